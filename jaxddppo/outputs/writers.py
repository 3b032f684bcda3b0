"""What a run writes and shows: metrics.jsonl, TensorBoard events, summary.json, progress output."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Optional, Protocol, TextIO

from tqdm import tqdm

# Every field of a metrics.jsonl row, with its meaning (docs/outputs.md documents each).
METRIC_FIELDS: dict[str, str] = {
    "update": "updates done so far (1 for the first)",
    "env_steps": "environment steps done so far, all shards together",
    "wall_seconds": "training seconds (compile excluded) at the end of the chunk of updates holding this one",
    "policy_loss": "clipped-surrogate loss, mean over the update's epochs x minibatches",
    "value_loss": "value loss (0.5 x squared error, clipped if ppo.clip_value), same mean",
    "entropy": "policy entropy, same mean",
    "approx_kl": "approximate KL(old || new), E[(r - 1) - log r], same mean",
    "clip_fraction": "fraction of samples whose ratio left [1 - clip_eps, 1 + clip_eps], same mean",
    "grad_norm": "global norm of the all-reduced gradient before clipping, same mean",
    "explained_variance": "1 - Var[return - value] / Var[return] over the rollout, all shards",
    "learning_rate": "learning rate at the update's first SGD step",
    "episode_return_mean": "mean return of the episodes that ended during the update, all shards (null if none)",
    "episode_length_mean": "mean length of those episodes (null if none)",
    "episodes_completed": "number of those episodes",
    "eval_return_mean": "mean return of the periodic deterministic evaluation run after this update, "
    "all shards (null on rows without one; see eval.every_updates)",
    "eval_return_std": "standard deviation of those returns (null likewise)",
    "eval_length_mean": "mean length of those episodes (null likewise)",
}

PBT_FILE = "pbt.jsonl"  # a population-based training sweep's exploits

# Every field of a pbt.jsonl row, with its meaning (docs/sweeps.md documents each).
PBT_FIELDS: dict[str, str] = {
    "update": "the update after which the member exploited (0: the member's starting hyperparameters)",
    "member": "the member that copied",
    "copied_from": "the member whose parameters, optimizer state and normalisation statistics it took",
    "fitness": "the copying member's fitness at the ranking",
    "source_fitness": "the fitness of the member it copied",
    "old": "the copying member's hyperparameters before (the swept keys and pbt.keys)",
    "new": "its hyperparameters after: the copied member's, perturbed or resampled and clipped",
}

# metrics.jsonl fields that are not TensorBoard scalars: `env_steps` is their step.
_NOT_SCALARS = ("member", "update", "env_steps")

# Every field of summary.json, with its meaning.
SUMMARY_FIELDS: dict[str, str] = {
    "env_id": "environment id",
    "total_env_steps": "environment steps done (a whole number of updates)",
    "num_updates": "PPO updates done",
    "num_devices": "devices in the mesh, over all processes",
    "num_shards": "logical data-parallel shards",
    "num_processes": "JAX processes (hosts)",
    "backend": "JAX backend (cpu, gpu, tpu)",
    "jax_version": "JAX version",
    "compile_seconds": "seconds before the first update: compiling the initialisation and the updates and making the "
                       "first state (the evaluations and the checksums compile while the training runs)",
    "train_seconds": "seconds of training, the host loop between chunks included (compile and evaluations excluded)",
    "env_steps_per_second": "total_env_steps / train_seconds",
    "final_episode_return": "mean return of the training episodes that ended in the last chunk of updates",
    "eval_return_mean": "mean return of the final deterministic evaluation",
    "eval_return_std": "standard deviation of those returns",
    "eval_length_mean": "mean length of the evaluation episodes",
    "eval_episodes": "number of evaluation episodes",
    "params_digest": "float64 sum of |p| over all parameters (equal runs give equal digests)",
}


def format_return(value: float, scale: Optional[float] = None) -> str:
    """A return for people: one decimal where `scale` (default: the value itself) is 10 or
    more (CartPole's 500.0), three below (MiniGrid's 0.958, which one decimal shows as 1.0)."""
    return f"{value:.1f}" if abs(value if scale is None else scale) >= 10 else f"{value:.3f}"


def format_mean_std(mean: float, std: float) -> str:
    """'mean +- std', both with the mean's decimals."""
    return f"{format_return(mean)} +- {format_return(std, mean)}"


def json_safe(value: Any) -> Any:
    """Floats that JSON cannot hold (NaN, inf) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_atomically(path: str, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary file renamed over it: a reader never sees
    half of it, and a failed write leaves no temporary file behind."""
    temporary = f"{path}.tmp"
    try:
        with open(temporary, "w" if isinstance(data, str) else "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except OSError:
        if os.path.isfile(temporary):
            os.remove(temporary)
        raise


def write_json(path: str, payload: dict) -> None:
    """Write a JSON file atomically, NaN and infinities as null."""
    write_atomically(path, json.dumps({k: json_safe(v) for k, v in payload.items()}, indent=2) + "\n")


class MetricsSink(Protocol):
    """Where the host loop sends each chunk's metrics rows."""

    def write(self, rows: list[dict]) -> None: ...

    def close(self) -> None: ...


class VideoSink(Protocol):
    """Where the host loop sends the periodic videos (`eval.video_every_updates`): a GIF file of
    member `member` (a sweep's index; None: a single run's, as a metrics row without `member`)."""

    def log_video(self, member: Optional[int], path: str, env_steps: int) -> None: ...


class MetricsWriter:
    """Appends one JSON object per update to metrics.jsonl, flushed after every chunk."""

    def __init__(self, path: str):
        self._handle: TextIO = open(path, "a")

    def write(self, rows: list[dict]) -> None:
        for row in rows:
            self._handle.write(json.dumps({k: json_safe(v) for k, v in row.items()}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def truncate_metrics(path: str, last_update: int) -> int:
    """Keep the rows of metrics.jsonl up to `last_update` (a resumed run rewrites the later ones).

    A torn last line (a kill during a write) is dropped. The file is replaced
    atomically. Returns the last update kept (0 if none).
    """
    kept, last_kept = [], 0
    with open(path) as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if not line.endswith("\n") or row.get("update", last_update + 1) > last_update:
                break
            kept.append(line)
            last_kept = row["update"]
    write_atomically(path, "".join(kept))
    return last_kept


class TensorBoardWriter:
    """Every numeric metrics.jsonl field as a scalar named like the field, at step `env_steps`:
    a run's in `run_dir`, each member's of a sweep in `run_dir`/tensorboard/member-<index>.

    Null fields (no episode ended, no evaluation on that update) are skipped. A periodic video
    goes in as the image `video`, its GIF's bytes as they are (TensorBoard's Images tab plays an
    animated GIF; tensorboardX's `add_video` would need moviepy to encode one).
    """

    def __init__(self, run_dir: str):
        self._run_dir = run_dir
        self._writers: dict[Optional[int], Any] = {}

    def _writer(self, member: Optional[int]) -> Any:
        if member not in self._writers:
            # Imported here: only runs that ask for TensorBoard pay for the import.
            from tensorboardX import SummaryWriter

            member_dir = os.path.join(self._run_dir, "tensorboard", f"member-{member}")
            self._writers[member] = SummaryWriter(logdir=self._run_dir if member is None else member_dir)
        return self._writers[member]

    def write(self, rows: list[dict]) -> None:
        for row in rows:
            writer = self._writer(row.get("member"))
            for name, value in row.items():
                if name not in _NOT_SCALARS and value is not None and math.isfinite(value):
                    writer.add_scalar(name, value, global_step=row["env_steps"])
        for writer in self._writers.values():
            writer.flush()

    def log_video(self, member: Optional[int], path: str, env_steps: int) -> None:
        from PIL import Image
        from tensorboardX.proto.summary_pb2 import Summary

        with open(path, "rb") as handle:
            gif = handle.read()
        with Image.open(path) as image:
            width, height = image.size
        frames = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif)
        writer = self._writer(member)
        writer.file_writer.add_summary(Summary(value=[Summary.Value(tag="video", image=frames)]), env_steps)
        writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


class FanOut:
    """Several sinks behind one: each chunk's rows go to every one of them."""

    def __init__(self, sinks: list[MetricsSink]):
        self._sinks = sinks

    def write(self, rows: list[dict]) -> None:
        for sink in self._sinks:
            sink.write(rows)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def open_metrics_sink(run_dir: str, tensorboard: Optional[TensorBoardWriter]) -> MetricsSink:
    """metrics.jsonl in `run_dir`, and to `tensorboard` if given."""
    jsonl = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"))
    return FanOut([jsonl, tensorboard]) if tensorboard is not None else jsonl


class Progress:
    """A tqdm bar on a terminal; otherwise one plain line at most every `line_interval` seconds."""

    def __init__(self, total_env_steps: int, enabled: bool, stream: TextIO = sys.stderr,
                 line_interval: float = 2.0):
        self._total = total_env_steps
        self._enabled = enabled
        self._stream = stream
        self._interval = line_interval
        self._last_line = -math.inf
        self._bar: Optional[tqdm] = None
        if enabled and stream.isatty():
            self._bar = tqdm(total=total_env_steps, unit="step", unit_scale=True, file=stream, dynamic_ncols=True)

    def update(self, env_steps: int, steps_per_second: float, episode_return: Optional[float]) -> None:
        if not self._enabled:
            return
        shown_return = "n/a" if episode_return is None else format_return(episode_return)
        if self._bar is not None:
            self._bar.update(env_steps - self._bar.n)
            self._bar.set_postfix_str(f"{steps_per_second:,.0f} steps/s, return {shown_return}")
            return
        now = time.monotonic()
        if now - self._last_line >= self._interval or env_steps >= self._total:
            self._last_line = now
            percent = 100.0 * env_steps / self._total
            print(
                f"[{percent:5.1f}%] env steps {env_steps:,}/{self._total:,} | "
                f"{steps_per_second:,.0f} steps/s | episode return {shown_return}",
                file=self._stream, flush=True,
            )

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            print(text, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
