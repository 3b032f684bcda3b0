"""The mesh, the compile wrapper, host transfers and digests.

`shard_parallel` compiles a per-device function (which handles its shards through
`shards.DeviceShards`) over a one-axis mesh of devices (a single run) or a two-axis
(member, device) mesh (a sweep's population): every leaf leads with the mesh's axes its
layout names (`layout_spec`: [num_shards] or nothing on a run's mesh, [num_members,
num_shards] or [num_members] on a population's). The host side: global arrays from host
arrays (`put_members`, `shared_array`), host copies (`first_shard`, `member_values`), the
parameters' digests and the bit checksums of a state (`state_checksums`, `state_digest`).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxddppo.shards import DEVICE_AXIS, MEMBER_AXIS, PER_MEMBER, PER_SHARD, DeviceShards, as_words, over_leading_axis


def make_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A one-axis mesh over `devices` (default: every device of every process)."""
    return Mesh(np.asarray(jax.devices() if devices is None else devices), (DEVICE_AXIS,))


def shard_sharding(mesh: Mesh, layout: str = PER_SHARD) -> NamedSharding:
    """The placement of a leaf of `layout` on `mesh` (`layout_spec`)."""
    return NamedSharding(mesh, layout_spec(layout, mesh))


def layout_spec(layout: str, mesh: Mesh) -> PartitionSpec:
    """How the leading axes of a leaf of `layout` (`shards.PER_SHARD` or `PER_MEMBER`) split
    over `mesh`: a population's leaves lead with the member axis, then per-shard ones with
    the shard axis; a per-member leaf is whole on each of its member's devices."""
    members = (MEMBER_AXIS,) if is_population(mesh) else ()
    return PartitionSpec(*members, DEVICE_AXIS) if layout == PER_SHARD else PartitionSpec(*members)


def leaf_placements(layouts: Any, tree: Any, mesh: Mesh) -> Any:
    """`tree` with each leaf replaced by its `NamedSharding` on `mesh`, from `layouts` (a
    prefix of `tree` whose leaves are layouts)."""
    return jax.tree.map(lambda layout, subtree: jax.tree.map(lambda _: shard_sharding(mesh, layout), subtree),
                        layouts, tree)


def shard_parallel(per_device: Callable, mesh: Mesh, donate_argnums: tuple[int, ...] = (),
                   shared_argnums: tuple[int, ...] = (), batch_members: bool = True,
                   over_members: bool = True, in_layouts: Optional[tuple[Any, ...]] = None,
                   out_layouts: Any = PER_SHARD) -> Callable:
    """Compile `per_device` to run on every device of the mesh, on that device's shards.

    Every argument and result is a pytree whose leaves lead with the axes of `mesh` their
    layout names (`layout_spec`): `in_layouts` holds one layout prefix per argument
    (default: all `PER_SHARD`), `out_layouts` one of the result. A per-shard leaf leads
    with [num_shards] on a run's mesh, [num_members, num_shards] on a population's; a
    per-member one with nothing, or [num_members]. The arguments at `shared_argnums` are
    one value for every shard (such as a chunk's count of updates), replicated over the
    mesh (`shared_array`) and not batched. `per_device` sees one member's leaves, per-shard
    ones as [shards_per_device], and handles its shards with `DeviceShards`. The members
    on a device are vmapped (each member's collectives stay within its own shards), or with
    `batch_members=False` run one after another (`lax.map`): XLA compiles a batch of members
    otherwise than one member, in the last bits, and a member run in turn computes what its
    single run computes, bit for bit (`train.batch_members`). With `over_members=False`,
    `per_device` sees all of its device's members at once (leaves [members_per_device, ...])
    and maps over them itself: what a population-based training step across members needs.
    `check_vma=False` gives pmap semantics: `jax.grad` inside `per_device` is the local
    gradient, and `DeviceShards.mean` then averages it (with the default `check_vma=True`,
    grad would already sum over devices).
    """
    if is_population(mesh) and over_members:
        per_device = over_leading_axis(per_device, shared_argnums, batched=batch_members)
    return _jit_over_mesh(per_device, mesh, in_layouts, out_layouts, donate_argnums, shared_argnums)


def per_shard(function: Callable) -> Callable:
    """A per-device function (for `shard_parallel`) that runs `function` on each of the
    device's shards, batched (`DeviceShards.map_batched`: only for work whose bits batching
    cannot change); `function` must not reduce over shards."""
    return functools.wraps(function)(lambda *args: DeviceShards.map_batched(function, *args))


def is_population(mesh: Mesh) -> bool:
    """Whether `mesh` holds a population (a member axis) rather than a single run."""
    return MEMBER_AXIS in mesh.axis_names


# jaxlib 0.11.2 (0.11.1 and earlier, 0.12.0 and 0.12.0.1 are fine; jax pins jaxlib to its own
# release) crashes the process with a segmentation fault while compiling a jit(shard_map(f)) over two
# or more devices that passes a zero-sized array into f: an argument (navix's state holds one), or a
# constant f closes over, which JAX passes in the same way (JAX's own `x.at[:, :].set(y)` scatters with
# int32[0] indices, as xminigrid's resets do). The crash is in Shardy's canonicalisation
# (ManualComputationUnusedInputsPattern). On that release, zero-sized arguments, which hold no
# values, are made inside f instead of passed, and f runs in an inner `jax.jit`, which keeps its
# constants out of the shard_map's operands. tests/test_sharding.py runs both bare programs in
# subprocesses, expecting the crash exactly in this range.
_ZERO_SIZED_OPERAND_CRASH = (0, 11, 2) <= jax.__version_info__ < (0, 12)


def _jit_over_mesh(per_device: Callable, mesh: Mesh, in_layouts: Optional[tuple[Any, ...]], out_layouts: Any,
                   donate_argnums: tuple[int, ...], shared_argnums: tuple[int, ...] = ()) -> Callable:
    # Explicit output shardings: on a one-device mesh XLA may otherwise report
    # P() for some outputs, and feeding them back in would recompile.
    out_shardings = jax.tree.map(lambda layout: shard_sharding(mesh, layout), out_layouts)
    out_specs = jax.tree.map(lambda placement: placement.spec, out_shardings)

    def over_mesh(*args: Any) -> Any:
        layouts = in_layouts or (PER_SHARD,) * len(args)
        in_specs = tuple(
            jax.tree.map(lambda _: PartitionSpec(), arg) if index in shared_argnums
            else jax.tree.map(lambda placement: placement.spec, leaf_placements(layouts[index], arg, mesh))
            for index, arg in enumerate(args)
        )
        if not _ZERO_SIZED_OPERAND_CRASH:
            return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
        return _without_zero_sized_operands(per_device, mesh, in_specs, out_specs)(*args)

    over_mesh.__name__ = per_device.__name__
    return jax.jit(over_mesh, out_shardings=out_shardings, donate_argnums=donate_argnums)


def _without_zero_sized_operands(per_device: Callable, mesh: Mesh, in_specs: tuple[Any, ...],
                                 out_specs: Any) -> Callable:
    """`shard_map(per_device)` whose zero-sized argument leaves are made inside instead of
    passed, and whose body is an inner `jax.jit` (`_ZERO_SIZED_OPERAND_CRASH`)."""

    def mapped(*args: Any) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        leaf_specs = jax.tree.leaves(in_specs)
        # (per-device shape, dtype) of each zero-sized leaf, None for the leaves passed in
        made_inside = [(NamedSharding(mesh, leaf_spec).shard_shape(leaf.shape), leaf.dtype) if leaf.size == 0
                       else None for leaf, leaf_spec in zip(leaves, leaf_specs)]

        def body(*passed: Any) -> Any:
            remaining = iter(passed)
            local = [jnp.zeros(*made) if made is not None else next(remaining) for made in made_inside]
            return per_device(*jax.tree.unflatten(treedef, local))

        passed = [leaf for leaf, made in zip(leaves, made_inside) if made is None]
        passed_specs = tuple(leaf_spec for leaf_spec, made in zip(leaf_specs, made_inside) if made is None)
        return jax.shard_map(jax.jit(body), mesh=mesh, in_specs=passed_specs, out_specs=out_specs,
                             check_vma=False)(*passed)

    return mapped


def make_population_mesh(member_devices: int, shard_devices: int,
                         devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A (member, device) mesh of `member_devices` rows and `shard_devices` columns: each row
    holds whole members, a row's devices split their shards."""
    grid = np.asarray(jax.devices() if devices is None else devices).reshape(member_devices, shard_devices)
    return Mesh(grid, (MEMBER_AXIS, DEVICE_AXIS))


def put_members(tree: Any, mesh: Mesh, layouts: Any = PER_SHARD) -> Any:
    """Host arrays leading [num_members, num_shards] (per-shard leaves) or [num_members]
    (per-member ones, as `layouts` says) as global arrays placed on `mesh`, each process
    holding its own part; a run's mesh (no member axis) takes its one member's."""

    def put(leaf: Any, placement: NamedSharding) -> jax.Array:
        host = np.asarray(leaf) if is_population(mesh) else np.asarray(leaf)[0]
        return jax.make_array_from_callback(host.shape, placement, lambda index: host[index])

    return jax.tree.map(put, tree, leaf_placements(layouts, tree, mesh))


def member_values(tree: Any, mesh: Mesh) -> Any:
    """Host copy of every member's value of a per-member `tree`: leaves [num_members, ...].
    A population's is gathered on every process; a run's is read from this process's devices."""
    if not is_population(mesh):
        return jax.tree.map(lambda leaf: leaf[None], local_copy(tree))
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def local_copy(tree: Any) -> Any:
    """Host copy of a run's per-member `tree`, from one of this process's devices."""
    return jax.tree.map(lambda leaf: np.asarray(leaf.addressable_shards[0].data), tree)


def params_digests(params: Any, mesh: Mesh) -> list[float]:
    """`params_digest` of every member."""
    leaves = jax.tree.leaves(member_values(params, mesh))
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
    """Host copy of one shard's slice of every leaf of a per-shard tree (from this process's own devices)."""

    def take(leaf: jax.Array) -> np.ndarray:
        local = min(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.asarray(local.data)[0]  # index on the host: no small device program per leaf

    return jax.tree.map(take, tree)


def all_shards(tree: Any) -> Any:
    """Host copy of every shard of every leaf (single-process runs and tests)."""
    return jax.tree.map(lambda leaf: np.asarray(jax.device_get(leaf)), tree)


def params_digest(params: Any) -> float:
    """float64 sum of |p| over every parameter of a run's (per-member) `params`."""
    return _host_digest(jax.tree.leaves(local_copy(params)))


def _host_digest(leaves: list[np.ndarray]) -> float:
    return float(sum(np.abs(np.asarray(leaf, dtype=np.float64)).sum() for leaf in leaves))


def _leaf_bits(leaf: jax.Array) -> jax.Array:
    """The raw bits of `leaf` as uint32 words (`shards.as_words`; typed keys as their key data)."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return as_words(leaf)


def _mix(bits: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection, so a changed input always changes the output."""
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        bits = (bits ^ (bits >> shift)) * jnp.uint32(factor)
    return bits ^ (bits >> 16)


def _bit_checksum(tree: Any) -> jax.Array:
    """Two wrapping sums ([2] uint32) over the raw bits of every element of every leaf, laid
    end to end, each mixed with its position first: any changed element changes both sums,
    and so does a moved one (barring collisions, about 2**-64). One pass over one vector:
    tested leaf by leaf, the program took seconds to compile."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros(2, jnp.uint32)
    bits = jnp.concatenate([_leaf_bits(leaf).reshape(-1) for leaf in leaves])
    salt = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    lanes = (_mix(bits ^ salt), _mix(_mix(bits + salt) ^ jnp.uint32(0x5BD1E995)))
    return jnp.stack([jnp.sum(lane, dtype=jnp.uint32) for lane in lanes])


def _as_uint64(lanes: np.ndarray) -> np.ndarray:
    """[..., 2] uint32 checksums as [...] uint64."""
    lanes = np.asarray(lanes).astype(np.uint64)
    return (lanes[..., 0] << np.uint64(32)) | lanes[..., 1]


def by_layout(tree: Any) -> tuple[list[Any], list[Any]]:
    """The leaves of a global `tree` (arrays, or shapes with shardings) on a training mesh:
    (the per-shard ones, the per-member ones), each in tree order."""
    leaves = jax.tree.leaves(tree)
    is_per_shard = [leaf.sharding.spec == layout_spec(PER_SHARD, leaf.sharding.mesh) for leaf in leaves]
    return ([leaf for leaf, shard in zip(leaves, is_per_shard) if shard],
            [leaf for leaf, shard in zip(leaves, is_per_shard) if not shard])


@functools.lru_cache(maxsize=None)
def checksum_program(mesh: Mesh) -> Callable:
    """The program of `state_checksums` on `mesh`, called with `by_layout(tree)`; to call
    or to compile ahead of time."""

    def checksums(per_shard_leaves: list[jax.Array], per_member_leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        return DeviceShards.map_batched(_bit_checksum, per_shard_leaves), _bit_checksum(per_member_leaves)

    return shard_parallel(checksums, mesh, in_layouts=(PER_SHARD, PER_MEMBER), out_layouts=(PER_SHARD, PER_MEMBER))


def state_checksums(tree: Any, mesh: Mesh, checksum: Optional[Callable] = None) -> np.ndarray:
    """The `_bit_checksum`s of a global state on `mesh` (per-shard and per-member leaves, see
    `by_layout`), computed where the values lie (by `checksum`, `checksum_program(mesh)`
    compiled for the tree, if given) and gathered: [..., num_shards + 1] uint64 with the
    mesh's member axis, each shard's then its member's, the same on every process. A
    collective in a multi-process run."""
    per_shard, per_member = (checksum or checksum_program(mesh))(*by_layout(tree))
    gathered = multihost_utils.process_allgather((per_shard, per_member), tiled=True)
    return np.concatenate([_as_uint64(gathered[0]), _as_uint64(gathered[1])[..., None]], axis=-1)


def replica_checksums(tree: Any, mesh: Mesh) -> np.ndarray:
    """The `_bit_checksum` of every device's copy of a per-member `tree`: [..., devices per
    member] uint64 with the mesh's member axis, the same on every process (a collective)."""
    per_device = shard_parallel(lambda member_tree: _bit_checksum(member_tree)[None], mesh, in_layouts=(PER_MEMBER,))
    return _as_uint64(multihost_utils.process_allgather(per_device(tree), tiled=True))


def state_digest(tree: Any, checksum: Optional[Callable] = None) -> str:
    """16 hex digits summing up every bit of every leaf of a global `tree`: of a state on a
    training mesh (with per-shard leaves), its shards' and members' checksums (see
    `state_checksums`), so the digest does not depend on the device or process count; of
    any other tree, one checksum of all of it. The same on every process (a collective in
    a multi-process run)."""
    leaves = jax.tree.leaves(tree)
    placement = getattr(leaves[0], "sharding", None) if leaves else None
    if isinstance(placement, NamedSharding) and by_layout(tree)[0]:
        checksums = state_checksums(tree, placement.mesh, checksum)
    else:
        checksums = _as_uint64(jax.device_get(jax.jit(_bit_checksum)(tree)))
    return hashlib.sha256(np.ascontiguousarray(checksums, dtype="<u8").tobytes()).hexdigest()[:16]
