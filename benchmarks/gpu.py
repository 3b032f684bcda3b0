"""The GPU suite: `python benchmarks/gpu.py [--out-dir DIR] [--budget-seconds S] [--quick]`.

One command for the first minutes a GPU is available. In order, each step a fresh
process, each result written as soon as it is measured:

  rates     playground:CheetahRun and playground:CartpoleBalance, 2048 environments: the
            core's own stepping rate and `BatchedEnv`'s (benchmarks/env_rates.py), over two
            episodes of each
  train     both tasks trained by `python -m jaxddppo.train` (CheetahRun with
            experiments/playground_cheetah_gpu.yaml, CartpoleBalance with
            experiments/playground_cartpole.yaml at 2048 environments): steady-state steps/s
            (after the first chunk), compile seconds, the final evaluation's return
  cartpole  experiments/cartpole.yaml at 2048 environments x 128 steps, 1 and 4 shards on the
            one device, each with train.exact_reductions true and false

DIR/gpu.json holds the device, driver, package versions, every measurement and the
markdown table that DIR/gpu.md holds. A step that fails or would start past the budget is
recorded as such and the suite goes on. `--quick` shrinks every size (a check on any
machine, CPU included). Exit codes: 0 every step measured, 1 some step failed or was skipped,
2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from bench import (OneLineParser, REPO_ROOT, env_rates_command, importing, output_tail, run_process, steady_state,
                   versions_of)

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "mujoco", "mujoco-mjx",
            "playground", "warp-lang", "gymnax")
PLAYGROUND_TASKS = ("CheetahRun", "CartpoleBalance")
EXPERIMENTS = REPO_ROOT / "experiments"
# Each training run: the config, its overrides (full size, --quick).
TRAINING = {
    "CheetahRun": (EXPERIMENTS / "playground_cheetah_gpu.yaml",
                   ["train.updates_per_chunk=5", "train.total_env_steps=2457600", "eval.num_episodes=16"],
                   ["env.num_envs=16", "ppo.num_steps=8", "train.updates_per_chunk=2", "train.total_env_steps=512",
                    "network.hidden_sizes=[16]", "eval.num_episodes=2"]),
    "CartpoleBalance": (EXPERIMENTS / "playground_cartpole.yaml",
                        ["env.num_envs=2048", "train.updates_per_chunk=10", "train.total_env_steps=2621440",
                         "eval.num_episodes=16"],
                        ["env.num_envs=16", "ppo.num_steps=8", "train.updates_per_chunk=2",
                         "train.total_env_steps=512", "eval.num_episodes=2"]),
}
CARTPOLE_LARGE = ["env.num_envs=2048", "ppo.num_steps=128", "ppo.num_epochs=4", "ppo.num_minibatches=4",
                  "train.updates_per_chunk=20", "train.total_env_steps=20971520", "run.cpu_threads=0"]
CARTPOLE_QUICK = ["env.num_envs=64", "ppo.num_steps=8", "ppo.num_minibatches=4", "train.updates_per_chunk=2",
                  "train.total_env_steps=4096", "run.cpu_threads=0"]
RATE_SIZES = {"full": (2048, 50), "quick": (64, 10)}
# env_rates.py's contenders here: on one H200, BatchedEnv vmapped in 4 groups kept the core's rate
# as one batch did (CheetahRun 0.81 both ways, CartpoleBalance 0.60), at a minute's more compiling.
RATE_CONTENDERS = ("core", "batch")


def step_plan(quick: bool) -> list[dict[str, Any]]:
    """The suite's steps, in order: what each runs and how its result is named."""
    steps: list[dict[str, Any]] = []
    num_envs, num_steps = RATE_SIZES["quick" if quick else "full"]
    for task in PLAYGROUND_TASKS:
        steps.append({"kind": "rates", "name": f"rates {task}", "env_id": f"playground:{task}",
                      "num_envs": num_envs, "num_steps": num_steps, "steps_per_env": 40 if quick else 0})
        config, full, small = TRAINING[task]
        steps.append({"kind": "train", "name": f"train {task}", "config": str(config),
                      "overrides": small if quick else full})
    for num_shards in (1, 4):
        for exact in (True, False):
            steps.append({"kind": "train", "name": f"cartpole {num_shards} shard(s) exact={str(exact).lower()}",
                          "config": str(EXPERIMENTS / "cartpole.yaml"),
                          "overrides": (CARTPOLE_QUICK if quick else CARTPOLE_LARGE)
                          + [f"train.num_shards={num_shards}", f"train.exact_reductions={str(exact).lower()}"]})
    return steps


def python_environment() -> dict[str, str]:
    environ = importing(REPO_ROOT, os.environ)
    environ.setdefault("PYTHONUNBUFFERED", "1")
    return environ


def run_rates(step: dict[str, Any], scratch: Path, timeout: float) -> dict[str, Any]:
    out = scratch / "rates.json"
    command = env_rates_command(step["env_id"], step["num_envs"], step["num_steps"], out,
                                steps_per_env=step["steps_per_env"], contenders=RATE_CONTENDERS)
    finished = run_process(command, python_environment(), scratch, timeout)
    if finished.exit_code != 0:
        raise RuntimeError(_failure(finished, scratch))
    return json.loads(out.read_text())


def run_training(step: dict[str, Any], scratch: Path, timeout: float) -> dict[str, Any]:
    run_dir = scratch / "run"
    command = [sys.executable, "-m", "jaxddppo.train", "--config", step["config"], *step["overrides"],
               f"run.dir={run_dir}", "run.progress=false", "checkpoint.every_updates=0",
               "checkpoint.every_seconds=0", "eval.every_updates=0"]
    finished = run_process(command, python_environment(), scratch, timeout)
    if finished.exit_code != 0:
        raise RuntimeError(_failure(finished, scratch))
    summary = json.loads((run_dir / "summary.json").read_text())
    steps, seconds = steady_state(run_dir / "metrics.jsonl", 1)
    return {"steps_per_second": steps / seconds, "steady_env_steps": steps,
            "compile_seconds": summary["compile_seconds"], "train_seconds": summary["train_seconds"],
            "eval_return_mean": summary.get("eval_return_mean"),
            "command": " ".join(command[1:])}


def _failure(finished: Any, scratch: Path) -> str:
    reason = "timed out" if finished.timed_out else f"exit code {finished.exit_code}"
    return f"{reason}: {output_tail(scratch / 'output.txt', 8)}"


def device_description() -> dict[str, Any]:
    """The accelerator (JAX's view, nvidia-smi's where present) and package versions."""
    import jax

    description: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0],
                                   "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                                   "device_count": jax.device_count(), "driver": None}
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        if query.returncode == 0:
            description["driver"] = query.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    description["versions"] = versions_of(PACKAGES)
    return description


def format_table(results: Sequence[dict[str, Any]]) -> str:
    rates = [r for r in results if r["kind"] == "rates"]
    trains = [r for r in results if r["kind"] == "train"]
    lines = ["| env.id | envs | core steps/s | BatchedEnv | batch / core |", "|---|---|---|---|---|"]
    for row in rates:
        if "result" not in row:
            lines.append(f"| `{row['env_id']}` | {row['num_envs']} | {row['status']} | | |")
            continue
        rate = row["result"]["steps_per_second"]
        lines.append(f"| `{row['env_id']}` | {row['num_envs']} | {rate['core']:,.0f} | {rate['batch']:,.0f} | "
                     f"{row['result']['batch_over_core']:.2f} |")
    core = {row["name"].split()[-1]: row["result"]["steps_per_second"]["core"] for row in rates if "result" in row}
    lines += ["", "| training | steps/s | train / core | compile s | eval return |", "|---|---|---|---|---|"]
    for row in trains:
        if "result" not in row:
            lines.append(f"| {row['name']} | {row['status']} | | | |")
            continue
        result, task = row["result"], row["name"].split()[-1]
        ratio = f"{result['steps_per_second'] / core[task]:.2f}" if task in core else ""
        eval_return = result["eval_return_mean"]
        lines.append(f"| {row['name']} | {result['steps_per_second']:,.0f} | {ratio} | "
                     f"{result['compile_seconds']:.1f} | {'' if eval_return is None else f'{eval_return:.1f}'} |")
    return "\n".join(lines)


def run_suite(out_dir: Path, budget_seconds: float, quick: bool, step_timeout: float,
              only: Sequence[str] = ()) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                              "device": device_description(), "quick": quick, "budget_seconds": budget_seconds,
                              "steps": []}
    print(json.dumps(report["device"]), flush=True)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="jaxddppo-gpu-") as root:
        plan = [step for step in step_plan(quick) if not only or any(part in step["name"] for part in only)]
        for index, step in enumerate(plan):
            row = dict(step)
            left = budget_seconds - (time.perf_counter() - started)
            if left <= 10:
                row["status"] = "skipped: budget spent"
                failures += 1
            else:
                scratch = Path(root) / str(index)
                scratch.mkdir()
                step_start = time.perf_counter()
                try:
                    run = run_rates if step["kind"] == "rates" else run_training
                    row["result"] = run(step, scratch, min(step_timeout, left))
                    row["status"] = "measured"
                except (RuntimeError, OSError, ValueError, KeyError) as error:
                    row["status"] = f"failed: {error}"
                    failures += 1
                row["wall_seconds"] = time.perf_counter() - step_start
            report["steps"].append(row)
            report["table"] = format_table(report["steps"])
            (out_dir / "gpu.json").write_text(json.dumps(report, indent=1))
            (out_dir / "gpu.md").write_text(report["table"] + "\n")
            print(f"{row['name']}: {row['status']} ({row.get('wall_seconds', 0):.0f} s)", flush=True)
    print(report["table"])
    return 1 if failures else 0


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(prog="python benchmarks/gpu.py", description=__doc__.split("\n\n")[1])
    parser.add_argument("--out-dir", default="gpu-results", help="where gpu.json and gpu.md go (default gpu-results)")
    parser.add_argument("--budget-seconds", type=float, default=480.0,
                        help="no step starts after this many seconds; a step's limit is what is left (default 480)")
    parser.add_argument("--step-timeout", type=float, default=300.0, help="seconds one step may run (default 300)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a check of the suite on any machine")
    parser.add_argument("--only", default="", help="comma-separated parts of step names: run only the steps "
                        "whose name contains one (e.g. cartpole,CheetahRun)")
    args = parser.parse_args(argv)
    if args.budget_seconds <= 0 or args.step_timeout <= 0:
        parser.error(f"--budget-seconds={args.budget_seconds} and --step-timeout={args.step_timeout} must be positive")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return run_suite(Path(args.out_dir), args.budget_seconds, args.quick, args.step_timeout,
                     [part for part in args.only.split(",") if part])


if __name__ == "__main__":
    sys.exit(main())
