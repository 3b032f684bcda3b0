"""Evaluate a trained run: `python -m jaxddppo.evaluate RUN_DIR [--episodes N] [--seed S]`.

Loads the newest intact checkpoint (or `--checkpoint STEP`), runs N episodes
with the deterministic policy on device, and prints the return and length
statistics. With the defaults (the run's `eval.num_episodes` and its evaluation
key) it reproduces the run's own final evaluation in summary.json.

`--video FILE` (.gif, or .mp4 with the `video` extra) instead draws `--video-episodes`
episodes of the deterministic policy into FILE, for environments that can draw themselves.

`--verify` instead reads back every checkpoint of a run or a sweep and checks it
against its digest: one line each, exit 0 only when the newest is intact.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import jax
import numpy as np

from jaxddppo.cli import OneLineParser
from jaxddppo.config.files import SWEEP_SPEC_FILE, load_resume_config
from jaxddppo.config.options import ConfigError
from jaxddppo.outputs.policy import Policy, load_policy
from jaxddppo.outputs.video import check_video_path, render_episodes, write_video
from jaxddppo.training.checkpoint import Checkpointer, CheckpointError
from jaxddppo.training.compile_cache import use_compilation_cache
from jaxddppo.training.eval_episodes import EvalResult, evaluate_policy_program
from jaxddppo.training.experiment import build, final_eval_key
from jaxddppo.training.population import build_population, read_spec


def evaluate(policy: Policy, num_episodes: Optional[int] = None, seed: Optional[int] = None) -> EvalResult:
    """`num_episodes` deterministic episodes (default: the run's eval.num_episodes).

    Without `seed`, the key of the run's final evaluation, so the result equals summary.json's.
    """
    episodes = policy.config.eval.num_episodes if num_episodes is None else num_episodes
    key = final_eval_key(policy.config) if seed is None else jax.random.key(seed)
    return evaluate_policy_program(
        policy.env, policy.network, policy.params, key, episodes, policy.obs_moments
    )


def video(policy: Policy, path: str, num_episodes: int = 1, seed: Optional[int] = None) -> list[int]:
    """Draw `num_episodes` deterministic episodes into `path`, one after another; their lengths.

    Episode `i` plays with `fold_in(key, i)`, `key` the seed's or else the run's final evaluation's."""
    key = final_eval_key(policy.config) if seed is None else jax.random.key(seed)
    episodes = render_episodes(policy.env, policy.network, policy.params, policy.obs_moments, key, num_episodes)
    write_video(path, [frame for frames in episodes for frame in frames])
    return [len(frames) - 1 for frames in episodes]


def statistics(result: EvalResult) -> dict:
    """Mean, std, min and max of the episode returns and lengths."""
    stats = {}
    for name, values in (("return", result.returns), ("length", result.lengths)):
        values = np.asarray(values, np.float64)
        stats.update({f"{name}_mean": float(values.mean()), f"{name}_std": float(values.std()),
                      f"{name}_min": float(values.min()), f"{name}_max": float(values.max())})
    return stats


def verify(run_dir: str) -> int:
    """Print every checkpoint of `run_dir` (a run's or a sweep's) with its verdict; set-aside
    ones are listed too. 0 when the newest is intact, 1 otherwise."""
    config, devices = load_resume_config(run_dir), jax.local_devices()[:1]
    if os.path.exists(os.path.join(run_dir, SWEEP_SPEC_FILE)):
        spec = read_spec(run_dir)
        experiment = build_population(config, spec.grid, spec.seeds, None, devices)
    else:
        experiment = build(config, devices)
    checkpointer = Checkpointer(run_dir, read_only=True)
    try:
        steps, target = checkpointer.steps(), experiment.abstract_state()
        if not steps:
            raise CheckpointError(f"no checkpoint in {checkpointer.directory}")
        verdicts = [(step, *checkpointer.verify(step, target)) for step in steps]
    finally:
        checkpointer.close()
    for step, _, verdict in verdicts:
        print(f"{checkpointer.path(step)}: {verdict}")
    for name in sorted(os.listdir(checkpointer.directory)):
        if name.endswith((".damaged", ".unreadable")):
            print(f"{os.path.join(checkpointer.directory, name)}: set aside by a resume")
    return 0 if verdicts[-1][1] else 1


def print_video(args: argparse.Namespace, policy: Policy) -> int:
    lengths = video(policy, args.video, args.video_episodes, args.seed)
    if args.json:
        print(json.dumps({"run_dir": args.run_dir, "update": policy.counters.update, "video": args.video,
                          "episode_lengths": lengths, "frames": sum(lengths) + len(lengths)}))
    else:
        print(f"{args.video}: {len(lengths)} episode(s) of {policy.config.env.id} at update "
              f"{policy.counters.update}, lengths {', '.join(map(str, lengths))}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(prog="python -m jaxddppo.evaluate",
                            description="Evaluate the deterministic policy of a run's checkpoint.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by python -m jaxddppo.train")
    parser.add_argument("--episodes", type=int, help="episodes to run (default: the run's eval.num_episodes)")
    parser.add_argument("--seed", type=int, help="evaluation seed (default: the key of the run's final evaluation)")
    parser.add_argument("--checkpoint", type=int, metavar="STEP", help="checkpoint to load (default: the newest)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--video", metavar="FILE",
                        help="evaluate nothing: draw the deterministic policy's episodes into FILE (.gif, or .mp4 "
                        "with the video extra), for environments that can draw themselves")
    parser.add_argument("--video-episodes", type=int, default=1, metavar="N",
                        help="episodes in the --video, one after another (default 1)")
    parser.add_argument("--verify", action="store_true",
                        help="evaluate nothing: check every checkpoint against its digest, one line each; exit 0 "
                        "only when the newest is intact, 1 otherwise")
    args = parser.parse_args(argv)
    if args.episodes is not None and args.episodes < 1:
        parser.error(f"--episodes={args.episodes} must be at least 1")
    if args.video_episodes < 1:
        parser.error(f"--video-episodes={args.video_episodes} must be at least 1")
    try:
        if args.verify:
            return verify(args.run_dir)
        if args.video is not None:
            check_video_path(args.video)
        policy = load_policy(args.run_dir, args.checkpoint, report=lambda message: print(message, file=sys.stderr))
        use_compilation_cache("auto")
        if args.video is not None:
            return print_video(args, policy)
        stats = statistics(evaluate(policy, args.episodes, args.seed))  # builds the environment, which may refuse
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    episodes = policy.config.eval.num_episodes if args.episodes is None else args.episodes
    if args.json:
        print(json.dumps({"run_dir": args.run_dir, "update": policy.counters.update,
                          "env_steps": policy.counters.env_steps, "episodes": episodes, **stats}))
        return 0
    print(f"{policy.config.env.id}, checkpoint at update {policy.counters.update} "
          f"({policy.counters.env_steps:,} env steps), {episodes} episodes")
    for name in ("return", "length"):
        print(f"  {name:6s} mean {stats[f'{name}_mean']:.2f}  std {stats[f'{name}_std']:.2f}  "
              f"min {stats[f'{name}_min']:.2f}  max {stats[f'{name}_max']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
