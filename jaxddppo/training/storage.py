"""Storage faults while training: a full disk, a denied permission, a read-only or vanished
run directory, met while writing a checkpoint, metrics.jsonl or TensorBoard events, or the
results at the end (summary.json, sweep.csv, the plots).

They end the run with one line that names the run directory, the error and the newest
intact checkpoint with the command to resume, and exit code `STORAGE_EXIT_CODE`, instead
of pages of orbax and asyncio tracebacks. A partial checkpoint is left for the resume to
remove; nothing complete is touched, so a resume once the fault is fixed ends as the
uninterrupted run.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
import threading
from typing import Any, Callable, Iterator, Optional

import jax

from jaxddppo.training.checkpoint import Checkpointer

STORAGE_EXIT_CODE = 74  # EX_IOERR: a storage fault; fix it, then resume

# The errors of a filesystem rather than of the program.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
                            errno.ESTALE, errno.EIO, errno.EFBIG, errno.ENOTDIR})
# tensorstore (under orbax) reports the OS error of a failed write in its message.
_TENSORSTORE_CODE = re.compile(r"os_error_code='?(\d+)")
_QUOTED_PATH = re.compile(r'"(/[^"]+)"')


class StorageError(Exception):
    """A storage fault stopped the run; the message is one line."""


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and every exception it was raised from or while handling."""
    seen, pending = set(), [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]


def storage_fault(error: BaseException) -> Optional[tuple[int, Optional[str]]]:
    """(errno, the file concerned if known) of the storage fault behind `error`, or None."""
    for link in _chain(error):
        if isinstance(link, OSError) and link.errno in STORAGE_ERRNOS:
            return link.errno, link.filename
        match = _TENSORSTORE_CODE.search(str(link))
        if match and int(match.group(1)) in STORAGE_ERRNOS:
            path = _QUOTED_PATH.search(str(link))
            return int(match.group(1)), path.group(1) if path else None
    return None


class _QuietStorageFaults(logging.Filter):
    """Drops log records of a storage fault: orbax logs each failed write of its background
    threads with a traceback before the error reaches the caller, who reports it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and storage_fault(record.exc_info[1]):
            return False
        message = record.getMessage()
        return not (_TENSORSTORE_CODE.search(message) and storage_fault(Exception(message)))


def _without_closed_loops(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """An unraisable-exception hook that drops "Event loop is closed": tensorstore completing a
    failed write after orbax closed the event loop that waited for it (one per write)."""

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous(unraisable)

    return hook


def _without_thread_faults(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """A thread exception hook that drops storage faults: a writer's thread (TensorBoard's)
    dying on one; the next write or flush from the training loop meets it and reports it."""

    def hook(arguments: Any) -> None:
        if arguments.exc_value is None or storage_fault(arguments.exc_value) is None:
            previous(arguments)

    return hook


@contextlib.contextmanager
def one_line_storage_faults(run_dir: str, checkpointer: Checkpointer, abstract_state: Callable[[], Any],
                            resume_command: str) -> Iterator[None]:
    """Turn a storage fault raised in the block into a one-line StorageError, after waiting
    for the saves in flight; it names a partial checkpoint left for the resume to remove
    (`Checkpointer.abandon`). Meanwhile the fault's echoes are quiet: orbax's logs of it, the
    closed event loops of its failed writes, writer threads dying of it. After a fault they
    stay quiet for good: the failed save's other writes go on after the report (until exit),
    and asyncio reports orbax's failed write tasks when they are collected. The newest
    intact checkpoint is verified by reading it back in a single-process run (in a
    multi-process run the other processes may be gone: the newest complete one is named,
    and a resume verifies it)."""
    loggers, quiet = [logging.getLogger("absl"), logging.getLogger("asyncio")], _QuietStorageFaults()
    unraisable_hook, thread_hook = sys.unraisablehook, threading.excepthook
    for logger in loggers:
        logger.addFilter(quiet)
    faulted = False
    sys.unraisablehook = _without_closed_loops(unraisable_hook)
    threading.excepthook = _without_thread_faults(thread_hook)
    try:
        yield
    except Exception as error:
        if (fault := storage_fault(error)) is None:
            raise
        faulted = True
        partial = checkpointer.abandon()
        line = _fault_line(run_dir, *fault)
        if partial:
            line += f"; a resume removes the partial checkpoint {', '.join(partial)}"
        line += f"; {_newest(checkpointer, abstract_state)}; once fixed, continue with: {resume_command} {run_dir}"
        raise StorageError(line) from None
    finally:
        if not faulted:
            for logger in loggers:
                logger.removeFilter(quiet)
            sys.unraisablehook, threading.excepthook = unraisable_hook, thread_hook


@contextlib.contextmanager
def one_line_result_faults(run_dir: str, resume_command: str) -> Iterator[None]:
    """Turn a storage fault while writing the results of a run that has saved its last
    checkpoint (summary.json, sweep.csv, the plots) into a one-line StorageError: a resume
    once the fault is fixed restores that checkpoint and writes them."""
    try:
        yield
    except Exception as error:
        if (fault := storage_fault(error)) is None:
            raise
        raise StorageError(f"{_fault_line(run_dir, *fault)} while writing the results; the checkpoints are "
                           f"complete; once fixed, write them with: {resume_command} {run_dir}") from None


def _fault_line(run_dir: str, code: int, path: Optional[str]) -> str:
    if path and os.path.abspath(path).startswith(os.path.abspath(run_dir) + os.sep):
        path = os.path.relpath(path, run_dir)
    return (f"storage error in {run_dir}: {os.strerror(code)} ({errno.errorcode.get(code, code)})"
            + (f" ({path})" if path else ""))


def _newest(checkpointer: Checkpointer, abstract_state: Callable[[], Any]) -> str:
    try:
        reader = Checkpointer(os.path.dirname(checkpointer.directory), read_only=True)
    except Exception:
        return f"no checkpoint can be listed in {checkpointer.directory}"
    try:
        if jax.process_count() == 1:
            return reader.newest_intact(abstract_state())
        steps = reader.steps()
        return "no checkpoint had been saved" if not steps else \
            f"the newest complete checkpoint is {reader.path(steps[-1])} (a resume verifies it)"
    finally:
        reader.close()
