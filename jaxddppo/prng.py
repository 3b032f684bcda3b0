"""Faster CPU lowerings of JAX's random numbers: the same bits, fewer and cheaper XLA ops.

Two parts: the Threefry-2x32 hash behind every key split and draw, and the sort
behind `jax.random.permutation` (`permutation` below).

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

from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.extend.random import threefry2x32_p
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
