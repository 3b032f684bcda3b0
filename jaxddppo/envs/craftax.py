"""craftax adapter (PyPI `craftax` 1.6.1): `craftax:Craftax-Classic-Symbolic-v1` and the other three ids.

One environment, functional, without automatic reset:
  reset(key)               -> (obs, state)   obs: float32 [1345] (Classic-Symbolic), [8268] (Symbolic),
                                             float32 [H, W, 3] in [0, 1] (Pixels)
  step(key, state, action) -> (obs, state, reward f32 [], terminated bool [], truncated bool [])

Uses craftax's NoAutoReset env classes (`make_craftax_env_from_name(name, auto_reset=False)`) and
calls their `reset_env(key, params)` / `step_env(key, state, action, params)` directly; the params
(a flax struct of Python scalars) are held by the core and closed over. The step key IS used
(mob spawning/movement, etc.).

craftax's `done` is `timestep >= max_timesteps | dead | (lava, Classic) | (boss beaten, full)`.
Here terminated = the env's own `is_terminal` evaluated with an unreachable time limit (so the
time-limit clause is off), truncated = `timestep >= max_timesteps` and not terminated.
Time limits (EnvParams.max_timesteps): 10000 (Classic), 100000 (full Craftax).

The env's `info` dict (achievements) is dropped. Weak-typed leaves of the reset state are made
strong so that reset and step states have identical types.

`render(state)` draws what the Pixels observation shows (the player's view, the inventory below
it) with craftax's own pixel renderer, from 16-pixel block textures: 288 x 288 (Classic, doubled)
and 208 x 176 (full Craftax). craftax builds its textures on first use (a minute for Classic,
minutes for full Craftax, once per install: it caches them in its package directory) and says so
on stdout, sent to stderr here so that `evaluate --json` prints JSON alone.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxddppo.config.options import ConfigError
from jaxddppo.envs.base import EnvSpec, enlarged, observation_spec, strongly_typed


_NAMES = (
    "Craftax-Classic-Symbolic-v1",
    "Craftax-Classic-Pixels-v1",
    "Craftax-Symbolic-v1",
    "Craftax-Pixels-v1",
)

_INT32_MAX = 2**31 - 1
_BLOCK_PIXELS = 16  # craftax's textures: 7 or 10 pixels a block (the agent's), 16 and 64


def names() -> list[str]:
    return list(_NAMES)


class CraftaxCore:
    """One craftax environment with its default EnvParams."""

    def __init__(self, name: str, env_id: str):
        if name not in _NAMES:
            raise ConfigError(f"env.id={env_id!r} is not a craftax environment; valid names: {', '.join(_NAMES)}")
        from craftax.craftax_env import make_craftax_env_from_name

        self.name = name
        # Pixels envs load (and on first use build + cache into site-packages) their textures here.
        with contextlib.redirect_stdout(sys.stderr):
            self.env = make_craftax_env_from_name(name, auto_reset=False)
        self.params = params = self.env.default_params
        # Same params, but a time limit no episode reaches: is_terminal then means a true end.
        self._no_limit = params.replace(max_timesteps=_INT32_MAX)
        self.spec = EnvSpec(
            env_id=env_id,
            observation=observation_spec(self.reset),
            discrete=True,
            num_actions=int(self.env.num_actions),
            max_episode_steps=int(params.max_timesteps),
        )
        self._draw: Optional[Callable[[Any], jax.Array]] = None  # compiled by the first `render`

    def reset(self, key: jax.Array) -> tuple[jax.Array, Any]:
        obs, state = self.env.reset_env(key, self.params)
        return obs, strongly_typed(state)

    def step(self, key: jax.Array, state: Any, action: jax.Array
             ) -> tuple[jax.Array, Any, jax.Array, jax.Array, jax.Array]:
        action = jnp.asarray(action, jnp.int32)
        obs, state, reward, _done, _info = self.env.step_env(key, state, action, self.params)
        terminated = jnp.asarray(self.env.is_terminal(state, self._no_limit), jnp.bool_)
        time_up = state.timestep >= self.params.max_timesteps
        truncated = jnp.logical_and(time_up, jnp.logical_not(terminated))
        return obs, state, jnp.asarray(reward, jnp.float32), terminated, truncated

    def render(self, state: Any) -> np.ndarray:
        """The player's view and inventory, drawn by craftax's pixel renderer: [H, W, 3] uint8."""
        if self._draw is None:
            pixels = _pixel_renderer(self.name)
            self._draw = jax.jit(lambda state: jnp.round(jnp.clip(pixels(state), 0, 255)).astype(jnp.uint8))
        return enlarged(np.asarray(self._draw(state)))


def _pixel_renderer(name: str) -> Callable[[Any], jax.Array]:
    """craftax's `render_craftax_pixels` for the variant of `name` (Classic or full): float32 [H, W, 3] in [0, 255]."""
    variant = "craftax_classic" if "Classic" in name else "craftax"
    renderer = importlib.import_module(f"craftax.{variant}.renderer")
    with contextlib.redirect_stdout(sys.stderr):
        return renderer.make_craftax_pixel_renderer(_BLOCK_PIXELS)


def make_core(name: str, env_id: str) -> CraftaxCore:
    return CraftaxCore(name, env_id)
