"""An environment's own stepping rate beside the trainer's batched, auto-resetting one:
`python benchmarks/env_rates.py ENV_ID --num-envs N --num-steps T [--rounds R] [--contenders
core,batch] [--xla-defaults] [--out FILE]`.

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

Every scan and the first states compile at once, each in a thread of its own, with the
options the trainer compiles its programs with on this backend (`run.cpu_tuning`'s on CPU;
`--xla-defaults`: XLA's own); then all run in one process, alternating over rounds, each
timed over whole scans of `num_steps` steps until every environment has taken at least
`steps_per_env` steps (by default two episodes of the environment's time limit, so
restarts are inside the window).
families.py and gpu.py run it, each measurement a process of its own
(`bench.env_rates_command`); nothing in jaxddppo imports it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxddppo.config.options import START_STATES
from jaxddppo.cpu import tuning as cpu_tuning
from jaxddppo.envs import BatchedEnv, batch_size, make_env
from jaxddppo.envs.base import float_observation, random_actions, strongly_typed

GROUPS = 4
CONTENDERS = ("core", "batch", "batch_vmapped")
LABELS = {"batch": "BatchedEnv", "batch_vmapped": f"vmapped in {GROUPS} groups", "brax": "Brax's training env"}


def valid_contenders(contenders: Sequence[str]) -> bool:
    """The core among them, and nothing but `CONTENDERS`."""
    return "core" in contenders and set(contenders) <= set(CONTENDERS)


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


def brax_training_env(env: BatchedEnv) -> Any:
    """The Playground task behind `env` as Brax PPO trains it (Playground's training wrapper)."""
    from mujoco_playground import wrapper

    core = env.core
    return wrapper.wrap_for_brax_training(core.env, episode_length=core.episode_length,
                                          action_repeat=core.action_repeat)


def brax_scan(brax_env: Any, spec: Any) -> Callable:
    """A scan maker over `brax_env`'s steps with the same random actions as the others."""

    def one(state: Any, step_key: jax.Array) -> tuple[Any, jax.Array]:
        state = brax_env.step(state, random_actions(spec, step_key, state.obs))
        return state, state.reward.sum()

    return lambda unused_env, num_steps: scan_of(one, num_steps)


def contender_scans(env: BatchedEnv, num_envs: int, contenders: Sequence[str] = CONTENDERS,
                    with_brax: bool = False) -> tuple[dict[str, Callable], Callable[[], dict[str, Any]]]:
    """The scan maker of each of `contenders` (and Brax's), and a jittable function of no
    arguments that returns each one's first carry."""
    makers: dict[str, Callable] = {"core": core_scan, "batch": batch_scan,
                                   "batch_vmapped": lambda env, steps: _vmapped(batch_scan(env, steps))}
    makers = {name: makers[name] for name in contenders}
    brax_env = brax_training_env(env) if with_brax else None
    if brax_env is not None:
        makers["brax"] = brax_scan(brax_env, env.spec)

    def first_carries() -> dict[str, Any]:
        key = jax.random.key(0)
        obs, state = env.reset(key, num_envs)
        carries = {"core": (obs, state.env_state), "batch": (obs, state)}
        if "batch_vmapped" in makers:
            carries["batch_vmapped"] = jax.vmap(lambda group_key: env.reset(group_key, num_envs // GROUPS))(
                jax.random.split(key, GROUPS))
        if brax_env is not None:
            carries["brax"] = brax_env.reset(jax.random.split(jax.random.PRNGKey(0), num_envs))
        return strongly_typed({name: carries[name] for name in makers})

    return makers, first_carries


def _vmapped(scan: Callable) -> Callable:
    def grouped(key: jax.Array, carry: Any) -> tuple[Any, jax.Array]:
        carry, totals = jax.vmap(scan)(jax.random.split(key, GROUPS), carry)
        return carry, totals.sum()

    return grouped


def compile_all(lowerings: dict[str, Callable[[], jax.stages.Lowered]],
                options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """Each program of `lowerings` lowered and compiled with `options` in a thread of its own
    (XLA compiles without holding Python's GIL), and the seconds each took with the others
    beside it."""

    def timed(lower: Callable[[], jax.stages.Lowered]) -> tuple[Any, float]:
        start = time.perf_counter()
        program = lower().compile(options)
        return program, time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=len(lowerings)) as pool:
        futures = {name: pool.submit(timed, lower) for name, lower in lowerings.items()}
        done = {name: future.result() for name, future in futures.items()}
    return {name: program for name, (program, _) in done.items()}, {name: seconds for name, (_, seconds) in done.items()}


def measure_rates(env_id: str, num_envs: int, num_steps: int, rounds: int = 2, steps_per_env: int = 0,
                  optimistic_reset_ratio: int = 1, start_states: str = "fresh",
                  with_brax: bool = False, contenders: Sequence[str] = CONTENDERS,
                  xla_defaults: bool = False) -> dict[str, Any]:
    """Steps/s of each of `contenders` (the core's always among them; medians over
    `rounds`), their compile seconds (every scan and the first states compile at once,
    each beside the others, with the trainer's compiler options for a program that runs
    many times, or XLA's defaults), and the ratios to the core's rate."""
    if not valid_contenders(contenders):
        raise ValueError(f"contenders={list(contenders)} must include 'core' and name only {list(CONTENDERS)}")
    if num_envs % GROUPS:
        raise ValueError(f"num_envs={num_envs} must be a multiple of {GROUPS} (the vmapped groups)")
    env = make_env(env_id, optimistic_reset_ratio, start_states)
    steps_per_env = steps_per_env or default_steps_per_env(env, num_steps)
    scans_per_round = -(-steps_per_env // num_steps)
    makers, first_carries = contender_scans(env, num_envs, contenders, with_brax)
    # Jitted: eagerly, a reset that settles a body over many physics steps dispatches each
    # operation on its own (minutes for MJX's CheetahRun).
    traced_firsts = jax.jit(first_carries).trace()
    shapes, step_key = traced_firsts.out_info, jax.random.key(1)
    lowerings = {name: (lambda make_scan=make_scan, name=name:
                        jax.jit(make_scan(env, num_steps)).lower(step_key, shapes[name]))
                 for name, make_scan in makers.items()}
    options = {} if xla_defaults else cpu_tuning.compiler_options(jax.devices()[0].platform, runs_once=False)
    start = time.perf_counter()
    compiled, compile_seconds = compile_all({**lowerings, "first carries": traced_firsts.lower}, options)
    compile_wall_seconds = time.perf_counter() - start
    print(f"{env_id}: compiled {', '.join(f'{name} in {compile_seconds[name]:.1f} s' for name in compile_seconds)}, "
          f"{compile_wall_seconds:.1f} s in all", file=sys.stderr, flush=True)
    carries = compiled.pop("first carries")()
    for name, function in compiled.items():  # an untimed first call of each
        carries[name], total = function(step_key, carries[name])
        total.block_until_ready()
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
        "compiler_options": options,
        "steps_per_env": scans_per_round * num_steps,
        "steps_per_second": medians, "rounds": rates, "compile_wall_seconds": compile_wall_seconds,
        "compile_seconds": {name: compile_seconds[name] for name in compiled},
        **{f"{name}_over_core": medians[name] / medians["core"] for name in medians if name != "core"},
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    from bench import OneLineParser

    parser = OneLineParser(prog="python benchmarks/env_rates.py",
                           description="Steps/s of an environment's core beside the trainer's BatchedEnv.")
    parser.add_argument("env_id", help="an env.id, e.g. playground:CheetahRun")
    parser.add_argument("--num-envs", type=int, default=256, help="environments (a multiple of 4; default 256)")
    parser.add_argument("--num-steps", type=int, default=32, help="steps per jitted scan (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the contenders (default 2)")
    parser.add_argument("--steps-per-env", type=int, default=0,
                        help="steps each environment takes per round (default: two episodes of the time limit)")
    parser.add_argument("--optimistic-reset-ratio", type=int, default=1, help="env.optimistic_reset_ratio (default 1)")
    parser.add_argument("--start-states", choices=START_STATES, default="fresh",
                        help="env.start_states (default fresh)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated, the core among them (default {','.join(CONTENDERS)})")
    parser.add_argument("--with-brax", action="store_true",
                        help="also step a playground: task as Brax PPO does (Playground's training wrapper)")
    parser.add_argument("--xla-defaults", action="store_true",
                        help="compile with XLA's default options, not the trainer's (run.cpu_tuning's on CPU)")
    parser.add_argument("--out", help="write the result as JSON to this file")
    args = parser.parse_args(argv)
    if args.num_envs < GROUPS or args.num_envs % GROUPS:
        parser.error(f"--num-envs={args.num_envs} must be a positive multiple of {GROUPS}")
    if args.with_brax and not args.env_id.startswith("playground:"):
        parser.error(f"--with-brax needs a playground: id, not {args.env_id!r}")
    if min(args.num_steps, args.rounds) < 1 or args.steps_per_env < 0:
        parser.error("--num-steps and --rounds must be at least 1, --steps-per-env at least 0")
    contenders = tuple(name for name in args.contenders.split(",") if name)
    if not valid_contenders(contenders):
        parser.error(f"--contenders={args.contenders} must include core and name only {','.join(CONTENDERS)}")
    result = measure_rates(args.env_id, args.num_envs, args.num_steps, args.rounds, args.steps_per_env,
                           args.optimistic_reset_ratio, args.start_states, args.with_brax, contenders,
                           args.xla_defaults)
    rates = result["steps_per_second"]
    print(f"{args.env_id}, {args.num_envs} envs, {result['steps_per_env']} steps each per round: core "
          f"{rates['core']:,.0f} steps/s"
          + "".join(f", {LABELS[name]} {rates[name]:,.0f} ({result[f'{name}_over_core']:.2f}x)"
                    for name in rates if name != "core"))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
