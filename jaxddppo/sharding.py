"""The mesh, the compile wrapper and host transfers.

`shard_parallel` compiles a per-device function (which handles its shards through
`shards.DeviceShards`) over a one-axis mesh of devices (a single run) or a two-axis
(member, device) mesh (a sweep's population): every state leaf leads with the mesh's state
axes (`state_spec`). The host side: global arrays from host arrays (`put_members`,
`shared_array`), host copies of shards (`first_shard`, `member_first_shards`) and the
parameters' digests.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxddppo.shards import DEVICE_AXIS, MEMBER_AXIS, DeviceShards, over_leading_axis
from jaxddppo.topology import Placement


def make_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A one-axis mesh over `devices` (default: every device of every process)."""
    return Mesh(np.asarray(jax.devices() if devices is None else devices), (DEVICE_AXIS,))


def shard_sharding(mesh: Mesh) -> NamedSharding:
    """The leading state axes split over the mesh (`state_spec`), the rest whole."""
    return NamedSharding(mesh, state_spec(mesh))


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
        per_device = over_leading_axis(per_device, shared_argnums, batched=batch_members)
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


def _jit_over_mesh(per_device: Callable, mesh: Mesh, spec: PartitionSpec, donate_argnums: tuple[int, ...],
                   shared_argnums: tuple[int, ...] = ()) -> Callable:
    # Explicit output shardings: on a one-device mesh XLA may otherwise report
    # P() for some outputs, and feeding them back in would recompile.
    out_shardings = NamedSharding(mesh, spec)

    def over_mesh(*args: Any) -> Any:
        in_specs = tuple(PartitionSpec() if index in shared_argnums else spec for index in range(len(args)))
        return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)(*args)

    over_mesh.__name__ = per_device.__name__
    return jax.jit(over_mesh, out_shardings=out_shardings, donate_argnums=donate_argnums)


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
