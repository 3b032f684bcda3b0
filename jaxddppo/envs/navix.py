"""navix adapter (extra `navix`): `navix:Navix-Empty-5x5-v0` and the other registered ids.

The extra installs navix 0.7 on Python 3.11 and navix 4 (which needs 3.12) on newer Pythons;
both have the calls below.

The environment is `navix.make(name)` with its default time limit (`max_steps`, 100 for every
id) and its default observation, the fully observed symbolic grid (entity tag, colour, state)
uint8 [H, W, 3], flattened to float32 [H * W * 3] for the MLP.

navix's `Environment.step` auto-resets (a `lax.cond` on the previous step type); the core calls
the non-resetting `Environment._step` instead. The step takes no key: randomness (dynamic
obstacles) comes from `state.key`, which the core sets to the step key. Step types: 1 truncation
(t >= max_steps), 2 termination (which wins when both happen). The state's rendering cache
(background tiles, read only by the RGB observations) is replaced by an empty array, so that
the rollout does not carry it.

`render(state)` draws the whole grid with navix's RGB observation (`observations.rgb`, the same
call in 0.7 and 4) over a background rebuilt from the state's grid: 8 pixels a cell, each pixel
repeated to about 320 pixels on the longer side (Empty-5x5: 320 x 320).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxddppo.config.options import ConfigError
from jaxddppo.envs.base import EnvSpec, enlarged, observation_spec

_TRUNCATION, _TERMINATION = 1, 2


def names() -> list[str]:
    import navix

    return sorted(navix.registry().keys())


class NavixCore:
    """One navix environment; the state is (step count int32 [], navix State)."""

    def __init__(self, name: str, env_id: str):
        import navix

        if name not in navix.registry():
            raise ConfigError(f"env.id={env_id!r} is not a navix environment; valid names: {', '.join(names())}")
        self.env = navix.make(name)
        self.spec = EnvSpec(env_id=env_id, observation=observation_spec(self.reset), discrete=True,
                            num_actions=int(self.env.action_space.n), max_episode_steps=int(self.env.max_steps))

    @staticmethod
    def _slim(state: Any) -> Any:
        return state.replace(cache=state.cache.replace(patches=jnp.zeros((0,), jnp.uint8)))

    def reset(self, key: jax.Array) -> tuple[jax.Array, Any]:
        timestep = self.env.reset(key)
        step_count = jnp.asarray(timestep.t, jnp.int32)
        return timestep.observation.reshape(-1), (step_count, self._slim(timestep.state))

    def step(self, key: jax.Array, state: Any, action: jax.Array
             ) -> tuple[jax.Array, Any, jax.Array, jax.Array, jax.Array]:
        from navix.environments.environment import Timestep

        step_count, navix_state = state
        action = jnp.asarray(action, jnp.int32)
        previous = Timestep(t=step_count, observation=jnp.zeros((), jnp.uint8), action=action,
                            reward=jnp.zeros((), jnp.float32), step_type=jnp.zeros((), jnp.int32),
                            state=navix_state.replace(key=key))
        timestep = self.env._step(previous, action)
        new_state = (jnp.asarray(timestep.t, jnp.int32), self._slim(timestep.state))
        return (timestep.observation.reshape(-1), new_state, jnp.asarray(timestep.reward, jnp.float32),
                timestep.step_type == _TERMINATION, timestep.step_type == _TRUNCATION)

    def render(self, state: Any) -> np.ndarray:
        """The whole grid with its entities, drawn by navix's RGB observation: [H, W, 3] uint8."""
        return enlarged(np.asarray(_draw_grid(state[1])))


@jax.jit
def _draw_grid(navix_state: Any) -> jax.Array:
    from navix.observations import rgb
    from navix.rendering.cache import RenderingCache

    return rgb(navix_state.replace(cache=RenderingCache.init(navix_state.grid)))


def make_core(name: str, env_id: str) -> NavixCore:
    return NavixCore(name, env_id)
