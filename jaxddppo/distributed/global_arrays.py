"""Global arrays between the host and the devices: global arrays from host arrays
(`put_members`, `shared_array`), host copies (`first_shard`, `member_values`,
`local_copy`), the parameters' digests, and the bit checksums of a state on its mesh
(`state_checksums`, `state_digest`, `replica_checksums`).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxddppo.sharding import (
    PER_MEMBER,
    PER_SHARD,
    DeviceShards,
    as_words,
    is_population,
    layout_spec,
    leaf_placements,
    shard_parallel,
)


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


def path_names(path: tuple) -> tuple[str, ...]:
    """A leaf's path as names: a field or dict entry by its name, a sequence item by its
    index. A saved tree's leaves keep these names whatever containers hold them back."""
    return tuple(str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", key)))) for key in path)


def named_leaves(tree: Any) -> dict[str, Any]:
    """The leaves of `tree` keyed by their `path_names` joined with "/"."""
    return {"/".join(path_names(path)): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


_SALT_STEP = 0x9E3779B9


def _name_salt(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def _bit_checksum(tree: Any) -> jax.Array:
    """Two wrapping sums ([2] uint32) over the raw bits of every element of every leaf, laid
    end to end, each mixed first with its position in its leaf and its leaf's name: any
    changed element changes both sums, and so does a moved one (barring collisions, about
    2**-64), but the leaves' order does not, so a tree restored in other containers sums
    the same. One pass over one vector: tested leaf by leaf, the program took seconds to
    compile."""
    words = {name: _leaf_bits(leaf).reshape(-1) for name, leaf in named_leaves(tree).items()}
    if not words:
        return jnp.zeros(2, jnp.uint32)
    bits = jnp.concatenate(list(words.values()))
    # A word's salt is (its position in its leaf) * STEP + its leaf's name salt: one iota over
    # the vector plus a constant per leaf, which compiles in half the time of an iota per leaf.
    starts = np.cumsum([0] + [leaf_words.size for leaf_words in words.values()])[:-1]
    leaf_terms = jnp.concatenate([jnp.full(leaf_words.size, (_name_salt(name) - int(start) * _SALT_STEP) % 2**32,
                                           jnp.uint32) for (name, leaf_words), start in zip(words.items(), starts)])
    salt = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(_SALT_STEP) + leaf_terms
    lanes = (_mix(bits ^ salt), _mix(_mix(bits + salt) ^ jnp.uint32(0x5BD1E995)))
    return jnp.stack([jnp.sum(lane, dtype=jnp.uint32) for lane in lanes])


def _as_uint64(lanes: np.ndarray) -> np.ndarray:
    """[..., 2] uint32 checksums as [...] uint64."""
    lanes = np.asarray(lanes).astype(np.uint64)
    return (lanes[..., 0] << np.uint64(32)) | lanes[..., 1]


def by_layout(tree: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The leaves of a global `tree` (arrays, or shapes with shardings) on a training mesh,
    by name (`named_leaves`): (the per-shard ones, the per-member ones)."""
    leaves = named_leaves(tree)
    is_per_shard = {name: leaf.sharding.spec == layout_spec(PER_SHARD, leaf.sharding.mesh)
                    for name, leaf in leaves.items()}
    return ({name: leaf for name, leaf in leaves.items() if is_per_shard[name]},
            {name: leaf for name, leaf in leaves.items() if not is_per_shard[name]})


@functools.lru_cache(maxsize=None)
def checksum_program(mesh: Mesh) -> Callable:
    """The program of `state_checksums` on `mesh`, called with `by_layout(tree)`; to call
    or to compile ahead of time."""

    def checksums(per_shard_leaves: dict[str, jax.Array], per_member_leaves: dict[str, jax.Array]
                  ) -> tuple[jax.Array, jax.Array]:
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


def _device_checksum(member_tree: Any) -> jax.Array:
    return _bit_checksum(member_tree)[None]


@functools.lru_cache(maxsize=None)
def _replica_checksum_program(mesh: Mesh) -> Callable:
    """`replica_checksums`' program on `mesh`: one function, so that JAX compiles it once per
    tree shape, not at every check."""
    return shard_parallel(_device_checksum, mesh, in_layouts=(PER_MEMBER,))


def replica_checksums(tree: Any, mesh: Mesh) -> np.ndarray:
    """The `_bit_checksum` of every device's copy of a per-member `tree`: [..., devices per
    member] uint64 with the mesh's member axis, the same on every process (a collective)."""
    return _as_uint64(multihost_utils.process_allgather(_replica_checksum_program(mesh)(tree), tiled=True))


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
