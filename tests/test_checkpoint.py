"""Checkpoints, exact resume, preemption, hard kills, non-finite guard, and loading a trained policy."""

from __future__ import annotations

import ast
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from conftest import host_leaves, small_config, subprocess_env

from jaxddppo.config.files import load_config, load_resume_config, with_overrides
from jaxddppo.config.options import ConfigError
from jaxddppo.distributed import global_arrays
from jaxddppo.envs import BatchedEnv, make_env
from jaxddppo.evaluate import evaluate, statistics
from jaxddppo.outputs import policy as policy_module
from jaxddppo.outputs.policy import load_policy
from jaxddppo.outputs.writers import truncate_metrics
from jaxddppo.rollout import normalize
from jaxddppo.train import run
from jaxddppo.training import checkpoint
from jaxddppo.training.checkpoint import PREEMPTED_EXIT_CODE, Checkpointer, SaveSchedule
from jaxddppo.training.chunk_metrics import NonFiniteError
from jaxddppo.training.experiment import (
    CompilingProgram,
    Experiment,
    all_finite,
    build,
    compile_programs,
    update_count,
)
from jaxddppo.training.loop import chunk_plan

REPO_ROOT = Path(__file__).resolve().parents[1]

# CartPole, 8 envs x 16 steps = 128 env steps per update, 12 updates, chunks of 4, a checkpoint every 4;
# with both running statistics, so that they too must survive a resume exactly.
# The fields of the state that checkpoint format 6 holds: a field added to every run's state
# (as PBT's first was) would leave the checkpoints written before it unreadable.
STATE_FIELDS = {"params", "opt_state", "rollout", "key", "update_index", "obs_moments", "return_moments"}


def test_a_checkpoint_holds_the_parameters_once_and_each_shard_s_environments(tmp_path):
    """On 4 shards, the parameters, optimizer state and statistics are saved once
    (the shapes the network gives them), the environments and keys once per shard."""
    run_dir = tmp_path / "run"
    run(small_config(run_dir, train={"total_env_steps": 4 * 128}), devices=jax.devices()[:4])
    metadata = json.loads(next((run_dir / "checkpoints").glob("*/state/_METADATA")).read_text())
    assert {ast.literal_eval(path)[0] for path in metadata["tree_metadata"]} == STATE_FIELDS
    saved = ocp.StandardCheckpointer().metadata(str(next((run_dir / "checkpoints").glob("*/state"))))
    saved = getattr(saved, "item_metadata", saved)
    experiment = build(load_resume_config(str(run_dir)), devices=jax.devices()[:1])
    obs = jnp.zeros((1, *experiment.env.spec.obs_shape))
    network = jax.eval_shape(experiment.network.init, jax.random.key(0), obs)
    assert [leaf.shape for leaf in jax.tree.leaves(saved["params"])] == [leaf.shape for leaf in jax.tree.leaves(network)]
    assert {leaf.shape[0] for leaf in jax.tree.leaves(saved["rollout"])} == {4}


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_wall_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_seconds"} for row in rows]


@pytest.fixture(scope="module")
def one_go(tmp_path_factory):
    """The reference: the small run done in one go on 4 devices."""
    run_dir = tmp_path_factory.mktemp("one_go") / "run"
    return run(small_config(run_dir), devices=jax.devices()[:4])


def test_chunk_plan_cuts_at_chunks_checkpoints_and_the_stop():
    assert list(chunk_plan(0, 12, 4, 4)) == [4, 4, 4]
    assert list(chunk_plan(0, 10, 4, 0)) == [4, 4, 2]
    assert list(chunk_plan(0, 12, 4, 6)) == [4, 2, 2, 4]
    assert list(chunk_plan(6, 12, 4, 4)) == [2, 4]
    assert list(chunk_plan(12, 12, 4, 4)) == []


@pytest.mark.oldest
def test_stop_and_resume_is_bit_identical_to_one_go(one_go, tmp_path):
    run_dir = tmp_path / "run"
    first = run(small_config(run_dir), devices=jax.devices()[:4], stop_after_updates=6)
    assert first.summary is None and first.stopped_by == "stop_after_updates" and first.counters.update == 6
    assert first.final_evaluate is None  # no final evaluation to compile
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["4", "6"]
    resumed = run(load_resume_config(str(run_dir)), devices=jax.devices()[:4], resume=True)
    assert resumed.counters.update == 12
    for got, want in zip(host_leaves(resumed.state), host_leaves(one_go.state), strict=True):
        np.testing.assert_array_equal(got, want)
    assert resumed.summary["params_digest"] == one_go.summary["params_digest"]
    assert without_wall_time(metric_rows(run_dir)) == without_wall_time(metric_rows(Path(one_go.run_dir)))


def test_elastic_resume_on_one_device_is_bit_identical_to_one_go(one_go, tmp_path):
    """Stopped on 4 devices, resumed on 1 (the same 4 shards, in turn): train.exact_reductions
    makes the resumed run end where the run done in one go on 4 devices ends, bit for bit."""
    run_dir = tmp_path / "run"
    run(small_config(run_dir), devices=jax.devices()[:4], stop_after_updates=4)
    resumed = run(load_resume_config(str(run_dir)), devices=jax.devices()[:1], resume=True)
    assert resumed.summary["num_devices"] == 1 and resumed.summary["num_shards"] == 4
    for got, want in zip(host_leaves(resumed.state), host_leaves(one_go.state), strict=True):
        np.testing.assert_array_equal(got, want)
    assert resumed.summary["params_digest"] == one_go.summary["params_digest"]
    assert without_wall_time(metric_rows(run_dir)) == without_wall_time(metric_rows(Path(one_go.run_dir)))


def test_resume_refuses_algorithm_changes_and_accepts_safe_ones(one_go):
    with pytest.raises(ConfigError, match=r"^ppo\.learning_rate=0\.1 cannot change on resume"):
        load_resume_config(one_go.run_dir, ["ppo.learning_rate=0.1"])
    with pytest.raises(ConfigError, match=r"^train\.num_shards=2 cannot change on resume"):
        load_resume_config(one_go.run_dir, ["train.num_shards=2"])
    with pytest.raises(ConfigError, match=r"^run\.cpu_tuning='off' cannot change on resume \(the run has 'on'\)"):
        load_resume_config(one_go.run_dir, ["run.cpu_tuning=off"])  # the minibatch orders
    with pytest.raises(ConfigError, match="run directory /nonexistent does not exist"):
        load_resume_config("/nonexistent")
    config = load_resume_config(one_go.run_dir, ["train.total_env_steps=4096", "checkpoint.keep=5"])
    assert config.train.total_env_steps == 4096 and config.checkpoint.keep == 5


def test_the_api_refuses_algorithm_changes_on_resume_and_keeps_config_yaml(one_go):
    """`run(config, resume=True)` with a whole config, as the command refuses an override."""
    stored = Path(one_go.run_dir) / "config.yaml"
    before = stored.read_bytes()
    changed = with_overrides(load_resume_config(one_go.run_dir), {"ppo.learning_rate": 0.1})
    with pytest.raises(ConfigError, match=r"^ppo\.learning_rate=0\.1 cannot change on resume \(the run has 0\.00025\)"):
        run(changed, resume=True)
    assert stored.read_bytes() == before


def test_config_yaml_records_the_resolved_cpu_switch_and_older_runs_resume_with_theirs(one_go, tmp_path):
    """run.cpu_tuning=auto is written as what it resolved to (on, on this CPU); a run directory
    written before the switch resumes with the switch that draws its minibatch orders."""
    stored = yaml.safe_load((Path(one_go.run_dir) / "config.yaml").read_text())
    assert stored["run"]["cpu_tuning"] == "on"
    for shuffle, flat, switch in (("jax", False, "off"), ("cpu_sorts", False, "on"), ("cpu_sorts", True, None)):
        older = tmp_path / f"{shuffle}-{flat}"
        older.mkdir()
        values = {**stored, "run": {key: value for key, value in stored["run"].items() if key != "cpu_tuning"}}
        values["ppo"] = {**stored["ppo"], "minibatch_shuffle": shuffle, "flat_optimizer": flat}
        values["network"] = {**stored["network"], "dense_gradient": "autodiff"}
        values["run"]["fast_cpu_compile"] = True
        (older / "config.yaml").write_text(yaml.safe_dump(values))
        if switch is None:
            with pytest.raises(ConfigError, match=r"ppo\.flat_optimizer=true is gone .* resume this run with"):
                load_resume_config(str(older))
        else:
            assert load_resume_config(str(older)).run.cpu_tuning == switch
    with pytest.raises(ConfigError, match=r"'ppo\.minibatch_shuffle' was replaced by run\.cpu_tuning"):
        load_config(None, ["ppo.minibatch_shuffle=cpu_sorts"])


def test_resume_below_the_steps_done_is_refused_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    run(small_config(run_dir), devices=jax.devices()[:4], stop_after_updates=4)
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    config = load_resume_config(str(run_dir), ["train.total_env_steps=256"])
    with pytest.raises(ConfigError, match=r"^train\.total_env_steps=256 is below the 512 env steps the checkpoint "
                                          r"at update 4 has done$"):
        run(config, devices=jax.devices()[:4], resume=True)
    assert {name: (run_dir / name).read_bytes() for name in before} == before


def test_keep_limits_the_checkpoints_kept(tmp_path):
    run_dir = tmp_path / "run"
    run(small_config(run_dir, checkpoint={"every_updates": 2, "keep": 2}), devices=jax.devices()[:4])
    assert sorted(os.listdir(run_dir / "checkpoints"), key=int) == ["10", "12"]


def test_save_schedule_by_update_and_by_time():
    now = [100.0]
    schedule = SaveSchedule(every_updates=4, every_seconds=30.0, clock=lambda: now[0])
    assert [update for update in range(1, 13) if schedule.due_by_update(update)] == [4, 8, 12]
    now[0] = 129.9
    assert not schedule.due_by_time()
    now[0] = 130.0
    assert schedule.due_by_time()
    schedule.saved()
    now[0] = 159.0
    assert not schedule.due_by_time()
    off = SaveSchedule(every_updates=0, every_seconds=0.0, clock=lambda: now[0])
    now[0] = 1e9
    assert not off.due_by_time() and not any(off.due_by_update(update) for update in range(1, 100))


@pytest.mark.parametrize("every_seconds, expected", [(1e-9, ["4", "8", "12"]),
                                                     pytest.param(300.0, ["12"], marks=pytest.mark.slow)])
def test_time_based_checkpoints_fall_on_chunk_boundaries(tmp_path, every_seconds, expected):
    """With no update cadence, a save is due at the first chunk boundary after `every_seconds`:
    after every chunk with a tiny interval, only the final save within a short run by default."""
    run_dir = tmp_path / "run"
    result = run(small_config(run_dir, checkpoint={"every_updates": 0, "every_seconds": every_seconds, "keep": 5}),
                 devices=jax.devices()[:4])
    assert sorted(os.listdir(run_dir / "checkpoints"), key=int) == expected
    checkpointer = Checkpointer(str(run_dir), read_only=True)
    restored, counters = checkpointer.restore(12, result.state)
    checkpointer.close()
    assert counters.update == 12
    assert global_arrays.params_digest(restored.params) == result.summary["params_digest"]


def corrupt(step_dir: Path) -> None:
    for path in (step_dir / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(os.urandom(max(path.stat().st_size, 16)))


def test_corrupted_newest_checkpoint_is_named_and_the_previous_one_used(one_go, tmp_path):
    run_dir = tmp_path / "run"
    run(small_config(run_dir), devices=jax.devices()[:4], stop_after_updates=8)
    corrupt(run_dir / "checkpoints" / "8")
    reports: list[str] = []
    experiment = build(load_resume_config(str(run_dir)), devices=jax.devices()[:4])
    checkpointer = Checkpointer(str(run_dir), read_only=True)
    _, counters = checkpointer.restore_latest(experiment.abstract_state(), reports.append)
    assert counters.update == 4
    assert len(reports) == 1 and f"{run_dir / 'checkpoints' / '8'} is unreadable, skipped" in reports[0]
    # A resume from the older checkpoint still finishes exactly as the run done in one go.
    resumed = run(load_resume_config(str(run_dir)), devices=jax.devices()[:4], resume=True)
    assert resumed.summary["params_digest"] == one_go.summary["params_digest"]
    assert [row["update"] for row in metric_rows(run_dir)] == list(range(1, 13))
    assert (run_dir / "checkpoints" / "8.unreadable").is_dir()


def test_no_usable_checkpoint_is_one_line_and_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    run(small_config(run_dir, train={"total_env_steps": 4 * 128}), devices=jax.devices()[:4])
    corrupt(run_dir / "checkpoints" / "4")
    result = subprocess.run([sys.executable, "-m", "jaxddppo.evaluate", str(run_dir)], env=subprocess_env(1),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (f"error: none of the 1 checkpoint(s) in {run_dir / 'checkpoints'} is intact "
                         "(each is unreadable or damaged)"), lines
    assert "is unreadable, skipped" in lines[0] and "Traceback" not in result.stderr


def test_a_resume_that_finds_no_usable_checkpoint_renames_none_of_them(tmp_path):
    """The checkpoints a resume cannot read stay where they are when none restores: the run
    stops, and a version of jaxddppo that reads them (the one that wrote them, say) finds them."""
    run_dir = tmp_path / "run"
    run(small_config(run_dir), devices=jax.devices()[:1], stop_after_updates=8)
    for step in ("4", "8"):
        corrupt(run_dir / "checkpoints" / step)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    result = subprocess.run([sys.executable, "-m", "jaxddppo.train", "--resume", str(run_dir)],
                            env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (f"error: none of the 2 checkpoint(s) in {run_dir / 'checkpoints'} is intact "
                         "(each is unreadable or damaged); all are left in place"), lines
    assert sum("is unreadable, skipped (" in line for line in lines) == 2 and "Traceback" not in result.stderr
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


@pytest.mark.parametrize("written_format", [pytest.param("absent", marks=pytest.mark.slow), 5])
def test_a_checkpoint_of_another_format_is_refused_in_one_line_and_kept(tmp_path, monkeypatch, written_format):
    """Checkpoints of jaxddppo before format 6 (format 5: kernels [in, out]; 4: a digest over the leaves in the
    order of the state's fields; none recorded: before format 2) are refused by --resume with one line and exit 2, and
    left as they were (not set aside as unreadable)."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        if written_format == "absent":
            patch.setattr(checkpoint, "_FORMAT_KEY", "not_the_format_key")
        else:
            patch.setattr(checkpoint, "CHECKPOINT_FORMAT", written_format)
        run(small_config(run_dir), devices=jax.devices()[:1], stop_after_updates=4)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    result = subprocess.run([sys.executable, "-m", "jaxddppo.train", "--resume", str(run_dir)],
                            env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {run_dir / 'checkpoints' / '4'} has format {1 if written_format == 'absent' else 5}, "
        "this jaxddppo reads format 6 only (the version that wrote it can still read it); start a new run")
    assert "Traceback" not in result.stderr
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_a_checkpoint_with_other_counters_is_refused_in_one_line(tmp_path, monkeypatch):
    """A checkpoint whose counters differ from this version's (a single run's
    final_episode_return, written for an hour before sweeps had checkpoints) is refused."""
    run_dir = tmp_path / "run"

    def single_return(counters):
        record = checkpoint.asdict(counters)
        record["final_episode_return"] = record.pop("final_episode_returns")[0]
        return {**record, "checkpoint_format": checkpoint.CHECKPOINT_FORMAT}

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "_counters_record", single_return)
        run(small_config(run_dir), devices=jax.devices()[:1], stop_after_updates=4)
    config = load_resume_config(str(run_dir))
    with pytest.raises(checkpoint.CheckpointFormatError,
                       match=r"records the counters env_steps, final_episode_return, train_seconds, update, "
                             r"this jaxddppo reads env_steps, final_episode_returns, train_seconds, update"):
        checkpoint.Checkpointer(str(run_dir)).restore(4, build(config, jax.devices()[:1]).abstract_state())


def test_non_finite_loss_stops_without_touching_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run(small_config(run_dir), devices=jax.devices()[:4], stop_after_updates=4)
    saved = sorted(os.listdir(run_dir / "checkpoints"))
    stored = run_dir / "config.yaml"  # a run whose learning rate makes its fifth update explode
    stored.write_text(stored.read_text().replace("learning_rate: 0.00025", "learning_rate: 1.0e+38"))
    with pytest.raises(NonFiniteError, match=r"^non-finite \w+ at update 5; stopped without saving it; "
                                             r"the newest checkpoint, .*/checkpoints/4, is intact$"):
        run(load_resume_config(str(run_dir)), devices=jax.devices()[:4], resume=True)
    assert sorted(os.listdir(run_dir / "checkpoints")) == saved
    policy = load_policy(str(run_dir))
    assert policy.counters.update == 4
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(policy.params))


def test_all_finite_finds_one_non_finite_element_in_any_leaf():
    """The leaves are tested laid end to end: every element of every leaf counts, whatever
    its shape or floating dtype."""
    leaves = [np.ones((3, 4), np.float32), np.zeros(4, np.float32), np.ones((), jnp.bfloat16),
              np.full((2, 1), 1e38, np.float32)]
    assert bool(jax.jit(all_finite)({"leaves": leaves}))
    for index, leaf in enumerate(leaves):
        for position in (0, leaf.size - 1):
            for bad in (np.nan, np.inf, -np.inf):
                poisoned = leaf.copy().reshape(-1)
                poisoned[position] = bad
                tree = {"leaves": [*leaves[:index], poisoned.reshape(leaf.shape), *leaves[index + 1:]]}
                assert not bool(jax.jit(all_finite)(tree)), (index, position, bad)


def test_chunk_reports_whether_its_parameters_are_finite():
    experiment = build(small_config(Path("unused")), devices=jax.devices()[:2])
    learn, inputs, one = experiment.learn_fn(), experiment.shard_inputs(), update_count(experiment.mesh, 1)
    _, _, finite = learn(experiment.init_state(), inputs, one)
    assert bool(finite)
    state = experiment.init_state()
    first_leaf = jax.tree.leaves(state.params)[0]
    poisoned = state.replace(params=jax.tree.map(
        lambda leaf: leaf.at[(0,) * leaf.ndim].set(np.inf) if leaf is first_leaf else leaf, state.params))
    _, _, finite = learn(poisoned, inputs, one)
    assert not bool(finite)


def test_non_finite_parameters_stop_the_run_naming_the_update(tmp_path, monkeypatch):
    """Parameters can turn non-finite while every guarded metric stays finite: the run
    then stops on the chunk's own finiteness flag (forced false here)."""
    learn_fn = Experiment.learn_fn

    def learn_fn_reporting_non_finite(self):
        learn = learn_fn(self)

        def learn_then_report_non_finite(state, inputs, num_updates):
            state, metrics, finite = learn(state, inputs, num_updates)
            return state, metrics, jnp.zeros_like(finite)

        return jax.jit(learn_then_report_non_finite)

    monkeypatch.setattr(Experiment, "learn_fn", learn_fn_reporting_non_finite)
    with pytest.raises(NonFiniteError, match=r"^non-finite parameters after update 4; stopped without saving "
                                             r"it; no checkpoint had been saved$"):
        run(small_config(tmp_path / "run"), devices=jax.devices()[:4])
    assert [row["update"] for row in metric_rows(tmp_path / "run")] == [1, 2, 3, 4]
    assert os.listdir(tmp_path / "run" / "checkpoints") == []


def test_truncate_metrics_drops_later_rows_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"update": u}) + "\n" for u in range(1, 6)) + '{"update": 6, "pol')
    assert truncate_metrics(str(path), 3) == 3
    assert [json.loads(line)["update"] for line in path.read_text().splitlines()] == [1, 2, 3]
    path.write_text(json.dumps({"update": 1}) + "\n" + '{"update": 2, "pol')
    assert truncate_metrics(str(path), 7) == 1


# --- the command line: signals and hard kills -------------------------------------------------------

# Endless unless stopped: 1e9 steps; progress lines every chunk (stderr is not a terminal).
LONG_RUN = ["--config", str(REPO_ROOT / "experiments" / "cartpole.yaml"), "env.num_envs=8", "ppo.num_steps=16",
            "ppo.anneal_lr=false", "train.total_env_steps=1000000000", "train.updates_per_chunk=2",
            "eval.num_episodes=4"]


def start_training(args: list[str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "jaxddppo.train", *args], env=subprocess_env(1),
                            stdout=handle, stderr=subprocess.STDOUT, text=True)


def wait_for_training(process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Until the first progress line (the first chunk is done)."""
    deadline = time.monotonic() + timeout
    while "env steps" not in log.read_text():
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "no progress line in time"
        time.sleep(0.1)


def finish(run_dir: Path, extra: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxddppo.train", "--resume", str(run_dir), *extra],
                          env=subprocess_env(1), capture_output=True, text=True, timeout=300)


def test_sigterm_saves_reports_and_resumes(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    process = start_training([*LONG_RUN, f"run.dir={run_dir}"], log)
    wait_for_training(process, log)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == PREEMPTED_EXIT_CODE, log.read_text()
    output = log.read_text()
    assert "Traceback" not in output
    stopped_at = int(output.split("stopped by SIGTERM after update ")[1].split()[0])
    assert str(stopped_at) in os.listdir(run_dir / "checkpoints")
    assert [row["update"] for row in metric_rows(run_dir)] == list(range(1, stopped_at + 1))
    total = (stopped_at + 2) * 128
    result = finish(run_dir, [f"train.total_env_steps={total}"])
    assert result.returncode == 0, result.stderr
    assert f"resumed from {run_dir / 'checkpoints'}/{stopped_at}" in result.stderr
    assert [row["update"] for row in metric_rows(run_dir)] == list(range(1, stopped_at + 3))
    assert json.loads((run_dir / "summary.json").read_text())["num_updates"] == stopped_at + 2


def complete_checkpoints(run_dir: Path) -> list[int]:
    directory = run_dir / "checkpoints"
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit()) if directory.is_dir() else []


@pytest.mark.slow
def test_sigkill_at_random_moments_never_breaks_resume(tmp_path):
    """Killed three times while saving every update, resumed each time, then finished.

    The first kill may come before any checkpoint is complete (the resume starts
    again from update 0); the later ones come once one is, amid saves in flight.
    """
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    rng = random.Random(0)
    args = [*LONG_RUN, f"run.dir={run_dir}", "checkpoint.every_updates=1", "checkpoint.keep=2"]
    for attempt in range(3):
        process = start_training(args, log)
        wait_for_training(process, log)
        deadline = time.monotonic() + 120
        while attempt > 0 and not complete_checkpoints(run_dir):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        process.kill()
        process.wait()
        args = ["--resume", str(run_dir)]
    done = max(complete_checkpoints(run_dir), default=0)
    result = finish(run_dir, [f"train.total_env_steps={(done + 2) * 128}"])
    assert result.returncode == 0, result.stderr
    assert [row["update"] for row in metric_rows(run_dir)] == list(range(1, done + 3))


def test_a_finished_run_compiles_its_final_evaluation_with_its_training_programs(one_go):
    assert isinstance(one_go.final_evaluate, CompilingProgram)
    assert isinstance(one_go.final_evaluate.future.result(), jax.stages.Compiled)
    experiment = build(small_config(one_go.run_dir), jax.devices()[:4])
    compiled_at_the_end = experiment.final_evaluations(one_go.state)[0]
    assert np.mean(np.asarray(compiled_at_the_end.returns, np.float64)) == one_go.summary["eval_return_mean"]


def test_the_final_evaluation_is_placed_on_the_callers_default_device(tmp_path):
    """The final evaluation is lowered in a background thread, under the calling thread's
    `jax.default_device`, which places it (a program of one device)."""
    experiment = build(small_config(tmp_path / "run"), jax.devices()[:1])
    with jax.default_device(jax.devices()[1]):
        programs = compile_programs(experiment, final_evaluation=True)
    shardings = jax.tree.leaves(programs.final_evaluate.future.result().input_shardings)
    assert shardings and all(placed.device_set == {jax.devices()[1]} for placed in shardings)
    assert all(placed.device_set == {jax.devices()[0]} for placed in jax.tree.leaves(programs.learn.input_shardings))


def test_training_starts_while_the_final_evaluation_compiles(tmp_path, monkeypatch):
    """`compile_programs` returns with the training's programs; the final evaluation, lowered
    in the background, is waited for by its call, which raises what its lowering raised."""
    experiment = build(small_config(tmp_path / "run"), jax.devices()[:1])
    training_ran = threading.Event()

    def lower_after_training(self, state):
        if not training_ran.wait(timeout=60):
            raise AssertionError("compile_programs waited for the final evaluation")
        raise RuntimeError("the final evaluation cannot be lowered")

    monkeypatch.setattr(Experiment, "lower_final_evaluation", lower_after_training)
    programs = compile_programs(experiment, final_evaluation=True)
    state = programs.init(programs.inputs)
    state, _, finite = programs.learn(state, programs.inputs, update_count(experiment.mesh, 1))
    assert bool(np.all(finite))
    training_ran.set()
    with pytest.raises(RuntimeError, match="cannot be lowered"):
        experiment.final_evaluations(state, programs.final_evaluate)


def test_training_starts_while_the_periodic_evaluation_compiles(tmp_path, monkeypatch):
    """The periodic evaluation compiles in the background too: the first update runs before
    it is lowered, and the evaluation after that update waits for its program."""
    config = with_overrides(small_config(tmp_path / "run"), {"eval.every_updates": 1, "train.updates_per_chunk": 1})
    experiment = build(config, jax.devices()[:1])
    training_ran = threading.Event()
    real_eval_fn = Experiment.eval_fn

    def eval_fn_after_training(self):
        if not training_ran.wait(timeout=60):
            raise AssertionError("compile_programs waited for the periodic evaluation")
        return real_eval_fn(self)

    monkeypatch.setattr(Experiment, "eval_fn", eval_fn_after_training)
    programs = compile_programs(experiment)
    assert isinstance(programs.evaluate, CompilingProgram)
    state = programs.init(programs.inputs)
    state, _, _ = programs.learn(state, programs.inputs, update_count(experiment.mesh, 1))
    training_ran.set()
    stats = programs.evaluate_after(state, 1, 1, experiment.mesh)
    assert stats.return_mean.shape == (1,) and np.all(stats.length_mean >= 1)


def test_evaluate_reproduces_the_runs_final_evaluation(one_go):
    result = subprocess.run([sys.executable, "-m", "jaxddppo.evaluate", one_go.run_dir, "--json"],
                            env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["update"] == 12 and printed["episodes"] == 4
    assert printed["return_mean"] == one_go.summary["eval_return_mean"]
    assert printed["return_std"] == pytest.approx(one_go.summary["eval_return_std"], abs=0)
    assert printed["length_mean"] == one_go.summary["eval_length_mean"]


def test_load_policy_acts_like_the_trained_params(one_go):
    policy = load_policy(one_go.run_dir)
    for got, want in zip(jax.tree.leaves(policy.params), jax.tree.leaves(global_arrays.local_copy(one_go.state.params)),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    assert policy.obs_moments is not None and float(policy.obs_moments.count) > 0
    obs = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    dist, _ = policy.network.apply(policy.params, normalize(policy.obs_moments, obs))
    np.testing.assert_array_equal(np.asarray(policy(obs)), np.asarray(dist.mode()))
    act = jax.jit(jax.vmap(functools.partial(policy.act, deterministic=False), in_axes=(None, 0, 0)))
    sampled = act(policy.params, obs[:, None], jax.random.split(jax.random.key(0), 16))
    assert sampled.shape == (16, 1) and set(np.unique(sampled)) <= {0, 1}
    stats = statistics(evaluate(policy))
    assert stats["return_mean"] == one_go.summary["eval_return_mean"]


def test_load_policy_builds_no_environment(one_go, monkeypatch):
    """The network comes from config.yaml and env_spec.json; the checkpoint is restored as
    saved and checked against its digest; evaluating episodes builds the environment."""
    recorded = json.loads((Path(one_go.run_dir) / "env_spec.json").read_text())
    assert recorded == {"env_id": "CartPole-v1", "observation": "float32[4]", "discrete": True, "num_actions": 2,
                        "action_low": [], "action_high": [], "max_episode_steps": 500, "action_mask_key": None}
    built = []
    monkeypatch.setattr(BatchedEnv, "__init__", lambda self, *args: built.append(args) or None)
    policy = load_policy(one_go.run_dir)
    assert not built and policy.counters.update == 12
    trained = global_arrays.local_copy((one_go.state.params, one_go.state.obs_moments))
    assert jax.tree.structure((policy.params, policy.obs_moments)) == jax.tree.structure(trained)
    for got, want in zip(jax.tree.leaves((policy.params, policy.obs_moments)), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(AttributeError):
        evaluate(policy)  # evaluating episodes builds the environment (here one left uninitialised)
    assert built


def test_load_policy_without_env_spec_json_builds_the_environment(one_go, tmp_path, monkeypatch):
    """A run whose observation env_spec.json cannot hold (a user's dataclass) writes none."""
    run_dir = tmp_path / "run"
    shutil.copytree(one_go.run_dir, run_dir)
    (run_dir / "env_spec.json").unlink()
    recorded, built = load_policy(one_go.run_dir), []

    def counted_make_env(*args, **kwargs):
        built.append(make_env(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(policy_module, "make_env", counted_make_env)
    policy = load_policy(str(run_dir))
    assert len(built) == 1 and policy.spec == recorded.spec
    for got, want in zip(jax.tree.leaves(policy.params), jax.tree.leaves(recorded.params), strict=True):
        np.testing.assert_array_equal(got, want)


def test_load_policy_refuses_a_checkpoint_that_does_not_fit_the_network(one_go, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(one_go.run_dir, run_dir)
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace(
        "hidden_sizes:\n  - 64\n  - 64", "hidden_sizes:\n  - 64\n  - 32"))
    with pytest.raises(ConfigError, match=(
            rf"^checkpoint {run_dir / 'checkpoints' / '12'} does not fit the network that config.yaml and "
            r"env_spec.json describe: params/params/Dense_0/kernel is float32\[1, 64\] there, float32\[1, 32\] in the "
            r"network$")):
        load_policy(str(run_dir))


@pytest.mark.parametrize("args,message", [
    (["{run}", "--checkpoint", "7"], "error: no checkpoint 7 in {run}/checkpoints (there are: [4, 8, 12])"),
    (["{run}/missing"], "error: run directory {run}/missing does not exist"),
    (["{run}", "--episodes", "0"], "error: --episodes=0 must be at least 1 (see --help)"),
])
def test_evaluate_bad_input_is_one_line_and_exit_2(one_go, args, message):
    result = subprocess.run([sys.executable, "-m", "jaxddppo.evaluate", *(a.format(run=one_go.run_dir) for a in args)],
                            env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip() == message.format(run=one_go.run_dir), result.stderr


@pytest.mark.slow  # about 50 s; test_learning.py loads a feed-forward policy in CI
def test_recurrent_policy_loads_and_reproduces_its_evaluation(tmp_path):
    run_dir = tmp_path / "run"
    config = small_config(run_dir, network={"recurrent": "gru", "recurrent_size": 16},
                          ppo={"num_minibatches": 2}, train={"total_env_steps": 4 * 128})
    result = run(config, devices=jax.devices()[:4])
    policy = load_policy(str(run_dir))
    assert policy.recurrent
    with pytest.raises(ValueError, match="use policy.step with a carry"):
        policy(np.zeros((2, 4), np.float32))
    carry = policy.initial_carry(2)
    carry, action = policy.step(policy.params, carry, np.zeros((2, 4), np.float32), np.ones(2, bool))
    assert action.shape == (2,)
    assert statistics(evaluate(policy))["return_mean"] == result.summary["eval_return_mean"]


def test_zero_size_arrays_in_the_state_survive_a_checkpoint(tmp_path):
    """orbax refuses to save zero-size arrays; an environment state may hold some (navix's cache)."""
    mesh_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = {"patches": jnp.zeros((3, 0, 2), jnp.float32), "position": jnp.arange(4),
             "moments": None, "mask": jnp.zeros((0,), bool)}
    checkpointer = Checkpointer(str(tmp_path), asynchronous=False)
    checkpointer.save(state, checkpoint.RunCounters(update=1, env_steps=8, train_seconds=0.5,
                                                    final_episode_returns=(None,)))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=mesh_sharding), state)
    restored, counters = checkpointer.restore(1, abstract)
    checkpointer.close()
    assert counters.env_steps == 8
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
