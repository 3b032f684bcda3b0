"""Population-based training inside the compiled program: rank a sweep's members by their
fitness, let the weakest copy the whole learning state of the strongest (`exploit`) and
perturb or resample the hyperparameters they take with it (`decide`).

Every device computes the same decisions: from every member's fitness and hyperparameters,
gathered over the mesh in member order, and from a key folded from the population's PBT
key with the update index. A loser's state moves to it from its winner's device one
member at a time (`sharding.copy_members`), bit for bit; a member keeps its own environments
and random streams. Static choices are `PBTSettings`; the traced state every shard carries
is `PBTState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxddppo import sharding
from jaxddppo.config.options import TRACED_BOUNDS, PBTConfig
from jaxddppo.ppo import PPOHyperparams, TrainState


@dataclass(frozen=True)
class PBTSettings:
    """What PBT does, fixed for a population: when, how many, and how it explores."""

    every_updates: int
    last_update: int  # the run's last update: no exploit there, the members are final
    num_members: int
    num_losers: int  # the bottom members that copy, as many as the top members they copy from
    keys: tuple[str, ...]  # PPOHyperparams fields that change
    reported: tuple[str, ...]  # the fields pbt.jsonl and sweep.csv report: the swept ones and `keys`
    grid_values: tuple[tuple[float, ...], ...]  # per key: the values its resampling draws from
    perturb: tuple[float, ...]
    resample_probability: float
    fitness: str  # train_return or eval_return

    @classmethod
    def from_config(cls, config: PBTConfig, member_hyperparams: Sequence[dict[str, float]], swept: Sequence[str],
                    last_update: int) -> "PBTSettings":
        """`member_hyperparams`: each member's PPOHyperparams fields; `swept`: the grid's keys."""
        num_members = len(member_hyperparams)
        keys = config.keys or tuple(key for key in swept if key.startswith("ppo."))
        names = tuple(key.split(".", 1)[1] for key in keys)
        swept_names = tuple(key.split(".", 1)[1] for key in swept if key.startswith("ppo."))
        return cls(
            every_updates=config.every_updates,
            last_update=last_update,
            num_members=num_members,
            num_losers=losers_of(num_members, config.quantile),
            keys=names,
            reported=tuple(dict.fromkeys(swept_names + names)),
            grid_values=tuple(tuple(sorted({values[name] for values in member_hyperparams})) for name in names),
            perturb=tuple(config.perturb),
            resample_probability=config.resample_probability,
            fitness=config.fitness,
        )

    def due(self, update_index: jax.Array) -> jax.Array:
        """Whether the members exploit after update `update_index` (a traced count)."""
        return (update_index % self.every_updates == 0) & (update_index < self.last_update)


def losers_of(num_members: int, quantile: float) -> int:
    """How many members copy: the quantile of the population rounded up, at most half of it."""
    return min(math.ceil(num_members * quantile), num_members // 2)


@struct.dataclass
class PBTState:
    """What PBT carries per member: the member's
    hyperparameters, the fitness sums of the interval so far, the population's key, and
    the record of the latest exploit (the host logs it)."""

    hyperparams: PPOHyperparams
    return_sum: jax.Array  # float32: sum over the interval's updates of mean episode return x episodes
    episodes: jax.Array  # float32: episodes that ended in the interval
    key: jax.Array  # the population's PBT key, the same for every member
    copied_from: jax.Array  # int32: the member copied at the chunk's exploit; -1 none
    previous: PPOHyperparams  # the hyperparameters before that exploit
    fitness: jax.Array  # float32: the fitness of the last ranking (NaN before the first)


@struct.dataclass
class PBTTrainState(TrainState):
    """The state of a population with PBT: the update's (which leaves `pbt` alone) and
    PBT's. A state without PBT keeps `TrainState`'s fields alone, as its checkpoints do."""

    pbt: Optional[PBTState] = None


def init_pbt_state(hyperparams: PPOHyperparams, key: jax.Array) -> PBTState:
    zero = jnp.zeros((), jnp.float32)
    return PBTState(hyperparams=hyperparams, return_sum=zero, episodes=zero, key=key,
                    copied_from=jnp.int32(-1), previous=hyperparams, fitness=jnp.full((), jnp.nan, jnp.float32))


def accumulate(state: PBTState, episode_return_mean: jax.Array, episodes_completed: jax.Array) -> PBTState:
    """`state` after a chunk whose updates' metrics are given ([capacity], zeros past the
    chunk's last update; a mean is NaN where no episode ended); clears the exploit record."""
    weighted = jnp.where(episodes_completed > 0, episode_return_mean * episodes_completed, 0.0)
    return state.replace(
        return_sum=state.return_sum + jnp.sum(weighted),
        episodes=state.episodes + jnp.sum(episodes_completed),
        copied_from=jnp.int32(-1),
        previous=state.hyperparams,
    )


def interval_fitness(state: PBTState) -> jax.Array:
    """Mean return of the training episodes that ended since the last exploit; NaN if none."""
    return jnp.where(state.episodes > 0, state.return_sum / jnp.maximum(state.episodes, 1.0), jnp.nan)


@struct.dataclass
class Decision:
    """Per member [num_members]: the member whose state it takes (itself if it keeps its
    own) and the hyperparameters it trains with next; and the members that take another's
    state [num_losers]."""

    source: jax.Array
    hyperparams: PPOHyperparams
    losers: jax.Array


def ranking(fitness: jax.Array) -> jax.Array:
    """Member indices from the fittest to the weakest; NaN ranks lowest, ties by member index."""
    return jnp.argsort(-jnp.where(jnp.isnan(fitness), -jnp.inf, fitness), stable=True)


def decide(settings: PBTSettings, fitness: jax.Array, hyperparams: PPOHyperparams, key: jax.Array) -> Decision:
    """Who copies whom and with which hyperparameters, from every member's `fitness` [N] and
    `hyperparams` (leaves [N]): each of the bottom `num_losers` takes a top member drawn
    at random, and each of `settings.keys` of that member's hyperparameters is drawn from
    the key's grid values with `resample_probability`, else multiplied by a factor drawn
    from `perturb`; then clipped to `TRACED_BOUNDS`. The others keep theirs."""
    order = ranking(fitness)
    num_members, num_losers = settings.num_members, settings.num_losers
    winners, losers = order[:num_losers], order[num_members - num_losers:]
    key_winner, key_explore = jax.random.split(key)
    picked = winners[jax.random.randint(key_winner, (num_losers,), 0, num_losers)]
    source = jnp.arange(num_members, dtype=jnp.int32).at[losers].set(picked.astype(jnp.int32))
    copied = jax.tree.map(lambda leaf: leaf[source], hyperparams)
    is_loser = source != jnp.arange(num_members)
    changes = {}
    for index, name in enumerate(settings.keys):
        member_keys = jax.vmap(lambda member: jax.random.fold_in(jax.random.fold_in(key_explore, index), member))(
            jnp.arange(num_members))
        changes[name] = jnp.where(is_loser, jax.vmap(lambda member_key, value: explore(
            settings, index, member_key, value))(member_keys, getattr(copied, name)), getattr(copied, name))
    return Decision(source=source, hyperparams=copied.replace(**changes), losers=losers.astype(jnp.int32))


def explore(settings: PBTSettings, index: int, key: jax.Array, value: jax.Array) -> jax.Array:
    """Key `settings.keys[index]`'s next value after `value`: resampled or perturbed, clipped."""
    key_resample, key_factor, key_value = jax.random.split(key, 3)
    factors = jnp.asarray(settings.perturb, jnp.float32)
    grid = jnp.asarray(settings.grid_values[index], jnp.float32)
    perturbed = value * factors[jax.random.randint(key_factor, (), 0, len(settings.perturb))]
    resampled = grid[jax.random.randint(key_value, (), 0, len(settings.grid_values[index]))]
    chosen = jnp.where(jax.random.uniform(key_resample) < settings.resample_probability, resampled, perturbed)
    low, high = TRACED_BOUNDS[settings.keys[index]]
    return jnp.clip(chosen, low, high)


def exploit(settings: PBTSettings, carried: Any, state: PBTState, fitness: jax.Array,
            update_index: jax.Array) -> tuple[Any, PBTState]:
    """Rank, copy and explore on every device of a population (inside `shard_parallel` with
    `over_members=False`): `carried`, the learning state a member copies, and `state` have
    per-member leaves [members_per_device, ...]; `fitness` [members_per_device].
    Returns both with the losers' rows replaced by their winners' (bit for bit) and the
    hyperparameters decided, the record of the exploit in `state`."""
    members_per_device = state.copied_from.shape[0]
    key = jax.random.fold_in(state.key[0], update_index)
    decision = decide(settings, sharding.all_members(fitness), sharding.all_members(state.hyperparams), key)
    carried = sharding.copy_members(carried, decision.source[decision.losers], decision.losers)
    members = sharding.local_members(jnp.arange(settings.num_members, dtype=jnp.int32), members_per_device)
    source = sharding.local_members(decision.source, members_per_device)
    zero = jnp.zeros((members_per_device,), jnp.float32)
    state = state.replace(
        hyperparams=sharding.local_members(decision.hyperparams, members_per_device),
        return_sum=zero,
        episodes=zero,
        copied_from=jnp.where(source != members, source, -1),
        fitness=fitness,
    )
    return carried, state


def exploit_rows(update: int, record: Any, keys: Sequence[str]) -> list[dict]:
    """The pbt.jsonl rows of a chunk's exploits from `record`, a host PBTState of every
    member (leaves [num_members]); `keys`: the PPOHyperparams fields to report."""
    copied_from = np.asarray(record.copied_from)
    fitness = np.asarray(record.fitness, np.float64)
    values = lambda hyperparams, member: {f"ppo.{name}": as_decimal(np.asarray(getattr(hyperparams, name))[member])
                                          for name in keys}
    return [{
        "update": update,
        "member": member,
        "copied_from": int(copied_from[member]),
        "fitness": float(fitness[member]),
        "source_fitness": float(fitness[copied_from[member]]),
        "old": values(record.previous, member),
        "new": values(record.hyperparams, member),
    } for member in np.flatnonzero(copied_from >= 0).tolist()]


def initial_rows(record: Any, keys: Sequence[str]) -> list[dict]:
    """pbt.jsonl's rows of update 0: every member's hyperparameters as it starts."""
    return [{"update": 0, "member": member, "copied_from": None, "fitness": None, "source_fitness": None,
             "old": None, "new": {f"ppo.{name}": as_decimal(np.asarray(getattr(record.hyperparams, name))[member])
                                  for name in keys}}
            for member in range(len(np.asarray(record.copied_from)))]


def as_decimal(value: np.floating) -> float:
    """A float32 hyperparameter as the shortest decimal that reads back as it (1e-4, not 9.99999974e-05)."""
    return float(str(np.float32(value)))


def lineages(rows: Sequence[dict], num_members: int) -> list[str]:
    """Each member's lineage from pbt.jsonl's rows: the members its state passed through,
    from the one it started as, with the update of each copy ("2 -8-> 0 -24-> 1": member 2's
    state, copied into member 0 after update 8, then into member 1 after update 24)."""
    lineage = [str(member) for member in range(num_members)]
    for row in sorted((row for row in rows if row["copied_from"] is not None), key=lambda row: row["update"]):
        lineage[row["member"]] = f"{lineage[row['copied_from']]} -{row['update']}-> {row['member']}"
    return lineage
