"""An environment's own stepping rate beside the trainer's batched, auto-resetting one.

  core      the family adapter's `step` vmapped over the environments, with uniformly random
            (legal) actions, in one jitted `lax.scan`: no resets at all, the environment's
            own rate
  batch     the same through `envs.BatchedEnv.step`, as the trainer steps them: episode
            statistics and restarts from the reset pool
  batch_vmapped
            `BatchedEnv` under `vmap`, the environments split into `GROUPS` groups (how a
            batched sweep's members and a device's batched shards step)

All three run in one process, alternating over rounds, each timed over whole scans of
`num_steps` steps until every environment has taken at least `steps_per_env` steps (by
default two episodes of the environment's time limit, so restarts are inside the window).
Used by families.py and gpu.py; nothing in jaxddppo imports it.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxddppo.envs import BatchedEnv, make_env
from jaxddppo.envs.base import float_observation, random_actions, strongly_typed

GROUPS = 4
CONTENDERS = ("core", "batch", "batch_vmapped")


def default_steps_per_env(env: BatchedEnv, num_steps: int) -> int:
    """Two episodes of the time limit where one is known, else 16 scans."""
    return 2 * env.spec.max_episode_steps if env.spec.max_episode_steps else 16 * num_steps


def core_scan(env: BatchedEnv, num_steps: int) -> Callable:
    """(key, (obs, state)) -> ((obs, state), reward sum): `num_steps` vmapped core steps."""
    spec, core = env.spec, env.core

    def one(carry: tuple[Any, Any], step_key: jax.Array) -> tuple[tuple[Any, Any], jax.Array]:
        obs, state = carry
        action_key, env_key = jax.random.split(step_key)
        actions = random_actions(spec, action_key, obs)
        keys = jax.random.split(env_key, jax.tree.leaves(obs)[0].shape[0])
        obs, state, reward, _, _ = jax.vmap(core.step)(keys, state, actions)
        return (float_observation(obs), strongly_typed(state)), jnp.sum(reward)

    def scan(key: jax.Array, carry: tuple[Any, Any]) -> tuple[tuple[Any, Any], jax.Array]:
        carry, rewards = jax.lax.scan(one, carry, jax.random.split(key, num_steps))
        return carry, rewards.sum()

    return scan


def batch_scan(env: BatchedEnv, num_steps: int) -> Callable:
    """(key, (obs, episode state)) -> (..., reward sum): `num_steps` steps of `BatchedEnv.step`."""
    spec = env.spec

    def one(carry: tuple[Any, Any], step_key: jax.Array) -> tuple[tuple[Any, Any], jax.Array]:
        obs, state = carry
        action_key, env_key = jax.random.split(step_key)
        state, result = env.step(env_key, state, random_actions(spec, action_key, obs))
        return (result.obs, state), result.reward.sum()

    def scan(key: jax.Array, carry: tuple[Any, Any]) -> tuple[tuple[Any, Any], jax.Array]:
        carry, rewards = jax.lax.scan(one, carry, jax.random.split(key, num_steps))
        return carry, rewards.sum()

    return scan


def initial_carries(env: BatchedEnv, num_envs: int) -> dict[str, tuple[Callable, Any]]:
    """Each contender's jitted scan maker and first carry."""
    key = jax.random.key(0)
    # Jitted: eagerly, a reset that settles a body over many physics steps dispatches each
    # operation on its own (minutes for MJX's CheetahRun).
    obs, state = jax.jit(env.reset, static_argnums=1)(key, num_envs)
    core_obs, core_state = jax.jit(lambda key: env.reset(key, num_envs, auto_reset=False))(key)
    groups = jax.random.split(key, GROUPS)
    grouped = jax.jit(jax.vmap(lambda group_key: env.reset(group_key, num_envs // GROUPS)))(groups)
    return {
        "core": (core_scan, (core_obs, core_state.env_state)),
        "batch": (batch_scan, (obs, state)),
        "batch_vmapped": (lambda env, steps: _vmapped(batch_scan(env, steps)), grouped),
    }


def _vmapped(scan: Callable) -> Callable:
    def grouped(key: jax.Array, carry: Any) -> tuple[Any, jax.Array]:
        carry, totals = jax.vmap(scan)(jax.random.split(key, GROUPS), carry)
        return carry, totals.sum()

    return grouped


def measure_rates(env_id: str, num_envs: int, num_steps: int, rounds: int = 2, steps_per_env: int = 0,
                  optimistic_reset_ratio: int = 1) -> dict[str, Any]:
    """Steps/s of each contender (medians over `rounds`), their compile seconds, and the
    ratios to the core's rate."""
    if num_envs % GROUPS:
        raise ValueError(f"num_envs={num_envs} must be a multiple of {GROUPS} (the vmapped groups)")
    env = make_env(env_id, optimistic_reset_ratio)
    steps_per_env = steps_per_env or default_steps_per_env(env, num_steps)
    scans_per_round = -(-steps_per_env // num_steps)
    compiled, carries, compile_seconds = {}, {}, {}
    for name, (make_scan, carry) in initial_carries(env, num_envs).items():
        function = jax.jit(make_scan(env, num_steps))
        start = time.perf_counter()
        carry, total = function(jax.random.key(1), strongly_typed(carry))
        total.block_until_ready()
        compile_seconds[name] = time.perf_counter() - start
        print(f"{env_id} {name}: compiled in {compile_seconds[name]:.1f} s", file=sys.stderr, flush=True)
        # A second untimed call: the first call's outputs carry shardings its inputs lacked.
        carry, total = function(jax.random.key(2), carry)
        total.block_until_ready()
        compiled[name], carries[name] = function, carry
    rates: dict[str, list[float]] = {name: [] for name in compiled}
    for round_index in range(rounds):
        for name, function in compiled.items():
            carry = carries[name]
            start = time.perf_counter()
            for scan_index in range(scans_per_round):
                carry, total = function(jax.random.fold_in(jax.random.key(3 + round_index), scan_index), carry)
            total.block_until_ready()
            seconds = time.perf_counter() - start
            carries[name] = carry
            rates[name].append(num_envs * num_steps * scans_per_round / seconds)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "env_id": env_id, "num_envs": num_envs, "num_steps": num_steps, "steps_per_env": scans_per_round * num_steps,
        "steps_per_second": medians, "rounds": rates, "compile_seconds": compile_seconds,
        "batch_over_core": medians["batch"] / medians["core"],
        "batch_vmapped_over_core": medians["batch_vmapped"] / medians["core"],
    }
