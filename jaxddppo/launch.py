"""Run a multi-process training on one machine: N trainer processes, D CPU devices each.

Usage:

    python -m jaxddppo.launch --num-processes N --devices-per-process D \\
        [--timeout-after-failure S] -- <arguments for python -m jaxddppo.train>

for example

    python -m jaxddppo.launch --num-processes 2 --devices-per-process 2 -- \\
        --config experiments/cartpole.yaml env.num_envs=64

The launcher picks a free TCP port on 127.0.0.1 and starts process i as

    python -m jaxddppo.train <arguments> run.cpu_devices=D \\
        distributed.coordinator=127.0.0.1:PORT distributed.num_processes=N distributed.process_id=i

(D wins over a run.cpu_devices among the arguments and over XLA_FLAGS' device count),
with JAX_PLATFORMS=cpu unless JAX_PLATFORMS is already set, and PYTHONUNBUFFERED=1.
Every line a process prints (stdout and stderr) is printed as `[p<i>] <line>`.

If a process exits non-zero or is killed, the launcher says which and how on
stderr, sends SIGTERM to the others, SIGKILLs any still running after
--timeout-after-failure seconds (default 10) and exits 1. Ctrl-C or SIGTERM of
the launcher stops every process the same way (exit 130 or 143). It exits 0
when every process does. Argument errors: one line on stderr, exit 2.

One abort counts as a success, with a line saying so: a process that printed the
trainer's "done" line and then died of SIGABRT in jaxlib's shutdown of the
distributed service (`JAXLIB_EXIT_ABORT`), a fault of jaxlib 0.11.2 at interpreter
exit that leaves the results complete.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Optional, Sequence

from jaxddppo.cli import OneLineParser

TRAIN_COMMAND = [sys.executable, "-m", "jaxddppo.train"]
POLL_SECONDS = 0.05
# What jaxlib 0.11.2 prints when the process hosting the coordination service (process 0)
# aborts while its gRPC server is destroyed at interpreter exit, now and then, after the
# trainer has finished.
JAXLIB_EXIT_ABORT = ("DistributedRuntimeService::Shutdown", "Check failed: queue.Pop() == nullptr")
# The trainer's last line of a finished run ("done: ..." when it is the only process).
FINISHED_LINE = re.compile(r"done( \(process \d+ of \d+\))?: ")
READER_GRACE_SECONDS = 5.0  # for the output of a process that has exited to be read to its end


@dataclass
class OutputFacts:
    """What one process's output has shown so far."""

    finished: bool = False  # the trainer's "done" line
    exit_abort_texts: set[str] = field(default_factory=set)  # those of JAXLIB_EXIT_ABORT seen

    def note(self, line: str) -> None:
        # A progress bar may precede the line with carriage returns that clear it.
        self.finished = self.finished or FINISHED_LINE.match(line.rsplit("\r", 1)[-1]) is not None
        self.exit_abort_texts.update(text for text in JAXLIB_EXIT_ABORT if text in line)

    @property
    def aborted_after_finishing(self) -> bool:
        return self.finished and len(self.exit_abort_texts) == len(JAXLIB_EXIT_ABORT)


class SignalWatch:
    """Records SIGINT and SIGTERM instead of acting on them, while in effect.

    Acting on them at once (KeyboardInterrupt) could interrupt `subprocess.Popen`
    after a child has started but before it is known, leaving it running; and it
    could interrupt stopping the children. Handlers can only be installed in the
    main thread; elsewhere, the signals keep their handlers.
    """

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        self.received = signum

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe_exit(returncode: int) -> str:
    """`exited with status 3`, or `exited with status -9 (killed by SIGKILL)`."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"exited with status {returncode} (killed by {name})"


def print_locked(lock: threading.Lock, text: str, stream_name: str = "stdout") -> None:
    """Write whole lines to sys.stdout or sys.stderr (looked up now: tests replace them)."""
    with lock:
        stream = getattr(sys, stream_name)
        stream.write(text)
        stream.flush()


def forward_output(process_id: int, pipe: IO[bytes], lock: threading.Lock, facts: OutputFacts) -> None:
    """Print every line of `pipe` as `[p<process_id>] <line>` until it closes, noting each in `facts`."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            facts.note(line)
            print_locked(lock, f"[p{process_id}] {line}\n")


def signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def stop(processes: Sequence[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every running process group, SIGKILL those still running after `timeout` s; reap all."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(process, signal.SIGKILL)
            process.wait()


def finished_before_exit_abort(returncode: int, facts: OutputFacts) -> bool:
    """Whether a process that exited with `returncode`, its whole output noted in `facts`,
    finished its training and then met jaxlib's abort at exit (`JAXLIB_EXIT_ABORT`)."""
    return returncode == -signal.SIGABRT and facts.aborted_after_finishing


def wait_for_all(processes: Sequence[subprocess.Popen], lock: threading.Lock, signals: SignalWatch,
                 readers: Sequence[threading.Thread], facts: Sequence[OutputFacts]) -> int:
    """0 once every process has exited 0 (or finished before jaxlib's abort at exit); 1 as
    soon as one has not, 128 + signal number as soon as the launcher receives SIGINT or
    SIGTERM (after saying which)."""
    running = dict(enumerate(processes))
    while running:
        if signals.received is not None:
            name = signal.Signals(signals.received).name
            print_locked(lock, f"launch: received {name}; stopping all processes\n", "stderr")
            return 128 + signals.received
        for process_id, process in list(running.items()):
            returncode = process.poll()
            if returncode is None:
                continue
            del running[process_id]
            if returncode == -signal.SIGABRT:
                readers[process_id].join(READER_GRACE_SECONDS)  # its output, to the end
            if finished_before_exit_abort(returncode, facts[process_id]):
                print_locked(lock, f"launch: process {process_id} finished, then {describe_exit(returncode)} in "
                             "jaxlib's shutdown of the distributed service (a jaxlib 0.11.2 fault at exit; its "
                             "results are complete): counted as done\n", "stderr")
            elif returncode != 0:
                print_locked(
                    lock, f"launch: process {process_id} {describe_exit(returncode)}; stopping the others\n", "stderr"
                )
                return 1
        time.sleep(POLL_SECONDS)
    return 0


def launch(
    train_args: Sequence[str],
    num_processes: int,
    devices_per_process: int,
    timeout_after_failure: float = 10.0,
    command: Optional[Sequence[str]] = None,
) -> int:
    """Run `num_processes` trainers until all exit; the launcher's exit code.

    `command` replaces `python -m jaxddppo.train` (tests use a fake trainer).
    Returns 0 if every process exits 0, 1 if one fails, 130 on SIGINT (Ctrl-C)
    and 143 on SIGTERM (those two are watched only when called in the main
    thread); no process is left running in any case.
    """
    base_command = list(command or TRAIN_COMMAND)
    port = free_port()
    env = {"JAX_PLATFORMS": "cpu", **os.environ, "PYTHONUNBUFFERED": "1"}
    lock = threading.Lock()
    processes: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    facts = [OutputFacts() for _ in range(num_processes)]
    with SignalWatch() as signals:
        try:
            for process_id in range(num_processes):
                process = subprocess.Popen(
                    [*base_command, *train_args, f"run.cpu_devices={devices_per_process}",
                     f"distributed.coordinator=127.0.0.1:{port}", f"distributed.num_processes={num_processes}",
                     f"distributed.process_id={process_id}"],
                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                processes.append(process)
                reader = threading.Thread(target=forward_output, args=(process_id, process.stdout, lock,
                                                                       facts[process_id]), daemon=True)
                reader.start()
                readers.append(reader)
            return wait_for_all(processes, lock, signals, readers, facts)
        finally:
            stop(processes, timeout_after_failure)
            for reader in readers:
                reader.join()


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options (before `--`) and the trainer's arguments (after it)."""
    parser = OneLineParser(
        prog="python -m jaxddppo.launch",
        usage="%(prog)s --num-processes N --devices-per-process D [--timeout-after-failure S] "
        "-- <arguments for python -m jaxddppo.train>",
        description="Start N jaxddppo.train processes on this machine, D CPU devices each, "
        "connected through a coordinator on 127.0.0.1.",
    )
    parser.add_argument("--num-processes", type=int, required=True, metavar="N", help="processes to start (>= 1)")
    parser.add_argument("--devices-per-process", type=int, required=True, metavar="D",
                        help="simulated CPU devices per process (>= 1)")
    parser.add_argument("--timeout-after-failure", type=float, default=10.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping processes (default 10)")
    split = argv.index("--") if "--" in argv else len(argv)
    args, unknown = parser.parse_known_args(argv[:split])
    if split == len(argv):
        parser.error("missing '--' before the arguments for python -m jaxddppo.train")
    if unknown:
        parser.error(f"unrecognized arguments before '--': {' '.join(unknown)}")
    if args.num_processes < 1:
        parser.error(f"--num-processes must be at least 1, got {args.num_processes}")
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1, got {args.devices_per_process}")
    if not args.timeout_after_failure >= 0:
        parser.error(f"--timeout-after-failure must be at least 0, got {args.timeout_after_failure}")
    return args, list(argv[split + 1:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, train_args = parse_args(list(sys.argv[1:] if argv is None else argv))
    return launch(train_args, args.num_processes, args.devices_per_process, args.timeout_after_failure)


if __name__ == "__main__":
    sys.exit(main())
