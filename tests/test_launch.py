"""The multi-process launcher, with a fake trainer in place of `python -m jaxddppo.train`.

The fake trainer reads its `key=value` arguments, writes its pid and what it saw
(arguments, XLA_FLAGS, JAX_PLATFORMS, PYTHONUNBUFFERED) to files in `out=DIR`,
prints two lines, then behaves as `mode=` says: `ok` exits 0; `fail` makes
process 1 exit 3 once every process has written its pid, while the others sleep;
`sleep` sleeps until killed; `exit_abort` makes process 0 print jaxlib 0.11.2's
abort at exit and abort, after the trainer's "done" line with `done=1` (the others
exit 0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxddppo.launch import OutputFacts, launch

REPO_ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 60  # a child process that outlives this is a bug

FAKE_TRAINER = r"""
import json, os, sys, time
args = dict(arg.split("=", 1) for arg in sys.argv[1:] if "=" in arg)
out, index = args["out"], int(args["distributed.process_id"])

def write(name, text):
    with open(os.path.join(out, name + ".tmp"), "w") as handle:
        handle.write(text)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))

seen = {"args": args, "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
        "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED")}
write(f"seen{index}.json", json.dumps(seen))
write(f"pid{index}", str(os.getpid()))
print(f"hello from {index}")
print(f"stderr of {index}", file=sys.stderr)
if args["mode"] == "ok" or (args["mode"] == "exit_abort" and index > 0):
    sys.exit(0)
if args["mode"] == "exit_abort":
    if args.get("done") == "1":
        print("done (process 0 of 2): 2,048 steps in 1.0 s (2,048 steps/s, compile 1.0 s); eval return 9.0")
    print("F1128 13:49:47.551606   29396 server.cc:561] Check failed: queue.Pop() == nullptr (0x7f8c vs. (null))",
          file=sys.stderr)
    print("    @     0x7f8d2ad7611b  xla::DistributedRuntimeService::Shutdown()", file=sys.stderr, flush=True)
    os.abort()
if args["mode"] == "fail" and index == 1:
    num_processes = int(args["distributed.num_processes"])
    while not all(os.path.exists(os.path.join(out, f"pid{i}")) for i in range(num_processes)):
        time.sleep(0.01)
    sys.exit(3)
while True:
    time.sleep(1)
"""
FAKE_COMMAND = [sys.executable, "-c", FAKE_TRAINER]


def wait_for_files(paths: list[Path], timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, f"not written in {timeout} s: {paths}"
        time.sleep(0.02)


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def child_pids(out: Path, num_processes: int) -> list[int]:
    return [int((out / f"pid{index}").read_text()) for index in range(num_processes)]


class LaunchInThread:
    """`launch(...)` in a thread, so that the test can act on the children meanwhile."""

    def __init__(self, *args, **kwargs):
        self.returncode: int | None = None
        self.thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, *args, **kwargs) -> None:
        self.returncode = launch(*args, **kwargs)

    def join(self) -> int:
        self.thread.join(HANG_GUARD_S)
        assert not self.thread.is_alive(), "the launcher did not return"
        return self.returncode


def test_all_processes_succeed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert launch(["mode=ok", f"out={tmp_path}", "run.cpu_devices=7"], 3, 2, command=FAKE_COMMAND) == 0

    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == sorted(
        f"[p{index}] {text} {index}" for index in range(3) for text in ("hello from", "stderr of")
    )
    seen = [json.loads((tmp_path / f"seen{index}.json").read_text()) for index in range(3)]
    ports = set()
    for index, child in enumerate(seen):
        assert child["args"]["distributed.process_id"] == str(index)
        assert child["args"]["distributed.num_processes"] == "3"
        host, port = child["args"]["distributed.coordinator"].split(":")
        assert host == "127.0.0.1" and 0 < int(port) < 65536
        ports.add(port)
        assert child["args"]["run.cpu_devices"] == "2"  # after the trainer's arguments, so it wins
        assert child["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4"
        assert child["JAX_PLATFORMS"] == "cpu"
        assert child["PYTHONUNBUFFERED"] == "1"
    assert len(ports) == 1
    for pid in child_pids(tmp_path, 3):
        assert_gone(pid)


def test_user_jax_platforms_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.delenv("XLA_FLAGS")
    assert launch(["mode=ok", f"out={tmp_path}"], 1, 3, command=FAKE_COMMAND) == 0
    seen = json.loads((tmp_path / "seen0.json").read_text())
    assert seen["JAX_PLATFORMS"] == "cuda"
    assert seen["args"]["run.cpu_devices"] == "3"


def test_an_abort_in_jaxlibs_shutdown_after_the_done_line_counts_as_done(tmp_path, capsys):
    assert launch(["mode=exit_abort", "done=1", f"out={tmp_path}"], 2, 1, command=FAKE_COMMAND) == 0
    captured = capsys.readouterr()
    assert captured.err == ("launch: process 0 finished, then exited with status -6 (killed by SIGABRT) in jaxlib's "
                            "shutdown of the distributed service (a jaxlib 0.11.2 fault at exit; its results are "
                            "complete): counted as done\n")
    assert "[p0] done (process 0 of 2): 2,048 steps in 1.0 s (2,048 steps/s, compile 1.0 s); eval return 9.0" in (
        captured.out.splitlines())


@pytest.mark.parametrize("lines, finished", [
    (["done (process 1 of 4): 8,192 steps in 0.9 s"], True),
    (["done: 8,192 steps in 0.9 s"], True),  # the only process
    (["\r" + " " * 20 + "\rdone: 8,192 steps in 0.9 s"], True),  # after a progress bar cleared itself
    (["jaxddppo: not done yet", "done"], False),
])
def test_the_done_line_is_recognised(lines, finished):
    facts = OutputFacts()
    for line in lines + ["F1128 server.cc:561] Check failed: queue.Pop() == nullptr (0x7f8c vs. (null))",
                         "    @     0x7f8d2ad7611b  xla::DistributedRuntimeService::Shutdown()"]:
        facts.note(line)
    assert facts.aborted_after_finishing == finished


def test_the_same_abort_without_the_done_line_is_a_failure(tmp_path, capsys):
    assert launch(["mode=exit_abort", f"out={tmp_path}"], 2, 1, command=FAKE_COMMAND) == 1
    assert capsys.readouterr().err.endswith(
        "launch: process 0 exited with status -6 (killed by SIGABRT); stopping the others\n")


def test_failing_process_stops_the_others(tmp_path, capsys):
    start = time.monotonic()
    returncode = launch(["mode=fail", f"out={tmp_path}"], 3, 1, command=FAKE_COMMAND)
    elapsed = time.monotonic() - start

    assert returncode == 1
    assert elapsed < 20
    captured = capsys.readouterr()
    assert captured.err == "launch: process 1 exited with status 3; stopping the others\n"
    assert "[p1] hello from 1" in captured.out.splitlines()
    for pid in child_pids(tmp_path, 3):
        assert_gone(pid)


def test_killed_process_is_named_with_its_signal(tmp_path, capsys):
    launcher = LaunchInThread(["mode=sleep", f"out={tmp_path}"], 2, 1, command=FAKE_COMMAND)
    wait_for_files([tmp_path / "pid0", tmp_path / "pid1"])
    pids = child_pids(tmp_path, 2)
    os.kill(pids[1], signal.SIGKILL)

    assert launcher.join() == 1
    assert capsys.readouterr().err == (
        "launch: process 1 exited with status -9 (killed by SIGKILL); stopping the others\n"
    )
    for pid in pids:
        assert_gone(pid)


def test_survivor_ignoring_sigterm_is_killed(tmp_path, capsys):
    stubborn = FAKE_TRAINER.replace("import json", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); import json")
    start = time.monotonic()
    returncode = launch(["mode=fail", f"out={tmp_path}"], 2, 1, timeout_after_failure=0.5,
                        command=[sys.executable, "-c", stubborn])
    assert returncode == 1
    assert time.monotonic() - start < 20
    assert "process 1 exited with status 3" in capsys.readouterr().err
    for pid in child_pids(tmp_path, 2):
        assert_gone(pid)


@pytest.mark.parametrize(("signum", "expected"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_the_launcher_stops_every_process(tmp_path, signum, expected):
    runner = (f"import sys; from jaxddppo.launch import launch; "
              f"sys.exit(launch(['mode=sleep', 'out={tmp_path}'], 2, 1, command={FAKE_COMMAND!r}))")
    launcher = subprocess.Popen(
        [sys.executable, "-c", runner],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_files([tmp_path / "pid0", tmp_path / "pid1"])
        launcher.send_signal(signum)
        stdout, stderr = launcher.communicate(timeout=HANG_GUARD_S)
    finally:
        launcher.kill()
    assert launcher.returncode == expected
    assert stderr == f"launch: received {signal.Signals(signum).name}; stopping all processes\n"
    assert "[p0] hello from 0" in stdout.splitlines()
    for pid in child_pids(tmp_path, 2):
        assert_gone(pid)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--num-processes", "2", "--devices-per-process", "1", "mode=ok"], "missing '--'"),
        (["--num-processes", "0", "--devices-per-process", "1", "--"], "--num-processes must be at least 1"),
        (["--num-processes", "2", "--devices-per-process", "0", "--"], "--devices-per-process must be at least 1"),
        (["--num-processes", "2", "--"], "--devices-per-process"),
        (["--num-processes", "two", "--devices-per-process", "1", "--"], "invalid int value"),
        (["--num-processes", "2", "--devices-per-process", "1", "--config", "x.yaml", "--"],
         "unrecognized arguments before '--': --config x.yaml"),
        (["--num-processes", "1", "--devices-per-process", "1", "--timeout-after-failure", "-1", "--"],
         "--timeout-after-failure must be at least 0"),
    ],
)
def test_argument_errors(arguments, message):
    result = subprocess.run([sys.executable, "-m", "jaxddppo.launch", *arguments], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help():
    result = subprocess.run([sys.executable, "-m", "jaxddppo.launch", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0
    assert "--num-processes N --devices-per-process D" in result.stdout
