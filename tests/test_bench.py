"""The benchmark driver: alternation, medians and ratios, and one real (tiny) side-by-side run."""

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, subprocess_env, xla_pool_threads_named
from jaxddppo import bench


def result(steps_per_second, compile_seconds=5.0, peak=700.0, final_return=500.0):
    return {"steps_per_second": steps_per_second, "first_run_steps_per_second": steps_per_second / 2,
            "compile_seconds": compile_seconds, "peak_rss_mb": peak, "final_return": final_return}


def test_every_suite_alternates_distinct_trials():
    rows = bench.comparisons(bench.SUITES)
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


def test_summary_takes_medians_and_the_median_of_round_ratios():
    rows = bench.comparisons(["scaling"])[:1]
    two, one = rows[0].numerator, rows[0].denominator
    measurements = {
        two: [result(150.0), result(90.0), result(120.0)],
        one: [result(100.0), result(100.0), result(50.0)],
    }
    (entry,) = bench.summarise(rows, measurements)
    assert entry["numerator_steps_per_second"] == 120.0 and entry["denominator_steps_per_second"] == 100.0
    assert entry["numerator_first_run_steps_per_second"] == 60.0
    assert entry["round_ratios"] == [1.5, 0.9, 2.4]
    assert entry["steps_per_second_ratio"] == 1.5  # not 120 / 100
    assert entry["scaling_efficiency"] == 0.75
    assert "| scaling | jaxddppo small, 2 device(s) |" in bench.format_table([entry])


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


def test_profile_update_runs_as_the_config_says(tmp_path):
    """experiments/profile_update.py applies run.cpu_devices and run.cpu_threads, as training does."""
    process = subprocess.run(
        [sys.executable, str(REPO_ROOT / "experiments" / "profile_update.py"), "--config",
         str(REPO_ROOT / "experiments" / "cartpole.yaml"), "--chunks", "3", "ppo.num_steps=16",
         "train.updates_per_chunk=2", "run.cpu_devices=2", "run.cpu_threads=3"],
        capture_output=True, text=True, env=subprocess_env(1), cwd=tmp_path, timeout=300,
    )
    assert process.returncode == 0, process.stderr
    assert "while loops in the optimised program" in process.stdout
    threads = ", 3 XLA CPU pool thread(s)" if xla_pool_threads_named() else ""
    assert f"env steps/s on 2 cpu device(s){threads}\n" in process.stdout


def test_bad_suite_is_one_line_and_exit_2():
    process = subprocess.run([sys.executable, "-m", "jaxddppo.bench", "--suites", "small,fast"],
                             capture_output=True, text=True)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [
        "error: --suites=fast is not a suite; choose from small, large, scaling, population (see --help)"
    ]


def test_small_suite_side_by_side(tmp_path):
    pytest.importorskip("rejax")
    out = tmp_path / "bench.json"
    assert bench.main(["--suites", "small", "--repeats", "1", "--total-env-steps", "4096", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["versions"]["rejax"] and report["configs"]["small"]["total_env_steps"] == 4096
    assert report["machine"]["cpu_model"] == bench.cpu_description(bench.read_cpuinfo())["cpu_model"]
    entry = report["table"][0]
    labels = [m["label"] for m in report["measurements"]]
    assert labels == ["jaxddppo small, 1 device(s), 1 CPU thread(s)", "rejax small, 1 device(s)",
                      "rejax small, 1 device(s), 1 CPU thread(s)", "jaxddppo small, 1 device(s)"]
    for measurement in report["measurements"]:
        (run,) = measurement["results"]
        if run["xla_cpu_pool_threads"] is not None and measurement["trial"]["cpu_threads"] and xla_pool_threads_named():
            assert run["xla_cpu_pool_threads"] == measurement["trial"]["cpu_threads"]
        assert run["env_steps"] == 4096  # 8 updates of 4 envs x 128 steps
        assert run["steps_per_second"] > 0 and run["compile_seconds"] > 0 and run["peak_rss_mb"] > 100
        assert run["steady_env_steps"] == 4096  # one chunk of 8 updates: all of it
        assert 8 <= run["final_return"] <= 500  # CartPole: any policy lasts 8 steps, none more than 500
    assert entry["steps_per_second_ratio"] == pytest.approx(
        report["measurements"][0]["results"][0]["steps_per_second"]
        / report["measurements"][1]["results"][0]["steps_per_second"]
    )
