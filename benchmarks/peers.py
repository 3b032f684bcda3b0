"""One trial of a peer PPO in this process, as benchmarks/bench.py starts it:

    python benchmarks/peers.py rejax|purejaxrl --spec JSON --seeds N --out FILE [--purejaxrl PATH]

Trains the benchmark config `--spec` (bench.py's CONFIGS) with rejax's PPO or
PureJaxRL's (`--purejaxrl`: a clone of https://github.com/luchris429/purejaxrl,
run unmodified through benchmarks/gymnax_shim.py), one run or, with N >= 1 seeds,
the training vmapped over N seeds, and writes the result as JSON to FILE. Both
train in one jitted call: compile_seconds is lowering and compiling it,
train_seconds its first call (all of training, first execution included) and
steady_seconds a second call of the compiled program. final_return is, for
rejax, the mean return of 128 episodes of the final policy after the clock
stops, and for PureJaxRL its own training metric: each environment's last
finished episode at the end of training. Over seeds, the mean.

    python benchmarks/peers.py purejaxrl --curve --spec JSON --seed S --out FILE --purejaxrl PATH

is one trial of benchmarks/learning.py: PureJaxRL trains once from seed S (no
second call), and the result adds its learning curve: the mean return of the
episodes that ended in each update (from the metrics its train function
returns) and the process's age when its one training call started.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import gymnax_shim
from process_clock import process_age_seconds

EVAL_EPISODES = 128


@dataclass(frozen=True)
class Timed:
    """The output of a training call and its seconds: compile, first call and second call."""

    output: Any
    compile_seconds: float
    train_seconds: float
    steady_seconds: float


def time_training(train: Callable[[jax.Array], Any], seeds: int, seed: int = 0, steady: bool = True) -> Timed:
    """Compile `train` (vmapped over `seeds` keys split from `seed`'s; a single key where 0), then
    call it twice, or once without `steady` (steady_seconds is then 0)."""
    keys = jax.random.split(jax.random.key(seed), max(seeds, 1))
    function, argument = (jax.vmap(train), keys) if seeds else (train, keys[0])
    start = time.perf_counter()
    compiled = jax.jit(function).lower(argument).compile()
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    output = jax.block_until_ready(compiled(argument))
    train_seconds = time.perf_counter() - start
    if not steady:
        return Timed(output, compile_seconds, train_seconds, 0.0)
    start = time.perf_counter()
    jax.block_until_ready(compiled(argument))
    steady_seconds = time.perf_counter() - start
    return Timed(output, compile_seconds, train_seconds, steady_seconds)


def result(timed: Timed, env_steps: int, final_return: float) -> dict[str, Any]:
    """A trial's result, as bench.py reads it."""
    return {
        "env_steps": env_steps,
        "train_seconds": timed.train_seconds,
        "steady_env_steps": env_steps,
        "steady_seconds": timed.steady_seconds,
        "compile_seconds": timed.compile_seconds,
        "final_return": final_return,
    }


def rejax_returns(algo: Any, env: Any, env_params: Any, actor_params: Any, seeds: int) -> jax.Array:
    """The mean return of EVAL_EPISODES episodes of each member's final policy."""
    from rejax.evaluate import evaluate_single

    max_steps = int(env_params.max_steps_in_episode)

    def member_return(params: Any, key: jax.Array) -> jax.Array:
        def act(obs: jax.Array, rng: jax.Array) -> jax.Array:
            return jnp.squeeze(algo.actor.apply(params, obs[None], rng, method="act"))

        episode_keys = jax.random.split(key, EVAL_EPISODES)
        _, returns = jax.vmap(lambda k: evaluate_single(act, env, env_params, k, max_steps))(episode_keys)
        return returns.mean()

    evaluate = jax.vmap(member_return, in_axes=(0, None)) if seeds else member_return
    return jax.jit(evaluate)(actor_params, jax.random.key(1))


def run_rejax(spec: dict[str, Any], seeds: int) -> dict[str, Any]:
    from rejax import PPO

    env, env_params = gymnax_shim.make(spec["env_id"])
    total = spec["total_env_steps"]
    algo = PPO.create(
        env=env, env_params=env_params, num_envs=spec["num_envs"], num_steps=spec["num_steps"],
        num_epochs=spec["num_epochs"], num_minibatches=spec["num_minibatches"],
        learning_rate=spec["learning_rate"], max_grad_norm=spec["max_grad_norm"], gamma=spec["gamma"],
        gae_lambda=spec["gae_lambda"], clip_eps=spec["clip_eps"], vf_coef=spec["vf_coef"],
        ent_coef=spec["ent_coef"], total_timesteps=total, eval_freq=total, skip_initial_evaluation=True,
        agent_kwargs={"activation": spec["activation"], "hidden_layer_sizes": tuple(spec["hidden_sizes"])},
    )
    # Training only: rejax's periodic evaluation is replaced by nothing and the final return
    # is measured after the clock stops.
    algo = algo.replace(eval_callback=lambda algo, train_state, key: jnp.zeros(()))
    timed = time_training(algo.train, seeds)
    train_state, _ = timed.output
    returns = rejax_returns(algo, env, env_params, train_state.actor_ts.params, seeds)
    iterations = -(-total // (spec["num_envs"] * spec["num_steps"]))  # rejax rounds up
    env_steps = iterations * spec["num_envs"] * spec["num_steps"] * max(seeds, 1)
    return result(timed, env_steps, float(jnp.mean(returns)))


def purejaxrl_config(spec: dict[str, Any]) -> dict[str, Any]:
    """PureJaxRL's config dict of a benchmark spec (its network is fixed at two layers of 64)."""
    if spec["hidden_sizes"] != [64, 64]:
        raise ValueError(f"PureJaxRL's network has hidden sizes [64, 64], not {spec['hidden_sizes']}")
    return {
        "ENV_NAME": spec["env_id"], "NUM_ENVS": spec["num_envs"], "NUM_STEPS": spec["num_steps"],
        "TOTAL_TIMESTEPS": spec["total_env_steps"], "UPDATE_EPOCHS": spec["num_epochs"],
        "NUM_MINIBATCHES": spec["num_minibatches"], "LR": spec["learning_rate"],
        "ANNEAL_LR": spec.get("anneal_lr", False),
        "GAMMA": spec["gamma"], "GAE_LAMBDA": spec["gae_lambda"], "CLIP_EPS": spec["clip_eps"],
        "VF_COEF": spec["vf_coef"], "ENT_COEF": spec["ent_coef"], "MAX_GRAD_NORM": spec["max_grad_norm"],
        "ACTIVATION": spec["activation"], "DEBUG": False,
    }


def purejaxrl_ppo(clone: Path) -> Any:
    """PureJaxRL's purejaxrl/ppo.py from `clone`, on gymnax 1.0."""
    gymnax_shim.prepare_purejaxrl()
    sys.path.insert(0, str(clone / "purejaxrl"))
    import ppo

    return ppo


def run_purejaxrl(spec: dict[str, Any], seeds: int, clone: Path) -> dict[str, Any]:
    timed = time_training(purejaxrl_ppo(clone).make_train(purejaxrl_config(spec)), seeds)
    # [seeds,] updates, steps, envs: each environment's last finished episode, at the last step.
    returns = timed.output["metrics"]["returned_episode_returns"][..., -1, -1, :]
    updates = spec["total_env_steps"] // (spec["num_envs"] * spec["num_steps"])  # PureJaxRL rounds down
    env_steps = updates * spec["num_envs"] * spec["num_steps"] * max(seeds, 1)
    return result(timed, env_steps, float(jnp.mean(returns)))


def episode_return_means(returns: np.ndarray, ended: np.ndarray) -> list[Optional[float]]:
    """Per update, the mean return of the episodes that ended in it (None where none did), from
    PureJaxRL's LogWrapper metrics [updates, steps, envs]: `returned_episode_returns` and
    `returned_episode`. jaxddppo's metrics.jsonl `episode_return_mean` is the same statistic."""
    ended = ended.astype(np.float64)
    counts = ended.sum(axis=(1, 2))
    sums = (returns.astype(np.float64) * ended).sum(axis=(1, 2))
    return [float(total / count) if count else None for total, count in zip(sums, counts)]


def run_purejaxrl_curve(spec: dict[str, Any], seed: int, clone: Path) -> dict[str, Any]:
    """One training run of PureJaxRL from `seed`, with its curve (benchmarks/learning.py)."""
    timed = time_training(purejaxrl_ppo(clone).make_train(purejaxrl_config(spec)), 0, seed=seed, steady=False)
    call_start_seconds = process_age_seconds() - timed.train_seconds
    metrics = timed.output["metrics"]
    returns = episode_return_means(np.asarray(metrics["returned_episode_returns"]),
                                   np.asarray(metrics["returned_episode"]))
    steps_per_update = spec["num_envs"] * spec["num_steps"]
    return {
        "env_steps": len(returns) * steps_per_update,
        "update_env_steps": [(index + 1) * steps_per_update for index in range(len(returns))],
        "update_returns": returns,
        "compile_seconds": timed.compile_seconds,
        "train_seconds": timed.train_seconds,
        "call_start_seconds": call_start_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="One trial of a peer PPO (started by benchmarks/bench.py).")
    parser.add_argument("peer", choices=("rejax", "purejaxrl"))
    parser.add_argument("--spec", required=True, help="the benchmark config, as JSON")
    parser.add_argument("--seeds", type=int, default=0, help="0: one run; N >= 1: vmapped over N seeds")
    parser.add_argument("--out", required=True, help="where to write the result (JSON)")
    parser.add_argument("--purejaxrl", type=Path, help="a clone of PureJaxRL's repository")
    parser.add_argument("--curve", action="store_true",
                        help="PureJaxRL: one run from --seed with its learning curve (benchmarks/learning.py)")
    parser.add_argument("--seed", type=int, default=0, help="with --curve: the run's seed (default 0)")
    args = parser.parse_args()
    if args.curve and args.peer != "purejaxrl":
        parser.error("--curve runs PureJaxRL only")
    spec = json.loads(args.spec)
    if args.curve:
        outcome = run_purejaxrl_curve(spec, args.seed, args.purejaxrl)
    elif args.peer == "rejax":
        outcome = run_rejax(spec, args.seeds)
    else:
        outcome = run_purejaxrl(spec, args.seeds, args.purejaxrl)
    with open(args.out, "w") as handle:
        json.dump(outcome, handle)


if __name__ == "__main__":
    main()
