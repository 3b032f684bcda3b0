"""One trial of Brax's PPO on a MuJoCo Playground task in this process, as
benchmarks/playground_peers.py starts it:

    python benchmarks/brax_peer.py --task CartpoleBalance --num-envs 256 --unroll-length 32 \
        --num-minibatches 8 --epochs 4 --hidden-sizes 32,32 --total-env-steps 3145728 --out result.json

Needs brax 0.14.2 and playground 0.2.0 (which need jax <= 0.9; benchmarks/README.md has the
recipe of their virtual environment). The task is `mujoco_playground.registry.load(task,
config_overrides={"impl": "jax"})` (MJX in pure JAX, as on a CPU), trained by
`brax.training.agents.ppo.train` through Playground's own training wrapper
(`mujoco_playground.wrapper.wrap_for_brax_training`: vmap, the task's episode length, and an
auto-reset to each environment's cached first state), as Playground's notebooks do, around the
task with its actions clipped to [-1, 1] (`ClipActions`, as jaxddppo's environments clip them).

Sizes: one update is one rollout of `--num-envs` x `--unroll-length` steps, split into
`--num-minibatches` minibatches for each of `--epochs` passes. Brax's `batch_size` counts
trajectories of `unroll_length` steps, not steps: it is num_envs / num_minibatches here (with
batch_size * num_minibatches = num_envs, each of Brax's training steps is one rollout of every
environment).

Brax trains in `num_evals - 1` compiled calls ("epochs") of equal length, evaluating after each
(and once before training). Its progress callback reports, after each call, `training/sps`
(that call's env steps over its own seconds, evaluations not included: brax/training/agents/ppo/
train.py's `training_epoch_with_timing` times the call alone) and `training/walltime` (the calls'
seconds summed). Brax 0.14.2 compiles its training program twice, in its first call and again in
its second, and likewise its evaluation program at its first two evaluations (JAX_LOG_COMPILES=1
shows each; we did not look for the cause), so the steady state is the calls after the second: (env steps of the last report -
env steps of the second) / (walltime of the last - walltime of the second); `--num-evals` must
be at least 4. The seconds of every XLA compile (jax.monitoring's backend-compile events) are
recorded by report, and `steady_compile_seconds`, those inside the steady state, shows whether
anything compiled there after all. The return is the last evaluation's `eval/episode_reward`:
the mean return of `--eval-episodes` episodes of the task's full length, with the deterministic
policy (the Gaussian's mean).

With `--playground-settings` (benchmarks/learning.py) the task trains as Playground's notebooks train
it instead: its own Brax PPO settings (`mujoco_playground.config.dm_control_suite_params.brax_ppo_config`,
whose `num_timesteps` and `num_evals` the arguments replace and whose `num_resets_per_eval` is set to
train exactly `num_timesteps`: `resets_per_eval`), Brax's default networks and Playground's wrapper
without the clip; the size and hyperparameter arguments are then not read, `--num-evals` may be as low
as 2 and the steady-state fields are null where fewer than 3 training calls were made. Every
report also records `process_seconds`, the process's age (benchmarks/process_clock.py).

Writes one JSON object to `--out`: the settings, every report, and the fields
benchmarks/playground_peers.py reads (env_steps, steady_env_steps, steady_seconds,
eval_return, ...).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from typing import Any, Optional, Sequence

from process_clock import process_age_seconds

# Brax 0.14.2 compiles its training program in each of its first two training calls.
WARMUP_CALLS = 2


def hidden_sizes(value: str) -> tuple[int, ...]:
    sizes = tuple(int(size) for size in value.split(",") if size.strip())
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of positive widths")
    return sizes


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="One trial of Brax PPO on a MuJoCo Playground task "
                                     "(started by benchmarks/playground_peers.py).")
    parser.add_argument("--task", required=True, help="a Playground task, e.g. CartpoleBalance")
    parser.add_argument("--num-envs", type=int)
    parser.add_argument("--unroll-length", type=int, help="env steps per env per update")
    parser.add_argument("--num-minibatches", type=int)
    parser.add_argument("--epochs", type=int, help="Brax's num_updates_per_batch")
    parser.add_argument("--hidden-sizes", type=hidden_sizes,
                        help="widths of the policy's and of the value network's hidden layers, e.g. 32,32")
    parser.add_argument("--activation", choices=("tanh", "silu", "relu"), default="tanh")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--discounting", type=float, default=0.995)
    parser.add_argument("--gae-lambda", type=float, default=0.95)
    parser.add_argument("--clip-eps", type=float, default=0.2)
    parser.add_argument("--entropy-cost", type=float, default=0.0)
    parser.add_argument("--vf-coef", type=float, default=0.5)
    parser.add_argument("--max-grad-norm", type=float, default=None, help="global-norm clipping (default: none)")
    parser.add_argument("--reward-scaling", type=float, default=1.0, help="rewards are multiplied by this")
    parser.add_argument("--normalize-observations", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--total-env-steps", type=int, required=True,
                        help="a multiple of num_envs x unroll_length x (num_evals - 1)")
    parser.add_argument("--num-evals", type=int, default=5,
                        help="evaluations, one before training and one after each of num_evals - 1 compiled "
                        f"calls (at least {WARMUP_CALLS + 2}: the steady state is the calls after the first "
                        f"{WARMUP_CALLS})")
    parser.add_argument("--eval-episodes", type=int, default=128, help="Brax's num_eval_envs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--playground-settings", action="store_true",
                        help="train with Playground's own Brax PPO settings of the task and Brax's default networks "
                        "(the sizes and hyperparameters above are not read)")
    parser.add_argument("--out", required=True, help="where to write the result (JSON)")
    args = parser.parse_args(argv)
    problem = size_problem(args)
    if problem:
        parser.error(problem)
    return args


def size_problem(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the sizes, in one line; None if nothing."""
    if args.playground_settings:
        return None if args.num_evals >= 2 else f"--num-evals={args.num_evals} must be at least 2"
    missing = [name for name in ("num_envs", "unroll_length", "num_minibatches", "epochs", "hidden_sizes")
               if getattr(args, name) is None]
    if missing:
        return "the following arguments are required: " + ", ".join("--" + name.replace("_", "-") for name in missing)
    if args.num_envs % args.num_minibatches:
        return f"--num-envs={args.num_envs} is not divisible by --num-minibatches={args.num_minibatches}"
    if args.num_evals < WARMUP_CALLS + 2:
        return (f"--num-evals={args.num_evals} leaves no training call after the first {WARMUP_CALLS}, which "
                f"compile; use at least {WARMUP_CALLS + 2}")
    per_call = args.num_envs * args.unroll_length * (args.num_evals - 1)
    if args.total_env_steps % per_call:
        return (f"--total-env-steps={args.total_env_steps} is not a multiple of num_envs x unroll_length x "
                f"(num_evals - 1) = {per_call}")
    return None


def training_reports(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The progress reports that follow a training call (the one before training has no training
    metrics)."""
    return [report for report in reports if "training/walltime" in report]


def steady_state(reports: Sequence[dict[str, Any]]) -> tuple[int, float]:
    """(env steps, seconds) of the training calls after the first WARMUP_CALLS, from the progress
    reports."""
    training = training_reports(reports)
    if len(training) < WARMUP_CALLS + 1:
        raise ValueError(f"{len(training)} training report(s); the steady state needs at least {WARMUP_CALLS + 1}")
    first, last = training[WARMUP_CALLS - 1], training[-1]
    return last["step"] - first["step"], last["training/walltime"] - first["training/walltime"]


def playground_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Playground's own Brax PPO settings of the task, with this trial's budget, evaluations (deterministic, as
    jaxddppo's) and seed."""
    from mujoco_playground.config import dm_control_suite_params

    settings = dm_control_suite_params.brax_ppo_config(args.task).to_dict()
    settings = {**settings, "num_timesteps": args.total_env_steps, "num_evals": args.num_evals,
                "num_eval_envs": args.eval_episodes, "deterministic_eval": True, "seed": args.seed}
    try:
        return {**settings, "num_resets_per_eval": resets_per_eval(settings)}
    except ValueError as error:
        raise SystemExit(f"brax_peer.py: {error}") from None


def resets_per_eval(settings: dict[str, Any]) -> int:
    """Brax's `num_resets_per_eval` that trains exactly `num_timesteps`, with Playground's restarts.

    Per evaluation interval Brax runs R groups of ceil(num_timesteps / (intervals x update x R))
    updates and restarts every environment after each group (R = num_resets_per_eval, at least 1),
    so Playground's R = 10 trains at least 10 updates an interval whatever the budget: at its own
    6e7 steps, 90 updates of 983,040 steps, each followed by a restart. One update a group at any
    budget keeps that rule: R = the updates of an interval. R = 0 (no restarts) is kept."""
    if settings["num_resets_per_eval"] == 0:
        return 0
    per_update = (settings["batch_size"] * settings["unroll_length"] * settings["num_minibatches"]
                  * settings["action_repeat"])
    intervals = max(settings["num_evals"] - 1, 1)
    updates, rest = divmod(settings["num_timesteps"], per_update)
    if rest or updates == 0 or updates % intervals:
        raise ValueError(f"--total-env-steps={settings['num_timesteps']} is not a positive whole number of "
                         f"updates of {per_update:,} steps divisible into {intervals} evaluation interval(s)")
    return updates // intervals


def matched_settings(args: argparse.Namespace, episode_length: int) -> dict[str, Any]:
    """Brax PPO's settings from the arguments, set as jaxddppo's (benchmarks/playground_peers.py)."""
    return {
        "num_timesteps": args.total_env_steps, "num_envs": args.num_envs, "episode_length": episode_length,
        "action_repeat": 1, "unroll_length": args.unroll_length, "num_minibatches": args.num_minibatches,
        "batch_size": args.num_envs // args.num_minibatches, "num_updates_per_batch": args.epochs,
        "learning_rate": args.learning_rate, "entropy_cost": args.entropy_cost, "discounting": args.discounting,
        "gae_lambda": args.gae_lambda, "clipping_epsilon": args.clip_eps, "vf_loss_coefficient": args.vf_coef,
        "max_grad_norm": args.max_grad_norm, "reward_scaling": args.reward_scaling,
        "normalize_observations": args.normalize_observations, "normalize_advantage": True,
        "num_evals": args.num_evals, "num_eval_envs": args.eval_episodes, "deterministic_eval": True,
        "num_resets_per_eval": 0, "seed": args.seed,
    }


def steady_fields(reports: Sequence[dict[str, Any]]) -> dict[str, Optional[float]]:
    """The steady state's env steps and seconds, the warm-up calls' extra seconds and the compile seconds
    inside the steady state; None where the training calls are too few to have one."""
    training = training_reports(reports)
    if len(training) <= WARMUP_CALLS:
        return dict.fromkeys(("steady_env_steps", "steady_seconds", "warmup_extra_seconds", "steady_compile_seconds"))
    steady_steps, steady_seconds = steady_state(reports)
    warmup = training[WARMUP_CALLS - 1]
    return {
        "steady_env_steps": steady_steps,
        "steady_seconds": steady_seconds,
        # The first WARMUP_CALLS calls' seconds beyond what the steady rate gives their steps: their compiles.
        "warmup_extra_seconds": warmup["training/walltime"] - warmup["step"] * steady_seconds / steady_steps,
        # XLA compiles after the warm-up calls (their evaluations included): 0 when nothing compiled again.
        "steady_compile_seconds": sum(report["compile_seconds"] for report in training[WARMUP_CALLS:]),
    }


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items() if getattr(value, "size", 1) == 1}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    import jax
    from brax.training.agents.ppo import networks as ppo_networks
    from brax.training.agents.ppo import train as ppo
    from flax import linen
    from mujoco_playground import registry, wrapper

    class ClipActions(wrapper.Wrapper):
        """The task sees actions clipped to its range [-1, 1], as jaxddppo's environments do: Brax's
        Gaussian ("normal") passes its samples on as they are. The loss still takes the log-probability
        of the unclipped sample, as jaxddppo's. MJX clamps the controls anyway, so only a reward that
        scores the action itself could tell: CartpoleBalance's small_control is 0 at |a| = 1 and beyond
        (it trained to the same return, to every digit, with and without the clip), and CheetahRun's
        reward ignores the action (its return moved as with another seed: a changed program changes the
        last bits, which its dynamics amplify)."""

        def step(self, state: Any, action: Any) -> Any:
            return self.env.step(state, jax.numpy.clip(action, -1.0, 1.0))

    def wrap_for_training(env: Any, **kwargs: Any) -> Any:
        return wrapper.wrap_for_brax_training(ClipActions(env), **kwargs)

    env = registry.load(args.task, config_overrides={"impl": "jax"})
    episode_length = int(env._config.episode_length)  # the env's own (locked) config
    activation = {"tanh": linen.tanh, "silu": linen.swish, "relu": linen.relu}[args.activation]
    orthogonal = jax.nn.initializers.orthogonal
    # jaxddppo's network in Brax's terms: separate policy and value MLPs, orthogonal weights (hidden
    # layers sqrt(2), policy mean 0.01; Brax initialises the value head like the hidden layers, jaxddppo
    # with 1), zero biases, and a Gaussian with a state-independent log standard deviation, 0 at first.
    network_factory = functools.partial(
        ppo_networks.make_ppo_networks,
        policy_hidden_layer_sizes=args.hidden_sizes, value_hidden_layer_sizes=args.hidden_sizes,
        activation=activation, distribution_type="normal", noise_std_type="log", init_noise_std=1.0,
        state_dependent_std=False,
        policy_network_kernel_init_fn=orthogonal, policy_network_kernel_init_kwargs={"scale": math.sqrt(2.0)},
        value_network_kernel_init_fn=orthogonal, value_network_kernel_init_kwargs={"scale": math.sqrt(2.0)},
        mean_kernel_init_fn=orthogonal, mean_kernel_init_kwargs={"scale": 0.01},
    )
    reports: list[dict[str, Any]] = []
    compiles: list[float] = []  # seconds of each XLA compile since the last report

    def compiled(event: str, seconds: float, **unused: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(compiled)

    def progress(step: int, metrics: dict[str, Any]) -> None:
        reports.append({"step": int(step), "time": time.perf_counter() - start,
                        "process_seconds": process_age_seconds(), "compile_seconds": sum(compiles),
                        **scalars(metrics)})
        compiles.clear()
        print(f"step {step}: " + ", ".join(f"{name} {reports[-1][name]:.4g}" for name in
                                           ("training/sps", "eval/episode_reward") if name in reports[-1]),
              flush=True)

    if args.playground_settings:  # as Playground's notebooks train: Brax's default networks, no clip
        settings, wrap_env_fn, factory = playground_settings(args), wrapper.wrap_for_brax_training, {}
    else:
        settings, wrap_env_fn = matched_settings(args, episode_length), wrap_for_training
        factory = {"network_factory": network_factory}
    _, _, final_metrics = ppo.train(environment=env, wrap_env_fn=wrap_env_fn, progress_fn=progress, **factory,
                                    **settings)
    last = reports[-1]
    if not args.playground_settings:
        settings = {**settings, "hidden_sizes": list(args.hidden_sizes), "activation": args.activation}
    outcome = {
        "task": args.task,
        "settings": settings,
        "env_steps": last["step"],
        "train_seconds": last["training/walltime"],
        **steady_fields(reports),
        "compile_seconds": sum(report["compile_seconds"] for report in reports),
        "eval_seconds": last["eval/walltime"],
        "wall_seconds": time.perf_counter() - start,
        "eval_return": float(final_metrics["eval/episode_reward"]),
        "eval_return_std": float(final_metrics["eval/episode_reward_std"]),
        "reports": reports,
        "versions": {"jax": jax.__version__},
    }
    with open(args.out, "w") as handle:
        json.dump(outcome, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
