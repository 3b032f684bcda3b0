"""jaxddppo: decentralized distributed PPO in JAX.

Python API: `jaxddppo.run(config) -> TrainResult` trains one run and
`jaxddppo.run_sweep(config, grid, seeds) -> SweepResult` a population of
seeds x hyperparameters, where `config` is a `Config`, a nested dict or a YAML
path; build configs with `load_config`, `from_dict` and `with_overrides`;
`jaxddppo.load_policy(run_dir)` loads a trained policy from a run's checkpoint and
`jaxddppo.export_policy(run_dir, output)` writes it as a `jax.export` program. Each
takes `env=` and `torso=`: your own environment and torso as objects, in place of
`env.id=module:attribute` and `network.torso=module:attribute`.
The commands are `python -m jaxddppo.train` and `python -m jaxddppo.sweep`.
"""

import importlib
from typing import Any

from jaxddppo.config.files import from_dict, load_config, with_overrides
from jaxddppo.config.options import Config, ConfigError

__version__ = "0.1.0"
__all__ = [
    "Config", "ConfigError", "from_dict", "load_config", "with_overrides", "run", "run_sweep", "load_policy",
]

# Imported on first use: importing jaxddppo.train here would make `python -m jaxddppo.train`
# warn (runpy), and JAX need not start for a config to be built.
_LAZY_FUNCTIONS = {"run": "jaxddppo.train", "run_sweep": "jaxddppo.sweep", "load_policy": "jaxddppo.outputs.policy"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_FUNCTIONS:
        return getattr(importlib.import_module(_LAZY_FUNCTIONS[name]), name)
    raise AttributeError(f"module 'jaxddppo' has no attribute {name!r}")
