"""env_spec.json: the environment's `EnvSpec` beside config.yaml, so that a trained policy's
network is rebuilt without building the environment (`load_policy`).

Observation leaves are recorded as `dtype[shape]` ("float32[5, 5, 3]"), in dicts (JSON
objects) and tuples (JSON arrays) as the environment gives them. An observation in other
containers (a user's dataclass) is not recorded: its run has no env_spec.json, and loading
its policy builds the environment.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import fields
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxddppo.config.options import ConfigError
from jaxddppo.envs import EnvSpec

ENV_SPEC_FILE = "env_spec.json"

_LEAF = re.compile(r"(\w+)\[([0-9, ]*)\]")


def _observation_record(tree: Any) -> Any:
    """The JSON form of an observation spec; None where it holds other containers than
    dicts with string keys and tuples."""
    if isinstance(tree, jax.ShapeDtypeStruct):
        return f"{tree.dtype}[{', '.join(str(size) for size in tree.shape)}]"
    if type(tree) is dict and all(isinstance(key, str) for key in tree):
        entries = {key: _observation_record(value) for key, value in tree.items()}
        return None if None in entries.values() else entries
    if type(tree) is tuple:
        items = [_observation_record(value) for value in tree]
        return None if None in items else items
    return None


def env_spec_record(spec: EnvSpec) -> Optional[dict]:
    """`spec` as env_spec.json holds it; None for an observation it cannot hold."""
    record = {field.name: getattr(spec, field.name) for field in fields(spec)}
    record.update(observation=_observation_record(spec.observation), discrete=bool(spec.discrete),
                  num_actions=int(spec.num_actions), max_episode_steps=int(spec.max_episode_steps),
                  action_low=[float(bound) for bound in spec.action_low],
                  action_high=[float(bound) for bound in spec.action_high])
    return None if record["observation"] is None else record


def _observation_of(record: Any) -> Any:
    if isinstance(record, dict):
        return {key: _observation_of(value) for key, value in record.items()}
    if isinstance(record, list):
        return tuple(_observation_of(value) for value in record)
    leaf = _LEAF.fullmatch(record)
    if leaf is None:
        raise ValueError(f"observation leaf {record!r} is not dtype[shape]")
    dtype, shape = leaf.groups()
    return jax.ShapeDtypeStruct(tuple(int(size) for size in shape.split(",") if size.strip()), jnp.dtype(dtype))


def read_env_spec(run_dir: str) -> Optional[EnvSpec]:
    """The spec of the environment `run_dir` trained on, or None if the run recorded none;
    ConfigError (one line) for a malformed file."""
    path = os.path.join(run_dir, ENV_SPEC_FILE)
    try:
        with open(path) as handle:
            record = json.load(handle)
        return EnvSpec(**{**record, "observation": _observation_of(record["observation"]),
                          "action_low": tuple(record["action_low"]), "action_high": tuple(record["action_high"])})
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{path} is malformed: {type(error).__name__}: {error}") from None
