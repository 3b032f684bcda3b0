"""Sweeps: `python -m jaxddppo.sweep --config FILE [--seeds N] [section.key=[v1,v2,...] ...]`
or `python -m jaxddppo.sweep --resume RUN_DIR`.

A sweep trains a population, grid points x seeds, as one compiled program:
every member has the structural config of the base run (env, sizes, network)
and its own seed and float hyperparameters, which are traced inputs vmapped
over the members. Members are spread over a (member, device) mesh
(`topology.place_population`); each member is a data-parallel DD-PPO run
over its own shards and trains as the single run of its config would, through
the run's own loop (`loop.train_experiment`: checkpoints, resume, preemption,
NaN guard, periodic evaluation). `training/population.py` makes the members of a grid; this
module trains them and writes their results.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from jaxddppo import sharding
from jaxddppo.cli import OneLineParser, add_start_arguments, parse_start_arguments
from jaxddppo.config.files import SWEEP_SPEC_FILE, as_config, load_config, load_resume_config
from jaxddppo.config.options import RESUMABLE_KEYS, TRACED_KEYS, Config, ConfigError
from jaxddppo.config.reference import help_text
from jaxddppo.cpu import tuning as cpu_tuning
from jaxddppo.distributed import global_arrays, multiprocess
from jaxddppo.outputs.writers import PBT_FILE, Progress, format_mean_std, format_return, json_safe, write_json
from jaxddppo.plot import PBT_CURVES_FILE, SWEEP_CURVES_FILE, plot_pbt, plot_sweep, read_metrics
from jaxddppo.references import with_objects
from jaxddppo.training import pbt
from jaxddppo.training.checkpoint import PREEMPTED_EXIT_CODE
from jaxddppo.training.compile_cache import use_compilation_cache
from jaxddppo.training.experiment import Experiment
from jaxddppo.training.loop import TrainResult, command_exit_code, process_label, start_session, train_experiment
from jaxddppo.training.population import (
    SEED_KEY,
    SweepSpec,
    build_population,
    expand_members,
    read_spec,
    split_overrides,
    swept_keys,
)
from jaxddppo.training.storage import STORAGE_EXIT_CODE, one_line_result_faults

RESUME_COMMAND = "python -m jaxddppo.sweep --resume"

# Every column of sweep.csv besides the swept keys (which follow `seed`), with its meaning.
SWEEP_CSV_FIELDS: dict[str, str] = {
    "member": "index of the member in the population (grid point-major, then seed)",
    "setting": "index of the member's grid point (members of one setting differ only in seed)",
    "seed": "the member's train.seed",
    "final_episode_return": "mean return of the training episodes that ended in the last chunk of updates",
    "eval_return_mean": "mean return of the member's final deterministic evaluation",
    "eval_return_std": "standard deviation of those returns",
    "params_digest": "float64 sum of |p| over the member's parameters (as summary.json of a single run)",
}

# Every field of a sweep's summary.json, with its meaning.
SWEEP_SUMMARY_FIELDS: dict[str, str] = {
    "env_id": "environment id",
    "swept_keys": "the keys varied by the grid, in column order",
    "num_members": "members trained: grid points x seeds",
    "num_settings": "grid points",
    "num_seeds": "seeds per grid point",
    "num_shards": "logical data-parallel shards of every member",
    "member_devices": "mesh rows: devices the members are split over",
    "shard_devices": "mesh columns: devices each member's shards are split over",
    "num_devices": "devices in the mesh, over all processes",
    "num_processes": "JAX processes (hosts)",
    "backend": "JAX backend (cpu, gpu, tpu)",
    "jax_version": "JAX version",
    "env_steps_per_member": "environment steps done by each member",
    "total_env_steps": "environment steps done by the whole population",
    "compile_seconds": "seconds before the first update: compiling the initialisation and the updates and making the "
                       "first state (the evaluations compile while the training runs)",
    "train_seconds": "seconds of training, the host loop between chunks included (compile and evaluations excluded)",
    "env_steps_per_second": "total_env_steps / train_seconds: the throughput of the whole population",
    "best_setting": "swept values of the setting with the highest mean evaluation return over its seeds",
    "best_eval_return_mean": "that setting's mean over seeds of the members' eval_return_mean",
    "best_eval_return_std": "standard deviation over seeds of the members' eval_return_mean",
}


def member_rows(population: Experiment, trained: TrainResult) -> list[dict]:
    """The rows of sweep.csv: one per member; with PBT, each member's final hyperparameters,
    exploits and lineage follow."""
    digests = global_arrays.params_digests(trained.state.params, population.mesh)
    evaluations = population.final_evaluations(trained.state, trained.final_evaluate)
    pbt_columns = pbt_member_columns(population, trained)
    rows = []
    for member, evaluation in zip(population.members, evaluations):
        returns = np.asarray(evaluation.returns, np.float64)
        rows.append({
            "member": member.index,
            "setting": member.setting,
            "seed": member.seed,
            **member.values,
            "final_episode_return": trained.counters.final_episode_returns[member.index],
            "eval_return_mean": float(returns.mean()),
            "eval_return_std": float(returns.std()),
            "params_digest": digests[member.index],
            **pbt_columns[member.index],
        })
    return rows


def pbt_member_columns(population: Experiment, trained: TrainResult) -> list[dict]:
    """Per member, the PBT columns of sweep.csv (none without PBT): `final_<key>` for each
    hyperparameter pbt.jsonl reports, `exploits` and `lineage` (from pbt.jsonl; None on
    processes that cannot read it)."""
    settings, num_members = population.pbt, len(population.members)
    if settings is None:
        return [{} for _ in range(num_members)]
    final = global_arrays.member_values(trained.state.pbt.hyperparams, population.mesh)
    path = os.path.join(trained.run_dir, PBT_FILE)
    rows = read_metrics(path) if os.path.exists(path) else None
    lineage = pbt.lineages(rows, num_members) if rows is not None else [None] * num_members
    return [{
        **{f"final_ppo.{name}": pbt.as_decimal(getattr(final, name)[member]) for name in settings.reported},
        "exploits": None if rows is None else sum(row["member"] == member and row["copied_from"] is not None
                                                  for row in rows),
        "lineage": lineage[member],
    } for member in range(num_members)]


def setting_rows(population: Experiment, rows: list[dict]) -> list[dict]:
    """One row per grid point: its values and mean / std over its seeds."""
    settings = []
    for setting in sorted({member.setting for member in population.members}):
        mine = [row for row in rows if row["setting"] == setting]
        eval_means = np.array([row["eval_return_mean"] for row in mine])
        finals = np.array([np.nan if row["final_episode_return"] is None else row["final_episode_return"]
                           for row in mine])
        settings.append({
            "setting": setting,
            **{key: mine[0][key] for key in swept_keys(population)},
            "num_seeds": len(mine),
            "eval_return_mean": float(eval_means.mean()),
            "eval_return_std": float(eval_means.std()),
            "final_episode_return": float(np.nanmean(finals)) if np.isfinite(finals).any() else None,
        })
    return settings


def best_setting(settings: list[dict]) -> dict:
    return max(settings, key=lambda row: row["eval_return_mean"])  # the first of equals


def setting_label(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{key.split('.')[-1]}={value:g}" if isinstance(value, float) else f"{key.split('.')[-1]}={value}"
                     for key, value in values.items()) or "all members"


def format_table(population: Experiment, settings: list[dict]) -> str:
    """Per-setting results, the best one marked with '*'."""
    best = best_setting(settings)["setting"]
    header = ["", "setting", *swept_keys(population), "seeds", "eval return (mean +- std over seeds)", "final return"]
    lines = []
    for row in settings:
        final = "n/a" if row["final_episode_return"] is None else format_return(row["final_episode_return"])
        lines.append([
            "*" if row["setting"] == best else "", str(row["setting"]),
            *(f"{row[key]:g}" if isinstance(row[key], float) else str(row[key]) for key in swept_keys(population)),
            str(row["num_seeds"]), format_mean_std(row["eval_return_mean"], row["eval_return_std"]), final,
        ])
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    render = lambda cells: "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()
    return "\n".join([render(header), *map(render, lines)])


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows([{key: "" if json_safe(value) is None else value for key, value in row.items()}
                          for row in rows])


@dataclass(frozen=True)
class SweepResult(TrainResult):
    """What `run_sweep` returns: a run's result (`state` leaves [num_members, num_shards, ...]),
    and `members`, the rows of sweep.csv, `settings`, the printed table, and the best of
    them (None, like `summary`, when the sweep stopped before its last update)."""

    members: Optional[list[dict]] = None
    settings: Optional[list[dict]] = None
    best: Optional[dict] = None

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.run_dir, "metrics.jsonl")

    @property
    def plot_path(self) -> str:
        return os.path.join(self.run_dir, SWEEP_CURVES_FILE)


def _summary(population: Experiment, trained: TrainResult, best: dict) -> dict:
    topology, mesh, counters = population.topology, population.mesh, trained.counters
    num_members = len(population.members)
    num_settings = len({member.setting for member in population.members})
    total = counters.env_steps * num_members
    return {
        "env_id": population.config.env.id,
        "swept_keys": swept_keys(population),
        "num_members": num_members,
        "num_settings": num_settings,
        "num_seeds": num_members // num_settings,
        "num_shards": topology.num_shards,
        "member_devices": mesh.shape[sharding.MEMBER_AXIS],
        "shard_devices": mesh.shape[sharding.DEVICE_AXIS],
        "num_devices": mesh.devices.size,
        "num_processes": jax.process_count(),
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "env_steps_per_member": counters.env_steps,
        "total_env_steps": total,
        "compile_seconds": round(trained.compile_seconds, 3),
        "train_seconds": round(counters.train_seconds, 3),
        "env_steps_per_second": round(total / counters.train_seconds, 1),
        "best_setting": {key: best[key] for key in swept_keys(population)},
        "best_eval_return_mean": best["eval_return_mean"],
        "best_eval_return_std": best["eval_return_std"],
    }


def save_curves(population: Experiment, run_dir: str) -> None:
    """curves.png: per grid point, the mean training return over its seeds and a +-1 std band;
    with PBT also pbt.png, each member's return beside its hyperparameters' schedules."""
    labels = {member.setting: setting_label(member.values) for member in population.members}
    plot_sweep(run_dir, [member.setting for member in population.members], labels,
               f"{population.config.env.id}: {len(population.members)} members",
               os.path.join(run_dir, SWEEP_CURVES_FILE))
    if population.pbt is not None:
        plot_pbt(run_dir, os.path.join(run_dir, PBT_CURVES_FILE))


def run_sweep(config: Union[Config, Mapping, str], grid: Optional[Mapping[str, Sequence[Any]]] = None,
              seeds: Optional[int] = None, member_devices: Optional[int] = None,
              devices: Optional[Sequence[jax.Device]] = None, *, resume: bool = False,
              stop_after_updates: Optional[int] = None, env: Any = None, torso: Any = None) -> SweepResult:
    """Train grid x seeds as one population; write config.yaml, sweep.json, metrics.jsonl,
    checkpoints, sweep.csv, summary.json and curves.png to the run dir and print the
    per-setting table.

    `grid` maps dotted keys to value lists, e.g. {"ppo.learning_rate": [3e-4, 1e-3]};
    `seeds` is the number of seeds from train.seed on (or give "train.seed": [...] in the grid).
    With `resume`, `config.run.dir` holds an earlier sweep of the same grid (`resume_sweep`
    reads both); `stop_after_updates` stops with a checkpoint, as `train.run` does. `env` and
    `torso` take your own environment and torso as objects, as `train.run` does.
    """
    config, objects = with_objects(as_config(config), env, torso)
    backend_warnings = multiprocess.start_backend(config)
    spec = SweepSpec({key: list(values) for key, values in (grid or {}).items()}, seeds, member_devices)
    population = build_population(config, spec.grid, seeds, member_devices, devices, objects)
    name = f"sweep-{population.config.env.id}"
    session = start_session(population, name, resume, stop_after_updates, backend_warnings)
    run_dir, progress, is_writer = session.run_dir, session.progress, jax.process_index() == 0
    if is_writer and not resume:
        write_json(os.path.join(run_dir, SWEEP_SPEC_FILE), asdict(spec))
    try:
        result = _results(population, train_experiment(population, session))
        if result.members is not None:
            session.log_summaries(result.members)
        if is_writer:
            with one_line_result_faults(run_dir, RESUME_COMMAND):
                save_curves(population, run_dir)
        if result.summary is not None:
            _report(population, result, progress)
    finally:
        session.close()
    return result


def _results(population: Experiment, trained: TrainResult) -> SweepResult:
    """sweep.csv and summary.json (process 0 writes them) when the sweep is done."""
    if trained.stopped_by is not None:
        return SweepResult(None, trained.state, trained.run_dir, trained.counters, trained.compile_seconds,
                           trained.stopped_by)
    rows = member_rows(population, trained)
    settings = setting_rows(population, rows)
    best = best_setting(settings)
    summary = _summary(population, trained, best)
    if jax.process_index() == 0:
        with one_line_result_faults(trained.run_dir, RESUME_COMMAND):
            write_csv(os.path.join(trained.run_dir, "sweep.csv"), rows)
            write_json(os.path.join(trained.run_dir, "summary.json"), summary)
    return SweepResult(summary, trained.state, trained.run_dir, trained.counters, trained.compile_seconds,
                       members=rows, settings=settings, best=best)


def _report(population: Experiment, result: SweepResult, progress: Progress) -> None:
    summary, best = result.summary, result.best
    is_writer = jax.process_index() == 0
    if is_writer:
        print(format_table(population, result.settings), flush=True)
    progress.message(
        f"done{process_label()}: {summary['total_env_steps']:,} steps in {result.counters.train_seconds:.1f} s "
        f"({summary['env_steps_per_second']:,.0f} steps/s, compile {summary['compile_seconds']:.1f} s); best "
        f"{setting_label(summary['best_setting'])}: eval return "
        f"{format_mean_std(best['eval_return_mean'], best['eval_return_std'])} over seeds"
        + (f"; {result.run_dir}/sweep.csv" if is_writer else "")
    )


def resume_sweep(run_dir: str, overrides: Sequence[str] = (), devices: Optional[Sequence[jax.Device]] = None,
                 stop_after_updates: Optional[int] = None, *, env: Any = None, torso: Any = None) -> SweepResult:
    """Continue the sweep in `run_dir` from its newest checkpoint, with its config.yaml and
    sweep.json and the overrides a resume allows (and the objects it was started with, if any)."""
    return _resume(load_resume_config(run_dir, overrides), devices, stop_after_updates, env, torso)


def _resume(config: Config, devices: Optional[Sequence[jax.Device]], stop_after_updates: Optional[int],
            env: Any = None, torso: Any = None) -> SweepResult:
    """`resume_sweep` with the run directory's config read (`config.run.dir` names it)."""
    spec = read_spec(config.run.dir)
    return run_sweep(config, spec.grid, spec.seeds, spec.member_devices, devices, resume=True,
                     stop_after_updates=stop_after_updates, env=env, torso=torso)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m jaxddppo.sweep",
        description="Train a grid of hyperparameters x seeds as one population over every device. "
        "A list value, section.key=[v1,v2], sweeps that key; other section.key=value items override the "
        f"config of every member. Sweepable keys: {', '.join(TRACED_KEYS)}, {SEED_KEY}. Results: "
        "sweep.csv, metrics.jsonl (with a member column), curves.png, summary.json, checkpoints/ in run.dir; "
        "--resume continues a sweep from its newest checkpoint. Exit codes: 0 done, 1 failed (non-finite numbers, "
        f"distributed errors), 2 bad input, {STORAGE_EXIT_CODE} storage error (fix it, then resume), "
        f"{PREEMPTED_EXIT_CODE} stopped by SIGTERM/SIGINT with a checkpoint saved.",
        epilog="configuration keys (type, default): meaning\n" + help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_start_arguments(
        parser,
        resume_help="continue the sweep in RUN_DIR (its config.yaml, sweep.json and newest checkpoint) with its "
        f"grid; overrides may change only {', '.join(RESUMABLE_KEYS)}",
        stop_help="stop with a checkpoint once every member has done N updates (the sweep can be resumed)")
    parser.add_argument("--seeds", type=int, help="seeds per grid point: train.seed, train.seed+1, ... (default 1)")
    parser.add_argument("--member-devices", type=int,
                        help="devices the members are split over (default: as many as divide the member count). "
                        "Unless this, run.cpu_devices, XLA_FLAGS' device count, distributed.* or JAX_PLATFORMS (naming "
                        "another platform first) decides the devices, or run.cpu_tuning=off, the CPU is split into one "
                        "device per core, as many as divide the member count")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value|[v1,v2,...]",
                        help="override or sweep one option")
    args = parse_start_arguments(parser, argv)
    if args.resume is not None and (args.seeds is not None or args.member_devices is not None):
        parser.error("--seeds and --member-devices cannot change on --resume: the sweep keeps its own")
    return args


def start(args: argparse.Namespace) -> SweepResult:
    """The sweep the command line asks for: a new one, or the resumed one."""
    plain, grid = split_overrides(args.overrides)
    if args.resume is not None:
        if grid:
            raise ConfigError(f"{', '.join(grid)} cannot be swept on --resume: the sweep keeps its own grid")
        config = load_resume_config(args.resume, plain)
        use_compilation_cache(config.run.compilation_cache)
        return _resume(config, None, args.stop_after_updates)
    config = load_config(args.config, plain)
    use_compilation_cache(config.run.compilation_cache)
    if args.member_devices is None:
        num_members = len(expand_members(config, grid, args.seeds))
        devices = cpu_tuning.cpu_devices_per_core(num_members, cpu_tuning.usable_cpu_cores())
        split = cpu_tuning.with_cpu_devices(config, devices, os.environ)
        if split is not config and config.run.progress:
            print(f"jaxddppo sweep: run.cpu_devices={split.run.cpu_devices}, one CPU device per core for "
                  f"{num_members} members (run.cpu_devices=1 keeps one device)", flush=True)
        config = split
    return run_sweep(config, grid, args.seeds, args.member_devices, stop_after_updates=args.stop_after_updates)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return command_exit_code(lambda: start(args))


if __name__ == "__main__":
    sys.exit(main())
