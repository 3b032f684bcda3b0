"""Sizes and placement: every global and per-shard size of a run, derived once from the
config and the device count (`Topology`), and how a sweep's population of members x shards
maps onto the devices (`Placement`). Bad combinations raise one-line `ConfigError`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax

from jaxddppo.config.options import Config, ConfigError


@dataclass(frozen=True)
class Topology:
    """Global and per-shard sizes, derived once from the config and the devices."""

    num_devices: int
    num_processes: int
    num_shards: int
    shards_per_device: int
    num_envs: int
    num_envs_per_shard: int
    num_steps: int
    num_minibatches: int
    minibatch_size_per_shard: int
    env_steps_per_update: int
    num_updates: int
    updates_per_chunk: int

    @property
    def global_minibatch_size(self) -> int:
        return self.minibatch_size_per_shard * self.num_shards


def _require_divisible(name: str, value: int, divisor_name: str, divisor: int, advice: str) -> None:
    if value % divisor:
        raise ConfigError(f"{name}={value} is not divisible by {divisor_name}={divisor}; {advice}")


def make_topology(config: Config, num_devices: Optional[int] = None,
                  num_processes: Optional[int] = None) -> Topology:
    """Derive every size from the global config; raise ConfigError on a bad combination."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    num_processes = jax.process_count() if num_processes is None else num_processes
    num_shards = config.train.num_shards or num_devices
    shard_key = "train.num_shards" if config.train.num_shards else "train.num_shards (default: devices)"
    _require_divisible(shard_key, num_shards, "the device count", num_devices,
                       f"set train.num_shards to a multiple of {num_devices}")
    num_envs = config.env.num_envs
    _require_divisible("env.num_envs", num_envs, shard_key, num_shards,
                       f"set env.num_envs to a multiple of {num_shards}")
    num_envs_per_shard = num_envs // num_shards
    samples_per_shard = num_envs_per_shard * config.ppo.num_steps
    _require_divisible("env.num_envs/train.num_shards x ppo.num_steps", samples_per_shard, "ppo.num_minibatches",
                       config.ppo.num_minibatches, "change ppo.num_minibatches, ppo.num_steps or env.num_envs")
    if config.ppo.segment_length:
        _require_divisible("env.num_envs/train.num_shards x ppo.num_steps/ppo.segment_length",
                           samples_per_shard // config.ppo.segment_length, "ppo.num_minibatches",
                           config.ppo.num_minibatches, "minibatches are whole segments; change "
                           "ppo.num_minibatches, ppo.segment_length or env.num_envs")
    if config.network.recurrent is not None:
        _require_divisible(f"env.num_envs/{shard_key}", num_envs_per_shard, "ppo.num_minibatches",
                           config.ppo.num_minibatches, f"network.recurrent={config.network.recurrent} minibatches "
                           "are whole environment sequences; change ppo.num_minibatches or env.num_envs")
    env_steps_per_update = num_envs * config.ppo.num_steps
    num_updates = config.train.total_env_steps // env_steps_per_update
    if num_updates < 1:
        raise ConfigError(
            f"train.total_env_steps={config.train.total_env_steps} is less than one update "
            f"(env.num_envs x ppo.num_steps = {env_steps_per_update}); raise train.total_env_steps"
        )
    updates_per_chunk = min(config.train.updates_per_chunk, num_updates)
    for key in ("every_updates", "video_every_updates"):
        _check_eval_cadence(f"eval.{key}", getattr(config.eval, key), config.train.updates_per_chunk, num_updates)
    return Topology(
        num_devices=num_devices,
        num_processes=num_processes,
        num_shards=num_shards,
        shards_per_device=num_shards // num_devices,
        num_envs=num_envs,
        num_envs_per_shard=num_envs_per_shard,
        num_steps=config.ppo.num_steps,
        num_minibatches=config.ppo.num_minibatches,
        minibatch_size_per_shard=samples_per_shard // config.ppo.num_minibatches,
        env_steps_per_update=env_steps_per_update,
        num_updates=num_updates,
        updates_per_chunk=updates_per_chunk,
    )


def _check_eval_cadence(key: str, every_updates: int, updates_per_chunk_setting: int, num_updates: int) -> None:
    """Periodic evaluations and videos run between compiled chunks, so they must fall on chunk boundaries."""
    updates_per_chunk = min(updates_per_chunk_setting, num_updates)
    if every_updates == 0 or every_updates % updates_per_chunk == 0:
        return
    chunk_name = "train.updates_per_chunk"
    if updates_per_chunk < updates_per_chunk_setting:
        chunk_name += f" (capped at the run's {num_updates} updates)"
    raise ConfigError(
        f"{key}={every_updates} is not a multiple of {chunk_name}={updates_per_chunk}; "
        f"evaluations run between chunks of updates: set {key} to a multiple of {updates_per_chunk}"
    )


@dataclass(frozen=True)
class Placement:
    """How a population of members x shards maps onto a (member, device) mesh."""

    num_members: int
    num_shards: int  # per member
    member_devices: int  # mesh rows: members are split over them
    shard_devices: int  # mesh columns: each member's shards are split over them

    @property
    def members_per_device(self) -> int:
        return self.num_members // self.member_devices

    @property
    def shards_per_device(self) -> int:
        return self.num_shards // self.shard_devices


def place_population(num_members: int, num_shards: Optional[int], num_devices: int,
                     member_devices: Optional[int] = None) -> Placement:
    """Split `num_devices` into member_devices x shard_devices; raise ConfigError if impossible.

    member_devices must divide the member count and shard_devices the shard count.
    By default members get as many devices as possible (members never communicate);
    `num_shards=None` then means one shard per device of a member's row.
    """
    if member_devices is not None:
        if member_devices < 1:
            raise ConfigError(f"--member-devices={member_devices} must be at least 1")
        if num_devices % member_devices:
            raise ConfigError(f"--member-devices={member_devices} must divide the device count {num_devices}")
        _require_divisible("the member count (grid points x seeds)", num_members, "--member-devices", member_devices,
                           "choose --member-devices dividing the member count")
        candidates = [member_devices]
    else:
        candidates = [d for d in range(num_devices, 0, -1) if num_devices % d == 0 and num_members % d == 0]
    for rows in candidates:
        columns = num_devices // rows
        shards = columns if num_shards is None else num_shards
        if shards % columns == 0:
            return Placement(num_members, shards, rows, columns)
    if member_devices is not None:
        raise ConfigError(
            f"train.num_shards={num_shards} does not split over the {num_devices // member_devices} devices each member "
            f"gets with --member-devices={member_devices}; set train.num_shards to a multiple of "
            f"{num_devices // member_devices} or change --member-devices"
        )
    raise ConfigError(
        f"cannot place {num_members} member(s) x train.num_shards={num_shards} shard(s) on {num_devices} devices: "
        f"need member devices x shard devices = {num_devices}, member devices dividing {num_members} and shard "
        f"devices dividing {num_shards}; change train.num_shards or the member count"
    )
