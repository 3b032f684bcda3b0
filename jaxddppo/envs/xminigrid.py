"""xminigrid adapter (PyPI `xminigrid` 0.9.3): `xminigrid:MiniGrid-Empty-8x8` and the other MiniGrid ports.

One environment, functional, without automatic reset:
  reset(key)               -> (obs, state)   obs: uint8 [view, view, 2] (tile id, colour id), agent-centred
  step(key, state, action) -> (obs, state, reward f32 [], terminated bool [], truncated bool [])

The state is xminigrid's own `TimeStep` (its `step` reads `timestep.state`). The key passed to
`step` is not used: xminigrid's step is deterministic given the state. The time limit is
xminigrid's own `params.max_steps` (set per env by `default_params`); xminigrid marks the step
that reaches it as truncated even when the goal is reached on that step, so truncated here is
`truncated & ~terminated`. The parameters are static (pytree_node=False) and held by the core.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxddppo.config.options import ConfigError
from jaxddppo.envs.base import EnvSpec, observation_spec


# XLand-MiniGrid-* ids need a ruleset (goal + rules) taken from a benchmark, which
# `xminigrid.load_benchmark` downloads from Hugging Face; with the default empty ruleset
# the goal (EmptyGoal) never triggers, so every reward is 0 and no episode terminates.
_XLAND_REASON = ("it needs a ruleset from an xminigrid benchmark (downloaded from Hugging Face); "
                 "with the default empty ruleset no reward is ever given")


def _registered() -> tuple[str, ...]:
    import xminigrid

    return tuple(xminigrid.registered_environments())


def names() -> list[str]:
    return [name for name in _registered() if not name.startswith("XLand-MiniGrid")]


class XMiniGridCore:
    """One xminigrid environment with its default parameters (`xminigrid.make(name)`)."""

    def __init__(self, name: str, env_id: str):
        import xminigrid

        registered = _registered()
        if name.startswith("XLand-MiniGrid") and name in registered:
            raise ConfigError(f"env.id={env_id!r} is not supported: {_XLAND_REASON}")
        if name not in registered:
            raise ConfigError(f"env.id={env_id!r} is not an xminigrid environment; valid names: {', '.join(names())}")
        self.env, self.params = xminigrid.make(name)
        if self.params.max_steps is None:
            raise ConfigError(f"env.id={env_id!r}: xminigrid gave no max_steps")
        self.spec = EnvSpec(
            env_id=env_id,
            observation=observation_spec(self.reset),
            discrete=True,
            num_actions=int(self.env.num_actions(self.params)),
            max_episode_steps=int(self.params.max_steps),
        )

    def reset(self, key: jax.Array) -> tuple[jax.Array, Any]:
        timestep = self.env.reset(self.params, key)
        return timestep.observation, timestep

    def step(self, key: jax.Array, state: Any, action: jax.Array
             ) -> tuple[jax.Array, Any, jax.Array, jax.Array, jax.Array]:
        del key  # the step is deterministic given the state
        timestep = self.env.step(self.params, state, jnp.asarray(action, jnp.int32))
        last = timestep.step_type == 2  # xminigrid.types.StepType.LAST
        # discount is 0 exactly when the goal (or a Memory door) was reached; the comparison of
        # xminigrid's weakly typed discount is a weak bool, hence the astype
        terminated = (timestep.discount == 0.0).astype(jnp.bool_)
        truncated = jnp.logical_and(last, jnp.logical_not(terminated))
        reward = jnp.asarray(timestep.reward, jnp.float32)
        return timestep.observation, timestep, reward, terminated, truncated

    def render(self, state: Any) -> np.ndarray:
        """The whole grid with the agent, drawn by xminigrid's RGB renderer: [H, W, 3] uint8."""
        return np.asarray(self.env.render(self.params.replace(render_mode="rgb_array"), state), np.uint8)


def make_core(name: str, env_id: str) -> XMiniGridCore:
    return XMiniGridCore(name, env_id)
