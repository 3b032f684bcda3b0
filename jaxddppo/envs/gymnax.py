"""gymnax environments (the core family: a bare `env.id` such as `CartPole-v1`)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxddppo.config.options import ConfigError
from jaxddppo.envs.base import EnvSpec, observation_spec

UNSUPPORTED = {
    "MNISTBandit-bsuite": "it downloads MNIST when created",
}

# gymnax is imported where it is used: importing it runs JAX computations, which
# would start the XLA backend before `jax.distributed.initialize` can run.


def names() -> list[str]:
    import gymnax

    return [env_id for env_id in gymnax.registered_envs if env_id not in UNSUPPORTED]


def _obs_converter(space: Any) -> Callable[[Any], Any]:
    """Discrete observations one-hot, Box ones float32; any other space's (a Dict, or a user's
    environment without `observation_space`) as they are (`BatchedEnv` casts every leaf)."""
    from gymnax.environments import spaces

    if isinstance(space, spaces.Discrete):
        return lambda obs: jax.nn.one_hot(obs, space.n, dtype=jnp.float32)
    if isinstance(space, spaces.Box):
        return lambda obs: jnp.asarray(obs, jnp.float32)
    return lambda obs: obs


def _observation_space(env: Any, params: Any) -> Any:
    try:
        return env.observation_space(params)
    except NotImplementedError:
        return None


class GymnaxCore:
    """One gymnax environment: its `reset_env` and `step_env` with `params`.

    The time limit is gymnax's own (`is_truncated`, `params.max_steps_in_episode`).
    """

    def __init__(self, env: Any, params: Any, env_id: str):
        from gymnax.environments import spaces

        self.env, self.params = env, params
        self._to_obs = _obs_converter(_observation_space(env, params))
        action_space = env.action_space(params)
        common = {"env_id": env_id, "observation": observation_spec(self.reset),
                  "max_episode_steps": int(getattr(params, "max_steps_in_episode", 0) or 0)}
        if isinstance(action_space, spaces.Discrete):
            self.spec = EnvSpec(discrete=True, num_actions=int(action_space.n), **common)
        elif isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
            low = jnp.broadcast_to(jnp.asarray(action_space.low, jnp.float32), action_space.shape)
            high = jnp.broadcast_to(jnp.asarray(action_space.high, jnp.float32), action_space.shape)
            self.spec = EnvSpec(discrete=False, num_actions=int(action_space.shape[0]),
                                action_low=tuple(float(v) for v in low),
                                action_high=tuple(float(v) for v in high), **common)
        else:
            raise ConfigError(f"env.id={env_id!r}: action space {action_space} is not supported (Discrete, or a "
                              "1-D Box)")

    def reset(self, key: jax.Array) -> tuple[jax.Array, Any]:
        obs, state = self.env.reset_env(key, self.params)
        return self._to_obs(obs), state

    def step(self, key: jax.Array, state: Any, action: jax.Array
             ) -> tuple[jax.Array, Any, jax.Array, jax.Array, jax.Array]:
        obs, state, reward, terminated, _ = self.env.step_env(key, state, action, self.params)
        truncated = self.env.is_truncated(state, self.params)
        return self._to_obs(obs), state, reward, terminated, truncated


def make_core(name: str, env_id: str) -> GymnaxCore:
    import gymnax

    if name in UNSUPPORTED:
        raise ConfigError(f"env.id={env_id!r} is not supported: {UNSUPPORTED[name]}")
    if name not in gymnax.registered_envs:
        raise ConfigError(f"env.id={env_id!r} is not a gymnax environment; valid ids: {', '.join(names())}")
    env, params = gymnax.make(name)
    return GymnaxCore(env, params, env_id)
