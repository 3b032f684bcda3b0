"""The benchmark harness (benchmarks/): suites, alternation, medians and ratios, argument errors,
and real (tiny) side-by-side runs. Tests that need a peer skip without it."""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from conftest import REPO_ROOT, subprocess_env

from jaxddppo import sharding
from jaxddppo.config.files import load_config

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import bench  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import collectives  # noqa: E402
import env_rates  # noqa: E402
import families  # noqa: E402
import gpu  # noqa: E402

TINY_STEPS = 4096  # 8 updates of 4 envs x 128 steps, in one chunk


def result(steps_per_second, compile_seconds=5.0, peak=700.0, final_return=500.0, outside_training_seconds=8.0):
    return {"steps_per_second": steps_per_second, "first_run_steps_per_second": steps_per_second / 2,
            "compile_seconds": compile_seconds, "peak_rss_mb": peak, "final_return": final_return,
            "outside_training_seconds": outside_training_seconds}


def tiny_plan(rows, sources):
    specs = {name: {**spec, "total_env_steps": TINY_STEPS} for name, spec in bench.CONFIGS.items()}
    return bench.Plan(rows=tuple(rows), specs=specs, sources=sources, repeats=1, timeout=300)


def test_every_suite_alternates_distinct_trials():
    rows = bench.comparisons(bench.SUITES, ["rejax"])
    trials = bench.distinct_trials(rows)
    assert len(trials) == len(set(trials))
    assert bench.Trial("jaxddppo", "small") in trials and bench.Trial("rejax", "small", seeds=32) in trials
    small = [row for row in rows if row.suite == "small"]
    assert {row.numerator for row in small} == {bench.Trial("jaxddppo", "small", cpu_threads=1)}
    assert [row.denominator.label for row in small] == [
        "rejax small, 1 device(s)", "rejax small, 1 device(s), 1 CPU thread(s)", "jaxddppo small, 1 device(s)"]
    scaling = [row for row in rows if row.suite == "scaling"]
    assert [(row.numerator.devices, row.denominator.devices) for row in scaling] == [(2, 1), (2, 1)]
    assert [row.denominator.cpu_threads for row in scaling] == [1, 0]  # each config's best on 1 device
    population = [row for row in rows if row.suite == "population"]
    assert [(row.numerator.seeds, row.numerator.devices) for row in population] == [
        (1, 1), (8, 1), (32, 1), (32, 2), (32, 1), (32, 1)]
    assert [(row.numerator.cpu_threads, row.denominator.cpu_threads) for row in population[-2:]] == [(1, 0), (1, 1)]


def test_the_cpu_devices_suite_puts_2_devices_against_1_from_4_to_16_envs_each():
    rows = bench.comparisons(["cpu-devices"], ["rejax"])
    assert [(row.numerator.config, row.numerator.devices, row.denominator.devices) for row in rows] == [
        ("small-8", 2, 1), ("small-16", 2, 1), ("small-32", 2, 1)]
    assert {row.numerator.contender for row in rows} | {row.denominator.contender for row in rows} == {"jaxddppo"}
    for row in rows:
        spec = bench.CONFIGS[row.numerator.config]
        assert {key: value for key, value in spec.items() if key not in ("num_envs", "total_env_steps")} == {
            key: value for key, value in bench.SMALL_CONFIG.items() if key not in ("num_envs", "total_env_steps")}
        # The device count is the trial's, not the train command's default split.
        env = bench.trial_environment(row.denominator, {}, REPO_ROOT)
        assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"


def test_the_guard_measures_both_checkouts_defaults_on_the_same_trials():
    guard = bench.comparisons(["guard"], ["rejax"])
    assert all(row.numerator == replace(row.denominator, contender="jaxddppo") for row in guard)
    assert {row.denominator.contender for row in guard} == {"baseline"}
    assert [(row.numerator.config, row.numerator.devices, row.numerator.seeds, row.guarded) for row in guard] == [
        ("small", 1, 0, False), ("large", 1, 0, True), ("large", 2, 0, False), ("small", 2, 32, True)]
    assert bench.CONFIGS["large"]["num_envs"] == 2048


def test_the_reductions_suite_prices_exact_reductions_on_two_devices(tmp_path):
    rows = bench.comparisons(["reductions"], ["rejax"])
    assert [(row.numerator, row.denominator) for row in rows] == [
        (bench.Trial("jaxddppo", "large", 2), bench.Trial("jaxddppo", "large", 2, exact_reductions=False))]
    (row,) = rows
    assert row.denominator.label == "jaxddppo large, 2 device(s), exact_reductions=false"
    sources = bench.Sources({"jaxddppo": REPO_ROOT})
    fast = load_config(bench.trial_command(row.denominator, bench.CONFIGS["large"], sources, tmp_path)[-1])
    assert fast.train.exact_reductions is False
    exact = bench.trial_command(row.numerator, bench.CONFIGS["large"], sources, tmp_path)
    assert "exact_reductions" not in yaml.safe_load(Path(exact[-1]).read_text())["train"]  # a baseline may predate it


def test_each_peer_gets_the_peer_suites_rows():
    rows = bench.comparisons(["small", "large", "population"], ["rejax", "purejaxrl"])
    peers = [row.denominator.contender for row in rows]
    assert peers.count("rejax") == 2 + 1 + 6 and peers.count("purejaxrl") == 2 + 1  # no PureJaxRL population


def test_trials_alternate_round_by_round(capsys):
    first, second = bench.Trial("jaxddppo", "small"), bench.Trial("baseline", "small")
    order = []

    def run(trial):
        order.append(trial)
        return result(100.0 * len(order))

    measurements = bench.measure([first, second], 3, run)
    assert order == [first, second] * 3
    assert [r["steps_per_second"] for r in measurements[second]] == [200.0, 400.0, 600.0]
    assert capsys.readouterr().out.count("round ") == 6


def test_summary_takes_medians_and_the_median_of_round_ratios():
    rows = bench.comparisons(["scaling"], [])[:1]
    two, one = rows[0].numerator, rows[0].denominator
    measurements = {
        two: [result(150.0, compile_seconds=4.0), result(90.0, compile_seconds=6.0, outside_training_seconds=4.0),
              result(120.0)],
        one: [result(100.0), result(100.0), result(50.0)],
    }
    (entry,) = bench.summarise(rows, measurements)
    assert entry["numerator_steps_per_second"] == 120.0 and entry["denominator_steps_per_second"] == 100.0
    assert entry["numerator_first_run_steps_per_second"] == 60.0
    assert entry["round_ratios"] == [1.5, 0.9, 2.4]
    assert entry["steps_per_second_ratio"] == 1.5  # not 120 / 100
    assert entry["round_compile_ratios"] == [0.8, 1.2, 1.0] and entry["compile_seconds_ratio"] == 1.0
    assert entry["round_outside_training_ratios"] == [1.0, 0.5, 1.0] and entry["outside_training_seconds_ratio"] == 1.0
    assert entry["scaling_efficiency"] == 0.75 and entry["guard"] is None
    assert "| scaling | jaxddppo small, 2 device(s) |" in bench.format_table([entry])


def test_guarded_rows_are_held_to_the_bounds():
    rows = bench.comparisons(["guard"], [])
    # This checkout / the baseline, row by row: steps/s and seconds outside training (compile
    # seconds are reported, not guarded: here 2x on every row).
    ratios = [(0.5, 3.0), (0.95, 1.1), (0.5, 3.0), (0.94, 1.0)]
    measurements = {}
    for row, (steps, outside_ratio) in zip(rows, ratios, strict=True):
        measurements[row.numerator] = [result(100.0 * steps, compile_seconds=2.0, outside_training_seconds=outside_ratio)]
        measurements[row.denominator] = [result(100.0, compile_seconds=1.0, outside_training_seconds=1.0)]
    table = bench.summarise(rows, measurements)
    assert [entry["guard"] for entry in table] == [None, "pass", None, "FAIL"]
    assert bench.guard_failures(table) == ["jaxddppo small, 2 device(s), 32 seeds / baseline"]
    measurements[rows[1].numerator] = [result(120.0, outside_training_seconds=1.11)]
    assert [entry["guard"] for entry in bench.summarise(rows, measurements)] == [None, "FAIL", None, "FAIL"]
    lines = bench.format_table(table).splitlines()
    assert lines[2].endswith("| - |") and lines[3].endswith("| pass |") and lines[5].endswith("| FAIL |")


def test_trial_environment_sets_threads_devices_and_the_checkout():
    environ = {"PJRT_NPROC": "4", "NPROC": "8", "PYTHONPATH": "/elsewhere",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_cpu_foo=1"}
    env = bench.trial_environment(bench.Trial("baseline", "large", devices=2, cpu_threads=1), environ, Path("/base"))
    assert env["PJRT_NPROC"] == "1" and "NPROC" not in env
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"
    assert env["PYTHONPATH"] == os.pathsep.join(["/base", "/elsewhere"])
    peer = bench.trial_environment(bench.Trial("rejax", "small"), environ, None)
    assert "PJRT_NPROC" not in peer and peer["PYTHONPATH"] == "/elsewhere"


def test_a_trial_process_compiles_without_the_compilation_cache(tmp_path):
    finished = bench.run_process([sys.executable, "-c", "import jax; print(jax.config.jax_enable_compilation_cache)"],
                                 {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "true"}, tmp_path, 120)
    assert finished.exit_code == 0 and (tmp_path / "output.txt").read_text().split()[-1] == "False"


def test_a_checkout_runs_its_command_line_on_a_config_it_accepts(tmp_path):
    sources = bench.Sources({"jaxddppo": REPO_ROOT}, Path("/clone"))
    sweep = bench.trial_command(bench.Trial("jaxddppo", "small", devices=2, seeds=32), bench.CONFIGS["small"],
                                sources, tmp_path)
    assert sweep[1:5] == ["-m", "jaxddppo.sweep", "--config", str(tmp_path / "config.yaml")]
    assert sweep[5:] == ["--seeds", "32"]
    config = load_config(str(tmp_path / "config.yaml"))
    assert config.run.dir == str(tmp_path / "run") and config.env.num_envs == 4 and config.ppo.learning_rate == 2.5e-4
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["checkpoint"] == {"every_updates": 0,
                                                                                   "every_seconds": 0}
    train = bench.trial_command(bench.Trial("baseline", "large"), bench.CONFIGS["large"], sources, tmp_path)
    assert train[1:3] == ["-m", "jaxddppo.train"] and load_config(train[-1]).env.num_envs == 2048
    peer = bench.trial_command(bench.Trial("purejaxrl", "large"), bench.CONFIGS["large"], sources, tmp_path)
    assert peer[1:3] == [str(bench.PEERS_SCRIPT), "purejaxrl"] and peer[-2:] == ["--purejaxrl", "/clone"]


def test_steady_state_leaves_out_the_first_chunk(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"member": member, "update": update, "env_steps": 100 * update, "wall_seconds": 1.0 if update <= 2 else 3.0}
            for update in (1, 2, 3, 4) for member in (0, 1)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert bench.steady_state(path, 2) == (400, 2.0)  # members x (400 - 200) steps in 3.0 - 1.0 s
    path.write_text("".join(json.dumps(row) + "\n" for row in rows if row["update"] <= 2))
    assert bench.steady_state(path, 2) == (400, 1.0)  # one chunk: all of it


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512bw avx512_bf16

processor\t: 1
model name\t: Another CPU
flags\t\t: fpu sse2
"""


def test_cpu_description_names_the_first_processors_model_and_vector_isa():
    assert bench.cpu_description(CPUINFO) == {"cpu_model": "AMD EPYC 9R14",
                                              "cpu_vector_isa": ["avx2", "fma", "avx512f", "avx512_bf16"]}
    assert bench.cpu_description("") == {"cpu_model": None, "cpu_vector_isa": []}


PUREJAXRL = bench.PUREJAXRL_URL


@pytest.mark.parametrize("argv, message", [
    (["--suites", "small,fast"],
     "--suites=fast is not a suite; choose from small, large, scaling, population, guard, reductions, cpu-devices"),
    (["--suites", ""],
     "--suites=(none) is not a suite; choose from small, large, scaling, population, guard, reductions, cpu-devices"),
    (["--peers", "rejax,cleanrl"], "--peers=cleanrl is not a peer; choose from rejax, purejaxrl"),
    (["--suites", "guard"], "--suites=guard needs --baseline PATH, another checkout of jaxddppo"),
    (["--baseline", str(REPO_ROOT)], "--baseline is read only by the guard suite; add guard to --suites"),
    (["--suites", "guard", "--baseline", "/nowhere"],
     "--baseline=/nowhere is not a checkout of jaxddppo (no jaxddppo/train.py there)"),
    (["--peers", "purejaxrl"], f"--peers=purejaxrl needs --purejaxrl PATH, a clone of {PUREJAXRL}"),
    (["--purejaxrl", "/nowhere"], "--purejaxrl is read only when --peers names purejaxrl"),
    (["--peers", "purejaxrl", "--purejaxrl", "/nowhere"],
     f"--purejaxrl=/nowhere is not a clone of {PUREJAXRL} (no purejaxrl/ppo.py there)"),
    (["--repeats", "0"], "--repeats=0 must be at least 1"),
    (["--total-env-steps", "0"], "--total-env-steps=0 must be at least 1"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {message} (see --help)"]


def test_the_population_suite_needs_rejax(tmp_path, capsys):
    (tmp_path / "purejaxrl").mkdir()
    (tmp_path / "purejaxrl" / "ppo.py").touch()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--suites", "small,population", "--peers", "purejaxrl", "--purejaxrl", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --suites=population measures against rejax only; add it to --peers (see --help)"]


def test_missing_rejax_is_one_line_and_exit_2(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "rejax" else find_spec(name))
    assert bench.main(["--suites", "large"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: rejax is not installed; install the peers with: pip install -e '.[bench]'"]


def test_the_script_reports_bad_arguments_without_a_traceback():
    process = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench.py"), "--suites", "guard"],
                             capture_output=True, text=True, cwd=REPO_ROOT)
    assert process.returncode == 2
    assert process.stderr.splitlines() == [
        "error: --suites=guard needs --baseline PATH, another checkout of jaxddppo (see --help)"]


@pytest.mark.slow
def test_guard_side_by_side_with_this_checkout_as_baseline(tmp_path):
    """The harness end to end on the guard's small row: both contenders through jaxddppo's
    command line in fresh processes, this checkout standing in for the baseline."""
    rows = bench.comparisons(["guard"], [])[:1]
    assert rows[0].numerator == bench.Trial("jaxddppo", "small")
    plan = tiny_plan(rows, bench.Sources({"jaxddppo": REPO_ROOT, "baseline": REPO_ROOT}))
    measurements = bench.run_plan(plan)
    table = bench.summarise(plan.rows, measurements)
    report = bench.build_report(plan, measurements, table, "test", bench.cpu_description(bench.read_cpuinfo()))
    report = json.loads(json.dumps(report))
    assert [m["label"] for m in report["measurements"]] == ["jaxddppo small, 1 device(s)",
                                                            "baseline small, 1 device(s)"]
    assert report["sources"]["baseline"]["path"] == str(REPO_ROOT)
    assert report["machine"]["cpu_model"] == bench.cpu_description(bench.read_cpuinfo())["cpu_model"]
    for measurement in report["measurements"]:
        (run,) = measurement["results"]
        assert run["env_steps"] == run["steady_env_steps"] == TINY_STEPS  # one chunk: all of it
        assert run["steps_per_second"] > 0 and run["compile_seconds"] > 0 and run["peak_rss_mb"] > 100
        assert 8 <= run["final_return"] <= 500  # CartPole: any policy lasts 8 steps, none more than 500
    (entry,) = report["table"]
    new, old = (m["results"][0] for m in report["measurements"])
    assert entry["steps_per_second_ratio"] == pytest.approx(new["steps_per_second"] / old["steps_per_second"])
    assert entry["compile_seconds_ratio"] == pytest.approx(new["compile_seconds"] / old["compile_seconds"])
    for run in (new, old):
        assert run["compile_seconds"] < run["outside_training_seconds"] == pytest.approx(
            run["wall_seconds"] - run["train_seconds"])
    assert entry["guard"] is None


def test_a_rejax_trial_runs_as_a_peer():
    pytest.importorskip("rejax")
    trial = bench.Trial("rejax", "small")
    run = bench.run_trial(trial, tiny_plan([], bench.Sources({})))
    assert run["env_steps"] == run["steady_env_steps"] == TINY_STEPS
    assert run["steps_per_second"] > 0 and run["compile_seconds"] > 0 and run["peak_rss_mb"] > 100
    assert 8 <= run["final_return"] <= 500


@pytest.mark.skipif(not os.environ.get("PUREJAXRL"), reason="set PUREJAXRL to a clone of PureJaxRL")
def test_a_purejaxrl_trial_runs_as_a_peer():
    trial = bench.Trial("purejaxrl", "small")
    run = bench.run_trial(trial, tiny_plan([], bench.Sources({}, Path(os.environ["PUREJAXRL"]))))
    assert run["env_steps"] == run["steady_env_steps"] == TINY_STEPS
    assert run["steps_per_second"] > 0 and run["compile_seconds"] > 0 and 0 <= run["final_return"] <= 500


SHIM_SCRIPT = """
import gymnax, jax, gymnax_shim
gymnax_shim.prepare_purejaxrl()
from brax import envs
from brax.envs.wrappers.training import EpisodeWrapper, AutoResetWrapper
import navix
env, params = gymnax.make("CartPole-v1")
obs, state = env.reset(jax.random.key(0), params)
stepped = env.step(jax.random.key(1), state, 0, params)
print(len(stepped), "final_observation" in stepped[-1])
"""


@pytest.mark.slow  # about 30 s; the shim serves PureJaxRL, a peer CI does not install
def test_the_shim_steps_gymnax_the_five_value_way_and_stands_in_for_unused_simulators():
    process = subprocess.run([sys.executable, "-c", SHIM_SCRIPT], capture_output=True, text=True,
                             cwd=REPO_ROOT / "benchmarks", env=subprocess_env(1), timeout=120)
    assert process.returncode == 0, process.stderr
    assert process.stdout.split() == ["5", "False"]


@pytest.mark.slow
def test_profile_update_runs_as_the_config_says(tmp_path):
    """benchmarks/profile_update.py applies run.cpu_devices and run.cpu_threads and compiles with the
    compiler options, as training does."""
    process = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "profile_update.py"), "--config",
         str(REPO_ROOT / "experiments" / "cartpole.yaml"), "--chunks", "3", "ppo.num_steps=16",
         "train.updates_per_chunk=2", "run.cpu_devices=2", "run.cpu_threads=3"],
        capture_output=True, text=True, env=subprocess_env(1), cwd=tmp_path, timeout=300,
    )
    assert process.returncode == 0, process.stderr
    assert "while loops in the optimised program" in process.stdout
    assert "env steps/s on 2 cpu device(s), 3 XLA CPU pool thread(s)" in process.stdout
    assert "compiler options: {'xla_backend_optimization_level': 2" in process.stdout  # the train command's


def test_env_rates_measure_the_core_and_the_batched_environment_side_by_side():
    from jaxddppo.cpu import tuning as cpu_tuning

    result = env_rates.measure_rates("Pendulum-v1", 8, 5, rounds=1, steps_per_env=10)
    assert result["num_envs"] == 8 and result["steps_per_env"] == 10
    assert result["compiler_options"] == cpu_tuning.compiler_options("cpu", runs_once=False)  # the trainer's
    assert set(result["steps_per_second"]) == set(env_rates.CONTENDERS)
    assert all(rate > 0 for rate in result["steps_per_second"].values())
    rates = result["steps_per_second"]
    assert result["batch_over_core"] == rates["batch"] / rates["core"]
    with pytest.raises(ValueError, match="num_envs=6 must be a multiple of 4"):
        env_rates.measure_rates("Pendulum-v1", 6, 5)


def test_env_rates_measure_only_the_contenders_asked_and_the_core_always():
    result = env_rates.measure_rates("Pendulum-v1", 8, 5, rounds=1, steps_per_env=10, contenders=("core", "batch"),
                                     xla_defaults=True)
    assert set(result["steps_per_second"]) == {"core", "batch"} and set(result["compile_seconds"]) == {"core", "batch"}
    assert result["compiler_options"] == {}
    assert "batch_vmapped_over_core" not in result and result["batch_over_core"] > 0
    with pytest.raises(ValueError, match=r"contenders=\['batch'\] must include 'core'"):
        env_rates.measure_rates("Pendulum-v1", 8, 5, contenders=("batch",))


def test_env_rates_step_first_start_states_and_refuse_brax_for_other_families(capsys):
    result = env_rates.measure_rates("CartPole-v1", 8, 5, rounds=1, steps_per_env=40, start_states="first")
    assert result["start_states"] == "first" and "brax_over_core" not in result
    assert all(rate > 0 for rate in result["steps_per_second"].values())
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        env_rates.main(["CartPole-v1", "--with-brax"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --with-brax needs a playground: id, not 'CartPole-v1' (see --help)"]


def test_env_rates_step_a_playground_task_as_brax_trains_it_beside_the_others():
    pytest.importorskip("mujoco_playground")
    result = env_rates.measure_rates("playground:CartpoleBalance", 8, 5, rounds=1, steps_per_env=10,
                                     with_brax=True, contenders=("core", "batch"))
    assert set(result["steps_per_second"]) == {"core", "batch", "brax"} == set(result["compile_seconds"])
    assert result["brax_over_core"] > 0 and result["batch_over_core"] > 0
    assert result["compile_wall_seconds"] >= max(result["compile_seconds"].values())


def test_env_rates_default_window_covers_two_episodes_of_the_time_limit():
    from jaxddppo.envs import make_env

    assert env_rates.default_steps_per_env(make_env("Pendulum-v1"), 32) == 400  # a limit of 200 steps


def rates_result(core: float, batch_over_core: float, vmapped_over_core: float) -> dict:
    return {"num_envs": 32, "steps_per_second": {"core": core}, "batch_over_core": batch_over_core,
            "batch_vmapped_over_core": vmapped_over_core}


def test_families_table_takes_medians_and_shows_the_share_of_the_core_rate(tmp_path):
    config_path = tmp_path / "navix.yaml"
    config_path.write_text(yaml.safe_dump({"env": {"id": "navix:Navix-Empty-5x5-v0", "num_envs": 32}}))
    path = str(config_path)
    results = {path: {
        "rates": [rates_result(1000.0, 0.9, 0.8), rates_result(3000.0, 0.7, 0.6), rates_result(2000.0, 0.95, 0.9)],
        "train_1": [{"steps_per_second": 500.0, "compile_seconds": 10.0}] * 3,
        "train_2": [{"steps_per_second": 800.0, "compile_seconds": 12.0}, {"steps_per_second": 900.0,
                    "compile_seconds": 14.0}, {"steps_per_second": 1000.0, "compile_seconds": 13.0}],
    }}
    [row] = families.table_rows([path], results)
    assert row["core_steps_per_second"] == 2000.0 and row["train_2_steps_per_second"] == 900.0
    assert row["batch_over_core"] == 0.9 and row["batch_vmapped_over_core"] == 0.8
    assert row["train_2_compile_seconds"] == 13.0
    line = families.format_table([row]).splitlines()[-1]
    assert line == "| `navix:Navix-Empty-5x5-v0` | 32 | 2,000 | 0.90 | 0.80 | 500 | 900 | 0.25, 0.45 | 10, 13 |"


def test_gpu_suite_plans_every_row_the_issue_names():
    names = [step["name"] for step in gpu.step_plan(quick=False)]
    assert names == ["rates CheetahRun", "train CheetahRun", "rates CartpoleBalance", "train CartpoleBalance",
                     "cartpole 1 shard(s) exact=true", "cartpole 1 shard(s) exact=false",
                     "cartpole 4 shard(s) exact=true", "cartpole 4 shard(s) exact=false"]
    large = gpu.step_plan(quick=False)[-1]["overrides"]
    assert "env.num_envs=2048" in large and "train.num_shards=4" in large and "train.exact_reductions=false" in large


def test_gpu_suite_table_sets_training_beside_the_core_rate():
    rates = {"kind": "rates", "name": "rates CheetahRun", "env_id": "playground:CheetahRun", "num_envs": 2048,
             "result": {"steps_per_second": {"core": 1_000_000.0, "batch": 850_000.0}, "batch_over_core": 0.85}}
    train = {"kind": "train", "name": "train CheetahRun",
             "result": {"steps_per_second": 400_000.0, "compile_seconds": 61.23, "eval_return_mean": 123.45}}
    skipped = {"kind": "train", "name": "cartpole 4 shard(s) exact=true", "status": "skipped: budget spent"}
    lines = gpu.format_table([rates, train, skipped]).splitlines()
    assert lines[2] == "| `playground:CheetahRun` | 2048 | 1,000,000 | 850,000 | 0.85 |"
    assert lines[-2] == "| train CheetahRun | 400,000 | 0.40 | 61.2 | 123.5 |"
    assert lines[-1] == "| cartpole 4 shard(s) exact=true | skipped: budget spent | | | |"


def test_gpu_suite_records_a_failed_step_and_goes_on(tmp_path, monkeypatch):
    def fail(step, scratch, timeout):
        raise RuntimeError("exit code 1: boom")

    def train(step, scratch, timeout):
        return {"steps_per_second": 10.0, "compile_seconds": 1.0, "eval_return_mean": None}

    monkeypatch.setattr(gpu, "run_rates", fail)
    monkeypatch.setattr(gpu, "run_training", train)
    assert gpu.run_suite(tmp_path, budget_seconds=600, quick=True, step_timeout=10) == 1
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [step["status"] for step in report["steps"]] == ["failed: exit code 1: boom", "measured"] * 2 + ["measured"] * 4
    assert (tmp_path / "gpu.md").read_text() == report["table"] + "\n"


def test_families_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as excinfo:
        families.main([str(tmp_path / "missing.yaml")])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: config file not found: {tmp_path / 'missing.yaml'} (see --help)"]
    config_path = tmp_path / "navix.yaml"
    config_path.write_text(yaml.safe_dump({"env": {"id": "navix:Navix-Empty-5x5-v0"}}))
    with pytest.raises(SystemExit) as excinfo:
        families.main([str(config_path), "--steps-per-env", "-1"])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --steps-per-env=-1 must be at least 0 (see --help)"]


def test_families_rates_step_the_configs_environments_for_the_steps_asked(tmp_path):
    config_path = tmp_path / "cartpole.yaml"
    config_path.write_text(yaml.safe_dump({"env": {"id": "CartPole-v1", "num_envs": 64,
                                                   "start_states": "first"}, "ppo": {"num_steps": 16}}))
    out = tmp_path / "rates.json"
    assert families.rates_command(str(config_path), 512, out) == [
        sys.executable, str(REPO_ROOT / "benchmarks" / "env_rates.py"), "CartPole-v1", "--num-envs", "64",
        "--num-steps", "16", "--steps-per-env", "512", "--optimistic-reset-ratio", "1", "--start-states", "first",
        "--out", str(out)]


def test_env_rates_command_measures_the_contenders_asked_in_a_process_of_its_own(tmp_path):
    out = tmp_path / "rates.json"
    command = bench.env_rates_command("Pendulum-v1", 8, 5, out, steps_per_env=10, contenders=("core", "batch"))
    process = subprocess.run(command + ["--rounds", "1"], capture_output=True, text=True, cwd=tmp_path,
                             env=subprocess_env(1), timeout=300)
    assert process.returncode == 0, process.stderr
    result = json.loads(out.read_text())
    assert set(result["steps_per_second"]) == {"core", "batch"} and result["steps_per_env"] == 10
    assert process.stdout.strip() == (
        f"Pendulum-v1, 8 envs, 10 steps each per round: core {result['steps_per_second']['core']:,.0f} steps/s, "
        f"BatchedEnv {result['steps_per_second']['batch']:,.0f} ({result['batch_over_core']:.2f}x)")


def test_env_rates_refuses_contenders_without_the_core_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        env_rates.main(["Pendulum-v1", "--contenders", "batch,brax"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --contenders=batch,brax must include core and name only core,batch,batch_vmapped (see --help)"]


@pytest.mark.parametrize("exact, expected", [
    (True, [("all-to-all", 1000), ("all-gather", 1000)]),
    (False, [("all-reduce", 1000)]),
])
def test_collectives_reads_how_shards_are_summed_from_the_compiled_program(exact, expected):
    """benchmarks/collectives.py on a sum of 1,000 values over 2 devices, one shard each."""
    device_shards = sharding.DeviceShards(exact)
    program = sharding.shard_parallel(device_shards.sum, sharding.make_mesh(jax.devices()[:2]),
                                      out_layouts=sharding.PER_MEMBER)
    text = program.lower(np.ones((2, 1000), np.float32)).compile().as_text()
    assert [found for found in collectives.collectives(text) if found[1] >= 1000] == expected
    row = collectives.gradient_row({"devices": 2, "exact_reductions": exact, "parameters": 1000,
                                    "collectives": expected + [("all-reduce", 3)]})
    assert row["sent_per_device"] == 1000 and (row["other_collectives"], row["other_values"]) == (1, 3)


def test_collectives_counts_the_values_of_tuples_and_async_pairs_once():
    text = """
  %ar = (f32[64]{0}, f32[4,16]{1,0}) all-reduce-start(f32[64]{0} %a, f32[4,16]{1,0} %b), replica_groups={}
  %done = (f32[64]{0}, f32[4,16]{1,0}) all-reduce-done(%ar)
  %ag = f32[2,500]{1,0} all-gather(f32[1,500]{1,0} %c), dimensions={0}
"""
    assert collectives.collectives(text) == [("all-reduce", 128), ("all-gather", 1000)]
    assert collectives.sent_per_device("all-reduce", 1000, 8) == 1750
    assert collectives.sent_per_device("all-to-all", 1000, 8) == 875
