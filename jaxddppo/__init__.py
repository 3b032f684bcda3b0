"""jaxddppo: decentralized distributed PPO in JAX.

Python API: `jaxddppo.train(config) -> TrainResult` and
`jaxddppo.sweep(config, grid, seeds) -> SweepResult`, where `config` is a
`Config`, a nested dict or a YAML path; build configs with `load_config`,
`from_dict` and `with_overrides`; `jaxddppo.load_policy(run_dir)` loads a trained
policy from a run's checkpoint. `train` and `sweep` are modules too (`python -m
jaxddppo.train`, `python -m jaxddppo.sweep`): they are imported on first use,
and calling the module runs it.
"""

import importlib
from typing import Any

from jaxddppo.config import Config, ConfigError, from_dict, load_config, with_overrides

__version__ = "0.1.0"
__all__ = [
    "Config", "ConfigError", "from_dict", "load_config", "with_overrides", "train", "sweep", "load_policy",
]

_CALLABLE_MODULES = ("train", "sweep")


def __getattr__(name: str) -> Any:
    # Imported lazily: importing them here would make `python -m jaxddppo.train` warn (runpy).
    if name in _CALLABLE_MODULES:
        return importlib.import_module(f"jaxddppo.{name}")
    if name == "load_policy":
        return importlib.import_module("jaxddppo.policy").load_policy
    raise AttributeError(f"module 'jaxddppo' has no attribute {name!r}")
