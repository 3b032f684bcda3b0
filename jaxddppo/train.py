"""Train: `python -m jaxddppo.train --config FILE [section.key=value ...]`, and `run`, its
Python API: a single run, built (`experiment.build`) and trained by the host loop
(`training/loop.py`), then evaluated and summarised.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence, Union

import jax

from jaxddppo.cli import OneLineParser, add_start_arguments, parse_start_arguments
from jaxddppo.config.files import as_config, load_config, load_resume_config
from jaxddppo.config.options import RESUMABLE_KEYS, Config
from jaxddppo.config.reference import help_text
from jaxddppo.cpu import tuning as cpu_tuning
from jaxddppo.distributed import multiprocess
from jaxddppo.outputs.writers import format_mean_std, write_json
from jaxddppo.plot import save_learning_curve
from jaxddppo.references import with_objects
from jaxddppo.training.checkpoint import PREEMPTED_EXIT_CODE
from jaxddppo.training.compile_cache import use_compilation_cache
from jaxddppo.training.experiment import build
from jaxddppo.training.loop import (
    TrainResult,
    command_exit_code,
    process_label,
    start_session,
    summarise,
    train_experiment,
)
from jaxddppo.training.storage import STORAGE_EXIT_CODE, one_line_result_faults


def run(config: Union[Config, Mapping, str], devices: Optional[Sequence[jax.Device]] = None, *,
        resume: bool = False, stop_after_updates: Optional[int] = None, env: Any = None,
        torso: Any = None) -> TrainResult:
    """Train with `config` (a Config, a nested dict or a YAML path), writing config.yaml,
    metrics.jsonl, checkpoints, summary.json and learning_curve.png (and TensorBoard
    events or W&B runs if asked) to the run dir.

    With `resume`, `config.run.dir` holds an earlier run (see `load_resume_config`):
    its newest intact checkpoint is restored and training continues from it.
    `stop_after_updates` stops (with a checkpoint) once that many updates are done in
    all. Joins a multi-process run first when `config.distributed` asks for one.
    `env` and `torso` take your own environment and torso as objects, in place of
    `env.id` and `network.torso` (docs/environments.md, docs/algorithm.md).
    """
    config, objects = with_objects(as_config(config), env, torso)
    backend_warnings = multiprocess.start_backend(config)
    experiment = build(config, devices, objects)
    config, is_writer = experiment.config, jax.process_index() == 0
    session = start_session(experiment, config.env.id, resume, stop_after_updates, backend_warnings)
    run_dir, progress = session.run_dir, session.progress
    try:
        result = train_experiment(experiment, session)
        if result.stopped_by is None:
            result = replace(result, summary=summarise(experiment, result))
            session.log_summaries([result.summary])
        if is_writer:
            with one_line_result_faults(run_dir, "python -m jaxddppo.train --resume"):
                if result.summary is not None:
                    write_json(os.path.join(run_dir, "summary.json"), result.summary)
                save_learning_curve(run_dir)
        if result.summary is not None:
            summary = result.summary
            progress.message(
                f"done{process_label()}: {summary['total_env_steps']:,} steps in "
                f"{result.counters.train_seconds:.1f} s ({summary['env_steps_per_second']:,.0f} steps/s, "
                f"compile {result.compile_seconds:.1f} s); eval return "
                f"{format_mean_std(summary['eval_return_mean'], summary['eval_return_std'])}"
                + (f"; {run_dir}/summary.json" if is_writer else "")
            )
    finally:
        session.close()
    return result


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m jaxddppo.train",
        description="Train PPO (DD-PPO) on every local device. Options are set in a YAML file "
        "(--config) and overridden as section.key=value; --resume continues a run from its newest checkpoint. "
        f"Exit codes: 0 done, 1 failed (non-finite numbers, distributed errors), 2 bad input, "
        f"{STORAGE_EXIT_CODE} storage error (disk full, permission denied; fix it, then resume), "
        f"{PREEMPTED_EXIT_CODE} stopped by SIGTERM/SIGINT with a checkpoint saved (resume to continue).",
        epilog="configuration keys, set in the YAML file or as section.key=value (type, default): meaning\n" + help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_start_arguments(
        parser,
        resume_help="continue the run in RUN_DIR (its config.yaml and newest checkpoint); overrides may change "
        f"only {', '.join(RESUMABLE_KEYS)}",
        stop_help="stop with a checkpoint once N updates are done in all (the run can be resumed)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override one option")
    return parse_start_arguments(parser, argv)


def with_cpu_device_per_core(config: Config) -> Config:
    """The command's default on a CPU: one device per core, as many as the run's sizes split
    over with enough environments each (`cpu_tuning.cpu_devices_for_run`), where nothing
    else decides the device count; says so when it splits."""
    devices = cpu_tuning.cpu_devices_for_run(config, cpu_tuning.usable_cpu_cores())
    split = cpu_tuning.with_cpu_devices(config, devices, os.environ)
    if split is not config and config.run.progress:
        print(f"jaxddppo: run.cpu_devices={devices}, one CPU device per core, "
              f"{config.env.num_envs // devices} envs each (run.cpu_devices=1 keeps one device)", flush=True)
    return split


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)

    def train() -> TrainResult:
        if args.resume is not None:
            config = load_resume_config(args.resume, args.overrides)
        else:
            config = load_config(args.config, args.overrides)
        use_compilation_cache(config.run.compilation_cache)
        return run(with_cpu_device_per_core(config), resume=args.resume is not None,
                   stop_after_updates=args.stop_after_updates)

    return command_exit_code(train)


if __name__ == "__main__":
    sys.exit(main())
