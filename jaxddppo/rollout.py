"""What a shard's batch of environments gives the update: rollouts under the policy
(`collect_rollout`, acting through `policy_step`), GAE, the learning batch the epochs
cut into minibatches (`flatten_rollout`, `sequence_batch`; `segment_advantages`
recomputes a minibatch's advantages), and the running statistics every shard shares:
the observation normaliser and the reward scaler.

The statistics keep `RunningMoments` (count, mean, M2 = sum of squared deviations). An
update merges one batch from every shard into them: each shard's batch moments are
combined with Chan et al.'s parallel formula through the shard collectives, then merged
into the running moments with the same formula. No E[x^2] - E[x]^2 appears, so large
means do not cancel the variance. Every shard ends with the same numbers, whatever the
device count. Samples may be pytrees (dict observations): the moments then hold one
mean and M2 per float leaf, and None for a bool leaf (an action mask), never normalised.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxddppo.envs import BatchedEnv, EpisodeState, batch_size
from jaxddppo.envs.base import update_if_any
from jaxddppo.networks import ActorCritic, Distribution
from jaxddppo.sharding import DeviceShards

OBS_CLIP = 10.0  # normalised observations are clipped to [-OBS_CLIP, OBS_CLIP]
_VARIANCE_EPS = 1e-8
# Both scale by an explicit rsqrt: XLA turns x / sqrt(v) into x * rsqrt(v) only where the sqrt
# has one user, so a division would compute other bits depending on the program around it.

# (params, carry, obs (leaves [B, ...]), episode_start [B] or None) -> (carry, distribution, value [B]);
# a feed-forward policy (carry None) takes obs with any leading shape, [T, B, ...] too.
PolicyFn = Callable[[Any, Any, Any, Optional[jax.Array]], tuple[Any, Any, jax.Array]]


@struct.dataclass
class Transition:
    """One rollout, time-major: every leaf is [T, B, ...]."""

    obs: Any  # observation acted on, as the environment gave it (not normalised)
    action: jax.Array
    log_prob: jax.Array  # log pi_old(action | obs)
    value: jax.Array  # V_old(obs)
    reward: jax.Array
    terminated: jax.Array  # true end of episode: no bootstrap
    truncated: jax.Array  # time limit: bootstrap from final_obs
    final_obs: Any  # observation reached by the step, before any auto-reset; None unless kept (`collect_rollout`)
    next_value: jax.Array  # V_old(final_obs) where no episode terminated; recurrent: with the carry after the step
    episode_start: Optional[jax.Array] = None  # recurrent policies only: the carry was reset before obs


@struct.dataclass
class RolloutState:
    """What a shard carries from one rollout to the next."""

    env: EpisodeState
    obs: Any  # leaves [B, ...]
    carry: Any = None  # recurrent policies: the carry before acting on obs
    episode_start: Optional[jax.Array] = None  # recurrent policies: [B] obs is an episode's first
    discounted_return: Optional[jax.Array] = None  # reward scaling: [B] discounted return so far


def initial_rollout(env: BatchedEnv, network: ActorCritic, key: jax.Array, num_envs: int,
                    scale_rewards: bool) -> RolloutState:
    """A shard's first `RolloutState`: `num_envs` environments reset with `key`."""
    obs, env_state = env.reset(key, num_envs)
    rollout = RolloutState(env_state, obs)
    if network.recurrent:
        rollout = rollout.replace(carry=network.initial_carry(num_envs), episode_start=jnp.ones((num_envs,), bool))
    if scale_rewards:
        rollout = rollout.replace(discounted_return=jnp.zeros((num_envs,), jnp.float32))
    return rollout


@struct.dataclass
class EpisodeStats:
    """Sums over the episodes that ended during a rollout."""

    return_sum: jax.Array
    length_sum: jax.Array
    count: jax.Array


def collect_rollout(
    env: BatchedEnv, policy: PolicyFn, params: Any, state: RolloutState, key: jax.Array, num_steps: int,
    critic_after_steps: bool = False, keep_final_obs: bool = False,
) -> tuple[RolloutState, Transition, EpisodeStats]:
    """Step every environment `num_steps` times with actions sampled from the policy.

    A recurrent policy (`state.carry` not None) carries its state from step to step,
    resets it where an episode starts, and values each step's final_obs with the carry
    the step produced. A feed-forward policy values final_obs only at steps that truncate
    an episode (`update_if_any`); elsewhere `next_value` is the next step's value (of the
    observation reached, or after a termination, which does not bootstrap). final_obs, as
    large as the observations, is kept only with `keep_final_obs`. With `critic_after_steps`
    the steps leave the critic out (XLA drops it from the loop) and one pass values all
    observations after them: large products instead of T small ones, which pays for a
    critic with a torso of its own; with a shared torso a value costs only its head.
    """
    recurrent = state.carry is not None
    if recurrent and critic_after_steps:
        raise ValueError("critic_after_steps needs a feed-forward policy; a recurrent one values each step")

    def step(carry: RolloutState, keys: tuple[jax.Array, jax.Array]) -> tuple[RolloutState, tuple[Transition, Any]]:
        key_action, env_keys = keys
        policy_carry, dist, value = policy(params, carry.carry, carry.obs, carry.episode_start)
        action = dist.sample(key_action)
        env_state, result = env.step_with_keys(env_keys, carry.env, action)
        next_state = carry.replace(env=env_state, obs=result.obs)
        episode_start = None
        if recurrent:
            done = result.terminated | result.truncated
            _, _, next_value = policy(params, policy_carry, result.final_obs, jnp.zeros_like(done))
            episode_start = carry.episode_start
            next_state = next_state.replace(carry=policy_carry, episode_start=done)
        else:
            def value_reached(reached: tuple[Any, jax.Array]) -> tuple[Any, jax.Array]:
                return reached[0], policy(params, None, reached[0], None)[2]
            next_value = update_if_any(jnp.any(result.truncated), value_reached,
                                       (result.final_obs, jnp.zeros_like(result.reward)))[1]
        transition = Transition(
            obs=carry.obs,
            action=action,
            log_prob=dist.log_prob(action),
            value=None if critic_after_steps else value,
            reward=result.reward,
            terminated=result.terminated,
            truncated=result.truncated,
            final_obs=result.final_obs if keep_final_obs else None,
            next_value=next_value,
            episode_start=episode_start,
        )
        ended = (result.episode_return, result.episode_length, result.terminated | result.truncated)
        return next_state, (transition, ended)

    state, (transitions, (returns, lengths, ended)) = jax.lax.scan(
        step, state, step_keys(key, num_steps, batch_size(state.obs))
    )
    if critic_after_steps:
        transitions = transitions.replace(value=policy(params, None, transitions.obs, None)[2])
    if not recurrent:
        following_value = jnp.concatenate([transitions.value[1:], policy(params, None, state.obs, None)[2][None]])
        transitions = transitions.replace(next_value=jnp.where(transitions.truncated, transitions.next_value,
                                                               following_value))
    stats = EpisodeStats(
        return_sum=returns.sum(),
        length_sum=lengths.sum().astype(jnp.float32),
        count=ended.sum().astype(jnp.float32),
    )
    return state, transitions, stats


def step_keys(key: jax.Array, num_steps: int, num_envs: int) -> tuple[jax.Array, jax.Array]:
    """The keys of every step of a rollout, split from `key` before it starts, in one
    call: action keys [T] and each environment's (step, reset) keys [T, B, 2].

    On CPU, XLA compiles every call of JAX's Threefry into a loop of its own (about 0.2 s
    of compile time each at 2048 environments), and runs many small ones slower than
    one large one.
    """
    keys = jax.random.split(key, (num_steps, 1 + 2 * num_envs))
    return keys[:, 0], keys[:, 1:].reshape(num_steps, num_envs, 2)


def gae(
    rewards: jax.Array,
    values: jax.Array,
    next_values: jax.Array,
    terminated: jax.Array,
    truncated: jax.Array,
    gamma: float | jax.Array,
    gae_lambda: float | jax.Array,
) -> jax.Array:
    """Generalised advantage estimates; every argument and the result are [T, B].

    `next_values[t]` is V(s_{t+1}) of the state the step reached (before any
    reset). A terminated step does not bootstrap; a truncated one does. Either
    ends the episode, so the lambda-trace stops there.
    """
    not_terminated = 1.0 - terminated.astype(values.dtype)
    continues = not_terminated * (1.0 - truncated.astype(values.dtype))
    deltas = rewards + gamma * next_values * not_terminated - values

    def backward(next_advantage: jax.Array, inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        delta, cont = inputs
        advantage = delta + gamma * gae_lambda * cont * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(backward, jnp.zeros_like(values[0]), (deltas, continues), reverse=True)
    return advantages


def prepare_observations(obs_moments: Optional[RunningMoments], obs: Any) -> Any:
    """What the network sees: `obs` normalised by `obs_moments`, or as it is when there are none."""
    return obs if obs_moments is None else normalize(obs_moments, obs)


def policy_step(
    network: ActorCritic,
    params: Any,
    obs_moments: Optional[RunningMoments],
    carry: Any,
    obs: Any,
    episode_start: Optional[jax.Array],
) -> tuple[Any, Distribution, jax.Array]:
    """(carry, distribution, value) for a batch of raw observations `obs` (leaves [B, ...]).

    Feed-forward networks take and return `carry=None` and ignore
    `episode_start`; recurrent ones reset the carry where `episode_start` [B]
    is true (the observation is the first of its episode).
    """
    return network.step(params, carry, prepare_observations(obs_moments, obs), episode_start)


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


@struct.dataclass
class Segments:
    """A rollout cut into segments of consecutive steps of one environment: leaves [S, N, ...]
    (S steps each; N = T / S x B segments), with what recomputing their advantages needs."""

    obs: Any  # as the network saw them
    last_obs: Any  # leaves [N, ...]: the observation each segment's last step reached, normalised as `obs`
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array  # V_old(obs), for value clipping
    next_value: jax.Array  # V_old(final_obs): what a truncation inside a segment bootstraps from
    reward: jax.Array  # scaled, where the run scales rewards
    terminated: jax.Array
    truncated: jax.Array


def segment_rollout(transitions: Transition, rewards: jax.Array, obs: Any, final_obs: Any,
                    segment_length: int) -> Segments:
    """The rollout [T, B, ...] as [S, T / S x B, ...] segments of `segment_length` = S steps;
    segment k x B + b is steps k S to (k + 1) S - 1 of environment b. `rewards`, `obs` and
    `final_obs` are as the update uses them (scaled, normalised)."""

    def cut(x: jax.Array) -> jax.Array:
        num_steps = x.shape[0]
        x = x.reshape((num_steps // segment_length, segment_length) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1).reshape((segment_length, -1) + x.shape[3:])

    return Segments(
        obs=jax.tree.map(cut, obs),
        last_obs=jax.tree.map(lambda x: cut(x)[-1], final_obs),
        **{name: cut(getattr(transitions, name)) for name in ("action", "log_prob", "value", "next_value")},
        reward=cut(rewards),
        terminated=cut(transitions.terminated),
        truncated=cut(transitions.truncated),
    )


def take_segments(segments: Segments, index: jax.Array) -> Segments:
    """The segments `index` [n] of `segments`, steps in order."""
    return jax.tree.map(lambda x: x[:, index], segments.replace(last_obs=None)).replace(
        last_obs=jax.tree.map(lambda x: x[index], segments.last_obs))


def segment_advantages(segment: Segments, value: jax.Array, last_value: jax.Array, gamma: jax.Array,
                       gae_lambda: jax.Array) -> jax.Array:
    """GAE [S, n] within each of `segment`'s segments (leaves [S, n, ...]) from the current
    values of its observations `value` [S, n] and of the observations their last steps
    reached `last_value` [n].

    A step bootstraps from the value of the next step's observation, the last step from
    `last_value`; a truncation inside a segment, whose reached observation is not the next
    step's, from the rollout's value of it.
    """
    following_value = jnp.concatenate([value[1:], last_value[None]])
    inside = (jnp.arange(value.shape[0]) < value.shape[0] - 1)[:, None]
    next_value = jnp.where(inside & segment.truncated, segment.next_value, following_value)
    return gae(segment.reward, value, next_value, segment.terminated, segment.truncated, gamma, gae_lambda)


@struct.dataclass
class RunningMoments:
    """Moments of every sample seen so far, over all shards. `mean` and `m2` have the
    samples' structure: an array of the leaf's shape per float leaf, None per bool leaf."""

    count: jax.Array  # [] float32
    mean: Any
    m2: Any  # sum of squared deviations from the mean

    @property
    def variance(self) -> Any:
        """Population variance; 1 before any sample, so an untouched normaliser passes values through."""
        return jax.tree.map(lambda m2: jnp.where(self.count > 0, m2 / jnp.maximum(self.count, 1.0), 1.0), self.m2)


def _is_bool(leaf: Any) -> bool:
    return leaf.dtype == jnp.bool_


def init_moments(shape: tuple[int, ...]) -> RunningMoments:
    """Moments of samples that are one float array of `shape`."""
    return init_observation_moments(jax.ShapeDtypeStruct(shape, jnp.float32))


def init_observation_moments(observation: Any) -> RunningMoments:
    """Moments of samples shaped as `observation`, a pytree of jax.ShapeDtypeStruct
    (`EnvSpec.observation`): zeros per float leaf, None per bool leaf."""
    zeros = jax.tree.map(lambda leaf: None if _is_bool(leaf) else jnp.zeros(leaf.shape, jnp.float32), observation)
    return RunningMoments(count=jnp.zeros((), jnp.float32), mean=zeros, m2=zeros)


def merge_moments(a: RunningMoments, b: RunningMoments) -> RunningMoments:
    """The moments of the union of two sample sets (Chan, Golub and LeVeque), leaf by leaf."""
    count = a.count + b.count
    weight_b = b.count / jnp.maximum(count, 1.0)
    delta = jax.tree.map(jnp.subtract, b.mean, a.mean)
    return RunningMoments(
        count=count,
        mean=jax.tree.map(lambda mean, d: mean + d * weight_b, a.mean, delta),
        m2=jax.tree.map(lambda m2_a, m2_b, d: m2_a + m2_b + jnp.square(d) * a.count * weight_b, a.m2, b.m2, delta),
    )


def global_batch_moments(samples: Any, shards: DeviceShards) -> RunningMoments:
    """Moments of every shard's `samples` together: a pytree of float leaves
    [shards_per_device, N, ...] (N is the same on every leaf and every shard; None leaves
    are left out). Call inside a per-device function (`sharding.shard_parallel`).

    With equal counts the parallel merge of the S shard moments reduces to
    mean = mean_s(mean_i) and M2 = sum_i (M2_i + N (mean_i - mean)^2).
    """
    samples_per_shard = jax.tree.leaves(samples)[0].shape[1]
    local_mean = shards.map(lambda shard: jax.tree.map(lambda x: jnp.mean(x, axis=0), shard), samples)
    mean = shards.mean(local_mean)

    def local_m2(x: jax.Array, shard_mean: jax.Array, global_mean: jax.Array) -> jax.Array:
        return jnp.sum(jnp.square(x - shard_mean), axis=0) + samples_per_shard * jnp.square(shard_mean - global_mean)

    m2 = shards.sum(shards.map(
        lambda shard, shard_mean: jax.tree.map(local_m2, shard, shard_mean, mean), samples, local_mean
    ))
    return RunningMoments(count=jnp.float32(samples_per_shard * shards.num_shards(samples)), mean=mean, m2=m2)


def update_moments(moments: RunningMoments, samples: Any, shards: DeviceShards) -> RunningMoments:
    """`moments` with every shard's `samples` (leaves [shards_per_device, N, *leaf shape])
    merged in; bool leaves are skipped."""
    float_samples = jax.tree.map(lambda x: None if _is_bool(x) else x, samples)
    return merge_moments(moments, global_batch_moments(float_samples, shards))


def normalize(moments: RunningMoments, x: Any) -> Any:
    """`x` (leaves [..., *leaf shape]) standardised leaf by leaf by the running moments and
    clipped to +-OBS_CLIP; bool leaves as they are."""

    def standardise(leaf: jax.Array, mean: Any, variance: Any) -> jax.Array:
        if mean is None:
            return leaf
        return jnp.clip((leaf - mean) * jax.lax.rsqrt(variance + _VARIANCE_EPS), -OBS_CLIP, OBS_CLIP)

    return jax.tree.map(standardise, x, moments.mean, moments.variance)


def scale(moments: RunningMoments, x: jax.Array) -> jax.Array:
    """`x` divided by the running standard deviation (no centring: rewards keep their sign)."""
    return x * jax.lax.rsqrt(moments.variance + _VARIANCE_EPS)


def discounted_returns(
    running: jax.Array, rewards: jax.Array, dones: jax.Array, gamma: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The discounted return of each step so far in its episode, G_t = r_t + gamma G_{t-1}.

    `running` [B] is G before the rollout (0 at an episode start); `rewards`,
    `dones` [T, B]. Returns the running value after the rollout and G [T, B].
    """

    def step(previous: jax.Array, inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        reward, done = inputs
        current = reward + gamma * previous
        return jnp.where(done, 0.0, current), current

    return jax.lax.scan(step, running, (rewards, dones))


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
