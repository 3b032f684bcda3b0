"""PPO's update, top to bottom: `make_update` returns the per-device
`update(state, hyperparams) -> (state, metrics)`, which runs in named phases:

1. collect: each shard steps its environments under the policy (`rollout.collect_rollout`);
2. advantages: rewards scaled if asked, GAE per shard (`rollout.gae`), the learning batch;
3. epochs: each epoch a fresh order cut into minibatches (`sharding.epoch_indices`), advantages
   normalised over each global minibatch (with `ppo.segment_length`, recomputed for each
   minibatch by the value network: `segment_gradients`), the loss's gradient of every shard
   averaged over all shards (`mean_gradients`), one optimizer step per minibatch;
4. metrics: every statistic reduced over all shards.

`sharding.shard_parallel` runs `update` on every device; it handles the device's shards
with `sharding.DeviceShards` (`map` per shard, `mean` over every shard of the run), so
nothing here names a device axis. Parameters and optimizer state, one per member
(`TrainState.layout`), are updated once per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxddppo.config.options import TRACED_BOUNDS, PPOConfig
from jaxddppo.envs import BatchedEnv
from jaxddppo.envs.base import strongly_typed
from jaxddppo.networks import ActorCritic, unroll
from jaxddppo.rollout import (
    Batch, EpisodeStats, RolloutState, RunningMoments, Segments, collect_rollout, flatten_rollout, gae, init_moments,
    init_observation_moments, initial_rollout, merge_time_and_batch, policy_step, prepare_observations,
    scale_rollout_rewards, segment_advantages, segment_rollout, sequence_batch, take_samples, take_segments,
    take_sequences, update_moments
)
from jaxddppo.sharding import (
    DeviceShards, epoch_indices, field_layouts, normalize_minibatch_advantages, random_permutations,
    sequence_advantages, update_keys
)


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


@dataclass(frozen=True)
class UpdateSettings:
    """The update's static choices and one shard's sizes (`distributed.topology` derives the
    global ones)."""

    num_steps: int
    num_envs_per_shard: int
    num_epochs: int
    num_minibatches: int
    num_shards: int
    num_updates: int  # of the whole run: defines the learning-rate schedule
    clip_value: bool
    normalize_advantages: bool
    anneal_lr: bool
    recurrent: bool  # minibatches are whole environment sequences
    critic_after_steps: bool  # a feed-forward critic with its own torso values the rollout after its steps
    normalize_observations: bool
    scale_rewards: bool
    segment_length: int = 0  # > 0: minibatches of segments, advantages recomputed at every SGD step
    permutations: Callable[[jax.Array, int, int], jax.Array] = random_permutations  # (key, epochs, n) orders
    exact_reductions: bool = True  # train.exact_reductions

    @property
    def sgd_steps_per_update(self) -> int:
        return self.num_epochs * self.num_minibatches

    @property
    def shards(self) -> DeviceShards:
        """How the update runs and sums its shards: exactly only where there are several
        (a single shard has one order, and would only pay for the loop)."""
        return DeviceShards(exact=self.exact_reductions and self.num_shards > 1)


@struct.dataclass
class TrainState:
    """Everything a run carries between updates: the rollout and key of each shard (a
    device's leaves lead with [shards_per_device]), and once for all shards the parameters,
    optimizer state, update count and statistics (`layout`)."""

    params: Any
    opt_state: Any  # the optimizer's (`optimizer_state`)
    rollout: RolloutState
    key: jax.Array  # this shard's key; each update folds in its index
    update_index: jax.Array  # int32, updates done so far
    obs_moments: Optional[RunningMoments] = None  # env.normalize_observations: all shards' observations
    return_moments: Optional[RunningMoments] = None  # env.scale_rewards: all shards' discounted returns

    @classmethod
    def layout(cls) -> TrainState:
        """Which fields are per shard and which per member (`sharding.shard_parallel`'s layouts)."""
        return field_layouts(cls, ("rollout", "key"))


@struct.dataclass
class LossInfo:
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array
    grad_norm: jax.Array


@struct.dataclass
class UpdateMetrics(LossInfo):
    """Per-update metrics, identical on every shard: the LossInfo fields (means over all
    SGD steps and shards), then statistics of the rollout."""

    explained_variance: jax.Array
    learning_rate: jax.Array
    episode_return_mean: jax.Array  # NaN if no episode ended during the update
    episode_length_mean: jax.Array
    episodes_completed: jax.Array


def make_update(
    env: BatchedEnv, network: ActorCritic, settings: UpdateSettings
) -> Callable[[TrainState, PPOHyperparams], tuple[TrainState, UpdateMetrics]]:
    """The per-device PPO update of the device's shards (`TrainState.layout`; one member's
    `PPOHyperparams`). The metrics are the same on every device, without a shard axis."""
    shards = settings.shards

    def update(state: TrainState, hyperparams: PPOHyperparams) -> tuple[TrainState, UpdateMetrics]:
        params, opt_state, update_index = state.params, state.opt_state, state.update_index
        obs_moments, return_moments = state.obs_moments, state.return_moments
        keys = shards.map_batched(lambda key: update_keys(key, update_index), state.key)
        key_rollout, key_epochs = keys[:, 0], keys[:, 1]

        # 1. Collect: every shard's environments, under the policy that acts.
        def policy(params: Any, carry: Any, obs: Any, episode_start: Any) -> tuple[Any, Any, jax.Array]:
            return policy_step(network, params, obs_moments, carry, obs, episode_start)

        rollout, transitions, episode_stats = shards.map(
            lambda shard_rollout, key: collect_rollout(
                env, policy, params, shard_rollout, key, settings.num_steps, settings.critic_after_steps,
                keep_final_obs=settings.segment_length > 0,
            ),
            state.rollout, key_rollout,
        )

        # 2. Advantages [shards_per_device, T, B] and the learning batch.
        rewards = transitions.reward
        if settings.scale_rewards:
            scaled = scale_rollout_rewards(
                transitions, rollout.discounted_return, return_moments, hyperparams.gamma, shards
            )
            rewards, return_moments = scaled.rewards, scaled.moments
            rollout = rollout.replace(discounted_return=scaled.discounted_return)
        advantages = shards.map_batched(
            lambda reward, shard: gae(
                reward, shard.value, shard.next_value, shard.terminated, shard.truncated,
                hyperparams.gamma, hyperparams.gae_lambda,
            ),
            rewards, transitions,
        )
        # The batch sees observations normalised as when they were acted on, so the
        # first epoch's ratios start at 1; the statistics then take in this rollout.
        obs = shards.map_batched(lambda shard_obs: prepare_observations(obs_moments, shard_obs), transitions.obs)
        if settings.recurrent:
            batch = shards.map_batched(sequence_batch, transitions, advantages, obs, state.rollout.carry)
        else:
            batch = shards.map_batched(flatten_rollout, transitions, advantages, obs)
        learning_batch = batch
        if settings.segment_length:
            final_obs = shards.map_batched(lambda shard_obs: prepare_observations(obs_moments, shard_obs),
                                           transitions.final_obs)
            learning_batch = shards.map_batched(
                lambda shard, reward, shard_obs, shard_final_obs: segment_rollout(
                    shard, reward, shard_obs, shard_final_obs, settings.segment_length),
                transitions, rewards, obs, final_obs,
            )
        if settings.normalize_observations:
            obs_moments = update_moments(
                obs_moments, shards.map_batched(merge_time_and_batch, transitions.obs), shards
            )

        # 3. Epochs of minibatches, one optimizer step each.
        params, opt_state, info = run_epochs(
            params, opt_state, learning_batch, key_epochs, loss_apply_fn(network), hyperparams, settings
        )

        # 4. Metrics: means over shards of per-shard means are global means (every shard has
        # equally many samples).
        totals = shards.mean(shards.map(
            lambda shard_info, shard_batch, shard_episodes: _ShardTotals(
                info=jax.tree.map(jnp.mean, shard_info),
                target_moments=_moments(shard_batch.target),
                residual_moments=_moments(shard_batch.target - shard_batch.value),
                episodes=shard_episodes,
            ),
            info, batch, episode_stats,
        ))
        episodes = totals.episodes
        nan_if_none = jnp.where(episodes.count > 0, 1.0, jnp.nan)
        count = jnp.maximum(episodes.count, 1e-30)
        metrics = UpdateMetrics(
            **vars(totals.info),
            explained_variance=1.0 - _variance(totals.residual_moments) / (_variance(totals.target_moments) + 1e-8),
            learning_rate=learning_rate_at(update_index * settings.sgd_steps_per_update, hyperparams, settings),
            episode_return_mean=episodes.return_sum / count * nan_if_none,
            episode_length_mean=episodes.length_sum / count * nan_if_none,
            episodes_completed=jnp.round(episodes.count * settings.num_shards),
        )
        return state.replace(params=params, opt_state=opt_state, rollout=rollout, update_index=update_index + 1,
                             obs_moments=obs_moments, return_moments=return_moments), metrics

    return update


def run_epochs(
    params: Any,
    opt_state: Any,
    batch: Batch | Segments,
    keys: jax.Array,
    apply_fn: Callable,
    hyperparams: PPOHyperparams,
    settings: UpdateSettings,
) -> tuple[Any, Any, LossInfo]:
    """`num_epochs` passes of minibatch SGD over the device's shards' `batch` (leaves
    [L, ...]), shard `i` shuffling with `keys[i]`; returns each shard's loss info of every
    SGD step [L, E, M].

    Feed-forward minibatches are random samples, or with `settings.segment_length` random
    segments (`batch` is then `Segments`) whose advantages each SGD step recomputes; recurrent
    ones are random whole environment sequences (truncated BPTT over the rollout).
    """
    shards = settings.shards
    if settings.segment_length:
        num_items = settings.num_envs_per_shard * settings.num_steps // settings.segment_length
    else:
        num_items = settings.num_envs_per_shard * (1 if settings.recurrent else settings.num_steps)
    indices = shards.map_batched(lambda key: epoch_indices(
        key, settings.num_epochs, settings.num_minibatches, num_items, settings.permutations), keys)
    if settings.segment_length:
        advantages = None

        def gradients_of(params: Any, index: jax.Array, advantage: None) -> tuple[Any, LossInfo]:
            segments = shards.map_batched(take_segments, batch, index)
            return segment_gradients(params, segments, apply_fn, hyperparams, settings)
    else:
        if settings.recurrent:
            advantages = sequence_advantages(batch.advantage, indices, settings.normalize_advantages, shards)
            take = take_sequences
        else:
            if settings.normalize_advantages:
                advantages = normalize_minibatch_advantages(batch.advantage, indices, shards)
            else:
                advantages = shards.map_batched(lambda shard, index: shard[index], batch.advantage, indices)
            take = take_samples

        def gradients_of(params: Any, index: jax.Array, advantage: jax.Array) -> tuple[Any, LossInfo]:
            minibatches = shards.map_batched(
                lambda shard, shard_index, shard_advantage: take(shard, shard_index).replace(advantage=shard_advantage),
                batch, index, advantage,
            )
            return mean_gradients(params, minibatches, apply_fn, hyperparams, settings.clip_value, shards)
    optimizer = make_optimizer(hyperparams, settings)

    def minibatch_step(carry: tuple[Any, Any], xs: tuple[jax.Array, Any]) -> tuple[tuple[Any, Any], LossInfo]:
        params, opt_state = carry
        grads, infos = gradients_of(params, *xs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), infos

    def epoch(carry: tuple[Any, Any], xs: tuple[jax.Array, jax.Array]) -> tuple[tuple[Any, Any], LossInfo]:
        return jax.lax.scan(minibatch_step, carry, xs)

    # Scanned over epochs, then minibatches: the shard axis goes inside both.
    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 2), (indices, advantages))
    (params, opt_state), infos = jax.lax.scan(epoch, (params, opt_state), xs)
    return params, opt_state, jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), infos)


def ppo_loss(
    params: Any, apply_fn: Callable, batch: Batch, hyperparams: PPOHyperparams, clip_value: bool
) -> tuple[jax.Array, LossInfo]:
    """Clipped-surrogate PPO loss of one minibatch, every field of `batch` [N, ...]: the
    clipped surrogate, the (clipped) value loss and the entropy bonus. `batch.advantage` is
    used as given (normalise it before calling). Returns the scalar loss and its parts
    (grad_norm left at 0)."""
    dist, value = apply_fn(params, batch.obs)
    info = policy_terms(dist, batch, hyperparams.clip_eps)
    value_loss = value_loss_of(value, batch.value, batch.target, hyperparams.clip_eps, clip_value)
    loss = info.policy_loss + hyperparams.vf_coef * value_loss - hyperparams.ent_coef * info.entropy
    return loss, info.replace(value_loss=value_loss)


def policy_terms(dist: Any, batch: Batch, clip_eps: jax.Array) -> LossInfo:
    """The clipped surrogate's loss, the entropy and the ratio's statistics of the policy
    `dist` on `batch` (value_loss and grad_norm left at 0)."""
    log_ratio = dist.log_prob(batch.action) - batch.log_prob
    ratio = jnp.exp(log_ratio)
    surrogate = ratio * batch.advantage
    clipped_surrogate = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * batch.advantage
    return LossInfo(
        policy_loss=-jnp.mean(jnp.minimum(surrogate, clipped_surrogate)),
        value_loss=jnp.zeros(()),
        entropy=jnp.mean(dist.entropy()),
        approx_kl=jnp.mean((ratio - 1.0) - log_ratio),
        clip_fraction=jnp.mean((jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)),
        grad_norm=jnp.zeros(()),
    )


def value_loss_of(value: jax.Array, old_value: jax.Array, target: jax.Array, clip_eps: jax.Array,
                  clip_value: bool) -> jax.Array:
    """Half the mean squared error of `value` against `target`, clipped around `old_value` if asked."""
    value_error = jnp.square(value - target)
    if clip_value:
        clipped_value = old_value + jnp.clip(value - old_value, -clip_eps, clip_eps)
        value_error = jnp.maximum(value_error, jnp.square(clipped_value - target))
    return 0.5 * jnp.mean(value_error)


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


def segment_gradients(
    params: Any, segments: Segments, apply_fn: Callable, hyperparams: PPOHyperparams, settings: UpdateSettings
) -> tuple[Any, LossInfo]:
    """`mean_gradients` of a global minibatch of segments (leaves [L, S, n, ...]) whose
    advantages and value targets come from the current value network. The pass that values
    a shard's segments also takes the value loss's gradient, and once the advantages are
    normalised over the global minibatch a second pass takes the policy's: valuing them
    apart would cost a forward pass more where a device's shards run in turn (exact
    reductions), as XLA does not merge passes across those loops."""
    shards = settings.shards

    def value_gradient(segment: Segments) -> tuple[Any, jax.Array, jax.Array]:
        def objective(params: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            value = apply_fn(params, merge_time_and_batch(segment.obs))[1]
            current, last_value = jax.lax.stop_gradient((value, apply_fn(params, segment.last_obs)[1]))
            advantage = merge_time_and_batch(segment_advantages(
                segment, current.reshape(segment.reward.shape), last_value, hyperparams.gamma, hyperparams.gae_lambda))
            value_loss = value_loss_of(value, merge_time_and_batch(segment.value), advantage + current,
                                       hyperparams.clip_eps, settings.clip_value)
            return hyperparams.vf_coef * value_loss, (advantage, value_loss)

        grads, (advantage, value_loss) = jax.grad(objective, has_aux=True)(params)
        return grads, advantage, value_loss

    value_grads, advantages, value_losses = shards.map(value_gradient, segments)
    if settings.normalize_advantages:
        advantages = normalize_minibatch_advantages(advantages, None, shards)

    def policy_gradient(segment: Segments, advantage: jax.Array, value_grad: Any) -> tuple[Any, LossInfo]:
        batch = merge_time_and_batch(Batch(obs=segment.obs, action=segment.action, log_prob=segment.log_prob,
                                           value=None, advantage=None, target=None)).replace(advantage=advantage)

        def objective(params: Any) -> tuple[jax.Array, LossInfo]:
            info = policy_terms(apply_fn(params, batch.obs)[0], batch, hyperparams.clip_eps)
            return info.policy_loss - hyperparams.ent_coef * info.entropy, info

        grads, info = jax.grad(objective, has_aux=True)(params)
        return jax.tree.map(jnp.add, value_grad, grads), info

    grads, infos = shards.map(policy_gradient, segments, advantages, value_grads)
    grads = shards.mean(grads)
    return grads, infos.replace(value_loss=value_losses,
                                grad_norm=jnp.broadcast_to(optax.tree.norm(grads), infos.grad_norm.shape))


def loss_apply_fn(network: ActorCritic) -> Callable[[Any, Any], tuple[Any, jax.Array]]:
    """(params, batch.obs) -> (distribution, value) as `ppo_loss` needs it."""
    if not network.recurrent:
        return network.apply
    return lambda params, sequences: unroll(
        network, params, sequences.carry, sequences.obs, sequences.episode_start
    )[1:]


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
        optax.scale_by_adam(eps=hyperparams.adam_eps),
        optax.scale_by_learning_rate(lambda step: learning_rate_at(step, hyperparams, settings)),
    )


def optimizer_state(params: Any, hyperparams: PPOHyperparams, settings: UpdateSettings) -> Any:
    """The optimizer's initial state for `params`."""
    return make_optimizer(hyperparams, settings).init(params)


@struct.dataclass
class _ShardTotals:
    """Per-shard statistics averaged over shards in one reduction at the end of an update."""

    info: LossInfo
    target_moments: jax.Array  # [2]: E[t], E[t^2] of the value targets
    residual_moments: jax.Array  # [2]: the same of target - value
    episodes: EpisodeStats


def _variance(moments: jax.Array) -> jax.Array:
    return jnp.maximum(moments[1] - jnp.square(moments[0]), 0.0)


def _moments(x: jax.Array) -> jax.Array:
    return jnp.stack([jnp.mean(x), jnp.mean(jnp.square(x))])


def initial_params(seed: int | jax.Array, network: ActorCritic, obs: Any) -> Any:
    """The parameters every shard of a run starts from: one key, shared by all shards."""
    return network.init(jax.random.fold_in(jax.random.key(seed), 0), obs)


def init_train_state(shard_indices: jax.Array, seed: int | jax.Array, env: BatchedEnv, network: ActorCritic,
                     hyperparams: PPOHyperparams, settings: UpdateSettings) -> TrainState:
    """The initial state of a device's shards (global indices `shard_indices`
    [shards_per_device]): parameters `initial_params(seed, ...)`; each shard's environment
    and update keys folded from its global index."""
    shard_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.fold_in(jax.random.key(seed), 1),
                                                                   shard_indices)
    rollout = DeviceShards.map_batched(lambda shard_key: initial_rollout(
        env, network, jax.random.fold_in(shard_key, 0), settings.num_envs_per_shard, settings.scale_rewards
    ), shard_keys)
    params = initial_params(seed, network, jax.tree.map(lambda leaf: leaf[0], rollout.obs))
    return strongly_typed(TrainState(
        params=params,
        opt_state=optimizer_state(params, hyperparams, settings),
        rollout=rollout,
        key=DeviceShards.map_batched(lambda shard_key: jax.random.fold_in(shard_key, 1), shard_keys),
        update_index=jnp.zeros((), jnp.int32),
        obs_moments=init_observation_moments(env.spec.observation) if settings.normalize_observations else None,
        return_moments=init_moments(()) if settings.scale_rewards else None,
    ))
