"""`python -m jaxddppo.plot`: reading run directories (resumed ones too), drawing, one-line errors.

Run directories here are written by hand: the files a run writes, with known numbers.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from jaxddppo.plot import draw_curve, draw_run, load_run, main, read_metrics

REPO_ROOT = Path(__file__).resolve().parents[1]


def metrics_row(update: int, episode_return, eval_return=None) -> dict:
    return {
        "update": update, "env_steps": 64 * update, "episode_return_mean": episode_return,
        "eval_return_mean": eval_return, "eval_return_std": None if eval_return is None else 2.0,
        "eval_length_mean": eval_return,
    }


def write_run(run_dir: Path, rows: list[dict], summary: dict | None = None, tail: str = "") -> Path:
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps(row) + "\n" for row in rows) + tail
    (run_dir / "metrics.jsonl").write_text(text)
    (run_dir / "config.yaml").write_text("env:\n  id: CartPole-v1\n")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_a_resumed_run_reads_as_one_curve_with_the_latest_rows(tmp_path):
    # Updates 1-4, then a resume from update 2 logs 3-6 again; a last line cut short by a kill.
    rows = [metrics_row(u, 10.0 * u) for u in (1, 2, 3, 4)] + [metrics_row(u, 100.0 * u) for u in (3, 4, 5, 6)]
    run_dir = write_run(tmp_path / "resumed", rows, tail='{"update": 7, "env_st')
    read = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [row["update"] for row in read] == [1, 2, 3, 4, 5, 6]
    assert [row["episode_return_mean"] for row in read] == [10.0, 20.0, 300.0, 400.0, 500.0, 600.0]


def test_load_run_keeps_training_and_evaluation_points_apart(tmp_path):
    rows = [metrics_row(1, None), metrics_row(2, 5.0, eval_return=7.0), metrics_row(3, 6.0),
            metrics_row(4, 8.0, eval_return=9.0)]
    run_dir = write_run(tmp_path / "r", rows, {"env_id": "CartPole-v1", "total_env_steps": 256,
                                              "eval_return_mean": 9.5})
    curve = load_run(str(run_dir))
    assert curve.name == "r" and curve.env_id == "CartPole-v1"
    np.testing.assert_array_equal(curve.env_steps, [128, 192, 256])  # update 1 ended no episode
    np.testing.assert_array_equal(curve.episode_return, [5.0, 6.0, 8.0])
    np.testing.assert_array_equal(curve.eval_env_steps, [128, 256])
    np.testing.assert_array_equal(curve.eval_return_mean, [7.0, 9.0])
    np.testing.assert_array_equal(curve.eval_return_std, [2.0, 2.0])
    assert curve.final_eval == (256, 9.5)

    axes = Figure().add_subplot()
    draw_run(axes, curve)
    training, final = axes.lines[0], axes.lines[-1]
    np.testing.assert_array_equal(training.get_xydata(), [[128, 5.0], [192, 6.0], [256, 8.0]])
    np.testing.assert_array_equal(final.get_xydata(), [[256, 9.5]])
    assert axes.containers[0].lines[0].get_marker() == "o"  # the evaluation points, with error bars
    np.testing.assert_array_equal(axes.containers[0].lines[0].get_xydata(), [[128, 7.0], [256, 9.0]])


def test_draw_curve_shades_the_band_it_is_given():
    axes = Figure().add_subplot()
    steps, mean = np.array([1.0, 2.0, 3.0]), np.array([1.0, 4.0, 9.0])
    color = draw_curve(axes, steps, mean, label="mean of 4 seeds", band=(mean - 1.0, mean + 1.0))
    np.testing.assert_array_equal(axes.lines[0].get_xydata(), np.stack([steps, mean], axis=1))
    [band] = [c for c in axes.collections if isinstance(c, PolyCollection)]
    vertices = band.get_paths()[0].vertices
    assert vertices[:, 1].min() == 0.0 and vertices[:, 1].max() == 10.0
    assert axes.lines[0].get_label() == "mean of 4 seeds" and color == axes.lines[0].get_color()


def test_main_overlays_several_runs_into_one_png(tmp_path, capsys, assert_real_png):
    first = write_run(tmp_path / "a", [metrics_row(u, 10.0 * u, 12.0 * u if u % 2 == 0 else None)
                                       for u in range(1, 9)])
    second = write_run(tmp_path / "b", [metrics_row(u, 20.0 + u) for u in range(1, 5)],
                       {"env_id": "CartPole-v1", "total_env_steps": 256, "eval_return_mean": 30.0})
    output = tmp_path / "both.png"
    assert main([str(first), str(second), "--output", str(output)]) == 0
    assert capsys.readouterr().out.strip() == str(output)
    assert_real_png(output)
    assert not list(tmp_path.glob("*.tmp"))


def test_main_on_one_run_writes_into_it(tmp_path, capsys, assert_real_png):
    run_dir = write_run(tmp_path / "one", [metrics_row(1, 3.0), metrics_row(2, 4.0)])
    assert main([str(run_dir)]) == 0
    assert_real_png(run_dir / "learning_curve.png")


@pytest.mark.parametrize("case, expected", [
    ("missing", "run directory not found: {dir}"),
    ("no_metrics", "{dir} has no metrics.jsonl"),
    ("empty_metrics", "{dir}/metrics.jsonl is empty"),
    ("garbage_line", "{dir}/metrics.jsonl line 1 is not a metrics row"),
    ("output_dir_missing", "directory {tmp}/nowhere does not exist"),
])
def test_bad_run_dirs_are_one_line_and_exit_2(tmp_path, capsys, case, expected):
    run_dir = tmp_path / "run"
    args = [str(run_dir)]
    if case == "no_metrics":
        run_dir.mkdir()
    elif case == "empty_metrics":
        write_run(run_dir, [])
    elif case == "garbage_line":
        write_run(run_dir, [], tail="not json\n" + json.dumps(metrics_row(1, 1.0)) + "\n")
    elif case == "output_dir_missing":
        write_run(run_dir, [metrics_row(1, 1.0)])
        args += ["--output", str(tmp_path / "nowhere" / "x.png")]
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured
    assert lines[0].startswith("error: ") and expected.format(dir=run_dir, tmp=tmp_path) in lines[0], lines[0]
    assert not list(tmp_path.rglob("*.png"))


def test_the_command_line_fails_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    completed = subprocess.run([sys.executable, "-m", "jaxddppo.plot", str(tmp_path / "nope")],
                               capture_output=True, text=True, env=env, timeout=120)
    assert completed.returncode == 2 and completed.stdout == ""
    assert completed.stderr.strip() == f"error: run directory not found: {tmp_path / 'nope'}"
