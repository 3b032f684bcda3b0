"""What the compilation cache saves: `python benchmarks/compile_cache.py [--cases A,B] [--rounds N] [--out FILE]`.

Each case is trained three times a round by `python -m jaxddppo.train` on its defaults (CPU
devices, tuning), each a fresh process: without a cache (`run.compilation_cache=off`), into an
empty cache (cold: every program compiled and written) and again (warm: every program loaded).
Reported per case, medians over the rounds: summary.json's compile seconds (tracing, lowering
and compiling or loading every program) and the process's wall seconds, start to exit.
Exit codes: 0 measured, 1 a run failed, 2 bad arguments.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (REPO_ROOT, OneLineParser, cpu_description, importing, machine_description,  # noqa: E402
                   read_cpuinfo, revision, run_process, versions_of)

EXPERIMENTS = REPO_ROOT / "experiments"
# name: (config, overrides): the README's first command, and two Playground tasks a few updates long.
CASES = {
    "cartpole": (EXPERIMENTS / "cartpole.yaml", []),
    "playground_cartpole": (EXPERIMENTS / "playground_cartpole.yaml", ["train.total_env_steps=65536"]),
    "cheetah_run": (EXPERIMENTS / "playground_cheetah_gpu.yaml",
                    ["env.num_envs=256", "train.total_env_steps=30720", "eval.every_updates=0", "eval.num_episodes=4"]),
}
RUNS = ("off", "cold", "warm")


def command(case: str, cache: Optional[Path], run_dir: Path) -> list[str]:
    """The train command of `case` with `cache` as run.compilation_cache (None: off)."""
    config, overrides = CASES[case]
    return [sys.executable, "-m", "jaxddppo.train", "--config", str(config), *overrides,
            f"run.compilation_cache={cache if cache is not None else 'off'}", "run.progress=false",
            f"run.dir={run_dir}"]


def train(case: str, cache: Optional[Path], scratch: Path, timeout: float) -> dict[str, float]:
    """One fresh training process: its compile seconds (summary.json) and wall seconds."""
    scratch.mkdir(parents=True)
    start = time.perf_counter()
    finished = run_process(command(case, cache, scratch / "run"), importing(REPO_ROOT, os.environ), scratch, timeout)
    wall = time.perf_counter() - start
    if finished.exit_code != 0:
        raise RuntimeError(f"{case}: exit code {finished.exit_code}:\n{(scratch / 'output.txt').read_text()[-2000:]}")
    summary = json.loads((scratch / "run" / "summary.json").read_text())
    return {"compile_seconds": summary["compile_seconds"], "wall_seconds": wall}


def one_round(case: str, timeout: float) -> dict[str, dict[str, float]]:
    """The three runs of `case`, off, cold and warm, the last two on one new cache."""
    with tempfile.TemporaryDirectory(prefix="jaxddppo-compile-cache-") as name:
        scratch = Path(name)
        cache = scratch / "cache"
        return {run: train(case, None if run == "off" else cache, scratch / run, timeout) for run in RUNS}


def summarise(measurements: dict[str, list[dict[str, dict[str, float]]]]) -> list[dict[str, Any]]:
    """A row per case: each run's median compile and wall seconds, and warm / off per round."""
    table = []
    for case, rounds in measurements.items():
        row: dict[str, Any] = {"case": case}
        for run in RUNS:
            for measure in ("compile_seconds", "wall_seconds"):
                row[f"{run}_{measure}"] = statistics.median(one[run][measure] for one in rounds)
        row["warm_over_off_compile"] = [one["warm"]["compile_seconds"] / one["off"]["compile_seconds"]
                                        for one in rounds]
        table.append(row)
    return table


def format_table(table: Sequence[dict[str, Any]]) -> str:
    lines = ["| case | compile s: off | cold | warm | warm / off (per round) | wall s: off | cold | warm |",
             "|---|---|---|---|---|---|---|---|"]
    for row in table:
        ratios = row["warm_over_off_compile"]
        lines.append(
            f"| {row['case']} | {row['off_compile_seconds']:.1f} | {row['cold_compile_seconds']:.1f} | "
            f"{row['warm_compile_seconds']:.1f} | {statistics.median(ratios):.2f} "
            f"({', '.join(f'{ratio:.2f}' for ratio in ratios)}) | {row['off_wall_seconds']:.1f} | "
            f"{row['cold_wall_seconds']:.1f} | {row['warm_wall_seconds']:.1f} |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(prog="python benchmarks/compile_cache.py",
                           description="Compile seconds of the train command without, into and from its "
                           "compilation cache.")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the cases (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take (default 900)")
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args(argv)
    unknown = [case for case in args.cases.split(",") if case not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; cases: {', '.join(CASES)}")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cases = args.cases.split(",")
    measurements: dict[str, list] = {case: [] for case in cases}
    try:
        for round_index in range(args.rounds):
            for case in cases:
                measurements[case].append(one_round(case, args.timeout))
                print(f"round {round_index + 1}, {case}: {json.dumps(measurements[case][-1])}", flush=True)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    table = summarise(measurements)
    print(format_table(table))
    if args.out is not None:
        arguments = sys.argv[1:] if argv is None else argv
        report = {"command": " ".join(["python benchmarks/compile_cache.py", *arguments]),
                  "machine": machine_description(cpu_description(read_cpuinfo())),
                  "versions": versions_of(("jax", "jaxlib", "mujoco-mjx", "playground")),
                  "revision": revision(REPO_ROOT),
                  "cases": {case: [str(CASES[case][0].relative_to(REPO_ROOT)), *CASES[case][1]] for case in cases},
                  "measurements": measurements, "table": table}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
