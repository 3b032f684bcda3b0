"""Several processes through jax.distributed, on one machine (127.0.0.1, gloo CPU collectives)."""

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import flip_a_stored_bit, subprocess_env

from jaxddppo.config.files import load_config
from jaxddppo.distributed import multiprocess
from jaxddppo.launch import OutputFacts, finished_before_exit_abort
from jaxddppo.train import run
from jaxddppo.training.experiment import build

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = ["--config", str(REPO_ROOT / "experiments" / "cartpole.yaml"), "env.num_envs=8",
             "train.num_shards=4", "ppo.num_steps=32", "train.total_env_steps=2048", "eval.num_episodes=4",
             "run.progress=false"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Evaluations after updates 4 and 8: a collective every process must join.
PERIODIC_EVAL = ["train.updates_per_chunk=4", "eval.every_updates=4"]


def exit_code(returncode: int, log: str) -> int:
    """A worker's exit code, 0 for one that finished its command and then met jaxlib 0.11.2's
    abort at exit, as the launcher counts it (docs/multihost.md, "Exit status")."""
    facts = OutputFacts()
    for line in log.splitlines():
        facts.note(line)
    return 0 if finished_before_exit_abort(returncode, facts) else returncode


def eval_rows(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["update"], row["eval_return_mean"], row["eval_return_std"]) for row in rows
            if row["eval_return_mean"] is not None]


# The environment by reference (`module:attribute`, gymnax's CartPole class, the same bits as
# CartPole-v1): every process imports it (tests/test_user_code.py has a user's own module).
CARTPOLE_BY_REFERENCE = ["env.id=gymnax.environments.classic_control.cartpole:CartPole"]


def test_two_processes_learn_what_one_process_learns(tmp_path):
    port = free_port()
    # The clocks of the checkpoint schedule disagree on purpose: process 0 finds a save due after
    # every chunk, process 1 never. A save is a collective, so both must agree to save after update 4.
    save_every_seconds = ["checkpoint.every_seconds=1e-9", "checkpoint.every_seconds=0"]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxddppo.train", *SMALL_RUN, *PERIODIC_EVAL, *CARTPOLE_BY_REFERENCE,
             f"run.dir={tmp_path / 'multi'}",
             "debug.check_replicas=true", "run.cpu_devices=2", f"distributed.coordinator=127.0.0.1:{port}",
             "distributed.num_processes=2", f"distributed.process_id={process_id}",
             "distributed.init_timeout=120", save_every_seconds[process_id]],
            env=subprocess_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for process_id in range(2)
    ]
    try:
        outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    for worker, output in zip(workers, outputs):
        assert exit_code(worker.returncode, output) == 0, output
    assert "process 1 of 2" in outputs[1] and "process 0 writes the results" in outputs[1]
    summary = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert (summary["num_processes"], summary["num_devices"], summary["num_shards"]) == (2, 4, 4)

    assert sorted(os.listdir(tmp_path / "multi" / "checkpoints"), key=int) == ["4", "8"]

    multi_evals = eval_rows(tmp_path / "multi")
    assert [update for update, *_ in multi_evals] == [4, 8]

    # One process on one device, its 4 shards in turn: the same bits (train.exact_reductions).
    config = load_config(SMALL_RUN[1], SMALL_RUN[2:] + PERIODIC_EVAL + CARTPOLE_BY_REFERENCE)
    single = run(replace(config, run=replace(config.run, dir=str(tmp_path / "single"))), devices=jax.devices()[:1])
    assert summary["params_digest"] == single.summary["params_digest"]
    assert summary["eval_return_mean"] == single.summary["eval_return_mean"]
    assert eval_rows(Path(single.run_dir)) == multi_evals


def test_unreachable_coordinator_is_one_line_within_the_timeout(tmp_path):
    start = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "jaxddppo.train", *SMALL_RUN, f"run.dir={tmp_path / 'r'}",
         f"distributed.coordinator=127.0.0.1:{free_port()}", "distributed.num_processes=2",
         "distributed.process_id=1", "distributed.init_timeout=3"],
        env=subprocess_env(1), capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - start
    lines = completed.stderr.strip().splitlines()
    assert completed.returncode == 1, completed.stderr
    assert len(lines) == 1 and "unreachable for 3 s" in lines[0] and "distributed.init_timeout" in lines[0]
    assert elapsed < 3 + 60  # the timeout, plus start-up of the interpreter and imports
    assert not (tmp_path / "r").exists()


def replica_config(tmp_path, check: bool):
    return load_config(SMALL_RUN[1], SMALL_RUN[2:] + [f"run.dir={tmp_path / 'r'}", f"debug.check_replicas={check}"])


def test_replica_check_passes_on_a_healthy_run(tmp_path):
    result = run(replica_config(tmp_path, True), devices=jax.devices()[:2])
    assert result.summary["num_updates"] == 8


def test_replica_check_stops_on_a_perturbed_replica(tmp_path):
    experiment = build(replica_config(tmp_path, True), jax.devices()[:2])
    params = experiment.init_state().params
    multiprocess.check_replicas(params, experiment.mesh, after_update=0)

    def perturb_device_one(leaf):
        copies = [np.array(copy.data) for copy in leaf.addressable_shards]
        copies[1].flat[0] = np.nextafter(copies[1].flat[0], np.float32(np.inf))
        return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, [
            jax.device_put(values, copy.device) for values, copy in zip(copies, leaf.addressable_shards)])

    perturbed = jax.tree.map(perturb_device_one, params)
    with pytest.raises(multiprocess.ReplicaDivergence, match=r"after update 7: device\(s\) \[1\] differ from device 0"):
        multiprocess.check_replicas(perturbed, experiment.mesh, after_update=7)


def processes_mentioning(text: str) -> dict[int, str]:
    """pid -> command line of every live process whose command line contains `text`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in command:
                found[int(entry.name)] = command
    return found


@pytest.mark.slow  # about 60 s; test_launch.py checks the same stop and message on stand-in processes in CI
def test_launcher_stops_every_process_when_a_worker_dies(tmp_path):
    run_dir = tmp_path / "killed"
    long_run = SMALL_RUN + ["train.total_env_steps=10000000", "train.updates_per_chunk=1", f"run.dir={run_dir}"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxddppo.launch", "--num-processes", "2", "--devices-per-process", "1",
         "--timeout-after-failure", "5", "--", *long_run],
        env=subprocess_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert launcher.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        workers = {pid: cmd for pid, cmd in processes_mentioning(str(run_dir)).items() if "jaxddppo.train" in cmd}
        [victim] = [pid for pid, cmd in workers.items() if "distributed.process_id=1" in cmd]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)
        assert time.monotonic() - killed_at < 60
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    assert "process 1 exited with status -9 (killed by SIGKILL)" in stderr
    assert not processes_mentioning(str(run_dir)), "a worker outlived the launcher"


def start_workers(args: list[str], port: int, log_dir: Path, command: str = "jaxddppo.train") -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", command, *args, f"distributed.coordinator=127.0.0.1:{port}",
             "distributed.num_processes=2", f"distributed.process_id={process_id}", "distributed.init_timeout=120"],
            env=subprocess_env(1), stdout=open(log_dir / f"worker{process_id}.log", "w"), stderr=subprocess.STDOUT,
        )
        for process_id in range(2)
    ]


def wait_all(workers: list[subprocess.Popen], log_dir: Path, timeout: float = 300) -> list[int]:
    """The exit codes (`exit_code`) of the workers `start_workers` started with logs in `log_dir`."""
    try:
        codes = [worker.wait(timeout=timeout) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    return [exit_code(code, (log_dir / f"worker{index}.log").read_text()) for index, code in enumerate(codes)]


@pytest.mark.slow  # about 60 s; the single-process SIGTERM test in test_checkpoint.py runs in CI
def test_sigterm_to_one_process_stops_both_at_the_same_update_and_they_resume(tmp_path):
    run_dir = tmp_path / "run"
    long_run = SMALL_RUN + ["train.total_env_steps=100000000", "train.updates_per_chunk=1", f"run.dir={run_dir}",
                            "ppo.anneal_lr=false"]
    workers = start_workers(long_run, free_port(), tmp_path)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert all(w.poll() is None for w in workers) and time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    workers[1].send_signal(signal.SIGTERM)
    codes = wait_all(workers, tmp_path)
    logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
    assert codes == [75, 75], logs
    stops = [int(log.split(" after update ")[1].split()[0]) for log in logs]
    assert "stopped (process 1 of 2) by SIGTERM" in logs[1]
    assert "stopped (process 0 of 2) by another process's signal" in logs[0]
    assert stops[0] == stops[1] and str(stops[0]) in os.listdir(run_dir / "checkpoints")

    resume = ["--resume", str(run_dir), f"train.total_env_steps={(stops[0] + 2) * 256}"]
    codes = wait_all(start_workers(resume, free_port(), tmp_path), tmp_path)
    logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs
    assert [json.loads(line)["update"] for line in metrics.read_text().splitlines()] == list(range(1, stops[0] + 3))


def test_both_processes_set_aside_a_damaged_checkpoint_and_resume_from_the_same_one(tmp_path):
    """Every process verifies the digest of the global state and all restore the same
    checkpoint; the resumed run ends where the run before the damage ended."""
    run_dir = tmp_path / "run"
    args = [*SMALL_RUN, f"run.dir={run_dir}", "run.cpu_devices=2", "train.updates_per_chunk=4",
            "checkpoint.every_updates=4"]
    assert wait_all(start_workers(args, free_port(), tmp_path), tmp_path) == [0, 0]
    before = json.loads((run_dir / "summary.json").read_text())
    flip_a_stored_bit(run_dir / "checkpoints" / "8")

    codes = wait_all(start_workers(["--resume", str(run_dir)], free_port(), tmp_path), tmp_path)
    logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs
    for log in logs:
        assert f"checkpoint {run_dir / 'checkpoints' / '8'} is damaged, skipped, moved to 8.damaged" in log, log
        assert f"resumed from {run_dir / 'checkpoints'}/4: update 4 of 8" in log, log
    assert json.loads((run_dir / "summary.json").read_text())["params_digest"] == before["params_digest"]


def test_a_pbt_sweep_over_two_processes_copies_across_them(tmp_path):
    """4 members, one per device, 2 devices per process: losers copy winners held by the other
    process (the exploit's collective crosses processes), and the sweep ends with the
    decisions and the bits of the same sweep in one process on one device."""
    sweep_args = ["--config", str(REPO_ROOT / "experiments" / "cartpole.yaml"), "env.num_envs=4",
                  "ppo.num_steps=16", "train.total_env_steps=2048", "train.updates_per_chunk=8",
                  "train.num_shards=2", "train.batch_members=false", "eval.num_episodes=4", "run.progress=false",
                  "pbt.every_updates=8", "pbt.quantile=0.5", "ppo.learning_rate=[1e-4,3e-4,1e-3,3e-3]"]
    workers = start_workers([*sweep_args, "--member-devices", "4", f"run.dir={tmp_path / 'multi'}",
                             "run.cpu_devices=2"], free_port(), tmp_path, command="jaxddppo.sweep")
    assert wait_all(workers, tmp_path) == [0, 0], [(tmp_path / f"worker{index}.log").read_text() for index in range(2)]
    single = subprocess.run([sys.executable, "-m", "jaxddppo.sweep", *sweep_args, f"run.dir={tmp_path / 'single'}"],
                            env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr

    def exploits(run_dir: Path) -> list[dict]:
        return [json.loads(line) for line in (run_dir / "pbt.jsonl").read_text().splitlines()]

    def digests(run_dir: Path) -> list[str]:
        with open(run_dir / "sweep.csv", newline="") as handle:
            return [row["params_digest"] for row in csv.DictReader(handle)]

    copies = [(row["member"], row["copied_from"]) for row in exploits(tmp_path / "multi") if row["update"] > 0]
    assert any(loser // 2 != winner // 2 for loser, winner in copies), copies  # process = member // 2
    assert exploits(tmp_path / "multi") == exploits(tmp_path / "single")
    assert digests(tmp_path / "multi") == digests(tmp_path / "single")
