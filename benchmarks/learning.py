"""Learning side by side: `python benchmarks/learning.py --suite minatar|playground [--tasks A,B] [--seeds N]
[--total-env-steps N] [--purejaxrl PATH] --out DIR [--resume]`; `--report RECORD.json --out DIR` redraws without
training.

Each suite trains jaxddppo and its reference implementation with the same settings on each task, over
several seeds, each trial a fresh process with the compilation cache off; the trials alternate, jaxddppo
then the reference, task after task, seed after seed (seed r trains seed r on both sides).

  minatar     gymnax's MinAtar games with PureJaxRL's MinAtar settings (its examples/brax_minatar.ipynb),
              against PureJaxRL's own ppo.py, run unmodified (`--purejaxrl PATH`, through peers.py --curve).
              The curve: the mean return of the training episodes that ended in each update.
  playground  MuJoCo Playground's DM Control tasks with Playground's own Brax PPO settings
              (dm_control_suite_params), against Brax's PPO as Playground's notebooks call it
              (brax_peer.py --playground-settings); run it in the peer's virtual environment
              (benchmarks/README.md). The curve: the deterministic evaluations both make during training.

Every curve point has two abscissae: env steps, and seconds from the trial's process start (start-up,
imports and compiling included) to the point. jaxddppo: when its row appeared in metrics.jsonl (the
driver watches the file), the updates of one chunk spread evenly over the chunk's training seconds
before it. PureJaxRL trains in one compiled call: its updates spread evenly over that call, from the
process's age when the call started (a constant rate: the call reports nothing in between). Brax: the
process's age at each of its progress reports (after each training call and its evaluation).

The record (`--out DIR`: DIR/SUITE.json, written after every trial; `--resume` runs only the trials it
lacks) keeps the machine, the versions, the sources, every trial's command, config and raw outputs
(jaxddppo's metrics rows, the peer's result file) beside its curve; SUITE.png draws each task's median
curves and seed ranges, SUITE.md tabulates the final returns.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import yaml
from bench import (
    EXIT_BAD_ARGUMENTS,
    EXIT_TRIAL_FAILED,
    PEERS_SCRIPT,
    PUREJAXRL_URL,
    REPO_ROOT,
    BenchError,
    OneLineParser,
    cpu_description,
    machine_description,
    names,
    output_tail,
    read_cpuinfo,
    revision,
    run_process,
    versions_of,
)
from bench import jaxddppo_config as bench_jaxddppo_config
from playground_peers import BRAX_PEER_SCRIPT, trial_environment
from playground_peers import jaxddppo_config as playground_jaxddppo_config

# PureJaxRL's MinAtar settings (examples/brax_minatar.ipynb's config; its ppo.py flattens the
# [10, 10, C] image into separate 64x64 actor and critic MLPs, as network.torso=mlp does).
MINATAR_SETTINGS: dict[str, Any] = {
    "num_envs": 64,
    "num_steps": 128,
    "num_epochs": 4,
    "num_minibatches": 8,
    "torso": "mlp",
    "hidden_sizes": [64, 64],
    "activation": "relu",
    "learning_rate": 5e-3,
    "anneal_lr": True,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "clip_eps": 0.2,
    "vf_coef": 0.5,
    "ent_coef": 0.01,
    "max_grad_norm": 0.5,
    "total_env_steps": 10_000_000,
}
MINATAR_TASKS = ("Breakout-MinAtar", "Asterix-MinAtar", "Freeway-MinAtar", "SpaceInvaders-MinAtar")

# Playground 0.2.0's dm_control_suite_params.brax_ppo_config for these three tasks (none has a task
# override). Brax's update collects batch_size x num_minibatches trajectories of unroll_length steps:
# 983,040 steps, that is 480 steps of each of the 2,048 environments, the rollout jaxddppo takes.
PLAYGROUND_SETTINGS: dict[str, Any] = {
    "num_envs": 2048,
    "unroll_length": 30,
    "batch_size": 1024,
    "num_minibatches": 32,
    "num_epochs": 16,
    "learning_rate": 1e-3,
    "gamma": 0.995,
    "gae_lambda": 0.95,
    "clip_eps": 0.3,  # Brax's default clipping_epsilon
    "vf_coef": 0.5,  # Brax's default vf_loss_coefficient
    "ent_coef": 1e-2,
    "reward_scaling": 10.0,  # Brax only: jaxddppo has no constant reward scale
    "normalize_observations": True,
    "num_evals": 10,
    "eval_episodes": 128,  # Brax's default num_eval_envs
    # Brax's default networks: a 4 x 32 policy and a 5 x 256 value MLP, swish.
    "hidden_sizes": [256, 256, 256, 256, 256],
    "policy_hidden_sizes": [32, 32, 32, 32],
    "activation": "silu",
    # Brax clips no gradient; jaxddppo's largest threshold.
    "max_grad_norm": 1000.0,
    "normalize_advantages": True,
}
# Env steps per task: three updates of 983,040 steps, which keep a trial near 15-20 minutes on the
# 2-core CPU (benchmarks/README.md). Playground trains these tasks for 6e7 steps.
PLAYGROUND_TASKS: dict[str, int] = {"CartpoleBalance": 2_949_120, "CheetahRun": 2_949_120, "WalkerWalk": 2_949_120}
# The training episodes that make a MinAtar trial's final return: those of its last updates.
FINAL_UPDATES = 16
# Seconds between looks at a jaxddppo trial's metrics.jsonl.
WATCH_INTERVAL = 0.1
# Points of a median curve.
BAND_POINTS = 200
TRAINERS = {"minatar": ("jaxddppo", "purejaxrl"), "playground": ("jaxddppo", "brax")}
REFERENCE_NAMES = {"purejaxrl": "PureJaxRL", "brax": "Brax PPO", "jaxddppo": "jaxddppo"}
PACKAGES = ("jax", "jaxlib", "flax", "optax", "distrax", "gymnax", "brax", "playground", "mujoco", "mujoco-mjx",
            "matplotlib")


@dataclass(frozen=True)
class Suite:
    """Tasks, each with its settings (`spec`), seeds, and which curve the trainers are compared on:
    "training" (training episodes, every update) or "evaluation" (the periodic deterministic ones)."""

    name: str
    specs: Mapping[str, dict[str, Any]]
    seeds: int
    curve: str

    @property
    def reference(self) -> str:
        return TRAINERS[self.name][1]


def steps_per_update(spec: Mapping[str, Any]) -> int:
    return spec["num_envs"] * spec["num_steps"]


def minatar_spec(env_id: str, total_env_steps: int) -> dict[str, Any]:
    """The settings of one MinAtar task, trained for `total_env_steps` rounded down to whole updates
    (both trainers round down; at least one update)."""
    spec = {**MINATAR_SETTINGS, "env_id": env_id}
    updates = max(total_env_steps // steps_per_update(spec), 1)
    return {**spec, "total_env_steps": updates * steps_per_update(spec)}


def playground_spec(task: str, total_env_steps: int) -> dict[str, Any]:
    """The settings of one Playground task with its evaluations: at least `total_env_steps`, rounded up
    to whole updates split evenly between Brax's num_evals - 1 evaluation intervals (Playground's 10
    evaluations where the updates divide into 9 intervals, else one evaluation after every update)."""
    per_update = PLAYGROUND_SETTINGS["unroll_length"] * PLAYGROUND_SETTINGS["batch_size"] * \
        PLAYGROUND_SETTINGS["num_minibatches"]
    updates = max(-(-total_env_steps // per_update), 1)
    intervals = PLAYGROUND_SETTINGS["num_evals"] - 1
    if updates % intervals:
        intervals = updates
    return {**PLAYGROUND_SETTINGS, "task": task, "num_steps": per_update // PLAYGROUND_SETTINGS["num_envs"],
            "total_env_steps": updates * per_update, "num_evals": intervals + 1,
            "eval_every_updates": updates // intervals, "start_states": "fresh", "cpu_devices": 0}


def suite(name: str, tasks: Optional[Sequence[str]] = None, seeds: Optional[int] = None,
          total_env_steps: Optional[int] = None, cpu_devices: int = 0) -> Suite:
    """A suite with its defaults, or the tasks, seed count and env steps given; jaxddppo trains
    on `cpu_devices` CPU devices (`run.cpu_devices`; 0: the train command's own choice)."""
    if name == "minatar":
        specs = {task: minatar_spec(task, total_env_steps or MINATAR_SETTINGS["total_env_steps"])
                 for task in tasks or MINATAR_TASKS}
        default_seeds, curve = 3, "training"
    else:
        specs = {task: playground_spec(task, total_env_steps or PLAYGROUND_TASKS[task])
                 for task in tasks or PLAYGROUND_TASKS}
        default_seeds, curve = 2, "evaluation"
    return Suite(name, {task: {**spec, "cpu_devices": cpu_devices} for task, spec in specs.items()},
                 seeds or default_seeds, curve)


# ---------------------------------------------------------------- one trial


def jaxddppo_config(suite_name: str, spec: Mapping[str, Any], seed: int, run_dir: Path) -> dict[str, Any]:
    """The train command's config of a task's settings, the compilation cache off."""
    if suite_name == "minatar":
        config = bench_jaxddppo_config(spec, run_dir)
        config["train"]["seed"] = seed
    else:
        config = playground_jaxddppo_config(spec["task"], spec, seed, run_dir)
        # Brax recomputes advantages in every minibatch of unroll_length-step trajectories.
        config["ppo"]["segment_length"] = spec["unroll_length"]
        config["train"]["updates_per_chunk"] = spec["eval_every_updates"]
        config["eval"]["every_updates"] = spec["eval_every_updates"]
    config["run"]["compilation_cache"] = "off"
    config["run"]["cpu_devices"] = spec.get("cpu_devices", 0)
    return config


def purejaxrl_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """What peers.py reads of a MinAtar task's settings (PureJaxRL's network is fixed: no torso)."""
    return {key: value for key, value in spec.items() if key != "torso"}


def reference_arguments(suite_name: str, spec: Mapping[str, Any], seed: int, out: Path,
                        purejaxrl: Optional[Path]) -> list[str]:
    """The reference trainer's script and arguments for a task's settings, writing its result to `out`."""
    if suite_name == "minatar":
        return [str(PEERS_SCRIPT), "purejaxrl", "--curve", "--spec", json.dumps(purejaxrl_spec(spec)),
                "--seed", str(seed), "--out", str(out), "--purejaxrl", str(purejaxrl)]
    return [str(BRAX_PEER_SCRIPT), "--playground-settings", "--task", spec["task"],
            "--total-env-steps", str(spec["total_env_steps"]), "--num-evals", str(spec["num_evals"]),
            "--eval-episodes", str(spec["eval_episodes"]), "--seed", str(seed), "--out", str(out)]


class MetricsWatch:
    """Notes, for each row of a metrics.jsonl as it appears, the seconds since `origin` (a
    `time.perf_counter()` reading): a thread looks at the file every `interval` seconds."""

    def __init__(self, path: Path, origin: float, interval: float = WATCH_INTERVAL):
        self.path, self.origin, self.interval = path, origin, interval
        self.stamps: list[float] = []
        self._read = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MetricsWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()
        self._look()

    def _watch(self) -> None:
        while not self._done.wait(self.interval):
            self._look()

    def _look(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._read)
                text = handle.read()
        except FileNotFoundError:
            return
        complete = text[: text.rfind(b"\n") + 1]
        self._read += len(complete)
        now = time.perf_counter() - self.origin
        self.stamps.extend([now] * complete.count(b"\n"))


def jaxddppo_outputs(run_dir: Path, stamps: Sequence[float]) -> dict[str, Any]:
    """What the record keeps of a jaxddppo run: its summary and its metrics rows, each with the
    seconds from the process start at which it appeared (`seen_seconds`)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    keys = ("update", "env_steps", "wall_seconds", "episode_return_mean", "eval_return_mean")
    rows = [{**{key: json.loads(line).get(key) for key in keys}, "seen_seconds": stamp}
            for line, stamp in zip(lines, stamps, strict=True)]
    return {"summary": summary, "rows": rows}


def run_trial(trainer: str, suite_name: str, spec: Mapping[str, Any], seed: int, purejaxrl: Optional[Path],
              timeout: float) -> dict[str, Any]:
    """One trial in a fresh process with its own scratch directory: its command, config and raw outputs."""
    label = f"{trainer} {spec.get('env_id') or spec['task']} seed {seed}"
    with tempfile.TemporaryDirectory(prefix="jaxddppo-learning-") as name:
        scratch = Path(name)
        if trainer == "jaxddppo":
            config = jaxddppo_config(suite_name, spec, seed, scratch / "run")
            (scratch / "config.yaml").write_text(yaml.safe_dump(config))
            command = [sys.executable, "-m", "jaxddppo.train", "--config", str(scratch / "config.yaml")]
        else:
            config = None
            command = [sys.executable] + reference_arguments(suite_name, spec, seed, scratch / "result.json", purejaxrl)
        origin = time.perf_counter()
        with MetricsWatch(scratch / "run" / "metrics.jsonl", origin) as watch:
            finished = run_process(command, trial_environment(trainer, os.environ), scratch, timeout)
        wall_seconds = time.perf_counter() - origin
        if finished.timed_out:
            raise BenchError(f"{label}: no result within {timeout:.0f} s")
        if finished.exit_code != 0:
            raise BenchError(f"{label}: exit code {finished.exit_code}\n{output_tail(scratch / 'output.txt')}")
        if trainer == "jaxddppo":
            outputs = jaxddppo_outputs(scratch / "run", watch.stamps)
        else:
            outputs = json.loads((scratch / "result.json").read_text())
    return {"trainer": trainer, "seed": seed, "command": command, "config": config, "wall_seconds": wall_seconds,
            "peak_rss_mb": finished.peak_rss_mb, "jaxddppo_revision": revision(REPO_ROOT), "outputs": outputs}


# ---------------------------------------------------------------- curves from the raw outputs


@dataclass(frozen=True)
class Curve:
    """Returns at env steps, and the seconds from the process start to each."""

    env_steps: list[float]
    seconds: list[float]
    returns: list[float]


def spread_over_calls(call_ends: Sequence[float], call_seconds: Sequence[float], counts: Sequence[int]) -> list[float]:
    """The time of each update when the `counts[i]` updates of compiled call i, which ended at
    `call_ends[i]` after `call_seconds[i]` of work, are spread evenly over it: update k of n at
    end - seconds + (k + 1) / n x seconds."""
    times = []
    for end, seconds, count in zip(call_ends, call_seconds, counts, strict=True):
        times.extend(end - seconds + (k + 1) / count * seconds for k in range(count))
    return times


def chunks(rows: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """metrics.jsonl rows grouped by chunk: consecutive rows with the same wall_seconds."""
    groups: list[list[Mapping[str, Any]]] = []
    for row in rows:
        if groups and groups[-1][0]["wall_seconds"] == row["wall_seconds"]:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def known(env_steps: Sequence[float], seconds: Sequence[float], returns: Sequence[Optional[float]]) -> Curve:
    """The curve of the points whose return is known (an update in which no episode ended has none)."""
    kept = [index for index, value in enumerate(returns) if value is not None]
    return Curve([env_steps[i] for i in kept], [seconds[i] for i in kept], [returns[i] for i in kept])


def jaxddppo_curve(outputs: Mapping[str, Any], kind: str) -> Curve:
    rows = outputs["rows"]
    if kind == "evaluation":
        return known([row["env_steps"] for row in rows], [row["seen_seconds"] for row in rows],
                     [row["eval_return_mean"] for row in rows])
    groups = chunks(rows)
    ends = [max(row["seen_seconds"] for row in group) for group in groups]
    walls = [group[0]["wall_seconds"] for group in groups]
    durations = [wall - previous for wall, previous in zip(walls, [0.0] + walls[:-1])]
    seconds = spread_over_calls(ends, durations, [len(group) for group in groups])
    return known([row["env_steps"] for row in rows], seconds, [row["episode_return_mean"] for row in rows])


def purejaxrl_curve(outputs: Mapping[str, Any]) -> Curve:
    returns = outputs["update_returns"]
    seconds = spread_over_calls([outputs["call_start_seconds"] + outputs["train_seconds"]],
                                [outputs["train_seconds"]], [len(returns)])
    return known(outputs["update_env_steps"], seconds, returns)


def brax_curve(outputs: Mapping[str, Any]) -> Curve:
    """Brax's evaluations after each training call (the one before training, at step 0, left out as
    jaxddppo has none)."""
    reports = [report for report in outputs["reports"] if report["step"] > 0]
    return known([report["step"] for report in reports], [report["process_seconds"] for report in reports],
                 [report.get("eval/episode_reward") for report in reports])


def trial_curve(trial: Mapping[str, Any], kind: str) -> Curve:
    if trial["trainer"] == "jaxddppo":
        return jaxddppo_curve(trial["outputs"], kind)
    if trial["trainer"] == "purejaxrl":
        return purejaxrl_curve(trial["outputs"])
    return brax_curve(trial["outputs"])


def final_return(curve: Curve, kind: str, spec: Mapping[str, Any]) -> float:
    """A trial's final return: training, the mean of the returns of its last FINAL_UPDATES updates
    (the points after `final_window_start`; an update in which no episode ended has none), or where
    none has one (episodes longer than the window), the last update's that has, NaN if no episode
    ended at all; evaluation, the last evaluation.

    The window is counted in updates, not points: Freeway's 64 episodes all end together every 2,500
    steps (one update in 20), and its last 16 points spanned the last 26% of the run."""
    if kind != "training":
        return curve.returns[-1]
    start = final_window_start(spec)
    in_window = [value for steps, value in zip(curve.env_steps, curve.returns) if steps > start]
    if in_window:
        return float(np.mean(in_window))
    return curve.returns[-1] if curve.returns else float("nan")


def final_window_start(spec: Mapping[str, Any]) -> int:
    """The env steps after which a run's last FINAL_UPDATES updates begin."""
    return spec["total_env_steps"] - FINAL_UPDATES * steps_per_update(spec)


def compile_seconds(trial: Mapping[str, Any]) -> float:
    outputs = trial["outputs"]
    return outputs["summary"]["compile_seconds"] if trial["trainer"] == "jaxddppo" else outputs["compile_seconds"]


def evaluation_return(trial: Mapping[str, Any]) -> Optional[float]:
    """The final deterministic evaluation: jaxddppo's summary.json, Brax's last; PureJaxRL has none."""
    outputs = trial["outputs"]
    if trial["trainer"] == "jaxddppo":
        return outputs["summary"]["eval_return_mean"]
    return outputs.get("eval_return")


def measured(trial: Mapping[str, Any], kind: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's curve and the numbers the table takes from it, from its raw outputs and its task's
    settings (`spec`)."""
    curve = trial_curve(trial, kind)
    return {"curve": {"env_steps": curve.env_steps, "seconds": curve.seconds, "returns": curve.returns},
            "final_return": final_return(curve, kind, spec), "eval_return": evaluation_return(trial),
            "compile_seconds": compile_seconds(trial)}


def remeasured(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` with every trial's curve and numbers derived again from its raw outputs, as this
    version of the benchmark derives them (`--report` draws a record measured by an older one)."""
    return {**record, "trials": [{**trial, **measured(trial, record["curve"], record["specs"][trial["task"]])}
                                 for trial in record["trials"]]}


# ---------------------------------------------------------------- medians, ranges and the table


@dataclass(frozen=True)
class Band:
    """Several seeds' curves on one grid: the median and the range (min, max) at each point."""

    x: np.ndarray
    median: np.ndarray
    low: np.ndarray
    high: np.ndarray


def band(curves: Sequence[Curve], axis: str, points: int = BAND_POINTS) -> Band:
    """The curves on `points` evenly spaced values of `axis` ("env_steps" or "seconds"), from where every
    curve has begun to where the last one ends: linear interpolation between a curve's points, and a
    curve that has ended keeps its last return (its run is over: on the seconds axis, seeds end apart)."""
    curves = [curve for curve in curves if curve.returns]
    if not curves:
        return Band(*(np.zeros(0) for _ in range(4)))
    xs = [np.asarray(getattr(curve, axis), np.float64) for curve in curves]
    grid = np.linspace(max(x[0] for x in xs), max(x[-1] for x in xs), points)
    values = np.array([np.interp(grid, x, curve.returns) for x, curve in zip(xs, curves)])
    return Band(grid, np.median(values, axis=0), values.min(axis=0), values.max(axis=0))


def first_reach(x: np.ndarray, y: np.ndarray, target: float) -> Optional[float]:
    """The first x at which y is at least `target`; None if it never is."""
    reached = np.flatnonzero(np.asarray(y) >= target)
    return float(x[reached[0]]) if reached.size else None


def curves_of(record: Mapping[str, Any], task: str, trainer: str) -> list[Curve]:
    return [Curve(**trial["curve"]) for trial in record["trials"]
            if trial["task"] == task and trial["trainer"] == trainer]


def values_of(record: Mapping[str, Any], task: str, trainer: str, key: str) -> list[float]:
    return [trial[key] for trial in record["trials"]
            if trial["task"] == task and trial["trainer"] == trainer and trial[key] is not None]


def summary_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per task: each trainer's median (and range) of the final return and of the final evaluation,
    its median compile seconds and process seconds, and the env steps and seconds jaxddppo's median
    curve takes to reach the reference's median final return (None: not reached)."""
    reference = TRAINERS[record["suite"]][1]
    rows = []
    for task in record["tasks"]:
        row: dict[str, Any] = {"task": task}
        for trainer in TRAINERS[record["suite"]]:
            for key in ("final_return", "eval_return", "compile_seconds", "wall_seconds"):
                values = values_of(record, task, trainer, key)
                row[f"{trainer}_{key}"] = float(np.median(values)) if values else None
                row[f"{trainer}_{key}_range"] = [min(values), max(values)] if values else None
        target = row[f"{reference}_final_return"]
        for axis in ("env_steps", "seconds"):
            ours = band(curves_of(record, task, "jaxddppo"), axis)
            row[f"jaxddppo_{axis}_to_reference"] = None if target is None else first_reach(ours.x, ours.median, target)
        row["reference_measured"] = target is not None
        rows.append(row)
    return rows


def number(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def with_range(row: Mapping[str, Any], key: str) -> str:
    if row[key] is None:
        return "-"
    low, high = row[f"{key}_range"]
    return f"{number(row[key])} ({number(low)}-{number(high)})"


def reach_text(row: Mapping[str, Any], axis: str) -> str:
    if not row["reference_measured"]:
        return "-"
    value = row[f"jaxddppo_{axis}_to_reference"]
    return "not reached" if value is None else number(value, 0)


def format_table(record: Mapping[str, Any]) -> str:
    """The Markdown table of a record: per task, each trainer's median final return (seed range), final
    evaluation, compile seconds and process seconds, and jaxddppo's steps and seconds to the reference's
    median final return."""
    reference = TRAINERS[record["suite"]][1]
    name = REFERENCE_NAMES[reference]
    lines = [f"| task | final return, jaxddppo | {name} | final evaluation, jaxddppo | {name} | "
             f"compile s, jaxddppo | {name} | process s, jaxddppo | {name} | jaxddppo to {name}'s final: "
             "env steps | seconds |", "|" + "---|" * 11]
    for row in summary_rows(record):
        reach = [reach_text(row, axis) for axis in ("env_steps", "seconds")]
        lines.append(
            f"| {row['task']} | {with_range(row, 'jaxddppo_final_return')} | "
            f"{with_range(row, f'{reference}_final_return')} | {with_range(row, 'jaxddppo_eval_return')} | "
            f"{with_range(row, f'{reference}_eval_return')} | {number(row['jaxddppo_compile_seconds'])} | "
            f"{number(row[f'{reference}_compile_seconds'])} | {number(row['jaxddppo_wall_seconds'], 0)} | "
            f"{number(row[f'{reference}_wall_seconds'], 0)} | {reach[0]} | {reach[1]} |")
    return "\n".join(lines)


def draw_figure(record: Mapping[str, Any], path: Path) -> list[str]:
    """One PNG for the record's suite: a column per task, its median curves and seed ranges against
    env steps (top) and seconds from the process start (bottom); returns the panels' titles, row by row."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    tasks, trainers = record["tasks"], TRAINERS[record["suite"]]
    figure, axes = pyplot.subplots(2, len(tasks), figsize=(4.5 * len(tasks), 7), squeeze=False)
    label = "training return" if record["curve"] == "training" else "evaluation return"
    abscissae = (("env_steps", "env steps", "env steps"), ("seconds", "seconds", "seconds from process start"))
    for column, task in enumerate(tasks):
        for row, (axis, name, axis_label) in enumerate(abscissae):
            panel = axes[row][column]
            for trainer in trainers:
                curves = curves_of(record, task, trainer)
                if not curves:
                    continue
                drawn = band(curves, axis)
                single = drawn.x.size > 0 and drawn.x[0] == drawn.x[-1]  # a point, not a line: marked
                line, = panel.plot(drawn.x, drawn.median, marker="o" if single else None,
                                   label=f"{REFERENCE_NAMES[trainer]} (median of {len(curves)})")
                panel.fill_between(drawn.x, drawn.low, drawn.high, color=line.get_color(), alpha=0.2)
            panel.set_title(f"{task}, by {name}")
            panel.set_xlabel(axis_label)
            panel.set_ylabel(label)
            panel.grid(alpha=0.3)
            panel.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return [panel.get_title() for row in axes for panel in row]


def write_report(record: Mapping[str, Any], out: Path) -> tuple[Path, Path]:
    """OUT/SUITE.png and OUT/SUITE.md from a record."""
    out.mkdir(parents=True, exist_ok=True)
    figure, table = out / f"{record['suite']}.png", out / f"{record['suite']}.md"
    draw_figure(record, figure)
    table.write_text(format_table(record) + "\n")
    return figure, table


# ---------------------------------------------------------------- a run


def trial_label(trial: Mapping[str, Any]) -> str:
    return f"{trial['trainer']} {trial['task']} seed {trial['seed']}"


def measure(chosen: Suite, run: Callable[[str, str, int], dict[str, Any]],
            trainers: Optional[Sequence[str]] = None, done: Sequence[dict[str, Any]] = (),
            after_trial: Optional[Callable[[list[dict[str, Any]]], None]] = None) -> list[dict[str, Any]]:
    """Seed after seed, task after task, jaxddppo then the reference (or `trainers`); each trial with its
    curve and numbers. The trials in `done` (an earlier record's) are kept and not run again (their
    numbers derived again from their raw outputs); after each new trial, `after_trial` gets the trials
    so far. Prints one line per trial."""
    trials = [{**trial, **measured(trial, chosen.curve, chosen.specs[trial["task"]])} for trial in done]
    measured_already = {(trial["task"], trial["trainer"], trial["seed"]) for trial in done}
    for seed in range(chosen.seeds):
        for task in chosen.specs:
            for trainer in trainers or TRAINERS[chosen.name]:
                if (task, trainer, seed) in measured_already:
                    continue
                trial = {"task": task, **run(trainer, task, seed)}
                trial.update(measured(trial, chosen.curve, chosen.specs[task]))
                trials.append(trial)
                print(f"{trial_label(trial)}: final return {trial['final_return']:.2f}, evaluation "
                      f"{number(trial['eval_return'], 2)}, compile {trial['compile_seconds']:.1f} s, process "
                      f"{trial['wall_seconds']:.0f} s", flush=True)
                if after_trial is not None:
                    after_trial(trials)
    return trials


def build_record(chosen: Suite, trials: Sequence[dict[str, Any]], command: str, purejaxrl: Optional[Path],
                 cpu: dict[str, Any]) -> dict[str, Any]:
    sources = {"jaxddppo": {"path": str(REPO_ROOT), "revision": revision(REPO_ROOT)}}
    if purejaxrl is not None:
        sources["purejaxrl"] = {"path": str(purejaxrl), "revision": revision(purejaxrl)}
    return {
        "suite": chosen.name,
        "curve": chosen.curve,
        "command": command,
        "machine": machine_description(cpu),
        "versions": versions_of(PACKAGES),
        "sources": sources,
        "tasks": list(chosen.specs),
        "seeds": chosen.seeds,
        "specs": dict(chosen.specs),
        "configs": {task: {"jaxddppo": jaxddppo_config(chosen.name, spec, 0, Path("RUN_DIR")),
                           chosen.reference: reference_arguments(chosen.name, spec, 0, Path("RESULT"), purejaxrl)}
                    for task, spec in chosen.specs.items()},
        "trials": list(trials),
    }


def save_record(record: Mapping[str, Any], path: Path) -> None:
    """Write `record` to `path` whole or not at all: a run stopped while writing keeps the last one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)


def record_to_resume(path: Path, record: Mapping[str, Any]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """The record at `path`, if the run of `record` (its trials aside) can continue it: the same
    suite, tasks and settings, on the same machine with the same versions; else None and why, in
    one line."""
    try:
        previous = json.loads(path.read_text())
        trials = previous["trials"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"--resume: {path} is not a record of this benchmark ({type(error).__name__}: {error})"
    if not isinstance(trials, list):
        return None, f"--resume: {path} is not a record of this benchmark (its trials are not a list)"
    ours = json.loads(json.dumps(record))
    for key in ("suite", "curve", "tasks"):
        if previous.get(key) != ours[key]:
            return None, f"--resume: {path} records {key} {previous.get(key)}, this run {ours[key]}"
    for task, spec in ours["specs"].items():
        theirs = previous.get("specs", {}).get(task, {})
        for setting in sorted(set(spec) | set(theirs)):
            if spec.get(setting) != theirs.get(setting):
                return None, (f"--resume: {path} trained {task} with {setting}={theirs.get(setting)}, this run "
                              f"{setting}={spec.get(setting)}")
    for group in ("machine", "versions"):
        theirs, mine = previous.get(group, {}), ours[group]
        for key in sorted((set(theirs) | set(mine)) - {"date"}):
            if theirs.get(key) != mine.get(key):
                return None, (f"--resume: {path} was measured with {key}={theirs.get(key)}, this run has "
                              f"{mine.get(key)}")
    return previous, None


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python benchmarks/learning.py",
        description="Train jaxddppo and a suite's reference implementation with the same settings, over several "
        "seeds, alternating fresh processes; record every curve and draw the median curves and the final returns. "
        f"Exit codes: 0 done, {EXIT_TRIAL_FAILED} a trial failed, {EXIT_BAD_ARGUMENTS} bad arguments.",
    )
    parser.add_argument("--suite", choices=tuple(TRAINERS), help="the suite to train")
    parser.add_argument("--tasks", help="comma-separated tasks of the suite (default: all)")
    parser.add_argument("--seeds", type=int, help="seeds 0 .. N-1 (default: minatar 3, playground 2)")
    parser.add_argument("--total-env-steps", type=int, metavar="N",
                        help="every task's env steps (rounded to whole updates), e.g. for a quick check")
    parser.add_argument("--purejaxrl", type=Path, metavar="PATH", help=f"minatar: a clone of {PUREJAXRL_URL}")
    parser.add_argument("--resume", action="store_true",
                        help="continue the record in --out: run only the trials it lacks (same settings, machine "
                        "and versions)")
    parser.add_argument("--report", type=Path, metavar="RECORD", help="redraw the figure and table of a record")
    parser.add_argument("--out", type=Path, metavar="DIR", required=True,
                        help="where SUITE.json (the record), SUITE.png and SUITE.md go")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per trial (default 3600)")
    parser.add_argument("--jaxddppo-cpu-devices", type=int, default=0, metavar="N",
                        help="jaxddppo's run.cpu_devices (default 0: the train command's own choice)")
    args = parser.parse_args(argv)
    args.tasks = names(args.tasks) if args.tasks else None
    problem = argument_problem(args)
    if problem:
        parser.error(problem)
    return args


def argument_problem(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the parsed arguments, in one line; None if nothing."""
    if (args.report is None) == (args.suite is None):
        return "give --suite NAME to train, or --report RECORD to redraw"
    if args.report is not None and args.resume:
        return "--resume continues a training run (--suite), not --report"
    if args.report is not None:
        return None if args.report.is_file() else f"--report={args.report} is not a file"
    every = MINATAR_TASKS if args.suite == "minatar" else tuple(PLAYGROUND_TASKS)
    unknown = [task for task in args.tasks or () if task not in every]
    if unknown:
        return f"--tasks={','.join(unknown)} is not a task of {args.suite}; choose from {', '.join(every)}"
    if args.seeds is not None and args.seeds < 1:
        return f"--seeds={args.seeds} must be at least 1"
    if args.total_env_steps is not None and args.total_env_steps < 1:
        return f"--total-env-steps={args.total_env_steps} must be at least 1"
    if args.jaxddppo_cpu_devices < 0:
        return f"--jaxddppo-cpu-devices={args.jaxddppo_cpu_devices} must be 0 (the command's choice) or more"
    if args.suite != "minatar" and args.purejaxrl is not None:
        return "--purejaxrl is read only by --suite=minatar"
    if args.suite == "minatar" and (args.purejaxrl is None or not (args.purejaxrl / "purejaxrl" / "ppo.py").is_file()):
        return f"--suite=minatar needs --purejaxrl PATH, a clone of {PUREJAXRL_URL} (with purejaxrl/ppo.py)"
    return None


# Imported by the trials' processes on both sides (gymnax by the MinAtar suite's; absent ones are skipped).
TRIAL_IMPORTS = ("jax", "flax", "optax", "gymnax")


def uncached_bytecode(modules: Sequence[str]) -> list[str]:
    """Those of `modules` (installed, importable) with no compiled bytecode beside their source: a
    process that imports them compiles their sources first (with PYTHONDONTWRITEBYTECODE set it writes
    nothing, so every process does), seconds that every trial's process time counts."""
    uncached = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.cached is not None and not os.path.exists(spec.cached):
            uncached.append(name)
    return uncached


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        record = remeasured(json.loads(args.report.read_text()))
        figure, table = write_report(record, args.out)
        print(format_table(record))
        print(f"wrote {figure} and {table}")
        return 0
    chosen = suite(args.suite, args.tasks, args.seeds, args.total_env_steps, args.jaxddppo_cpu_devices)
    purejaxrl = args.purejaxrl.resolve() if args.purejaxrl else None
    cpu = cpu_description(read_cpuinfo())
    command = "python benchmarks/learning.py " + " ".join(argv if argv is not None else sys.argv[1:])
    record = build_record(chosen, [], command, purejaxrl, cpu)
    path = args.out / f"{chosen.name}.json"
    done: list[dict[str, Any]] = []
    if path.exists():
        previous, problem = record_to_resume(path, record) if args.resume else \
            (None, f"{path} exists: --resume continues its run, or give another --out")
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_BAD_ARGUMENTS
        record["command"], done = previous.get("command", record["command"]), previous["trials"]
    budgets = ", ".join(f"{task} {spec['total_env_steps']:,} steps" for task, spec in chosen.specs.items())
    print(f"machine: {cpu['cpu_model'] or 'CPU model unknown'}, {os.cpu_count()} CPUs; {chosen.seeds} seed(s); "
          f"{budgets}" + (f"; {len(done)} trial(s) already in {path}" if done else ""), flush=True)
    uncached = uncached_bytecode(TRIAL_IMPORTS)
    if uncached:
        print(f"warning: {', '.join(uncached)} {'has' if len(uncached) == 1 else 'have'} no compiled bytecode: every "
              f"trial's process compiles its imports first, seconds its process time counts; run python -m "
              f"compileall on {sys.prefix} or install without pip's --no-compile", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        trials = measure(chosen, lambda trainer, task, seed: run_trial(
            trainer, chosen.name, chosen.specs[task], seed, purejaxrl, args.timeout), done=done,
            after_trial=lambda trials: save_record({**record, "trials": trials}, path))
    except BenchError as error:
        kept = f"\nthe trials before it are in {path}: --resume continues" if path.exists() else ""
        print(f"error: {error}{kept}", file=sys.stderr)
        return EXIT_TRIAL_FAILED
    record["trials"] = trials
    save_record(record, path)
    figure, table = write_report(record, args.out)
    print(format_table(record))
    print(f"wrote {path}, {figure} and {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
