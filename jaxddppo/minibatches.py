"""The learning batch of one shard's rollout and its minibatches: the rollout's fields as a
flat batch (feed-forward) or as whole environment sequences (recurrent), each epoch's
random order, and the samples of one minibatch.

What the update needs of its static settings is `Minibatching`; `ppo.UpdateSettings`
gives it as `settings.minibatching`. Each epoch's order is drawn by `random_permutations`,
or by the function given in its place (the CPU switch gives `cpu_tuning.sort_permutations`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxddppo.loss import Batch, SequenceObs, normalize_minibatch_advantages
from jaxddppo.rollout import Transition
from jaxddppo.shards import DeviceShards


def random_permutations(key: jax.Array, num_permutations: int, n: int) -> jax.Array:
    """[num_permutations, n]: random orders of range(n), one per key split from `key`."""
    return jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(key, num_permutations))


@dataclass(frozen=True)
class Minibatching:
    """Static sizes of one shard's epochs."""

    num_epochs: int
    num_minibatches: int
    minibatch_size: int  # samples per minibatch, feed-forward
    num_envs: int  # environments per shard: a recurrent minibatch takes whole sequences of some
    permutations: Callable[[jax.Array, int, int], jax.Array] = random_permutations  # (key, epochs, n)


def merge_time_and_batch(tree: Any) -> Any:
    """Leaves [T, B, ...] as [T * B, ...]."""
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


def flatten_rollout(transitions: Transition, advantages: jax.Array, obs: Any) -> Batch:
    """[T, B, ...] rollout fields to a flat [T * B, ...] learning batch; `obs` (leaves
    [T, B, ...]) are the observations as the network saw them."""
    return Batch(
        obs=merge_time_and_batch(obs),
        action=merge_time_and_batch(transitions.action),
        log_prob=merge_time_and_batch(transitions.log_prob),
        value=merge_time_and_batch(transitions.value),
        advantage=merge_time_and_batch(advantages),
        target=merge_time_and_batch(advantages + transitions.value),
    )


def sequence_batch(transitions: Transition, advantages: jax.Array, obs: Any, initial_carry: Any) -> Batch:
    """The rollout as [T, B] sequences for a recurrent policy, starting from `initial_carry`."""
    return Batch(
        obs=SequenceObs(obs=obs, episode_start=transitions.episode_start, carry=initial_carry),
        action=transitions.action,
        log_prob=transitions.log_prob,
        value=transitions.value,
        advantage=advantages,
        target=advantages + transitions.value,
    )


def take_samples(batch: Batch, index: jax.Array) -> Batch:
    """The samples `index` [n] of a flat batch."""
    return jax.tree.map(lambda x: x[index], batch)


def take_sequences(batch: Batch, env_index: jax.Array) -> Batch:
    """The whole sequences of environments `env_index` [n] of a sequence batch, steps in order."""
    sequences = batch.obs
    fields = jax.tree.map(lambda x: x[:, env_index], batch.replace(obs=None))
    return fields.replace(obs=SequenceObs(
        obs=jax.tree.map(lambda x: x[:, env_index], sequences.obs),
        episode_start=sequences.episode_start[:, env_index],
        carry=jax.tree.map(lambda c: c[env_index], sequences.carry),
    ))


def epoch_permutations(key: jax.Array, num_items: int, sizes: Minibatching) -> jax.Array:
    """[num_epochs, num_items]: a fresh random order of range(num_items) per epoch."""
    return sizes.permutations(key, sizes.num_epochs, num_items)


def minibatch_indices(key: jax.Array, sizes: Minibatching) -> jax.Array:
    """[num_epochs, num_minibatches, minibatch_size]: a fresh permutation per epoch."""
    permutations = epoch_permutations(key, sizes.num_minibatches * sizes.minibatch_size, sizes)
    return permutations.reshape(sizes.num_epochs, sizes.num_minibatches, sizes.minibatch_size)


def sequence_indices(key: jax.Array, sizes: Minibatching) -> jax.Array:
    """[num_epochs, num_minibatches, envs per minibatch]: a fresh permutation of the envs per epoch."""
    permutations = epoch_permutations(key, sizes.num_envs, sizes)
    return permutations.reshape(sizes.num_epochs, sizes.num_minibatches, -1)


def sequence_advantages(
    advantages: jax.Array, env_indices: jax.Array, normalize: bool, shards: DeviceShards
) -> jax.Array:
    """Each sequence minibatch's advantages [L, E, M, T, n] from the device's shards'
    `advantages` [L, T, B], normalised over the global minibatch if asked (as for flat minibatches)."""
    shards_per_device, num_steps, num_envs = advantages.shape
    flat_indices = jnp.arange(num_steps)[:, None] * num_envs + env_indices[..., None, :]  # [L, E, M, T, n]
    flat_advantages = advantages.reshape(shards_per_device, -1)
    if not normalize:
        return shards.map_batched(lambda shard, index: shard[index], flat_advantages, flat_indices)
    per_minibatch = flat_indices.reshape(flat_indices.shape[:3] + (-1,))
    return normalize_minibatch_advantages(flat_advantages, per_minibatch, shards).reshape(flat_indices.shape)
