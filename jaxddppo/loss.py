"""The PPO loss of a minibatch and its gradient over every shard: the clipped surrogate,
the (clipped) value loss and the entropy bonus (`ppo_loss`), advantages normalised over
each global minibatch, and each shard's gradient averaged over all shards
(`mean_gradients`). The float hyperparameters are traced (`PPOHyperparams`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxddppo.config.options import TRACED_BOUNDS, PPOConfig
from jaxddppo.networks import ActorCritic, unroll
from jaxddppo.shards import DeviceShards


def _hyperparams_from_config(cls: type, config: PPOConfig) -> Any:
    return cls(**{name: jnp.asarray(getattr(config, name), jnp.float32) for name in TRACED_BOUNDS})


# The update's float hyperparameters, traced (so that a sweep can vmap over them and PBT change
# them): one float32 array each, named as config/options.py declares them (TRACED_BOUNDS), so that a new
# one is declared there alone. `PPOHyperparams.from_config(config.ppo)` makes one.
PPOHyperparams = struct.dataclass(type("PPOHyperparams", (), {
    "__module__": __name__,
    "__annotations__": {name: jax.Array for name in TRACED_BOUNDS},
    "from_config": classmethod(_hyperparams_from_config),
}))


@struct.dataclass
class SequenceObs:
    """A recurrent policy's input: whole environment sequences and the carry they start from."""

    obs: Any  # leaves [T, B, ...], as the network sees them (normalised if the run normalises)
    episode_start: jax.Array  # [T, B]
    carry: Any  # leaves [B, ...]: the carry before each sequence's first step


@struct.dataclass
class Batch:
    """Learning samples: flat over [T * B] (feed-forward) or [T, B] sequences (recurrent; `obs`
    is then a SequenceObs), or one minibatch of either."""

    obs: Any
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    advantage: jax.Array
    target: jax.Array  # value target: advantage + value


@struct.dataclass
class LossInfo:
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array
    grad_norm: jax.Array


def ppo_loss(
    params: Any, apply_fn: Callable, batch: Batch, hyperparams: PPOHyperparams, clip_value: bool
) -> tuple[jax.Array, LossInfo]:
    """Clipped-surrogate PPO loss of one minibatch; every field of `batch` is [N, ...].

    `batch.advantage` is used as given (normalise it before calling).
    Returns the scalar loss and its parts (grad_norm left at 0).
    """
    dist, value = apply_fn(params, batch.obs)
    log_ratio = dist.log_prob(batch.action) - batch.log_prob
    ratio = jnp.exp(log_ratio)
    clip_eps = hyperparams.clip_eps
    surrogate = ratio * batch.advantage
    clipped_surrogate = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * batch.advantage
    policy_loss = -jnp.mean(jnp.minimum(surrogate, clipped_surrogate))
    value_error = jnp.square(value - batch.target)
    if clip_value:
        clipped_value = batch.value + jnp.clip(value - batch.value, -clip_eps, clip_eps)
        value_error = jnp.maximum(value_error, jnp.square(clipped_value - batch.target))
    value_loss = 0.5 * jnp.mean(value_error)
    entropy = jnp.mean(dist.entropy())
    loss = policy_loss + hyperparams.vf_coef * value_loss - hyperparams.ent_coef * entropy
    info = LossInfo(
        policy_loss=policy_loss,
        value_loss=value_loss,
        entropy=entropy,
        approx_kl=jnp.mean((ratio - 1.0) - log_ratio),
        clip_fraction=jnp.mean((jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)),
        grad_norm=jnp.zeros(()),
    )
    return loss, info


def normalize_minibatch_advantages(advantages: jax.Array, indices: jax.Array, shards: DeviceShards) -> jax.Array:
    """Advantages of every minibatch, normalised over that global minibatch (all shards).

    `advantages` [L, N] are the device's shards' flat advantages; `indices` [L, E, M, n]
    pick each epoch's minibatches. The statistics of all E x M minibatches are reduced
    together, around a shift common to every shard (the rollout mean) so
    E[x^2] - E[x]^2 does not cancel.
    """
    shift = shards.mean(shards.map(jnp.mean, advantages))
    centered = shards.map_batched(lambda shard, index: shard[index] - shift, advantages, indices)
    mean, mean_square = shards.mean(shards.map(
        lambda shard: (jnp.mean(shard, -1), jnp.mean(jnp.square(shard), -1)), centered
    ))
    std = jnp.sqrt(jnp.maximum(mean_square - jnp.square(mean), 0.0))
    # A product, not a division: XLA may rewrite a division into a product by the
    # reciprocal, depending on the surrounding program, which would change the last bits.
    inverse_std = 1.0 / (std + 1e-8)
    return shards.map_batched(lambda shard: (shard - mean[..., None]) * inverse_std[..., None], centered)


def mean_gradients(
    params: Any, minibatches: Batch, apply_fn: Callable, hyperparams: PPOHyperparams, clip_value: bool,
    shards: DeviceShards,
) -> tuple[Any, LossInfo]:
    """Gradient of the global minibatch: each shard's gradient of its own loss (`minibatches`
    leaves [L, ...]), averaged over every shard. Returns it and each shard's loss info [L]
    (grad_norm: the mean gradient's norm).

    `jax.grad` is taken of each local loss and the gradients are then averaged: under
    `shard_parallel` (pmap semantics) grad of an averaged loss would be local.
    """
    grads, infos = shards.map(
        lambda minibatch: jax.grad(ppo_loss, has_aux=True)(params, apply_fn, minibatch, hyperparams, clip_value),
        minibatches,
    )
    grads = shards.mean(grads)
    return grads, infos.replace(grad_norm=jnp.broadcast_to(optax.tree.norm(grads), infos.grad_norm.shape))


def loss_apply_fn(network: ActorCritic) -> Callable[[Any, Any], tuple[Any, jax.Array]]:
    """(params, batch.obs) -> (distribution, value) as `ppo_loss` needs it."""
    if not network.recurrent:
        return network.apply
    return lambda params, sequences: unroll(
        network, params, sequences.carry, sequences.obs, sequences.episode_start
    )[1:]
