"""All parallelism: mesh, shard axes, global and per-shard sizes, the shard_map wrapper.

A *shard* is a logical slice of the global batch with its own environments and
its own local minibatching; a *device* is physical. Every array of the training
state has a leading axis of length `num_shards`, split over the mesh axis
`DEVICE_AXIS`, so a device holds `shards_per_device` of them. A per-device
function runs each of its shards' computations with `DeviceShards.map` and
reduces over all shards with `DeviceShards.sum`/`mean`; by default the shards run
one after another and sums add the shards in order of global shard index, so the
results do not depend on how shards map to devices, bit for bit.

A sweep trains a *population* of independent members (seeds x hyperparameters)
in one program: state leaves get a leading `[num_members, num_shards]` pair of
axes, split over a two-axis mesh `(MEMBER_AXIS, DEVICE_AXIS)`. Members never
communicate; a member's shards reduce over `DEVICE_AXIS` within its mesh row.

A single run's mesh has no member axis. `shard_parallel` serves both meshes.
Other modules never name an axis: they call `DeviceShards`' methods.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxddppo.config import Config, ConfigError, DistributedConfig

DEVICE_AXIS = "device"
MEMBER_AXIS = "member"
# The XLA_FLAGS entry that splits the CPU into N devices when JAX starts.
CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


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


def _require_divisible(numerator: tuple[str, int], denominator: tuple[str, int], advice: str) -> None:
    (num_name, num_value), (den_name, den_value) = numerator, denominator
    if num_value % den_value:
        raise ConfigError(
            f"{num_name}={num_value} is not divisible by {den_name}={den_value}; {advice}"
        )


def make_topology(config: Config, num_devices: Optional[int] = None,
                  num_processes: Optional[int] = None) -> Topology:
    """Derive every size from the global config; raise ConfigError on a bad combination."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    num_processes = jax.process_count() if num_processes is None else num_processes
    num_shards = config.train.num_shards or num_devices
    shard_key = "train.num_shards" if config.train.num_shards else "train.num_shards (default: devices)"
    _require_divisible(
        (shard_key, num_shards), ("the device count", num_devices),
        f"set train.num_shards to a multiple of {num_devices}",
    )
    num_envs = config.env.num_envs
    _require_divisible(
        ("env.num_envs", num_envs), (shard_key, num_shards),
        f"set env.num_envs to a multiple of {num_shards}",
    )
    num_envs_per_shard = num_envs // num_shards
    samples_per_shard = num_envs_per_shard * config.ppo.num_steps
    _require_divisible(
        ("env.num_envs/train.num_shards x ppo.num_steps", samples_per_shard),
        ("ppo.num_minibatches", config.ppo.num_minibatches),
        "change ppo.num_minibatches, ppo.num_steps or env.num_envs",
    )
    if config.network.recurrent is not None:
        _require_divisible(
            (f"env.num_envs/{shard_key}", num_envs_per_shard),
            ("ppo.num_minibatches", config.ppo.num_minibatches),
            f"network.recurrent={config.network.recurrent} minibatches are whole environment sequences; "
            "change ppo.num_minibatches or env.num_envs",
        )
    env_steps_per_update = num_envs * config.ppo.num_steps
    num_updates = config.train.total_env_steps // env_steps_per_update
    if num_updates < 1:
        raise ConfigError(
            f"train.total_env_steps={config.train.total_env_steps} is less than one update "
            f"(env.num_envs x ppo.num_steps = {env_steps_per_update}); raise train.total_env_steps"
        )
    updates_per_chunk = min(config.train.updates_per_chunk, num_updates)
    _check_eval_cadence(config.eval.every_updates, config.train.updates_per_chunk, num_updates)
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


def _check_eval_cadence(every_updates: int, updates_per_chunk_setting: int, num_updates: int) -> None:
    """Periodic evaluations run between compiled chunks, so they must fall on chunk boundaries."""
    updates_per_chunk = min(updates_per_chunk_setting, num_updates)
    if every_updates == 0 or every_updates % updates_per_chunk == 0:
        return
    chunk_name = "train.updates_per_chunk"
    if updates_per_chunk < updates_per_chunk_setting:
        chunk_name += f" (capped at the run's {num_updates} updates)"
    raise ConfigError(
        f"eval.every_updates={every_updates} is not a multiple of {chunk_name}={updates_per_chunk}; "
        f"evaluations run between chunks of updates: set eval.every_updates to a multiple of {updates_per_chunk}"
    )


def make_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A one-axis mesh over `devices` (default: every device of every process)."""
    return Mesh(np.asarray(jax.devices() if devices is None else devices), (DEVICE_AXIS,))


def shard_sharding(mesh: Mesh) -> NamedSharding:
    """The leading state axes split over the mesh (`state_spec`), the rest whole."""
    return NamedSharding(mesh, state_spec(mesh))


@dataclass(frozen=True)
class DeviceShards:
    """How a per-device function (`shard_parallel`) handles the shards of its device,
    whose leaves lead with [shards_per_device]: `map` runs a per-shard function on each,
    `sum` and `mean` reduce a per-shard value over every shard of the run, giving the same
    unbatched value on every device.

    `exact` (`train.exact_reductions`): a device's shards run one after another and every
    sum adds the shards in order of their global index, whatever the device count, so a
    run computes the same bits on any number of devices. Otherwise shards run batched
    (`vmap`) and a sum is one all-reduce (`psum`), which adds in an order set by the
    placement; XLA also compiles a batch of shards otherwise than one shard, in the last
    bits.
    """

    exact: bool = True

    def map(self, per_shard: Callable, *args: Any) -> Any:
        """`per_shard` over the leading [shards_per_device] axis of every leaf of `args`."""
        if self.exact:
            return _in_turn(per_shard, args)
        return _over_leading_axis(per_shard, (), batched=True)(*args)

    @staticmethod
    def map_batched(per_shard: Callable, *args: Any) -> Any:
        """`per_shard` batched (`vmap`) over the device's shards, exact or not: only for
        computations whose bits batching cannot change (random keys, gathers and reshapes,
        elementwise arithmetic). Fewer loops compile faster."""
        return jax.vmap(per_shard)(*args)

    def sum(self, tree: Any) -> Any:
        """Sum over every shard of the run of `tree`, whose float leaves lead with
        [shards_per_device]; the result, without that axis, is the same on every device."""
        if self.exact:
            return _ordered_sum(tree)
        return jax.lax.psum(jax.tree.map(lambda leaf: jnp.sum(leaf, axis=0), tree), DEVICE_AXIS)

    def mean(self, tree: Any) -> Any:
        """Mean over every shard of the run (see `sum`)."""
        num_shards = self.num_shards(tree)
        return jax.tree.map(lambda total: total / num_shards, self.sum(tree))

    @staticmethod
    def num_shards(tree: Any) -> int:
        """The run's shard count, from a per-device value whose leaves lead with [shards_per_device]."""
        return jax.tree.leaves(tree)[0].shape[0] * jax.lax.axis_size(DEVICE_AXIS)


def one_copy(tree: Any) -> Any:
    """The first local shard's copy of a value every shard holds (leaves [shards_per_device, ...])."""
    return jax.tree.map(lambda leaf: leaf[0], tree)


def copies(tree: Any, shards_per_device: int) -> Any:
    """`tree` repeated for each of the device's shards: leaves [shards_per_device, ...]."""
    return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (shards_per_device, *jnp.shape(leaf))), tree)


def _in_turn(per_shard: Callable, args: tuple[Any, ...]) -> Any:
    """`per_shard` on each shard of `args` (leaves [L, ...]), one after another.

    XLA must compile the shard's computation alike for every L, and it would not for
    L = 1: a loop it knows runs once is inlined, and slices along an axis of length 1
    are simplified away, so a device's only shard would compute other last bits than a
    shard among several. So the loop's trip count is hidden from XLA, and a single
    shard's arguments and results sit in buffers of two (the second never read).
    """
    num_local = _leading_length(args)
    buffer_length = max(num_local, 2)
    if num_local == 1:
        args = jax.tree.map(lambda leaf: jnp.concatenate([leaf, leaf]), args)
    shapes = jax.eval_shape(lambda shard_args: per_shard(*shard_args), one_copy(args))
    outputs = jax.tree.map(lambda shape: jnp.zeros((buffer_length, *shape.shape), shape.dtype), shapes)

    def one_shard(index: jax.Array, outputs: Any) -> Any:
        shard_args = jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), args)
        return jax.tree.map(lambda stacked, value: stacked.at[index].set(value), outputs, per_shard(*shard_args))

    trip_count = jax.lax.optimization_barrier(jnp.int32(num_local))
    outputs = jax.lax.fori_loop(0, trip_count, one_shard, outputs)
    return jax.tree.map(lambda stacked: stacked[:num_local], outputs)


def _leading_length(tree: Any) -> int:
    return jax.tree.leaves(tree)[0].shape[0]


def _ordered_sum(tree: Any) -> Any:
    """Sum over every shard in order of global shard index: ((s0 + s1) + s2) + ...

    The leaves are laid end to end into [L, P] (L shards on this device). With D > 1
    devices, an all-to-all hands device d the d-th of D column chunks of every shard's
    row, in global shard order; it adds them and an all-gather reassembles the sum. Each
    device moves about (L + 1) x P values, like a ring all-reduce for L = 1, whatever D.
    """
    leaves, treedef = jax.tree.flatten(tree)
    num_local = leaves[0].shape[0]
    rows = jnp.concatenate([leaf.reshape(num_local, -1) for leaf in leaves], axis=1)
    width = rows.shape[1]
    num_devices = jax.lax.axis_size(DEVICE_AXIS)
    if num_devices > 1:
        chunk = -(-width // num_devices)
        rows = jnp.pad(rows, ((0, 0), (0, chunk * num_devices - width)))
        rows = rows.reshape(num_local, num_devices, chunk)
        rows = jax.lax.all_to_all(rows, DEVICE_AXIS, 1, 0, tiled=True)[:, 0]  # [num_shards, chunk]
    # A loop XLA cannot unroll: with D = 1 it would otherwise see through the sum to each
    # leaf and compile the consumers (the gradient's norm) otherwise than for D > 1.
    num_rows = jax.lax.optimization_barrier(jnp.int32(rows.shape[0]))
    total = jax.lax.fori_loop(1, num_rows, lambda row, total: total + rows[row], rows[0])
    if num_devices > 1:
        total = jax.lax.all_gather(total, DEVICE_AXIS, tiled=True)[:width]
    sizes = [leaf[0].size for leaf in leaves]
    parts = jnp.split(total, np.cumsum(sizes)[:-1])
    return jax.tree.unflatten(treedef, [part.reshape(leaf.shape[1:]) for part, leaf in zip(parts, leaves)])


def shard_parallel(per_device: Callable, mesh: Mesh, donate_argnums: tuple[int, ...] = (),
                   shared_argnums: tuple[int, ...] = (), batch_members: bool = True) -> Callable:
    """Compile `per_device` to run on every device of the mesh, on that device's shards.

    Every argument and result is a pytree whose leaves lead with the state axes of
    `mesh` (`state_spec`): [num_shards] on a run's mesh, [num_members, num_shards] on a
    population's; except the arguments at `shared_argnums`: one value for every shard
    (such as a chunk's count of updates), replicated over the mesh (`shared_array`) and
    not batched. `per_device` sees one member's [shards_per_device] leaves and handles
    its shards with `DeviceShards`. The members on a device are vmapped (each member's
    collectives stay within its own shards), or with `batch_members=False` run one after
    another (`lax.map`): XLA compiles a batch of members otherwise than one member, in the
    last bits, and a member run in turn computes what its single run computes, bit for
    bit (`train.batch_members`).
    `check_vma=False` gives pmap semantics: `jax.grad` inside `per_device` is the local
    gradient, and `DeviceShards.mean` then averages it (with the default `check_vma=True`,
    grad would already sum over devices).
    """
    if is_population(mesh):
        per_device = _over_leading_axis(per_device, shared_argnums, batched=batch_members)
    return _jit_over_mesh(per_device, mesh, state_spec(mesh), donate_argnums, shared_argnums)


def per_shard(function: Callable) -> Callable:
    """A per-device function (for `shard_parallel`) that runs `function` on each of the
    device's shards, batched (`DeviceShards.map_batched`: only for work whose bits batching
    cannot change); `function` must not reduce over shards."""
    return functools.wraps(function)(lambda *args: DeviceShards.map_batched(function, *args))


def is_population(mesh: Mesh) -> bool:
    """Whether `mesh` holds a population (a member axis) rather than a single run."""
    return MEMBER_AXIS in mesh.axis_names


def state_spec(mesh: Mesh) -> PartitionSpec:
    """How the leading axes of every state leaf split over `mesh`."""
    return PartitionSpec(MEMBER_AXIS, DEVICE_AXIS) if is_population(mesh) else PartitionSpec(DEVICE_AXIS)


def _over_leading_axis(function: Callable, shared_argnums: tuple[int, ...], batched: bool) -> Callable:
    """`function` over the leading axis of every argument but those at `shared_argnums`:
    `jax.vmap` if `batched`, else `lax.map` (one after another).

    An axis of length 1 is indexed instead: XLA compiles a batch of one otherwise than no
    batch (it turns the gradient's matrix products around), which would change the bits
    that a shard alone on its device, or a member, computes.
    """

    def mapped(*args: Any) -> Any:
        mapped_args = [arg for index, arg in enumerate(args) if index not in shared_argnums]

        def call(unshared: Sequence[Any]) -> Any:
            remaining = iter(unshared)
            return function(*[arg if index in shared_argnums else next(remaining) for index, arg in enumerate(args)])

        length = jax.tree.leaves(mapped_args)[0].shape[0]
        if length == 1:
            return jax.tree.map(lambda leaf: leaf[None], call(jax.tree.map(lambda leaf: leaf[0], mapped_args)))
        if not batched:
            return jax.lax.map(call, mapped_args)
        return jax.vmap(call)(mapped_args)

    mapped.__name__ = getattr(function, "__name__", "mapped")  # names the compiled program
    return mapped


# jaxlib 0.11.2 (0.11.1 and earlier are fine; jax pins jaxlib to its own release) crashes the
# process with a segmentation fault while compiling a jit(shard_map(f)) over two or more devices
# that passes a zero-sized array into f: an argument (navix's state holds one), or a constant f
# closes over, which JAX passes in the same way (JAX's own `x.at[:, :].set(y)` scatters with
# int32[0] indices, as xminigrid's resets do). The crash is in Shardy's canonicalisation
# (ManualComputationUnusedInputsPattern). In that range, zero-sized arguments, which hold no
# values, are made inside f instead of passed, and f runs in an inner `jax.jit`, which keeps its
# constants out of the shard_map's operands. tests/test_sharding.py runs both bare programs in
# subprocesses and fails once a release in the range compiles them: then bound it by that release.
_ZERO_SIZED_OPERAND_CRASH = jax.__version_info__ >= (0, 11, 2)


def _jit_over_mesh(per_device: Callable, mesh: Mesh, spec: PartitionSpec, donate_argnums: tuple[int, ...],
                   shared_argnums: tuple[int, ...] = ()) -> Callable:
    # Explicit output shardings: on a one-device mesh XLA may otherwise report
    # P() for some outputs, and feeding them back in would recompile.
    out_shardings = NamedSharding(mesh, spec)

    def over_mesh(*args: Any) -> Any:
        in_specs = tuple(PartitionSpec() if index in shared_argnums else spec for index in range(len(args)))
        if not _ZERO_SIZED_OPERAND_CRASH:
            return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)(*args)
        return _without_zero_sized_operands(per_device, mesh, in_specs, spec)(*args)

    over_mesh.__name__ = per_device.__name__
    return jax.jit(over_mesh, out_shardings=out_shardings, donate_argnums=donate_argnums)


def _without_zero_sized_operands(per_device: Callable, mesh: Mesh, in_specs: tuple[PartitionSpec, ...],
                                 out_spec: PartitionSpec) -> Callable:
    """`shard_map(per_device)` whose zero-sized argument leaves are made inside instead of
    passed, and whose body is an inner `jax.jit` (`_ZERO_SIZED_OPERAND_CRASH`)."""

    def mapped(*args: Any) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        leaf_specs = [arg_spec for arg, arg_spec in zip(args, in_specs) for _ in jax.tree.leaves(arg)]
        # (per-device shape, dtype) of each zero-sized leaf, None for the leaves passed in
        made_inside = [(NamedSharding(mesh, leaf_spec).shard_shape(leaf.shape), leaf.dtype) if leaf.size == 0
                       else None for leaf, leaf_spec in zip(leaves, leaf_specs)]

        def body(*passed: Any) -> Any:
            remaining = iter(passed)
            local = [jnp.zeros(*made) if made is not None else next(remaining) for made in made_inside]
            return per_device(*jax.tree.unflatten(treedef, local))

        passed = [leaf for leaf, made in zip(leaves, made_inside) if made is None]
        passed_specs = tuple(leaf_spec for leaf_spec, made in zip(leaf_specs, made_inside) if made is None)
        return jax.shard_map(jax.jit(body), mesh=mesh, in_specs=passed_specs, out_specs=out_spec,
                             check_vma=False)(*passed)

    return mapped


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def place_population(num_members: int, num_shards: Optional[int], num_devices: int,
                     member_devices: Optional[int] = None) -> Placement:
    """Split `num_devices` into member_devices x shard_devices; raise ConfigError if impossible.

    member_devices must divide the member count and shard_devices the shard count.
    By default members get as many devices as possible (members never communicate);
    `num_shards=None` then means one shard per device of a member's row.
    """
    if member_devices is not None:
        if member_devices < 1 or num_devices % member_devices:
            raise ConfigError(f"--member-devices={member_devices} must divide the device count {num_devices}")
        _require_divisible(("the member count (grid points x seeds)", num_members),
                           ("--member-devices", member_devices),
                           "choose --member-devices dividing the member count")
        candidates = [member_devices]
    else:
        candidates = [d for d in reversed(_divisors(num_devices)) if num_members % d == 0]
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


def make_population_mesh(placement: Placement, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A (member, device) mesh: each row holds whole members, a row's devices split their shards."""
    grid = np.asarray(jax.devices() if devices is None else devices).reshape(
        placement.member_devices, placement.shard_devices
    )
    return Mesh(grid, (MEMBER_AXIS, DEVICE_AXIS))


def put_members(tree: Any, mesh: Mesh) -> Any:
    """Host arrays leading [num_members, num_shards] as global arrays split over `mesh`,
    each process holding its own part; a run's mesh (no member axis) takes its one member's
    [num_shards]."""
    placement = shard_sharding(mesh)

    def put(leaf: Any) -> jax.Array:
        host = np.asarray(leaf) if is_population(mesh) else np.asarray(leaf)[0]
        return jax.make_array_from_callback(host.shape, placement, lambda index: host[index])

    return jax.tree.map(put, tree)


def member_first_shards(tree: Any, mesh: Mesh) -> Any:
    """Host copy of shard 0 of every member, for every leaf: [num_members, ...]. A
    population's is gathered on every process; a run's is read from this process's devices."""
    if not is_population(mesh):
        return jax.tree.map(lambda leaf: leaf[None], first_shard(tree))
    gathered = multihost_utils.process_allgather(jax.tree.map(lambda leaf: leaf[:, 0], tree), tiled=True)
    return jax.tree.map(np.asarray, gathered)


def params_digests(params: Any, mesh: Mesh) -> list[float]:
    """`params_digest` of every member (shard 0 of each)."""
    leaves = jax.tree.leaves(member_first_shards(params, mesh))
    return [_host_digest([leaf[member] for leaf in leaves]) for member in range(leaves[0].shape[0])]


def shared_array(mesh: Mesh, value: np.ndarray) -> jax.Array:
    """Host `value` as a global array replicated on every device of the mesh: an argument
    at `shared_argnums` of `shard_parallel`."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, replicated_sharding(mesh), lambda index: value[index])


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """The placement of `shared_array`s: a whole copy on every device."""
    return NamedSharding(mesh, PartitionSpec())


def first_shard(tree: Any) -> Any:
    """Host copy of one shard's slice of every leaf (from this process's own devices)."""

    def take(leaf: jax.Array) -> np.ndarray:
        local = min(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.asarray(local.data)[0]  # index on the host: no small device program per leaf

    return jax.tree.map(take, tree)


def all_shards(tree: Any) -> Any:
    """Host copy of every shard of every leaf (single-process runs and tests)."""
    return jax.tree.map(lambda leaf: np.asarray(jax.device_get(leaf)), tree)


def params_digest(params: Any) -> float:
    """float64 sum of |p| over every parameter of one shard."""
    return _host_digest(jax.tree.leaves(first_shard(params)))


def _host_digest(leaves: list[np.ndarray]) -> float:
    return float(sum(np.abs(np.asarray(leaf, dtype=np.float64)).sum() for leaf in leaves))


def broadcast_text(text: str, max_bytes: int = 4096) -> str:
    """Process 0's `text` on every process (a collective; a no-op in a single-process run)."""
    if jax.process_count() == 1:
        return text
    encoded = text.encode()
    if len(encoded) > max_bytes:
        raise ValueError(f"broadcast_text: {len(encoded)} bytes exceed {max_bytes}")
    buffer = np.zeros(max_bytes, np.uint8)
    buffer[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return bytes(received).rstrip(b"\0").decode()


class DistributedError(RuntimeError):
    """The multi-process runtime could not start; the message is one line."""


def _wait_for_coordinator(address: str, timeout_seconds: float) -> None:
    """Fail with one line if nothing listens at `address` within the timeout.

    JAX aborts the whole process (SIGABRT, a C++ stack trace) when it cannot
    register with the coordinator, so a process that is not the coordinator
    checks first that it can reach it.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"coordinator {address} unreachable for {timeout_seconds} s (distributed.init_timeout); "
                    "check that process 0 runs and that its host and port are reachable"
                ) from None
            time.sleep(0.25)


def backend_started() -> bool:
    """Whether JAX's backends have started (its devices exist), through public API: the
    CPU device count may change only before they start, and JAX refuses another value after."""
    count = jax.config.jax_num_cpu_devices
    try:
        jax.config.update("jax_num_cpu_devices", -2 if count == -1 else -1)  # both mean "not set"
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", count)
    return False


def set_cpu_threads(cpu_threads: int) -> Optional[str]:
    """Size XLA's CPU thread pool (`run.cpu_threads`; 0 leaves XLA's default, one thread per core).

    The pool is created with JAX's backend, from the PJRT_NPROC environment
    variable, so this must run before the first JAX computation of the process.
    Returns a one-line warning when the backend had started already with another
    setting (in a notebook, say), else None.
    """
    if cpu_threads == 0:
        return None
    wanted = str(cpu_threads)
    if backend_started():
        if os.environ.get("PJRT_NPROC") == wanted:
            return None
        return (f"warning: run.cpu_threads={cpu_threads} has no effect: JAX's backend started before it was "
                f"set; set it in a fresh process, or PJRT_NPROC={cpu_threads} in the environment")
    os.environ["PJRT_NPROC"] = wanted
    return None


def set_cpu_devices(cpu_devices: int) -> Optional[str]:
    """Split the CPU into `cpu_devices` JAX devices (`run.cpu_devices`; 0 leaves JAX's
    default: one, or as many as XLA_FLAGS' --xla_force_host_platform_device_count says).

    Like the thread pool, the CPU devices are created with JAX's backend, so this must
    run before the first JAX computation of the process. Returns a one-line warning when
    the backend had started already with another count, else None.
    """
    if cpu_devices == 0:
        return None
    if backend_started():
        try:
            if len(jax.devices("cpu")) == cpu_devices:
                return None
        except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
            return f"warning: run.cpu_devices={cpu_devices} has no effect: JAX runs without its CPU backend"
        return (f"warning: run.cpu_devices={cpu_devices} has no effect: JAX's backend started before it was "
                f"set; set it in a fresh process, or XLA_FLAGS={CPU_DEVICE_COUNT_FLAG}={cpu_devices}")
    jax.config.update("jax_num_cpu_devices", cpu_devices)
    return None


def cpu_device_count_open(config: Config, environ: Mapping[str, str]) -> bool:
    """Whether this process will run on CPU devices whose count nothing has decided yet:
    not `run.cpu_devices`, XLA_FLAGS' device count, a multi-process run (`distributed.*`)
    or a backend that has started already, and JAX_PLATFORMS, if set, names the CPU first."""
    distributed = config.distributed.coordinator is not None or config.distributed.auto
    decided = (config.run.cpu_devices > 0 or CPU_DEVICE_COUNT_FLAG in environ.get("XLA_FLAGS", "") or distributed
               or backend_started())
    platform = (environ.get("JAX_PLATFORMS") or "cpu").split(",")[0].strip()
    return not decided and platform == "cpu"


def usable_cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_devices_per_core(num_members: int, num_cores: int) -> int:
    """The most CPU devices, at most one per core, that `num_members` split over evenly."""
    return max(devices for devices in range(1, min(num_members, num_cores) + 1) if num_members % devices == 0)


def start_backend(config: Config) -> list[str]:
    """What a run or a sweep does before its first JAX computation: size the CPU thread
    pool (`set_cpu_threads`) and the CPU device count (`set_cpu_devices`), then join a
    multi-process run if the config asks for one and none is joined yet. Returns their
    warnings, if any."""
    warnings = [set_cpu_threads(config.run.cpu_threads), set_cpu_devices(config.run.cpu_devices)]
    if not jax.distributed.is_initialized():
        initialize_distributed(config.distributed)
    return [warning for warning in warnings if warning is not None]


def initialize_distributed(config: DistributedConfig) -> None:
    """Join a multi-process run when the config asks for one; otherwise stay single-process.

    Explicit settings win. Cluster auto-detection (SLURM, Open MPI, Cloud TPU,
    Kubernetes) runs only with `distributed.auto=true`, so stray cluster variables
    never start it.
    """
    if config.coordinator is not None:
        where = f"coordinator {config.coordinator}"
        explicit = {
            "coordinator_address": config.coordinator,
            "num_processes": config.num_processes,
            "process_id": config.process_id,
        }
        if config.process_id != 0:
            _wait_for_coordinator(config.coordinator, config.init_timeout)
    elif config.auto:
        where, explicit = "auto-detected cluster", {}
    else:
        return
    try:
        jax.distributed.initialize(
            **explicit,
            initialization_timeout=config.init_timeout,
            heartbeat_timeout_seconds=config.heartbeat_timeout,
        )
    except Exception as error:  # JAX raises several types, each with a many-line message
        detail = " ".join(str(error).split())[:300]
        raise DistributedError(
            f"jax.distributed could not start ({where}, distributed.init_timeout={config.init_timeout} s): {detail}"
        ) from None


class ReplicaDivergence(RuntimeError):
    """Shards hold different parameters; the message is one line."""


def _bit_checksum(tree: Any) -> jax.Array:
    """A wrapping sum of the raw bits of every leaf: any changed bit changes it (barring collisions)."""
    total = jnp.zeros((), jnp.uint32)
    for leaf in jax.tree.leaves(tree):
        bits = jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.uint32)
        total = total + jnp.sum(bits, dtype=jnp.uint32)
    return total


@functools.lru_cache(maxsize=None)
def _compiled_checksum(mesh: Mesh) -> Callable:
    return shard_parallel(per_shard(_bit_checksum), mesh)


def check_replicas(params: Any, mesh: Mesh, after_update: int) -> None:
    """Raise ReplicaDivergence unless, within every member, every shard on every process
    holds bitwise the same params."""
    checksums = np.asarray(multihost_utils.process_allgather(_compiled_checksum(mesh)(params), tiled=True))
    population = is_population(mesh)
    for member, row in enumerate(checksums.reshape(-1, checksums.shape[-1])):
        _raise_on_divergence(row, after_update, f" of member {member}" if population else "")


def _raise_on_divergence(every_shard: np.ndarray, after_update: int, whose: str) -> None:
    differing = [int(i) for i in np.flatnonzero(every_shard != every_shard[0])]
    if differing:
        raise ReplicaDivergence(
            f"replicas{whose} diverged after update {after_update}: shard(s) {differing} differ from shard 0 "
            f"(parameter bit checksums {every_shard.tolist()}); check that every host runs the same "
            "jaxddppo, JAX and jaxlib versions"
        )
