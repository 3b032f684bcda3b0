"""The price of checkpoint digests: `python benchmarks/checkpoint_cost.py --baseline PATH
[--rounds N] [--out FILE]`, with PATH a checkout of jaxddppo from before checkpoints recorded
digests (commit 417bc16's first parent, for instance).

Both checkouts train the large config of benchmarks/bench.py (2048 CartPole environments,
20 updates) with a checkpoint after every chunk of 2 updates, then resume from the newest
checkpoint and train one more chunk. Every run is a fresh process; the contenders take turns
(A B A B ...), and each ratio is the median of the per-round ratios. What it reports:

  steps/s     steady state (after the first chunk), saves included: this checkout takes a
              digest of the whole state before each save
  resume s    the resume's wall time, start to exit (start-up, restore, compile, one chunk):
              this checkout reads the digest back and checks the restored state against it
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

UPDATES_PER_CHUNK = 2
CONTENDERS = ("jaxddppo", "baseline")


def run_config(run_dir: Path) -> dict[str, Any]:
    spec = bench.CONFIGS["large"]
    config = bench.jaxddppo_config(spec, run_dir)
    config["train"]["updates_per_chunk"] = UPDATES_PER_CHUNK
    config["checkpoint"] = {"every_updates": UPDATES_PER_CHUNK, "every_seconds": 0}
    return config


def one_round(contender: str, checkout: Path, timeout: float) -> dict[str, float]:
    """Train with a checkpoint every chunk, then resume for one more chunk; both fresh processes."""
    with tempfile.TemporaryDirectory(prefix="jaxddppo-checkpoint-cost-") as name:
        scratch = Path(name)
        config = run_config(scratch / "run")
        (scratch / "config.yaml").write_text(yaml.safe_dump(config))
        env = bench.trial_environment(bench.Trial(contender, "large"), os.environ, checkout)
        train = [sys.executable, "-m", "jaxddppo.train", "--config", str(scratch / "config.yaml")]
        finished = bench.run_process(train, env, scratch, timeout)
        check(finished, contender, "training", scratch)
        steps, seconds = bench.steady_state(scratch / "run" / "metrics.jsonl", 1)
        longer = config["train"]["total_env_steps"] + UPDATES_PER_CHUNK * bench.CONFIGS["large"]["num_envs"] * \
            bench.CONFIGS["large"]["num_steps"]
        resume = [sys.executable, "-m", "jaxddppo.train", "--resume", str(scratch / "run"),
                  f"train.total_env_steps={longer}"]
        start = time.perf_counter()
        finished = bench.run_process(resume, env, scratch, timeout)
        resume_seconds = time.perf_counter() - start
        check(finished, contender, "resume", scratch)
        return {"steps_per_second": steps / seconds, "resume_seconds": resume_seconds}


def check(finished: bench.Finished, contender: str, what: str, scratch: Path) -> None:
    if finished.timed_out or finished.exit_code != 0:
        tail = bench.output_tail(scratch / "output.txt")
        raise bench.BenchError(f"{contender} {what}: exit code {finished.exit_code}\n{tail}")


def summarise(results: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    ours, theirs = results["jaxddppo"], results["baseline"]
    table: dict[str, Any] = {}
    for key in ("steps_per_second", "resume_seconds"):
        ratios = [a[key] / b[key] for a, b in zip(ours, theirs, strict=True)]
        table[key] = {"jaxddppo": statistics.median(r[key] for r in ours),
                      "baseline": statistics.median(r[key] for r in theirs),
                      "round_ratios": ratios, "ratio": statistics.median(ratios)}
    return table


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = bench.OneLineParser(prog="python benchmarks/checkpoint_cost.py", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, metavar="PATH",
                        help="a checkout of jaxddppo from before checkpoint digests")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of alternating runs (default 5)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per process (default 1800)")
    parser.add_argument("--out", metavar="FILE", help="write the measurements and ratios as JSON to FILE")
    args = parser.parse_args(argv)
    if not (args.baseline / "jaxddppo").is_dir():
        parser.error(f"--baseline {args.baseline} is not a checkout of jaxddppo (no jaxddppo/ in it)")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    checkouts = {"jaxddppo": bench.REPO_ROOT, "baseline": args.baseline.resolve()}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    try:
        for round_index in range(args.rounds):
            for contender in CONTENDERS:
                result = one_round(contender, checkouts[contender], args.timeout)
                results[contender].append(result)
                print(f"round {round_index + 1}/{args.rounds} {contender}: {result['steps_per_second']:,.0f} steps/s, "
                      f"resume {result['resume_seconds']:.1f} s", flush=True)
    except bench.BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return bench.EXIT_TRIAL_FAILED
    table = summarise(results)
    for key, label in (("steps_per_second", "steps/s"), ("resume_seconds", "resume s")):
        row = table[key]
        rounds = ", ".join(f"{ratio:.3f}" for ratio in row["round_ratios"])
        print(f"{label}: this {row['jaxddppo']:,.1f}, baseline {row['baseline']:,.1f}, "
              f"ratio {row['ratio']:.3f} (rounds {rounds})")
    if args.out:
        record = {"command": " ".join(["python", "benchmarks/checkpoint_cost.py", *sys.argv[1:]]),
                  "machine": bench.machine_description(bench.cpu_description(bench.read_cpuinfo())),
                  "versions": bench.package_versions(),
                  "sources": {name: {"path": str(path), "revision": bench.revision(path)}
                              for name, path in checkouts.items()},
                  "config": run_config(Path("RUN_DIR")), "table": table, "measurements": results}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
