"""Environment families: `python benchmarks/families.py CONFIG [CONFIG ...] [--out FILE]`.

For each experiment config (an `env.id` of any family, see docs/environments.md):

  core steps/s      the environment's own rate: its `env.num_envs` environments' core `step`
                    vmapped, with uniformly random (legal) actions, in one jitted `lax.scan`
                    of `ppo.num_steps` steps, no resets (benchmarks/env_rates.py)
  batch / core      the same steps through the trainer's auto-resetting `envs.BatchedEnv`
                    (`env.optimistic_reset_ratio` and `env.start_states` as configured),
                    and through it under `vmap` in 4 groups (as a batched sweep's members or a
                    device's batched shards step), against the core: what restarts and episode
                    statistics cost. Both in the core's process, alternating, each over two
                    episodes of the time limit (or `--steps-per-env` steps)
  train steps/s     `python -m jaxddppo.train` on the same config with `train.num_shards=2`,
                    on 1 and on 2 CPU devices (`run.cpu_devices`): steady state after the first
                    chunk of updates (as bench.py reads it), and its compile seconds; no
                    checkpoints, a final evaluation of 2 episodes only
  train / core      the share of the environment's own rate that training keeps

Every measurement is a fresh process; the rows of each config alternate over `--repeats`
rounds and the table reports medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

from bench import (
    EXIT_BAD_ARGUMENTS,
    EXIT_TRIAL_FAILED,
    REPO_ROOT,
    OneLineParser,
    cpu_description,
    env_rates_command,
    importing,
    machine_description,
    output_tail,
    read_cpuinfo,
    run_process,
    steady_state,
    versions_of,
)

from jaxddppo.config.files import load_config

DEVICE_COUNTS = (1, 2)
PACKAGES = ("jax", "jaxlib", "flax", "gymnax", "navix", "xminigrid", "jumanji", "craftax", "playground", "mujoco-mjx")
NUM_SHARDS = 2


def rates_command(config_path: str, steps_per_env: int, out: Path) -> list[str]:
    """env_rates.py's command line for the config's environments: its `env.num_envs`, scans
    of `ppo.num_steps`, its reset settings; `steps_per_env` 0: two episodes of the time limit."""
    config = load_config(config_path)
    return env_rates_command(config.env.id, config.env.num_envs, config.ppo.num_steps, out, steps_per_env,
                             config.env.optimistic_reset_ratio, config.env.start_states)


def run_rates(config_path: str, steps_per_env: int, scratch: Path, timeout: float) -> dict[str, Any]:
    out = scratch / "rates.json"
    finished = run_process(rates_command(config_path, steps_per_env, out), dict(os.environ), scratch, timeout)
    if finished.exit_code != 0:
        raise RuntimeError(f"stepping {config_path} failed:\n{output_tail(scratch / 'output.txt')}")
    return json.loads(out.read_text())


def run_training(config_path: str, devices: int, env_steps: Optional[int], scratch: Path,
                 timeout: float) -> dict[str, Any]:
    run_dir = scratch / "run"
    command = [sys.executable, "-m", "jaxddppo.train", "--config", config_path, f"run.dir={run_dir}",
               "run.progress=false", f"run.cpu_devices={devices}", f"train.num_shards={NUM_SHARDS}",
               "checkpoint.every_updates=0", "checkpoint.every_seconds=0", "eval.every_updates=0",
               "eval.num_episodes=2"]
    if env_steps:
        command.append(f"train.total_env_steps={env_steps}")
    environ = importing(REPO_ROOT, {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"})
    finished = run_process(command, environ, scratch, timeout)
    if finished.exit_code != 0:
        raise RuntimeError(f"training {config_path} on {devices} device(s) failed:\n"
                           f"{output_tail(scratch / 'output.txt')}")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps, seconds = steady_state(run_dir / "metrics.jsonl", 1)
    return {"steps_per_second": steps / seconds, "compile_seconds": summary["compile_seconds"]}


def measure(config_paths: Sequence[str], repeats: int, env_steps: Optional[int], steps_per_env: int,
            timeout: float) -> dict[str, Any]:
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        path: {"rates": [], **{f"train_{devices}": [] for devices in DEVICE_COUNTS}} for path in config_paths}
    with tempfile.TemporaryDirectory(prefix="jaxddppo-families-") as root:
        for round_index in range(repeats):
            for path in config_paths:
                for row in results[path]:
                    scratch = Path(root) / f"{round_index}-{Path(path).stem}-{row}"
                    scratch.mkdir()
                    if row == "rates":
                        result = run_rates(path, steps_per_env, scratch, timeout)
                        rate = result["steps_per_second"]["core"]
                    else:
                        result = run_training(path, int(row.split("_")[1]), env_steps, scratch, timeout)
                        rate = result["steps_per_second"]
                    results[path][row].append(result)
                    print(f"round {round_index + 1}/{repeats} {path} {row}: {rate:,.0f} steps/s",
                          file=sys.stderr, flush=True)
    return results


def median(results: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.median(result[key] for result in results)


def table_rows(config_paths: Sequence[str], results: dict[str, Any]) -> list[dict[str, Any]]:
    import yaml

    rows = []
    for path in config_paths:
        config = yaml.safe_load(Path(path).read_text())
        rates = results[path]["rates"]
        row = {"config": os.path.relpath(path, REPO_ROOT), "env_id": config["env"]["id"],
               "num_envs": rates[0]["num_envs"],
               "core_steps_per_second": statistics.median(rate["steps_per_second"]["core"] for rate in rates),
               "batch_over_core": median(rates, "batch_over_core"),
               "batch_vmapped_over_core": median(rates, "batch_vmapped_over_core")}
        for devices in DEVICE_COUNTS:
            trials = results[path][f"train_{devices}"]
            row[f"train_{devices}_steps_per_second"] = median(trials, "steps_per_second")
            row[f"train_{devices}_compile_seconds"] = median(trials, "compile_seconds")
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| env.id | envs | core steps/s | batch / core | vmapped / core | train steps/s, 1 device | 2 devices | "
             "train / core (1, 2) | compile s (1, 2) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        one, two, core = row["train_1_steps_per_second"], row["train_2_steps_per_second"], row["core_steps_per_second"]
        lines.append(f"| `{row['env_id']}` | {row['num_envs']} | {core:,.0f} | {row['batch_over_core']:.2f} | "
                     f"{row['batch_vmapped_over_core']:.2f} | {one:,.0f} | {two:,.0f} | "
                     f"{one / core:.2f}, {two / core:.2f} | "
                     f"{row['train_1_compile_seconds']:.0f}, {row['train_2_compile_seconds']:.0f} |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python benchmarks/families.py",
        description="Training steps/s of environment families on 1 and 2 CPU devices beside the environment's own "
        f"stepping rate and the trainer's batched one. Exit codes: 0 done, {EXIT_TRIAL_FAILED} a measurement failed, {EXIT_BAD_ARGUMENTS} "
        "bad arguments.")
    parser.add_argument("configs", nargs="+", help="experiment configs (YAML), e.g. experiments/navix_empty.yaml")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--env-steps", type=int, default=None,
                        help="train.total_env_steps of each training run (default: the config's)")
    parser.add_argument("--steps-per-env", type=int, default=0,
                        help="steps each environment takes per round of the rates (default: two episodes of the "
                        "time limit; Craftax's is 10,000)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a measurement may run (default 1800)")
    parser.add_argument("--out", help="write the machine, versions, table and every measurement as JSON")
    args = parser.parse_args(argv)
    for path in args.configs:
        if not Path(path).is_file():
            parser.error(f"config file not found: {path}")
    args.configs = [str(Path(path).resolve()) for path in args.configs]  # trials run in scratch directories
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be at least 1")
    if args.steps_per_env < 0:
        parser.error(f"--steps-per-env={args.steps_per_env} must be at least 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        results = measure(args.configs, args.repeats, args.env_steps, args.steps_per_env, args.timeout)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_TRIAL_FAILED
    rows = table_rows(args.configs, results)
    print(format_table(rows))
    if args.out:
        report = {"machine": machine_description(cpu_description(read_cpuinfo())), "versions": versions_of(PACKAGES),
                  "repeats": args.repeats, "env_steps": args.env_steps, "steps_per_env": args.steps_per_env,
                  "table": rows, "measurements": results}
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
