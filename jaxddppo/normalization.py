"""Running statistics shared by every shard: the observation normaliser and the reward scaler.

Both keep `RunningMoments` (count, mean, M2 = sum of squared deviations). An
update merges one batch from every shard into them: each shard's batch moments
are combined with Chan et al.'s parallel formula through the shard collectives,
then merged into the running moments with the same formula. No E[x^2] - E[x]^2
appears, so large means do not cancel the variance. Every shard ends with the
same numbers, whatever the device count.

Samples may be pytrees (dict observations): the moments then hold one mean and
M2 per float leaf, and None for a bool leaf (an action mask), which is never
normalised.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxddppo.shards import DeviceShards

OBS_CLIP = 10.0  # normalised observations are clipped to [-OBS_CLIP, OBS_CLIP]
_VARIANCE_EPS = 1e-8
# Both scale by an explicit rsqrt: XLA turns x / sqrt(v) into x * rsqrt(v) only where the sqrt
# has one user, so a division would compute other bits depending on the program around it.


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
