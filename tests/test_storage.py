"""Storage faults: damaged checkpoints are found by their digest and set aside, and a full,
read-only or vanished disk ends a run with one line; either way a resume ends exactly as
the run done in one go."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import flip_a_stored_bit, host_leaves, small_config, subprocess_env

from jaxddppo import sweep, train
from jaxddppo.config.files import load_resume_config, to_yaml
from jaxddppo.distributed import global_arrays
from jaxddppo.outputs import writers
from jaxddppo.sweep import resume_sweep, run_sweep
from jaxddppo.train import run
from jaxddppo.training import checkpoint
from jaxddppo.training.checkpoint import CheckpointDamaged, Checkpointer, CheckpointError
from jaxddppo.training.experiment import build
from jaxddppo.training.storage import STORAGE_EXIT_CODE, StorageError, storage_fault


# As tests/test_checkpoint.py: 12 updates of 128 env steps, chunks of 4, a checkpoint every 4.
def small_config_file(directory: Path, run_dir: Path, **sections: dict) -> list[str]:
    """The command-line arguments of `small_config`: a YAML file and run.dir."""
    path = directory / "small.yaml"
    path.write_text(to_yaml(small_config(run_dir, **sections)))
    return ["--config", str(path), f"run.dir={run_dir}"]


@pytest.fixture(scope="module")
def one_go(tmp_path_factory):
    return run(small_config(tmp_path_factory.mktemp("one_go") / "run"), devices=jax.devices()[:4])


def assert_same_state(got, want) -> None:
    for got_leaf, want_leaf in zip(host_leaves(got), host_leaves(want), strict=True):
        np.testing.assert_array_equal(got_leaf, want_leaf)


def test_digest_sees_every_changed_bit_and_no_placement(one_go):
    """The digest changes with one bit anywhere (a key, a counter, an env state, a parameter),
    and not with the device count holding the same shards."""
    state = one_go.state
    digest = global_arrays.state_digest(state)
    on_one_device = build(load_resume_config(one_go.run_dir), devices=jax.devices()[:1]).abstract_state()
    moved = jax.tree.map(lambda leaf, target: jax.device_put(leaf, target.sharding), state, on_one_device)
    assert global_arrays.state_digest(moved) == digest
    leaves, treedef = jax.tree.flatten(state)
    key_leaf = next(i for i, leaf in enumerate(leaves) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))
    for index in (0, key_leaf, len(leaves) // 2, len(leaves) - 1):
        raw = np.array(jax.random.key_data(leaves[index]) if jax.dtypes.issubdtype(
            leaves[index].dtype, jax.dtypes.prng_key) else leaves[index])
        flat = raw.reshape(-1).view(np.uint8)
        flat[flat.size // 2] ^= 1
        changed = jax.device_put(raw, leaves[index].sharding)
        if jax.dtypes.issubdtype(leaves[index].dtype, jax.dtypes.prng_key):
            changed = jax.random.wrap_key_data(changed)
        tree = jax.tree.unflatten(treedef, [*leaves[:index], changed, *leaves[index + 1:]])
        assert global_arrays.state_digest(tree) != digest, index


def numpy_checksum(named: dict[str, np.ndarray]) -> np.ndarray:
    """The checksum's definition in NumPy: every 32-bit word salted by its position in its
    leaf times 0x9E3779B9 plus the first 4 bytes (little-endian) of the sha256 of its leaf's
    name, murmur3-finalised in two lanes, each summed modulo 2**32."""
    def mix(bits: np.ndarray) -> np.ndarray:
        for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            bits = (bits ^ (bits >> shift)) * np.uint64(factor) % 2**32
        return bits ^ (bits >> 16)

    sums = np.zeros(2, np.uint64)
    for name, leaf in named.items():
        bits = np.ascontiguousarray(leaf).view(np.uint32).reshape(-1).astype(np.uint64)
        name_salt = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
        salt = (np.arange(bits.size, dtype=np.uint64) * 0x9E3779B9 + name_salt) % 2**32
        lanes = (mix(bits ^ salt), mix((mix((bits + salt) % 2**32) ^ 0x5BD1E995)))
        sums = (sums + [lane.sum() % 2**32 for lane in lanes]) % 2**32
    return sums.astype(np.uint32)


def test_checksum_equals_its_numpy_definition_in_any_leaf_order():
    tree = {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5, "b": np.full(3, -0.0, np.float32)},
            "count": np.array([7, 2**31 + 5], np.uint32), "steps": np.int32(-3)}
    named = {"params/w": tree["params"]["w"], "params/b": tree["params"]["b"], "count": tree["count"],
             "steps": np.asarray(tree["steps"])}
    want = numpy_checksum(named)
    np.testing.assert_array_equal(np.asarray(jax.jit(global_arrays._bit_checksum)(tree)), want)
    reordered = [tree["steps"], {"b": tree["params"]["b"], "w": tree["params"]["w"]}, tree["count"]]
    renamed = {"0": named["steps"], "1/b": named["params/b"], "1/w": named["params/w"], "2": named["count"]}
    np.testing.assert_array_equal(np.asarray(jax.jit(global_arrays._bit_checksum)(reordered)),
                                  numpy_checksum(renamed))
    assert not np.array_equal(numpy_checksum(renamed), want)


def messages(monkeypatch) -> list[str]:
    """Every progress message of the runs that follow (the warnings among them)."""
    shown, message = [], writers.Progress.message
    monkeypatch.setattr(writers.Progress, "message", lambda self, text: (shown.append(text), message(self, text)))
    return shown


def test_a_flipped_bit_is_set_aside_and_the_resume_is_exact(one_go, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run(small_config(run_dir), devices=jax.devices()[:4], stop_after_updates=8)
    flip_a_stored_bit(run_dir / "checkpoints" / "8")
    checkpointer = Checkpointer(str(run_dir), read_only=True)
    target = build(load_resume_config(str(run_dir)), devices=jax.devices()[:4]).abstract_state()
    manager = ocp.CheckpointManager(run_dir / "checkpoints")  # orbax alone reads it back without a word
    manager.restore(8, args=ocp.args.Composite(state=ocp.args.StandardRestore(checkpoint._without_empty_leaves(target))))
    manager.close()
    with pytest.raises(CheckpointDamaged, match=r"/checkpoints/8 is damaged: state digest [0-9a-f]{16}, "):
        checkpointer.restore(8, target)
    assert checkpointer.verify(8, target)[0] is False and checkpointer.verify(4, target) == (True, "intact")
    checkpointer.close()
    lines = messages(monkeypatch)
    resumed = run(load_resume_config(str(run_dir)), devices=jax.devices()[:4], resume=True)
    assert lines[1].startswith(f"warning: checkpoint {run_dir / 'checkpoints' / '8'} is damaged, skipped, "
                               "moved to 8.damaged (state digest "), lines
    assert lines[2].startswith(f"resumed from {run_dir / 'checkpoints'}/4: update 4 of 12"), lines
    assert (run_dir / "checkpoints" / "8.damaged").is_dir()
    assert_same_state(resumed.state, one_go.state)
    assert resumed.summary["params_digest"] == one_go.summary["params_digest"]


def verify_command(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxddppo.evaluate", str(run_dir), "--verify"],
                          env=subprocess_env(1), capture_output=True, text=True, timeout=300)


def test_verify_lists_every_checkpoint_and_fails_on_a_damaged_newest(one_go, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(one_go.run_dir, run_dir)
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace(one_go.run_dir, str(run_dir)))
    result = verify_command(run_dir)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.splitlines() == [f"{run_dir / 'checkpoints' / str(step)}: intact" for step in (4, 8, 12)]
    flip_a_stored_bit(run_dir / "checkpoints" / "12")
    result = verify_command(run_dir)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines()[1:] == [
        f"{run_dir / 'checkpoints' / '8'}: intact",
        f"{run_dir / 'checkpoints' / '12'}: damaged (its digest differs from the one recorded when it was saved)"]


def save_without_digest(self, state, counters, checksum=None):
    """Checkpointer.save as jaxddppo wrote checkpoints before digests."""
    ocp = checkpoint.ocp
    self._manager.save(counters.update, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(checkpoint._without_empty_leaves(state)),
        counters=ocp.args.JsonSave(checkpoint._counters_record(counters))))


def test_a_checkpoint_without_its_digest_is_never_called_intact(tmp_path, monkeypatch):
    """A checkpoint whose digest is missing cannot be checked: it is unreadable, and skipped."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Checkpointer, "save", save_without_digest)
        run(small_config(run_dir, train={"total_env_steps": 4 * 128}), devices=jax.devices()[:1])
    assert not (run_dir / "checkpoints" / "4" / "digest").exists()
    target = build(load_resume_config(str(run_dir)), devices=jax.devices()[:1]).abstract_state()
    checkpointer, warnings = Checkpointer(str(run_dir), read_only=True), []
    intact, verdict = checkpointer.verify(4, target)
    assert not intact and verdict.startswith("unreadable ("), verdict
    with pytest.raises(CheckpointError, match=r"none of the 1 checkpoint\(s\) .* is intact"):
        checkpointer.restore_latest(target, warnings.append)
    assert len(warnings) == 1 and "is unreadable, skipped" in warnings[0]
    checkpointer.close()


# --- full, read-only and vanished disks ----------------------------------------------------------

def failing_save(code: int, at_update: int):
    """Checkpointer.save that, at `at_update`, leaves a partial step behind and fails as orbax
    does on a full disk (from its background thread, at the next wait)."""
    save = Checkpointer.save

    def save_or_fail(self, state, counters, checksum=None):
        if counters.update != at_update:
            return save(self, state, counters, checksum)
        os.makedirs(os.path.join(self.directory, f"{at_update}.orbax-checkpoint-tmp", "state"))
        raise ValueError(f"RESOURCE_EXHAUSTED: Error writing local file \"{self.directory}/{at_update}"
                         f".orbax-checkpoint-tmp/state/_sharding\": {os.strerror(code)} [os_error_code='{code}']")

    return save_or_fail


def test_a_full_disk_while_saving_is_one_error_and_the_resume_is_exact(one_go, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Checkpointer, "save", failing_save(errno.ENOSPC, at_update=8))
        with pytest.raises(StorageError) as raised:
            run(small_config(run_dir), devices=jax.devices()[:4])
    assert str(raised.value) == (
        f"storage error in {run_dir}: No space left on device (ENOSPC) (checkpoints/8.orbax-checkpoint-tmp/state/"
        f"_sharding); a resume removes the partial checkpoint 8.orbax-checkpoint-tmp; the newest checkpoint, "
        f"{run_dir / 'checkpoints' / '4'}, is intact; once fixed, continue with: python -m jaxddppo.train --resume "
        f"{run_dir}")
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["4", "8.orbax-checkpoint-tmp"]
    resumed = run(load_resume_config(str(run_dir)), devices=jax.devices()[:4], resume=True)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["12", "4", "8"]
    assert_same_state(resumed.state, one_go.state)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["update"] for row in rows] == list(range(1, 13))


@pytest.mark.parametrize("sink, code", [("MetricsWriter", errno.EROFS), ("MetricsWriter", errno.EACCES),
                                        ("MetricsWriter", errno.ENOENT), ("TensorBoardWriter", errno.ENOSPC)])
def test_a_failed_metrics_write_is_one_error(tmp_path, monkeypatch, sink, code):
    """A read-only, forbidden or vanished run directory met by metrics.jsonl, a full disk met
    by the TensorBoard events (injected: the tests run as root, whom chmod does not stop)."""
    run_dir = tmp_path / "run"
    write_rows = getattr(writers, sink).write

    def write(self, rows):
        if rows[0]["update"] > 4:
            raise OSError(code, os.strerror(code))
        write_rows(self, rows)

    monkeypatch.setattr(getattr(writers, sink), "write", write)
    with pytest.raises(StorageError) as raised:
        run(small_config(run_dir, run={"tensorboard": sink == "TensorBoardWriter"}), devices=jax.devices()[:1])
    assert str(raised.value).startswith(
        f"storage error in {run_dir}: {os.strerror(code)} ({errno.errorcode[code]}); the newest checkpoint, "
        f"{run_dir / 'checkpoints' / '4'}, is intact; once fixed, continue with: ")


def test_a_full_disk_while_writing_the_results_is_one_error_and_a_resume_writes_them(one_go, tmp_path,
                                                                                  monkeypatch):
    run_dir = tmp_path / "run"
    write = writers.write_json

    def full_disk_for_the_summary(path, values):
        if os.path.basename(path) == "summary.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write(path, values)

    with monkeypatch.context() as patch:
        patch.setattr(train, "write_json", full_disk_for_the_summary)
        with pytest.raises(StorageError) as raised:
            run(small_config(run_dir), devices=jax.devices()[:4])
    assert str(raised.value) == (
        f"storage error in {run_dir}: No space left on device (ENOSPC) (summary.json) while writing the results; "
        f"the checkpoints are complete; once fixed, write them with: python -m jaxddppo.train --resume {run_dir}")
    assert not (run_dir / "summary.json").exists()
    resumed = run(load_resume_config(str(run_dir)), devices=jax.devices()[:4], resume=True)
    assert_same_state(resumed.state, one_go.state)
    assert json.loads((run_dir / "summary.json").read_text())["total_env_steps"] == resumed.summary["total_env_steps"]


def test_a_sweep_whose_results_cannot_be_written_says_so_in_one_line(tmp_path, monkeypatch):
    run_dir = tmp_path / "sweep"

    def read_only(path, rows):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(sweep, "write_csv", read_only)
    config = small_config(run_dir, train={"total_env_steps": 4 * 128})
    with pytest.raises(StorageError) as raised:
        run_sweep(config, seeds=2, devices=jax.devices()[:2])
    assert str(raised.value) == (
        f"storage error in {run_dir}: Read-only file system (EROFS) (sweep.csv) while writing the results; the "
        f"checkpoints are complete; once fixed, write them with: python -m jaxddppo.sweep --resume {run_dir}")


def test_storage_fault_reads_errors_of_python_and_of_tensorstore():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/run/metrics.jsonl")
        except OSError:
            raise RuntimeError("while closing")
    except RuntimeError as error:
        assert storage_fault(error) == (errno.ENOSPC, "/run/metrics.jsonl")
    message = 'PERMISSION_DENIED: Error writing local file "/r/x": Failed [os_error_code=\'13\']'
    assert storage_fault(ValueError(message)) == (errno.EACCES, "/r/x")
    assert storage_fault(ValueError("shapes differ")) is None
    assert storage_fault(OSError(errno.ECONNREFUSED, "refused")) is None


INJECTED_CLI = """
import errno, sys
from jaxddppo.training.checkpoint import Checkpointer
sys.path.insert(0, sys.argv[1])
from test_storage import failing_save
Checkpointer.save = failing_save(errno.ENOSPC, at_update=8)
from jaxddppo.train import main
sys.exit(main(sys.argv[2:]))
"""


def test_the_command_line_prints_one_line_and_exits_74(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", INJECTED_CLI, str(Path(__file__).parent),
                             *small_config_file(tmp_path, run_dir)],
                            env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert result.returncode == STORAGE_EXIT_CODE == 74, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: storage error in {run_dir}: No space left on device (ENOSPC)") and \
        last.endswith(f"continue with: python -m jaxddppo.train --resume {run_dir}"), result.stderr


@pytest.fixture
def small_filesystem():
    """A 16 MiB tmpfs (where root may mount one; skipped elsewhere)."""
    mount_point = tempfile.mkdtemp(prefix="jaxddppo-small-fs-")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", mount_point], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        os.rmdir(mount_point)
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    yield Path(mount_point)
    subprocess.run(["umount", mount_point], check=True)
    os.rmdir(mount_point)


def fill(filesystem: Path, leaving: int) -> None:
    """Take all of `filesystem`'s free space but `leaving` bytes."""
    free = os.statvfs(filesystem)
    with open(filesystem / "ballast", "wb") as ballast:
        os.posix_fallocate(ballast.fileno(), 0, free.f_bavail * free.f_frsize - leaving)


# Slow: three runs, one of them a subprocess; the injected-ENOSPC tests above run in the default suite.
@pytest.mark.slow
def test_a_real_full_disk_is_one_line_and_the_resume_is_exact(one_go, small_filesystem, tmp_path):
    """Checkpoint 4 saved, then the disk filled to 256 KiB free (a checkpoint takes about 500):
    the resumed run's save of update 8 fails part-way."""
    run_dir = small_filesystem / "run"
    run(small_config(run_dir), devices=jax.devices()[:4], stop_after_updates=4)
    fill(small_filesystem, leaving=256 * 1024)
    result = subprocess.run([sys.executable, "-m", "jaxddppo.train", "--resume", str(run_dir)],
                            env=subprocess_env(4), capture_output=True, text=True, timeout=300)
    assert result.returncode == STORAGE_EXIT_CODE, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 3 and lines[1].startswith(f"resumed from {run_dir / 'checkpoints'}/4: update 4 of 12"), lines
    directory = re.escape(str(run_dir))
    assert re.fullmatch(  # the file named is the first write that found the disk full
        rf"error: storage error in {directory}: No space left on device \(ENOSPC\)( \([^)]+\))?; a resume removes the "
        rf"partial checkpoint 8\.orbax-checkpoint-tmp; the newest checkpoint, {directory}/checkpoints/4, is intact; "
        rf"once fixed, continue with: python -m jaxddppo\.train --resume {directory}", lines[2]), lines
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["4", "8.orbax-checkpoint-tmp"]
    larger = tmp_path / "run"  # space freed: the run moved to a larger disk
    shutil.copytree(run_dir, larger)
    (larger / "config.yaml").write_text((larger / "config.yaml").read_text().replace(str(run_dir), str(larger)))
    resumed = run(load_resume_config(str(larger)), devices=jax.devices()[:4], resume=True)
    assert sorted(os.listdir(larger / "checkpoints")) == ["12", "4", "8"]
    assert_same_state(resumed.state, one_go.state)


# --- sweeps and several processes --------------------------------------------------------------------

def test_a_damaged_sweep_checkpoint_is_found_and_set_aside(tmp_path, monkeypatch):
    """The digest covers every member (one bit of member 1's parameters changes it); a
    damaged checkpoint of a sweep is listed by --verify and set aside by the resume."""
    run_dir = tmp_path / "sweep"
    config = small_config(run_dir, train={"total_env_steps": 8 * 128, "num_shards": 2})
    done = run_sweep(config, seeds=2, devices=jax.devices()[:2])
    leaves, treedef = jax.tree.flatten(done.state)
    changed = np.array(leaves[0])
    changed[1].reshape(-1)[0] = np.nextafter(changed[1].reshape(-1)[0], np.float32(np.inf))
    leaves[0] = jax.device_put(changed, leaves[0].sharding)
    assert global_arrays.state_digest(jax.tree.unflatten(treedef, leaves)) != global_arrays.state_digest(done.state)

    flip_a_stored_bit(run_dir / "checkpoints" / "8")
    result = verify_command(run_dir)
    assert result.returncode == 1 and result.stdout.splitlines() == [
        f"{run_dir / 'checkpoints' / '4'}: intact",
        f"{run_dir / 'checkpoints' / '8'}: damaged (its digest differs from the one recorded when it was saved)",
    ], result.stdout + result.stderr
    lines = messages(monkeypatch)
    resumed = resume_sweep(str(run_dir), devices=jax.devices()[:2])
    assert resumed.counters.update == 8 and (run_dir / "checkpoints" / "8.damaged").is_dir()
    assert lines[1].startswith(f"warning: checkpoint {run_dir / 'checkpoints' / '8'} is damaged, skipped"), lines
    assert lines[2].startswith(f"resumed from {run_dir / 'checkpoints'}/4"), lines
    assert_same_state(resumed.state, done.state)
