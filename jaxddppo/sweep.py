"""Sweeps: `python -m jaxddppo.sweep --config FILE [--seeds N] [section.key=[v1,v2,...] ...]`.

A sweep trains a population, grid points x seeds, as one compiled program:
every member has the structural config of the base run (env, sizes, network)
and its own seed and float hyperparameters, which are traced inputs vmapped
over the members. Members are spread over a (member, device) mesh
(`sharding.place_population`); each member is a data-parallel DD-PPO run
over its own shards and trains as the single run of its config would.

Structural keys (anything that changes array shapes or the compiled program)
are refused in a grid: run one sweep per value.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import numpy as np
from flax import struct
from matplotlib.figure import Figure

from jaxddppo import sharding
from jaxddppo.cli import OneLineParser
from jaxddppo.config import (
    Config,
    ConfigError,
    as_config,
    help_text,
    load_config,
    options,
    to_yaml,
    with_overrides,
)
from jaxddppo.envs import BatchedEnv, make_env
from jaxddppo.eval_episodes import EvalResult, evaluate_policy
from jaxddppo.outputs import MetricsWriter, Progress, json_safe, write_json
from jaxddppo.networks import ActorCritic, make_actor_critic
from jaxddppo.ppo import (
    PPOHyperparams,
    TrainState,
    UpdateMetrics,
    UpdateSettings,
    init_train_state,
    initial_params,
    make_update,
)
from jaxddppo.train import (
    abstract_update_count,
    chunk_episode_return,
    chunk_plan,
    claim_run_dir,
    lower_and_compile,
    metrics_rows,
    process_label,
    run_updates,
    update_count,
)

# Keys a grid may vary: the traced float hyperparameters, and the seed.
SWEEPABLE_KEYS: tuple[str, ...] = tuple(f"ppo.{name}" for name in PPOHyperparams.__dataclass_fields__)
SEED_KEY = "train.seed"

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


@dataclass(frozen=True)
class Member:
    """One member of the population: a grid point and a seed."""

    index: int
    setting: int
    seed: int
    values: dict[str, Any]  # swept key -> value, as typed in the config
    config: Config  # the single run this member is equivalent to


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


@struct.dataclass
class MemberInputs:
    """What distinguishes the members, one entry per (member, shard): leaves [num_members, num_shards]."""

    shard_index: jax.Array
    seed: jax.Array
    hyperparams: PPOHyperparams


@dataclass(frozen=True)
class Population:
    """Everything static about a sweep, and its compiled-on-demand entry points."""

    config: Config  # the base config, train.num_shards resolved
    members: tuple[Member, ...]
    placement: sharding.Placement
    topology: sharding.Topology  # of one member
    mesh: jax.sharding.Mesh
    env: BatchedEnv
    network: ActorCritic
    settings: UpdateSettings

    @property
    def swept_keys(self) -> list[str]:
        return list(self.members[0].values)

    def inputs(self) -> MemberInputs:
        num_members, num_shards = self.placement.num_members, self.placement.num_shards
        grid = lambda per_member: np.repeat(np.asarray(per_member)[:, None], num_shards, axis=1)
        hyperparams = [PPOHyperparams.from_config(member.config.ppo) for member in self.members]
        host = MemberInputs(
            shard_index=np.tile(np.arange(num_shards, dtype=np.int32), (num_members, 1)),
            seed=grid(np.array([member.seed for member in self.members], np.int32)),
            hyperparams=jax.tree.map(lambda *leaves: grid(np.stack(leaves)), *hyperparams),
        )
        return sharding.put_population(host, self.mesh)

    def initial_params(self) -> Any:
        """Every member's initial parameters, computed one member at a time: leaves [members, shards, ...]."""
        example_obs, _ = self.env.reset(jax.random.key(0), 1)
        init = jax.jit(lambda seed: initial_params(seed, self.network, example_obs))
        per_member = [jax.device_get(init(np.int32(member.seed))) for member in self.members]
        num_shards = self.placement.num_shards
        stacked = jax.tree.map(
            lambda *leaves: np.repeat(np.stack(leaves)[:, None], num_shards, axis=1), *per_member
        )
        return sharding.put_population(stacked, self.mesh)

    def init_fn(self) -> Callable[[MemberInputs, Any], TrainState]:
        """`(inputs, initial_params()) -> TrainState`: every member's initial state."""
        def init_shard(shard: MemberInputs, params: Any) -> TrainState:
            return init_train_state(
                shard.shard_index, shard.seed, self.env, self.network,
                self.topology.num_envs_per_shard, shard.hyperparams, self.settings, params,
            )

        return sharding.shard_parallel(init_shard, self.mesh)

    def learn_fn(self) -> Callable[[TrainState, MemberInputs, jax.Array], tuple[TrainState, UpdateMetrics]]:
        """`(state, inputs, num_updates)`: up to `updates_per_chunk` updates of every member in
        one call, as many as `num_updates` says (`train.update_count`); metrics leaves [members,
        shards, updates_per_chunk], zeros after the last update (`train.run_updates`)."""
        update = make_update(self.env, self.network, self.settings)
        capacity = self.topology.updates_per_chunk

        def learn(state: TrainState, shard: MemberInputs, num_updates: jax.Array) -> tuple[TrainState, UpdateMetrics]:
            return run_updates(update, shard.hyperparams, state, num_updates, capacity)

        return sharding.shard_parallel(learn, self.mesh, donate_argnums=(0,), shared_argnums=(2,))

    def evaluate(self, state: TrainState, inputs: MemberInputs) -> EvalResult:
        """Every member's final deterministic evaluation, as a single run does it: host [members, episodes]."""
        num_episodes = self.config.eval.num_episodes

        def evaluate_shard(shard_state: TrainState, shard: MemberInputs) -> EvalResult:
            key = jax.random.fold_in(jax.random.key(shard.seed), 2)
            return evaluate_policy(self.env, self.network, shard_state.params, key, num_episodes,
                                   shard_state.obs_moments)

        return sharding.member_first_shards(sharding.shard_parallel(evaluate_shard, self.mesh)(state, inputs))


def build_population(config: Config, grid: Mapping[str, Sequence[Any]], num_seeds: Optional[int] = None,
                     member_devices: Optional[int] = None,
                     devices: Optional[Sequence[jax.Device]] = None) -> Population:
    """Validate the grid, the placement and every size; compile nothing."""
    members = expand_members(config, grid, num_seeds)
    devices = list(jax.devices() if devices is None else devices)
    placement = sharding.place_population(len(members), config.train.num_shards, len(devices), member_devices)
    with_shards = lambda c: replace(c, train=replace(c.train, num_shards=placement.num_shards))
    config = with_shards(config)
    members = [replace(member, config=with_shards(member.config)) for member in members]
    env = make_env(config.env.id)
    topology = sharding.make_topology(config, num_devices=placement.shard_devices,
                                      num_processes=jax.process_count())
    return Population(
        config=config,
        members=tuple(members),
        placement=placement,
        topology=topology,
        mesh=sharding.make_population_mesh(placement, devices),
        env=env,
        network=make_actor_critic(config.network, env.spec),
        settings=UpdateSettings.from_config(config, topology),
    )


@dataclass(frozen=True)
class PopulationLoop:
    state: TrainState
    train_seconds: float
    final_returns: list[Optional[float]]  # per member
    episode_returns: np.ndarray  # [members, updates], NaN where no episode ended


def train_chunks(population: Population, state: TrainState, inputs: MemberInputs, learn: Callable,
                 writer: Optional[MetricsWriter], progress: Progress) -> PopulationLoop:
    """Call, block, time, log: the host loop over chunks of updates of the whole population."""
    topology, num_members = population.topology, population.placement.num_members
    train_seconds, updates_done = 0.0, 0
    final_returns: list[Optional[float]] = [None] * num_members
    curves = []
    for size in chunk_plan(0, topology.num_updates, topology.updates_per_chunk, 0):
        chunk_start = time.perf_counter()
        state, metrics = learn(state, inputs, update_count(population.mesh, size))
        metrics = sharding.member_first_shards(metrics)  # blocks until the chunk is done
        metrics = jax.tree.map(lambda column: column[:, :size], metrics)
        chunk_seconds = time.perf_counter() - chunk_start
        for member in range(num_members):
            member_metrics = jax.tree.map(lambda leaf: leaf[member], metrics)
            if writer is not None:
                rows = metrics_rows(member_metrics, updates_done, topology.env_steps_per_update,
                                    train_seconds + chunk_seconds)
                writer.write([{"member": member, **row} for row in rows])
            chunk_return = chunk_episode_return(member_metrics)
            final_returns[member] = chunk_return if chunk_return is not None else final_returns[member]
        curves.append(np.asarray(metrics.episode_return_mean, np.float64))
        updates_done += size
        if population.config.debug.check_replicas:
            sharding.check_replicas(state.params, population.mesh, updates_done)
        train_seconds += time.perf_counter() - chunk_start  # the host's logging counts too
        known = [r for r in final_returns if r is not None]
        progress.update(
            updates_done * topology.env_steps_per_update * num_members,
            size * topology.env_steps_per_update * num_members / chunk_seconds,
            float(np.mean(known)) if known else None,
        )
    return PopulationLoop(state, train_seconds, final_returns, np.concatenate(curves, axis=1))


def member_rows(population: Population, loop: PopulationLoop, evaluation: EvalResult) -> list[dict]:
    """The rows of sweep.csv: one per member."""
    digests = sharding.params_digests(loop.state.params)
    returns = np.asarray(evaluation.returns, np.float64)
    rows = []
    for member in population.members:
        rows.append({
            "member": member.index,
            "setting": member.setting,
            "seed": member.seed,
            **member.values,
            "final_episode_return": loop.final_returns[member.index],
            "eval_return_mean": float(returns[member.index].mean()),
            "eval_return_std": float(returns[member.index].std()),
            "params_digest": digests[member.index],
        })
    return rows


def setting_rows(population: Population, rows: list[dict]) -> list[dict]:
    """One row per grid point: its values and mean / std over its seeds."""
    settings = []
    for setting in sorted({member.setting for member in population.members}):
        mine = [row for row in rows if row["setting"] == setting]
        eval_means = np.array([row["eval_return_mean"] for row in mine])
        finals = np.array([np.nan if row["final_episode_return"] is None else row["final_episode_return"]
                           for row in mine])
        settings.append({
            "setting": setting,
            **{key: mine[0][key] for key in population.swept_keys},
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


def format_table(population: Population, settings: list[dict]) -> str:
    """Per-setting results, the best one marked with '*'."""
    best = best_setting(settings)["setting"]
    header = ["", "setting", *population.swept_keys, "seeds", "eval return (mean +- std over seeds)", "final return"]
    lines = []
    for row in settings:
        final = "n/a" if row["final_episode_return"] is None else f"{row['final_episode_return']:.1f}"
        lines.append([
            "*" if row["setting"] == best else "", str(row["setting"]),
            *(f"{row[key]:g}" if isinstance(row[key], float) else str(row[key]) for key in population.swept_keys),
            str(row["num_seeds"]), f"{row['eval_return_mean']:.1f} +- {row['eval_return_std']:.1f}", final,
        ])
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    render = lambda cells: "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()
    return "\n".join([render(header), *map(render, lines)])


def plot_learning_curves(env_steps: np.ndarray, returns: np.ndarray, groups: Sequence[int],
                         labels: Mapping[int, str], title: str, path: str) -> None:
    """A PNG of the training return against env steps: per group, the mean over its members and a
    band of +-1 standard deviation. `returns` is [members, points] (NaN where unknown)."""
    figure = Figure(figsize=(7, 4.5), dpi=100)
    axes = figure.subplots()
    groups = np.asarray(groups)
    for group, label in labels.items():
        curves = returns[groups == group]
        seen = np.isfinite(curves).any(axis=0)
        mean = np.full(curves.shape[1], np.nan)
        std = np.full(curves.shape[1], np.nan)
        mean[seen] = np.nanmean(curves[:, seen], axis=0)
        std[seen] = np.nanstd(curves[:, seen], axis=0)
        (line,) = axes.plot(env_steps, mean, label=f"{label} ({len(curves)} seeds)")
        axes.fill_between(env_steps, mean - std, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
    axes.set_xlabel("environment steps (per member)")
    axes.set_ylabel("training episode return")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, format="png")


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows([{key: "" if json_safe(value) is None else value for key, value in row.items()}
                          for row in rows])


@dataclass(frozen=True)
class SweepResult:
    """What `run_sweep` returns; `members` are the rows of sweep.csv, `settings` the printed table."""

    summary: dict
    members: list[dict]
    settings: list[dict]
    best: dict
    run_dir: str
    state: TrainState  # leaves [num_members, num_shards, ...]

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.run_dir, "metrics.jsonl")

    @property
    def plot_path(self) -> str:
        return os.path.join(self.run_dir, "curves.png")


def _summary(population: Population, loop: PopulationLoop, compile_seconds: float, best: dict) -> dict:
    topology, placement = population.topology, population.placement
    per_member = topology.num_updates * topology.env_steps_per_update
    total = per_member * placement.num_members
    return {
        "env_id": population.config.env.id,
        "swept_keys": population.swept_keys,
        "num_members": placement.num_members,
        "num_settings": len({member.setting for member in population.members}),
        "num_seeds": placement.num_members // len({member.setting for member in population.members}),
        "num_shards": placement.num_shards,
        "member_devices": placement.member_devices,
        "shard_devices": placement.shard_devices,
        "num_devices": population.mesh.devices.size,
        "num_processes": jax.process_count(),
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "env_steps_per_member": per_member,
        "total_env_steps": total,
        "compile_seconds": round(compile_seconds, 3),
        "train_seconds": round(loop.train_seconds, 3),
        "env_steps_per_second": round(total / loop.train_seconds, 1),
        "best_setting": {key: best[key] for key in population.swept_keys},
        "best_eval_return_mean": best["eval_return_mean"],
        "best_eval_return_std": best["eval_return_std"],
    }


def _write_results(population: Population, result: SweepResult, loop: PopulationLoop) -> None:
    write_csv(os.path.join(result.run_dir, "sweep.csv"), result.members)
    write_json(os.path.join(result.run_dir, "summary.json"), result.summary)
    topology = population.topology
    env_steps = np.arange(1, topology.num_updates + 1) * topology.env_steps_per_update
    labels = {row["setting"]: setting_label({key: row[key] for key in population.swept_keys})
              for row in result.settings}
    plot_learning_curves(env_steps, loop.episode_returns, [m.setting for m in population.members], labels,
                         f"{population.config.env.id}: {population.placement.num_members} members",
                         result.plot_path)


def run_sweep(config: Union[Config, Mapping, str], grid: Optional[Mapping[str, Sequence[Any]]] = None,
              seeds: Optional[int] = None, member_devices: Optional[int] = None,
              devices: Optional[Sequence[jax.Device]] = None) -> SweepResult:
    """Train grid x seeds as one population; write config.yaml, metrics.jsonl, sweep.csv, summary.json
    and curves.png to the run dir and print the per-setting table.

    `grid` maps dotted keys to value lists, e.g. {"ppo.learning_rate": [3e-4, 1e-3]};
    `seeds` is the number of seeds from train.seed on (or give "train.seed": [...] in the grid).
    """
    config = as_config(config)
    backend_warnings = sharding.start_backend(config)
    population = build_population(config, grid or {}, seeds, member_devices, devices)
    config, topology, placement = population.config, population.topology, population.placement
    is_writer = jax.process_index() == 0
    run_dir = claim_run_dir(config.run.dir, f"sweep-{config.env.id}") if is_writer else ""
    if is_writer:
        with open(os.path.join(run_dir, "config.yaml"), "w") as handle:
            handle.write(to_yaml(replace(config, run=replace(config.run, dir=run_dir))))
    progress = Progress(topology.num_updates * topology.env_steps_per_update * placement.num_members,
                        config.run.progress and is_writer)
    progress.message(
        f"jaxddppo sweep{process_label()}: {config.env.id}, {placement.num_members} member(s) "
        f"({len({member.setting for member in population.members})} setting(s)) x "
        f"{placement.num_shards} shard(s) on {population.mesh.devices.size} {jax.default_backend()} device(s) "
        f"({placement.member_devices} member rows x {placement.shard_devices} shard columns); "
        f"{topology.num_updates} updates of {topology.env_steps_per_update} steps per member"
        + (f"; writing to {run_dir}" if is_writer else "")
    )
    for warning in backend_warnings:
        progress.message(warning)
    compile_start = time.perf_counter()
    inputs = population.inputs()
    params = population.initial_params()
    abstract_count = abstract_update_count(population.mesh)
    compiled = lower_and_compile(
        lambda: population.init_fn().trace(inputs, params),
        lambda state: {"learn": lambda: population.learn_fn().lower(state, inputs, abstract_count)},
    )
    state = compiled["init"](inputs, params)
    jax.block_until_ready(state)
    compile_seconds = time.perf_counter() - compile_start

    writer = MetricsWriter(os.path.join(run_dir, "metrics.jsonl")) if is_writer else None
    try:
        loop = train_chunks(population, state, inputs, compiled["learn"], writer, progress)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    rows = member_rows(population, loop, population.evaluate(loop.state, inputs))
    settings = setting_rows(population, rows)
    best = best_setting(settings)
    result = SweepResult(_summary(population, loop, compile_seconds, best), rows, settings, best, run_dir,
                         loop.state)
    if is_writer:
        _write_results(population, result, loop)
        print(format_table(population, settings), flush=True)
    summary = result.summary
    progress.message(
        f"done{process_label()}: {summary['total_env_steps']:,} steps in {loop.train_seconds:.1f} s "
        f"({summary['env_steps_per_second']:,.0f} steps/s, compile {compile_seconds:.1f} s); best "
        f"{setting_label(summary['best_setting'])}: eval return {best['eval_return_mean']:.1f} +- "
        f"{best['eval_return_std']:.1f} over seeds" + (f"; {run_dir}/sweep.csv" if is_writer else "")
    )
    return result


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
        "sweep.csv, metrics.jsonl (with a member column), curves.png, summary.json in run.dir.",
        epilog="configuration keys (type, default): meaning\n" + help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config file, e.g. experiments/cartpole.yaml")
    parser.add_argument("--seeds", type=int, help="seeds per grid point: train.seed, train.seed+1, ... (default 1)")
    parser.add_argument("--member-devices", type=int,
                        help="devices the members are split over (default: as many as divide the member count). "
                        "Unless this, run.cpu_devices, XLA_FLAGS' device count, distributed.* or JAX_PLATFORMS (naming "
                        "another platform first) decides the devices, the CPU is split into one device per core, as "
                        "many as divide the member count")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value|[v1,v2,...]",
                        help="override or sweep one option")
    return parser.parse_intermixed_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        plain, grid = split_overrides(args.overrides)
        config = load_config(args.config, plain)
        if args.member_devices is None:
            num_members = len(expand_members(config, grid, args.seeds))
            split = with_cpu_device_per_core(config, num_members, sharding.usable_cpu_cores(), os.environ)
            if split is not config and config.run.progress:
                print(f"jaxddppo sweep: run.cpu_devices={split.run.cpu_devices}, one CPU device per core for "
                      f"{num_members} members (run.cpu_devices=1 keeps one device)", flush=True)
            config = split
        run_sweep(config, grid, args.seeds, args.member_devices)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (sharding.DistributedError, sharding.ReplicaDivergence) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
