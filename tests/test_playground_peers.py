"""benchmarks/playground_peers.py and benchmarks/brax_peer.py without running either contender (and
without brax installed): argument errors, the step budgets, the configs both sides get, the
steady state read from Brax's reports, and the table's medians and ratios."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from jaxddppo.config.files import from_dict

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import brax_peer  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import playground_peers as peers  # noqa: E402


def result(steps_per_second, eval_return, env_steps=3_145_728, wall_seconds=100.0, devices=1):
    return {"steps_per_second": steps_per_second, "eval_return": eval_return, "env_steps": env_steps,
            "wall_seconds": wall_seconds, "devices": devices}


@pytest.mark.parametrize("arguments, message", [
    (["--tasks", "CartpoleBalance,Walker"], "--tasks=Walker is not a task; choose from CartpoleBalance, CheetahRun"),
    (["--tasks", ","], "--tasks=(none) is not a task"),
    (["--tasks", "CheetahRun,CheetahRun"], "names a task twice"),
    (["--repeats", "0"], "--repeats=0 must be at least 1"),
    (["--total-env-steps", "-5"], "--total-env-steps=-5 must be at least 1"),
    (["--timeout", "0"], "--timeout=0.0 must be positive"),
    (["--jaxddppo-cpu-devices", "-1"], "--jaxddppo-cpu-devices=-1 must be 0"),
    (["--repeats", "three"], "invalid int value"),
    (["--seeds", "3"], "unrecognized arguments: --seeds 3"),
])
def test_bad_arguments_are_one_line_and_exit_2(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        peers.parse_args(arguments)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_the_command_refuses_bad_arguments_before_looking_for_brax():
    process = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "playground_peers.py"), "--repeats", "0"],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == ["error: --repeats=0 must be at least 1 (see --help)"]


def test_without_brax_the_driver_says_where_to_run_it(monkeypatch, capsys):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    ran = []
    monkeypatch.setattr(peers, "run_trial", lambda *args: ran.append(args))
    assert peers.main(["--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "brax is not installed" in err
    assert not ran


def test_defaults_and_budgets():
    args = peers.parse_args([])
    assert args.tasks == ["CartpoleBalance", "CheetahRun"] and args.repeats == 3 and args.out is None
    specs = peers.task_specs(args)
    for task, spec in specs.items():
        # Both contenders can train exactly the budget: whole updates, evenly over Brax's training calls.
        assert spec["total_env_steps"] == peers.TASKS[task]["total_env_steps"]
        assert spec["total_env_steps"] % (spec["num_envs"] * spec["num_steps"] * (spec["brax_num_evals"] - 1)) == 0
    # Brax's steady state needs a training call after its two that compile.
    assert min(spec["brax_num_evals"] for spec in peers.TASKS.values()) >= brax_peer.WARMUP_CALLS + 2
    quantum = 256 * 32 * 4
    assert peers.task_specs(peers.parse_args(["--total-env-steps", "1"]))["CheetahRun"]["total_env_steps"] == quantum
    assert peers.with_total(peers.TASKS["CartpoleBalance"], quantum)["total_env_steps"] == quantum
    assert peers.with_total(peers.TASKS["CartpoleBalance"], quantum + 1)["total_env_steps"] == 2 * quantum
    assert {spec["start_states"] for spec in specs.values()} == {"fresh"}
    first = peers.task_specs(peers.parse_args(["--start-states", "first"]))["CheetahRun"]
    assert peers.jaxddppo_config("CheetahRun", first, 0, Path("run"))["env"]["start_states"] == "first"


def test_both_contenders_get_the_same_settings(tmp_path):
    spec = peers.with_total(peers.TASKS["CheetahRun"], 100_000)
    config = peers.jaxddppo_config("CheetahRun", spec, 2, tmp_path / "run")
    assert config["env"]["id"] == "playground:CheetahRun"
    # jaxddppo accepts every key and value (validated on a core environment: no playground needed).
    validated = from_dict({**config, "env": {**config["env"], "id": "Pendulum-v1"}})
    assert validated.train.total_env_steps == spec["total_env_steps"] and validated.train.seed == 2
    assert validated.ppo.anneal_lr is False and validated.ppo.clip_value is False
    assert validated.env.scale_rewards is False and validated.eval.num_episodes == spec["eval_episodes"]

    arguments = peers.brax_arguments("CheetahRun", spec, 2, tmp_path / "result.json")
    brax = brax_peer.parse_args(arguments)
    assert brax.task == "CheetahRun" and brax.seed == 2 and brax.out == str(tmp_path / "result.json")
    pairs = [(brax.num_envs, validated.env.num_envs), (brax.unroll_length, validated.ppo.num_steps),
             (brax.num_minibatches, validated.ppo.num_minibatches), (brax.epochs, validated.ppo.num_epochs),
             (list(brax.hidden_sizes), list(validated.network.hidden_sizes)),
             (brax.activation, validated.network.activation),
             (brax.learning_rate, validated.ppo.learning_rate), (brax.discounting, validated.ppo.gamma),
             (brax.gae_lambda, validated.ppo.gae_lambda), (brax.clip_eps, validated.ppo.clip_eps),
             (brax.entropy_cost, validated.ppo.ent_coef), (brax.vf_coef, validated.ppo.vf_coef),
             (brax.max_grad_norm, validated.ppo.max_grad_norm),
             (brax.normalize_observations, validated.env.normalize_observations),
             (brax.total_env_steps, validated.train.total_env_steps),
             (brax.eval_episodes, validated.eval.num_episodes)]
    for brax_value, jaxddppo_value in pairs:
        assert brax_value == jaxddppo_value
    assert brax.reward_scaling == 1.0 and brax.num_evals == spec["brax_num_evals"]


def test_brax_peer_refuses_sizes_it_cannot_train(tmp_path, capsys):
    base = ["--task", "CartpoleBalance", "--num-envs", "256", "--unroll-length", "32", "--num-minibatches", "8",
            "--epochs", "4", "--hidden-sizes", "32,32", "--out", str(tmp_path / "r.json")]
    assert brax_peer.parse_args(base + ["--total-env-steps", str(8192 * 8)]).num_evals == 5
    for extra, message in ((["--total-env-steps", "8192"], "is not a multiple of"),
                           (["--total-env-steps", str(8192 * 4), "--num-evals", "3"], "use at least 4"),
                           (["--total-env-steps", str(8192 * 4), "--num-minibatches", "7"], "not divisible"),
                           (["--total-env-steps", "1", "--hidden-sizes", "32,0"], "positive widths")):
        with pytest.raises(SystemExit) as exit_info:
            brax_peer.parse_args(base + extra)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_brax_steady_state_leaves_out_the_calls_that_compile():
    reports = [{"step": 0, "eval/episode_reward": 300.0},  # before training
               {"step": 100, "training/walltime": 40.0},  # compiles
               {"step": 200, "training/walltime": 70.0},  # compiles again
               {"step": 300, "training/walltime": 71.0},
               {"step": 400, "training/walltime": 73.0}]
    assert brax_peer.steady_state(reports) == (200, 3.0)
    with pytest.raises(ValueError, match="at least 3"):
        brax_peer.steady_state(reports[:3])


def test_table_reports_medians_and_the_median_of_round_ratios():
    measurements = {
        ("CartpoleBalance", "jaxddppo"): [result(100.0, 990.0, devices=2), result(300.0, 995.0, devices=2),
                                          result(120.0, 900.0, devices=2)],
        ("CartpoleBalance", "brax"): [result(50.0, 800.0), result(100.0, 980.0, wall_seconds=300.0),
                                      result(240.0, 700.0)],
    }
    (row,) = peers.summarise(["CartpoleBalance"], measurements)
    assert row["round_ratios"] == [2.0, 3.0, 0.5]
    # The median of the per-round ratios, not the ratio of the medians (120 / 100).
    assert row["steps_per_second_ratio"] == 2.0
    assert row["jaxddppo_steps_per_second"] == 120.0 and row["brax_steps_per_second"] == 100.0
    assert row["jaxddppo_eval_return"] == 990.0 and row["brax_eval_return"] == 800.0
    assert row["brax_eval_returns"] == [800.0, 980.0, 700.0]
    assert row["brax_wall_seconds"] == 100.0
    table = peers.format_table([row])
    lines = table.splitlines()
    assert row["jaxddppo_devices"] == 2
    assert len(lines) == 3 and lines[0].count("|") == lines[2].count("|") == 11
    assert "| CartpoleBalance | 3,145,728 | 2 | 120 | 100 | 2.00 | 990.0 | 800.0 | 100 | 100 |" == lines[2]


def test_rounds_alternate_the_contenders_with_one_seed_per_round(capsys):
    calls = []

    def run(contender, task, seed):
        calls.append((seed, task, contender))
        return {**result(1000.0 if contender == "jaxddppo" else 500.0, 10.0 * seed), "steady_compile_seconds": 0.0}

    measurements = peers.measure(["CartpoleBalance", "CheetahRun"], 2, run)
    assert calls == [(0, "CartpoleBalance", "jaxddppo"), (0, "CartpoleBalance", "brax"),
                     (0, "CheetahRun", "jaxddppo"), (0, "CheetahRun", "brax"),
                     (1, "CartpoleBalance", "jaxddppo"), (1, "CartpoleBalance", "brax"),
                     (1, "CheetahRun", "jaxddppo"), (1, "CheetahRun", "brax")]
    assert [r["eval_return"] for r in measurements["CheetahRun", "brax"]] == [0.0, 10.0]
    assert capsys.readouterr().out.count("round ") == 8


def test_trial_environment_is_each_commands_devices_default_threads_this_checkout_first():
    environ = {"PJRT_NPROC": "1", "NPROC": "3", "PYTHONPATH": "/elsewhere",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_cpu_x=1"}
    brax, ours = peers.trial_environment("brax", environ), peers.trial_environment("jaxddppo", environ)
    for env in (brax, ours):
        assert "PJRT_NPROC" not in env and "NPROC" not in env
        assert env["PYTHONPATH"].split(":") == [str(REPO_ROOT), "/elsewhere"]
    assert brax["XLA_FLAGS"] == "--xla_cpu_x=1 --xla_force_host_platform_device_count=1"
    assert ours["XLA_FLAGS"] == "--xla_cpu_x=1"  # the train command decides its devices
    assert Path(peers.BRAX_PEER_SCRIPT).is_file()


def test_jaxddppo_cpu_devices_reach_its_config(tmp_path):
    spec = {**peers.TASKS["CheetahRun"], "cpu_devices": 1}
    assert peers.jaxddppo_config("CheetahRun", spec, 0, tmp_path)["run"]["cpu_devices"] == 1
    assert peers.jaxddppo_config("CheetahRun", peers.TASKS["CheetahRun"], 0, tmp_path)["run"]["cpu_devices"] == 0
    assert peers.task_specs(peers.parse_args(["--jaxddppo-cpu-devices", "1"]))["CheetahRun"]["cpu_devices"] == 1
