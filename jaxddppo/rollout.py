"""Rollouts of a batch of environments under the policy (`lax.scan`), and GAE."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxddppo.envs import BatchedEnv, EpisodeState, batch_size

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
    final_obs: Any  # observation reached by the step, before any auto-reset
    next_value: jax.Array  # V_old(final_obs); recurrent policies: with the carry after the step
    episode_start: Optional[jax.Array] = None  # recurrent policies only: the carry was reset before obs


@struct.dataclass
class RolloutState:
    """What a shard carries from one rollout to the next."""

    env: EpisodeState
    obs: Any  # leaves [B, ...]
    carry: Any = None  # recurrent policies: the carry before acting on obs
    episode_start: Optional[jax.Array] = None  # recurrent policies: [B] obs is an episode's first
    discounted_return: Optional[jax.Array] = None  # reward scaling: [B] discounted return so far


@struct.dataclass
class EpisodeStats:
    """Sums over the episodes that ended during a rollout."""

    return_sum: jax.Array
    length_sum: jax.Array
    count: jax.Array


def collect_rollout(
    env: BatchedEnv, policy: PolicyFn, params: Any, state: RolloutState, key: jax.Array, num_steps: int,
    critic_after_steps: bool = False,
) -> tuple[RolloutState, Transition, EpisodeStats]:
    """Step every environment `num_steps` times with actions sampled from the policy.

    A recurrent policy (`state.carry` not None) carries its state from step to
    step, resets it where an episode starts, and values each step's final_obs
    with the carry the step produced. A feed-forward policy values the final_obs
    of all steps after the last one, in one pass, and with `critic_after_steps`
    the observations acted on too, in another: the steps then leave the critic
    out (XLA drops it from the loop), which pays when it has a torso of its own
    and the batch is small (large products instead of T small ones, each with a
    fixed cost); with a torso shared with the actor, a value at each step costs
    only its head.
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
        next_value, episode_start = None, None
        if recurrent:
            done = result.terminated | result.truncated
            _, _, next_value = policy(params, policy_carry, result.final_obs, jnp.zeros_like(done))
            episode_start = carry.episode_start
            next_state = next_state.replace(carry=policy_carry, episode_start=done)
        transition = Transition(
            obs=carry.obs,
            action=action,
            log_prob=dist.log_prob(action),
            value=None if critic_after_steps else value,
            reward=result.reward,
            terminated=result.terminated,
            truncated=result.truncated,
            final_obs=result.final_obs,
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
        transitions = transitions.replace(next_value=policy(params, None, transitions.final_obs, None)[2])
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
