"""jaxddppo and Brax's PPO side by side on MuJoCo Playground tasks:
`python benchmarks/playground_peers.py [--tasks CartpoleBalance,CheetahRun] [--repeats 3] [--out FILE]`.

Runs in the peer's virtual environment (brax 0.14.2 and playground 0.2.0 need jax <= 0.9;
benchmarks/README.md has the recipe), which also holds this checkout (`pip install -e .`): both
contenders train with the same interpreter, the same JAX and the same MJX, in pure JAX on the CPU.

For each task both contenders train the same sizes and hyperparameters (`TASKS`), each trial a
fresh process, alternating jaxddppo, Brax, jaxddppo, Brax ... over `--repeats` rounds; round r
trains seed r on both sides. Each takes the CPU devices its command takes by default: Brax one
(JAX's default), jaxddppo one per core as its sizes allow (`--jaxddppo-cpu-devices N` sets
jaxddppo's `run.cpu_devices`, 1 for the same device as Brax).

  jaxddppo  `python -m jaxddppo.train --config <generated YAML>` with this checkout first on
            PYTHONPATH; steady-state steps/s from metrics.jsonl after the first chunk of updates
            (bench.py's `steady_state`), the return from summary.json's final evaluation
  Brax      benchmarks/brax_peer.py: `brax.training.agents.ppo.train` on the task through
            Playground's `wrap_for_brax_training`; steady-state steps/s from Brax's own progress
            reports after its first two training calls (both compile), evaluations excluded, the
            return from its last evaluation

Both evaluate the final policy deterministically (the Gaussian's mean) on `eval_episodes`
episodes of the task's full length. The table reports, per task, the medians of each side and
the median of the per-round ratios jaxddppo / Brax of steps/s, and the evaluation returns at the
same env steps. What differs between the two, and cannot be set alike, is listed in
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import yaml
from bench import (
    CPU_DEVICE_COUNT_FLAG,
    EXIT_BAD_ARGUMENTS,
    EXIT_TRIAL_FAILED,
    REPO_ROOT,
    BenchError,
    OneLineParser,
    cpu_description,
    importing,
    machine_description,
    names,
    output_tail,
    read_cpuinfo,
    revision,
    run_process,
    steady_state,
    versions_of,
)

from jaxddppo.config.options import START_STATES

BENCHMARKS_DIR = Path(__file__).resolve().parent
BRAX_PEER_SCRIPT = BENCHMARKS_DIR / "brax_peer.py"
CONTENDERS = ("jaxddppo", "brax")

# The hyperparameters both contenders take. Sizes: one update is one rollout of num_envs x
# num_steps env steps, num_epochs passes of num_minibatches minibatches over it. Rewards enter the
# loss unscaled on both sides (jaxddppo's env.scale_rewards divides by a running standard deviation,
# Brax's reward_scaling multiplies by a constant: 1 is the only setting they share); gradients are
# clipped to the same global norm; the learning rate is constant (Brax has no linear annealing).
COMMON: dict[str, Any] = {
    "num_envs": 256,
    "num_steps": 32,
    "num_minibatches": 8,
    "num_epochs": 4,
    "hidden_sizes": [32, 32],
    "activation": "tanh",
    "learning_rate": 1e-3,
    "gamma": 0.995,
    "gae_lambda": 0.95,
    "clip_eps": 0.2,
    "vf_coef": 0.5,
    "ent_coef": 0.0,
    "max_grad_norm": 0.5,
    "normalize_observations": True,
    "eval_episodes": 128,
    # Brax trains in num_evals - 1 compiled calls (brax_peer.py): 4 calls, the last 2 timed.
    "brax_num_evals": 5,
}
TASKS: dict[str, dict[str, Any]] = {
    # experiments/playground_cartpole.yaml's sizes and budget (3e6 steps, rounded to 4 x 96 updates).
    "CartpoleBalance": {**COMMON, "total_env_steps": 3_145_728},
    # The same sizes with Brax's DM Control entropy cost (mujoco_playground's dm_control_suite_params),
    # 40 updates and 32 evaluation episodes (an evaluation is 1,000 physics-heavy steps per episode):
    # the budget is set by the time the whole default run takes on a 2-core CPU, mostly compiling. A
    # start, not a trained cheetah (Playground trains it for 6e7 steps).
    "CheetahRun": {**COMMON, "ent_coef": 0.01, "eval_episodes": 32, "total_env_steps": 327_680},
}
DEFAULT_TASKS = tuple(TASKS)
PACKAGES = ("jax", "jaxlib", "brax", "playground", "mujoco", "mujoco-mjx", "flax", "optax")
# Backend-compile seconds inside Brax's steady state above which the driver warns (brax_peer.py).
STEADY_COMPILE_WARNING_SECONDS = 1.0


def update_steps(spec: Mapping[str, Any]) -> int:
    return spec["num_envs"] * spec["num_steps"]


def step_quantum(spec: Mapping[str, Any]) -> int:
    """Env steps both contenders can train exactly: whole updates, split evenly over Brax's
    num_evals - 1 training calls."""
    return update_steps(spec) * (spec["brax_num_evals"] - 1)


def with_total(spec: Mapping[str, Any], total: int) -> dict[str, Any]:
    """`spec` training at least `total` env steps, rounded up to a whole number of `step_quantum`s."""
    quantum = step_quantum(spec)
    return {**spec, "total_env_steps": -(-total // quantum) * quantum}


# ---------------------------------------------------------------- one trial


def jaxddppo_config(task: str, spec: Mapping[str, Any], seed: int, run_dir: Path) -> dict[str, Any]:
    """The jaxddppo config of a task's spec: no checkpoints in between, no progress output, the
    final evaluation only."""
    return {
        "env": {"id": f"playground:{task}", "num_envs": spec["num_envs"],
                "normalize_observations": spec["normalize_observations"], "scale_rewards": False,
                "start_states": spec.get("start_states", "fresh")},
        "network": {"hidden_sizes": list(spec["hidden_sizes"]), "activation": spec["activation"],
                    "actor_hidden_sizes": spec.get("policy_hidden_sizes")},
        "ppo": {
            "num_steps": spec["num_steps"], "num_epochs": spec["num_epochs"],
            "num_minibatches": spec["num_minibatches"], "learning_rate": spec["learning_rate"],
            "anneal_lr": False, "gamma": spec["gamma"], "gae_lambda": spec["gae_lambda"],
            "clip_eps": spec["clip_eps"], "clip_value": False, "vf_coef": spec["vf_coef"],
            "ent_coef": spec["ent_coef"], "max_grad_norm": spec["max_grad_norm"],
            # Brax's Adam (optax's default epsilon).
            "adam_eps": 1e-8, "normalize_advantages": True,
        },
        "train": {"total_env_steps": spec["total_env_steps"], "seed": seed},
        "eval": {"num_episodes": spec["eval_episodes"]},
        "checkpoint": {"every_updates": 0, "every_seconds": 0},
        "run": {"dir": str(run_dir), "progress": False, "cpu_devices": spec.get("cpu_devices", 0)},
    }


def brax_arguments(task: str, spec: Mapping[str, Any], seed: int, out: Path) -> list[str]:
    """brax_peer.py's arguments for a task's spec."""
    return [
        "--task", task, "--num-envs", str(spec["num_envs"]), "--unroll-length", str(spec["num_steps"]),
        "--num-minibatches", str(spec["num_minibatches"]), "--epochs", str(spec["num_epochs"]),
        "--hidden-sizes", ",".join(str(size) for size in spec["hidden_sizes"]),
        "--activation", spec["activation"], "--learning-rate", repr(spec["learning_rate"]),
        "--discounting", repr(spec["gamma"]), "--gae-lambda", repr(spec["gae_lambda"]),
        "--clip-eps", repr(spec["clip_eps"]), "--entropy-cost", repr(spec["ent_coef"]),
        "--vf-coef", repr(spec["vf_coef"]), "--max-grad-norm", repr(spec["max_grad_norm"]),
        "--reward-scaling", "1.0",
        "--normalize-observations" if spec["normalize_observations"] else "--no-normalize-observations",
        "--total-env-steps", str(spec["total_env_steps"]), "--num-evals", str(spec["brax_num_evals"]),
        "--eval-episodes", str(spec["eval_episodes"]), "--seed", str(seed), "--out", str(out),
    ]


def trial_command(contender: str, task: str, spec: Mapping[str, Any], seed: int, scratch: Path) -> list[str]:
    """The command line of a trial run in `scratch` (a config file is written there for jaxddppo)."""
    if contender == "jaxddppo":
        config_path = scratch / "config.yaml"
        config_path.write_text(yaml.safe_dump(jaxddppo_config(task, spec, seed, scratch / "run")))
        return [sys.executable, "-m", "jaxddppo.train", "--config", str(config_path)]
    return [sys.executable, str(BRAX_PEER_SCRIPT)] + brax_arguments(task, spec, seed, scratch / "result.json")


def trial_environment(contender: str, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a trial: XLA's default thread pool (no PJRT_NPROC or NPROC inherited), this
    checkout first on PYTHONPATH, and the CPU devices each command takes by default: one for
    Brax, jaxddppo's own choice (no device count in XLA_FLAGS: `run.cpu_devices` decides)."""
    env = {key: value for key, value in environ.items() if key not in ("PJRT_NPROC", "NPROC")}
    flags = [flag for flag in env.get("XLA_FLAGS", "").split() if not flag.startswith(CPU_DEVICE_COUNT_FLAG)]
    if contender == "brax":
        flags.append(f"{CPU_DEVICE_COUNT_FLAG}=1")
    env["XLA_FLAGS"] = " ".join(flags)
    return importing(REPO_ROOT, env)


def jaxddppo_result(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    steady_steps, steady_seconds = steady_state(run_dir / "metrics.jsonl", 1)
    return {"env_steps": summary["total_env_steps"], "steady_env_steps": steady_steps,
            "steady_seconds": steady_seconds, "compile_seconds": summary["compile_seconds"],
            "eval_return": summary["eval_return_mean"], "devices": summary["num_devices"]}


def brax_result(path: Path) -> dict[str, Any]:
    outcome = json.loads(path.read_text())
    keys = ("env_steps", "steady_env_steps", "steady_seconds", "compile_seconds", "steady_compile_seconds",
            "warmup_extra_seconds", "eval_seconds", "eval_return", "eval_return_std")
    return {key: outcome[key] for key in keys}


def run_trial(contender: str, task: str, spec: Mapping[str, Any], seed: int, timeout: float) -> dict[str, Any]:
    """One measurement, in a fresh subprocess with its own scratch directory."""
    label = f"{contender} {task} seed {seed}"
    with tempfile.TemporaryDirectory(prefix="jaxddppo-playground-") as name:
        scratch = Path(name)
        command = trial_command(contender, task, spec, seed, scratch)
        start = time.perf_counter()
        finished = run_process(command, trial_environment(contender, os.environ), scratch, timeout)
        wall_seconds = time.perf_counter() - start
        if finished.timed_out:
            raise BenchError(f"{label}: no result within {timeout:.0f} s")
        if finished.exit_code != 0:
            raise BenchError(f"{label}: exit code {finished.exit_code}\n{output_tail(scratch / 'output.txt')}")
        result = jaxddppo_result(scratch / "run") if contender == "jaxddppo" else brax_result(scratch / "result.json")
    result["seed"] = seed
    result["steps_per_second"] = result["steady_env_steps"] / result["steady_seconds"]
    result["peak_rss_mb"] = finished.peak_rss_mb
    result["wall_seconds"] = wall_seconds
    return result


# ---------------------------------------------------------------- rounds and the table


Key = tuple[str, str]  # (task, contender)


def measure(tasks: Sequence[str], repeats: int, run: Callable[[str, str, int], dict[str, Any]]
            ) -> dict[Key, list[dict[str, Any]]]:
    """Round r runs, for each task in turn, jaxddppo then Brax on seed r; each (task, contender)'s
    results in round order. Prints one line per trial."""
    measurements: dict[Key, list[dict[str, Any]]] = {(task, c): [] for task in tasks for c in CONTENDERS}
    for round_index in range(repeats):
        for task in tasks:
            for contender in CONTENDERS:
                result = run(contender, task, round_index)
                measurements[task, contender].append(result)
                print(f"round {round_index + 1}/{repeats} {contender} {task}: {result['steps_per_second']:,.0f} "
                      f"steps/s, eval return {result['eval_return']:.1f} after {result['env_steps']:,} steps, "
                      f"{result['wall_seconds']:.0f} s", flush=True)
                if result.get("steady_compile_seconds", 0.0) > STEADY_COMPILE_WARNING_SECONDS:
                    print(f"warning: {result['steady_compile_seconds']:.1f} s of XLA compiles inside Brax's steady "
                          "state: its steps/s are too low", flush=True)
    return measurements


def summarise(tasks: Sequence[str], measurements: Mapping[Key, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per task: each contender's medians over the rounds (steps/s, evaluation return, env
    steps, wall seconds), the per-round ratios jaxddppo / Brax of steps/s and their median."""
    table = []
    for task in tasks:
        ours, brax = measurements[task, "jaxddppo"], measurements[task, "brax"]
        row: dict[str, Any] = {"task": task}
        for contender, results in (("jaxddppo", ours), ("brax", brax)):
            for key in ("steps_per_second", "eval_return", "env_steps", "wall_seconds"):
                row[f"{contender}_{key}"] = statistics.median(result[key] for result in results)
            row[f"{contender}_eval_returns"] = [result["eval_return"] for result in results]
        row["jaxddppo_devices"] = max(result["devices"] for result in ours)
        row["round_ratios"] = [a["steps_per_second"] / b["steps_per_second"] for a, b in zip(ours, brax, strict=True)]
        row["steps_per_second_ratio"] = statistics.median(row["round_ratios"])
        table.append(row)
    return table


def format_table(table: Sequence[dict[str, Any]]) -> str:
    lines = ["| task | env steps | jaxddppo devices | jaxddppo steps/s | Brax steps/s | jaxddppo / Brax | "
             "jaxddppo eval return | Brax eval return | jaxddppo wall s | Brax wall s |",
             "|" + "---|" * 10]
    for row in table:
        steps = f"{row['jaxddppo_env_steps']:,.0f}"
        if row["brax_env_steps"] != row["jaxddppo_env_steps"]:
            steps += f" / {row['brax_env_steps']:,.0f}"
        lines.append(
            f"| {row['task']} | {steps} | {row['jaxddppo_devices']} | {row['jaxddppo_steps_per_second']:,.0f} | "
            f"{row['brax_steps_per_second']:,.0f} | {row['steps_per_second_ratio']:.2f} | "
            f"{row['jaxddppo_eval_return']:.1f} | {row['brax_eval_return']:.1f} | "
            f"{row['jaxddppo_wall_seconds']:.0f} | {row['brax_wall_seconds']:.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the record of a run


def build_report(specs: Mapping[str, dict[str, Any]], repeats: int, measurements: Mapping[Key, list[dict[str, Any]]],
                 table: Sequence[dict[str, Any]], command: str, cpu: dict[str, Any]) -> dict[str, Any]:
    return {
        "command": command,
        "machine": machine_description(cpu),
        "versions": versions_of(PACKAGES),
        "jaxddppo": {"path": str(REPO_ROOT), "revision": revision(REPO_ROOT)},
        "configs": {task: {"spec": spec, "jaxddppo": jaxddppo_config(task, spec, 0, Path("RUN_DIR")),
                           "brax_peer": brax_arguments(task, spec, 0, Path("RESULT"))}
                    for task, spec in specs.items()},
        "repeats": repeats,
        "table": list(table),
        "measurements": [{"task": task, "contender": contender, "results": results}
                         for (task, contender), results in measurements.items()],
    }


# ---------------------------------------------------------------- the command line


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python benchmarks/playground_peers.py",
        description="jaxddppo and Brax PPO side by side on MuJoCo Playground tasks, alternating over the rounds; "
        "the table reports medians and the median of the per-round ratios of steps/s. Run it in the peer's "
        f"virtual environment (benchmarks/README.md). Exit codes: 0 done, {EXIT_TRIAL_FAILED} a trial failed, "
        f"{EXIT_BAD_ARGUMENTS} bad arguments or brax missing.",
    )
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                        help=f"comma-separated tasks of {', '.join(TASKS)} (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of alternating trials (default 3)")
    parser.add_argument("--total-env-steps", type=int, metavar="N",
                        help="override every task's env steps (rounded up to whole updates, split evenly over "
                        "Brax's training calls), e.g. for a quick check")
    parser.add_argument("--start-states", choices=START_STATES, default="fresh",
                        help="jaxddppo's env.start_states (default fresh; first restarts as Brax does)")
    parser.add_argument("--jaxddppo-cpu-devices", type=int, default=0, metavar="N",
                        help="jaxddppo's run.cpu_devices (default 0: the train command's own choice, one device per "
                        "core as its sizes allow; 1: one device, as Brax)")
    parser.add_argument("--out", metavar="FILE", help="write the raw measurements and the table as JSON to FILE")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed per trial (default 1200)")
    args = parser.parse_args(argv)
    args.tasks = names(args.tasks)
    problem = argument_problem(args)
    if problem:
        parser.error(problem)
    return args


def argument_problem(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the parsed arguments, in one line; None if nothing."""
    unknown = [task for task in args.tasks if task not in TASKS]
    if unknown or not args.tasks:
        return f"--tasks={','.join(unknown) or '(none)'} is not a task; choose from {', '.join(TASKS)}"
    if len(set(args.tasks)) != len(args.tasks):
        return f"--tasks={','.join(args.tasks)} names a task twice"
    if args.repeats < 1:
        return f"--repeats={args.repeats} must be at least 1"
    if args.total_env_steps is not None and args.total_env_steps < 1:
        return f"--total-env-steps={args.total_env_steps} must be at least 1"
    if args.timeout <= 0:
        return f"--timeout={args.timeout} must be positive"
    if args.jaxddppo_cpu_devices < 0:
        return f"--jaxddppo-cpu-devices={args.jaxddppo_cpu_devices} must be 0 (the command's choice) or more"
    return None


def task_specs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    total = args.total_env_steps
    return {task: {**with_total(TASKS[task], total if total is not None else TASKS[task]["total_env_steps"]),
                   "start_states": args.start_states, "cpu_devices": args.jaxddppo_cpu_devices}
            for task in args.tasks}


def missing_peer() -> Optional[str]:
    """The first of the peer's packages this interpreter cannot import; None if none."""
    for module in ("brax", "mujoco_playground"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    specs = task_specs(args)
    missing = missing_peer()
    if missing:
        print(f"error: {missing} is not installed for {sys.executable}; run this script in the peer's virtual "
              "environment (benchmarks/README.md)", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    cpu = cpu_description(read_cpuinfo())
    budgets = ", ".join(f"{task} {spec['total_env_steps']:,} steps" for task, spec in specs.items())
    print(f"machine: {cpu['cpu_model'] or 'CPU model unknown'}, {os.cpu_count()} CPUs; {budgets}", flush=True)
    start = time.perf_counter()
    try:
        measurements = measure(args.tasks, args.repeats,
                               lambda contender, task, seed: run_trial(contender, task, specs[task], seed, args.timeout))
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_TRIAL_FAILED
    table = summarise(args.tasks, measurements)
    print(format_table(table))
    print(f"{args.repeats} round(s) in {time.perf_counter() - start:.0f} s")
    if args.out:
        command = "python benchmarks/playground_peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "w") as handle:
            json.dump(build_report(specs, args.repeats, measurements, table, command, cpu), handle, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
