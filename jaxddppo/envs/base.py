"""The environment protocol, and the one batched, auto-resetting environment built on it.

A family adapter implements `EnvCore`: one environment, functional, jittable,
*without* automatic reset. `BatchedEnv` vmaps a core over a batch, restarts the
environments whose episode ended from a pool of fresh states (`ResetPool`, below: reset
work only when episodes end) and keeps the episode statistics. The rollout and evaluation
see only `BatchedEnv`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxddppo.config.options import START_STATES, ConfigError


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


def enlarged(frame: np.ndarray, longest_side: int = 320) -> np.ndarray:
    """A frame [H, W, 3] with every pixel repeated the largest whole number of times (at least
    once) that keeps its longer side within `longest_side`: a renderer's few pixels a cell shown at
    about the size the other families draw."""
    times = max(1, longest_side // max(frame.shape[:2]))
    return np.repeat(np.repeat(frame, times, axis=0), times, axis=1)


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
        # Jitted once, so that every program stepping or restarting these environments (the
        # update, the evaluations, the initialisation) reuses one trace of the core's functions.
        self._core_reset, self._core_step = jax.jit(core.reset), jax.jit(core.step)
        self.spec = core.spec
        self.optimistic_reset_ratio = optimistic_reset_ratio
        self.start_states = start_states

    def _reset_batch(self, keys: jax.Array) -> tuple[Any, Any]:
        obs, env_state = jax.vmap(self._core_reset)(keys)
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
        obs, env_state, reward, terminated, truncated = jax.vmap(self._core_step)(
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


# Resets paid only when episodes end: a pool of fresh start states, refilled a batch at a time.
#
# `BatchedEnv` keeps, beside its environments, a `ResetPool` of fresh (observation, state)
# pairs made by the core's own `reset`. An environment whose episode ends takes the next
# unused pair, so every episode starts from its own fresh random state; the pool is refilled
# (every slot at once, one batched reset) only when the environments ending on a step need
# more pairs than it has left. A step on which no episode ends does no reset work, and the
# total is about one reset per episode that ends: on a GPU, where a long reset (MJX's settling
# steps) is latency paid per call, few large refills beat many small ones.
#
# A restart is done in two halves. On the step where an episode ends, the environment is
# handed its slot: the slot's observation (what the policy acts on next) and, in
# `pending_slot`, the slot itself. At the start of its next step, `take_pending` puts the
# slot's state in place of the ended one. The state thus never passes through the branch
# that hands out slots right after the core's step wrote it, which on a CPU cost a copy of
# every state leaf at every step (CartpoleBalance in 4 vmapped groups stepped at 0.83-0.84 of
# its core's rate with it, 0.94-0.97 without). The pool is refilled only in the first half,
# so a slot is never overwritten between the two.
#
# Both decisions are `update_if_any`: a branch that stays a branch under `vmap` (batched
# sweep members, batched shards), taken when any member of the batch needs it. A plain
# `lax.cond` under `vmap` becomes a `select` that computes both sides.
#
# Opt-in (`env.start_states=first`): the pool holds each environment's own first state and
# is never refilled; an environment whose episode ends restarts from it (Brax's auto-reset).
# No reset work after the first, but every episode of an environment starts the same way.


def _where(condition: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leaf by leaf, `on_true` where `condition` [B] holds, else `on_false` (leaves [B, ...])."""

    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.where(condition.reshape(condition.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(pick, on_true, on_false)


def update_if_any(predicate: jax.Array, update: Callable[[Any], Any], operands: Any) -> Any:
    """`update(operands)` where `predicate` holds, else `operands` as they are: a branch
    that stays a branch under `vmap`, and leaves the operands in place when not taken.

    Batched, `update` runs when the predicate holds for any member, and each member keeps
    its update only where its own predicate holds: every member computes what it would
    alone, and a batch in which no member needs the update skips it. Nested `vmap`s nest
    the rule (the batched call is itself an `update_if_any`).

    The branch takes the form each backend runs best, chosen when the program is lowered:
    on a CPU a loop of at most one iteration, whose carry XLA updates in place, where a
    `lax.cond` inside the rollout's loop copied every operand it passed through (the reset
    pool and the environment states, at every step); elsewhere a `lax.cond`, since a GPU
    waits on the host for each check of a loop's condition (training CartPole, 2048 envs x
    128 steps on one H200: 18.3M env steps/s with the cond, 10.5M with the loop).
    """
    # Both forms and the batched rule share one trace of `update`. Traced once per form, the
    # reset inside the nested branches of a step was traced 4 times (12 under `vmap`, where it
    # is now traced twice): 15 of the 24 s that tracing a CheetahRun step took on a CPU.
    # `custom_vmap` refuses batched values in a closure (a sweep's parameters): they pass as operands.
    closed_update, hoisted = jax.closure_convert(update, operands)
    update = jax.jit(lambda both: (both[0], closed_update(both[1], *both[0])))

    @jax.custom_batching.custom_vmap
    def branch(predicate: jax.Array, operands: Any) -> Any:
        return jax.lax.platform_dependent(predicate, operands, cpu=partial(branch_as_loop, update),
                                          default=partial(branch_as_cond, update))

    @branch.def_vmap
    def batched(axis_size: int, in_batched: tuple[Any, Any], predicate: jax.Array, operands: Any
                ) -> tuple[Any, Any]:
        predicate_batched, operands_batched = in_batched
        operands = jax.tree.map(
            lambda leaf, is_batched: leaf if is_batched else jnp.broadcast_to(leaf, (axis_size, *jnp.shape(leaf))),
            operands, operands_batched)
        update_batched = jax.vmap(update)
        if not predicate_batched:
            out = update_if_any(predicate, update_batched, operands)
        else:
            def where_own(args: tuple[jax.Array, Any]) -> tuple[jax.Array, Any]:
                member_predicate, member_operands = args
                return member_predicate, _where(member_predicate, update_batched(member_operands), member_operands)

            out = update_if_any(jnp.any(predicate), where_own, (predicate, operands))[1]
        return out, jax.tree.map(lambda _: True, out)

    return branch(jnp.asarray(predicate, bool), (list(hoisted), operands))[1]


def branch_as_loop(update: Callable[[Any], Any], predicate: jax.Array, operands: Any) -> Any:
    """`update(operands)` if the scalar `predicate` holds, else `operands`: a loop of at most
    one iteration (`update_if_any`'s form on a CPU)."""

    def body(carry: tuple[jax.Array, Any]) -> tuple[jax.Array, Any]:
        return jnp.zeros((), bool), update(carry[1])

    return jax.lax.while_loop(lambda carry: carry[0], body, (predicate, operands))[1]


def branch_as_cond(update: Callable[[Any], Any], predicate: jax.Array, operands: Any) -> Any:
    """`branch_as_loop`'s result as a `lax.cond` (`update_if_any`'s form on other backends)."""
    return jax.lax.cond(predicate, update, lambda unchanged: unchanged, operands)


@struct.dataclass
class ResetPool:
    """Fresh start states of one batch of environments, handed out in slot order."""

    obs: Any  # leaves [P, ...]: first observations (float32, bool masks)
    state: Any  # leaves [P, ...]: the environment states they belong to
    next_slot: jax.Array  # [] int32: the first slot not handed out; P when every slot is used
    # [B] int32: the slot whose state each environment takes at the start of its next step
    # (its episode ended and it acts on that slot's observation); -1: none
    pending_slot: jax.Array

    @property
    def size(self) -> int:
        return jax.tree.leaves(self.obs)[0].shape[0]


def empty_pool(obs: Any, state: Any, size: int) -> ResetPool:
    """A pool of `size` slots, all used: the first refill happens when the first episode ends.
    `obs` and `state` (leaves [B >= size, ...], the batch's first ones) give the slots their
    shapes and types."""
    first = jax.tree.map(lambda leaf: leaf[:size], (obs, state))
    return ResetPool(obs=first[0], state=first[1], next_slot=jnp.asarray(size, jnp.int32),
                     pending_slot=_no_slots(obs))


def first_states_pool(obs: Any, state: Any) -> ResetPool:
    """The pool of `env.start_states=first`: slot i holds environment i's first (obs, state);
    `next_slot` is unused."""
    return ResetPool(obs=obs, state=state, next_slot=jnp.zeros((), jnp.int32), pending_slot=_no_slots(obs))


def _no_slots(obs: Any) -> jax.Array:
    return jnp.full((jax.tree.leaves(obs)[0].shape[0],), -1, jnp.int32)


def take_pending(pool: ResetPool, state: Any) -> tuple[ResetPool, Any]:
    """(pool, state) with each environment that has a pending slot in that slot's state, and
    no slot pending. `state`: the environments' states (leaves [B, ...]).

    On a CPU the take is an `update_if_any` (most steps take nothing); elsewhere it is
    `take_slot_states` at every step: a branch there would make every step wait for the host
    to read its predicate (on one H100, CartPole trained at 16.4M env steps/s so, 14.6-14.8M
    with the branch).
    """

    def take_if_any(pool: ResetPool, state: Any) -> tuple[ResetPool, Any]:
        return update_if_any(jnp.any(pool.pending_slot >= 0), lambda operands: take_slot_states(*operands),
                             (pool, state))

    return jax.lax.platform_dependent(pool, state, cpu=take_if_any, default=take_slot_states)


def take_slot_states(pool: ResetPool, state: Any) -> tuple[ResetPool, Any]:
    """`take_pending` as a gather and a select over every environment (its form off a CPU)."""
    slot_state = jax.tree.map(lambda leaf: leaf[jnp.maximum(pool.pending_slot, 0)], pool.state)
    return (pool.replace(pending_slot=jnp.full_like(pool.pending_slot, -1)),
            _where(pool.pending_slot >= 0, slot_state, state))


def hand_out_slots(
    reset_batch: Callable[[jax.Array], tuple[Any, Any]], pool: ResetPool, reset_keys: jax.Array,
    done: jax.Array, obs: Any,
) -> tuple[ResetPool, Any]:
    """(pool, obs) after each environment where `done` [B] is handed a slot: its observation
    becomes the slot's, and the slot is pending (`take_pending` restarts its state).

    The k-th environment ending on this step (in batch order) takes slot `next_slot + k`.
    If fewer slots are left than environments end, the pool is first refilled, every slot,
    by `reset_batch(reset_keys[:P])` (this step's reset keys of the first P environments).
    Only a pool smaller than the batch can run out within one step; the environments beyond
    its size then share slots (slot modulo P).
    """

    def hand_out(operands: tuple[ResetPool, jax.Array, jax.Array, Any]) -> tuple[ResetPool, jax.Array, jax.Array, Any]:
        pool, reset_keys, done, obs = operands
        num_done = jnp.sum(done, dtype=jnp.int32)
        pool, _ = update_if_any(pool.next_slot + num_done > pool.size, _refill(reset_batch), (pool, reset_keys))
        slot = (pool.next_slot + jnp.cumsum(done, dtype=jnp.int32) - 1) % pool.size
        obs = _where(done, jax.tree.map(lambda leaf: leaf[slot], pool.obs), obs)
        pool = pool.replace(next_slot=jnp.minimum(pool.next_slot + num_done, pool.size),
                            pending_slot=jnp.where(done, slot, pool.pending_slot))
        return pool, reset_keys, done, obs

    pool, _, _, obs = update_if_any(jnp.any(done), hand_out, (pool, reset_keys, done, obs))
    return pool, obs


def hand_out_first_states(pool: ResetPool, done: jax.Array, obs: Any) -> tuple[ResetPool, Any]:
    """(pool, obs) after each environment where `done` [B] is handed its own first state
    (slot i of a `first_states_pool`, for environment i): no reset is computed."""

    def hand_out(operands: tuple[ResetPool, jax.Array, Any]) -> tuple[ResetPool, jax.Array, Any]:
        pool, done, obs = operands
        own_slot = jnp.arange(done.shape[0], dtype=jnp.int32)
        return (pool.replace(pending_slot=jnp.where(done, own_slot, pool.pending_slot)), done,
                _where(done, pool.obs, obs))

    pool, _, obs = update_if_any(jnp.any(done), hand_out, (pool, done, obs))
    return pool, obs


def _refill(reset_batch: Callable[[jax.Array], tuple[Any, Any]]
            ) -> Callable[[tuple[ResetPool, jax.Array]], tuple[ResetPool, jax.Array]]:
    def refill(args: tuple[ResetPool, jax.Array]) -> tuple[ResetPool, jax.Array]:
        pool, reset_keys = args
        obs, state = reset_batch(reset_keys[:pool.size])
        return pool.replace(obs=obs, state=state, next_slot=jnp.zeros((), jnp.int32)), reset_keys

    return refill
