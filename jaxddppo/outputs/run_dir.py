"""The run directory: claimed by one run only, its path agreed by every process, and its
config.yaml and env_spec.json.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from typing import Optional

import jax

from jaxddppo.config.files import to_yaml
from jaxddppo.config.options import Config, ConfigError
from jaxddppo.distributed import multiprocess
from jaxddppo.outputs.env_spec import ENV_SPEC_FILE
from jaxddppo.outputs.writers import write_atomically


def claim_run_dir(path: Optional[str], name: str) -> str:
    """Create the run directory and claim it by creating metrics.jsonl exclusively.

    An explicit `run.dir` that already holds a run is refused (nothing is
    overwritten, even by two runs started together); the default
    `runs/<name>-<timestamp>` takes a numbered suffix instead.
    """
    explicit = path is not None
    name = name.replace("<", "").replace(">", "")  # an object's `<object>:NAME` (references.py)
    base = path if explicit else os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    candidate, attempt = base, 1
    while True:
        if os.path.exists(candidate) and not os.path.isdir(candidate):
            raise ConfigError(f"run.dir={candidate!r} exists and is not a directory")
        try:
            os.makedirs(candidate, exist_ok=True)
            open(os.path.join(candidate, "metrics.jsonl"), "x").close()
            return candidate
        except FileExistsError:
            if explicit:
                raise ConfigError(
                    f"run.dir={candidate!r} already holds a run (metrics.jsonl); choose another run.dir, "
                    f"or continue it with --resume {candidate}"
                ) from None
            attempt += 1
            candidate = f"{base}-{attempt}"
        except OSError as error:
            raise ConfigError(f"run.dir={candidate!r} cannot be created: {error.strerror}") from None


def shared_run_dir(config: Config, name: str) -> str:
    """Process 0 claims the run directory; every process learns its path (checkpoints need it)."""
    if jax.process_index() != 0:
        run_dir = multiprocess.broadcast_text("")
        if not run_dir:
            raise multiprocess.DistributedError("process 0 could not create the run directory; see its error")
        return run_dir
    try:
        run_dir = claim_run_dir(config.run.dir, name)
    except ConfigError:
        multiprocess.broadcast_text("")
        raise
    return multiprocess.broadcast_text(run_dir)


def write_config(run_dir: str, config: Config) -> None:
    recorded = replace(config, run=replace(config.run, dir=run_dir))
    write_atomically(os.path.join(run_dir, "config.yaml"), to_yaml(recorded))


def write_env_spec(run_dir: str, record: dict) -> None:
    """Write env_spec.json, an `env_spec.env_spec_record`."""
    write_atomically(os.path.join(run_dir, ENV_SPEC_FILE), json.dumps(record, indent=2) + "\n")
