"""Train: `python -m jaxddppo.train --config FILE [section.key=value ...]`.

The host loop is thin: build (config -> topology -> env + network -> update),
compile K updates as one call, then call, block, time, log, repeat; evaluate and
write the summary at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from jaxddppo import sharding
from jaxddppo.config import Config, ConfigError, as_config, help_text, load_config, to_yaml
from jaxddppo.envs import BatchedEnv, make_env
from jaxddppo.evaluation import evaluate_policy
from jaxddppo.logging import METRIC_FIELDS, MetricsWriter, Progress, write_json
from jaxddppo.networks import ActorCritic, make_actor_critic
from jaxddppo.ppo import (
    PPOHyperparams,
    TrainState,
    UpdateMetrics,
    UpdateSettings,
    init_train_state,
    make_update,
)


@dataclass(frozen=True)
class Experiment:
    """Everything static about a run, and its compiled-on-demand entry points."""

    config: Config
    topology: sharding.Topology
    mesh: jax.sharding.Mesh
    env: BatchedEnv
    network: ActorCritic
    settings: UpdateSettings
    hyperparams: PPOHyperparams

    def init_state(self) -> TrainState:
        """The global training state: leaves [num_shards, ...] split over the mesh."""
        topology = self.topology

        def init_shard(shard_index: jax.Array) -> TrainState:
            return init_train_state(
                shard_index, self.config.train.seed, self.env, self.network,
                topology.num_envs_per_shard, self.hyperparams, self.settings,
            )

        indices = sharding.global_shard_indices(self.mesh, topology.num_shards)
        return sharding.shard_parallel(init_shard, self.mesh)(indices)

    def learn_fn(self, num_updates: int) -> Callable[[TrainState], tuple[TrainState, UpdateMetrics]]:
        """`num_updates` updates in one jitted call; metrics leaves are [num_shards, num_updates]."""
        update = make_update(self.env, self.network, self.settings)
        hyperparams = self.hyperparams

        def learn(state: TrainState) -> tuple[TrainState, UpdateMetrics]:
            return jax.lax.scan(lambda s, _: update(s, hyperparams), state, length=num_updates)

        return sharding.shard_parallel(learn, self.mesh, donate_argnums=(0,))


def build(config: Config, devices: Optional[Sequence[jax.Device]] = None) -> Experiment:
    """Validate everything that needs the environment and the devices; compile nothing.

    `devices` defaults to every device of every process.
    """
    env = make_env(config.env.id)
    mesh = sharding.make_mesh(devices)
    topology = sharding.make_topology(config, num_devices=mesh.devices.size)
    network = make_actor_critic(config.network, env.spec)
    return Experiment(
        config=config,
        topology=topology,
        mesh=mesh,
        env=env,
        network=network,
        settings=UpdateSettings.from_config(config.ppo, topology),
        hyperparams=PPOHyperparams.from_config(config.ppo),
    )


@dataclass(frozen=True)
class TrainResult:
    """What `run` returns: the summary (as written to summary.json), final state and run dir."""

    summary: dict
    state: TrainState
    run_dir: str


def claim_run_dir(path: Optional[str], env_id: str) -> str:
    """Create the run directory and claim it by creating metrics.jsonl exclusively.

    An explicit `run.dir` that already holds a run is refused (nothing is
    overwritten, even by two runs started together); the default
    `runs/<env>-<timestamp>` takes a numbered suffix instead.
    """
    explicit = path is not None
    base = path if explicit else os.path.join("runs", f"{env_id}-{time.strftime('%Y%m%d-%H%M%S')}")
    candidate, attempt = base, 1
    while True:
        if os.path.exists(candidate) and not os.path.isdir(candidate):
            raise ConfigError(f"run.dir={candidate!r} exists and is not a directory")
        try:
            os.makedirs(candidate, exist_ok=True)
            open(os.path.join(candidate, "metrics.jsonl"), "x").close()
            return candidate
        except FileExistsError:
            if explicit:
                raise ConfigError(
                    f"run.dir={candidate!r} already holds a run (metrics.jsonl); choose another run.dir"
                ) from None
            attempt += 1
            candidate = f"{base}-{attempt}"
        except OSError as error:
            raise ConfigError(f"run.dir={candidate!r} cannot be created: {error.strerror}") from None


def metrics_rows(metrics: UpdateMetrics, first_update: int, env_steps_per_update: int,
                 wall_seconds: float) -> list[dict]:
    """One dict per update from the metrics of one chunk (host arrays [num_updates])."""
    columns = {name: np.asarray(value, np.float64) for name, value in vars(metrics).items()}
    rows = []
    for offset in range(len(columns["policy_loss"])):
        update = first_update + offset + 1
        row: dict[str, Any] = {
            "update": update,
            "env_steps": update * env_steps_per_update,
            "wall_seconds": round(wall_seconds, 3),
        }
        row.update({name: float(values[offset]) for name, values in columns.items()})
        row["episodes_completed"] = int(row["episodes_completed"])
        rows.append(row)
    assert set(rows[0]) == set(METRIC_FIELDS), "metrics.jsonl fields and their documentation differ"
    return rows


def chunk_episode_return(metrics: UpdateMetrics) -> Optional[float]:
    """Mean return over the episodes that ended in a chunk, weighted by their count."""
    counts = np.asarray(metrics.episodes_completed, np.float64)
    if counts.sum() == 0:
        return None
    returns = np.nan_to_num(np.asarray(metrics.episode_return_mean, np.float64))
    return float((returns * counts).sum() / counts.sum())


def chunk_sizes(num_updates: int, updates_per_chunk: int) -> list[int]:
    full, remainder = divmod(num_updates, updates_per_chunk)
    return [updates_per_chunk] * full + ([remainder] if remainder else [])


def process_label() -> str:
    return f" (process {jax.process_index()} of {jax.process_count()})" if jax.process_count() > 1 else ""


def compile_chunks(experiment: Experiment, state: TrainState) -> dict[int, Any]:
    """The compiled learn call for every chunk size the run needs (at most two)."""
    topology = experiment.topology
    sizes = sorted(set(chunk_sizes(topology.num_updates, topology.updates_per_chunk)))
    return {size: experiment.learn_fn(size).lower(state).compile() for size in sizes}


@dataclass(frozen=True)
class LoopResult:
    state: TrainState
    train_seconds: float
    final_episode_return: Optional[float]


def train_chunks(experiment: Experiment, state: TrainState, compiled: dict[int, Any],
                 writer: Optional[MetricsWriter], progress: Progress) -> LoopResult:
    """Call, block, time, log: the host loop over chunks of updates."""
    topology = experiment.topology
    train_seconds, updates_done, last_return = 0.0, 0, None
    for size in chunk_sizes(topology.num_updates, topology.updates_per_chunk):
        chunk_start = time.perf_counter()
        state, metrics = compiled[size](state)
        metrics = sharding.first_shard(metrics)  # blocks until the chunk is done
        chunk_seconds = time.perf_counter() - chunk_start
        train_seconds += chunk_seconds
        if writer is not None:
            writer.write(metrics_rows(metrics, updates_done, topology.env_steps_per_update, train_seconds))
        updates_done += size
        if experiment.config.debug.check_replicas:
            sharding.check_replicas(state.params, experiment.mesh, updates_done)
        chunk_return = chunk_episode_return(metrics)
        last_return = chunk_return if chunk_return is not None else last_return
        progress.update(
            updates_done * topology.env_steps_per_update,
            size * topology.env_steps_per_update / chunk_seconds,
            last_return,
        )
    return LoopResult(state, train_seconds, last_return)


def summarise(experiment: Experiment, loop: LoopResult, compile_seconds: float) -> dict:
    """Evaluate the final policy deterministically and assemble summary.json."""
    config, topology = experiment.config, experiment.topology
    evaluation = jax.jit(evaluate_policy, static_argnums=(0, 1, 4))(
        experiment.env, experiment.network, sharding.first_shard(loop.state.params),
        jax.random.fold_in(jax.random.key(config.train.seed), 2), config.eval.num_episodes,
    )
    eval_returns = np.asarray(evaluation.returns, np.float64)
    total_env_steps = topology.num_updates * topology.env_steps_per_update
    return {
        "env_id": config.env.id,
        "total_env_steps": total_env_steps,
        "num_updates": topology.num_updates,
        "num_devices": topology.num_devices,
        "num_shards": topology.num_shards,
        "num_processes": topology.num_processes,
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "compile_seconds": round(compile_seconds, 3),
        "train_seconds": round(loop.train_seconds, 3),
        "env_steps_per_second": round(total_env_steps / loop.train_seconds, 1),
        "final_episode_return": loop.final_episode_return,
        "eval_return_mean": float(eval_returns.mean()),
        "eval_return_std": float(eval_returns.std()),
        "eval_length_mean": float(np.asarray(evaluation.lengths, np.float64).mean()),
        "eval_episodes": config.eval.num_episodes,
        "params_digest": sharding.params_digest(loop.state.params),
    }


def run(config: Config, devices: Optional[Sequence[jax.Device]] = None) -> TrainResult:
    """Train with `config`, writing config.yaml, metrics.jsonl and summary.json to the run dir.

    Joins a multi-process run first when `config.distributed` asks for one.
    """
    if not jax.distributed.is_initialized():
        sharding.initialize_distributed(config.distributed)
    experiment = build(config, devices)
    topology = experiment.topology
    config = replace(config, train=replace(config.train, num_shards=topology.num_shards))
    is_writer = jax.process_index() == 0
    run_dir = claim_run_dir(config.run.dir, config.env.id) if is_writer else ""
    if is_writer:
        with open(os.path.join(run_dir, "config.yaml"), "w") as handle:
            handle.write(to_yaml(replace(config, run=replace(config.run, dir=run_dir))))
    progress = Progress(topology.num_updates * topology.env_steps_per_update, config.run.progress and is_writer)
    where = f"writing to {run_dir}" if is_writer else "process 0 writes the results"
    progress.message(
        f"jaxddppo{process_label()}: {config.env.id}, {topology.num_envs} envs in {topology.num_shards} shard(s) on "
        f"{topology.num_devices} {jax.default_backend()} device(s), {topology.num_processes} process(es); "
        f"{topology.num_updates} updates of {topology.env_steps_per_update} steps; {where}"
    )
    compile_start = time.perf_counter()
    state = experiment.init_state()
    compiled = compile_chunks(experiment, state)
    jax.block_until_ready(state)
    compile_seconds = time.perf_counter() - compile_start

    writer = MetricsWriter(os.path.join(run_dir, "metrics.jsonl")) if is_writer else None
    try:
        loop = train_chunks(experiment, state, compiled, writer, progress)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    summary = summarise(experiment, loop, compile_seconds)
    if is_writer:
        write_json(os.path.join(run_dir, "summary.json"), summary)
    progress.message(
        f"done{process_label()}: {summary['total_env_steps']:,} steps in {loop.train_seconds:.1f} s "
        f"({summary['env_steps_per_second']:,.0f} steps/s, compile {compile_seconds:.1f} s); "
        f"eval return {summary['eval_return_mean']:.1f} +- {summary['eval_return_std']:.1f}"
        + (f"; {run_dir}/summary.json" if is_writer else "")
    )
    return TrainResult(summary=summary, state=loop.state, run_dir=run_dir)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints usage on a second line
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="python -m jaxddppo.train",
        description="Train PPO (DD-PPO) on every local device. Options are set in a YAML file "
        "(--config) and overridden as section.key=value.",
        epilog="configuration keys, set in the YAML file or as section.key=value (type, default): meaning\n" + help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config file, e.g. experiments/cartpole.yaml")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override one option")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        run(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (sharding.DistributedError, sharding.ReplicaDivergence) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


class _CallableModule(types.ModuleType):
    """`jaxddppo.train(config)` calls `run`; the module stays a module."""

    def __call__(self, config: Union[Config, Mapping, str], devices: Optional[Sequence[jax.Device]] = None
                 ) -> TrainResult:
        return run(as_config(config), devices)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
