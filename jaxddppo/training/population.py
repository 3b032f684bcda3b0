"""A sweep's population: the members of a grid of hyperparameters x seeds (`expand_members`)
and their experiment on a (member, device) mesh (`build_population`), and the spec that
rebuilds them on a resume (sweep.json, `SweepSpec`). Structural keys
(anything that changes array shapes or the compiled program) are refused in a grid: run one
sweep per value.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

import jax

from jaxddppo import sharding
from jaxddppo.config.files import SWEEP_SPEC_FILE, with_overrides
from jaxddppo.config.options import TRACED_KEYS, Config, ConfigError, config_value
from jaxddppo.config.reference import options
from jaxddppo.distributed.topology import make_topology, place_population
from jaxddppo.references import UserObjects
from jaxddppo.training.experiment import Experiment, Member, assemble


SEED_KEY = "train.seed"


def check_grid_keys(config: Config, grid: Mapping[str, Sequence[Any]]) -> None:
    """Unknown and structural keys, and empty value lists, are refused with one line."""
    known = {opt.key for opt in options()}
    for key, values in grid.items():
        if key not in known:
            with_overrides(config, {key: None})  # raises the config's own unknown-key message
        if key not in TRACED_KEYS and key != SEED_KEY:
            raise ConfigError(
                f"{key}={list(values)!r} cannot be swept: {key} is structural (it changes array shapes or the "
                f"compiled program); a sweep varies only {', '.join(TRACED_KEYS)} and {SEED_KEY} (or --seeds); "
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


def with_seed(config: Config, seed: Any) -> Config:
    """`config` with train.seed = `seed`: an int directly (with_overrides takes OmegaConf
    about 50 ms, a second and a half for a 32-seed sweep), anything else checked as an override."""
    if type(seed) is int:
        return replace(config, train=replace(config.train, seed=seed))
    return with_overrides(config, {SEED_KEY: seed})


def expand_members(config: Config, grid: Mapping[str, Sequence[Any]], num_seeds: Optional[int] = None) -> list[Member]:
    """Grid points (in the order of `grid`'s keys) x seeds, each validated as a config of its own."""
    check_grid_keys(config, grid)
    seeds = seed_list(config, grid, num_seeds)
    axes = {key: list(values) for key, values in grid.items() if key != SEED_KEY}
    members = []
    for setting, point in enumerate(itertools.product(*axes.values())):
        point_config = with_overrides(config, dict(zip(axes, point)))
        for seed in seeds:
            member_config = with_seed(point_config, seed)
            members.append(Member(
                index=len(members),
                setting=setting,
                seed=member_config.train.seed,
                values={key: config_value(member_config, key) for key in axes},
                config=member_config,
            ))
    return members


def build_population(config: Config, grid: Mapping[str, Sequence[Any]], num_seeds: Optional[int] = None,
                     member_devices: Optional[int] = None,
                     devices: Optional[Sequence[jax.Device]] = None,
                     objects: UserObjects = UserObjects()) -> Experiment:
    """Validate the grid, the placement and every size; compile nothing. `objects`: the
    environment and torso given to the Python API, if any (`experiment.assemble`)."""
    members = expand_members(config, grid, num_seeds)
    devices = list(jax.devices() if devices is None else devices)
    placement = place_population(len(members), config.train.num_shards, len(devices), member_devices)
    with_shards = lambda c: replace(c, train=replace(c.train, num_shards=placement.num_shards))
    config = with_shards(config)
    members = [replace(member, config=with_shards(member.config)) for member in members]
    topology = make_topology(config, num_devices=placement.shard_devices,
                                      num_processes=jax.process_count())
    mesh = sharding.make_population_mesh(placement.member_devices, placement.shard_devices, devices)
    return assemble(config, members, mesh, topology, objects)


def swept_keys(population: Experiment) -> list[str]:
    return list(population.members[0].values)


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """`key=[a,b,...]` items become grid axes (values as written); the rest stay plain overrides.

    A list-valued option (e.g. network.hidden_sizes=[64,64]) is a plain override;
    a list of lists for it is a grid axis. A list in a keyword-argument mapping
    (env.kwargs.*, network.torso_kwargs.*) is always a plain override.
    """
    list_options = {opt.key for opt in options() if opt.type_name.startswith("list")}
    mappings = tuple(f"{opt.key}." for opt in options() if opt.type_name.startswith("dict"))
    plain, grid = [], {}
    for item in overrides:
        key, sep, value = item.partition("=")
        value = value.strip()
        is_list = value.startswith("[") and value.endswith("]")
        # a keyword argument's list (env.kwargs.sizes=[3,5]) is its value: structural keys are never swept
        if not sep or not is_list or key.startswith(mappings) or (key in list_options and not value.startswith("[[")):
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


@dataclass(frozen=True)
class SweepSpec:
    """What makes a population out of a base config, kept in the run dir (sweep.json) for a resume."""

    grid: dict[str, list[Any]]
    seeds: Optional[int] = None
    member_devices: Optional[int] = None


def read_spec(run_dir: str) -> SweepSpec:
    """The grid, seeds and member devices of the sweep in `run_dir`; ConfigError if it has none."""
    try:
        with open(os.path.join(run_dir, SWEEP_SPEC_FILE)) as handle:
            return SweepSpec(**json.load(handle))
    except FileNotFoundError:
        raise ConfigError(f"{run_dir} has no {SWEEP_SPEC_FILE}: not a sweep's run directory "
                          "(resume a single run with python -m jaxddppo.train --resume)") from None
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{os.path.join(run_dir, SWEEP_SPEC_FILE)} is unreadable: {error}") from None
