"""Checkpoints: the whole training state and the run's counters, saved with orbax.

A checkpoint is `RUN_DIR/checkpoints/<update>/` holding the global `TrainState`
(every member's parameters, optimizer state and statistics, once; every shard's
environment states and keys) and a small JSON record of the host-side counters, and a
digest of both (`global_arrays.state_digest` of the state, a hash of the counters) taken
from the arrays in memory. Orbax writes a step to a temporary directory and renames it
when complete, so a save killed part-way never looks complete, and the digest is committed
with the data it describes. A restore checks the digest; `restore_latest` skips (and names)
any complete-looking step that cannot be read or fails the check, falling back to the one
before it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
import signal
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxddppo.distributed import global_arrays

CHECKPOINT_SUBDIR = "checkpoints"
# The layout of the saved state, recorded beside the counters; another is refused. 6: the
# built-in networks' dense kernels are [out, in] (`networks.FeatureMajorDense`); 5 had them
# [in, out]. Since 5 the parameters, optimizer state and statistics are saved once per member,
# not once per shard, and the digest does not depend on the order of the leaves (formats 1 to
# 5, and checkpoints without a digest, come from earlier versions of 0.1.0).
CHECKPOINT_FORMAT = 6
_FORMAT_KEY = "checkpoint_format"
_DIGEST_ITEM = "digest"
_TEMPORARY = "*.orbax-checkpoint-tmp*"  # orbax's name for a step being written


class CheckpointError(Exception):
    """No usable checkpoint; the message is one line naming the directory."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint written in another layout than this version reads; the message is one line."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint that reads back but differs from the digest taken when it was saved."""


def _counters_record(counters: RunCounters) -> dict:
    return {**asdict(counters), _FORMAT_KEY: CHECKPOINT_FORMAT}


def _digest(state: Any, counters_record: dict, checksum: Optional[Callable] = None) -> dict:
    """What a checkpoint records of itself (`state` global, whole; a collective)."""
    counters_text = json.dumps(counters_record, sort_keys=True).encode()
    return {"state": global_arrays.state_digest(state, checksum),
            "counters": hashlib.sha256(counters_text).hexdigest()[:16]}


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (a collective in a multi-process run)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray([ok], np.int32))))


@dataclass(frozen=True)
class RunCounters:
    """Host-side state that continues across a resume."""

    update: int  # updates done; also the checkpoint's step number
    env_steps: int  # of one member
    train_seconds: float
    final_episode_returns: tuple[Optional[float], ...]  # one per member


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), CHECKPOINT_SUBDIR)


def _is_empty(leaf: Any) -> bool:
    return 0 in leaf.shape


def _without_empty_leaves(tree: Any) -> Any:
    """`tree` with its zero-size arrays replaced by None: orbax refuses to save them, and an
    environment state may hold some (navix's `cache.patches` is [0, ...])."""
    return jax.tree.map(lambda leaf: None if _is_empty(leaf) else leaf, tree)


def _with_unsaved_leaves(restored: Any, abstract: Any) -> Any:
    """The tree `abstract` describes (shapes, dtypes, shardings) from the `restored` one: the
    zero-size arrays, which `_without_empty_leaves` left out, come back, holding no values."""
    restored_leaves = global_arrays.named_leaves(restored)
    abstract_leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def empty(leaf: Any) -> jax.Array:
        if getattr(leaf, "sharding", None) is None:
            return jax.numpy.zeros(leaf.shape, leaf.dtype)
        zeros = np.zeros(leaf.shape, leaf.dtype)
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: zeros[index])

    def leaf_of(path: tuple, leaf: Any) -> Any:
        return empty(leaf) if _is_empty(leaf) else restored_leaves["/".join(global_arrays.path_names(path))]

    return jax.tree.unflatten(treedef, [leaf_of(path, leaf) for path, leaf in abstract_leaves])


class Checkpointer:
    """Saves and restores `(TrainState, RunCounters)` under `RUN_DIR/checkpoints/`.

    Every process of a multi-process run must make the same calls with the same
    global arrays (orbax synchronises them). Saving is asynchronous where orbax
    allows: `save` returns once the arrays are copied off the devices.
    """

    def __init__(self, run_dir: str, keep: int = 1, asynchronous: bool = True, read_only: bool = False):
        """`read_only` (for reading a run that may still be training) deletes and creates nothing."""
        self.directory = checkpoint_dir(run_dir)
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"no checkpoint directory {self.directory}")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep,
                create=not read_only,
                cleanup_tmp_directories=not read_only,
                enable_async_checkpointing=asynchronous,
            ),
        )

    def steps(self) -> list[int]:
        """The complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, state: Any, counters: RunCounters, checksum: Optional[Callable] = None) -> None:
        """Start saving; the digest is taken first, from the same arrays (a few ms), with
        `checksum` (`Programs.checksum`) if given, else a program compiled at the first save."""
        record = _counters_record(counters)
        self._manager.save(
            counters.update,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_without_empty_leaves(state)),
                counters=ocp.args.JsonSave(record),
                **{_DIGEST_ITEM: ocp.args.JsonSave(_digest(state, record, checksum))},
            ),
            force=True,
        )

    def path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def saved_shapes(self, step: int) -> Any:
        """The shapes and dtypes of checkpoint `step`'s state as orbax recorded them: nested
        dicts and lists named as saved (`global_arrays.path_names`), zero-size leaves left out."""
        metadata = ocp.StandardCheckpointHandler().metadata(pathlib.Path(self.path(step), "state"))
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), metadata.tree)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, RunCounters]:
        """Checkpoint `step`, placed as `abstract_state` says (shapes, dtypes, shardings), checked
        against its digest: CheckpointDamaged if it differs. Every process verifies the same
        digest of the global state, and reads only if all of them could. `abstract_state` may
        also be a function that makes it from `saved_shapes(step)`: a reader that builds no
        environment restores the state as saved."""
        if step not in self.steps():
            raise CheckpointError(f"no checkpoint {step} in {self.directory} (there are: {self.steps()})")
        counters_only = ocp.args.Composite(counters=ocp.args.JsonRestore())
        record = dict(self._manager.restore(step, args=counters_only)["counters"])
        written_format = record.get(_FORMAT_KEY, 1)
        if written_format != CHECKPOINT_FORMAT:
            raise CheckpointFormatError(
                f"checkpoint {self.path(step)} has format {written_format}, this jaxddppo reads format "
                f"{CHECKPOINT_FORMAT} only (the version that wrote it can still read it); start a new run"
            )
        error = None
        try:
            if callable(abstract_state):
                abstract_state = abstract_state(self.saved_shapes(step))
            items = ocp.args.Composite(state=ocp.args.StandardRestore(_without_empty_leaves(abstract_state)),
                                       **{_DIGEST_ITEM: ocp.args.JsonRestore()})
            restored = self._manager.restore(step, args=items)
        except Exception as caught:  # orbax and tensorstore raise many types for damaged files
            error = caught
        if not _everywhere(error is None):
            raise error or CheckpointError(f"checkpoint {self.path(step)} could not be read by another process")
        state = _with_unsaved_leaves(restored["state"], abstract_state)
        recorded, found = dict(restored[_DIGEST_ITEM]), _digest(state, record)
        differing = [f"{part} digest {found[part]}, {recorded.get(part)} when saved"
                     for part in found if found[part] != recorded.get(part)]
        if differing:
            raise CheckpointDamaged(f"checkpoint {self.path(step)} is damaged: {'; '.join(differing)}")
        counters = {key: value for key, value in record.items() if key != _FORMAT_KEY}
        expected = [field.name for field in fields(RunCounters)]
        if sorted(counters) != sorted(expected):
            raise CheckpointFormatError(
                f"checkpoint {self.path(step)} records the counters {', '.join(sorted(counters))}, this jaxddppo "
                f"reads {', '.join(sorted(expected))} (the version that wrote it can still read it); start a new run"
            )
        counters["final_episode_returns"] = tuple(counters["final_episode_returns"])
        return state, RunCounters(**counters)

    def verify(self, step: int, abstract_state: Any) -> tuple[bool, str]:
        """(True: intact, False: damaged, unreadable or of another format; a few words that say
        which). Reads the whole checkpoint; changes nothing."""
        try:
            self.restore(step, abstract_state)
        except CheckpointFormatError as error:
            return False, str(error)
        except CheckpointDamaged:
            return False, "damaged (its digest differs from the one recorded when it was saved)"
        except Exception as error:
            return False, f"unreadable ({type(error).__name__}: {' '.join(str(error).split())[:120]})"
        return True, "intact"

    def newest_intact(self, abstract_state: Any) -> str:
        """A phrase naming the newest checkpoint that verifies (reading them back, newest
        first), for the message of a run that stopped on an error."""
        newer = []
        for step in reversed(self.steps()):
            intact, verdict = self.verify(step, abstract_state)
            if intact:
                return (f"the newest intact checkpoint is {self.path(step)} (newer: {', '.join(newer)})" if newer
                        else f"the newest checkpoint, {self.path(step)}, is intact")
            newer.append(f"{step} {verdict.split(' (')[0].split(',')[0]}")
        return f"no checkpoint in {self.directory} is intact" if newer else "no checkpoint had been saved"

    def restore_latest(self, abstract_state: Any, report: Callable[[str], None],
                       set_aside: bool = False) -> tuple[Any, RunCounters]:
        """The newest checkpoint that restores and matches its digest; each newer one that does
        not is named via `report`.

        With `set_aside` (a run that will save again), once an older checkpoint restores,
        each such step directory is renamed to `<step>.unreadable` or `<step>.damaged` (kept
        for inspection) so that its step can be saved anew. When none restores, every one
        stays where it is: the run stops, and a version of jaxddppo that reads them finds
        them. Every process makes the same choice (`restore` agrees on every step).
        """
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        rejected: dict[int, tuple[str, str]] = {}  # step -> (unreadable or damaged, why)

        def report_rejected(moved: bool) -> None:
            for step, (verdict, detail) in rejected.items():
                where = f", moved to {step}.{verdict}" if moved else ""
                report(f"warning: checkpoint {self.path(step)} is {verdict}, skipped{where} ({detail})")

        for step in reversed(steps):
            try:
                restored = self.restore(step, abstract_state)
            except CheckpointFormatError:
                report_rejected(moved=False)
                raise
            except Exception as error:
                damaged = isinstance(error, CheckpointDamaged)
                rejected[step] = ("damaged", str(error).split(": ", 1)[1]) if damaged else \
                    ("unreadable", f"{type(error).__name__}: {' '.join(str(error).split())[:160]}")
                continue
            if set_aside and rejected:
                self._set_aside({step: verdict for step, (verdict, _) in rejected.items()})
            report_rejected(moved=set_aside)
            return restored
        report_rejected(moved=False)
        raise CheckpointError(f"none of the {len(steps)} checkpoint(s) in {self.directory} is intact "
                              "(each is unreadable or damaged)" + ("; all are left in place" if set_aside else ""))

    def _set_aside(self, steps: dict[int, str]) -> None:
        if jax.process_index() == 0:
            for step, suffix in steps.items():
                os.replace(self.path(step), f"{self.path(step)}.{suffix}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxddppo: unreadable checkpoints set aside")
        self._manager.reload()

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def abandon(self) -> list[str]:
        """After a failed write: wait for the saves in flight and close, swallowing their errors
        (the caller reports the first one). Returns the names of the partial steps left (process 0).

        They are left to the next start's `cleanup_tmp_directories`: orbax's wait ends at a save's
        first failed write while the others go on, and tensorstore's among them recreate the
        directories they write into, so a step removed now could come back."""
        for finish in (self.wait, self.close):
            try:
                finish()
            except Exception:  # the same storage error again, or one it caused
                pass
        partial = sorted(glob.glob(os.path.join(self.directory, _TEMPORARY))) if jax.process_index() == 0 else []
        return [os.path.basename(path) for path in partial]


class SaveSchedule:
    """When a run saves between chunks: after every `every_updates`-th update, and at the
    first chunk boundary once `every_seconds` of wall time have passed since the last
    save (or since the schedule started); 0 turns either off.

    The time-based part is what a long run needs (at most that much work lost to a
    crash) without saving every fraction of a second on a fast one: an orbax save costs
    about 0.1 s of CPU, and on a 2-core machine it slows the chunks running beside it.
    """

    def __init__(self, every_updates: int, every_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.every_updates = every_updates
        self.every_seconds = every_seconds
        self._clock = clock
        self._last_save = clock()

    def due_by_update(self, update: int) -> bool:
        """The same on every process: it depends on the update alone."""
        return bool(self.every_updates) and update % self.every_updates == 0

    def due_by_time(self) -> bool:
        """This process's clock: agree on it across processes before acting on it (`StopSignals.agreed`)."""
        return bool(self.every_seconds) and self._clock() - self._last_save >= self.every_seconds

    def saved(self) -> None:
        self._last_save = self._clock()


PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped early on a signal, checkpoint saved; resume to continue


class StopSignals:
    """Turns SIGTERM and a first SIGINT into a request to stop at the next update boundary.

    A second SIGINT gets the default handling (the process dies at once). The
    handlers are installed on `__enter__` (from the main thread only) and the
    previous ones restored on `__exit__`. In a multi-process run, `agreed` makes
    every process see a request that any one of them received, so all of them
    save the same update.
    """

    def __init__(self, announce: Callable[[str], None]):
        self._announce = announce
        self._previous: dict[int, Any] = {}
        self.received: Optional[str] = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            self._announce("SIGINT: stopping at the next update boundary (press Ctrl-C again to abort without saving)")
        else:
            self._announce(f"{self.received}: stopping at the next update boundary")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def agreed(self, save_due: bool = False) -> tuple[Optional[str], bool]:
        """(the signal that asked to stop, if any process received one; whether any process
        found a save due): one small all-gather in a multi-process run, so every process
        stops, and saves, after the same update. A collective: call on every process."""
        if jax.process_count() == 1:
            return self.received, save_due
        flags = multihost_utils.process_allgather(np.asarray([self.received is not None, save_due], np.int32))
        flags = flags.reshape(-1, 2)
        stop = (self.received or "another process's signal") if np.any(flags[:, 0]) else None
        return stop, bool(np.any(flags[:, 1]))
