"""Sweeps: `python -m jaxddppo.sweep --config FILE [--seeds N] [section.key=[v1,v2,...] ...]`
or `python -m jaxddppo.sweep --resume RUN_DIR`.

A sweep trains a population, grid points x seeds, as one compiled program:
every member has the structural config of the base run (env, sizes, network)
and its own seed and float hyperparameters, which are traced inputs vmapped
over the members. Members are spread over a (member, device) mesh
(`sharding.place_population`); each member is a data-parallel DD-PPO run
over its own shards and trains as the single run of its config would, through
the run's own loop (`train.train_experiment`: checkpoints, resume, preemption,
NaN guard, periodic evaluation); this module adds the grid and its results.

Structural keys (anything that changes array shapes or the compiled program)
are refused in a grid: run one sweep per value.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from jaxddppo import sharding
from jaxddppo.checkpoint import PREEMPTED_EXIT_CODE, CheckpointError
from jaxddppo.cli import OneLineParser
from jaxddppo.config import (
    RESUMABLE_KEYS,
    Config,
    ConfigError,
    as_config,
    help_text,
    load_config,
    load_resume_config,
    options,
    with_overrides,
)
from jaxddppo.outputs import Progress, format_mean_std, format_return, json_safe, write_json
from jaxddppo.plot import SWEEP_CURVES_FILE, plot_sweep
from jaxddppo.ppo import PPOHyperparams
from jaxddppo.storage import STORAGE_EXIT_CODE, StorageError
from jaxddppo.train import (
    Experiment,
    Member,
    NonFiniteError,
    TrainResult,
    assemble,
    process_label,
    start_session,
    train_experiment,
)

# Keys a grid may vary: the traced float hyperparameters, and the seed.
SWEEPABLE_KEYS: tuple[str, ...] = tuple(f"ppo.{name}" for name in PPOHyperparams.__dataclass_fields__)
SEED_KEY = "train.seed"
SPEC_FILE = "sweep.json"  # the grid, seeds and member devices, for a resume

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
    "compile_seconds": "seconds spent compiling",
    "train_seconds": "seconds of training, the host loop between chunks included (compile and evaluations excluded)",
    "env_steps_per_second": "total_env_steps / train_seconds: the throughput of the whole population",
    "best_setting": "swept values of the setting with the highest mean evaluation return over its seeds",
    "best_eval_return_mean": "that setting's mean over seeds of the members' eval_return_mean",
    "best_eval_return_std": "standard deviation over seeds of the members' eval_return_mean",
}


def _config_value(config: Config, key: str) -> Any:
    section, leaf = key.split(".")
    return getattr(getattr(config, section), leaf)


def check_grid_keys(config: Config, grid: Mapping[str, Sequence[Any]]) -> None:
    """Unknown and structural keys, and empty value lists, are refused with one line."""
    known = {opt.key for opt in options()}
    for key, values in grid.items():
        if key not in known:
            with_overrides(config, {key: None})  # raises the config's own unknown-key message
        if key not in SWEEPABLE_KEYS and key != SEED_KEY:
            raise ConfigError(
                f"{key}={list(values)!r} cannot be swept: {key} is structural (it changes array shapes or the "
                f"compiled program); a sweep varies only {', '.join(SWEEPABLE_KEYS)} and {SEED_KEY} (or --seeds); "
                f"run one sweep per value of {key}"
            )
        if len(values) == 0:
            raise ConfigError(f"{key}=[] has no values to sweep")


def seed_list(config: Config, grid: Mapping[str, Sequence[Any]], num_seeds: Optional[int]) -> list[Any]:
    """The seeds: `train.seed=[...]` in the grid, or `num_seeds` from train.seed on, or train.seed alone."""
    if SEED_KEY in grid:
        if num_seeds is not None:
            raise ConfigError(f"--seeds={num_seeds} and {SEED_KEY}=[...] both set; give one of them")
        return list(grid[SEED_KEY])
    if num_seeds is not None and num_seeds < 1:
        raise ConfigError(f"--seeds={num_seeds} is invalid: must be at least 1")
    return [config.train.seed + offset for offset in range(num_seeds or 1)]


def expand_members(config: Config, grid: Mapping[str, Sequence[Any]], num_seeds: Optional[int] = None) -> list[Member]:
    """Grid points (in the order of `grid`'s keys) x seeds, each validated as a config of its own."""
    check_grid_keys(config, grid)
    seeds = seed_list(config, grid, num_seeds)
    axes = {key: list(values) for key, values in grid.items() if key != SEED_KEY}
    members = []
    for setting, point in enumerate(itertools.product(*axes.values())):
        point_config = with_overrides(config, dict(zip(axes, point)))
        for seed in seeds:
            member_config = with_overrides(point_config, {SEED_KEY: seed})
            members.append(Member(
                index=len(members),
                setting=setting,
                seed=member_config.train.seed,
                values={key: _config_value(member_config, key) for key in axes},
                config=member_config,
            ))
    return members


def build_population(config: Config, grid: Mapping[str, Sequence[Any]], num_seeds: Optional[int] = None,
                     member_devices: Optional[int] = None,
                     devices: Optional[Sequence[jax.Device]] = None) -> Experiment:
    """Validate the grid, the placement and every size; compile nothing."""
    members = expand_members(config, grid, num_seeds)
    devices = list(jax.devices() if devices is None else devices)
    placement = sharding.place_population(len(members), config.train.num_shards, len(devices), member_devices)
    with_shards = lambda c: replace(c, train=replace(c.train, num_shards=placement.num_shards))
    config = with_shards(config)
    members = [replace(member, config=with_shards(member.config)) for member in members]
    topology = sharding.make_topology(config, num_devices=placement.shard_devices,
                                      num_processes=jax.process_count())
    return assemble(config, members, sharding.make_population_mesh(placement, devices), topology)


def swept_keys(population: Experiment) -> list[str]:
    return list(population.members[0].values)


def member_rows(population: Experiment, trained: TrainResult) -> list[dict]:
    """The rows of sweep.csv: one per member."""
    digests = sharding.params_digests(trained.state.params, population.mesh)
    evaluations = population.final_evaluations(trained.state)
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
        })
    return rows


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
    """curves.png: per grid point, the mean training return over its seeds and a +-1 std band."""
    labels = {member.setting: setting_label(member.values) for member in population.members}
    plot_sweep(run_dir, [member.setting for member in population.members], labels,
               f"{population.config.env.id}: {len(population.members)} members",
               os.path.join(run_dir, SWEEP_CURVES_FILE))


@dataclass(frozen=True)
class SweepSpec:
    """What makes a population out of a base config, kept in the run dir (sweep.json) for a resume."""

    grid: dict[str, list[Any]]
    seeds: Optional[int] = None
    member_devices: Optional[int] = None


def read_spec(run_dir: str) -> SweepSpec:
    """The grid, seeds and member devices of the sweep in `run_dir`; ConfigError if it has none."""
    try:
        with open(os.path.join(run_dir, SPEC_FILE)) as handle:
            return SweepSpec(**json.load(handle))
    except FileNotFoundError:
        raise ConfigError(f"{run_dir} has no {SPEC_FILE}: not a sweep's run directory "
                          "(resume a single run with python -m jaxddppo.train --resume)") from None
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{os.path.join(run_dir, SPEC_FILE)} is unreadable: {error}") from None


def run_sweep(config: Union[Config, Mapping, str], grid: Optional[Mapping[str, Sequence[Any]]] = None,
              seeds: Optional[int] = None, member_devices: Optional[int] = None,
              devices: Optional[Sequence[jax.Device]] = None, *, resume: bool = False,
              stop_after_updates: Optional[int] = None) -> SweepResult:
    """Train grid x seeds as one population; write config.yaml, sweep.json, metrics.jsonl,
    checkpoints, sweep.csv, summary.json and curves.png to the run dir and print the
    per-setting table.

    `grid` maps dotted keys to value lists, e.g. {"ppo.learning_rate": [3e-4, 1e-3]};
    `seeds` is the number of seeds from train.seed on (or give "train.seed": [...] in the grid).
    With `resume`, `config.run.dir` holds an earlier sweep of the same grid (`resume_sweep`
    reads both); `stop_after_updates` stops with a checkpoint, as `train.run` does.
    """
    config = as_config(config)
    backend_warnings = sharding.start_backend(config)
    spec = SweepSpec({key: list(values) for key, values in (grid or {}).items()}, seeds, member_devices)
    population = build_population(config, spec.grid, seeds, member_devices, devices)
    name = f"sweep-{population.config.env.id}"
    session = start_session(population, name, resume, stop_after_updates, backend_warnings)
    run_dir, progress, is_writer = session.run_dir, session.progress, jax.process_index() == 0
    if is_writer and not resume:
        write_json(os.path.join(run_dir, SPEC_FILE), asdict(spec))
    try:
        result = _results(population, train_experiment(population, session))
        if is_writer:
            save_curves(population, run_dir)
        if result.summary is not None:
            _report(population, result, progress)
    finally:
        progress.close()
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
                 stop_after_updates: Optional[int] = None) -> SweepResult:
    """Continue the sweep in `run_dir` from its newest checkpoint, with its config.yaml and
    sweep.json and the overrides a resume allows."""
    spec = read_spec(run_dir)
    return run_sweep(load_resume_config(run_dir, overrides), spec.grid, spec.seeds, spec.member_devices, devices,
                     resume=True, stop_after_updates=stop_after_updates)


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """`key=[a,b,...]` items become grid axes (values as written); the rest stay plain overrides.

    A list-valued option (e.g. network.hidden_sizes=[64,64]) is a plain override;
    a list of lists for it is a grid axis.
    """
    list_options = {opt.key for opt in options() if opt.type_name.startswith("list")}
    plain, grid = [], {}
    for item in overrides:
        key, sep, value = item.partition("=")
        value = value.strip()
        is_list = value.startswith("[") and value.endswith("]")
        if not sep or not is_list or (key in list_options and not value.startswith("[[")):
            plain.append(item)
            continue
        if key in grid:
            raise ConfigError(f"{key} is swept twice on the command line; give one list")
        inner = value[1:-1]
        items = [part.strip() for part in inner.split(",")] if inner.strip() else []
        if any(not part for part in items):
            raise ConfigError(f"override '{item}' has an empty value in its list")
        grid[key] = items
    return plain, grid


def with_cpu_device_per_core(config: Config, num_members: int, num_cores: int,
                             environ: Mapping[str, str]) -> Config:
    """The sweep command's default for `run.cpu_devices`: one CPU device per core, as many
    as divide the member count, where nothing else decides the device count and JAX runs
    on the CPU (`sharding.cpu_device_count_open`). Members never communicate, and on one
    device XLA's thread pool gains little from more cores for them. The Python API leaves
    the count alone: the devices of a process are fixed once JAX starts, and a training run
    in the same process would share its gradients over all of them."""
    if not sharding.cpu_device_count_open(config, environ):
        return config
    devices = sharding.cpu_devices_per_core(num_members, num_cores)
    return config if devices == 1 else with_overrides(config, {"run.cpu_devices": devices})


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m jaxddppo.sweep",
        description="Train a grid of hyperparameters x seeds as one population over every device. "
        "A list value, section.key=[v1,v2], sweeps that key; other section.key=value items override the "
        f"config of every member. Sweepable keys: {', '.join(SWEEPABLE_KEYS)}, {SEED_KEY}. Results: "
        "sweep.csv, metrics.jsonl (with a member column), curves.png, summary.json, checkpoints/ in run.dir; "
        "--resume continues a sweep from its newest checkpoint. Exit codes: 0 done, 1 failed (non-finite numbers, "
        f"distributed errors), 2 bad input, {STORAGE_EXIT_CODE} storage error (fix it, then resume), "
        f"{PREEMPTED_EXIT_CODE} stopped by SIGTERM/SIGINT with a checkpoint saved.",
        epilog="configuration keys (type, default): meaning\n" + help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help="YAML config file, e.g. experiments/cartpole.yaml")
    source.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the sweep in RUN_DIR (its config.yaml, sweep.json and newest checkpoint) "
                        f"with its grid; overrides may change only {', '.join(RESUMABLE_KEYS)}")
    parser.add_argument("--stop-after-updates", type=int, metavar="N",
                        help="stop with a checkpoint once every member has done N updates (the sweep can be resumed)")
    parser.add_argument("--seeds", type=int, help="seeds per grid point: train.seed, train.seed+1, ... (default 1)")
    parser.add_argument("--member-devices", type=int,
                        help="devices the members are split over (default: as many as divide the member count). "
                        "Unless this, run.cpu_devices, XLA_FLAGS' device count, distributed.* or JAX_PLATFORMS (naming "
                        "another platform first) decides the devices, the CPU is split into one device per core, as "
                        "many as divide the member count")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value|[v1,v2,...]",
                        help="override or sweep one option")
    args = parser.parse_intermixed_args(argv)
    if args.stop_after_updates is not None and args.stop_after_updates < 1:
        parser.error(f"--stop-after-updates={args.stop_after_updates} must be at least 1")
    if args.resume is not None and (args.seeds is not None or args.member_devices is not None):
        parser.error("--seeds and --member-devices cannot change on --resume: the sweep keeps its own")
    return args


def start(args: argparse.Namespace) -> SweepResult:
    """The sweep the command line asks for: a new one, or the resumed one."""
    plain, grid = split_overrides(args.overrides)
    if args.resume is not None:
        if grid:
            raise ConfigError(f"{', '.join(grid)} cannot be swept on --resume: the sweep keeps its own grid")
        return resume_sweep(args.resume, plain, stop_after_updates=args.stop_after_updates)
    config = load_config(args.config, plain)
    if args.member_devices is None:
        num_members = len(expand_members(config, grid, args.seeds))
        split = with_cpu_device_per_core(config, num_members, sharding.usable_cpu_cores(), os.environ)
        if split is not config and config.run.progress:
            print(f"jaxddppo sweep: run.cpu_devices={split.run.cpu_devices}, one CPU device per core for "
                  f"{num_members} members (run.cpu_devices=1 keeps one device)", flush=True)
        config = split
    return run_sweep(config, grid, args.seeds, args.member_devices, stop_after_updates=args.stop_after_updates)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        result = start(args)
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (sharding.DistributedError, sharding.ReplicaDivergence, NonFiniteError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except StorageError as error:
        print(f"error: {error}", file=sys.stderr)
        return STORAGE_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return PREEMPTED_EXIT_CODE if result.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
