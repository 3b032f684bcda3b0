"""Environments behind one small protocol: batched gymnax envs with auto-reset.

`make_env(env_id)` returns a `BatchedEnv` whose `reset`/`step` work on a batch
of environments (vmapped, jittable). Each step reports `terminated` (a true end:
no bootstrap) apart from `truncated` (a time limit: bootstrap the value from
`final_obs`, the observation before the automatic reset), and the return and
length of every episode that ended on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxddppo.config import ConfigError

UNSUPPORTED_ENVS = {
    "MNISTBandit-bsuite": "it downloads MNIST when created",
}


@dataclass(frozen=True)
class EnvSpec:
    """What the network and the trainer need to know about an environment."""

    env_id: str
    obs_shape: tuple[int, ...]
    discrete: bool
    num_actions: int  # categories for discrete actions, dimensions for continuous ones
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()
    max_episode_steps: int = 0


@struct.dataclass
class EpisodeState:
    env_state: Any
    episode_return: jax.Array  # [B] return so far of the running episode
    episode_length: jax.Array  # [B]


@struct.dataclass
class StepResult:
    obs: jax.Array  # [B, *obs_shape] observation to act on next (after auto-reset)
    reward: jax.Array  # [B]
    terminated: jax.Array  # [B] bool
    truncated: jax.Array  # [B] bool, time limit and not terminated
    final_obs: jax.Array  # [B, *obs_shape] observation the step reached, before any reset
    episode_return: jax.Array  # [B] return of the episode that ended here (0 where none did)
    episode_length: jax.Array  # [B]


# gymnax is imported where it is used: importing it runs JAX computations, which
# would start the XLA backend before `jax.distributed.initialize` can run.


def available_env_ids() -> list[str]:
    import gymnax

    return [env_id for env_id in gymnax.registered_envs if env_id not in UNSUPPORTED_ENVS]


def _obs_converter(space: Any) -> tuple[Callable[[Any], jax.Array], tuple[int, ...]]:
    from gymnax.environments import spaces

    if isinstance(space, spaces.Discrete):
        return (lambda obs: jax.nn.one_hot(obs, space.n, dtype=jnp.float32)), (int(space.n),)
    if isinstance(space, spaces.Box):
        return (lambda obs: jnp.asarray(obs, jnp.float32)), tuple(int(d) for d in space.shape)
    raise ConfigError(f"observation space {type(space).__name__} is not supported (Box or Discrete only)")


class BatchedEnv:
    """A batch of one gymnax environment, auto-resetting, with episode statistics."""

    def __init__(self, env_id: str):
        import gymnax
        from gymnax.environments import spaces

        if env_id in UNSUPPORTED_ENVS:
            raise ConfigError(f"env.id={env_id!r} is not supported: {UNSUPPORTED_ENVS[env_id]}")
        if env_id not in gymnax.registered_envs:
            raise ConfigError(
                f"env.id={env_id!r} is not a gymnax environment; valid ids: {', '.join(available_env_ids())}"
            )
        self._env, self._params = gymnax.make(env_id)
        self._to_obs, obs_shape = _obs_converter(self._env.observation_space(self._params))
        action_space = self._env.action_space(self._params)
        max_steps = int(self._params.max_steps_in_episode)
        if isinstance(action_space, spaces.Discrete):
            self.spec = EnvSpec(env_id, obs_shape, True, int(action_space.n), max_episode_steps=max_steps)
            self._low = self._high = None
        elif isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
            low = jnp.broadcast_to(jnp.asarray(action_space.low, jnp.float32), action_space.shape)
            high = jnp.broadcast_to(jnp.asarray(action_space.high, jnp.float32), action_space.shape)
            self.spec = EnvSpec(
                env_id, obs_shape, False, int(action_space.shape[0]),
                tuple(float(v) for v in low), tuple(float(v) for v in high), max_steps,
            )
            self._low, self._high = low, high
        else:
            raise ConfigError(f"env.id={env_id!r}: action space {action_space} is not supported")

    def reset(self, key: jax.Array, num_envs: int) -> tuple[jax.Array, EpisodeState]:
        keys = jax.random.split(key, num_envs)
        obs, env_state = jax.vmap(self._env.reset, in_axes=(0, None))(keys, self._params)
        zeros = jnp.zeros((num_envs,), jnp.float32)
        state = EpisodeState(env_state, zeros, jnp.zeros((num_envs,), jnp.int32))
        return self._to_obs(obs), state

    def _env_action(self, action: jax.Array) -> jax.Array:
        if self.spec.discrete:
            return action
        return jnp.clip(action, self._low, self._high)

    def step(self, key: jax.Array, state: EpisodeState, action: jax.Array) -> tuple[EpisodeState, StepResult]:
        """Step every environment once; `key` is split into one key per environment."""
        return self.step_with_keys(jax.random.split(key, action.shape[0]), state, action)

    def step_with_keys(self, keys: jax.Array, state: EpisodeState,
                       action: jax.Array) -> tuple[EpisodeState, StepResult]:
        """`step` with the per-environment keys [B] given (a rollout splits them for all its steps at once)."""
        obs, env_state, reward, terminated, truncated, info = jax.vmap(
            self._env.step, in_axes=(0, 0, 0, None)
        )(keys, state.env_state, self._env_action(action), self._params)
        reward = jnp.asarray(reward, jnp.float32)
        terminated = jnp.asarray(terminated, bool)
        truncated = jnp.logical_and(jnp.asarray(truncated, bool), jnp.logical_not(terminated))
        done = jnp.logical_or(terminated, truncated)
        episode_return = state.episode_return + reward
        episode_length = state.episode_length + 1
        result = StepResult(
            obs=self._to_obs(obs),
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            final_obs=self._to_obs(info["final_observation"]),
            episode_return=jnp.where(done, episode_return, 0.0),
            episode_length=jnp.where(done, episode_length, 0),
        )
        new_state = EpisodeState(
            env_state,
            jnp.where(done, 0.0, episode_return),
            jnp.where(done, 0, episode_length),
        )
        return new_state, result


def make_env(env_id: str) -> BatchedEnv:
    """The batched environment for `env_id`, or ConfigError naming the valid ids."""
    return BatchedEnv(env_id)
