"""Shard semantics: what a per-device function does with its device's shards.

A *shard* is a logical slice of the global batch with its own environments and its own
local minibatching; a *device* is physical. A value is laid out `PER_SHARD`, each leaf
leading with an axis of length `num_shards` split over the mesh axis `DEVICE_AXIS` (a
device holds `shards_per_device` of them), or `PER_MEMBER`, one value that every shard
uses (parameters, optimizer state, statistics), held whole on every device. A per-device function runs each of its shards' computations
with `DeviceShards.map` and reduces over all shards with `DeviceShards.sum`/`mean`; by
default the shards run one after another and sums add the shards in order of global shard
index, so the results do not depend on how shards map to devices, bit for bit.

A sweep's population adds a leading member axis, `MEMBER_AXIS`; members communicate only
for population-based training (`all_members`, `local_members`, `copy_members`).
The update (`ppo.py`), the normalisers and the evaluation never name an axis: they call
`DeviceShards`' methods and need this module alone. The mesh over these axes and the
compile wrapper are `sharding.py`'s; the host loop and the sweep read the mesh's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

DEVICE_AXIS = "device"
MEMBER_AXIS = "member"
PER_SHARD = "per shard"  # leaves lead with [num_shards], split over the devices
PER_MEMBER = "per member"  # one value for all of a member's shards, whole on each of its devices


def field_layouts(cls: type, per_shard_fields: Sequence[str]) -> Any:
    """The layout of a dataclass pytree `cls`: an instance whose fields are PER_SHARD if named
    in `per_shard_fields`, else PER_MEMBER (a prefix of every `cls` for `sharding.shard_parallel`)."""
    return cls(**{name: PER_SHARD if name in per_shard_fields else PER_MEMBER for name in cls.__dataclass_fields__})


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
        return over_leading_axis(per_shard, (), batched=True)(*args)

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


def all_members(tree: Any) -> Any:
    """A population's per-member values gathered in member order: leaves
    [members_per_device, ...] on each device in, [num_members, ...] out, the same on every
    device (bits copied, nothing added)."""
    return jax.tree.map(lambda leaf: jax.lax.all_gather(leaf, MEMBER_AXIS, tiled=True), tree)


def local_members(tree: Any, members_per_device: int) -> Any:
    """This device's members' rows of `tree`, whose leaves lead with [num_members]."""
    start = jax.lax.axis_index(MEMBER_AXIS) * members_per_device
    return jax.tree.map(lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, start, members_per_device), tree)


def copy_members(tree: Any, sources: jax.Array, destinations: jax.Array) -> Any:
    """This device's members' rows of `tree` (leaves [members_per_device, ...]) with member
    `destinations[k]`'s row replaced by member `sources[k]`'s, bit for bit, for each k
    (`sources`, `destinations`: [K] member indices, the same on every device; no source is
    a destination). One row crosses the member axis at a time, so a device holds its own
    members and one more row, where an all-gather would hold every member's.

    The row travels as a `psum` of its bits (`as_words`), to which every device but its holder
    adds zeros: integer sums are exact, where a float sum would turn -0.0 into 0.0."""
    members_per_device = _leading_length(tree)
    start = jax.lax.axis_index(MEMBER_AXIS) * members_per_device

    def local_index(member: jax.Array) -> tuple[jax.Array, jax.Array]:
        here = (member >= start) & (member < start + members_per_device)
        return here, jnp.clip(member - start, 0, members_per_device - 1)

    def copy_one(k: int, tree: Any) -> Any:
        held, source = local_index(sources[k])
        here, destination = local_index(destinations[k])

        def copy_leaf(leaf: jax.Array) -> jax.Array:
            words = as_words(leaf[source])
            row = from_words(jax.lax.psum(jnp.where(held, words, jnp.zeros_like(words)), MEMBER_AXIS), leaf.dtype)
            return jax.lax.dynamic_update_index_in_dim(leaf, jnp.where(here, row, leaf[destination]), destination, 0)

        return jax.tree.map(copy_leaf, tree)

    return jax.lax.fori_loop(0, sources.shape[0], copy_one, tree)


def as_words(value: jax.Array) -> jax.Array:
    """The raw bits of `value` as uint32 words: narrower types (bool as uint8) widened, wider
    ones split in 32-bit words (a last axis of 2). A `psum` adds uint32 on every backend
    (NCCL, for one, adds no 16-bit integers)."""
    if value.dtype == jnp.bool_:
        value = value.astype(jnp.uint8)
    width = value.dtype.itemsize
    if width < 4:
        return jax.lax.bitcast_convert_type(value, jnp.dtype(f"uint{8 * width}")).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(value, jnp.uint32)


def from_words(words: jax.Array, dtype: Any) -> jax.Array:
    """The value of `dtype` whose `as_words` are `words`."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return words != 0
    if dtype.itemsize < 4:
        words = words.astype(jnp.dtype(f"uint{8 * dtype.itemsize}"))
    return jax.lax.bitcast_convert_type(words, dtype)


def _in_turn(per_shard: Callable, args: tuple[Any, ...]) -> Any:
    """`per_shard` on each shard of `args` (leaves [L, ...]), one after another.

    XLA must compile the shard's computation alike for every L, and it would not for
    L = 1: a loop it knows runs once is inlined, and slices along an axis of length 1
    are simplified away, so a device's only shard would compute other last bits than a
    shard among several. So the loop's trip count is hidden from XLA, and a single
    shard's arguments and results sit in buffers of two (the second never read).
    """
    shards_per_device = _leading_length(args)
    buffer_length = max(shards_per_device, 2)
    if shards_per_device == 1:
        args = jax.tree.map(lambda leaf: jnp.concatenate([leaf, leaf]), args)
    shapes = jax.eval_shape(lambda shard_args: per_shard(*shard_args), jax.tree.map(lambda leaf: leaf[0], args))
    outputs = jax.tree.map(lambda shape: jnp.zeros((buffer_length, *shape.shape), shape.dtype), shapes)

    def one_shard(index: jax.Array, outputs: Any) -> Any:
        shard_args = jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), args)
        return jax.tree.map(lambda stacked, value: stacked.at[index].set(value), outputs, per_shard(*shard_args))

    trip_count = jax.lax.optimization_barrier(jnp.int32(shards_per_device))
    outputs = jax.lax.fori_loop(0, trip_count, one_shard, outputs)
    return jax.tree.map(lambda stacked: stacked[:shards_per_device], outputs)


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
    shards_per_device = leaves[0].shape[0]
    rows = jnp.concatenate([leaf.reshape(shards_per_device, -1) for leaf in leaves], axis=1)
    width = rows.shape[1]
    num_devices = jax.lax.axis_size(DEVICE_AXIS)
    if num_devices > 1:
        chunk = -(-width // num_devices)
        rows = jnp.pad(rows, ((0, 0), (0, chunk * num_devices - width)))
        rows = rows.reshape(shards_per_device, num_devices, chunk)
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


def over_leading_axis(function: Callable, shared_argnums: tuple[int, ...], batched: bool) -> Callable:
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
