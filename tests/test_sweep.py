"""Sweeps: a population of grid points x seeds in one program, spread over devices.

- A member trains as the single run of its config: batched, to a tolerance; in turn
  (train.batch_members=false), bit for bit.
- sweep.csv, metrics.jsonl and curves.png hold what the docs say.
- Structural keys are refused with one line; placement is derived and validated.
- `jaxddppo.run` / `jaxddppo.run_sweep` are the modules' functions, and `python -m` works without warnings.
- run.cpu_devices splits the CPU into devices for a sweep started from the command line, and
  the command takes one device per core when nothing else decides the device count.
- A sweep stopped and resumed ends bit for bit as the sweep done in one go; SIGTERM stops the
  command with a checkpoint and exit 75; a non-finite member is named; every member logs its
  own periodic evaluation (its single run's) and TensorBoard events.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import jax
import numpy as np
import pytest
from conftest import host_leaves, subprocess_env
from matplotlib import image

import jaxddppo
from jaxddppo.config.files import from_dict, with_overrides
from jaxddppo.config.options import ConfigError
from jaxddppo.cpu import tuning as cpu_tuning
from jaxddppo.distributed import global_arrays, topology
from jaxddppo.sweep import SWEEP_CSV_FIELDS, parse_args, resume_sweep
from jaxddppo.train import run
from jaxddppo.training.checkpoint import PREEMPTED_EXIT_CODE
from jaxddppo.training.chunk_metrics import NonFiniteError
from jaxddppo.training.experiment import Experiment
from jaxddppo.training.population import expand_members, split_overrides

REPO_ROOT = Path(__file__).resolve().parents[1]
# Same maths, but XLA compiles a batch of members otherwise in the last bits (docs/sweeps.md).
INVARIANCE_RTOL = 1e-5

# 4 envs x 16 steps = 64 env steps per update, 32 updates.
SMALL = {
    "env": {"id": "CartPole-v1", "num_envs": 4},
    "ppo": {"num_steps": 16},
    "train": {"total_env_steps": 2048, "updates_per_chunk": 8},
    "eval": {"num_episodes": 4},
    "run": {"progress": False},
}
LEARNING_RATES = [3e-4, 1e-3]
NUM_SEEDS = 2


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_wall_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_seconds"} for row in rows]


@pytest.fixture(scope="module")
def sweep_result(tmp_path_factory):
    """2 learning rates x 2 seeds on 2 simulated devices, through the Python API."""
    config = with_overrides(from_dict(SMALL), {"run.dir": str(tmp_path_factory.mktemp("sweep") / "run")})
    return jaxddppo.run_sweep(config, {"ppo.learning_rate": LEARNING_RATES}, seeds=NUM_SEEDS, devices=jax.devices()[:2])


@pytest.fixture(scope="module")
def member_1_single_run(sweep_result, tmp_path_factory):
    """The single run of member 1's config (its learning rate, its seed) on one device."""
    row = sweep_result.members[1]
    single_config = with_overrides(from_dict(SMALL), {
        "ppo.learning_rate": row["ppo.learning_rate"],
        "train.seed": row["seed"],
        "train.num_shards": sweep_result.summary["num_shards"],
        "run.dir": str(tmp_path_factory.mktemp("single") / "run"),
    })
    return run(single_config, devices=jax.devices()[:1])


def test_batched_member_trains_as_its_single_run(sweep_result, member_1_single_run):
    row = sweep_result.members[1]
    assert row["params_digest"] == pytest.approx(member_1_single_run.summary["params_digest"], rel=INVARIANCE_RTOL)
    # A different member differs by far more than the tolerance.
    other = sweep_result.members[2]
    assert abs(other["params_digest"] - row["params_digest"]) > 1e-3 * row["params_digest"]


def test_member_in_turn_trains_bit_for_bit_as_its_single_run(member_1_single_run, tmp_path):
    """With train.batch_members=false the 4 members run two after another on each of 2
    devices, and member 1 ends with its single run's parameters (on 1 device), bit for bit:
    so a sweep run in turn learns the same bits on any device count."""
    config = with_overrides(from_dict(SMALL), {"train.batch_members": False, "run.dir": str(tmp_path / "run")})
    in_turn = jaxddppo.run_sweep(config, {"ppo.learning_rate": LEARNING_RATES}, seeds=NUM_SEEDS,
                                 devices=jax.devices()[:2])
    assert in_turn.summary["member_devices"] == 2 and in_turn.summary["num_members"] == 4
    member_params = jax.tree.map(lambda leaf: leaf[1], global_arrays.all_shards(in_turn.state.params))
    single_params = global_arrays.local_copy(member_1_single_run.state.params)
    for member_leaf, single_leaf in zip(jax.tree.leaves(member_params), jax.tree.leaves(single_params)):
        np.testing.assert_array_equal(member_leaf, single_leaf)
    assert in_turn.members[1]["params_digest"] == member_1_single_run.summary["params_digest"]
    assert in_turn.members[1]["eval_return_mean"] == member_1_single_run.summary["eval_return_mean"]


def test_sweep_csv_rows_and_columns(sweep_result):
    with open(os.path.join(sweep_result.run_dir, "sweep.csv"), newline="") as handle:
        rows = list(csv.DictReader(handle))
    fields = list(SWEEP_CSV_FIELDS)
    assert list(rows[0]) == fields[:3] + ["ppo.learning_rate"] + fields[3:]
    assert [int(r["member"]) for r in rows] == [0, 1, 2, 3]
    assert [int(r["setting"]) for r in rows] == [0, 0, 1, 1]
    assert [int(r["seed"]) for r in rows] == [0, 1, 0, 1]
    assert [float(r["ppo.learning_rate"]) for r in rows] == [3e-4, 3e-4, 1e-3, 1e-3]
    for row in rows:
        assert np.isfinite(float(row["eval_return_mean"])) and float(row["eval_return_mean"]) >= 1
        assert float(row["eval_return_std"]) >= 0
        assert float(row["final_episode_return"]) >= 1
    assert [float(r["params_digest"]) for r in rows] == [m["params_digest"] for m in sweep_result.members]


def test_sweep_plot_is_a_png(sweep_result):
    path = Path(sweep_result.plot_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0.01  # not a blank canvas


def test_sweep_metrics_and_summary(sweep_result):
    rows = [json.loads(line) for line in Path(sweep_result.metrics_path).read_text().splitlines()]
    num_updates = 2048 // 64
    assert len(rows) == 4 * num_updates
    for member in range(4):
        mine = [r for r in rows if r["member"] == member]
        assert [r["update"] for r in mine] == list(range(1, num_updates + 1))
    first_lr = {r["member"]: r["learning_rate"] for r in rows if r["update"] == 1}
    assert first_lr[0] == pytest.approx(3e-4) and first_lr[3] == pytest.approx(1e-3)
    summary = json.loads(Path(sweep_result.run_dir, "summary.json").read_text())
    assert summary["num_members"] == 4 and summary["num_settings"] == 2 and summary["num_seeds"] == 2
    assert summary["member_devices"] * summary["shard_devices"] == 2
    assert summary["total_env_steps"] == 4 * 2048
    best = max(sweep_result.settings, key=lambda s: s["eval_return_mean"])
    assert summary["best_setting"] == {"ppo.learning_rate": best["ppo.learning_rate"]}
    seeds_of_best = [m["eval_return_mean"] for m in sweep_result.members if m["setting"] == best["setting"]]
    assert summary["best_eval_return_mean"] == pytest.approx(np.mean(seeds_of_best))


# --- the grid and the placement (no training) ------------------------------------------------------


def test_grid_expands_to_points_times_seeds():
    config = from_dict(SMALL)
    members = expand_members(config, {"ppo.learning_rate": ["3e-4", "1e-3"], "ppo.ent_coef": [0.0, 0.01]}, 3)
    assert len(members) == 12
    assert [m.seed for m in members[:3]] == [0, 1, 2]
    assert members[3].values == {"ppo.learning_rate": 3e-4, "ppo.ent_coef": 0.01}
    assert members[11].config.ppo.learning_rate == 1e-3 and members[11].config.train.seed == 2
    explicit = expand_members(config, {"train.seed": [5, 9]})
    assert [m.seed for m in explicit] == [5, 9] and explicit[0].values == {}
    assert [m.config for m in members[9:]] == [with_overrides(config, {"ppo.learning_rate": 1e-3, "ppo.ent_coef": 0.01,
                                                                      "train.seed": seed}) for seed in range(3)]


@pytest.mark.parametrize("grid, seeds, expected", [
    ({"env.num_envs": [4, 8]}, None, ["env.num_envs", "structural", "ppo.learning_rate"]),
    ({"network.hidden_sizes": [[32], [64]]}, None, ["network.hidden_sizes", "structural"]),
    ({"ppo.lerning_rate": [1e-3]}, None, ["ppo.lerning_rate", "ppo.learning_rate"]),
    ({"ppo.gamma": [0.9, 1.5]}, None, ["ppo.gamma", "1.5"]),
    ({"ppo.gamma": []}, None, ["ppo.gamma"]),
    ({"train.seed": [1, 2]}, 3, ["--seeds", "train.seed"]),
    ({"train.seed": [1, "two"]}, None, ["train.seed", "two"]),
    ({}, 0, ["--seeds"]),
])
def test_bad_grid_is_one_clear_error(grid, seeds, expected):
    with pytest.raises(ConfigError) as error:
        expand_members(from_dict(SMALL), grid, seeds)
    message = str(error.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message


def test_command_line_lists_become_grid_axes():
    plain, grid = split_overrides([
        "ppo.learning_rate=[3e-4, 1e-3]", "network.hidden_sizes=[32,32]", "env.num_envs=8",
        "network.cnn_channels=[[8],[16]]",
    ])
    assert plain == ["network.hidden_sizes=[32,32]", "env.num_envs=8"]
    assert grid == {"ppo.learning_rate": ["3e-4", "1e-3"], "network.cnn_channels": ["[8]", "[16]"]}


def test_command_line_options_may_come_between_overrides():
    args = parse_args(["--config", "x.yaml", "ppo.gamma=0.9", "--seeds", "2", "ppo.learning_rate=[1e-3,3e-4]",
                       "--member-devices", "1"])
    assert (args.config, args.seeds, args.member_devices) == ("x.yaml", 2, 1)
    assert args.overrides == ["ppo.gamma=0.9", "ppo.learning_rate=[1e-3,3e-4]"]


@pytest.mark.parametrize("members, shards, devices, member_devices, expected", [
    (4, None, 2, None, (2, 1, 1)),  # members take every device, one shard each
    (8, None, 4, None, (4, 1, 1)),
    (3, None, 4, None, (1, 4, 4)),  # 3 members do not split over 4 devices: shards do
    (6, None, 4, None, (2, 2, 2)),
    (4, 4, 2, None, (2, 1, 4)),
    (4, 2, 4, 2, (2, 2, 2)),
    (1, 8, 8, None, (1, 8, 8)),
])
def test_placement_is_derived(members, shards, devices, member_devices, expected):
    placement = topology.place_population(members, shards, devices, member_devices)
    assert (placement.member_devices, placement.shard_devices, placement.num_shards) == expected
    assert placement.members_per_device * placement.member_devices == members
    assert placement.shards_per_device * placement.shard_devices == placement.num_shards


@pytest.mark.parametrize("members, shards, devices, member_devices, expected", [
    (3, 2, 4, None, ["3 member", "train.num_shards=2", "4 devices"]),
    (4, None, 4, 3, ["--member-devices=3", "4"]),
    (3, None, 4, 2, ["3", "--member-devices", "2"]),
    (4, 1, 4, 2, ["train.num_shards=1", "2"]),
])
def test_impossible_placement_is_one_clear_error(members, shards, devices, member_devices, expected):
    with pytest.raises(ConfigError) as error:
        topology.place_population(members, shards, devices, member_devices)
    message = str(error.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message


# --- the command line and the Python API ------------------------------------------------------------


def run_module(module: str, args: list[str], cwd: Path, xla_flags: str = "--xla_force_host_platform_device_count=1",
               cores: Optional[set[int]] = None) -> subprocess.CompletedProcess:
    """`python -m module args` with `xla_flags` as XLA_FLAGS, pinned to `cores` if given."""
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    if cores is None:
        command = ["-m", module]
    else:
        command = ["-c", f"import os, runpy; os.sched_setaffinity(0, {sorted(cores)}); "
                         f"runpy.run_module('{module}', run_name='__main__', alter_sys=True)"]
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", *command, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, expected", [
    (["env.num_envs=[4,8]"], ["env.num_envs", "structural"]),
    (["ppo.learning_rate=[1e-3,abc]"], ["ppo.learning_rate", "abc"]),
    (["--seeds", "2", "--member-devices", "2"], ["--member-devices=2", "1"]),
    (["--stop-after-updates", "0"], ["--stop-after-updates=0", "at least 1"]),
    (["--member-devices", "0"], ["--member-devices=0", "at least 1"]),
    (["--resume", "{tmp}", "--seeds", "2"], ["--seeds", "--resume"]),
])
def test_sweep_command_refuses_bad_input_in_one_line(tmp_path, args, expected):
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    result = run_module("jaxddppo.sweep", [*args, f"run.dir={tmp_path / 'r'}"], tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_cpu_devices_splits_the_cpu_for_the_command_line_sweep(sweep_result, tmp_path):
    """`python -m jaxddppo.sweep ... run.cpu_devices=2` in a process where JAX would see
    one CPU device places the members on two, and learns bit for bit what the same sweep
    learns on two devices through the Python API."""
    result = run_module("jaxddppo.sweep", [*sweep_command_args(tmp_path), "run.cpu_devices=2"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["member_devices"] * summary["shard_devices"] == 2
    with open(tmp_path / "r" / "sweep.csv") as handle:
        digests = [float(row["params_digest"]) for row in csv.DictReader(handle)]
    assert digests == [row["params_digest"] for row in sweep_result.members]


def sweep_command_args(tmp_path: Path) -> list[str]:
    """The command line of `sweep_result`'s sweep (2 learning rates x 2 seeds)."""
    small = [f"{section}.{key}={value}" for section, values in SMALL.items() for key, value in values.items()]
    return [*small, "--seeds", str(NUM_SEEDS), f"ppo.learning_rate=[{','.join(map(str, LEARNING_RATES))}]",
            f"run.dir={tmp_path / 'r'}"]


@pytest.mark.slow  # about 60 s; test_sweep_command_splits_the_cpu_only_where_nothing_else_decides runs in CI
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to pin the sweep to")
def test_command_line_sweep_takes_one_cpu_device_per_core(sweep_result, tmp_path):
    """With nothing deciding the device count, `python -m jaxddppo.sweep` on two cores
    splits the CPU into two devices for its 4 members, says so, records it in config.yaml,
    and learns bit for bit what the same sweep learns on two devices through the Python API."""
    two_cores = set(sorted(os.sched_getaffinity(0))[:2])
    result = run_module("jaxddppo.sweep", [*sweep_command_args(tmp_path), "run.progress=true"], tmp_path,
                        xla_flags="", cores=two_cores)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "run.cpu_devices=2, one CPU device per core for 4 members" in result.stdout + result.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert (summary["num_devices"], summary["member_devices"]) == (2, 2)
    assert "cpu_devices: 2" in (tmp_path / "r" / "config.yaml").read_text()
    with open(tmp_path / "r" / "sweep.csv") as handle:
        digests = [float(row["params_digest"]) for row in csv.DictReader(handle)]
    assert digests == [row["params_digest"] for row in sweep_result.members]


@pytest.mark.parametrize("members, cores, expected", [
    (32, 2, 2), (4, 2, 2), (3, 2, 1), (1, 8, 1), (12, 8, 6), (7, 4, 1), (8, 8, 8), (2, 64, 2), (5, 1, 1),
])
def test_cpu_devices_per_core_divide_the_members(members, cores, expected):
    assert cpu_tuning.cpu_devices_per_core(members, cores) == expected


@pytest.mark.parametrize("overrides, environ, expected", [
    ({}, {}, 2),
    ({"run.cpu_devices": 1}, {}, 1),  # the config decides
    ({"run.cpu_devices": 4}, {}, 4),
    ({}, {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=1"}, 0),
    ({}, {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}, 2),
    ({"distributed.coordinator": "localhost:1234", "distributed.num_processes": 2, "distributed.process_id": 0},
     {}, 0),
    ({"distributed.auto": True}, {}, 0),
    ({}, {"JAX_PLATFORMS": "cpu"}, 2),
    ({}, {"JAX_PLATFORMS": "cuda,cpu"}, 0),  # JAX would run on the GPU
    ({}, {"JAX_PLATFORMS": "tpu"}, 0),
])
def test_sweep_command_splits_the_cpu_only_where_nothing_else_decides(monkeypatch, overrides, environ, expected):
    """As on a machine with no GPU or TPU plugin for JAX installed, where an unset JAX_PLATFORMS
    means the CPU (with one installed: test_cpu_tuning.py)."""
    monkeypatch.setattr(cpu_tuning, "backend_started", lambda: False)
    monkeypatch.setattr(cpu_tuning, "accelerator_plugin_installed", lambda: False)
    config = with_overrides(from_dict(SMALL), overrides)
    chosen = cpu_tuning.with_cpu_devices(config, 2, environ)
    assert chosen.run.cpu_devices == expected
    assert (chosen is config) == (expected == config.run.cpu_devices)


def test_sweep_command_leaves_a_started_backend_alone(monkeypatch):
    monkeypatch.setattr(cpu_tuning, "accelerator_plugin_installed", lambda: False)  # the backend alone decides
    config = from_dict(SMALL)
    jax.devices()  # this process's backend has started
    assert cpu_tuning.with_cpu_devices(config, 2, {}) is config


def test_sweep_command_keeps_one_device_with_the_cpu_switch_off(monkeypatch):
    monkeypatch.setattr(cpu_tuning, "backend_started", lambda: False)
    monkeypatch.setattr(cpu_tuning, "accelerator_plugin_installed", lambda: False)  # the switch alone decides
    config = with_overrides(from_dict(SMALL), {"run.cpu_tuning": "off"})
    assert cpu_tuning.with_cpu_devices(config, 2, {}) is config


@pytest.mark.oldest
@pytest.mark.parametrize("module", ["jaxddppo.train", "jaxddppo.sweep"])
def test_modules_run_with_python_m_without_warnings(tmp_path, module):
    result = run_module(module, ["--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    assert f"python -m {module}" in result.stdout


def test_python_api_functions_are_the_modules_functions():
    import jaxddppo.sweep as sweep_module
    import jaxddppo.train as train_module

    assert jaxddppo.run is train_module.run and jaxddppo.run_sweep is sweep_module.run_sweep
    assert not callable(train_module) and not callable(sweep_module)  # plain modules
    with pytest.raises(ConfigError, match="env.num_envs"):
        jaxddppo.run({"env": {"num_envs": 0}})


# --- checkpoints, resume, preemption, evaluation, TensorBoard ---------------------------------------


def test_sweep_stop_and_resume_is_bit_identical_to_one_go(sweep_result, tmp_path):
    run_dir = tmp_path / "run"
    config = with_overrides(from_dict(SMALL), {"run.dir": str(run_dir)})
    first = jaxddppo.run_sweep(config, {"ppo.learning_rate": LEARNING_RATES}, seeds=NUM_SEEDS,
                               devices=jax.devices()[:2], stop_after_updates=16)
    assert first.summary is None and first.stopped_by == "stop_after_updates" and first.counters.update == 16
    assert "16" in os.listdir(run_dir / "checkpoints")
    resumed = resume_sweep(str(run_dir), devices=jax.devices()[:2])
    assert resumed.counters.update == 32
    for got, want in zip(host_leaves(resumed.state), host_leaves(sweep_result.state), strict=True):
        np.testing.assert_array_equal(got, want)
    assert resumed.members == sweep_result.members
    assert without_wall_time(metric_rows(run_dir)) == without_wall_time(metric_rows(Path(sweep_result.run_dir)))


@pytest.mark.slow  # about 55 s; a run's non-finite stop is tested in CI (test_checkpoint.py)
def test_non_finite_member_stops_the_sweep_naming_it(tmp_path, monkeypatch):
    learn_fn = Experiment.learn_fn

    def learn_fn_flagging_member_one(self):
        learn = learn_fn(self)

        def learn_then_flag_member_one(state, inputs, num_updates):
            state, metrics, finite = learn(state, inputs, num_updates)
            return state, metrics, finite.at[1].set(False)

        return jax.jit(learn_then_flag_member_one)

    monkeypatch.setattr(Experiment, "learn_fn", learn_fn_flagging_member_one)
    config = with_overrides(from_dict(SMALL), {"run.dir": str(tmp_path / "run")})
    with pytest.raises(NonFiniteError, match=r"^non-finite parameters of member 1 after update 8; stopped without "
                                             r"saving it; no checkpoint had been saved$"):
        jaxddppo.run_sweep(config, seeds=2, devices=jax.devices()[:2])
    rows = metric_rows(tmp_path / "run")
    assert [(row["member"], row["update"]) for row in rows] == [(m, u) for m in (0, 1) for u in range(1, 9)]


@pytest.mark.slow  # about 55 s; a run's periodic evaluation and TensorBoard are tested in CI (test_outputs.py)
def test_periodic_evaluation_and_tensorboard_per_member(tmp_path):
    """Every member's rows carry its own periodic evaluation, the one its single run logs;
    TensorBoard events go to one directory per member."""
    values = {"eval.every_updates": 8, "train.total_env_steps": 1024}
    config = with_overrides(from_dict(SMALL), {**values, "run.dir": str(tmp_path / "sweep"), "run.tensorboard": True})
    result = jaxddppo.run_sweep(config, seeds=2, devices=jax.devices()[:2])
    rows = metric_rows(tmp_path / "sweep")
    for member in (0, 1):
        assert [row["update"] for row in rows if row["member"] == member and row["eval_return_mean"] is not None] \
            == [8, 16]
    single = run(with_overrides(from_dict(SMALL), {**values, "train.seed": 1, "run.dir": str(tmp_path / "single"),
                                                   "train.num_shards": result.summary["num_shards"]}),
                 devices=jax.devices()[:1])
    single_evals = [row["eval_return_mean"] for row in metric_rows(Path(single.run_dir))
                    if row["eval_return_mean"] is not None]
    assert [row["eval_return_mean"] for row in rows if row["member"] == 1 and row["eval_return_mean"] is not None] \
        == single_evals
    for member in ("member-0", "member-1"):
        events = os.listdir(tmp_path / "sweep" / "tensorboard" / member)
        assert any(name.startswith("events.out.tfevents") for name in events)


@pytest.mark.slow
def test_sweep_command_sigterm_saves_and_resumes(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "sweep.log"
    args = ["--config", str(REPO_ROOT / "experiments" / "cartpole.yaml"), "--seeds", "2", "env.num_envs=8",
            "ppo.num_steps=16", "ppo.anneal_lr=false", "train.total_env_steps=1000000000",
            "train.updates_per_chunk=2", "eval.num_episodes=4", f"run.dir={run_dir}"]
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "jaxddppo.sweep", *args], env=subprocess_env(1),
                                   stdout=handle, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while "env steps" not in log.read_text():
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "no progress line in time"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == PREEMPTED_EXIT_CODE, log.read_text()
    output = log.read_text()
    assert "Traceback" not in output and f"python -m jaxddppo.sweep --resume {run_dir}" in output
    stopped_at = int(output.split("stopped by SIGTERM after update ")[1].split()[0])
    assert str(stopped_at) in os.listdir(run_dir / "checkpoints")
    result = subprocess.run([sys.executable, "-m", "jaxddppo.sweep", "--resume", str(run_dir),
                             f"train.total_env_steps={(stopped_at + 2) * 128}"],
                            env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {run_dir / 'checkpoints'}/{stopped_at}" in result.stderr
    rows = metric_rows(run_dir)
    for member in (0, 1):
        assert [row["update"] for row in rows if row["member"] == member] == list(range(1, stopped_at + 3))
    with open(run_dir / "sweep.csv", newline="") as handle:
        assert [int(row["member"]) for row in csv.DictReader(handle)] == [0, 1]


def test_resume_of_a_single_run_directory_is_one_clear_error(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_text("env:\n  num_envs: 4\n")
    result = run_module("jaxddppo.sweep", ["--resume", str(tmp_path / "r")], tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "sweep.json" in result.stderr and "python -m jaxddppo.train --resume" in result.stderr
