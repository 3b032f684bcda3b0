"""Resets paid only when episodes end: a pool of fresh start states, refilled a batch at a time.

`BatchedEnv` keeps, beside its environments, a `ResetPool` of fresh (observation, state)
pairs made by the core's own `reset`. An environment whose episode ends takes the next
unused pair, so every episode starts from its own fresh random state; the pool is refilled
(every slot at once, one batched reset) only when the environments ending on a step need
more pairs than it has left. A step on which no episode ends does no reset work, and the
total is about one reset per episode that ends: on a GPU, where a long reset (MJX's settling
steps) is latency paid per call, few large refills beat many small ones.

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

    @property
    def size(self) -> int:
        return jax.tree.leaves(self.obs)[0].shape[0]


def empty_pool(obs: Any, state: Any, size: int) -> ResetPool:
    """A pool of `size` slots, all used: the first refill happens when the first episode ends.
    `obs` and `state` (leaves [B >= size, ...]) only give the slots their shapes and types."""
    first = jax.tree.map(lambda leaf: leaf[:size], (obs, state))
    return ResetPool(obs=first[0], state=first[1], next_slot=jnp.asarray(size, jnp.int32))


# (pool, reset keys [B], done [B], observations, states)
RestartOperands = tuple[ResetPool, jax.Array, jax.Array, Any, Any]


def restart_finished(
    reset_batch: Callable[[jax.Array], tuple[Any, Any]], pool: ResetPool, reset_keys: jax.Array,
    done: jax.Array, obs: Any, state: Any,
) -> tuple[ResetPool, Any, Any]:
    """(pool, obs, state) after the environments where `done` [B] restart from the pool.

    The k-th environment ending on this step (in batch order) takes slot `next_slot + k`.
    If fewer slots are left than environments end, the pool is first refilled, every slot,
    by `reset_batch(reset_keys[:P])` (this step's reset keys of the first P environments).
    Only a pool smaller than the batch can run out within one step; the environments beyond
    its size then share slots (slot modulo P).
    """

    def restart(operands: RestartOperands) -> RestartOperands:
        pool, reset_keys, done, obs, state = operands
        num_done = jnp.sum(done, dtype=jnp.int32)
        pool, _ = update_if_any(pool.next_slot + num_done > pool.size, _refill(reset_batch), (pool, reset_keys))
        slot = (pool.next_slot + jnp.cumsum(done, dtype=jnp.int32) - 1) % pool.size
        fresh = jax.tree.map(lambda leaf: leaf[slot], (pool.obs, pool.state))
        pool = pool.replace(next_slot=jnp.minimum(pool.next_slot + num_done, pool.size))
        return pool, reset_keys, done, _where(done, fresh[0], obs), _where(done, fresh[1], state)

    pool, _, _, obs, state = update_if_any(jnp.any(done), restart, (pool, reset_keys, done, obs, state))
    return pool, obs, state


def first_states_pool(obs: Any, state: Any) -> ResetPool:
    """The pool of `restart_from_first`: slot i holds environment i's first (obs, state);
    `next_slot` is unused."""
    return ResetPool(obs=obs, state=state, next_slot=jnp.zeros((), jnp.int32))


def restart_from_first(pool: ResetPool, done: jax.Array, obs: Any, state: Any) -> tuple[Any, Any]:
    """(obs, state) after the environments where `done` [B] restart from their own first
    state (slot i of a `first_states_pool`, for environment i); no reset is computed."""

    def restart(operands: tuple[ResetPool, jax.Array, Any, Any]) -> tuple[ResetPool, jax.Array, Any, Any]:
        pool, done, obs, state = operands
        return pool, done, _where(done, pool.obs, obs), _where(done, pool.state, state)

    _, _, obs, state = update_if_any(jnp.any(done), restart, (pool, done, obs, state))
    return obs, state


def _refill(reset_batch: Callable[[jax.Array], tuple[Any, Any]]
            ) -> Callable[[tuple[ResetPool, jax.Array]], tuple[ResetPool, jax.Array]]:
    def refill(args: tuple[ResetPool, jax.Array]) -> tuple[ResetPool, jax.Array]:
        pool, reset_keys = args
        obs, state = reset_batch(reset_keys[:pool.size])
        return ResetPool(obs=obs, state=state, next_slot=jnp.zeros((), jnp.int32)), reset_keys

    return refill
