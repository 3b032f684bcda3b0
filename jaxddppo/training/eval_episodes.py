"""Deterministic evaluation of a policy on device: one episode per environment.

`evaluate_policy` runs a batch of episodes on one device (`evaluate_policy_program`, its
jitted form, for a run's final evaluation). `evaluate_on_shards`
splits a fixed set of episodes over every shard and reduces the statistics over
all of them; each episode's key comes from its global episode index, so the
result does not depend on how many shards or devices run it.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxddppo.envs import BatchedEnv
from jaxddppo.networks import ActorCritic
from jaxddppo.rollout import RunningMoments, policy_step
from jaxddppo.sharding import DeviceShards


@struct.dataclass
class EvalResult:
    returns: jax.Array  # [num_episodes]
    lengths: jax.Array  # [num_episodes]


@struct.dataclass
class EvalStats:
    """Statistics over every episode of one evaluation, identical on every shard."""

    return_mean: jax.Array
    return_std: jax.Array  # population standard deviation, as numpy's std
    length_mean: jax.Array


@struct.dataclass
class _EvalCarry:
    env_state: Any
    obs: Any
    returns: jax.Array
    lengths: jax.Array
    finished: jax.Array
    step: jax.Array
    policy_carry: Any  # recurrent policies only, else None
    episode_start: Optional[jax.Array]  # recurrent policies only, else None


def evaluate_policy(
    env: BatchedEnv, network: ActorCritic, params: Any, key: jax.Array, num_episodes: int,
    obs_moments: Optional[RunningMoments] = None,
) -> EvalResult:
    """Run `num_episodes` environments with the policy's mode until each ends its first episode.

    The policy acts as in training (`rollout.policy_step`): observations
    normalised by `obs_moments` if given, recurrent carry from fresh episodes.
    Episodes that reach the time limit count as ended; an environment whose episode
    ended is not restarted (no reset work). Jittable.
    """
    key_reset, key_steps = jax.random.split(key)
    obs, env_state = env.reset(key_reset, num_episodes, auto_reset=False)
    zeros = jnp.zeros((num_episodes,), jnp.float32)
    episode_start = jnp.ones((num_episodes,), bool) if network.recurrent else None
    init = _EvalCarry(
        env_state, obs, zeros, zeros.astype(jnp.int32), zeros.astype(bool), jnp.zeros((), jnp.int32),
        network.initial_carry(num_episodes), episode_start,
    )
    max_steps = env.spec.max_episode_steps + 1

    def not_done(carry: _EvalCarry) -> jax.Array:
        running = jnp.logical_not(carry.finished.all())
        if env.spec.max_episode_steps == 0:  # no known limit (jumanji:Game2048-v1): every episode must end
            return running
        return jnp.logical_and(running, carry.step < max_steps)

    def step(carry: _EvalCarry) -> _EvalCarry:
        policy_carry, dist, _ = policy_step(
            network, params, obs_moments, carry.policy_carry, carry.obs, carry.episode_start
        )
        env_state, result = env.step_without_reset(jax.random.fold_in(key_steps, carry.step), carry.env_state,
                                                   dist.mode())
        done = result.terminated | result.truncated
        ended = jnp.logical_and(done, jnp.logical_not(carry.finished))
        return _EvalCarry(
            env_state=env_state,
            obs=result.obs,
            returns=jnp.where(ended, result.episode_return, carry.returns),
            lengths=jnp.where(ended, result.episode_length, carry.lengths),
            finished=carry.finished | ended,
            step=carry.step + 1,
            policy_carry=policy_carry,
            episode_start=done if network.recurrent else None,
        )

    final = jax.lax.while_loop(not_done, step, init)
    return EvalResult(returns=final.returns, lengths=final.lengths)


# The one jitted form of `evaluate_policy` for a run's final evaluation: `jaxddppo.evaluate`
# reproduces summary.json's result only while both compile this same program.
evaluate_policy_program = jax.jit(evaluate_policy, static_argnums=(0, 1, 4))


def episodes_per_shard(num_episodes: int, num_shards: int) -> int:
    """Episodes each shard runs; the last shards may run a few beyond `num_episodes`, which are masked."""
    return -(-num_episodes // num_shards)


def evaluate_on_shards(
    env: BatchedEnv, network: ActorCritic, params: Any, key: jax.Array, shard_index: jax.Array,
    num_episodes: int, num_shards: int, shards: DeviceShards, obs_moments: Optional[RunningMoments] = None,
) -> EvalStats:
    """The device's shards' (global indices `shard_index` [L]) share of `num_episodes`
    deterministic episodes, reduced over all shards: the same statistics on every device.

    Call inside a per-device function (`sharding.shard_parallel`). Episode `i` (global
    index) runs alone with key `fold_in(key, i)` on whichever shard holds it.
    """
    count = episodes_per_shard(num_episodes, num_shards)

    def shard_episodes(index: jax.Array) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
        indices = index * count + jnp.arange(count)
        results = jax.vmap(
            lambda i: evaluate_policy(env, network, params, jax.random.fold_in(key, i), 1, obs_moments)
        )(indices)
        mask = (indices < num_episodes).astype(jnp.float32)
        returns, lengths = results.returns[:, 0], results.lengths[:, 0].astype(jnp.float32)
        return returns, mask, (jnp.sum(mask * returns), jnp.sum(mask * lengths))

    returns, valid, sums = shards.map(shard_episodes, shard_index)
    # Sums over every shard's episodes; the variance is a second pass around the mean, so nothing cancels.
    return_sum, length_sum = shards.sum(sums)
    return_mean, length_mean = return_sum / num_episodes, length_sum / num_episodes
    squares = shards.sum(shards.map(
        lambda shard_returns, mask: jnp.sum(mask * jnp.square(shard_returns - return_mean)), returns, valid
    ))
    return EvalStats(return_mean=return_mean, return_std=jnp.sqrt(squares / num_episodes), length_mean=length_mean)
