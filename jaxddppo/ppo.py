"""PPO's update: epochs x minibatches (`minibatches.py`) of the loss's mean gradient
(`loss.py`), and one update step from rollout to new parameters.

`make_update` binds the static pieces (environment, network, sizes) and returns
the per-device `update(state, hyperparams) -> (state, metrics)`;
`sharding.shard_parallel` runs it on every device. It runs each of the device's shards' rollouts, returns
and minibatch gradients with `DeviceShards.map`, and reduces every statistic that
all shards use (advantage normalisation, gradients, logged metrics) over all
shards with `DeviceShards.mean`; parameters and optimizer state, one per member
(`TrainState.layout`), are updated once per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxddppo.envs import BatchedEnv
from jaxddppo.envs.base import strongly_typed
from jaxddppo.loss import Batch, LossInfo, PPOHyperparams, loss_apply_fn, mean_gradients, normalize_minibatch_advantages
from jaxddppo.minibatches import (
    Minibatching,
    flatten_rollout,
    merge_time_and_batch,
    minibatch_indices,
    random_permutations,
    sequence_advantages,
    sequence_batch,
    sequence_indices,
    take_samples,
    take_sequences,
)
from jaxddppo.networks import ActorCritic, policy_step, prepare_observations
from jaxddppo.normalization import (
    RunningMoments,
    discounted_returns,
    init_moments,
    init_observation_moments,
    scale,
    update_moments,
)
from jaxddppo.rollout import EpisodeStats, RolloutState, Transition, collect_rollout, gae
from jaxddppo.shards import DeviceShards, field_layouts


@dataclass(frozen=True)
class UpdateSettings:
    """Static PPO choices and sizes of one shard's update."""

    num_steps: int
    num_epochs: int
    num_minibatches: int
    minibatch_size: int  # per shard
    num_shards: int
    num_updates: int  # of the whole run: defines the learning-rate schedule
    clip_value: bool
    normalize_advantages: bool
    anneal_lr: bool
    num_envs: int  # per shard
    recurrent: bool  # minibatches are whole environment sequences
    critic_after_steps: bool  # a feed-forward critic with its own torso values the rollout after its steps
    normalize_observations: bool
    scale_rewards: bool
    permutations: Callable[[jax.Array, int, int], jax.Array] = random_permutations  # draws the epochs' orders
    exact_reductions: bool = True  # train.exact_reductions

    @property
    def sgd_steps_per_update(self) -> int:
        return self.num_epochs * self.num_minibatches

    @property
    def minibatching(self) -> Minibatching:
        return Minibatching(
            num_epochs=self.num_epochs, num_minibatches=self.num_minibatches,
            minibatch_size=self.minibatch_size, num_envs=self.num_envs, permutations=self.permutations,
        )

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
class UpdateMetrics(LossInfo):
    """Per-update metrics, identical on every shard: the LossInfo fields (means over all
    SGD steps and shards), then statistics of the rollout."""

    explained_variance: jax.Array
    learning_rate: jax.Array
    episode_return_mean: jax.Array  # NaN if no episode ended during the update
    episode_length_mean: jax.Array
    episodes_completed: jax.Array


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


def run_epochs(
    params: Any,
    opt_state: Any,
    batch: Batch,
    keys: jax.Array,
    apply_fn: Callable,
    hyperparams: PPOHyperparams,
    settings: UpdateSettings,
) -> tuple[Any, Any, LossInfo]:
    """`num_epochs` passes of minibatch SGD over the device's shards' `batch` (leaves
    [L, ...]), shard `i` shuffling with `keys[i]`; returns each shard's loss info of every
    SGD step [L, E, M].

    Feed-forward minibatches are random samples; recurrent ones are random whole
    environment sequences (truncated BPTT over the rollout).
    """
    shards = settings.shards
    if settings.recurrent:
        indices = shards.map_batched(lambda key: sequence_indices(key, settings.minibatching), keys)
        advantages = sequence_advantages(batch.advantage, indices, settings.normalize_advantages, shards)
        take = take_sequences
    else:
        indices = shards.map_batched(lambda key: minibatch_indices(key, settings.minibatching), keys)
        if settings.normalize_advantages:
            advantages = normalize_minibatch_advantages(batch.advantage, indices, shards)
        else:
            advantages = shards.map_batched(lambda shard, index: shard[index], batch.advantage, indices)
        take = take_samples
    optimizer = make_optimizer(hyperparams, settings)

    def minibatch_step(carry: tuple[Any, Any], xs: tuple[jax.Array, jax.Array]) -> tuple[tuple[Any, Any], LossInfo]:
        params, opt_state = carry
        minibatches = shards.map_batched(
            lambda shard, index, advantage: take(shard, index).replace(advantage=advantage), batch, *xs
        )
        grads, infos = mean_gradients(params, minibatches, apply_fn, hyperparams, settings.clip_value, shards)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), infos

    def epoch(carry: tuple[Any, Any], xs: tuple[jax.Array, jax.Array]) -> tuple[tuple[Any, Any], LossInfo]:
        return jax.lax.scan(minibatch_step, carry, xs)

    # Scanned over epochs, then minibatches: the shard axis goes inside both.
    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 2), (indices, advantages))
    (params, opt_state), infos = jax.lax.scan(epoch, (params, opt_state), xs)
    return params, opt_state, jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), infos)


@struct.dataclass
class ScaledRewards:
    rewards: jax.Array  # [L, T, B]
    discounted_return: jax.Array  # [L, B] carried to the next rollout
    moments: RunningMoments


def scale_rollout_rewards(
    transitions: Transition, discounted_return: jax.Array, moments: RunningMoments, gamma: jax.Array,
    shards: DeviceShards,
) -> ScaledRewards:
    """Rewards divided by the running std of the discounted return, updated with every shard's
    rollout; `transitions` and `discounted_return` [L, B] are the device's shards'."""
    dones = transitions.terminated | transitions.truncated
    discounted_return, returns = shards.map_batched(
        lambda running, reward, done: discounted_returns(running, reward, done, gamma),
        discounted_return, transitions.reward, dones,
    )
    moments = update_moments(moments, returns.reshape(returns.shape[0], -1), shards)
    rewards = shards.map_batched(lambda reward: scale(moments, reward), transitions.reward)
    return ScaledRewards(rewards, discounted_return, moments)


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


def update_keys(shard_key: jax.Array, update_index: jax.Array) -> jax.Array:
    """The rollout's and the epochs' keys [2] of update `update_index`: the shard's key folded
    with 2 x update_index and 2 x update_index + 1, in one Threefry call (XLA's CPU backend
    compiles each call into a loop of its own)."""
    indices = 2 * update_index.astype(jnp.uint32) + jnp.arange(2, dtype=jnp.uint32)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(shard_key, indices)


def make_update(
    env: BatchedEnv, network: ActorCritic, settings: UpdateSettings
) -> Callable[[TrainState, PPOHyperparams], tuple[TrainState, UpdateMetrics]]:
    """The per-device PPO update of the device's shards (`TrainState.layout`; one member's
    `PPOHyperparams`): rollout, GAE, epochs x minibatches of SGD. The metrics are the same
    on every device, without a shard axis."""
    shards = settings.shards

    def update(state: TrainState, hyperparams: PPOHyperparams) -> tuple[TrainState, UpdateMetrics]:
        params, opt_state, update_index = state.params, state.opt_state, state.update_index
        obs_moments, return_moments = state.obs_moments, state.return_moments
        keys = shards.map_batched(lambda key: update_keys(key, update_index), state.key)
        key_rollout, key_epochs = keys[:, 0], keys[:, 1]

        def policy(params: Any, carry: Any, obs: Any, episode_start: Any) -> tuple[Any, Any, jax.Array]:
            return policy_step(network, params, obs_moments, carry, obs, episode_start)

        rollout, transitions, episode_stats = shards.map(
            lambda shard_rollout, key: collect_rollout(
                env, policy, params, shard_rollout, key, settings.num_steps, settings.critic_after_steps
            ),
            state.rollout, key_rollout,
        )
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
        if settings.normalize_observations:
            obs_moments = update_moments(
                obs_moments, shards.map_batched(merge_time_and_batch, transitions.obs), shards
            )
        params, opt_state, info = run_epochs(
            params, opt_state, batch, key_epochs, loss_apply_fn(network), hyperparams, settings
        )
        # Means over shards of per-shard means are global means: every shard has equally many samples.
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


def initial_params(seed: int | jax.Array, network: ActorCritic, obs: Any) -> Any:
    """The parameters every shard of a run starts from: one key, shared by all shards."""
    return network.init(jax.random.fold_in(jax.random.key(seed), 0), obs)


def init_train_state(
    shard_indices: jax.Array,
    seed: int | jax.Array,
    env: BatchedEnv,
    network: ActorCritic,
    num_envs_per_shard: int,
    hyperparams: PPOHyperparams,
    settings: UpdateSettings,
) -> TrainState:
    """The initial state of a device's shards (global indices `shard_indices`
    [shards_per_device]): parameters `initial_params(seed, ...)`; each shard's environment
    and update keys folded from its global index."""
    shard_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.fold_in(jax.random.key(seed), 1),
                                                                   shard_indices)

    def init_rollout(shard_key: jax.Array) -> RolloutState:
        obs, env_state = env.reset(jax.random.fold_in(shard_key, 0), num_envs_per_shard)
        rollout = RolloutState(env_state, obs)
        if network.recurrent:
            rollout = rollout.replace(
                carry=network.initial_carry(num_envs_per_shard),
                episode_start=jnp.ones((num_envs_per_shard,), bool),
            )
        if settings.scale_rewards:
            rollout = rollout.replace(discounted_return=jnp.zeros((num_envs_per_shard,), jnp.float32))
        return rollout

    rollout = DeviceShards.map_batched(init_rollout, shard_keys)
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
