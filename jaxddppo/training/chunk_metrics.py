"""A chunk's metrics on the host: the metrics.jsonl rows of its updates (member after member
in a sweep), the mean episode return a progress line shows, and the guard that stops a run
on the first NaN or Inf."""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from jaxddppo.outputs.writers import METRIC_FIELDS
from jaxddppo.ppo import UpdateMetrics
from jaxddppo.training.eval_episodes import EvalStats
from jaxddppo.training.experiment import Experiment


class NonFiniteError(RuntimeError):
    """Training produced NaN or Inf; the message names the update and the quantity."""


def eval_fields(evaluation: Optional[EvalStats]) -> dict[str, Optional[float]]:
    """The eval_* fields of a metrics row: null on rows without an evaluation."""
    if evaluation is None:
        return {"eval_return_mean": None, "eval_return_std": None, "eval_length_mean": None}
    return {
        "eval_return_mean": float(evaluation.return_mean),
        "eval_return_std": float(evaluation.return_std),
        "eval_length_mean": float(evaluation.length_mean),
    }


def metrics_rows(metrics: UpdateMetrics, first_update: int, env_steps_per_update: int,
                 wall_seconds: float, evaluation: Optional[EvalStats] = None) -> list[dict]:
    """One dict per update from the metrics of one chunk (host arrays [num_updates]);
    `evaluation`, if any, ran after the chunk's last update and goes on its row."""
    columns = {name: np.asarray(value, np.float64) for name, value in vars(metrics).items()}
    rows = []
    for offset in range(len(columns["policy_loss"])):
        update = first_update + offset + 1
        row: dict[str, Any] = {
            "update": update,
            "env_steps": update * env_steps_per_update,
            "wall_seconds": round(wall_seconds, 3),
        }
        row.update({name: float(values[offset]) for name, values in columns.items()})
        row["episodes_completed"] = int(row["episodes_completed"])
        row.update(eval_fields(None))
        rows.append(row)
    if evaluation is not None:
        rows[-1].update(eval_fields(evaluation))
    assert set(rows[0]) == set(METRIC_FIELDS), "metrics.jsonl fields and their documentation differ"
    return rows


# Quantities that are finite in every healthy update (explained_variance and the
# episode means are legitimately undefined sometimes).
GUARDED_METRICS = ("policy_loss", "value_loss", "entropy", "approx_kl", "grad_norm")


def first_non_finite(metrics: UpdateMetrics) -> Optional[tuple[int, str]]:
    """(offset within the chunk, quantity) of the first NaN/Inf among the guarded metrics."""
    for offset in range(len(np.asarray(metrics.policy_loss))):
        for name in GUARDED_METRICS:
            if not np.isfinite(np.asarray(getattr(metrics, name))[offset]):
                return offset, name
    return None


def chunk_episode_return(metrics: UpdateMetrics) -> Optional[float]:
    """Mean return over the episodes that ended in a chunk, weighted by their count."""
    counts = np.asarray(metrics.episodes_completed, np.float64)
    if counts.sum() == 0:
        return None
    returns = np.nan_to_num(np.asarray(metrics.episode_return_mean, np.float64))
    return float((returns * counts).sum() / counts.sum())


def chunk_rows(experiment: Experiment, metrics: list[UpdateMetrics], first_update: int, wall_seconds: float,
               evaluations: Optional[EvalStats]) -> list[dict]:
    """The metrics rows of one chunk, member after member (`metrics`: host, one per member);
    a sweep's rows lead with their member."""
    rows = []
    for member, member_metrics in enumerate(metrics):
        evaluation = None if evaluations is None else jax.tree.map(lambda leaf: leaf[member], evaluations)
        member_rows = metrics_rows(member_metrics, first_update, experiment.topology.env_steps_per_update,
                                   wall_seconds, evaluation)
        rows += [{"member": member, **row} for row in member_rows] if experiment.is_sweep else member_rows
    return rows


def check_finite(metrics: list[UpdateMetrics], params_finite: np.ndarray, first_update: int,
                 name_members: bool) -> None:
    """Raise NonFiniteError naming the member (in a sweep), the update and the quantity."""
    for member, member_metrics in enumerate(metrics):
        whose = f" of member {member}" if name_members else ""
        bad = first_non_finite(member_metrics)
        if bad is not None:
            offset, name = bad
            raise NonFiniteError(f"non-finite {name}{whose} at update {first_update + offset + 1}")
        if not params_finite[member]:
            size = len(np.asarray(member_metrics.policy_loss))
            raise NonFiniteError(f"non-finite parameters{whose} after update {first_update + size}")
