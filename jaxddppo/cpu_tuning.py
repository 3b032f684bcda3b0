"""Opt-in CPU tuning: what XLA's CPU backend runs much faster written another way.

Nothing here is used unless a config option asks for it; everything is plain, public JAX,
and importing it changes nothing in JAX.

`ppo.minibatch_shuffle=cpu_sorts` draws each epoch's minibatch order with
`sort_permutation` instead of `jax.random.permutation`. JAX shuffles by sorting
(random key, index) pairs, and XLA's CPU backend sorts pairs by calling a compiled
comparator for every comparison; it sorts one array of integers directly
(docs/benchmarks.md has the timings and the command).

`run.fast_cpu_compile` compiles the programs with `compiler_options`: XLA's CPU backend
spends most of a compile in LLVM, whose level 3 makes these programs no faster than its
level 2, and whose level 0 suffices for a program that runs once.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np

# A block with 64-bit types on: jax.enable_x64 in newer JAX, jax.experimental.enable_x64 in older.
_SIXTY_FOUR_BITS = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64

# JAX's criterion for the random bits a shuffle needs: 3 x log2(n), so that ties are rare.
_BITS_PER_ELEMENT_FACTOR = 3


def sort_permutation(key: jax.Array, n: int) -> jax.Array:
    """A uniformly random order of range(n) (int32), from stable sorts by random keys.

    Each round sorts one array of 64-bit integers: 32 random bits in the high word, the
    element's current position in the low word (so equal keys keep their order, as a
    stable sort would). Successive stable sorts order by all rounds' keys together, the
    last round's first; rounds are added until they hold JAX's 3 x log2(n) random bits
    (two rounds up to 2**21 elements), all drawn in one call. The 64-bit integers live
    inside an `enable_x64` block, which reverts when the sort is traced.
    """
    if n <= 1:
        return jnp.arange(n, dtype=jnp.int32)
    if n >= 2**31:
        raise ValueError(f"sort_permutation needs n < 2**31, got {n}")
    num_rounds = math.ceil(_BITS_PER_ELEMENT_FACTOR * math.log2(n) / 32)
    order = jnp.arange(n, dtype=jnp.int32)
    for random_words in jax.random.bits(key, (num_rounds, n), jnp.uint32):
        with _SIXTY_FOUR_BITS(True):
            positions = jnp.arange(n, dtype=jnp.uint64)
            packed = jnp.sort((random_words.astype(jnp.uint64) << np.uint64(32)) | positions)
            sorted_positions = (packed & np.uint64(0xFFFFFFFF)).astype(jnp.int32)
        order = order[sorted_positions]
    return order


def compiler_options(platform: str, runs_once: bool) -> dict[str, Any]:
    """`Lowered.compile` options for a program on `platform` (a device's `.platform`):
    on CPU, XLA's backend optimisation level 0 for a program that runs once and 2 for the
    others (XLA's default is 3); none elsewhere (XLA's GPU backend refuses level 0)."""
    if platform != "cpu":
        return {}
    return {"xla_backend_optimization_level": 0 if runs_once else 2}
