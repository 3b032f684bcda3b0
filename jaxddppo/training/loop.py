"""The host loop that a run and a sweep share: start a session (the run directory, the
progress output), compile, initialise or restore, then call, block, time, log, check and
checkpoint chunk after chunk of updates; evaluate and summarise at the end.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Optional, Sequence

import jax
import numpy as np

from jaxddppo import sharding
from jaxddppo.config.files import check_resume, to_dict, with_overrides
from jaxddppo.config.options import Config, ConfigError
from jaxddppo.cpu import tuning as cpu_tuning
from jaxddppo.distributed import global_arrays, multiprocess
from jaxddppo.outputs import video
from jaxddppo.outputs.env_spec import env_spec_record
from jaxddppo.outputs.run_dir import shared_run_dir, write_config, write_env_spec
from jaxddppo.outputs.tracker import TrackedRun, WandbTracker, check_available
from jaxddppo.outputs.writers import (
    PBT_FILE,
    FanOut,
    MetricsSink,
    MetricsWriter,
    Progress,
    TensorBoardWriter,
    VideoSink,
    open_metrics_sink,
    truncate_metrics,
)
from jaxddppo.ppo import TrainState
from jaxddppo.training import pbt
from jaxddppo.training.checkpoint import (
    PREEMPTED_EXIT_CODE,
    Checkpointer,
    CheckpointError,
    RunCounters,
    SaveSchedule,
    StopSignals,
)
from jaxddppo.training.chunk_metrics import NonFiniteError, check_finite, chunk_episode_return, chunk_rows
from jaxddppo.training.eval_episodes import EvalResult
from jaxddppo.training.experiment import Experiment, Member, Programs, compile_programs, final_eval_key, update_count
from jaxddppo.training.storage import STORAGE_EXIT_CODE, StorageError, one_line_storage_faults


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
    # The final evaluation's program, compiled while the training ran (None if it stopped early)
    final_evaluate: Optional[Callable[..., EvalResult]] = None

    @property
    def preempted(self) -> bool:
        """Stopped early by a signal (SIGTERM, SIGINT), with a checkpoint to resume from."""
        return self.stopped_by not in (None, "stop_after_updates")


def chunk_plan(start: int, stop: int, updates_per_chunk: int, checkpoint_every: int,
               pbt_every: int = 0) -> Iterator[int]:
    """Sizes of the chunks from update `start` to `stop`: cut at every multiple of
    `updates_per_chunk`, of `checkpoint_every` and of `pbt_every` (0: no such cuts), so that
    a chunk ends where PBT exploits."""
    update = start
    while update < stop:
        boundary = min(stop, (update // updates_per_chunk + 1) * updates_per_chunk)
        for every in (checkpoint_every, pbt_every):
            if every:
                boundary = min(boundary, (update // every + 1) * every)
        yield boundary - update
        update = boundary


def process_label() -> str:
    return f" (process {jax.process_index()} of {jax.process_count()})" if jax.process_count() > 1 else ""


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
    pbt_writer: Optional[MetricsSink]  # pbt.jsonl: process 0 of a population with PBT only
    progress: Progress
    checkpointer: Checkpointer
    signals: StopSignals
    video_dir: Optional[str] = None  # process 0 of a run with eval.video_every_updates only
    video_sinks: tuple[VideoSink, ...] = ()  # process 0: TensorBoard and W&B, those that are on: the videos too


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
        metrics, params_finite, exploits = global_arrays.member_values(  # blocks
            (metrics, params_finite, pbt_record(state)), mesh)
        per_member = [jax.tree.map(lambda column: column[member, :size], metrics) for member in range(num_members)]
        chunk_seconds = time.perf_counter() - chunk_start
        first_update, update = counters.update, counters.update + size
        eval_start = time.perf_counter()
        evaluations = programs.evaluate_after(state, update, config.eval.every_updates, mesh)
        write_videos(experiment, state, update, outputs.video_dir, outputs.video_sinks)
        eval_seconds = time.perf_counter() - eval_start
        if outputs.writer is not None:
            outputs.writer.write(chunk_rows(experiment, per_member, first_update,
                                            counters.train_seconds + chunk_seconds, evaluations))
        if outputs.pbt_writer is not None:
            outputs.pbt_writer.write(pbt.exploit_rows(update, exploits, experiment.pbt.reported))
        check_finite(per_member, params_finite, first_update, experiment.is_sweep)
        if config.debug.check_replicas:
            multiprocess.check_replicas(state.params, mesh, update)
        returns = [chunk_episode_return(member_metrics) for member_metrics in per_member]
        # Training time counts the host's work between chunks (logging, checks) but not evaluations and videos.
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
            outputs.checkpointer.save(state, counters, programs.checksum)
            schedule.saved()
            saved_update = update
        if stop is not None:
            return LoopResult(state, counters, saved_update, stop)
    return LoopResult(state, counters, saved_update, None)


def write_videos(experiment: Experiment, state: TrainState, update: int, video_dir: Optional[str],
                 sinks: Sequence[VideoSink] = ()) -> None:
    """Every member's video of one deterministic episode after `update`, when it is on the
    eval.video_every_updates cadence, into `video_dir` (None: another process writes them) and
    to `sinks` (TensorBoard, W&B). A collective in a multi-process run."""
    every = experiment.config.eval.video_every_updates
    if not every or update % every:
        return
    params, obs_moments = global_arrays.member_values((state.params, state.obs_moments), experiment.mesh)
    if video_dir is None:
        return
    for member in experiment.members:
        member_params, member_moments = jax.tree.map(lambda leaf: leaf[member.index], (params, obs_moments))
        key = jax.random.fold_in(final_eval_key(member.config), update)
        frames = video.render_episodes(experiment.env, experiment.network, member_params, member_moments, key)[0]
        name = f"update_{update}" + (f"_member_{member.index}" if experiment.is_sweep else "")
        path = os.path.join(video_dir, f"{name}.gif")
        video.write_video(path, frames)
        for sink in sinks:
            sink.log_video(member.index if experiment.is_sweep else None, path,
                           update * experiment.topology.env_steps_per_update)


def pbt_record(state: TrainState) -> Optional[pbt.PBTState]:
    """What the host reads of a population's PBT state after a chunk (its key stays on the devices)."""
    return state.pbt.replace(key=None) if isinstance(state, pbt.PBTTrainState) else None


def summarise(experiment: Experiment, trained: TrainResult) -> dict:
    """Evaluate the final policy deterministically and assemble summary.json."""
    config, topology, counters = experiment.config, experiment.topology, trained.counters
    evaluation = experiment.final_evaluations(trained.state, trained.final_evaluate)[0]
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
        "params_digest": global_arrays.params_digests(trained.state.params, experiment.mesh)[0],
    }


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
        if os.path.exists(os.path.join(run_dir, PBT_FILE)):
            truncate_metrics(os.path.join(run_dir, PBT_FILE), counters.update)
        last_row = truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), counters.update)
        if last_row < counters.update:
            progress.message(f"warning: metrics.jsonl ends at update {last_row}, before the checkpoint's "
                             f"update {counters.update}; updates {last_row + 1}-{counters.update} have no rows")
    return state, counters


@dataclass(frozen=True)
class Session:
    """Where and how a population trains: its run directory (claimed by process 0, or an
    earlier run's to resume), its progress output, its W&B runs (process 0, if asked for), and
    when to stop early."""

    run_dir: str
    progress: Progress
    resume: bool
    stop_after_updates: Optional[int]
    tracker: Optional[WandbTracker] = None

    def log_summaries(self, summaries: Sequence[dict]) -> None:
        """Each member's summary (summary.json's fields, a member's row of sweep.csv) to W&B."""
        if self.tracker is not None:
            self.tracker.log_summaries(summaries)

    def close(self) -> None:
        self.progress.close()
        if self.tracker is not None:
            self.tracker.close()


def open_tracker(experiment: Experiment, run_dir: str, progress: Progress) -> Optional[WandbTracker]:
    """The W&B runs of process 0, if `wandb.mode` asks for them: one per member, named like the
    run directory, with the config of the single run the member equals; a sweep's are grouped
    (by default) under the run directory's name."""
    config, name = experiment.config, os.path.basename(os.path.normpath(run_dir))
    if config.wandb.mode == "off" or jax.process_index() != 0:
        return None
    resolved = replace(config, run=replace(config.run, dir=run_dir))
    runs = [tracked_run(member, resolved, name, experiment.is_sweep) for member in experiment.members]
    group = config.wandb.group or (name if experiment.is_sweep else None)
    return WandbTracker(config.wandb, run_dir, runs, group, progress.message)


def tracked_run(member: Member, config: Config, name: str, is_sweep: bool) -> TrackedRun:
    """A member's W&B run: its seed and hyperparameters in `config`; a sweep's member also by
    index and setting."""
    member_config = to_dict(with_overrides(config, {**member.values, "train.seed": member.seed}))
    if not is_sweep:
        return TrackedRun(name, member_config)
    return TrackedRun(f"{name}-member-{member.index}",
                      {**member_config, "member": member.index, "setting": member.setting})


def start_session(experiment: Experiment, name: str, resume: bool, stop_after_updates: Optional[int],
                  warnings: Sequence[str]) -> Session:
    """Claim a run directory (default `runs/<name>-<timestamp>`) and write config.yaml and
    env_spec.json into it, or take the resumed run's (refusing a config that changes its algorithm); open the
    progress output over every member's steps and say what trains where, with `warnings`."""
    config, topology, is_writer = experiment.config, experiment.topology, jax.process_index() == 0
    if resume:
        check_resume(config)
    check_available(config.wandb)
    run_dir = config.run.dir if resume else shared_run_dir(config, name)
    if is_writer and not resume:
        write_config(run_dir, config)
        env_record = env_spec_record(experiment.env.spec)
        if env_record is not None:
            write_env_spec(run_dir, env_record)
    members, per_member = len(experiment.members), ""
    progress = Progress(topology.num_updates * topology.env_steps_per_update * members,
                        config.run.progress and is_writer)
    if experiment.is_sweep:
        settings = len({member.setting for member in experiment.members})
        rows = experiment.mesh.shape[sharding.MEMBER_AXIS]
        per_member = f" per member, {members} member(s) ({settings} setting(s)) on {rows} row(s) of such devices"
    progress.message(
        f"jaxddppo{process_label()}: {config.env.id}, {topology.num_envs} envs in {topology.num_shards} shard(s) on "
        f"{topology.num_devices} {jax.default_backend()} device(s), {topology.num_processes} process(es)"
        f"{', CPU tuning on' if cpu_tuning.is_on(config) else ''}; "
        f"{topology.num_updates} updates of {topology.env_steps_per_update} steps{per_member}; "
        + (f"writing to {run_dir}" if is_writer else "process 0 writes the results")
    )
    for warning in warnings:
        progress.message(warning)
    return Session(run_dir, progress, resume, stop_after_updates, open_tracker(experiment, run_dir, progress))


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
    video_dir = None
    if config.eval.video_every_updates and is_writer:
        video.check_renders(experiment.env)  # before compiling: a run that cannot draw is refused at once
        video_dir = os.path.join(session.run_dir, "videos")
    programs = compile_programs(experiment, final_evaluation=stop_update == topology.num_updates)
    if state is None:
        state = programs.init(programs.inputs)
    plan = (counters.update, stop_update, topology.updates_per_chunk, config.checkpoint.every_updates)
    jax.block_until_ready(state)
    compile_seconds = time.perf_counter() - compile_start

    tensorboard = TensorBoardWriter(session.run_dir) if is_writer and config.run.tensorboard else None
    writer = open_metrics_sink(session.run_dir, tensorboard) if is_writer else None
    # The session closes its tracker, after the summary: only `writer` closes here.
    rows_to = writer if session.tracker is None else FanOut([writer, session.tracker])
    video_sinks = tuple(sink for sink in (tensorboard, session.tracker) if sink is not None)
    pbt_writer = open_pbt_log(experiment, session.run_dir, state, counters.update)
    try:
        with StopSignals(session.progress.message) as signals:
            loop = train_chunks(experiment, state, programs, chunk_plan(*plan, config.pbt.every_updates), counters,
                                LoopOutputs(rows_to, pbt_writer, session.progress, checkpointer, signals, video_dir,
                                            video_sinks))
    except NonFiniteError as error:
        checkpointer.wait()
        raise NonFiniteError(f"{error}; stopped without saving it; "
                             f"{checkpointer.newest_intact(experiment.abstract_state())}") from None
    finally:
        for sink in (writer, pbt_writer):
            if sink is not None:
                sink.close()
    state, counters = loop.state, loop.counters
    stopped_by = loop.stopped_by or ("stop_after_updates" if counters.update < topology.num_updates else None)
    if counters.update not in (loop.saved_update, restored_update):
        checkpointer.save(state, counters, programs.checksum)
    return TrainResult(summary=None, state=state, run_dir=session.run_dir, counters=counters,
                       compile_seconds=compile_seconds, stopped_by=stopped_by, final_evaluate=programs.final_evaluate)


def open_pbt_log(experiment: Experiment, run_dir: str, state: TrainState, update: int) -> Optional[MetricsWriter]:
    """pbt.jsonl of a population with PBT, for process 0 (None elsewhere): a run starting
    at update 0 writes it anew, every member's starting hyperparameters first; a resumed one
    appends to the rows `restore_run` kept. A collective in a multi-process run."""
    if experiment.pbt is None:
        return None
    record = global_arrays.member_values(pbt_record(state), experiment.mesh) if update == 0 else None
    if jax.process_index() != 0:
        return None
    path = os.path.join(run_dir, PBT_FILE)
    if update == 0:
        open(path, "w").close()
    writer = MetricsWriter(path)
    if record is not None:
        writer.write(pbt.initial_rows(record, experiment.pbt.reported))
    return writer


def command_exit_code(command: Callable[[], TrainResult]) -> int:
    """Run a command line's work (a run or a sweep) and give its exit code: 0 done,
    PREEMPTED_EXIT_CODE stopped by a signal with a checkpoint, 2 bad input (config,
    checkpoint), 1 failed (non-finite numbers, distributed errors), STORAGE_EXIT_CODE a
    storage fault, 130 interrupted; every error is one line on stderr."""
    try:
        result = command()
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (multiprocess.DistributedError, multiprocess.ReplicaDivergence, NonFiniteError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except StorageError as error:
        print(f"error: {error}", file=sys.stderr)
        return STORAGE_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return PREEMPTED_EXIT_CODE if result.preempted else 0
