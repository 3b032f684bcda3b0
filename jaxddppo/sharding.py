"""Shard semantics and the mesh: the one module of the algorithm that names a device axis.

A *shard* is a logical slice of the global batch with its own environments and its own
local minibatching (its keys for each update, `update_keys`, and its epochs' orders,
`epoch_indices`); a *device* is physical. A value is laid out `PER_SHARD`, each leaf
leading with an axis of length `num_shards` split over the mesh axis `DEVICE_AXIS` (a
device holds `shards_per_device` of them), or `PER_MEMBER`, one value that every shard
uses (parameters, optimizer state, statistics), held whole on every device. A per-device
function runs each of its shards' computations with `DeviceShards.map` and reduces over
all shards with `DeviceShards.sum`/`mean`; by default the shards run one after another and
sums add the shards in order of global shard index, so the results do not depend on how
shards map to devices, bit for bit.

`shard_parallel` compiles a per-device function over a one-axis mesh of devices (a single
run) or a two-axis (member, device) mesh (a sweep's population): every leaf leads with the
mesh's axes its layout names (`layout_spec`: [num_shards] or nothing on a run's mesh,
[num_members, num_shards] or [num_members] on a population's). Members communicate only
for population-based training (`all_members`, `local_members`, `copy_members`). Host
copies, digests and checksums of global arrays are `distributed/global_arrays.py`'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DEVICE_AXIS = "device"
MEMBER_AXIS = "member"
PER_SHARD = "per shard"  # leaves lead with [num_shards], split over the devices
PER_MEMBER = "per member"  # one value for all of a member's shards, whole on each of its devices


def field_layouts(cls: type, per_shard_fields: Sequence[str]) -> Any:
    """The layout of a dataclass pytree `cls`: an instance whose fields are PER_SHARD if named
    in `per_shard_fields`, else PER_MEMBER (a prefix of every `cls` for `shard_parallel`)."""
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


def normalize_minibatch_advantages(
    advantages: jax.Array, indices: Optional[jax.Array], shards: DeviceShards
) -> jax.Array:
    """Advantages of every minibatch, normalised over that global minibatch (all shards).

    `advantages` [L, N] are the device's shards' flat advantages; `indices` [L, E, M, n]
    pick each epoch's minibatches, or are None where `advantages` are one minibatch. The
    statistics of all E x M minibatches are reduced together, around a shift common to
    every shard (the rollout mean) so E[x^2] - E[x]^2 does not cancel.
    """
    shift = shards.mean(shards.map(jnp.mean, advantages))
    if indices is None:
        centered = advantages - shift
    else:
        centered = shards.map_batched(lambda shard, index: shard[index] - shift, advantages, indices)
    mean, mean_square = shards.mean(shards.map(
        lambda shard: (jnp.mean(shard, -1), jnp.mean(jnp.square(shard), -1)), centered
    ))
    std = jnp.sqrt(jnp.maximum(mean_square - jnp.square(mean), 0.0))
    # A product, not a division: XLA may rewrite a division into a product by the
    # reciprocal, depending on the surrounding program, which would change the last bits.
    inverse_std = 1.0 / (std + 1e-8)
    return shards.map_batched(lambda shard: (shard - mean[..., None]) * inverse_std[..., None], centered)


def sequence_advantages(
    advantages: jax.Array, env_indices: jax.Array, normalize: bool, shards: DeviceShards
) -> jax.Array:
    """Each sequence minibatch's advantages [L, E, M, T, n] from the device's shards'
    `advantages` [L, T, B], normalised over the global minibatch if asked (as for flat minibatches)."""
    shards_per_device, num_steps, num_envs = advantages.shape
    flat_indices = jnp.arange(num_steps)[:, None] * num_envs + env_indices[..., None, :]  # [L, E, M, T, n]
    flat_advantages = advantages.reshape(shards_per_device, -1)
    if not normalize:
        return shards.map_batched(lambda shard, index: shard[index], flat_advantages, flat_indices)
    per_minibatch = flat_indices.reshape(flat_indices.shape[:3] + (-1,))
    return normalize_minibatch_advantages(flat_advantages, per_minibatch, shards).reshape(flat_indices.shape)


def random_permutations(key: jax.Array, num_permutations: int, n: int) -> jax.Array:
    """[num_permutations, n]: random orders of range(n), one per key split from `key`."""
    return jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(key, num_permutations))


def epoch_indices(key: jax.Array, num_epochs: int, num_minibatches: int, num_items: int,
                  permutations: Callable[[jax.Array, int, int], jax.Array] = random_permutations) -> jax.Array:
    """[num_epochs, num_minibatches, num_items / num_minibatches]: a fresh random order of
    range(num_items) per epoch, cut into minibatches. The items are a shard's samples
    (feed-forward) or its environments' whole sequences (recurrent)."""
    return permutations(key, num_epochs, num_items).reshape(num_epochs, num_minibatches, -1)


def update_keys(shard_key: jax.Array, update_index: jax.Array) -> jax.Array:
    """The rollout's and the epochs' keys [2] of update `update_index`: the shard's key folded
    with 2 x update_index and 2 x update_index + 1, in one Threefry call (XLA's CPU backend
    compiles each call into a loop of its own)."""
    indices = 2 * update_index.astype(jnp.uint32) + jnp.arange(2, dtype=jnp.uint32)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(shard_key, indices)


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


def make_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A one-axis mesh over `devices` (default: every device of every process)."""
    return Mesh(np.asarray(jax.devices() if devices is None else devices), (DEVICE_AXIS,))


def shard_sharding(mesh: Mesh, layout: str = PER_SHARD) -> NamedSharding:
    """The placement of a leaf of `layout` on `mesh` (`layout_spec`)."""
    return NamedSharding(mesh, layout_spec(layout, mesh))


def layout_spec(layout: str, mesh: Mesh) -> PartitionSpec:
    """How the leading axes of a leaf of `layout` (`PER_SHARD` or `PER_MEMBER`) split
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
    mesh (`global_arrays.shared_array`) and not batched. `per_device` sees one member's
    leaves, per-shard ones as [shards_per_device], and handles its shards with
    `DeviceShards`. The members on a device are vmapped (each member's collectives stay
    within its own shards), or with `batch_members=False` run one after another
    (`lax.map`): XLA compiles a batch of members otherwise than one member, in the last
    bits, and a member run in turn computes what its single run computes, bit for bit
    (`train.batch_members`). With `over_members=False`, `per_device` sees all of its
    device's members at once (leaves [members_per_device, ...]) and maps over them itself:
    what a population-based training step across members needs.
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
