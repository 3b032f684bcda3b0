"""The environment protocol, and the one batched, auto-resetting environment built on it.

A family adapter implements `EnvCore`: one environment, functional, jittable,
*without* automatic reset. `BatchedEnv` vmaps a core over a batch, resets the
environments whose episode ended (each its own reset, or optimistic resets: a few
fresh states per step shared among the environments that finished) and keeps the
episode statistics. The rollout and evaluation see only `BatchedEnv`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from jaxddppo.config import ConfigError


@dataclass(frozen=True)
class EnvSpec:
    """What the network and the trainer need to know about an environment."""

    env_id: str
    # One environment's observation (no batch axis): a pytree of jax.ShapeDtypeStruct,
    # one array or a dict of them. Leaves are float32, except a bool action mask.
    observation: Any
    discrete: bool
    num_actions: int  # categories for discrete actions, dimensions for continuous ones
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()
    # The time limit: evaluation steps at most this many times. 0: none known (jumanji:Game2048-v1,
    # whose episodes still end), evaluation then runs until every episode has ended.
    max_episode_steps: int = 0
    # Legal-action masks: the observation is a dict and observation[action_mask_key] is bool [num_actions].
    action_mask_key: Optional[str] = None

    @property
    def obs_shape(self) -> tuple[int, ...]:
        """The shape of a single-array observation."""
        if not isinstance(self.observation, jax.ShapeDtypeStruct):
            raise TypeError(f"{self.env_id} observes a pytree, not one array: use spec.observation")
        return tuple(self.observation.shape)


class EnvCore(Protocol):
    """One environment of a family, without automatic reset (what an adapter implements).

    `reset(key) -> (observation, state)`; `step(key, state, action) -> (observation,
    state, reward [] float32, terminated [] bool, truncated [] bool)`: `terminated` is a
    true end (no bootstrap), `truncated` a time limit reached by an episode that did
    not terminate. Both are jittable and vmappable; the state is any pytree.
    Observation leaves are cast to float32 by `BatchedEnv` (bool leaves stay bool).
    """

    spec: EnvSpec

    def reset(self, key: jax.Array) -> tuple[Any, Any]: ...

    def step(self, key: jax.Array, state: Any, action: jax.Array
             ) -> tuple[Any, Any, jax.Array, jax.Array, jax.Array]: ...


@struct.dataclass
class EpisodeState:
    env_state: Any
    episode_return: jax.Array  # [B] return so far of the running episode
    episode_length: jax.Array  # [B]


@struct.dataclass
class StepResult:
    obs: Any  # [B, ...] observation to act on next (after auto-reset)
    reward: jax.Array  # [B]
    terminated: jax.Array  # [B] bool
    truncated: jax.Array  # [B] bool, time limit and not terminated
    final_obs: Any  # [B, ...] observation the step reached, before any reset
    episode_return: jax.Array  # [B] return of the episode that ended here (0 where none did)
    episode_length: jax.Array  # [B]


def float_observation(obs: Any) -> Any:
    """Every observation leaf as float32, except bool leaves (action masks)."""
    return jax.tree.map(lambda leaf: leaf if leaf.dtype == jnp.bool_ else jnp.asarray(leaf, jnp.float32), obs)


def batch_size(obs: Any) -> int:
    """The number of observations in a batch (a pytree): the leading axis of its leaves."""
    return jax.tree.leaves(obs)[0].shape[0]


def observation_spec(core_reset: Any) -> Any:
    """The `EnvSpec.observation` of a core's `reset`, from its abstract evaluation."""
    obs, _ = jax.eval_shape(lambda: core_reset(jax.random.key(0)))
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.bool_ if leaf.dtype == jnp.bool_ else jnp.float32), obs
    )


def random_actions(spec: EnvSpec, key: jax.Array, obs: Any) -> jax.Array:
    """Uniformly random legal actions for a batch of observations `obs` (masked ones never drawn)."""
    num_envs = batch_size(obs)
    if not spec.discrete:
        low, high = jnp.asarray(spec.action_low), jnp.asarray(spec.action_high)
        return jax.random.uniform(key, (num_envs, spec.num_actions), minval=low, maxval=high)
    if spec.action_mask_key is None:
        return jax.random.randint(key, (num_envs,), 0, spec.num_actions)
    return jax.random.categorical(key, jnp.where(obs[spec.action_mask_key], 0.0, -jnp.inf))


def _select(done: jax.Array, on_done: Any, otherwise: Any) -> Any:
    """Leaf by leaf, `on_done` where `done` [B] holds, else `otherwise` (leaves [B, ...])."""

    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.where(done.reshape(done.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(pick, on_done, otherwise)


class BatchedEnv:
    """A batch of one environment, auto-resetting, with episode statistics.

    Every environment has two keys per step: the first steps it, the second resets it
    if its episode ended. With `optimistic_reset_ratio` r > 1, a step computes only
    B / r fresh states (from the reset keys of the first B / r environments) and gives
    the k-th environment that finished on it fresh state k mod (B / r): worth it when a
    reset costs far more than a step (Craftax's world generation), at the price of
    environments that finish together sometimes starting from the same state.
    """

    def __init__(self, core: EnvCore, optimistic_reset_ratio: int = 1):
        if optimistic_reset_ratio < 1:
            raise ConfigError(f"env.optimistic_reset_ratio={optimistic_reset_ratio} must be at least 1")
        self.core = core
        self.spec = core.spec
        self.optimistic_reset_ratio = optimistic_reset_ratio

    def reset(self, key: jax.Array, num_envs: int) -> tuple[Any, EpisodeState]:
        obs, env_state = jax.vmap(self.core.reset)(jax.random.split(key, num_envs))
        zeros = jnp.zeros((num_envs,), jnp.float32)
        return float_observation(obs), EpisodeState(env_state, zeros, jnp.zeros((num_envs,), jnp.int32))

    def _env_action(self, action: jax.Array) -> jax.Array:
        if self.spec.discrete:
            return action
        low = jnp.asarray(self.spec.action_low, jnp.float32)
        high = jnp.asarray(self.spec.action_high, jnp.float32)
        return jnp.clip(action, low, high)

    def _fresh_states(self, reset_keys: jax.Array, done: jax.Array) -> tuple[Any, Any]:
        """(observations, states) [B, ...] that the environments where `done` restart from."""
        num_envs = done.shape[0]
        if self.optimistic_reset_ratio == 1:
            return jax.vmap(self.core.reset)(reset_keys)
        num_resets = max(1, num_envs // self.optimistic_reset_ratio)
        obs, states = jax.vmap(self.core.reset)(reset_keys[:num_resets])
        slot = (jnp.cumsum(done) - 1) % num_resets
        return jax.tree.map(lambda leaf: leaf[slot], (obs, states))

    def step(self, key: jax.Array, state: EpisodeState, action: jax.Array) -> tuple[EpisodeState, StepResult]:
        """Step every environment once; `key` is split into each environment's step and reset keys."""
        return self.step_with_keys(jax.random.split(key, (action.shape[0], 2)), state, action)

    def step_with_keys(self, keys: jax.Array, state: EpisodeState,
                       action: jax.Array) -> tuple[EpisodeState, StepResult]:
        """`step` with each environment's (step, reset) keys [B, 2] given (a rollout splits
        them for all its steps at once)."""
        step_keys, reset_keys = keys[:, 0], keys[:, 1]
        obs, env_state, reward, terminated, truncated = jax.vmap(self.core.step)(
            step_keys, state.env_state, self._env_action(action)
        )
        reward = jnp.asarray(reward, jnp.float32)
        terminated = jnp.asarray(terminated, bool)
        truncated = jnp.logical_and(jnp.asarray(truncated, bool), jnp.logical_not(terminated))
        done = jnp.logical_or(terminated, truncated)
        fresh_obs, fresh_states = self._fresh_states(reset_keys, done)
        final_obs = float_observation(obs)
        episode_return = state.episode_return + reward
        episode_length = state.episode_length + 1
        result = StepResult(
            obs=_select(done, float_observation(fresh_obs), final_obs),
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
            episode_return=jnp.where(done, episode_return, 0.0),
            episode_length=jnp.where(done, episode_length, 0),
        )
        new_state = EpisodeState(
            _select(done, fresh_states, env_state),
            jnp.where(done, 0.0, episode_return),
            jnp.where(done, 0, episode_length),
        )
        return new_state, result


def strongly_typed(tree: Any) -> Any:
    """`tree` with no weakly typed leaf (same values and dtypes). An environment may build
    its state from Python numbers; the compiled chunk is then called with the state it
    returned, whose leaves are strongly typed, and a weak type in the first state would
    make the second call's input types differ from the first's."""

    def strong(leaf: Any) -> jax.Array:
        if not isinstance(leaf, jax.Array):
            leaf = jnp.asarray(leaf)  # a Python or NumPy scalar in an eagerly built state
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return leaf  # keys are never weakly typed
        return jax.lax.convert_element_type(leaf, leaf.dtype)

    return jax.tree.map(strong, tree)
