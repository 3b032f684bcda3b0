"""The command line, run as a user runs it: `python -m jaxddppo.train --config FILE [key=value ...]`.

Every case runs on the CPU backend in its own working directory, with exactly one
device but where the command splits the CPU by default. Bad input must fail fast
(before anything compiles) with one line on stderr and exit code 2: the cases run
one after another in one fresh interpreter, through `jaxddppo.train.main` (what
`python -m jaxddppo.train` calls), and one of them also as its own process. The two
real training runs are started in the background when the module's first test
starts, so they compile while the quick failure cases run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

import pytest
from conftest import subprocess_env

from jaxddppo.config.files import load_config
from jaxddppo.config.reference import options
from jaxddppo.outputs.writers import METRIC_FIELDS, SUMMARY_FIELDS

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICK_TIMEOUT_S = 120  # a hang guard only; the failure cases take a few seconds
RUN_TIMEOUT_S = 600

# The main run: CartPole-v1, 4 envs x 16 steps = 64 env steps per update, 2048 // 64 updates.
MAIN_YAML = """\
env:
  id: CartPole-v1
  num_envs: 4
ppo:
  num_steps: 16
train:
  total_env_steps: 2048
  updates_per_chunk: 8
eval:
  num_episodes: 4
"""
MAIN_NUM_UPDATES = 2048 // (4 * 16)
# The second run: no run.dir (so the default one), and the file's num_envs overridden to 8.
DEFAULT_DIR_OVERRIDES = ["env.num_envs=8", "train.total_env_steps=1024"]
DEFAULT_DIR_NUM_UPDATES = 1024 // (8 * 16)


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxddppo.train", *args]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def describe(self) -> str:
        return (f"exit {self.returncode} after {self.seconds:.1f} s\n--- stdout:\n{self.stdout}"
                f"\n--- stderr:\n{self.stderr}")


def run_cli(args: list[str], cwd: Path, timeout: float = QUICK_TIMEOUT_S) -> Result:
    start = time.perf_counter()
    completed = subprocess.run(
        cli_command(*args), cwd=cwd, env=subprocess_env(1), capture_output=True, text=True, timeout=timeout,
    )
    return Result(completed.returncode, completed.stdout, completed.stderr, time.perf_counter() - start)


class BackgroundRun:
    """A CLI run in the background, its output in files (no pipe to fill up)."""

    def __init__(self, args: list[str], cwd: Path, name: str):
        self.cwd = cwd
        self._stdout = cwd / f"{name}.stdout"
        self._stderr = cwd / f"{name}.stderr"
        self._start = time.perf_counter()
        self._result: Optional[Result] = None
        with open(self._stdout, "w") as out, open(self._stderr, "w") as err:
            self._process = subprocess.Popen(cli_command(*args), cwd=cwd, env=subprocess_env(1), stdout=out, stderr=err)

    def result(self) -> Result:
        if self._result is None:
            try:
                returncode = self._process.wait(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.stop()
                pytest.fail(f"the run in {self.cwd} took over {RUN_TIMEOUT_S} s")
            self._result = Result(returncode, self._stdout.read_text(), self._stderr.read_text(),
                                  time.perf_counter() - self._start)
        return self._result

    def succeeded(self) -> Result:
        result = self.result()
        assert result.returncode == 0, result.describe()
        assert "Traceback" not in result.stdout + result.stderr, result.describe()
        return result

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


@dataclass
class RealRuns:
    main: BackgroundRun
    main_yaml: Path
    main_dir: Path
    default_dir: BackgroundRun
    default_dir_cwd: Path


@pytest.fixture(scope="module", autouse=True)
def real_runs(tmp_path_factory: pytest.TempPathFactory):
    """Start both real runs as soon as the module's first test starts; stop them at its end."""
    main_cwd = tmp_path_factory.mktemp("main_run")
    main_yaml = main_cwd / "cartpole.yaml"
    main_yaml.write_text(MAIN_YAML)
    main_dir = main_cwd / "run"
    default_cwd = tmp_path_factory.mktemp("default_dir_run")
    (default_cwd / "cartpole.yaml").write_text(MAIN_YAML)
    runs = RealRuns(
        main=BackgroundRun(["--config", str(main_yaml), f"run.dir={main_dir}"], main_cwd, "main"),
        main_yaml=main_yaml,
        main_dir=main_dir,
        default_dir=BackgroundRun(["--config", "cartpole.yaml", *DEFAULT_DIR_OVERRIDES], default_cwd, "default"),
        default_dir_cwd=default_cwd,
    )
    yield runs
    runs.main.stop()
    runs.default_dir.stop()


# --- --help ---------------------------------------------------------------------------------------


def test_help_lists_every_option_with_defaults(tmp_path: Path):
    result = run_cli(["--help"], tmp_path)
    assert result.returncode == 0, result.describe()
    assert "Traceback" not in result.stdout + result.stderr, result.describe()
    lines = result.stdout.splitlines()
    all_options = options()
    assert all_options, "jaxddppo.config.options.options() is empty"
    for opt in all_options:
        assert any(line.strip().startswith(opt.key + " ") for line in lines), f"--help does not list {opt.key}"

    def line_of(key: str) -> str:
        return next(line for line in lines if line.strip().startswith(key + " "))

    defaults = {opt.key: opt.default for opt in all_options}
    for key in ("env.id", "env.num_envs", "ppo.learning_rate", "ppo.gamma", "train.total_env_steps"):
        assert "default" in line_of(key) and str(defaults[key]) in line_of(key), (
            f"--help does not show the default {defaults[key]!r} of {key}: {line_of(key)!r}"
        )
    assert not list(tmp_path.iterdir()), "--help wrote files"


# --- bad input: one line, exit code 2, nothing written --------------------------------------------

# (id, arguments, files to write first {name: text}, substrings the one error line must hold).
# "{tmp}" in an argument or a substring stands for the case's working directory.
BAD_INPUTS = [
    ("unknown_key", ["ppo.lerning_rate=1e-3"], {}, ["ppo.lerning_rate", "ppo.learning_rate"]),
    ("unknown_section_typo", ["trian.seed=1"], {}, ["trian", "'train'"]),
    ("unknown_section", ["foo.bar=1"], {}, ["foo"]),
    ("wrong_type", ["env.num_envs=abc"], {}, ["env.num_envs", "abc"]),
    ("wrong_type_bool", ["ppo.anneal_lr=maybe"], {}, ["ppo.anneal_lr", "maybe"]),
    ("out_of_range_gamma", ["ppo.gamma=1.5"], {}, ["ppo.gamma", "1.5"]),
    ("out_of_range_num_envs", ["env.num_envs=0"], {}, ["env.num_envs", "0"]),
    ("out_of_range_learning_rate", ["ppo.learning_rate=-1"], {}, ["ppo.learning_rate", "-1"]),
    ("invalid_choice", ["network.activation=foo"], {}, ["network.activation", "foo", "tanh"]),
    ("negative_checkpoint_seconds", ["checkpoint.every_seconds=-5"], {}, ["checkpoint.every_seconds", "-5"]),
    # One device, so 4 shards are allowed (a multiple of the device count), but 6 envs do not split in 4.
    ("num_envs_not_divisible_by_shards", ["env.num_envs=6", "train.num_shards=4"], {},
     ["env.num_envs", "6", "train.num_shards", "4"]),
    # 4 envs x 128 steps = 512 samples per shard, not divisible into 3 minibatches.
    ("samples_not_divisible_by_minibatches",
     ["env.num_envs=4", "ppo.num_steps=128", "ppo.num_minibatches=3"], {},
     ["ppo.num_minibatches", "3", "512"]),
    ("eval_off_chunk_boundaries", ["eval.every_updates=3", "train.updates_per_chunk=2"], {},
     ["eval.every_updates", "3", "train.updates_per_chunk", "2"]),
    ("invalid_recurrent_core", ["network.recurrent=rnn"], {}, ["network.recurrent", "rnn", "gru", "lstm"]),
    ("actor_widths_with_a_shared_torso", ["network.shared_torso=true", "network.actor_hidden_sizes=[8]"], {},
     ["network.actor_hidden_sizes", "[8]", "network.shared_torso"]),
    ("invalid_start_states", ["env.start_states=cached"], {}, ["env.start_states", "cached", "fresh", "first"]),
    ("first_start_states_with_a_pool_ratio", ["env.start_states=first", "env.optimistic_reset_ratio=4"], {},
     ["env.optimistic_reset_ratio", "4", "env.start_states=first"]),
    # 6 envs x 128 steps split into 4 minibatches of samples, but not into 4 of whole sequences.
    ("sequences_not_divisible_by_minibatches",
     ["network.recurrent=gru", "env.num_envs=6", "ppo.num_minibatches=4"], {},
     ["env.num_envs", "=6", "ppo.num_minibatches=4", "network.recurrent=gru"]),
    ("less_than_one_update", ["env.num_envs=4", "ppo.num_steps=16", "train.total_env_steps=63"], {},
     ["train.total_env_steps", "63", "64"]),
    ("unknown_env", ["env.id=NotAnEnv-v0"], {}, ["env.id", "NotAnEnv-v0", "CartPole-v1", "Pendulum-v1"]),
    ("missing_config_file", ["--config", "{tmp}/missing.yaml"], {}, ["missing.yaml"]),
    ("config_file_is_a_directory", ["--config", "{tmp}"], {}, ["{tmp}"]),
    ("malformed_yaml", ["--config", "{tmp}/bad.yaml"], {"bad.yaml": "env: [unclosed\n"}, ["bad.yaml"]),
    ("yaml_list", ["--config", "{tmp}/list.yaml"], {"list.yaml": "- env\n- ppo\n"}, ["list.yaml"]),
    ("yaml_scalar", ["--config", "{tmp}/scalar.yaml"], {"scalar.yaml": "42\n"}, ["scalar.yaml"]),
    ("unknown_key_in_file", ["--config", "{tmp}/typo.yaml"], {"typo.yaml": "env:\n  num_envz: 4\n"},
     ["typo.yaml", "env.num_envz", "env.num_envs"]),
    ("wrong_type_in_file", ["--config", "{tmp}/type.yaml"], {"type.yaml": "ppo:\n  gamma: high\n"},
     ["type.yaml", "ppo.gamma", "high"]),
    ("override_without_equals", ["env.num_envs"], {}, ["env.num_envs"]),
    ("unknown_flag", ["--frobnicate"], {}, ["--frobnicate"]),
    ("stop_after_no_updates", ["--stop-after-updates", "0"], {}, ["--stop-after-updates=0", "at least 1"]),
    ("config_and_resume", ["--config", "{tmp}/c.yaml", "--resume", "{tmp}"], {}, ["--resume", "--config"]),
]


# Runs each case's arguments through the command line's main function as `python -m jaxddppo.train`
# runs them (`sys.exit(main())`), one after another: what one process would print and exit with.
BATCH_DRIVER = r"""
import contextlib, io, json, os, sys, traceback
from jaxddppo.train import main
results = []
for cwd, args in json.loads(sys.stdin.read()):
    os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            traceback.print_exc()
            code = 1
    if isinstance(code, str):  # sys.exit("message") prints it and exits 1
        err.write(code + "\n")
        code = 1
    results.append([code or 0, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def bad_input_case(tmp_path: Path, args: list[str], files: dict[str, str]) -> list[str]:
    """Write the case's files into `tmp_path`; its arguments there, writing into tmp_path/r."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return [arg.replace("{tmp}", str(tmp_path)) for arg in args] + [f"run.dir={tmp_path / 'r'}"]


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Result]]:
    """Every BAD_INPUTS case, one after another in one fresh interpreter: its directory and result."""
    cases = {name: (tmp_path_factory.mktemp(name), args, files) for name, args, files, _ in BAD_INPUTS}
    batch = [[str(cwd), bad_input_case(cwd, args, files)] for cwd, args, files in cases.values()]
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, "-c", BATCH_DRIVER], input=json.dumps(batch), capture_output=True,
                               text=True, env=subprocess_env(1), timeout=QUICK_TIMEOUT_S, cwd=REPO_ROOT)
    assert completed.returncode == 0, completed.stderr
    seconds = time.perf_counter() - start
    outcomes = json.loads(completed.stdout.strip().splitlines()[-1])
    return {name: (cases[name][0], Result(code, out, err, seconds))
            for name, (code, out, err) in zip(cases, outcomes, strict=True)}


def test_bad_input_in_its_own_process_is_one_line_and_exit_2(tmp_path: Path):
    result = run_cli(bad_input_case(tmp_path, ["--config", "{tmp}/typo.yaml"], {"typo.yaml": "env:\n  num_envz: 4\n"}),
                     tmp_path)
    assert (result.returncode, result.stdout, "Traceback" in result.stderr) == (2, "", False), result.describe()
    assert result.stderr.count("\n") == 1 and "env.num_envz" in result.stderr, result.describe()
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name, expected", [(case[0], case[3]) for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(bad_input_results: dict[str, tuple[Path, Result]], name: str,
                                          expected: list[str]):
    tmp_path, result = bad_input_results[name]
    run_dir = tmp_path / "r"

    assert result.returncode == 2, result.describe()
    assert "Traceback" not in result.stdout + result.stderr, result.describe()
    assert result.stdout == "", result.describe()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"want exactly one line on stderr\n{result.describe()}"
    for text in expected:
        text = text.replace("{tmp}", str(tmp_path))
        assert text in lines[0], f"{text!r} is not in the error line {lines[0]!r}"
    # It failed before anything ran: no run directory, no runs/ default one.
    assert not run_dir.exists() or not list(run_dir.iterdir()), sorted(os.listdir(run_dir))
    assert not (tmp_path / "runs").exists()


# --- real runs -------------------------------------------------------------------------------------


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_config_metrics_and_summary(real_runs: RealRuns, assert_real_png):
    result = real_runs.main.succeeded()
    run_dir = real_runs.main_dir
    # No TensorBoard events unless run.tensorboard=true.
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints", "config.yaml", "env_spec.json", "learning_curve.png", "metrics.jsonl", "summary.json"
    ], result.describe()
    # The final checkpoint alone: the last update (the short run never reaches checkpoint.every_seconds=300).
    assert os.listdir(run_dir / "checkpoints") == [str(MAIN_NUM_UPDATES)]
    assert_real_png(run_dir / "learning_curve.png")

    # config.yaml: the requested config, with the shard count resolved for one device and the CPU switch for a CPU.
    saved = load_config(str(run_dir / "config.yaml"))
    requested = load_config(str(real_runs.main_yaml), [f"run.dir={run_dir}"])
    assert requested.train.num_shards is None and requested.run.cpu_tuning == "auto"
    expected = dataclasses.replace(requested, train=dataclasses.replace(requested.train, num_shards=1),
                                   run=dataclasses.replace(requested.run, cpu_tuning="on"))
    assert saved == expected
    assert (saved.env.id, saved.env.num_envs, saved.ppo.num_steps) == ("CartPole-v1", 4, 16)
    assert (saved.train.total_env_steps, saved.train.updates_per_chunk, saved.eval.num_episodes) == (2048, 8, 4)
    assert saved.run.dir == str(run_dir)

    # metrics.jsonl: one row per update, every documented field and no other.
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == MAIN_NUM_UPDATES
    assert [row["update"] for row in rows] == list(range(1, MAIN_NUM_UPDATES + 1))
    previous_wall = 0.0
    for row in rows:
        assert set(row) == set(METRIC_FIELDS), row
        assert row["eval_return_mean"] is None, row  # eval.every_updates defaults to 0: no periodic evaluation
        assert row["env_steps"] == row["update"] * 4 * 16, row
        for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm",
                    "explained_variance", "learning_rate"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row)
        assert row["value_loss"] >= 0 and row["entropy"] >= 0 and 0 <= row["clip_fraction"] <= 1, row
        assert 0 < row["learning_rate"] <= 2.5e-4 * (1 + 1e-6), row  # float32 of the default
        assert isinstance(row["episodes_completed"], int) and row["episodes_completed"] >= 0, row
        assert row["wall_seconds"] >= previous_wall, row
        previous_wall = row["wall_seconds"]
    assert sum(row["episodes_completed"] for row in rows) > 0  # CartPole episodes end within 2048 steps

    # summary.json: every documented field, with the values this run must have.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) == set(SUMMARY_FIELDS)
    required = {"env_id", "total_env_steps", "num_devices", "num_shards", "num_processes", "compile_seconds",
                "train_seconds", "env_steps_per_second", "final_episode_return", "eval_return_mean",
                "eval_return_std", "params_digest"}
    assert required <= set(summary)
    assert summary["env_id"] == "CartPole-v1"
    assert summary["total_env_steps"] == 2048
    assert summary["num_updates"] == MAIN_NUM_UPDATES
    assert (summary["num_devices"], summary["num_shards"], summary["num_processes"]) == (1, 1, 1)
    assert summary["backend"] == "cpu"
    assert summary["jax_version"] == metadata.version("jax")
    assert summary["eval_episodes"] == 4
    assert summary["params_digest"] > 0 and math.isfinite(summary["params_digest"])
    assert summary["compile_seconds"] > 0 and summary["train_seconds"] > 0
    assert summary["env_steps_per_second"] > 0
    assert summary["final_episode_return"] is None or summary["final_episode_return"] > 0
    assert 1 <= summary["eval_return_mean"] <= 500  # CartPole-v1 returns
    assert summary["eval_return_std"] >= 0
    assert summary["eval_length_mean"] == summary["eval_return_mean"]  # +1 per step on CartPole


def test_second_run_into_same_dir_is_refused(real_runs: RealRuns):
    real_runs.main.succeeded()
    run_dir = real_runs.main_dir
    before = {path.relative_to(run_dir): path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}

    result = run_cli(["--config", str(real_runs.main_yaml), f"run.dir={run_dir}"], real_runs.main.cwd)

    assert result.returncode == 2, result.describe()
    assert "Traceback" not in result.stdout + result.stderr, result.describe()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.describe()
    assert "run.dir" in lines[0] and str(run_dir) in lines[0], lines[0]
    after = {path.relative_to(run_dir): path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    assert after == before  # metrics.jsonl, checkpoints and everything else untouched, byte for byte


def test_default_run_dir_is_under_runs_in_the_cwd(real_runs: RealRuns):
    result = real_runs.default_dir.succeeded()
    runs = real_runs.default_dir_cwd / "runs"
    assert runs.is_dir(), result.describe()
    made = [path.name for path in runs.iterdir()]
    assert len(made) == 1 and re.fullmatch(r"CartPole-v1-\d{8}-\d{6}", made[0]), made
    run_dir = runs / made[0]
    assert {"config.yaml", "metrics.jsonl", "summary.json"} <= {path.name for path in run_dir.iterdir()}
    saved = load_config(str(run_dir / "config.yaml"))
    assert saved.run.dir == os.path.join("runs", made[0])  # as resolved, relative to the cwd
    assert len(read_metrics(run_dir / "metrics.jsonl")) == DEFAULT_DIR_NUM_UPDATES


def test_overrides_beat_the_config_file(real_runs: RealRuns):
    result = real_runs.default_dir.succeeded()
    assert "num_envs: 4" in (real_runs.default_dir_cwd / "cartpole.yaml").read_text()
    (run_dir,) = (real_runs.default_dir_cwd / "runs").iterdir()
    saved = load_config(str(run_dir / "config.yaml"))
    assert saved.env.num_envs == 8, result.describe()
    assert saved.train.total_env_steps == 1024
    assert saved.ppo.num_steps == 16  # from the file, not the default 128
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_updates"] == DEFAULT_DIR_NUM_UPDATES  # the run used 8 envs, not only config.yaml
    assert summary["total_env_steps"] == 1024


@pytest.mark.slow  # about 30 s end to end; the device-count decision's unit tests run in CI
def test_external_device_count_is_honoured_and_used_by_default(tmp_path):
    """XLA_FLAGS set by the user decides the devices; num_shards defaults to all of them."""
    (tmp_path / "run.yaml").write_text(MAIN_YAML)
    completed = subprocess.run(
        cli_command("--config", "run.yaml", "run.dir=two", "train.total_env_steps=512"),
        cwd=tmp_path, env=subprocess_env(2), capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (summary["num_devices"], summary["num_shards"]) == (2, 2)
    assert load_config(str(tmp_path / "two" / "config.yaml")).train.num_shards == 2


# The CPU split's run: 32 CartPoles, 16 per device on two cores.
SPLIT_YAML = MAIN_YAML.replace("num_envs: 4", "num_envs: 32").replace("total_env_steps: 2048", "total_env_steps: 1024")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to pin the run to")
def test_the_command_takes_one_cpu_device_per_core(tmp_path):
    """With nothing deciding the device count, `python -m jaxddppo.train` on two cores splits
    the CPU into two devices for 32 environments, says so, records the devices and the two
    shards in config.yaml, and learns bit for bit what its two shards learn on one device
    through the Python API."""
    from jaxddppo.train import run

    (tmp_path / "run.yaml").write_text(SPLIT_YAML)
    two_cores = sorted(os.sched_getaffinity(0))[:2]
    env = {key: value for key, value in subprocess_env(1).items() if key != "XLA_FLAGS"}
    command = [sys.executable, "-c", f"import os, runpy; os.sched_setaffinity(0, {two_cores}); "
               "runpy.run_module('jaxddppo.train', run_name='__main__', alter_sys=True)",
               "--config", "run.yaml", "run.dir=split"]
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert completed.returncode == 0, completed.stderr
    assert "run.cpu_devices=2, one CPU device per core, 16 envs each" in completed.stdout
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert (summary["num_devices"], summary["num_shards"]) == (2, 2)
    saved = load_config(str(tmp_path / "split" / "config.yaml"))
    assert (saved.run.cpu_devices, saved.train.num_shards) == (2, 2)

    import jax

    one_device = dataclasses.replace(saved, run=dataclasses.replace(saved.run, dir=str(tmp_path / "one"),
                                                                    cpu_devices=0, progress=False))
    alone = run(one_device, devices=jax.devices()[:1])
    assert alone.summary["num_devices"] == 1
    assert alone.summary["params_digest"] == summary["params_digest"]
