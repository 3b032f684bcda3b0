"""An environment's own stepping rate beside the trainer's batched, auto-resetting one:
`python benchmarks/env_rates.py ENV_ID --num-envs N --num-steps T [--rounds R] [--out FILE]`.

  core      the family adapter's `step` vmapped over the environments, with uniformly random
            (legal) actions, in one jitted `lax.scan`: no resets at all, the environment's
            own rate
  batch     the same through `envs.BatchedEnv.step`, as the trainer steps them: episode
            statistics and restarts from the reset pool
  batch_vmapped
            `BatchedEnv` under `vmap`, the environments split into `GROUPS` groups (how a
            batched sweep's members and a device's batched shards step)
  brax      with `--with-brax`, for a `playground:` id: the same task through Playground's
            `wrap_for_brax_training`, as Brax PPO steps it (restarts from each environment's
            cached first state), with the same random actions

All run in one process, alternating over rounds, each timed over whole scans of
`num_steps` steps until every environment has taken at least `steps_per_env` steps (by
default two episodes of the environment's time limit, so restarts are inside the window).
Used by families.py and gpu.py; nothing in jaxddppo imports it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxddppo.config import START_STATES
from jaxddppo.envs import BatchedEnv, batch_size, make_env
from jaxddppo.envs.base import float_observation, random_actions, strongly_typed

GROUPS = 4
CONTENDERS = ("core", "batch", "batch_vmapped")


def default_steps_per_env(env: BatchedEnv, num_steps: int) -> int:
    """Two episodes of the time limit where one is known, else 16 scans."""
    return 2 * env.spec.max_episode_steps if env.spec.max_episode_steps else 16 * num_steps


def scan_of(one: Callable[[Any, jax.Array], tuple[Any, jax.Array]], num_steps: int) -> Callable:
    """(key, carry) -> (carry, reward sum): `one` (carry, step key) -> (carry, rewards) over
    `num_steps` keys split from `key`."""

    def scan(key: jax.Array, carry: Any) -> tuple[Any, jax.Array]:
        carry, rewards = jax.lax.scan(one, carry, jax.random.split(key, num_steps))
        return carry, rewards.sum()

    return scan


def core_scan(env: BatchedEnv, num_steps: int) -> Callable:
    """(key, (obs, state)) -> ((obs, state), reward sum): `num_steps` vmapped core steps."""
    spec, core = env.spec, env.core

    def one(carry: tuple[Any, Any], step_key: jax.Array) -> tuple[tuple[Any, Any], jax.Array]:
        obs, state = carry
        action_key, env_key = jax.random.split(step_key)
        actions = random_actions(spec, action_key, obs)
        keys = jax.random.split(env_key, batch_size(obs))
        obs, state, reward, _, _ = jax.vmap(core.step)(keys, state, actions)
        return (float_observation(obs), strongly_typed(state)), jnp.sum(reward)

    return scan_of(one, num_steps)


def batch_scan(env: BatchedEnv, num_steps: int) -> Callable:
    """(key, (obs, episode state)) -> (..., reward sum): `num_steps` steps of `BatchedEnv.step`."""
    spec = env.spec

    def one(carry: tuple[Any, Any], step_key: jax.Array) -> tuple[tuple[Any, Any], jax.Array]:
        obs, state = carry
        action_key, env_key = jax.random.split(step_key)
        state, result = env.step(env_key, state, random_actions(spec, action_key, obs))
        return (result.obs, state), result.reward.sum()

    return scan_of(one, num_steps)


def brax_contender(env: BatchedEnv, num_envs: int) -> tuple[Callable, Any]:
    """A scan maker and first state of the Playground task behind `env` as Brax's training steps it."""
    from mujoco_playground import wrapper

    core = env.core
    brax_env = wrapper.wrap_for_brax_training(core.env, episode_length=core.episode_length,
                                              action_repeat=core.action_repeat)

    def one(state: Any, step_key: jax.Array) -> tuple[Any, jax.Array]:
        state = brax_env.step(state, random_actions(env.spec, step_key, state.obs))
        return state, state.reward.sum()

    def make_scan(unused_env: BatchedEnv, num_steps: int) -> Callable:
        return scan_of(one, num_steps)

    first = jax.jit(brax_env.reset)(jax.random.split(jax.random.PRNGKey(0), num_envs))
    return make_scan, first


def initial_carries(env: BatchedEnv, num_envs: int, contenders: Sequence[str] = CONTENDERS,
                    with_brax: bool = False) -> dict[str, tuple[Callable, Any]]:
    """The jitted scan maker and first carry of each of `contenders` (and Brax's)."""
    key = jax.random.key(0)
    # Jitted: eagerly, a reset that settles a body over many physics steps dispatches each
    # operation on its own (minutes for MJX's CheetahRun).
    obs, state = jax.jit(env.reset, static_argnums=1)(key, num_envs)
    carries: dict[str, tuple[Callable, Any]] = {"core": (core_scan, (obs, state.env_state)),
                                                "batch": (batch_scan, (obs, state))}
    if "batch_vmapped" in contenders:
        grouped = jax.jit(jax.vmap(lambda group_key: env.reset(group_key, num_envs // GROUPS)))(
            jax.random.split(key, GROUPS))
        carries["batch_vmapped"] = (lambda env, steps: _vmapped(batch_scan(env, steps)), grouped)
    carries = {name: carries[name] for name in contenders}
    if with_brax:
        carries["brax"] = brax_contender(env, num_envs)
    return carries


def _vmapped(scan: Callable) -> Callable:
    def grouped(key: jax.Array, carry: Any) -> tuple[Any, jax.Array]:
        carry, totals = jax.vmap(scan)(jax.random.split(key, GROUPS), carry)
        return carry, totals.sum()

    return grouped


def measure_rates(env_id: str, num_envs: int, num_steps: int, rounds: int = 2, steps_per_env: int = 0,
                  optimistic_reset_ratio: int = 1, start_states: str = "fresh",
                  with_brax: bool = False, contenders: Sequence[str] = CONTENDERS) -> dict[str, Any]:
    """Steps/s of each of `contenders` (the core's always among them; medians over
    `rounds`), their compile seconds, and the ratios to the core's rate."""
    if "core" not in contenders or not set(contenders) <= set(CONTENDERS):
        raise ValueError(f"contenders={list(contenders)} must include 'core' and name only {list(CONTENDERS)}")
    if num_envs % GROUPS:
        raise ValueError(f"num_envs={num_envs} must be a multiple of {GROUPS} (the vmapped groups)")
    env = make_env(env_id, optimistic_reset_ratio, start_states)
    steps_per_env = steps_per_env or default_steps_per_env(env, num_steps)
    scans_per_round = -(-steps_per_env // num_steps)
    compiled, carries, compile_seconds = {}, {}, {}
    for name, (make_scan, carry) in initial_carries(env, num_envs, contenders, with_brax).items():
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
        keys = jax.block_until_ready(list(jax.random.split(jax.random.key(3 + round_index), scans_per_round)))
        for name, function in compiled.items():
            carry = carries[name]
            start = time.perf_counter()
            for scan_index in range(scans_per_round):
                carry, total = function(keys[scan_index], carry)
            total.block_until_ready()
            seconds = time.perf_counter() - start
            carries[name] = carry
            rates[name].append(num_envs * num_steps * scans_per_round / seconds)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "env_id": env_id, "num_envs": num_envs, "num_steps": num_steps, "start_states": start_states,
        "steps_per_env": scans_per_round * num_steps,
        "steps_per_second": medians, "rounds": rates, "compile_seconds": compile_seconds,
        **{f"{name}_over_core": medians[name] / medians["core"] for name in medians if name != "core"},
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    from bench import OneLineParser

    parser = OneLineParser(prog="python benchmarks/env_rates.py",
                           description="Steps/s of an environment's core beside the trainer's BatchedEnv.")
    parser.add_argument("env_id", help="an env.id, e.g. playground:CheetahRun")
    parser.add_argument("--num-envs", type=int, default=256, help="environments (a multiple of 4; default 256)")
    parser.add_argument("--num-steps", type=int, default=32, help="steps per jitted scan (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three contenders (default 2)")
    parser.add_argument("--steps-per-env", type=int, default=0,
                        help="steps each environment takes per round (default: two episodes of the time limit)")
    parser.add_argument("--optimistic-reset-ratio", type=int, default=1, help="env.optimistic_reset_ratio (default 1)")
    parser.add_argument("--start-states", choices=START_STATES, default="fresh",
                        help="env.start_states (default fresh)")
    parser.add_argument("--with-brax", action="store_true",
                        help="also step a playground: task as Brax PPO does (Playground's training wrapper)")
    parser.add_argument("--out", help="write the result as JSON to this file")
    args = parser.parse_args(argv)
    if args.num_envs < GROUPS or args.num_envs % GROUPS:
        parser.error(f"--num-envs={args.num_envs} must be a positive multiple of {GROUPS}")
    if args.with_brax and not args.env_id.startswith("playground:"):
        parser.error(f"--with-brax needs a playground: id, not {args.env_id!r}")
    if min(args.num_steps, args.rounds) < 1 or args.steps_per_env < 0:
        parser.error("--num-steps and --rounds must be at least 1, --steps-per-env at least 0")
    result = measure_rates(args.env_id, args.num_envs, args.num_steps, args.rounds, args.steps_per_env,
                           args.optimistic_reset_ratio, args.start_states, args.with_brax)
    rates = result["steps_per_second"]
    print(f"{args.env_id}, {args.num_envs} envs, {result['steps_per_env']} steps each per round: core "
          f"{rates['core']:,.0f} steps/s, BatchedEnv {rates['batch']:,.0f} ({result['batch_over_core']:.2f}x), "
          f"vmapped in {GROUPS} groups {rates['batch_vmapped']:,.0f} ({result['batch_vmapped_over_core']:.2f}x)"
          + (f", Brax's training env {rates['brax']:,.0f} ({result['brax_over_core']:.2f}x)" if args.with_brax else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
