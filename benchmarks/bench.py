"""Benchmarks: `python benchmarks/bench.py [--suites ...] [--baseline PATH] [--peers ...] [--out FILE]`.

Contenders, side by side on the same machine: jaxddppo from this checkout
("jaxddppo"), jaxddppo from another checkout (`--baseline PATH`: "baseline"),
and peer PPO implementations: rejax (installed by the `bench` extra) and
PureJaxRL (`--peers purejaxrl --purejaxrl PATH`, a clone of its repository).
Every measurement is a fresh subprocess (its own compile, its own peak memory,
its own simulated device count), and the trials of all selected suites take
turns, A B C A B C ..., so that a slow minute of a noisy machine falls on every
contender alike. Each table reports medians over the rounds and ratios as the
median of the per-round ratios.

A jaxddppo checkout runs through its command line, `python -m jaxddppo.train`
(or `python -m jaxddppo.sweep --seeds N` for a population of N seeds), with the
checkout first on PYTHONPATH, so that this checkout and the baseline are
measured the same way; a peer runs in benchmarks/peers.py. What a trial reports:

  steps/s            steady state, compile excluded: for jaxddppo the training after
                     its first chunk of updates (metrics.jsonl); for a peer, which trains
                     in one call, a second call of the compiled program
  first-run steps/s  all of training, first execution included
  compile s          jaxddppo's summary.json compile_seconds; a peer's lowering and compile
  outside training   the process's wall seconds less its training seconds: start-up, every
                     compile, initialisation, the final evaluation, the outputs
  peak MB            the process's peak resident memory, as the OS reports it on reaping it
  return             the final return (summary.json's evaluation for jaxddppo; see peers.py)

Suites:
  small       1 device, PureJaxRL's CartPole config: jaxddppo with one CPU thread against
              each peer as it runs by default and with one thread too, and against
              itself with XLA's default thread pool
  large       the same with 2048 environments: jaxddppo against each peer
  scaling     jaxddppo on 2 devices against its best on 1 device, small and large configs
  population  1, 8 and 32 seeds of the small config: a jaxddppo sweep against rejax
              vmapped; 32 seeds also on 2 devices, and with one CPU thread each
  guard       this checkout against --baseline, both with their defaults: the small config
              on 1 device and the large config on 2 devices (reported), the large config
              on 1 device and a sweep of 32 seeds of the small config on 2 devices
              (guarded: steps/s at least 0.95x, seconds outside training at most 1.1x:
              what a checkout compiles when, and where it counts it, may differ)
  reductions  the price of train.exact_reductions: the large config on 2 devices, exact
              (the default) against train.exact_reductions=false (a run of one shard runs
              the same program either way)
  cpu-devices where the train command starts splitting the CPU (one device per core from 16
              environments a device on): the small config with 8, 16 and 32 environments
              on 2 devices against 1, XLA's default thread pool

A trial's CPU thread count is XLA's CPU thread pool size, set through
PJRT_NPROC for every contender (0: XLA's default, one thread per core); its
device count is XLA_FLAGS' --xla_force_host_platform_device_count.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import yaml

BENCHMARKS_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARKS_DIR.parent
PEERS_SCRIPT = BENCHMARKS_DIR / "peers.py"
ENV_RATES_SCRIPT = BENCHMARKS_DIR / "env_rates.py"

# The matched hyperparameters (PureJaxRL's CartPole defaults, constant learning rate:
# rejax 0.1.3 has no learning-rate schedule).
SMALL_CONFIG: dict[str, Any] = {
    "env_id": "CartPole-v1",
    "num_envs": 4,
    "num_steps": 128,
    "num_epochs": 4,
    "num_minibatches": 4,
    "hidden_sizes": [64, 64],
    "activation": "tanh",
    "learning_rate": 2.5e-4,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "clip_eps": 0.2,
    "vf_coef": 0.5,
    "ent_coef": 0.01,
    "max_grad_norm": 0.5,
    "total_env_steps": 500_000,
}
# The cpu-devices suite's environment counts: 4, 8 and 16 environments a device on 2 devices.
CPU_DEVICES_NUM_ENVS = (8, 16, 32)
CONFIGS: dict[str, dict[str, Any]] = {
    "small": SMALL_CONFIG,
    "large": {**SMALL_CONFIG, "num_envs": 2048, "total_env_steps": 2048 * 128 * 20},
    **{f"small-{num_envs}": {**SMALL_CONFIG, "num_envs": num_envs, "total_env_steps": 1_000_000}
       for num_envs in CPU_DEVICES_NUM_ENVS},
}
SUITES = ("small", "large", "scaling", "population", "guard", "reductions", "cpu-devices")
DEFAULT_SUITES = ("small", "large", "scaling", "population")
CHECKOUTS = ("jaxddppo", "baseline")  # contenders that are checkouts of jaxddppo
PEERS = ("rejax", "purejaxrl")
# Vmapped over seeds, PureJaxRL hangs in its initialisation on jax 0.10.2's CPU thread pool
# (benchmarks/README.md); it runs in the small and large suites only.
POPULATION_PEERS = ("rejax",)
POPULATION_SEEDS = (1, 8, 32)
GUARD_SEEDS = 32
# The guard's bounds on this checkout against the baseline (medians of per-round ratios).
GUARD_MIN_STEPS_RATIO = 0.95
GUARD_MAX_OUTSIDE_TRAINING_RATIO = 1.1
CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
PUREJAXRL_URL = "https://github.com/luchris429/purejaxrl"
EXIT_TRIAL_FAILED, EXIT_BAD_ARGUMENTS, EXIT_GUARD_FAILED = 1, 2, 3


@dataclass(frozen=True)
class Trial:
    """One kind of measurement: a contender on a config, a device count, a number of seeds
    (0: a single run; n >= 1: a population of n seeds), a CPU thread pool size (0: XLA's
    default) and, for a jaxddppo checkout, its train.exact_reductions."""

    contender: str  # one of CHECKOUTS or PEERS
    config: str  # a key of CONFIGS
    devices: int = 1
    seeds: int = 0
    cpu_threads: int = 0
    exact_reductions: bool = True

    @property
    def label(self) -> str:
        population = f", {self.seeds} seeds" if self.seeds else ""
        threads = f", {self.cpu_threads} CPU thread(s)" if self.cpu_threads else ""
        reductions = "" if self.exact_reductions else ", exact_reductions=false"
        return f"{self.contender} {self.config}, {self.devices} device(s){population}{threads}{reductions}"


@dataclass(frozen=True)
class Comparison:
    """A table row: `numerator` against `denominator`, within a suite; `guarded` rows are held
    to the guard's bounds."""

    suite: str
    numerator: Trial
    denominator: Trial
    guarded: bool = False


# One CPU thread makes the small config's tiny operations run faster (docs/benchmarks.md);
# the large config's larger ones use every core.
SMALL_BEST = Trial("jaxddppo", "small", cpu_threads=1)


def small_rows(peers: Sequence[str]) -> list[Comparison]:
    rows = []
    for peer in peers:
        rows.append(Comparison("small", SMALL_BEST, Trial(peer, "small")))
        rows.append(Comparison("small", SMALL_BEST, Trial(peer, "small", cpu_threads=1)))
    return rows + [Comparison("small", SMALL_BEST, Trial("jaxddppo", "small"))]


def large_rows(peers: Sequence[str]) -> list[Comparison]:
    return [Comparison("large", Trial("jaxddppo", "large"), Trial(peer, "large")) for peer in peers]


def scaling_rows(peers: Sequence[str]) -> list[Comparison]:
    return [Comparison("scaling", Trial("jaxddppo", "small", devices=2), SMALL_BEST),
            Comparison("scaling", Trial("jaxddppo", "large", devices=2), Trial("jaxddppo", "large"))]


def population_rows(peers: Sequence[str]) -> list[Comparison]:
    peers = [peer for peer in peers if peer in POPULATION_PEERS]
    rows = [Comparison("population", Trial("jaxddppo", "small", seeds=seeds), Trial(peer, "small", seeds=seeds))
            for seeds in POPULATION_SEEDS for peer in peers]
    largest = POPULATION_SEEDS[-1]
    # On one device, as experiments/cartpole.yaml runs it (one thread), against each peer as
    # its users run it and with one thread too.
    one_thread = Trial("jaxddppo", "small", seeds=largest, cpu_threads=1)
    for peer in peers:
        rows.append(Comparison("population", Trial("jaxddppo", "small", devices=2, seeds=largest),
                               Trial(peer, "small", seeds=largest)))
        rows.append(Comparison("population", one_thread, Trial(peer, "small", seeds=largest)))
        rows.append(Comparison("population", one_thread, Trial(peer, "small", seeds=largest, cpu_threads=1)))
    return rows


def guard_rows(peers: Sequence[str]) -> list[Comparison]:
    """Each config with both checkouts' defaults: the large config on 1 device and the sweep
    guarded, the others reported (on 2 devices this checkout's exact reductions, which the
    baseline predates, have a price of their own: the reductions suite)."""
    return [Comparison("guard", Trial("jaxddppo", config, devices, seeds), Trial("baseline", config, devices, seeds),
                       guarded=guarded)
            for config, devices, seeds, guarded in (("small", 1, 0, False), ("large", 1, 0, True),
                                                    ("large", 2, 0, False), ("small", 2, GUARD_SEEDS, True))]


def reductions_rows(peers: Sequence[str]) -> list[Comparison]:
    return [Comparison("reductions", Trial("jaxddppo", "large", 2),
                       Trial("jaxddppo", "large", 2, exact_reductions=False))]


def cpu_devices_rows(peers: Sequence[str]) -> list[Comparison]:
    return [Comparison("cpu-devices", Trial("jaxddppo", f"small-{num_envs}", 2), Trial("jaxddppo", f"small-{num_envs}"))
            for num_envs in CPU_DEVICES_NUM_ENVS]


SUITE_ROWS: dict[str, Callable[[Sequence[str]], list[Comparison]]] = {
    "small": small_rows, "large": large_rows, "scaling": scaling_rows, "population": population_rows,
    "guard": guard_rows, "reductions": reductions_rows, "cpu-devices": cpu_devices_rows,
}


def comparisons(suites: Sequence[str], peers: Sequence[str]) -> list[Comparison]:
    """The table rows of `suites`, in order; the peer suites' rows for each of `peers`."""
    return [row for suite in suites for row in SUITE_ROWS[suite](peers)]


def distinct_trials(rows: Sequence[Comparison]) -> list[Trial]:
    trials: list[Trial] = []
    for row in rows:
        for trial in (row.numerator, row.denominator):
            if trial not in trials:
                trials.append(trial)
    return trials


@dataclass(frozen=True)
class Sources:
    """Where the contenders' code is: each jaxddppo checkout by contender, and PureJaxRL's clone."""

    checkouts: Mapping[str, Path]
    purejaxrl: Optional[Path] = None


@dataclass(frozen=True)
class Plan:
    """What one benchmark run measures: the rows, the configs by name, where the contenders'
    code is, the rounds of alternating trials and the seconds allowed per trial."""

    rows: tuple[Comparison, ...]
    specs: Mapping[str, dict[str, Any]]
    sources: Sources
    repeats: int
    timeout: float


# ---------------------------------------------------------------- one trial


class BenchError(RuntimeError):
    """A trial failed; the message names it and ends with its output's last lines."""


def jaxddppo_config(spec: Mapping[str, Any], run_dir: Path, exact_reductions: bool = True) -> dict[str, Any]:
    """The jaxddppo config of a benchmark spec: no checkpoints in between, no progress output.
    train.exact_reductions is written only when false (a baseline checkout may predate it), and
    network.torso only where the spec names one (`anneal_lr` and `torso` are optional keys: the
    learning benchmark's)."""
    network = {"hidden_sizes": list(spec["hidden_sizes"]), "activation": spec["activation"]}
    if "torso" in spec:
        network["torso"] = spec["torso"]
    config = {
        "env": {"id": spec["env_id"], "num_envs": spec["num_envs"]},
        "network": network,
        "ppo": {
            "num_steps": spec["num_steps"], "num_epochs": spec["num_epochs"],
            "num_minibatches": spec["num_minibatches"], "learning_rate": spec["learning_rate"],
            "anneal_lr": spec.get("anneal_lr", False), "gamma": spec["gamma"], "gae_lambda": spec["gae_lambda"],
            "clip_eps": spec["clip_eps"], "vf_coef": spec["vf_coef"], "ent_coef": spec["ent_coef"],
            "max_grad_norm": spec["max_grad_norm"],
        },
        "train": {"total_env_steps": spec["total_env_steps"]},
        "checkpoint": {"every_updates": 0, "every_seconds": 0},
        "run": {"dir": str(run_dir), "progress": False},
    }
    if not exact_reductions:
        config["train"]["exact_reductions"] = False
    return config


def trial_command(trial: Trial, spec: Mapping[str, Any], sources: Sources, scratch: Path) -> list[str]:
    """The command line of a trial run in `scratch`: a jaxddppo checkout's train or sweep command
    on a config file written there, or benchmarks/peers.py writing scratch/result.json."""
    if trial.contender in CHECKOUTS:
        config_path = scratch / "config.yaml"
        config = jaxddppo_config(spec, scratch / "run", trial.exact_reductions)
        config_path.write_text(yaml.safe_dump(config))
        if trial.seeds:
            return [sys.executable, "-m", "jaxddppo.sweep", "--config", str(config_path), "--seeds", str(trial.seeds)]
        return [sys.executable, "-m", "jaxddppo.train", "--config", str(config_path)]
    command = [sys.executable, str(PEERS_SCRIPT), trial.contender, "--spec", json.dumps(spec),
               "--seeds", str(trial.seeds), "--out", str(scratch / "result.json")]
    if trial.contender == "purejaxrl":
        command += ["--purejaxrl", str(sources.purejaxrl)]
    return command


def importing(checkout: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with `checkout` first on PYTHONPATH: a process that imports jaxddppo from it."""
    return {**environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), environ.get("PYTHONPATH")]))}


def trial_environment(trial: Trial, environ: Mapping[str, str], checkout: Optional[Path]) -> dict[str, str]:
    """`environ` for a trial's process: its CPU thread pool size (PJRT_NPROC; none inherited, nor
    NPROC, which XLA's default pool is sized from), its device count (XLA_FLAGS) and, for a
    jaxddppo contender, its `checkout` first on PYTHONPATH."""
    env = {key: value for key, value in environ.items() if key not in ("PJRT_NPROC", "NPROC")}
    if trial.cpu_threads:
        env["PJRT_NPROC"] = str(trial.cpu_threads)
    flags = [flag for flag in env.get("XLA_FLAGS", "").split() if not flag.startswith(CPU_DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join(flags + [f"{CPU_DEVICE_COUNT_FLAG}={trial.devices}"])
    return importing(checkout, env) if checkout is not None else env


@dataclass(frozen=True)
class Finished:
    """How a trial's process ended: its exit code, its peak resident memory and whether it was
    stopped for running past its time."""

    exit_code: int
    peak_rss_mb: float
    timed_out: bool


def run_process(command: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float) -> Finished:
    """Run `command` in `cwd`, its output in cwd/output.txt, killed after `timeout` seconds, with
    JAX's compilation cache off (each trial compiles everything: jaxddppo's commands would
    otherwise load what an earlier trial compiled). The peak memory is the one the OS reports
    as the process is reaped (Linux reports KiB)."""
    env = {**env, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    with open(cwd / "output.txt", "w") as output:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=output, stderr=subprocess.STDOUT)
    expired = threading.Event()

    def stop() -> None:
        expired.set()
        process.kill()

    timer = threading.Timer(timeout, stop)
    timer.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)
    finally:
        timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    return Finished(process.returncode, usage.ru_maxrss / 1024.0, expired.is_set())


def steady_state(metrics_path: Path, members: int) -> tuple[int, float]:
    """(env steps, seconds) of a run after its first chunk of updates, from metrics.jsonl:
    the first chunk also pays one-time costs (first execution of the compiled program)."""
    with open(metrics_path) as handle:
        rows = [json.loads(line) for line in handle]
    rows = [row for row in rows if row.get("member", 0) == 0]
    later_chunks = [index for index in range(1, len(rows)) if rows[index]["wall_seconds"] != rows[0]["wall_seconds"]]
    last = rows[-1]
    if not later_chunks:  # a single chunk: nothing to set apart
        return last["env_steps"] * members, last["wall_seconds"]
    first = rows[later_chunks[0] - 1]
    return (last["env_steps"] - first["env_steps"]) * members, last["wall_seconds"] - first["wall_seconds"]


def jaxddppo_result(run_dir: Path, seeds: int) -> dict[str, Any]:
    """A jaxddppo trial's result, from the summary.json and metrics.jsonl of its run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steady_steps, steady_seconds = steady_state(run_dir / "metrics.jsonl", max(seeds, 1))
    return {
        "env_steps": summary["total_env_steps"],
        "train_seconds": summary["train_seconds"],
        "steady_env_steps": steady_steps,
        "steady_seconds": steady_seconds,
        "compile_seconds": summary["compile_seconds"],
        # A sweep of one setting: its mean over seeds.
        "final_return": summary["best_eval_return_mean"] if seeds else summary["eval_return_mean"],
    }


def env_rates_command(env_id: str, num_envs: int, num_steps: int, out: Path, steps_per_env: int = 0,
                      optimistic_reset_ratio: int = 1, start_states: str = "fresh",
                      contenders: Optional[Sequence[str]] = None) -> list[str]:
    """The command line of env_rates.py that measures these rates in a process of its own
    and writes them as JSON to `out` (`contenders` None: env_rates.py's default, all three)."""
    command = [sys.executable, str(ENV_RATES_SCRIPT), env_id, "--num-envs", str(num_envs),
               "--num-steps", str(num_steps), "--steps-per-env", str(steps_per_env),
               "--optimistic-reset-ratio", str(optimistic_reset_ratio), "--start-states", start_states]
    if contenders is not None:
        command += ["--contenders", ",".join(contenders)]
    return command + ["--out", str(out)]


def output_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])


def run_trial(trial: Trial, plan: Plan) -> dict[str, Any]:
    """One measurement, in a fresh subprocess with its own scratch directory."""
    with tempfile.TemporaryDirectory(prefix="jaxddppo-bench-") as name:
        scratch = Path(name)
        command = trial_command(trial, plan.specs[trial.config], plan.sources, scratch)
        env = trial_environment(trial, os.environ, plan.sources.checkouts.get(trial.contender))
        start = time.perf_counter()
        finished = run_process(command, env, scratch, plan.timeout)
        wall_seconds = time.perf_counter() - start
        if finished.timed_out:
            raise BenchError(f"{trial.label}: no result within {plan.timeout:.0f} s")
        if finished.exit_code != 0:
            raise BenchError(f"{trial.label}: exit code {finished.exit_code}\n{output_tail(scratch / 'output.txt')}")
        if trial.contender in CHECKOUTS:
            result = jaxddppo_result(scratch / "run", trial.seeds)
        else:
            result = json.loads((scratch / "result.json").read_text())
    result["steps_per_second"] = result["steady_env_steps"] / result["steady_seconds"]
    result["first_run_steps_per_second"] = result["env_steps"] / result["train_seconds"]
    result["peak_rss_mb"] = finished.peak_rss_mb
    result["wall_seconds"] = wall_seconds
    result["outside_training_seconds"] = wall_seconds - result["train_seconds"]
    return result


# ---------------------------------------------------------------- rounds and tables


def measure(trials: Sequence[Trial], repeats: int,
            run: Callable[[Trial], dict[str, Any]]) -> dict[Trial, list[dict[str, Any]]]:
    """Each round runs every trial once, in the same order (A B C A B C ...); the results of
    each trial in round order. Prints one line per trial run."""
    measurements: dict[Trial, list[dict[str, Any]]] = {trial: [] for trial in trials}
    for round_index in range(repeats):
        for trial in trials:
            result = run(trial)
            measurements[trial].append(result)
            print(f"round {round_index + 1}/{repeats} {trial.label}: {result['steps_per_second']:,.0f} steps/s, "
                  f"compile {result['compile_seconds']:.1f} s, peak {result['peak_rss_mb']:,.0f} MB, "
                  f"return {result['final_return']:.1f}", flush=True)
    return measurements


def run_plan(plan: Plan) -> dict[Trial, list[dict[str, Any]]]:
    """Every trial of the plan's rows, alternating over its rounds."""
    return measure(distinct_trials(plan.rows), plan.repeats, lambda trial: run_trial(trial, plan))


def median_of(results: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.median(result[key] for result in results)


def round_ratios(numerator: Sequence[dict[str, Any]], denominator: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [a[key] / b[key] for a, b in zip(numerator, denominator, strict=True)]


def guard_verdict(steps_ratio: float, outside_training_ratio: float) -> str:
    within = steps_ratio >= GUARD_MIN_STEPS_RATIO and outside_training_ratio <= GUARD_MAX_OUTSIDE_TRAINING_RATIO
    return "pass" if within else "FAIL"


def summarise(rows: Sequence[Comparison], measurements: Mapping[Trial, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One dict per comparison: both trials' medians, and the medians of the per-round ratios of
    steps/s, of compile seconds and of seconds outside training; a guarded row's verdict,
    None for the others."""
    table = []
    for row in rows:
        numerator, denominator = measurements[row.numerator], measurements[row.denominator]
        entry: dict[str, Any] = {"suite": row.suite, "numerator": row.numerator.label,
                                 "denominator": row.denominator.label}
        for side, results in (("numerator", numerator), ("denominator", denominator)):
            for key in ("steps_per_second", "first_run_steps_per_second", "compile_seconds",
                        "outside_training_seconds", "peak_rss_mb", "final_return"):
                entry[f"{side}_{key}"] = median_of(results, key)
        entry["round_ratios"] = round_ratios(numerator, denominator, "steps_per_second")
        entry["steps_per_second_ratio"] = statistics.median(entry["round_ratios"])
        entry["round_compile_ratios"] = round_ratios(numerator, denominator, "compile_seconds")
        entry["compile_seconds_ratio"] = statistics.median(entry["round_compile_ratios"])
        entry["round_outside_training_ratios"] = round_ratios(numerator, denominator, "outside_training_seconds")
        entry["outside_training_seconds_ratio"] = statistics.median(entry["round_outside_training_ratios"])
        entry["guard"] = (guard_verdict(entry["steps_per_second_ratio"], entry["outside_training_seconds_ratio"])
                          if row.guarded else None)
        if row.suite == "scaling":
            entry["scaling_efficiency"] = entry["steps_per_second_ratio"] / row.numerator.devices
        table.append(entry)
    return table


def format_table(table: Sequence[dict[str, Any]]) -> str:
    header = ("| suite | A | B | A steps/s | B steps/s | A / B | A compile s | B compile s | A / B compile | "
              "A / B outside training | A peak MB | B peak MB | A return | B return | guard |")
    lines = [header, "|" + "---|" * 15]
    for row in table:
        ratio = f"{row['steps_per_second_ratio']:.2f}"
        if "scaling_efficiency" in row:
            ratio += f" (eff. {row['scaling_efficiency']:.2f})"
        lines.append(
            f"| {row['suite']} | {row['numerator']} | {row['denominator']} | "
            f"{row['numerator_steps_per_second']:,.0f} | {row['denominator_steps_per_second']:,.0f} | {ratio} | "
            f"{row['numerator_compile_seconds']:.1f} | {row['denominator_compile_seconds']:.1f} | "
            f"{row['compile_seconds_ratio']:.2f} | {row['outside_training_seconds_ratio']:.2f} | "
            f"{row['numerator_peak_rss_mb']:,.0f} | {row['denominator_peak_rss_mb']:,.0f} | "
            f"{row['numerator_final_return']:.1f} | {row['denominator_final_return']:.1f} | {row['guard'] or '-'} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- the record of a run


# Vector instruction sets XLA's CPU kernels use when present: two runs compare only on the same ones.
VECTOR_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def cpu_description(cpuinfo: str) -> dict[str, Any]:
    """The CPU model and the vector instruction sets it has, from /proc/cpuinfo's text
    (the first processor's fields; None and [] where the text does not say)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name") or None,
            "cpu_vector_isa": [flag for flag in VECTOR_ISA_FLAGS if flag in flags]}


def read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return handle.read()
    except OSError:  # not Linux
        return ""


def machine_description(cpu: dict[str, Any]) -> dict[str, Any]:
    """The machine of a run, `cpu` from `cpu_description`; starts JAX's backend in this process."""
    import jax

    return {
        "date": time.strftime("%Y-%m-%d"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **cpu,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
    }


def versions_of(packages: Sequence[str]) -> dict[str, Optional[str]]:
    """Each package's installed version (None: not installed)."""
    versions: dict[str, Optional[str]] = {}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def package_versions() -> dict[str, Optional[str]]:
    """The versions of the peers and of the libraries they share with jaxddppo (None: not installed)."""
    return versions_of(("rejax", "gymnax", "flax", "optax", "distrax"))


def revision(path: Path) -> Optional[str]:
    """`git describe --always --dirty` of the checkout at `path`; None where git cannot say."""
    try:
        process = subprocess.run(["git", "-C", str(path), "describe", "--always", "--dirty"],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return process.stdout.strip() if process.returncode == 0 else None


def describe_sources(sources: Sources) -> dict[str, dict[str, Any]]:
    paths = {**sources.checkouts, **({"purejaxrl": sources.purejaxrl} if sources.purejaxrl else {})}
    return {name: {"path": str(path), "revision": revision(path)} for name, path in paths.items()}


def build_report(plan: Plan, measurements: Mapping[Trial, list[dict[str, Any]]], table: Sequence[dict[str, Any]],
                 command: str, cpu: dict[str, Any]) -> dict[str, Any]:
    """The raw record of a run (`--out`): the machine, the code measured, the configs, the table
    (`summarise`'s) and every measurement."""
    return {
        "command": command,
        "machine": machine_description(cpu),
        "versions": package_versions(),
        "sources": describe_sources(plan.sources),
        "configs": dict(plan.specs),
        "repeats": plan.repeats,
        "table": list(table),
        "measurements": [{"trial": asdict(trial), "label": trial.label, "results": results}
                         for trial, results in measurements.items()],
    }


# ---------------------------------------------------------------- the command line


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit code 2 (as jaxddppo.cli's: this
    driver imports no jaxddppo, whose checkout would be a guess)."""

    def error(self, message: str) -> None:
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_ARGUMENTS)


def names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python benchmarks/bench.py",
        description="Benchmark jaxddppo side by side with another checkout of it (--baseline) and with peer PPO "
        "implementations (rejax: pip install -e '.[bench]'). Trials alternate over the rounds; tables report "
        f"medians and the medians of per-round ratios. Exit codes: 0 done, {EXIT_TRIAL_FAILED} a trial failed, "
        f"{EXIT_BAD_ARGUMENTS} bad arguments, {EXIT_GUARD_FAILED} a guarded ratio out of bounds.",
    )
    parser.add_argument("--suites", default=",".join(DEFAULT_SUITES),
                        help=f"comma-separated suites of {', '.join(SUITES)} (default: {','.join(DEFAULT_SUITES)})")
    parser.add_argument("--baseline", type=Path, metavar="PATH",
                        help="another checkout of jaxddppo, measured against this one by the guard suite")
    parser.add_argument("--peers", default="rejax",
                        help=f"comma-separated peers of {', '.join(PEERS)} for the small, large and population "
                        "suites (default: rejax)")
    parser.add_argument("--purejaxrl", type=Path, metavar="PATH", help=f"a clone of {PUREJAXRL_URL}")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of alternating trials (default 3)")
    parser.add_argument("--total-env-steps", type=int, metavar="N",
                        help="override every config's env steps (per seed), e.g. for a quick check; a config "
                        "whose one update (envs x steps) is larger takes one update")
    parser.add_argument("--out", metavar="FILE", help="write the raw measurements and tables as JSON to FILE")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per trial (default 1800)")
    args = parser.parse_args(argv)
    args.suites, args.peers = names(args.suites), names(args.peers)
    problem = argument_problem(args)
    if problem:
        parser.error(problem)
    return args


def argument_problem(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the parsed arguments, in one line; None if nothing."""
    unknown = [suite for suite in args.suites if suite not in SUITES]
    if unknown or not args.suites:
        return f"--suites={','.join(unknown) or '(none)'} is not a suite; choose from {', '.join(SUITES)}"
    unknown = [peer for peer in args.peers if peer not in PEERS]
    if unknown or not args.peers:
        return f"--peers={','.join(unknown) or '(none)'} is not a peer; choose from {', '.join(PEERS)}"
    if "guard" in args.suites and args.baseline is None:
        return "--suites=guard needs --baseline PATH, another checkout of jaxddppo"
    if args.baseline is not None and "guard" not in args.suites:
        return "--baseline is read only by the guard suite; add guard to --suites"
    if args.baseline is not None and not (args.baseline / "jaxddppo" / "train.py").is_file():
        return f"--baseline={args.baseline} is not a checkout of jaxddppo (no jaxddppo/train.py there)"
    if "purejaxrl" in args.peers and args.purejaxrl is None:
        return f"--peers=purejaxrl needs --purejaxrl PATH, a clone of {PUREJAXRL_URL}"
    if args.purejaxrl is not None and "purejaxrl" not in args.peers:
        return "--purejaxrl is read only when --peers names purejaxrl"
    if args.purejaxrl is not None and not (args.purejaxrl / "purejaxrl" / "ppo.py").is_file():
        return f"--purejaxrl={args.purejaxrl} is not a clone of {PUREJAXRL_URL} (no purejaxrl/ppo.py there)"
    if "population" in args.suites and not set(args.peers) & set(POPULATION_PEERS):
        return f"--suites=population measures against {', '.join(POPULATION_PEERS)} only; add it to --peers"
    if args.repeats < 1:
        return f"--repeats={args.repeats} must be at least 1"
    if args.total_env_steps is not None and args.total_env_steps < 1:
        return f"--total-env-steps={args.total_env_steps} must be at least 1"
    return None


def make_plan(args: argparse.Namespace) -> Plan:
    checkouts = {"jaxddppo": REPO_ROOT}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()
    specs = {name: dict(config) for name, config in CONFIGS.items()}
    if args.total_env_steps is not None:
        for spec in specs.values():
            spec["total_env_steps"] = max(args.total_env_steps, spec["num_envs"] * spec["num_steps"])
    return Plan(rows=tuple(comparisons(args.suites, args.peers)), specs=specs,
                sources=Sources(checkouts, args.purejaxrl.resolve() if args.purejaxrl else None),
                repeats=args.repeats, timeout=args.timeout)


def guard_failures(table: Sequence[dict[str, Any]]) -> list[str]:
    return [f"{row['numerator']} / baseline" for row in table if row["guard"] == "FAIL"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    contenders = {trial.contender for trial in distinct_trials(plan.rows)}
    if "rejax" in contenders and importlib.util.find_spec("rejax") is None:
        print("error: rejax is not installed; install the peers with: pip install -e '.[bench]'", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    # JAX's backend stays unstarted in this process until the trials are done: the machine
    # line needs only the CPU.
    cpu = cpu_description(read_cpuinfo())
    vector_isa = ", ".join(cpu["cpu_vector_isa"]) or "none of " + ", ".join(VECTOR_ISA_FLAGS)
    print(f"machine: {cpu['cpu_model'] or 'CPU model unknown'} ({vector_isa}), {os.cpu_count()} CPUs", flush=True)
    try:
        measurements = run_plan(plan)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_TRIAL_FAILED
    table = summarise(plan.rows, measurements)
    print(format_table(table))
    if args.out:
        command = "python benchmarks/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "w") as handle:
            json.dump(build_report(plan, measurements, table, command, cpu), handle, indent=1)
        print(f"wrote {args.out}")
    failures = guard_failures(table)
    if any(row["guard"] for row in table):
        print(f"guard (steps/s at least {GUARD_MIN_STEPS_RATIO}x, seconds outside training at most "
              f"{GUARD_MAX_OUTSIDE_TRAINING_RATIO}x): "
              + (f"FAIL: {'; '.join(failures)}" if failures else "pass"))
    return EXIT_GUARD_FAILED if failures else 0


if __name__ == "__main__":
    sys.exit(main())
