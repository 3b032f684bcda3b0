"""Resets paid only when episodes end: a pool of fresh start states, refilled a batch at a time.

`BatchedEnv` keeps, beside its environments, a `ResetPool` of fresh (observation, state)
pairs made by the core's own `reset`. An environment whose episode ends takes the next
unused pair, so every episode starts from its own fresh random state; the pool is refilled
(every slot at once, one batched reset) only when the environments ending on a step need
more pairs than it has left. A step on which no episode ends does no reset work, and the
total is about one reset per episode that ends: on a GPU, where a long reset (MJX's settling
steps) is latency paid per call, few large refills beat many small ones.

A restart is done in two halves. On the step where an episode ends, the environment is
handed its slot: the slot's observation (what the policy acts on next) and, in
`pending_slot`, the slot itself. At the start of its next step, `take_pending` puts the
slot's state in place of the ended one. The state thus never passes through the branch
that hands out slots right after the core's step wrote it, which on a CPU cost a copy of
every state leaf at every step (CartpoleBalance in 4 vmapped groups stepped at 0.83-0.84 of
its core's rate with it, 0.94-0.97 without). The pool is refilled only in the first half,
so a slot is never overwritten between the two.

Both decisions are `update_if_any`: a branch that stays a branch under `vmap` (batched
sweep members, batched shards), taken when any member of the batch needs it. A plain
`lax.cond` under `vmap` becomes a `select` that computes both sides.

Opt-in (`env.start_states=first`): the pool holds each environment's own first state and
is never refilled; an environment whose episode ends restarts from it (Brax's auto-reset).
No reset work after the first, but every episode of an environment starts the same way.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct


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
    update = jax.jit(update)

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

    return branch(jnp.asarray(predicate, bool), operands)


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
