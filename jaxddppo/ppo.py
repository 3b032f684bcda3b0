"""PPO: the loss, epochs x minibatches with a gradient all-reduce, and one update step.

`make_update` binds the static pieces (environment, network, sizes) and returns
the per-shard `update(state, hyperparams) -> (state, metrics)`; `sharding.py`
runs it on every shard. Every statistic that all shards use (advantage
normalisation, gradients, logged metrics) is reduced over all shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxddppo.config import PPOConfig
from jaxddppo.envs import BatchedEnv
from jaxddppo.networks import ActorCritic
from jaxddppo.rollout import EpisodeStats, RolloutState, Transition, collect_rollout, gae
from jaxddppo.sharding import Topology, pmean_over_shards, psum_over_shards


@struct.dataclass
class PPOHyperparams:
    """The float hyperparameters, traced (so a sweep can vmap over them)."""

    learning_rate: jax.Array
    gamma: jax.Array
    gae_lambda: jax.Array
    clip_eps: jax.Array
    vf_coef: jax.Array
    ent_coef: jax.Array
    max_grad_norm: jax.Array

    @classmethod
    def from_config(cls, config: PPOConfig) -> "PPOHyperparams":
        names = [f for f in cls.__dataclass_fields__]
        return cls(**{name: jnp.asarray(getattr(config, name), jnp.float32) for name in names})


@dataclass(frozen=True)
class UpdateSettings:
    """Static PPO choices and sizes of one shard's update."""

    num_steps: int
    num_epochs: int
    num_minibatches: int
    minibatch_size: int  # per shard
    num_updates: int  # of the whole run: defines the learning-rate schedule
    clip_value: bool
    normalize_advantages: bool
    anneal_lr: bool
    adam_eps: float

    @classmethod
    def from_config(cls, config: PPOConfig, topology: Topology) -> "UpdateSettings":
        return cls(
            num_steps=config.num_steps,
            num_epochs=config.num_epochs,
            num_minibatches=config.num_minibatches,
            minibatch_size=topology.minibatch_size_per_shard,
            num_updates=topology.num_updates,
            clip_value=config.clip_value,
            normalize_advantages=config.normalize_advantages,
            anneal_lr=config.anneal_lr,
            adam_eps=config.adam_eps,
        )

    @property
    def sgd_steps_per_update(self) -> int:
        return self.num_epochs * self.num_minibatches


@struct.dataclass
class TrainState:
    """Everything one shard carries between updates."""

    params: Any
    opt_state: Any
    rollout: RolloutState
    key: jax.Array  # this shard's key; each update folds in its index
    update_index: jax.Array  # int32, updates done so far


@struct.dataclass
class Batch:
    """Learning samples, flat over [T * B] or split into minibatches."""

    obs: jax.Array
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


@struct.dataclass
class UpdateMetrics:
    """Per-update metrics, identical on every shard. Losses are means over all SGD steps."""

    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array
    grad_norm: jax.Array
    explained_variance: jax.Array
    learning_rate: jax.Array
    episode_return_mean: jax.Array  # NaN if no episode ended during the update
    episode_length_mean: jax.Array
    episodes_completed: jax.Array


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


def learning_rate_at(sgd_step: jax.Array, hyperparams: PPOHyperparams, settings: UpdateSettings) -> jax.Array:
    """Learning rate at a global SGD step; annealing runs to 0 over the whole run."""
    if not settings.anneal_lr:
        return hyperparams.learning_rate
    total = settings.num_updates * settings.sgd_steps_per_update
    return hyperparams.learning_rate * (1.0 - sgd_step.astype(jnp.float32) / total)


def make_optimizer(hyperparams: PPOHyperparams, settings: UpdateSettings) -> optax.GradientTransformation:
    """Global-norm clipping, then Adam, then the (annealed) learning rate."""
    return optax.chain(
        optax.clip_by_global_norm(hyperparams.max_grad_norm),
        optax.scale_by_adam(eps=settings.adam_eps),
        optax.scale_by_learning_rate(lambda step: learning_rate_at(step, hyperparams, settings)),
    )


def normalize_over_shards(x: jax.Array) -> jax.Array:
    """(x - mean) / std with mean and std over every shard's samples (equal counts)."""
    mean = pmean_over_shards(jnp.mean(x))
    variance = pmean_over_shards(jnp.mean(jnp.square(x - mean)))
    return (x - mean) / (jnp.sqrt(variance) + 1e-8)


def sgd_step(
    params: Any,
    opt_state: Any,
    batch: Batch,
    apply_fn: Callable,
    hyperparams: PPOHyperparams,
    settings: UpdateSettings,
) -> tuple[Any, Any, LossInfo]:
    """One minibatch: local gradient, averaged over all shards, one optimizer step."""
    if settings.normalize_advantages:
        batch = batch.replace(advantage=normalize_over_shards(batch.advantage))
    grad_fn = jax.grad(ppo_loss, has_aux=True)
    grads, info = grad_fn(params, apply_fn, batch, hyperparams, settings.clip_value)
    grads = pmean_over_shards(grads)
    info = pmean_over_shards(info).replace(grad_norm=optax.global_norm(grads))
    updates, opt_state = make_optimizer(hyperparams, settings).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, info


def split_minibatches(batch: Batch, key: jax.Array, settings: UpdateSettings) -> Batch:
    """A fresh permutation of the flat batch, split into [num_minibatches, minibatch_size, ...]."""
    permutation = jax.random.permutation(key, settings.num_minibatches * settings.minibatch_size)
    return jax.tree.map(
        lambda x: x[permutation].reshape((settings.num_minibatches, settings.minibatch_size) + x.shape[1:]),
        batch,
    )


def run_epochs(
    params: Any,
    opt_state: Any,
    batch: Batch,
    key: jax.Array,
    apply_fn: Callable,
    hyperparams: PPOHyperparams,
    settings: UpdateSettings,
) -> tuple[Any, Any, LossInfo]:
    """`num_epochs` passes of minibatch SGD over `batch`; returns mean loss info."""

    def minibatch_step(carry: tuple[Any, Any], minibatch: Batch) -> tuple[tuple[Any, Any], LossInfo]:
        new_params, new_opt_state, info = sgd_step(*carry, minibatch, apply_fn, hyperparams, settings)
        return (new_params, new_opt_state), info

    def epoch(carry: tuple[Any, Any], epoch_key: jax.Array) -> tuple[tuple[Any, Any], LossInfo]:
        return jax.lax.scan(minibatch_step, carry, split_minibatches(batch, epoch_key, settings))

    (params, opt_state), infos = jax.lax.scan(
        epoch, (params, opt_state), jax.random.split(key, settings.num_epochs)
    )
    return params, opt_state, jax.tree.map(jnp.mean, infos)


def flatten_rollout(transitions: Transition, advantages: jax.Array) -> Batch:
    """[T, B, ...] rollout fields to a flat [T * B, ...] learning batch."""
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    return Batch(
        obs=flat(transitions.obs),
        action=flat(transitions.action),
        log_prob=flat(transitions.log_prob),
        value=flat(transitions.value),
        advantage=flat(advantages),
        target=flat(advantages + transitions.value),
    )


def explained_variance_over_shards(values: jax.Array, targets: jax.Array) -> jax.Array:
    """1 - Var[target - value] / Var[target], moments over all shards."""

    def variance(x: jax.Array) -> jax.Array:
        mean = pmean_over_shards(jnp.mean(x))
        return pmean_over_shards(jnp.mean(jnp.square(x - mean)))

    return 1.0 - variance(targets - values) / (variance(targets) + 1e-8)


def episode_means(stats: EpisodeStats) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean return and length over the episodes that ended on any shard (NaN if none)."""
    total = psum_over_shards(stats)
    nan_if_none = jnp.where(total.count > 0, 1.0, jnp.nan)
    count = jnp.maximum(total.count, 1.0)
    return total.return_sum / count * nan_if_none, total.length_sum / count * nan_if_none, total.count


def make_update(
    env: BatchedEnv, network: ActorCritic, settings: UpdateSettings
) -> Callable[[TrainState, PPOHyperparams], tuple[TrainState, UpdateMetrics]]:
    """The per-shard PPO update: rollout, GAE, epochs x minibatches of SGD."""

    def update(state: TrainState, hyperparams: PPOHyperparams) -> tuple[TrainState, UpdateMetrics]:
        key_rollout, key_epochs = jax.random.split(jax.random.fold_in(state.key, state.update_index))
        rollout, transitions, episode_stats = collect_rollout(
            env, network.apply, state.params, state.rollout, key_rollout, settings.num_steps
        )
        _, next_values = network.apply(state.params, transitions.final_obs)
        advantages = gae(
            transitions.reward, transitions.value, next_values,
            transitions.terminated, transitions.truncated,
            hyperparams.gamma, hyperparams.gae_lambda,
        )
        batch = flatten_rollout(transitions, advantages)
        params, opt_state, info = run_epochs(
            state.params, state.opt_state, batch, key_epochs, network.apply, hyperparams, settings
        )
        return_mean, length_mean, episodes = episode_means(episode_stats)
        metrics = UpdateMetrics(
            policy_loss=info.policy_loss,
            value_loss=info.value_loss,
            entropy=info.entropy,
            approx_kl=info.approx_kl,
            clip_fraction=info.clip_fraction,
            grad_norm=info.grad_norm,
            explained_variance=explained_variance_over_shards(batch.value, batch.target),
            learning_rate=learning_rate_at(
                state.update_index * settings.sgd_steps_per_update, hyperparams, settings
            ),
            episode_return_mean=return_mean,
            episode_length_mean=length_mean,
            episodes_completed=episodes,
        )
        new_state = state.replace(
            params=params, opt_state=opt_state, rollout=rollout, update_index=state.update_index + 1
        )
        return new_state, metrics

    return update


def init_train_state(
    shard_index: jax.Array,
    seed: int,
    env: BatchedEnv,
    network: ActorCritic,
    num_envs_per_shard: int,
    hyperparams: PPOHyperparams,
    settings: UpdateSettings,
) -> TrainState:
    """One shard's initial state. Parameters come from one key shared by every shard;
    environment and update keys are folded from the global shard index."""
    root = jax.random.key(seed)
    shard_key = jax.random.fold_in(jax.random.fold_in(root, 1), shard_index)
    obs, env_state = env.reset(jax.random.fold_in(shard_key, 0), num_envs_per_shard)
    params = network.init(jax.random.fold_in(root, 0), obs)
    opt_state = make_optimizer(hyperparams, settings).init(params)
    return TrainState(
        params=params,
        opt_state=opt_state,
        rollout=RolloutState(env_state, obs),
        key=jax.random.fold_in(shard_key, 1),
        update_index=jnp.zeros((), jnp.int32),
    )
