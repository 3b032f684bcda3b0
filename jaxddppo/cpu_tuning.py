"""Opt-in CPU tuning: what XLA's CPU backend runs much faster written another way.

Nothing here is used unless a config option asks for it; everything is plain, public JAX,
and importing it changes nothing in JAX.

`ppo.minibatch_shuffle=cpu_sorts` draws each epoch's minibatch order with
`sort_permutation` instead of `jax.random.permutation`. JAX shuffles by sorting
(random key, index) pairs, and XLA's CPU backend sorts pairs by calling a compiled
comparator for every comparison; it sorts one array of integers directly
(docs/benchmarks.md has the timings and the command).

`run.written_out_threefry=true` runs the update (and the initialisation) with its keys in
`WRITTEN_OUT_THREEFRY`, a PRNG implementation (`jax.extend.random.define_prng_impl`) that
computes JAX's Threefry-2x32 with every round written out. JAX lowers the hash on CPU as a
loop of 5 iterations, which XLA cannot fuse with what draws from it: every split and draw
becomes a loop of small operations. The random bits are JAX's, bit for bit; the program
around them fuses otherwise, so float results match only up to rounding.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

# JAX's criterion for the random bits a shuffle needs: 3 x log2(n), so that ties are rare.
_BITS_PER_ELEMENT_FACTOR = 3


def sort_permutation(key: jax.Array, n: int) -> jax.Array:
    """A uniformly random order of range(n) (int32), from stable sorts by random keys.

    Each round sorts one array of 64-bit integers: 32 random bits in the high word, the
    element's current position in the low word (so equal keys keep their order, as a
    stable sort would). Successive stable sorts order by all rounds' keys together, the
    last round's first; rounds are added until they hold JAX's 3 x log2(n) random bits
    (two rounds up to 2**21 elements). The 64-bit integers live inside a
    `jax.enable_x64` block, which reverts when the sort is traced.
    """
    if n <= 1:
        return jnp.arange(n, dtype=jnp.int32)
    if n >= 2**31:
        raise ValueError(f"sort_permutation needs n < 2**31, got {n}")
    num_rounds = math.ceil(_BITS_PER_ELEMENT_FACTOR * math.log2(n) / 32)
    order = jnp.arange(n, dtype=jnp.int32)
    for round_key in jax.random.split(key, num_rounds):
        random_words = jax.random.bits(round_key, (n,), jnp.uint32)
        with jax.enable_x64(True):
            positions = jnp.arange(n, dtype=jnp.uint64)
            packed = jnp.sort((random_words.astype(jnp.uint64) << np.uint64(32)) | positions)
            sorted_positions = (packed & np.uint64(0xFFFFFFFF)).astype(jnp.int32)
        order = order[sorted_positions]
    return order


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(value: jax.Array, distance: int) -> jax.Array:
    return (value << np.uint32(distance)) | (value >> np.uint32(32 - distance))


def threefry2x32(key: jax.Array, high: jax.Array, low: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block cipher, 20 rounds (Salmon et al., 2011), of the counters
    (high, low) under `key` (uint32 [2]), with every round written out."""
    schedule = (key[0], key[1], key[0] ^ key[1] ^ _KEY_PARITY)
    x0, x1 = high + schedule[0], low + schedule[1]
    for block in range(5):
        for distance in _ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, distance) ^ x0
        x0 = x0 + schedule[(block + 1) % 3]
        x1 = x1 + schedule[(block + 2) % 3] + np.uint32(block + 1)
    return x0, x1


def _counters(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    size = math.prod(shape)
    if size >= 2**32:
        raise ValueError(f"written-out Threefry draws fewer than 2**32 values at once, got shape {shape}")
    return jnp.zeros(shape, jnp.uint32), jnp.arange(size, dtype=jnp.uint32).reshape(shape)


def _seed(seed: jax.Array) -> jax.Array:
    return jax.random.key_data(jax.random.key(seed))


def _split(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jnp.stack(threefry2x32(key, *_counters(tuple(shape))), axis=-1)


def _fold_in(key: jax.Array, data: jax.Array) -> jax.Array:
    return jnp.stack(threefry2x32(key, jnp.zeros((), jnp.uint32), jnp.asarray(data, jnp.uint32)))


def _random_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    high, low = threefry2x32(key, *_counters(tuple(shape)))
    if bit_width == 64:
        return (high.astype(jnp.uint64) << np.uint64(32)) | low.astype(jnp.uint64)
    return (high ^ low).astype(jnp.dtype(f"uint{bit_width}"))


_JAX_THREEFRY = "threefry2x32"  # what jax.random.key_impl names JAX's own
WRITTEN_OUT_THREEFRY = jax.extend.random.define_prng_impl(
    key_shape=(2,), seed=_seed, split=_split, random_bits=_random_bits, fold_in=_fold_in,
    name="threefry2x32_written_out", tag="fwo",
)


def _rekeyed(tree: Any, from_impl: Any, to_impl: Any) -> Any:
    def rekey(leaf: Any) -> Any:
        if (isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
                and jax.random.key_impl(leaf) == from_impl):
            return jax.random.wrap_key_data(jax.random.key_data(leaf), impl=to_impl)
        return leaf

    return jax.tree.map(rekey, tree)


def written_out_keys(tree: Any) -> Any:
    """`tree` with every key of JAX's Threefry as a written-out Threefry key (the same data)."""
    return _rekeyed(tree, _JAX_THREEFRY, WRITTEN_OUT_THREEFRY)


def jax_keys(tree: Any) -> Any:
    """`tree` with every written-out Threefry key as a key of JAX's Threefry (the same data)."""
    return _rekeyed(tree, WRITTEN_OUT_THREEFRY, _JAX_THREEFRY)


def with_written_out_threefry(update: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
    """`update(state, *args) -> (state, outputs)` run with the keys of `state` in the
    written-out Threefry, its new state's keys given back in JAX's: the same random bits,
    and the same state types in and out."""

    def written_out_update(state: Any, *args: Any) -> tuple[Any, Any]:
        new_state, outputs = update(written_out_keys(state), *args)
        return jax_keys(new_state), outputs

    return written_out_update
