"""Benchmarks: `python benchmarks/bench.py [--suites ...] [--repeats N] [--out FILE]`.

jaxddppo against rejax's PPO (installed by the `bench` extra) on the same
machine, in the same run: every measurement is a fresh subprocess (its own
compile, its own peak memory, its own simulated device count), and the trials
of all selected suites take turns, A B C A B C ..., so that a slow minute of a
noisy machine falls on every contender alike. Each table reports medians over
the repeats and ratios as the median of the per-round ratios.

Steps/s are steady-state, compile excluded: for jaxddppo the training after its
first chunk of updates (from metrics.jsonl), for rejax, which trains in one
call, a second call of the compiled program. The first run's steps/s (all of
training, first execution included) is recorded beside them.

Suites:
  small       1 device, PureJaxRL's CartPole config: jaxddppo with one CPU thread
              (run.cpu_threads=1) vs rejax as it runs by default and with one thread too
  large       the same with 2048 environments: jaxddppo vs rejax
  scaling     jaxddppo on 2 devices vs its best on 1 device, small and large configs
  population  1, 8 and 32 seeds of the small config: a jaxddppo sweep vs rejax vmapped;
              32 seeds also on 2 devices, and with one CPU thread each

rejax runs in processes that never import jaxddppo, so it runs as its users run
it (jaxddppo's faster CPU lowering of the Threefry hash is not installed there).
A trial's CPU thread count is XLA's CPU thread pool size, set through
PJRT_NPROC for either contender (0: XLA's default, one thread per core).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

from jaxddppo.cli import OneLineParser

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
CONFIGS: dict[str, dict[str, Any]] = {
    "small": SMALL_CONFIG,
    "large": {**SMALL_CONFIG, "num_envs": 2048, "total_env_steps": 2048 * 128 * 20},
}
SUITES = ("small", "large", "scaling", "population")
POPULATION_SEEDS = (1, 8, 32)
RESULT_PREFIX = "BENCH_RESULT "


@dataclass(frozen=True)
class Trial:
    """One kind of measurement: a contender on a config, a device count, a number of seeds
    (0: a single run; n >= 1: a population of n seeds, vmapped) and a CPU thread pool
    size (0: XLA's default)."""

    contender: str  # "jaxddppo" or "rejax"
    config: str  # a key of CONFIGS
    devices: int = 1
    seeds: int = 0
    cpu_threads: int = 0

    @property
    def label(self) -> str:
        population = f", {self.seeds} seeds" if self.seeds else ""
        threads = f", {self.cpu_threads} CPU thread(s)" if self.cpu_threads else ""
        return f"{self.contender} {self.config}, {self.devices} device(s){population}{threads}"


@dataclass(frozen=True)
class Comparison:
    """A table row: `numerator` against `denominator` (steps/s ratio), within a suite."""

    suite: str
    numerator: Trial
    denominator: Trial


def comparisons(suites: Sequence[str]) -> list[Comparison]:
    rows = []
    # One CPU thread makes the small config's tiny operations run faster (docs/benchmarks.md);
    # the large config's larger ones use every core.
    small_best = Trial("jaxddppo", "small", cpu_threads=1)
    for suite in suites:
        if suite == "small":
            rows.append(Comparison(suite, small_best, Trial("rejax", "small")))
            rows.append(Comparison(suite, small_best, Trial("rejax", "small", cpu_threads=1)))
            rows.append(Comparison(suite, small_best, Trial("jaxddppo", "small")))
        elif suite == "large":
            rows.append(Comparison(suite, Trial("jaxddppo", "large"), Trial("rejax", "large")))
        elif suite == "scaling":
            rows.append(Comparison(suite, Trial("jaxddppo", "small", devices=2), small_best))
            rows.append(Comparison(suite, Trial("jaxddppo", "large", devices=2), Trial("jaxddppo", "large")))
        elif suite == "population":
            for seeds in POPULATION_SEEDS:
                rows.append(Comparison(suite, Trial("jaxddppo", "small", seeds=seeds),
                                       Trial("rejax", "small", seeds=seeds)))
            largest = POPULATION_SEEDS[-1]
            rows.append(Comparison(suite, Trial("jaxddppo", "small", devices=2, seeds=largest),
                                   Trial("rejax", "small", seeds=largest)))
            # On one device, as experiments/cartpole.yaml runs it (one thread), against rejax
            # as its users run it and with one thread too.
            one_thread = Trial("jaxddppo", "small", seeds=largest, cpu_threads=1)
            rows.append(Comparison(suite, one_thread, Trial("rejax", "small", seeds=largest)))
            rows.append(Comparison(suite, one_thread, Trial("rejax", "small", seeds=largest, cpu_threads=1)))
        else:
            raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    return rows


def distinct_trials(rows: Sequence[Comparison]) -> list[Trial]:
    trials: list[Trial] = []
    for row in rows:
        for trial in (row.numerator, row.denominator):
            if trial not in trials:
                trials.append(trial)
    return trials


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def xla_cpu_pool_threads() -> Optional[int]:
    """Threads of XLA's CPU thread pool in this process (Linux names them tf_XLAEigen), or None
    where /proc does not list threads."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    count = 0
    for task in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, task, "comm")) as handle:
                count += handle.read().strip() == "tf_XLAEigen"
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return count


# ---------------------------------------------------------------- workers (one per subprocess)


def jaxddppo_config(spec: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """The jaxddppo config of a benchmark spec: no checkpoints in between, no progress output."""
    return {
        "env": {"id": spec["env_id"], "num_envs": spec["num_envs"]},
        "network": {"hidden_sizes": spec["hidden_sizes"], "activation": spec["activation"]},
        "ppo": {
            "num_steps": spec["num_steps"], "num_epochs": spec["num_epochs"],
            "num_minibatches": spec["num_minibatches"], "learning_rate": spec["learning_rate"],
            "anneal_lr": False, "gamma": spec["gamma"], "gae_lambda": spec["gae_lambda"],
            "clip_eps": spec["clip_eps"], "vf_coef": spec["vf_coef"], "ent_coef": spec["ent_coef"],
            "max_grad_norm": spec["max_grad_norm"],
        },
        "train": {"total_env_steps": spec["total_env_steps"]},
        "checkpoint": {"every_updates": 0, "every_seconds": 0},
        "run": {"dir": run_dir, "progress": False},
    }


def steady_state(metrics_path: str, members: int) -> tuple[int, float]:
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


def run_jaxddppo(spec: dict[str, Any], seeds: int) -> dict[str, Any]:
    import jaxddppo

    with tempfile.TemporaryDirectory(prefix="jaxddppo-bench-") as scratch:
        config = jaxddppo_config(spec, os.path.join(scratch, "run"))
        if seeds:
            result = jaxddppo.run_sweep(config, seeds=seeds)
            summary, run_dir = result.summary, result.run_dir
            final_return = summary["best_eval_return_mean"]  # one setting: the mean over seeds
        else:
            result = jaxddppo.run(config)
            summary, run_dir = result.summary, result.run_dir
            final_return = summary["eval_return_mean"]
        steady_steps, steady_seconds = steady_state(os.path.join(run_dir, "metrics.jsonl"), max(seeds, 1))
    return {
        "env_steps": summary["total_env_steps"],
        "train_seconds": summary["train_seconds"],
        "steady_env_steps": steady_steps,
        "steady_seconds": steady_seconds,
        "compile_seconds": summary["compile_seconds"],
        "final_return": final_return,
    }


class _FiveValueStep:
    """A gymnax 1.0 environment whose `step` returns (obs, state, reward, done, info), as
    rejax 0.1.3 expects; done = terminated or truncated."""

    def __init__(self, env: Any):
        self.env = env

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.env, name)

    def step(self, key: Any, state: Any, action: Any, params: Any = None) -> tuple:
        import jax.numpy as jnp

        obs, state, reward, terminated, truncated, info = self.env.step(key, state, action, params)
        return obs, state, reward, jnp.logical_or(terminated, truncated), info


def run_rejax(spec: dict[str, Any], seeds: int) -> dict[str, Any]:
    import gymnax
    import jax
    import jax.numpy as jnp
    from rejax import PPO
    from rejax.evaluate import evaluate_single

    assert "jaxddppo.envs" not in sys.modules, "rejax must run with JAX's own lowerings"
    env, env_params = gymnax.make(spec["env_id"])
    env = _FiveValueStep(env)
    total = spec["total_env_steps"]
    algo = PPO.create(
        env=env, env_params=env_params, num_envs=spec["num_envs"], num_steps=spec["num_steps"],
        num_epochs=spec["num_epochs"], num_minibatches=spec["num_minibatches"],
        learning_rate=spec["learning_rate"], max_grad_norm=spec["max_grad_norm"], gamma=spec["gamma"],
        gae_lambda=spec["gae_lambda"], clip_eps=spec["clip_eps"], vf_coef=spec["vf_coef"],
        ent_coef=spec["ent_coef"], total_timesteps=total, eval_freq=total, skip_initial_evaluation=True,
        agent_kwargs={"activation": spec["activation"], "hidden_layer_sizes": tuple(spec["hidden_sizes"])},
    )
    # Training only: rejax's periodic evaluation is replaced by nothing and the final return
    # is measured after the clock stops.
    algo = algo.replace(eval_callback=lambda algo, train_state, key: jnp.zeros(()))
    keys = jax.random.split(jax.random.key(0), max(seeds, 1))
    train = jax.jit(jax.vmap(algo.train)) if seeds else jax.jit(algo.train)
    argument = keys if seeds else keys[0]
    start = time.perf_counter()
    compiled = train.lower(argument).compile()
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    train_state, _ = compiled(argument)
    jax.block_until_ready(train_state)
    train_seconds = time.perf_counter() - start
    # rejax trains in one call: its steady state is a second call of the compiled program.
    start = time.perf_counter()
    jax.block_until_ready(compiled(argument))
    steady_seconds = time.perf_counter() - start

    max_steps = int(env_params.max_steps_in_episode)

    def member_return(actor_params: Any, key: jax.Array) -> jax.Array:
        def act(obs: jax.Array, rng: jax.Array) -> jax.Array:
            return jnp.squeeze(algo.actor.apply(actor_params, obs[None], rng, method="act"))

        episode_keys = jax.random.split(key, 128)
        _, returns = jax.vmap(lambda k: evaluate_single(act, env, env_params, k, max_steps))(episode_keys)
        return returns.mean()

    actor_params = train_state.actor_ts.params
    if seeds:
        returns = jax.jit(jax.vmap(member_return, in_axes=(0, None)))(actor_params, jax.random.key(1))
    else:
        returns = jax.jit(member_return)(actor_params, jax.random.key(1))
    iterations = -(-total // (spec["num_envs"] * spec["num_steps"]))
    env_steps = iterations * spec["num_envs"] * spec["num_steps"] * max(seeds, 1)
    return {
        "env_steps": env_steps,
        "train_seconds": train_seconds,
        "steady_env_steps": env_steps,
        "steady_seconds": steady_seconds,
        "compile_seconds": compile_seconds,
        "final_return": float(jnp.mean(returns)),
    }


WORKERS: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    "jaxddppo": run_jaxddppo,
    "rejax": run_rejax,
}


def worker_main(trial: Trial, spec: dict[str, Any]) -> None:
    """Run one trial in this process and print its result as one JSON line."""
    result = WORKERS[trial.contender](spec, trial.seeds)
    result["steps_per_second"] = result["steady_env_steps"] / result["steady_seconds"]
    result["first_run_steps_per_second"] = result["env_steps"] / result["train_seconds"]
    result["peak_rss_mb"] = peak_rss_mb()
    result["xla_cpu_pool_threads"] = xla_cpu_pool_threads()
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the driver


class BenchError(RuntimeError):
    """A trial failed; the message names it and ends with its error output."""


def run_trial(trial: Trial, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One measurement in a fresh subprocess with `trial.devices` simulated CPU devices."""
    from jaxddppo.sharding import CPU_DEVICE_COUNT_FLAG, environment_for_own_cpu_threads

    env = environment_for_own_cpu_threads(os.environ)
    if trial.cpu_threads:
        env["PJRT_NPROC"] = str(trial.cpu_threads)
    env["XLA_FLAGS"] = " ".join(
        [flag for flag in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in flag]
        + [f"{CPU_DEVICE_COUNT_FLAG}={trial.devices}"]
    )
    command = [sys.executable, __file__, "--worker", json.dumps(asdict(trial)),
               "--spec", json.dumps(spec)]
    start = time.perf_counter()
    try:
        process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{trial.label}: no result within {timeout:.0f} s") from None
    lines = [line for line in process.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if process.returncode != 0 or not lines:
        tail = "\n".join(process.stderr.strip().splitlines()[-15:])
        raise BenchError(f"{trial.label}: exit code {process.returncode}\n{tail}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["wall_seconds"] = time.perf_counter() - start
    return result


def median_of(results: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.median(result[key] for result in results)


def summarise(rows: Sequence[Comparison], measurements: dict[Trial, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One dict per comparison: both trials' medians and the median of the per-round ratios."""
    table = []
    for row in rows:
        numerator, denominator = measurements[row.numerator], measurements[row.denominator]
        ratios = [a["steps_per_second"] / b["steps_per_second"] for a, b in zip(numerator, denominator)]
        entry: dict[str, Any] = {"suite": row.suite, "numerator": row.numerator.label,
                                 "denominator": row.denominator.label}
        for side, results in (("numerator", numerator), ("denominator", denominator)):
            for key in ("steps_per_second", "first_run_steps_per_second", "compile_seconds", "peak_rss_mb",
                        "final_return"):
                entry[f"{side}_{key}"] = median_of(results, key)
        entry["steps_per_second_ratio"] = statistics.median(ratios)
        entry["round_ratios"] = ratios
        if row.suite == "scaling":
            entry["scaling_efficiency"] = entry["steps_per_second_ratio"] / row.numerator.devices
        table.append(entry)
    return table


def format_table(table: Sequence[dict[str, Any]]) -> str:
    header = ("| suite | A | B | A steps/s | B steps/s | A / B | A compile s | B compile s | "
              "A peak MB | B peak MB | A return | B return |")
    lines = [header, "|" + "---|" * 12]
    for row in table:
        ratio = f"{row['steps_per_second_ratio']:.2f}"
        if "scaling_efficiency" in row:
            ratio += f" (eff. {row['scaling_efficiency']:.2f})"
        lines.append(
            f"| {row['suite']} | {row['numerator']} | {row['denominator']} | "
            f"{row['numerator_steps_per_second']:,.0f} | {row['denominator_steps_per_second']:,.0f} | {ratio} | "
            f"{row['numerator_compile_seconds']:.1f} | {row['denominator_compile_seconds']:.1f} | "
            f"{row['numerator_peak_rss_mb']:,.0f} | {row['denominator_peak_rss_mb']:,.0f} | "
            f"{row['numerator_final_return']:.1f} | {row['denominator_final_return']:.1f} |"
        )
    return "\n".join(lines)


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


def peer_versions() -> dict[str, Optional[str]]:
    from importlib import metadata

    versions: dict[str, Optional[str]] = {}
    for package in ("jaxddppo", "rejax", "gymnax", "flax", "optax"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python benchmarks/bench.py",
        description="Benchmark jaxddppo against rejax's PPO side by side (install the peers with "
        "pip install -e '.[bench]'). Trials alternate over the repeats; tables report medians and ratios.",
    )
    parser.add_argument("--suites", default=",".join(SUITES),
                        help=f"comma-separated suites to run (default: all of {', '.join(SUITES)})")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of alternating trials (default 3)")
    parser.add_argument("--total-env-steps", type=int, metavar="N",
                        help="override every config's env steps (per seed), e.g. for a quick check")
    parser.add_argument("--out", metavar="FILE", help="write the raw measurements and tables as JSON to FILE")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per trial (default 1800)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        args.suites = [suite.strip() for suite in args.suites.split(",") if suite.strip()]
        unknown = [suite for suite in args.suites if suite not in SUITES]
        if unknown or not args.suites:
            parser.error(f"--suites={','.join(unknown) or '(none)'} is not a suite; choose from {', '.join(SUITES)}")
        if args.repeats < 1:
            parser.error(f"--repeats={args.repeats} must be at least 1")
        if args.total_env_steps is not None and args.total_env_steps < 1:
            parser.error(f"--total-env-steps={args.total_env_steps} must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker_main(Trial(**json.loads(args.worker)), json.loads(args.spec))
        return 0
    rows = comparisons(args.suites)
    trials = distinct_trials(rows)
    if any(trial.contender == "rejax" for trial in trials) and peer_versions()["rejax"] is None:
        print("error: rejax is not installed; install the peers with: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    specs = {name: dict(config) for name, config in CONFIGS.items()}
    if args.total_env_steps is not None:
        for spec in specs.values():
            spec["total_env_steps"] = args.total_env_steps
    # JAX's backend stays unstarted in this process until the trials are done: the machine
    # line needs only the CPU.
    cpu = cpu_description(read_cpuinfo())
    vector_isa = ", ".join(cpu["cpu_vector_isa"]) or "none of " + ", ".join(VECTOR_ISA_FLAGS)
    print(f"machine: {cpu['cpu_model'] or 'CPU model unknown'} ({vector_isa}), {os.cpu_count()} CPUs", flush=True)
    measurements: dict[Trial, list[dict[str, Any]]] = {trial: [] for trial in trials}
    for round_index in range(args.repeats):
        for trial in trials:
            try:
                result = run_trial(trial, specs[trial.config], args.timeout)
            except BenchError as error:
                print(f"error: {error}", file=sys.stderr)
                return 1
            measurements[trial].append(result)
            print(f"round {round_index + 1}/{args.repeats} {trial.label}: {result['steps_per_second']:,.0f} steps/s, "
                  f"compile {result['compile_seconds']:.1f} s, peak {result['peak_rss_mb']:,.0f} MB, "
                  f"return {result['final_return']:.1f}", flush=True)
    table = summarise(rows, measurements)
    print(format_table(table))
    if args.out:
        report = {
            "command": "python benchmarks/bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine_description(cpu),
            "versions": peer_versions(),
            "configs": specs,
            "repeats": args.repeats,
            "table": table,
            "measurements": [{"trial": asdict(trial), "label": trial.label, "results": results}
                             for trial, results in measurements.items()],
        }
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
