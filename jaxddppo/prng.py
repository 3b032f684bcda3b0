"""Faster CPU lowerings of JAX's random numbers: the same bits, fewer and cheaper XLA ops.

Three parts: the Threefry-2x32 hash behind every key split and draw, the sort
behind `jax.random.permutation` (`permutation` below), and a key implementation
that hashes on the host, for programs that run once (`HOST_THREEFRY` below).

On CPU, JAX lowers the hash behind `jax.random` as a `while` loop over its five
blocks of four rounds (small programs, quick compiles). Every key split, fold-in
and draw then runs as a loop of a few dozen tiny XLA operations, and a PPO
rollout draws five times per environment step: on the small CartPole config that
loop was most of the operations the compiled update executed. Written out
straight, the twenty rounds are elementwise and XLA fuses them into a single
kernel. The hash is unchanged, so every key and every random number is
bit-identical to JAX's own lowering (tests/test_prng.py checks both the published
test vector and JAX's output).

The lowering emits the rounds as StableHLO operations directly: tracing them
through `jax.numpy` at each of the ten call sites of the CartPole training chunk
(`mlir.lower_fun`) took 0.23-0.27 s of the 1.0-1.2 s JAX spent tracing and
lowering it.

`install()` registers this lowering for the CPU platform of the whole process; it
affects programs compiled afterwards, and only how they are lowered. Importing
`jaxddppo.envs` (which every training, sweep and evaluation path does) installs it.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.extend.random import define_prng_impl, threefry2x32_p, threefry_prng_impl
from jax.interpreters import batching, mlir

# Rotation distances of Threefry-2x32 (Salmon et al., SC'11), for even and odd blocks of four rounds.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_SCHEDULE_PARITY = np.uint32(0x1BD11BDA)


def _filled(ir_type: Any, scalar: np.generic) -> Any:
    """A StableHLO tensor of type `ir_type` with every element `scalar` (of its element type)."""
    return stablehlo.broadcast_in_dim(ir_type, mlir.ir_constant(scalar), mlir.dense_int_array([]))


def _rotate_left(x: Any, distance: int) -> Any:
    return (x << np.uint32(distance)) | (x >> np.uint32(32 - distance))


def threefry2x32_unrolled(key0, key1, count0, count1):
    """Threefry-2x32 with 20 rounds: the pair of uint32 words (count0, count1) hashed
    under the key (key0, key1). The arguments are uint32 arrays (NumPy or JAX, broadcast
    together) or, in the lowering, `_Words` of the output shape."""
    keys = (key0, key1, key0 ^ key1 ^ _KEY_SCHEDULE_PARITY)
    x0, x1 = count0 + keys[0], count1 + keys[1]
    for block in range(5):
        for distance in _ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, distance) ^ x0
        x0 = x0 + keys[(block + 1) % 3]
        x1 = x1 + keys[(block + 2) % 3] + np.uint32(block + 1)
    return x0, x1


class _Words:
    """uint32 words of the hash's output shape as StableHLO values, with the operators
    `threefry2x32_unrolled` applies; uint32 scalars on the right become constants."""

    def __init__(self, value: Any, ir_type: Any):
        self.value, self.ir_type = value, ir_type

    def _operand(self, other: Union["_Words", np.uint32]) -> Any:
        if isinstance(other, _Words):
            return other.value
        return _filled(self.ir_type, np.uint32(other))

    def _apply(self, operation: Any, other: Union["_Words", np.uint32]) -> "_Words":
        return _Words(operation(self.value, self._operand(other)), self.ir_type)

    def __add__(self, other: Union["_Words", np.uint32]) -> "_Words":
        return self._apply(stablehlo.add, other)

    def __xor__(self, other: Union["_Words", np.uint32]) -> "_Words":
        return self._apply(stablehlo.xor, other)

    def __or__(self, other: Union["_Words", np.uint32]) -> "_Words":
        return self._apply(stablehlo.or_, other)

    def __lshift__(self, other: Union["_Words", np.uint32]) -> "_Words":
        return self._apply(stablehlo.shift_left, other)

    def __rshift__(self, other: Union["_Words", np.uint32]) -> "_Words":
        return self._apply(stablehlo.shift_right_logical, other)


def _threefry2x32_lowering(ctx: Any, key0: Any, key1: Any, count0: Any, count1: Any) -> list[Any]:
    """`threefry2x32_p` as StableHLO: the four operands broadcast to the output shape
    (trailing dimensions aligned, as NumPy broadcasts), then hashed."""
    aval_out = ctx.avals_out[0]
    ir_type, rank = mlir.aval_to_ir_type(ctx.module_context, aval_out), len(aval_out.shape)

    def words(value: Any, aval: Any) -> _Words:
        if aval.shape != aval_out.shape:
            dimensions = mlir.dense_int_array(range(rank - len(aval.shape), rank))
            value = stablehlo.broadcast_in_dim(ir_type, value, dimensions)
        return _Words(value, ir_type)

    operands = [words(value, aval) for value, aval in zip((key0, key1, count0, count1), ctx.avals_in)]
    return [word.value for word in threefry2x32_unrolled(*operands)]


def _flat_index_words(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The high and low uint32 words of each element's row-major index in `shape`: the
    counts JAX hashes to split a key or draw bits of that shape."""
    index = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64).reshape(shape)
    return (index >> np.uint64(32)).astype(np.uint32), (index & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _hash_host(keys: np.ndarray, count_high: np.ndarray, count_low: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`threefry2x32_unrolled` in NumPy under the uint32 `keys` [..., 2]; the additions wrap
    around, as the hash means them to (NumPy warns of that for 0-d operands)."""
    with np.errstate(over="ignore"):
        return threefry2x32_unrolled(keys[..., 0], keys[..., 1], count_high, count_low)


def _hash_keys_host(keys: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Both output words of hashing every element index of `shape` under each of the
    uint32 `keys` [..., 2]: arrays [..., *shape]."""
    high, low = _flat_index_words(shape)
    keys = np.asarray(keys, np.uint32)
    return _hash_host(keys.reshape(keys.shape[:-1] + (1,) * len(shape) + (2,)), high, low)


def _split_host(keys: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.stack(_hash_keys_host(keys, shape), axis=-1)


def _fold_in_host(keys: np.ndarray, data: np.ndarray) -> np.ndarray:
    keys, data = np.asarray(keys, np.uint32), np.asarray(data, np.uint32)
    return np.stack(_hash_host(keys, np.zeros_like(data), data), axis=-1)


def _random_bits_host(keys: np.ndarray, bit_width: int, shape: tuple[int, ...]) -> np.ndarray:
    high, low = _hash_keys_host(keys, shape)
    if bit_width == 64:
        return (high.astype(np.uint64) << np.uint64(32)) | low.astype(np.uint64)
    return (high ^ low).astype(np.dtype(f"uint{bit_width}"))


def _split_on_host(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    shape = tuple(shape)
    result = jax.ShapeDtypeStruct((*shape, 2), jnp.uint32)
    return jax.pure_callback(lambda keys: _split_host(keys, shape), result, key, vmap_method="expand_dims")


def _fold_in_on_host(key: jax.Array, data: Any) -> jax.Array:
    data = jnp.asarray(data, jnp.uint32)
    result = jax.ShapeDtypeStruct((2,), jnp.uint32)
    return jax.pure_callback(_fold_in_host, result, key, data, vmap_method="broadcast_all")


def _random_bits_on_host(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    shape = tuple(shape)
    result = jax.ShapeDtypeStruct(shape, jnp.dtype(f"uint{bit_width}"))
    return jax.pure_callback(lambda keys: _random_bits_host(keys, bit_width, shape), result, key,
                             vmap_method="expand_dims")


# JAX's Threefry keys (in jax_threefry_partitionable's layout), hashed on the host.
# Every split, fold-in and draw of a key of this implementation gives the bits JAX's own
# Threefry gives (tests/test_prng.py), but the compiled program calls back into NumPy
# for the hash instead of computing it. For a program that runs once, such as a run's
# initialisation, that is the cheaper trade on CPU: the hash's written-out rounds were
# half of the CartPole initialisation's compile (0.6-0.7 s, 1 CPU second), and its few
# callbacks cost milliseconds, once. See `run_once_key_impl`.
HOST_THREEFRY = define_prng_impl(
    key_shape=(2,), seed=threefry_prng_impl.seed, split=_split_on_host, random_bits=_random_bits_on_host,
    fold_in=_fold_in_on_host, name="threefry2x32_on_host", tag="fryh",
)


def run_once_key_impl(platform: str) -> Optional[Any]:
    """The key implementation for a program that runs once on `platform` (`jax.random.key`'s
    `impl`): `HOST_THREEFRY` on CPU when JAX's default keys are Threefry keys in the
    partitionable layout (its default), else None (JAX's default). Pass the keys such a
    program returns through `with_default_impl`."""
    default_threefry = (jax.config.jax_default_prng_impl == "threefry2x32"
                        and jax.config.jax_threefry_partitionable)
    return HOST_THREEFRY if platform == "cpu" and default_threefry else None


def with_default_impl(tree: Any) -> Any:
    """`tree` with every key of `HOST_THREEFRY` made a key of JAX's default Threefry, the same
    key data: the keys an initialisation hands to the compiled training chunks."""

    def convert(leaf: Any) -> Any:
        is_key = isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        if is_key and jax.random.key_impl(leaf) == HOST_THREEFRY:
            return jax.random.wrap_key_data(jax.random.key_data(leaf), impl=threefry_prng_impl)
        return leaf

    return jax.tree.map(convert, tree)


def permutation(key: jax.Array, n: int) -> jax.Array:
    """`jax.random.permutation(key, n)` bit for bit: a uniformly random order of range(n), int32.

    JAX sorts arange(n) by fresh random 32-bit keys (stably), in as many rounds as
    collisions make necessary. The sort that carries a second array along is slow
    on CPU: XLA calls a compiled comparator for every comparison and moves the
    pairs element by element (170-260 us for the small config's four epochs of 512
    samples, against 15 us for one array). `stable_argsort` sorts one array of plain
    integers instead.
    """
    num_rounds = int(np.ceil(3 * np.log(max(1, n)) / np.log(np.iinfo(np.uint32).max)))
    order = jnp.arange(n)
    for _ in range(num_rounds):
        key, subkey = jax.random.split(key)
        order = order[stable_argsort(jax.random.bits(subkey, (n,), jnp.uint32))]
    return order


stable_argsort_p = Primitive("jaxddppo_stable_argsort")


def stable_argsort(sort_keys: jax.Array) -> jax.Array:
    """The int32 indices that sort uint32 `sort_keys` along the last axis, equal keys in
    their original order (`lax.sort_key_val(sort_keys, iota)`'s values)."""
    return stable_argsort_p.bind(sort_keys)


def _stable_argsort_reference(sort_keys: jax.Array) -> jax.Array:
    positions = lax.broadcasted_iota(jnp.int32, sort_keys.shape, sort_keys.ndim - 1)
    return lax.sort_key_val(sort_keys, positions, dimension=sort_keys.ndim - 1, is_stable=True)[1]


def _stable_argsort_batched(args: tuple[jax.Array], dims: tuple[Any]) -> tuple[jax.Array, int]:
    (sort_keys,), (dim,) = args, dims
    return stable_argsort(jnp.moveaxis(sort_keys, dim, 0)), 0


def _stable_argsort_cpu_lowering(ctx: Any, sort_keys: Any) -> list[Any]:
    """Each key widened to 64 bits with its position in the low word, one array of
    distinct integers sorted with the plain `<` (XLA's CPU sort runs `std::sort` on
    it directly), and the positions read back from the low words."""
    shape = ctx.avals_in[0].shape
    axis = len(shape) - 1
    wide_type = ir.RankedTensorType.get(shape, ir.IntegerType.get_unsigned(64))
    high = stablehlo.shift_left(stablehlo.convert(wide_type, sort_keys), _filled(wide_type, np.uint64(32)))
    packed = stablehlo.or_(high, stablehlo.iota(wide_type, iota_dimension=mlir.i64_attr(axis)))
    sort = stablehlo.SortOp([wide_type], [packed], dimension=mlir.i64_attr(axis), is_stable=ir.BoolAttr.get(False))
    scalar = ir.RankedTensorType.get([], ir.IntegerType.get_unsigned(64))
    comparator = sort.comparator.blocks.append(scalar, scalar)
    with ir.InsertionPoint(comparator):
        less = stablehlo.compare(*comparator.arguments, stablehlo.ComparisonDirectionAttr.get("LT"),
                                 compare_type=stablehlo.ComparisonTypeAttr.get("UNSIGNED"))
        stablehlo.return_([less])
    positions = stablehlo.and_(sort.results[0], _filled(wide_type, np.uint64(0xFFFFFFFF)))
    return [stablehlo.convert(mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0]), positions)]


stable_argsort_p.def_impl(_stable_argsort_reference)
stable_argsort_p.def_abstract_eval(lambda sort_keys: sort_keys.update(dtype=jnp.dtype(jnp.int32)))
batching.primitive_batchers[stable_argsort_p] = _stable_argsort_batched
mlir.register_lowering(stable_argsort_p, mlir.lower_fun(_stable_argsort_reference, multiple_results=False))
mlir.register_lowering(stable_argsort_p, _stable_argsort_cpu_lowering, platform="cpu")

_installed = False


def install() -> None:
    """Lower `threefry2x32_p` on CPU with `threefry2x32_unrolled` (idempotent)."""
    global _installed
    if not _installed:
        mlir.register_lowering(threefry2x32_p, _threefry2x32_lowering, platform="cpu")
        _installed = True
