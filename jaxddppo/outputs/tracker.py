"""Weights & Biases (`wandb.mode`): a MetricsSink that logs every metrics.jsonl row to a W&B run
against `env_steps` (one W&B run per member of a sweep, in one group), with the resolved config
at the start and the summary at the end.

Every W&B call runs on a thread of the tracker's own, in order, so that W&B never holds up
training: not `wandb.init`, which waits up to `INIT_TIMEOUT_SECONDS` for a server that cannot be
reached, nor a slow upload. The first call that fails prints one warning line and switches the
tracker off; metrics.jsonl stays the record.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import secrets
import threading
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from jaxddppo.config.options import ConfigError, WandbConfig
from jaxddppo.outputs.writers import json_safe, write_json

RUN_IDS_FILE = "wandb_runs.json"  # in the run directory: the W&B run ids a resume continues
INIT_TIMEOUT_SECONDS = 60.0  # wandb.init gives up on an unreachable server after this long
FINISH_TIMEOUT_SECONDS = 120.0  # a run's last upload at the end may take this long (W&B then marks it crashed)
# How long the end of a run waits for the tracker's thread (starting, logging, finishing).
CLOSE_TIMEOUT_SECONDS = INIT_TIMEOUT_SECONDS + FINISH_TIMEOUT_SECONDS + 60.0


def check_available(settings: WandbConfig) -> None:
    """Refuse a tracker whose package is missing, before anything is compiled or written."""
    if settings.mode != "off" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"wandb.mode={settings.mode} needs the wandb package: pip install 'jaxddppo[wandb]'")


@dataclass(frozen=True)
class TrackedRun:
    """One W&B run: its display name and its config (a member's: its own hyperparameters and index)."""

    name: str
    config: dict


def run_ids(run_dir: str, count: int) -> list[str]:
    """The W&B run ids of the run directory's `count` runs: those an earlier start kept (so that a
    resume continues the same W&B runs), else new ones, kept for the next resume."""
    path = os.path.join(run_dir, RUN_IDS_FILE)
    if os.path.exists(path):
        with open(path) as handle:
            ids = json.load(handle)["ids"]
        if len(ids) == count:
            return ids
    ids = [secrets.token_hex(6) for _ in range(count)]
    write_json(path, {"ids": ids})
    return ids


def history_row(row: dict) -> dict:
    """A metrics.jsonl row as W&B history: its fields but the member (the W&B run says whose),
    without null ones (no episode ended, no evaluation), as metrics.jsonl holds them."""
    safe = {name: json_safe(value) for name, value in row.items() if name != "member"}
    return {name: value for name, value in safe.items() if value is not None}


class WandbTracker:
    """Every metrics row to the W&B run of its member, from a thread of its own.

    `write` and `log_summaries` only queue their work; `close` finishes the W&B runs and waits for
    the thread at most CLOSE_TIMEOUT_SECONDS. `message` prints one line (a warning, where the
    runs are).
    """

    def __init__(self, settings: WandbConfig, run_dir: str, runs: Sequence[TrackedRun], group: Optional[str],
                 message: Callable[[str], None]):
        self._message = message
        self._runs: list[Any] = []
        self._failed = False
        self._tasks: queue.SimpleQueue[Optional[Callable[[], None]]] = queue.SimpleQueue()
        ids = run_ids(run_dir, len(runs))
        self._tasks.put(lambda: self._start(settings, run_dir, runs, ids, group))
        self._thread = threading.Thread(target=self._work, name="jaxddppo-wandb", daemon=True)
        self._thread.start()

    def write(self, rows: list[dict]) -> None:
        self._tasks.put(lambda: self._log(rows))

    def log_video(self, member: Optional[int], path: str, env_steps: int) -> None:
        """A video file (`eval.video_every_updates`) into the member's W&B run (None: the run's
        only one), as `video` at `env_steps`."""
        self._tasks.put(lambda: self._log_video(member, path, env_steps))

    def log_summaries(self, summaries: Sequence[dict]) -> None:
        """Each run's summary fields (summary.json's, or a member's row of sweep.csv), once at the end."""
        self._tasks.put(lambda: self._log_summaries(summaries))

    def close(self) -> None:
        self._tasks.put(self._finish)
        self._tasks.put(None)
        self._thread.join(CLOSE_TIMEOUT_SECONDS)
        if self._thread.is_alive():
            self._message(f"warning: W&B still busy after {CLOSE_TIMEOUT_SECONDS:.0f} s; left behind (its files "
                          "are in the run directory's wandb/, for wandb sync)")

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            if self._failed:
                continue
            try:
                task()
            except Exception as error:  # whatever W&B raises, training goes on without it
                self._failed = True
                detail = (str(error).splitlines() or [""])[0][:200]
                self._message(f"warning: W&B logging stopped ({type(error).__name__}: {detail}); "
                              "metrics.jsonl keeps the record")
                for run in self._runs:
                    with suppress(Exception):
                        run.finish(exit_code=1)

    def _start(self, settings: WandbConfig, run_dir: str, runs: Sequence[TrackedRun], ids: Sequence[str],
               group: Optional[str]) -> None:
        import wandb  # only a run that asks for W&B pays for the import

        options = wandb.Settings(console="off", silent=True, init_timeout=INIT_TIMEOUT_SECONDS,
                                 finish_timeout=FINISH_TIMEOUT_SECONDS)
        for run, run_id in zip(runs, ids):
            tracked = wandb.init(mode=settings.mode, project=settings.project, entity=settings.entity, group=group,
                                 tags=list(settings.tags), name=run.name, id=run_id, resume="allow", dir=run_dir,
                                 config=run.config, reinit="create_new", settings=options)
            tracked.define_metric("*", step_metric="env_steps")
            self._runs.append(tracked)
        where = self._runs[0].url if settings.mode == "online" else f"{run_dir}/wandb (upload with wandb sync)"
        others = f" and {len(runs) - 1} more in group {group}" if len(runs) > 1 else ""
        self._message(f"W&B {settings.mode}: {where}{others}")

    def _log(self, rows: list[dict]) -> None:
        for row in rows:
            self._runs[row.get("member", 0)].log(history_row(row))

    def _log_video(self, member: Optional[int], path: str, env_steps: int) -> None:
        import wandb

        self._runs[0 if member is None else member].log({"env_steps": env_steps, "video": wandb.Video(path)})

    def _log_summaries(self, summaries: Sequence[dict]) -> None:
        for run, summary in zip(self._runs, summaries):
            run.summary.update({name: json_safe(value) for name, value in summary.items()})

    def _finish(self) -> None:
        for run in self._runs:
            run.finish()
