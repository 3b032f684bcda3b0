"""Learning curves: `python -m jaxddppo.plot RUN_DIR [RUN_DIR ...] [--output FILE]`.

A run's curve is the training episode return against env steps (from
metrics.jsonl), its periodic evaluations as points with their standard
deviation, and the final evaluation (from summary.json) as a star. A sweep's
curves.png shows, per grid point, the mean training return over its seeds and a
band of +-1 standard deviation (`plot_sweep`); a population-based training sweep's pbt.png
shows each member's training return beside its hyperparameters' schedules (`plot_pbt`).
`draw_curve` draws one curve with an optional band on any matplotlib Axes. Figures are
built without pyplot, so nothing here changes a notebook's matplotlib backend.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import yaml

from jaxddppo.cli import OneLineParser
from jaxddppo.outputs.writers import PBT_FILE

CURVE_FILE = "learning_curve.png"
SWEEP_CURVES_FILE = "curves.png"
PBT_CURVES_FILE = "pbt.png"
FIGURE_SIZE = (8.0, 5.0)  # inches
DPI = 100


class RunDirError(ValueError):
    """A run directory that cannot be plotted; the message is one line."""


@dataclass(frozen=True)
class RunCurve:
    """What one run's learning curve shows; every array is 1-D, sorted by env steps."""

    name: str
    env_id: Optional[str]
    env_steps: np.ndarray  # updates on which episodes ended
    episode_return: np.ndarray
    eval_env_steps: np.ndarray
    eval_return_mean: np.ndarray
    eval_return_std: np.ndarray
    final_eval: Optional[tuple[int, float]]  # (env steps, mean return) from summary.json


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl, one per update (of each member, in a sweep's), in
    member and update order.

    A resumed run appends to the same file and may log some updates again; the
    row written last for an update wins. A last line cut short (a run killed
    while writing) is ignored.
    """
    with open(path) as handle:
        lines = handle.read().split("\n")
    by_update: dict[tuple[int, int], dict] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = (int(row.get("member", 0)), int(row["update"]))
        except (ValueError, KeyError, TypeError):
            if number == len(lines):  # no newline after it: cut short
                continue
            raise RunDirError(f"{path} line {number} is not a metrics row: {line[:80]!r}") from None
        by_update[key] = row
    return [by_update[key] for key in sorted(by_update)]


def _column(rows: list[dict], field: str) -> np.ndarray:
    return np.array([np.nan if row.get(field) is None else row[field] for row in rows], np.float64)


def load_run(run_dir: str) -> RunCurve:
    """Read a run directory's metrics.jsonl (and summary.json, config.yaml if present)."""
    if not os.path.isdir(run_dir):
        raise RunDirError(f"run directory not found: {run_dir}")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        raise RunDirError(f"{run_dir} has no metrics.jsonl: not a jaxddppo run directory")
    rows = read_metrics(metrics_path)
    if not rows:
        raise RunDirError(f"{metrics_path} is empty: the run has not finished an update yet")
    steps = _column(rows, "env_steps")
    returns = _column(rows, "episode_return_mean")
    eval_mean, eval_std = _column(rows, "eval_return_mean"), _column(rows, "eval_return_std")
    trained, evaluated = ~np.isnan(returns), ~np.isnan(eval_mean)
    summary = _read_json(os.path.join(run_dir, "summary.json"))
    final_eval = None
    if summary.get("eval_return_mean") is not None and summary.get("total_env_steps") is not None:
        final_eval = (int(summary["total_env_steps"]), float(summary["eval_return_mean"]))
    return RunCurve(
        name=os.path.basename(os.path.normpath(run_dir)),
        env_id=summary.get("env_id") or _config_env_id(run_dir),
        env_steps=steps[trained],
        episode_return=returns[trained],
        eval_env_steps=steps[evaluated],
        eval_return_mean=eval_mean[evaluated],
        eval_return_std=np.nan_to_num(eval_std[evaluated]),
        final_eval=final_eval,
    )


def _read_json(path: str) -> dict:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):  # absent (a run still going, or killed) or cut short
        return {}


def _config_env_id(run_dir: str) -> Optional[str]:
    try:
        with open(os.path.join(run_dir, "config.yaml")) as handle:
            return yaml.safe_load(handle)["env"]["id"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None


def draw_curve(
    ax: Any,
    env_steps: np.ndarray,
    values: np.ndarray,
    *,
    label: Optional[str] = None,
    band: Optional[tuple[np.ndarray, np.ndarray]] = None,
    color: Optional[str] = None,
) -> str:
    """A line of `values` against `env_steps` on the matplotlib Axes `ax`, and, if given,
    the band `(lower, upper)` shaded around it. Returns the colour used."""
    (line,) = ax.plot(env_steps, values, label=label, color=color, linewidth=1.2)
    if band is not None:
        ax.fill_between(env_steps, band[0], band[1], color=line.get_color(), alpha=0.2, linewidth=0)
    return line.get_color()


def draw_run(ax: Any, run: RunCurve, color: Optional[str] = None) -> None:
    """One run in one colour: its training curve (labelled with the run's name), its
    periodic evaluations (points, mean +- std) and its final evaluation (a star)."""
    color = draw_curve(ax, run.env_steps, run.episode_return, label=run.name, color=color)
    if len(run.eval_env_steps):
        ax.errorbar(run.eval_env_steps, run.eval_return_mean, yerr=run.eval_return_std, fmt="o",
                    color=color, markersize=5, capsize=3)
    if run.final_eval is not None:
        ax.plot(*run.final_eval, marker="*", markersize=13, color=color, markeredgecolor="black",
                linestyle="none")


def _figure() -> tuple[Any, Any]:
    # Imported here: matplotlib takes a second to import, which every other command would pay.
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_SIZE, dpi=DPI)
    return figure, figure.add_subplot()


def _save(figure: Any, ax: Any, title: str, xlabel: str, handles: list, path: str) -> None:
    """Label, lay out and save a PNG to `path` (written whole, then renamed)."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("episode return")
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize="small")
    figure.tight_layout()
    temporary = f"{path}.tmp"
    figure.savefig(temporary, format="png")
    os.replace(temporary, path)


def plot_runs(runs: Sequence[RunCurve], path: str) -> None:
    """Draw `runs` on one set of axes and save a PNG to `path`."""
    from matplotlib.lines import Line2D

    figure, ax = _figure()
    for run in runs:
        draw_run(ax, run)
    env_ids = sorted({run.env_id for run in runs if run.env_id})
    handles, _ = ax.get_legend_handles_labels()
    if any(len(run.eval_env_steps) for run in runs):
        handles.append(Line2D([], [], color="gray", marker="o", linestyle="none",
                              label="evaluation (mean +- std)"))
    if any(run.final_eval is not None for run in runs):
        handles.append(Line2D([], [], color="gray", marker="*", markersize=11, markeredgecolor="black",
                              linestyle="none", label="final evaluation"))
    _save(figure, ax, ", ".join(env_ids) if env_ids else "learning curve", "environment steps", handles, path)


def plot_sweep(run_dir: str, groups: Sequence[int], labels: Mapping[int, str], title: str, path: str) -> None:
    """A sweep's curves from its metrics.jsonl: per group of members (`groups[member]`),
    the mean training return over its members and a band of +-1 standard deviation (every
    member has a row for every update)."""
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))  # member-major
    steps = _column(rows, "env_steps").reshape(len(groups), -1)[0]
    returns = _column(rows, "episode_return_mean").reshape(len(groups), -1)
    figure, ax = _figure()
    groups = np.asarray(groups)
    for group, label in labels.items():
        curves = returns[groups == group]
        seen = np.isfinite(curves).any(axis=0)
        mean, std = np.full(curves.shape[1], np.nan), np.full(curves.shape[1], np.nan)
        mean[seen] = np.nanmean(curves[:, seen], axis=0)
        std[seen] = np.nanstd(curves[:, seen], axis=0)
        draw_curve(ax, steps, mean, label=f"{label} ({len(curves)} seeds)", band=(mean - std, mean + std))
    handles, _ = ax.get_legend_handles_labels()
    _save(figure, ax, title, "environment steps (per member)", handles, path)


def hyperparameter_schedules(rows: list[dict]) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """From pbt.jsonl's rows: per hyperparameter, per member, its (update, value) changes in
    update order, starting with update 0."""
    schedules: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for row in sorted(rows, key=lambda row: (row["update"], row["member"])):
        for key, value in row["new"].items():
            schedules.setdefault(key, {}).setdefault(row["member"], []).append((row["update"], value))
    return schedules


def plot_pbt(run_dir: str, path: str) -> None:
    """A PBT sweep's figure: every member's training return against env steps (left) and,
    beside it, each hyperparameter's value per member over the same steps (one panel per
    key, log scale), from metrics.jsonl and pbt.jsonl."""
    from matplotlib.figure import Figure

    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    schedules = hyperparameter_schedules(read_metrics(os.path.join(run_dir, PBT_FILE)))
    members = sorted({int(row.get("member", 0)) for row in rows})
    steps_per_update = rows[0]["env_steps"] / rows[0]["update"]
    last_update = max(row["update"] for row in rows)
    figure = Figure(figsize=(FIGURE_SIZE[0] / 2 * (1 + len(schedules)), FIGURE_SIZE[1]), dpi=DPI)
    axes = figure.subplots(1, 1 + len(schedules), squeeze=False)[0]
    colors = {}
    for member in members:
        mine = [row for row in rows if int(row.get("member", 0)) == member]
        returns, steps = _column(mine, "episode_return_mean"), _column(mine, "env_steps")
        seen = np.isfinite(returns)
        colors[member] = draw_curve(axes[0], steps[seen], returns[seen], label=f"member {member}")
    axes[0].set_title("training return")
    axes[0].set_xlabel("environment steps (per member)")
    axes[0].set_ylabel("episode return")
    for ax, (key, per_member) in zip(axes[1:], schedules.items()):
        for member, changes in sorted(per_member.items()):
            updates = [update for update, _ in changes] + [last_update]
            values = [value for _, value in changes]
            ax.step(np.array(updates) * steps_per_update, values + values[-1:], where="post",
                    color=colors.get(member), linewidth=1.0)
        ax.set_yscale("log")
        ax.set_title(key)
        ax.set_xlabel("environment steps (per member)")
    for ax in axes:
        ax.grid(alpha=0.3)
    if len(members) <= 16:
        axes[0].legend(fontsize="x-small")
    figure.tight_layout()
    temporary = f"{path}.tmp"
    figure.savefig(temporary, format="png")
    os.replace(temporary, path)


def save_learning_curve(run_dir: str) -> str:
    """Write `run_dir`/learning_curve.png from the run's own files; returns its path."""
    path = os.path.join(run_dir, CURVE_FILE)
    plot_runs([load_run(run_dir)], path)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(
        prog="python -m jaxddppo.plot",
        description="Draw the learning curves of one or more runs on one figure: training episode "
        "return against env steps, evaluations marked. A population-based training sweep's directory (with "
        f"{PBT_FILE}) gets {PBT_CURVES_FILE}: every member's training return beside its hyperparameters' schedules.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory (holding metrics.jsonl)")
    parser.add_argument("-o", "--output", help=f"PNG to write (default: RUN_DIR/{CURVE_FILE} for one run, "
                        "learning_curves.png in the current directory for several)")
    args = parser.parse_args(argv)
    first, single_run = args.run_dirs[0], len(args.run_dirs) == 1
    pbt = single_run and os.path.isfile(os.path.join(first, PBT_FILE))
    default = os.path.join(first, PBT_CURVES_FILE if pbt else CURVE_FILE) if single_run else "learning_curves.png"
    output = args.output or default
    try:
        if pbt:
            if not os.path.isfile(os.path.join(first, "metrics.jsonl")):
                raise RunDirError(f"{first} has no metrics.jsonl: not a jaxddppo run directory")
            plot_pbt(first, output)
        else:
            runs = [load_run(run_dir) for run_dir in args.run_dirs]
            output_dir = os.path.dirname(output) or "."
            if not os.path.isdir(output_dir):
                raise RunDirError(f"--output {output}: directory {output_dir} does not exist")
            plot_runs(runs, output)
    except RunDirError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: {error.filename or output}: {error.strerror}", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
