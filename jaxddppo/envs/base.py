"""The environment protocol, and the one batched, auto-resetting environment built on it.

A family adapter implements `EnvCore`: one environment, functional, jittable,
*without* automatic reset. `BatchedEnv` vmaps a core over a batch, restarts the
environments whose episode ended from a pool of fresh states (`resets.py`: reset work
only when episodes end) and keeps the episode statistics. The rollout and evaluation
see only `BatchedEnv`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from jaxddppo.config.options import START_STATES, ConfigError
from jaxddppo.envs.resets import (ResetPool, empty_pool, first_states_pool, hand_out_first_states, hand_out_slots,
                                  take_pending)


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
    # Where `reset_pool.pending_slot` is set, the state the episode ended in: the next step
    # starts from the slot's state (`take_pending`) instead.
    env_state: Any
    episode_return: jax.Array  # [B] return so far of the running episode
    episode_length: jax.Array  # [B]
    reset_pool: Optional[ResetPool] = None  # fresh start states; None where episodes are not restarted


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


class BatchedEnv:
    """A batch of one environment, auto-resetting, with episode statistics.

    Every environment has two keys per step: the first steps it, the second is its share
    of the reset keys a refill of the reset pool uses on that step. The pool holds
    `num_envs // optimistic_reset_ratio` fresh states (at least one); with the default
    ratio 1 it holds one per environment and every episode starts from a state of its own.
    A larger ratio keeps a smaller pool (less memory, more frequent and smaller refills);
    when more environments finish on one step than it holds, some start from the same state.
    With `start_states="first"` the pool holds each environment's own first state instead,
    and every episode of an environment restarts from it: no reset work after the first.
    """

    def __init__(self, core: EnvCore, optimistic_reset_ratio: int = 1, start_states: str = "fresh"):
        if optimistic_reset_ratio < 1:
            raise ConfigError(f"env.optimistic_reset_ratio={optimistic_reset_ratio} must be at least 1")
        if start_states not in START_STATES:
            raise ConfigError(f"env.start_states={start_states!r} is invalid: must be one of {', '.join(START_STATES)}")
        if start_states == "first" and optimistic_reset_ratio != 1:
            raise ConfigError(f"env.optimistic_reset_ratio={optimistic_reset_ratio} is invalid with "
                              "env.start_states='first', which keeps no pool of fresh states: leave it at 1")
        self.core = core
        self.spec = core.spec
        self.optimistic_reset_ratio = optimistic_reset_ratio
        self.start_states = start_states

    def _reset_batch(self, keys: jax.Array) -> tuple[Any, Any]:
        obs, env_state = jax.vmap(self.core.reset)(keys)
        return float_observation(obs), strongly_typed(env_state)

    def reset(self, key: jax.Array, num_envs: int, auto_reset: bool = True) -> tuple[Any, EpisodeState]:
        """First observations and states of `num_envs` environments; with `auto_reset=False`
        no reset pool (for `step_without_reset`, each environment running one episode)."""
        obs, env_state = self._reset_batch(jax.random.split(key, num_envs))
        zeros = jnp.zeros((num_envs,), jnp.float32)
        pool = None
        if auto_reset and self.start_states == "first":
            pool = first_states_pool(obs, env_state)
        elif auto_reset:
            pool = empty_pool(obs, env_state, max(1, num_envs // self.optimistic_reset_ratio))
        return obs, EpisodeState(env_state, zeros, jnp.zeros((num_envs,), jnp.int32), pool)

    def _env_action(self, action: jax.Array) -> jax.Array:
        if self.spec.discrete:
            return action
        low = jnp.asarray(self.spec.action_low, jnp.float32)
        high = jnp.asarray(self.spec.action_high, jnp.float32)
        return jnp.clip(action, low, high)

    def step(self, key: jax.Array, state: EpisodeState, action: jax.Array) -> tuple[EpisodeState, StepResult]:
        """Step every environment once; `key` is split into each environment's step and reset keys."""
        return self.step_with_keys(jax.random.split(key, (action.shape[0], 2)), state, action)

    def step_with_keys(self, keys: jax.Array, state: EpisodeState,
                       action: jax.Array) -> tuple[EpisodeState, StepResult]:
        """`step` with each environment's (step, reset) keys [B, 2] given (a rollout splits
        them for all its steps at once)."""
        if state.reset_pool is None:
            raise ValueError("this EpisodeState has no reset pool: make it with reset(..., auto_reset=True)")
        pool, env_state = take_pending(state.reset_pool, state.env_state)
        new_state, result = self._step_episodes(keys[:, 0], state.replace(env_state=env_state), action)
        done = jnp.logical_or(result.terminated, result.truncated)
        if self.start_states == "first":
            pool, obs = hand_out_first_states(pool, done, result.final_obs)
        else:
            pool, obs = hand_out_slots(self._reset_batch, pool, keys[:, 1], done, result.final_obs)
        new_state = new_state.replace(reset_pool=pool)
        return new_state, result.replace(obs=obs)

    def step_without_reset(self, key: jax.Array, state: EpisodeState,
                           action: jax.Array) -> tuple[EpisodeState, StepResult]:
        """Step every environment once and restart none: an environment whose episode ended
        steps on from where it ended (evaluation, which reads each environment's first
        episode only). `key` is split as `step` splits it, so the steps are the same."""
        keys = jax.random.split(key, (action.shape[0], 2))
        return self._step_episodes(keys[:, 0], state, action)

    def _step_episodes(self, step_keys: jax.Array, state: EpisodeState,
                       action: jax.Array) -> tuple[EpisodeState, StepResult]:
        """The core's step of every environment and the episode statistics; `obs` is the
        observation reached (no restart) and the episode counters restart where one ended."""
        obs, env_state, reward, terminated, truncated = jax.vmap(self.core.step)(
            step_keys, state.env_state, self._env_action(action)
        )
        reward = jnp.asarray(reward, jnp.float32)
        terminated = jnp.asarray(terminated, bool)
        truncated = jnp.logical_and(jnp.asarray(truncated, bool), jnp.logical_not(terminated))
        done = jnp.logical_or(terminated, truncated)
        final_obs = float_observation(obs)
        episode_return = state.episode_return + reward
        episode_length = state.episode_length + 1
        result = StepResult(
            obs=final_obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
            episode_return=jnp.where(done, episode_return, 0.0),
            episode_length=jnp.where(done, episode_length, 0),
        )
        new_state = state.replace(
            env_state=strongly_typed(env_state),
            episode_return=jnp.where(done, 0.0, episode_return),
            episode_length=jnp.where(done, 0, episode_length),
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
