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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.flatten_util import ravel_pytree

from jaxddppo import cpu_tuning, sharding
from jaxddppo.checkpoint import (
    PREEMPTED_EXIT_CODE,
    Checkpointer,
    CheckpointError,
    RunCounters,
    SaveSchedule,
    StopSignals,
)
from jaxddppo.cli import OneLineParser
from jaxddppo.config import (
    RESUMABLE_KEYS,
    Config,
    ConfigError,
    as_config,
    help_text,
    load_config,
    load_resume_config,
    to_yaml,
)
from jaxddppo.envs import BatchedEnv, make_env
from jaxddppo.eval_episodes import EvalResult, EvalStats, evaluate_on_shards, evaluate_policy
from jaxddppo.outputs import (METRIC_FIELDS, MetricsSink, Progress, format_mean_std, open_metrics_sink,
                              truncate_metrics, write_json)
from jaxddppo.networks import ActorCritic, make_actor_critic
from jaxddppo.plot import save_learning_curve
from jaxddppo.storage import STORAGE_EXIT_CODE, StorageError, one_line_storage_faults
from jaxddppo.ppo import (
    PPOHyperparams,
    TrainState,
    UpdateMetrics,
    UpdateSettings,
    init_train_state,
    make_update,
)


def run_updates(update: Callable[[TrainState, Any], tuple[TrainState, UpdateMetrics]], hyperparams: Any,
                state: TrainState, num_updates: jax.Array, capacity: int) -> tuple[TrainState, UpdateMetrics]:
    """`num_updates` successive updates (a traced count, 1 to `capacity`) and their metrics,
    stacked [capacity] with zeros after the last one.

    The count is an argument, not the length of a scan, so that one compiled program runs
    every chunk of a run: the last, shorter chunk and the chunks cut short by checkpoints
    need no program of their own. The loop computes what a scan of the same updates
    computes, bit for bit (tests/test_sharding.py).
    """
    update = jax.jit(update, inline=True)  # traced once, for the metrics' shapes and for the loop

    def one_update(index: jax.Array, carry: tuple[TrainState, UpdateMetrics]) -> tuple[TrainState, UpdateMetrics]:
        state, stacked = carry
        state, metrics = update(state, hyperparams)
        return state, jax.tree.map(lambda column, value: column.at[index].set(value), stacked, metrics)

    shapes = jax.eval_shape(update, state, hyperparams)[1]
    stacked = jax.tree.map(lambda shape: jnp.zeros((capacity, *shape.shape), shape.dtype), shapes)
    return jax.lax.fori_loop(0, num_updates, one_update, (state, stacked))


def update_count(mesh: jax.sharding.Mesh, num_updates: int) -> jax.Array:
    """The `num_updates` argument of `run_updates`, replicated on every device of `mesh`."""
    return sharding.shared_array(mesh, np.int32(num_updates))


def abstract_update_count(mesh: jax.sharding.Mesh) -> jax.ShapeDtypeStruct:
    """The shape, dtype and placement of `update_count(mesh, ...)`, for lowering."""
    return jax.ShapeDtypeStruct((), np.int32, sharding=sharding.replicated_sharding(mesh))


@dataclass(frozen=True)
class Member:
    """One member of a population: a grid point and a seed. A single run is the only
    member of its population."""

    index: int
    setting: int
    seed: int
    values: dict[str, Any]  # swept key -> value, as typed in the config (empty for a single run)
    config: Config  # the single run this member is equivalent to


@struct.dataclass
class ShardInputs:
    """Each shard's traced inputs, leaves leading with the state axes ([num_shards] for a
    run, [num_members, num_shards] for a population): its global index within its member,
    and its member's seed and hyperparameters. They are arguments, not constants of the
    programs, so that one compiled program serves every seed and every hyperparameter
    (and JAX's persistent compilation cache serves a run with other ones)."""

    shard_index: jax.Array
    seed: jax.Array
    hyperparams: PPOHyperparams


@dataclass(frozen=True)
class Experiment:
    """Everything static about a population of members, and its compiled-on-demand entry
    points. A single run is a population of one on a mesh without a member axis; a sweep's
    mesh has one (`sharding.make_population_mesh`)."""

    config: Config  # the base config, train.num_shards resolved
    members: tuple[Member, ...]
    topology: sharding.Topology  # of one member
    mesh: jax.sharding.Mesh
    env: BatchedEnv
    network: ActorCritic
    settings: UpdateSettings

    @property
    def is_sweep(self) -> bool:
        """A sweep's outputs name the member of every metrics row, even a population of one."""
        return sharding.is_population(self.mesh)

    @property
    def batch_members(self) -> bool:
        return self.config.train.batch_members

    def init_fn(self) -> Callable[[ShardInputs], TrainState]:
        """`(shard_inputs) -> TrainState`: the initial global state, leaves leading with the state axes."""
        def init_shard(shard: ShardInputs) -> TrainState:
            return init_train_state(
                shard.shard_index, shard.seed, self.env, self.network,
                self.topology.num_envs_per_shard, shard.hyperparams, self.settings,
            )

        # The shards' initial states are keys and elementwise draws, which batching leaves alone
        # (tests/test_sharding.py compares them on 1, 2 and 4 devices).
        return sharding.shard_parallel(sharding.per_shard(init_shard), self.mesh, batch_members=self.batch_members)

    def shard_inputs(self) -> ShardInputs:
        num_shards = self.topology.num_shards
        per_shard = lambda per_member: np.repeat(np.asarray(per_member)[:, None], num_shards, axis=1)
        hyperparams = [PPOHyperparams.from_config(member.config.ppo) for member in self.members]
        return sharding.put_members(ShardInputs(
            shard_index=np.tile(np.arange(num_shards, dtype=np.int32), (len(self.members), 1)),
            seed=per_shard(np.array([member.seed for member in self.members], np.int32)),
            hyperparams=jax.tree.map(lambda *leaves: per_shard(np.stack(leaves)), *hyperparams),
        ), self.mesh)

    def init_state(self) -> TrainState:
        """The global training state, split over the mesh."""
        return self.init_fn()(self.shard_inputs())

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of `init_state()`, computing nothing (a restore target)."""
        placement = sharding.shard_sharding(self.mesh)
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placement),
                            jax.eval_shape(self.init_fn(), self.shard_inputs()))

    def learn_fn(self) -> Callable[[TrainState, ShardInputs, jax.Array], tuple[TrainState, UpdateMetrics, jax.Array]]:
        """`(state, shard_inputs, num_updates)`: up to `updates_per_chunk` updates of every
        member in one jitted call, as many as `num_updates` says (`update_count(mesh, n)`).
        Returns the new state, the metrics (leaves [..., updates_per_chunk] after the state
        axes, see `run_updates`) and whether every parameter is finite afterwards (a bool
        per shard, checked in the same program to spare the host loop a call)."""
        update = make_update(self.env, self.network, self.settings)
        capacity = self.topology.updates_per_chunk

        def learn(state: TrainState, shard: ShardInputs, num_updates: jax.Array
                  ) -> tuple[TrainState, UpdateMetrics, jax.Array]:
            hyperparams = sharding.one_copy(shard.hyperparams)
            state, metrics = run_updates(update, hyperparams, state, num_updates, capacity)
            num_local = shard.shard_index.shape[0]
            return state, sharding.copies(metrics, num_local), sharding.copies(all_finite(state.params), num_local)

        return sharding.shard_parallel(learn, self.mesh, donate_argnums=(0,), shared_argnums=(2,),
                                      batch_members=self.batch_members)

    def eval_fn(self) -> Callable[[Any, Any, jax.Array, ShardInputs], EvalStats]:
        """`(params, obs_moments, update_index, shard_inputs) -> EvalStats`, every argument and leaf per shard.

        The evaluation after update `u` uses the same episode keys whatever the shard count.
        """
        config, topology = self.config, self.topology

        def evaluate(params: Any, obs_moments: Any, update_index: jax.Array, shard: ShardInputs) -> EvalStats:
            params, obs_moments, update_index, seed = sharding.one_copy((params, obs_moments, update_index, shard.seed))
            eval_root = jax.random.fold_in(jax.random.key(seed), 3)
            stats = evaluate_on_shards(
                self.env, self.network, params, jax.random.fold_in(eval_root, update_index), shard.shard_index,
                config.eval.num_episodes, topology.num_shards, self.settings.shards, obs_moments,
            )
            return sharding.copies(stats, shard.shard_index.shape[0])

        return sharding.shard_parallel(evaluate, self.mesh, batch_members=self.batch_members)

    def final_evaluations(self, state: TrainState) -> list[EvalResult]:
        """Every member's final deterministic evaluation of its shard 0, on the host, one
        member after another with one compiled program (`jaxddppo.evaluate` reproduces it)."""
        params, obs_moments = sharding.member_first_shards((state.params, state.obs_moments), self.mesh)
        evaluate = jax.jit(evaluate_policy, static_argnums=(0, 1, 4))
        return [
            evaluate(self.env, self.network, jax.tree.map(lambda leaf: leaf[member.index], params),
                     final_eval_key(member.config), self.config.eval.num_episodes,
                     jax.tree.map(lambda leaf: leaf[member.index], obs_moments))
            for member in self.members
        ]


def assemble(config: Config, members: Sequence[Member], mesh: jax.sharding.Mesh,
             topology: sharding.Topology) -> Experiment:
    """The experiment of `members` (whose configs differ from `config` in seed and
    hyperparameters at most) on `mesh`; compiles nothing."""
    env = make_env(config.env.id, config.env.optimistic_reset_ratio)
    return Experiment(
        config=config,
        members=tuple(members),
        topology=topology,
        mesh=mesh,
        env=env,
        network=make_actor_critic(config.network, env.spec),
        settings=UpdateSettings.from_config(config, topology),
    )


def build(config: Config, devices: Optional[Sequence[jax.Device]] = None) -> Experiment:
    """A single run: a population of one on a mesh over `devices` (default: every device
    of every process). Validates everything that needs the environment and the devices;
    compiles nothing. The experiment's config has train.num_shards resolved."""
    mesh = sharding.make_mesh(devices)
    topology = sharding.make_topology(config, num_devices=mesh.devices.size)
    config = replace(config, train=replace(config.train, num_shards=topology.num_shards))
    member = Member(index=0, setting=0, seed=config.train.seed, values={}, config=config)
    return assemble(config, [member], mesh, topology)


@dataclass(frozen=True)
class TrainResult:
    """What `run` returns (`train_experiment` too, without a summary).

    `summary` is summary.json's content, or None when training stopped before its
    last update (`stopped_by` then names why: a signal or `stop_after_updates`).
    """

    summary: Optional[dict]
    state: TrainState
    run_dir: str
    counters: RunCounters
    compile_seconds: float
    stopped_by: Optional[str] = None

    @property
    def preempted(self) -> bool:
        """Stopped early by a signal (SIGTERM, SIGINT), with a checkpoint to resume from."""
        return self.stopped_by not in (None, "stop_after_updates")


class NonFiniteError(RuntimeError):
    """Training produced NaN or Inf; the message names the update and the quantity."""


def claim_run_dir(path: Optional[str], name: str) -> str:
    """Create the run directory and claim it by creating metrics.jsonl exclusively.

    An explicit `run.dir` that already holds a run is refused (nothing is
    overwritten, even by two runs started together); the default
    `runs/<name>-<timestamp>` takes a numbered suffix instead.
    """
    explicit = path is not None
    base = path if explicit else os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
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
                    f"run.dir={candidate!r} already holds a run (metrics.jsonl); choose another run.dir, "
                    f"or continue it with --resume {candidate}"
                ) from None
            attempt += 1
            candidate = f"{base}-{attempt}"
        except OSError as error:
            raise ConfigError(f"run.dir={candidate!r} cannot be created: {error.strerror}") from None


def shared_run_dir(config: Config, name: str) -> str:
    """Process 0 claims the run directory; every process learns its path (checkpoints need it)."""
    if jax.process_index() != 0:
        run_dir = sharding.broadcast_text("")
        if not run_dir:
            raise sharding.DistributedError("process 0 could not create the run directory; see its error")
        return run_dir
    try:
        run_dir = claim_run_dir(config.run.dir, name)
    except ConfigError:
        sharding.broadcast_text("")
        raise
    return sharding.broadcast_text(run_dir)


def write_config(run_dir: str, config: Config) -> None:
    path = os.path.join(run_dir, "config.yaml")
    with open(f"{path}.tmp", "w") as handle:
        handle.write(to_yaml(replace(config, run=replace(config.run, dir=run_dir))))
    os.replace(f"{path}.tmp", path)


def eval_fields(evaluation: Optional[EvalStats]) -> dict[str, Optional[float]]:
    """The eval_* fields of a metrics row: null on rows without an evaluation."""
    if evaluation is None:
        return {"eval_return_mean": None, "eval_return_std": None, "eval_length_mean": None}
    return {
        "eval_return_mean": float(evaluation.return_mean),
        "eval_return_std": float(evaluation.return_std),
        "eval_length_mean": float(evaluation.length_mean),
    }


def metrics_rows(metrics: UpdateMetrics, first_update: int, env_steps_per_update: int,
                 wall_seconds: float, evaluation: Optional[EvalStats] = None) -> list[dict]:
    """One dict per update from the metrics of one chunk (host arrays [num_updates]);
    `evaluation`, if any, ran after the chunk's last update and goes on its row."""
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
        row.update(eval_fields(None))
        rows.append(row)
    if evaluation is not None:
        rows[-1].update(eval_fields(evaluation))
    assert set(rows[0]) == set(METRIC_FIELDS), "metrics.jsonl fields and their documentation differ"
    return rows


# Quantities that are finite in every healthy update (explained_variance and the
# episode means are legitimately undefined sometimes).
GUARDED_METRICS = ("policy_loss", "value_loss", "entropy", "approx_kl", "grad_norm")


def first_non_finite(metrics: UpdateMetrics) -> Optional[tuple[int, str]]:
    """(offset within the chunk, quantity) of the first NaN/Inf among the guarded metrics."""
    for offset in range(len(np.asarray(metrics.policy_loss))):
        for name in GUARDED_METRICS:
            if not np.isfinite(np.asarray(getattr(metrics, name))[offset]):
                return offset, name
    return None


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every leaf of `tree` is finite: a bool scalar.

    One test over the leaves laid end to end: tested leaf by leaf, the check compiled into
    one or two kernels per parameter shape (10 kernels more in the CartPole chunk)."""
    return jnp.all(jnp.isfinite(ravel_pytree(tree)[0]))


def chunk_episode_return(metrics: UpdateMetrics) -> Optional[float]:
    """Mean return over the episodes that ended in a chunk, weighted by their count."""
    counts = np.asarray(metrics.episodes_completed, np.float64)
    if counts.sum() == 0:
        return None
    returns = np.nan_to_num(np.asarray(metrics.episode_return_mean, np.float64))
    return float((returns * counts).sum() / counts.sum())


def chunk_plan(start: int, stop: int, updates_per_chunk: int, checkpoint_every: int) -> Iterator[int]:
    """Sizes of the chunks from update `start` to `stop`: cut at every multiple of
    `updates_per_chunk` and of `checkpoint_every` (0: no checkpoint cuts)."""
    update = start
    while update < stop:
        boundary = min(stop, (update // updates_per_chunk + 1) * updates_per_chunk)
        if checkpoint_every:
            boundary = min(boundary, (update // checkpoint_every + 1) * checkpoint_every)
        yield boundary - update
        update = boundary


def process_label() -> str:
    return f" (process {jax.process_index()} of {jax.process_count()})" if jax.process_count() > 1 else ""


@dataclass(frozen=True)
class Programs:
    """Everything a population executes, compiled, and their traced inputs: the
    initialisation, the chunk of updates (`Experiment.learn_fn`, one program for chunks of
    every length) and the periodic evaluation (None when `eval.every_updates` is 0)."""

    inputs: ShardInputs
    init: Callable[[ShardInputs], TrainState]
    learn: Callable[[TrainState, ShardInputs, jax.Array], tuple[TrainState, UpdateMetrics, jax.Array]]
    evaluate: Optional[Callable[[Any, Any, jax.Array, ShardInputs], EvalStats]]

    def evaluate_after(self, state: TrainState, updates_done: int, every_updates: int,
                       mesh: jax.sharding.Mesh) -> Optional[EvalStats]:
        """Every member's current policy evaluated if `updates_done` is on the cadence: host
        statistics, leaves [num_members], or None. A collective over all shards: every
        process calls it after the same chunks."""
        if self.evaluate is None or updates_done % every_updates:
            return None
        stats = self.evaluate(state.params, state.obs_moments, state.update_index, self.inputs)
        return sharding.member_first_shards(stats, mesh)


def compile_programs(experiment: Experiment) -> Programs:
    """The initialisation, the chunk of updates and, if asked, the periodic evaluation,
    lowered from the initialisation's output shapes alone (nothing runs before every
    program is compiled). Each program compiles as soon as it is lowered, the longest
    first: XLA compiles without holding Python's GIL, so the next lowering runs beside
    it. `run.fast_cpu_compile` passes `cpu_tuning.compiler_options`."""
    inputs = experiment.shard_inputs()
    traced_init = experiment.init_fn().trace(inputs)
    state = traced_init.out_info
    lowerings = {"learn": lambda: experiment.learn_fn().lower(state, inputs, abstract_update_count(experiment.mesh))}
    if experiment.config.eval.every_updates:
        lowerings["evaluate"] = lambda: experiment.eval_fn().lower(
            state.params, state.obs_moments, state.update_index, inputs
        )
    lowerings["init"] = traced_init.lower
    platform = experiment.mesh.devices.flat[0].platform
    options = {name: cpu_tuning.compiler_options(platform, runs_once=name == "init")
               if experiment.config.run.fast_cpu_compile else {} for name in lowerings}
    with ThreadPoolExecutor(max_workers=len(lowerings)) as pool:
        futures = {name: pool.submit(lambda name=name, lower=lower: lower().compile(options[name]))
                   for name, lower in lowerings.items()}
        compiled = {name: future.result() for name, future in futures.items()}
    return Programs(inputs=inputs, init=compiled["init"], learn=compiled["learn"], evaluate=compiled.get("evaluate"))


@dataclass(frozen=True)
class LoopResult:
    state: TrainState
    counters: RunCounters
    saved_update: Optional[int]  # update of the newest checkpoint started, if any
    stopped_by: Optional[str]


@dataclass(frozen=True)
class LoopOutputs:
    """Where the host loop reports and saves."""

    writer: Optional[MetricsSink]  # process 0 only
    progress: Progress
    checkpointer: Checkpointer
    signals: StopSignals


def chunk_rows(experiment: Experiment, metrics: list[UpdateMetrics], first_update: int, wall_seconds: float,
               evaluations: Optional[EvalStats]) -> list[dict]:
    """The metrics rows of one chunk, member after member (`metrics`: host, one per member);
    a sweep's rows lead with their member."""
    rows = []
    for member, member_metrics in enumerate(metrics):
        evaluation = None if evaluations is None else jax.tree.map(lambda leaf: leaf[member], evaluations)
        member_rows = metrics_rows(member_metrics, first_update, experiment.topology.env_steps_per_update,
                                   wall_seconds, evaluation)
        rows += [{"member": member, **row} for row in member_rows] if experiment.is_sweep else member_rows
    return rows


def check_finite(metrics: list[UpdateMetrics], params_finite: np.ndarray, first_update: int,
                 name_members: bool) -> None:
    """Raise NonFiniteError naming the member (in a sweep), the update and the quantity."""
    for member, member_metrics in enumerate(metrics):
        whose = f" of member {member}" if name_members else ""
        bad = first_non_finite(member_metrics)
        if bad is not None:
            offset, name = bad
            raise NonFiniteError(f"non-finite {name}{whose} at update {first_update + offset + 1}")
        if not params_finite[member]:
            size = len(np.asarray(member_metrics.policy_loss))
            raise NonFiniteError(f"non-finite parameters{whose} after update {first_update + size}")


def train_chunks(experiment: Experiment, state: TrainState, programs: Programs, sizes: Iterable[int],
                 counters: RunCounters, outputs: LoopOutputs) -> LoopResult:
    """Call, block, time, log, check, checkpoint: the host loop over chunks of updates of
    every member.

    Raises NonFiniteError, after logging the chunk, without saving it.
    """
    topology, config, mesh = experiment.topology, experiment.config, experiment.mesh
    num_members = len(experiment.members)
    schedule = SaveSchedule(config.checkpoint.every_updates, config.checkpoint.every_seconds)
    saved_update = None
    for size in sizes:
        chunk_start = time.perf_counter()
        state, metrics, params_finite = programs.learn(state, programs.inputs, update_count(mesh, size))
        metrics, params_finite = sharding.member_first_shards((metrics, params_finite), mesh)  # blocks
        per_member = [jax.tree.map(lambda column: column[member, :size], metrics) for member in range(num_members)]
        chunk_seconds = time.perf_counter() - chunk_start
        first_update, update = counters.update, counters.update + size
        eval_start = time.perf_counter()
        evaluations = programs.evaluate_after(state, update, config.eval.every_updates, mesh)
        eval_seconds = time.perf_counter() - eval_start
        if outputs.writer is not None:
            outputs.writer.write(chunk_rows(experiment, per_member, first_update,
                                            counters.train_seconds + chunk_seconds, evaluations))
        check_finite(per_member, params_finite, first_update, experiment.is_sweep)
        if config.debug.check_replicas:
            sharding.check_replicas(state.params, mesh, update)
        returns = [chunk_episode_return(member_metrics) for member_metrics in per_member]
        # Training time counts the host's work between chunks (logging, checks) but not evaluations.
        counters = RunCounters(
            update=update,
            env_steps=update * topology.env_steps_per_update,
            train_seconds=counters.train_seconds + time.perf_counter() - chunk_start - eval_seconds,
            final_episode_returns=tuple(new if new is not None else old
                                        for new, old in zip(returns, counters.final_episode_returns)),
        )
        known = [value for value in counters.final_episode_returns if value is not None]
        outputs.progress.update(counters.env_steps * num_members,
                                size * topology.env_steps_per_update * num_members / chunk_seconds,
                                float(np.mean(known)) if known else None)
        stop, save_due = outputs.signals.agreed(schedule.due_by_time())
        if stop is not None or save_due or schedule.due_by_update(update):
            outputs.checkpointer.save(state, counters)
            schedule.saved()
            saved_update = update
        if stop is not None:
            return LoopResult(state, counters, saved_update, stop)
    return LoopResult(state, counters, saved_update, None)


def summarise(experiment: Experiment, trained: TrainResult) -> dict:
    """Evaluate the final policy deterministically and assemble summary.json."""
    config, topology, counters = experiment.config, experiment.topology, trained.counters
    evaluation = experiment.final_evaluations(trained.state)[0]
    eval_returns = np.asarray(evaluation.returns, np.float64)
    return {
        "env_id": config.env.id,
        "total_env_steps": counters.env_steps,
        "num_updates": counters.update,
        "num_devices": topology.num_devices,
        "num_shards": topology.num_shards,
        "num_processes": topology.num_processes,
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "compile_seconds": round(trained.compile_seconds, 3),
        "train_seconds": round(counters.train_seconds, 3),
        "env_steps_per_second": round(counters.env_steps / counters.train_seconds, 1),
        "final_episode_return": counters.final_episode_returns[0],
        "eval_return_mean": float(eval_returns.mean()),
        "eval_return_std": float(eval_returns.std()),
        "eval_length_mean": float(np.asarray(evaluation.lengths, np.float64).mean()),
        "eval_episodes": config.eval.num_episodes,
        "params_digest": sharding.params_digests(trained.state.params, experiment.mesh)[0],
    }


def final_eval_key(config: Config) -> jax.Array:
    """The key of the final evaluation (`jaxddppo.evaluate` uses it too, to reproduce it)."""
    return jax.random.fold_in(jax.random.key(config.train.seed), 2)


def fresh_counters(num_members: int) -> RunCounters:
    return RunCounters(update=0, env_steps=0, train_seconds=0.0, final_episode_returns=(None,) * num_members)


def restore_run(experiment: Experiment, checkpointer: Checkpointer, run_dir: str,
                progress: Progress) -> tuple[Optional[TrainState], RunCounters]:
    """The newest intact checkpoint, and metrics.jsonl cut back to its update (process 0).
    Reads nothing but the checkpoint (no program is compiled), so a checkpoint that cannot
    be resumed is refused at once.

    A run stopped before its first checkpoint completed starts again from update 0 (the
    state is then None); its metrics rows are written anew, identical.
    """
    state, counters = None, fresh_counters(len(experiment.members))
    if checkpointer.steps():
        state, counters = checkpointer.restore_latest(experiment.abstract_state(), progress.message, set_aside=True)
        progress.message(f"resumed from {checkpointer.directory}/{counters.update}: update {counters.update} "
                         f"of {experiment.topology.num_updates}, {counters.env_steps:,} env steps done")
    else:
        progress.message(f"no checkpoint in {checkpointer.directory} yet: starting again from update 0")
    if counters.update > experiment.topology.num_updates:
        raise ConfigError(
            f"train.total_env_steps={experiment.config.train.total_env_steps} is below the "
            f"{counters.env_steps} env steps the checkpoint at update {counters.update} has done"
        )
    if jax.process_index() == 0:
        last_row = truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), counters.update)
        if last_row < counters.update:
            progress.message(f"warning: metrics.jsonl ends at update {last_row}, before the checkpoint's "
                             f"update {counters.update}; updates {last_row + 1}-{counters.update} have no rows")
    return state, counters


@dataclass(frozen=True)
class Session:
    """Where and how a population trains: its run directory (claimed by process 0, or an
    earlier run's to resume), its progress output, and when to stop early."""

    run_dir: str
    progress: Progress
    resume: bool
    stop_after_updates: Optional[int]


def start_session(experiment: Experiment, name: str, resume: bool, stop_after_updates: Optional[int],
                  warnings: Sequence[str]) -> Session:
    """Claim a run directory (default `runs/<name>-<timestamp>`) and write config.yaml into
    it, or take the resumed run's; open the progress output over every member's steps and
    say what trains where, with `warnings`."""
    config, topology, is_writer = experiment.config, experiment.topology, jax.process_index() == 0
    run_dir = config.run.dir if resume else shared_run_dir(config, name)
    if is_writer and not resume:
        write_config(run_dir, config)
    members, per_member = len(experiment.members), ""
    progress = Progress(topology.num_updates * topology.env_steps_per_update * members,
                        config.run.progress and is_writer)
    if experiment.is_sweep:
        settings = len({member.setting for member in experiment.members})
        rows = experiment.mesh.shape[sharding.MEMBER_AXIS]
        per_member = f" per member, {members} member(s) ({settings} setting(s)) on {rows} row(s) of such devices"
    progress.message(
        f"jaxddppo{process_label()}: {config.env.id}, {topology.num_envs} envs in {topology.num_shards} shard(s) on "
        f"{topology.num_devices} {jax.default_backend()} device(s), {topology.num_processes} process(es); "
        f"{topology.num_updates} updates of {topology.env_steps_per_update} steps{per_member}; "
        + (f"writing to {run_dir}" if is_writer else "process 0 writes the results")
    )
    for warning in warnings:
        progress.message(warning)
    return Session(run_dir, progress, resume, stop_after_updates)


def train_experiment(experiment: Experiment, session: Session) -> TrainResult:
    """Compile, initialise or restore, train chunk after chunk with checkpoints, and save
    the last update: what a run and a sweep share. The caller writes the results."""
    config, topology, progress = experiment.config, experiment.topology, session.progress
    checkpointer = Checkpointer(session.run_dir, config.checkpoint.keep, config.checkpoint.async_save)
    command = "jaxddppo.sweep" if experiment.is_sweep else "jaxddppo.train"
    with one_line_storage_faults(session.run_dir, checkpointer, experiment.abstract_state,
                                 f"python -m {command} --resume"):
        try:
            trained = _train(experiment, session, checkpointer)
        finally:
            checkpointer.wait()
            checkpointer.close()
    if trained.stopped_by is not None:
        progress.message(
            f"stopped{process_label()} by {trained.stopped_by} after update {trained.counters.update} of "
            f"{topology.num_updates}; checkpoint {checkpointer.directory}/{trained.counters.update}; continue with: "
            f"python -m {command} --resume {session.run_dir}"
        )
    return trained


def _train(experiment: Experiment, session: Session, checkpointer: Checkpointer) -> TrainResult:
    config, topology, is_writer = experiment.config, experiment.topology, jax.process_index() == 0
    compile_start = time.perf_counter()
    stop_update = min(topology.num_updates, session.stop_after_updates or topology.num_updates)
    state, counters, restored_update = None, fresh_counters(len(experiment.members)), None
    if session.resume:
        state, counters = restore_run(experiment, checkpointer, session.run_dir, session.progress)
        restored_update = counters.update if counters.update else None
        if is_writer:
            write_config(session.run_dir, config)  # with the resume's overrides, once they proved valid
    programs = compile_programs(experiment)
    if state is None:
        state = programs.init(programs.inputs)
    plan = (counters.update, stop_update, topology.updates_per_chunk, config.checkpoint.every_updates)
    jax.block_until_ready(state)
    compile_seconds = time.perf_counter() - compile_start

    writer = open_metrics_sink(session.run_dir, config.run.tensorboard) if is_writer else None
    try:
        with StopSignals(session.progress.message) as signals:
            loop = train_chunks(experiment, state, programs, chunk_plan(*plan), counters,
                                LoopOutputs(writer, session.progress, checkpointer, signals))
    except NonFiniteError as error:
        checkpointer.wait()
        raise NonFiniteError(f"{error}; stopped without saving it; "
                             f"{checkpointer.newest_intact(experiment.abstract_state())}") from None
    finally:
        if writer is not None:
            writer.close()
    state, counters = loop.state, loop.counters
    stopped_by = loop.stopped_by or ("stop_after_updates" if counters.update < topology.num_updates else None)
    if counters.update not in (loop.saved_update, restored_update):
        checkpointer.save(state, counters)
    return TrainResult(summary=None, state=state, run_dir=session.run_dir, counters=counters,
                       compile_seconds=compile_seconds, stopped_by=stopped_by)


def run(config: Union[Config, Mapping, str], devices: Optional[Sequence[jax.Device]] = None, *,
        resume: bool = False, stop_after_updates: Optional[int] = None) -> TrainResult:
    """Train with `config` (a Config, a nested dict or a YAML path), writing config.yaml,
    metrics.jsonl, checkpoints, summary.json and learning_curve.png (and TensorBoard
    events if asked) to the run dir.

    With `resume`, `config.run.dir` holds an earlier run (see `load_resume_config`):
    its newest intact checkpoint is restored and training continues from it.
    `stop_after_updates` stops (with a checkpoint) once that many updates are done in
    all. Joins a multi-process run first when `config.distributed` asks for one.
    """
    config = as_config(config)
    backend_warnings = sharding.start_backend(config)
    experiment = build(config, devices)
    config, is_writer = experiment.config, jax.process_index() == 0
    session = start_session(experiment, config.env.id, resume, stop_after_updates, backend_warnings)
    run_dir, progress = session.run_dir, session.progress
    try:
        result = train_experiment(experiment, session)
        if result.stopped_by is None:
            result = replace(result, summary=summarise(experiment, result))
        if is_writer:
            if result.summary is not None:
                write_json(os.path.join(run_dir, "summary.json"), result.summary)
            save_learning_curve(run_dir)
        if result.summary is not None:
            summary = result.summary
            progress.message(
                f"done{process_label()}: {summary['total_env_steps']:,} steps in "
                f"{result.counters.train_seconds:.1f} s ({summary['env_steps_per_second']:,.0f} steps/s, "
                f"compile {result.compile_seconds:.1f} s); eval return "
                f"{format_mean_std(summary['eval_return_mean'], summary['eval_return_std'])}"
                + (f"; {run_dir}/summary.json" if is_writer else "")
            )
    finally:
        progress.close()
    return result


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m jaxddppo.train",
        description="Train PPO (DD-PPO) on every local device. Options are set in a YAML file "
        "(--config) and overridden as section.key=value; --resume continues a run from its newest checkpoint. "
        f"Exit codes: 0 done, 1 failed (non-finite numbers, distributed errors), 2 bad input, "
        f"{STORAGE_EXIT_CODE} storage error (disk full, permission denied; fix it, then resume), "
        f"{PREEMPTED_EXIT_CODE} stopped by SIGTERM/SIGINT with a checkpoint saved (resume to continue).",
        epilog="configuration keys, set in the YAML file or as section.key=value (type, default): meaning\n" + help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help="YAML config file, e.g. experiments/cartpole.yaml")
    source.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR (its config.yaml and newest checkpoint); overrides may "
                        f"change only {', '.join(RESUMABLE_KEYS)}")
    parser.add_argument("--stop-after-updates", type=int, metavar="N",
                        help="stop with a checkpoint once N updates are done in all (the run can be resumed)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override one option")
    args = parser.parse_intermixed_args(argv)
    if args.stop_after_updates is not None and args.stop_after_updates < 1:
        parser.error(f"--stop-after-updates={args.stop_after_updates} must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.resume is not None:
            config = load_resume_config(args.resume, args.overrides)
        else:
            config = load_config(args.config, args.overrides)
        result = run(config, resume=args.resume is not None, stop_after_updates=args.stop_after_updates)
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (sharding.DistributedError, sharding.ReplicaDivergence, NonFiniteError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except StorageError as error:
        print(f"error: {error}", file=sys.stderr)
        return STORAGE_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return PREEMPTED_EXIT_CODE if result.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
