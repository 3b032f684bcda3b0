"""gymnax 1.0 environments for peers written against gymnax's older step API.

gymnax 1.0's `step` returns (obs, state, reward, terminated, truncated, info);
rejax 0.1.3 and PureJaxRL unpack (obs, state, reward, done, info). `make` wraps
an environment to step the older way, done = terminated or truncated, its
`info` without gymnax 1.0's `final_observation` (PureJaxRL keeps every step's
`info` in its metrics: at 1e7 steps on SpaceInvaders-MinAtar, 24 GB of final
observations, beyond this 24 GB host), and `prepare_purejaxrl` makes PureJaxRL
use it. Imported only by benchmarks/peers.py, in a peer's own process.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import gymnax
import gymnax.registration
import jax.numpy as jnp


class FiveValueStep:
    """A gymnax 1.0 environment whose `step` returns (obs, state, reward, done, info), its
    info as gymnax's older step gave it: without the final observation."""

    def __init__(self, env: Any):
        self.env = env

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.env, name)

    def step(self, key: Any, state: Any, action: Any, params: Any = None) -> tuple:
        obs, state, reward, terminated, truncated, info = self.env.step(key, state, action, params)
        info = {name: value for name, value in info.items() if name != "final_observation"}
        return obs, state, reward, jnp.logical_or(terminated, truncated), info


def make(env_id: str) -> tuple[FiveValueStep, Any]:
    """`gymnax.make(env_id)`, its environment stepping the five-value way."""
    env, env_params = gymnax.registration.make(env_id)
    return FiveValueStep(env), env_params


def _unavailable(*args: Any, **kwargs: Any) -> Any:
    raise ImportError("a stand-in from benchmarks/gymnax_shim.py: install the simulator to use it")


def _stand_in(name: str, **attributes: Any) -> types.ModuleType:
    """An empty module imported as `name`, holding `attributes`."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def prepare_purejaxrl() -> None:
    """Let PureJaxRL's unmodified ppo.py run on gymnax 1.0 in this process: its `gymnax.make`
    becomes `make` above, and brax and navix, which its wrappers.py imports for other
    environments but PPO on gymnax never uses, become stand-ins where they are not installed."""
    gymnax.make = make
    if importlib.util.find_spec("brax") is None:
        training = _stand_in("brax.envs.wrappers.training", EpisodeWrapper=_unavailable,
                             AutoResetWrapper=_unavailable)
        envs = _stand_in("brax.envs", wrappers=_stand_in("brax.envs.wrappers", training=training))
        _stand_in("brax", envs=envs)
    if importlib.util.find_spec("navix") is None:
        _stand_in("navix")
