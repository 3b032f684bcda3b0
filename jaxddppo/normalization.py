"""Running statistics shared by every shard: the observation normaliser and the reward scaler.

Both keep `RunningMoments` (count, mean, M2 = sum of squared deviations). An
update merges one batch from every shard into them: each shard's batch moments
are combined with Chan et al.'s parallel formula through the shard collectives,
then merged into the running moments with the same formula. No E[x^2] - E[x]^2
appears, so large means do not cancel the variance. Every shard ends with the
same numbers, whatever the device count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxddppo.sharding import pmean_over_shards, psum_over_shards

OBS_CLIP = 10.0  # normalised observations are clipped to [-OBS_CLIP, OBS_CLIP]
_VARIANCE_EPS = 1e-8


@struct.dataclass
class RunningMoments:
    """Moments of every sample seen so far, over all shards; mean and m2 have the sample shape."""

    count: jax.Array  # [] float32
    mean: jax.Array
    m2: jax.Array  # sum of squared deviations from the mean

    @property
    def variance(self) -> jax.Array:
        """Population variance; 1 before any sample, so an untouched normaliser passes values through."""
        return jnp.where(self.count > 0, self.m2 / jnp.maximum(self.count, 1.0), 1.0)


def init_moments(shape: tuple[int, ...]) -> RunningMoments:
    zeros = jnp.zeros(shape, jnp.float32)
    return RunningMoments(count=jnp.zeros((), jnp.float32), mean=zeros, m2=zeros)


def merge_moments(a: RunningMoments, b: RunningMoments) -> RunningMoments:
    """The moments of the union of two sample sets (Chan, Golub and LeVeque)."""
    count = a.count + b.count
    weight_b = b.count / jnp.maximum(count, 1.0)
    delta = b.mean - a.mean
    return RunningMoments(
        count=count,
        mean=a.mean + delta * weight_b,
        m2=a.m2 + b.m2 + jnp.square(delta) * a.count * weight_b,
    )


def global_batch_moments(samples: jax.Array) -> RunningMoments:
    """Moments of every shard's `samples` [N, ...] together (N is the same on every shard).

    With equal counts the parallel merge of the S shard moments reduces to
    mean = mean_s(mean_i) and M2 = sum_i (M2_i + N (mean_i - mean)^2).
    Call inside a function wrapped by `shard_parallel`.
    """
    num_local = samples.shape[0]
    local_mean = jnp.mean(samples, axis=0)
    mean = pmean_over_shards(local_mean)
    local_m2 = jnp.sum(jnp.square(samples - local_mean), axis=0) + num_local * jnp.square(local_mean - mean)
    m2, count = psum_over_shards((local_m2, jnp.float32(num_local)))
    return RunningMoments(count=count, mean=mean, m2=m2)


def update_moments(moments: RunningMoments, samples: jax.Array) -> RunningMoments:
    """`moments` with every shard's `samples` [N, *sample_shape] merged in."""
    return merge_moments(moments, global_batch_moments(samples))


def normalize(moments: RunningMoments, x: jax.Array) -> jax.Array:
    """`x` [..., *sample_shape] standardised by the running moments and clipped to +-OBS_CLIP."""
    standardised = (x - moments.mean) / jnp.sqrt(moments.variance + _VARIANCE_EPS)
    return jnp.clip(standardised, -OBS_CLIP, OBS_CLIP)


def scale(moments: RunningMoments, x: jax.Array) -> jax.Array:
    """`x` divided by the running standard deviation (no centring: rewards keep their sign)."""
    return x / jnp.sqrt(moments.variance + _VARIANCE_EPS)


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
