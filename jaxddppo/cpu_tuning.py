"""Opt-in CPU tuning: what XLA's CPU backend runs much faster written another way.

Nothing here is used unless a config option asks for it; everything is plain, public JAX,
and importing it changes nothing in JAX.

`ppo.minibatch_shuffle=cpu_sorts` draws the epochs' minibatch orders with
`sort_permutations` instead of `jax.random.permutation`. JAX shuffles by sorting
(random key, index) pairs, and XLA's CPU backend sorts pairs by calling a compiled
comparator for every comparison; it sorts one array of integers directly
(docs/benchmarks.md has the timings and the command).

`run.fast_cpu_compile` compiles the programs with `compiler_options`: XLA's CPU backend
spends most of a compile in LLVM, whose level 3 makes these programs no faster than its
level 2, and whose level 0, with XLA's older kernel emitter, suffices for a program that
runs once.

`network.dense_gradient=cpu_transposed` gives each Dense layer `dense_dot_general`: the same
product, whose kernel gradient multiplies the layer's inputs transposed into a matrix of their
own (an optimisation barrier keeps XLA from folding the transpose back into the product),
a layout XLA's CPU backend multiplies faster than the one autodiff leaves it.

`ppo.flat_optimizer` runs the gradient clipping and Adam through `flat_optimizer`, on the
parameters laid end to end in one vector: a few kernels per SGD step instead of a few per
parameter array, which XLA's CPU backend compiles faster.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import optax

# A block with 64-bit types on: jax.enable_x64 in newer JAX, jax.experimental.enable_x64 in older.
_SIXTY_FOUR_BITS = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64

# jaxlib 0.11.1 refuses the compile option `xla_cpu_use_fusion_emitters` ("No such compile option").
_HAS_OLDER_KERNEL_EMITTER = jax.__version_info__ < (0, 11, 1)

# JAX's criterion for the random bits a shuffle needs: 3 x log2(n), so that ties are rare.
_BITS_PER_ELEMENT_FACTOR = 3


def sort_permutations(key: jax.Array, num_permutations: int, n: int) -> jax.Array:
    """Uniformly random orders of range(n) (int32, [num_permutations, n]), from stable sorts
    by random keys.

    Each round sorts one array of 64-bit integers: 32 random bits in the high word, the
    element's current position in the low word (so equal keys keep their order, as a
    stable sort would). Successive stable sorts order by all rounds' keys together, the
    last round's first; rounds are added until they hold JAX's 3 x log2(n) random bits
    (two rounds up to 2**21 elements). Every permutation's bits are drawn in one call
    (`bits(key, (num_permutations, rounds, n))`). The 64-bit integers live inside an
    `enable_x64` block, which reverts when the sort is traced.
    """
    if n <= 1:
        return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (num_permutations, n))
    if n >= 2**31:
        raise ValueError(f"sort_permutations needs n < 2**31, got {n}")
    num_rounds = math.ceil(_BITS_PER_ELEMENT_FACTOR * math.log2(n) / 32)
    all_random_words = jax.random.bits(key, (num_permutations, num_rounds, n), jnp.uint32)
    order = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (num_permutations, n))
    for random_words in jnp.moveaxis(all_random_words, 1, 0):
        with _SIXTY_FOUR_BITS(True):
            positions = jnp.arange(n, dtype=jnp.uint64)
            packed = jnp.sort((random_words.astype(jnp.uint64) << np.uint64(32)) | positions, axis=-1)
            sorted_positions = (packed & np.uint64(0xFFFFFFFF)).astype(jnp.int32)
        order = jnp.take_along_axis(order, sorted_positions, axis=-1)
    return order


def dense_dot_general(
    inputs: jax.Array,
    kernel: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Optional[Any] = None,
) -> jax.Array:
    """`jax.lax.dot_general` as `flax.linen.Dense` calls it (the inputs' last axis against a
    [in, out] kernel's first), with the same forward pass and a kernel gradient
    `barrier(inputs reshaped to [N, in]).T @ output gradient reshaped to [N, out]`."""
    expected = _dense_dimension_numbers(inputs.ndim)
    if kernel.ndim != 2 or jax.tree.map(int, dimension_numbers) != expected:
        raise ValueError(f"dense_dot_general takes a Dense layer's product {expected} with a 2-D kernel, got "
                         f"{dimension_numbers} with kernel shape {kernel.shape}")
    if precision is not None or preferred_element_type is not None:
        raise ValueError("dense_dot_general takes the default precision and element type, got "
                         f"precision={precision}, preferred_element_type={preferred_element_type}")
    return _dense_product(inputs, kernel)


def _dense_dimension_numbers(inputs_ndim: int) -> tuple:
    """Dense's product: the inputs' last axis against the kernel's first, no batch axes."""
    return (((inputs_ndim - 1,), (0,)), ((), ()))


def _forward_product(inputs: jax.Array, kernel: jax.Array) -> jax.Array:
    return jax.lax.dot_general(inputs, kernel, _dense_dimension_numbers(inputs.ndim))


@jax.custom_vjp
def _dense_product(inputs: jax.Array, kernel: jax.Array) -> jax.Array:
    return _forward_product(inputs, kernel)


def _dense_product_forward(inputs: jax.Array, kernel: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _forward_product(inputs, kernel), (inputs, kernel)


def _dense_product_backward(
    residuals: tuple[jax.Array, jax.Array], output_grad: jax.Array
) -> tuple[jax.Array, jax.Array]:
    inputs, kernel = residuals
    inputs_grad = jax.lax.dot_general(output_grad, kernel, (((output_grad.ndim - 1,), (1,)), ((), ())))
    inputs_matrix_transposed = jax.lax.optimization_barrier(inputs.reshape(-1, inputs.shape[-1]).T)
    kernel_grad = inputs_matrix_transposed @ output_grad.reshape(-1, output_grad.shape[-1])
    return inputs_grad, kernel_grad


_dense_product.defvjp(_dense_product_forward, _dense_product_backward)


def flat_optimizer(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` applied to the parameters and gradients raveled into one vector
    (`optax.flatten`): the same arithmetic element by element, but for the order in which
    a global norm sums; its state holds one vector per statistic instead of a tree."""
    return optax.flatten(optimizer)


def compiler_options(platform: str, runs_once: bool) -> dict[str, Any]:
    """`Lowered.compile` options for a program on `platform` (a device's `.platform`):
    on CPU, XLA's backend optimisation level 2 for a program that runs many times (XLA's
    default is 3), and for one that runs once level 0 with XLA's older kernel emitter, which
    compiles small kernels faster than its fusion emitters (jaxlib 0.11.1 removed the
    option, and XLA's CPU backend has only the fusion emitters from then on); none elsewhere
    (XLA's GPU backend refuses level 0)."""
    if platform != "cpu":
        return {}
    if runs_once:
        older_emitter = {"xla_cpu_use_fusion_emitters": False} if _HAS_OLDER_KERNEL_EMITTER else {}
        return {"xla_backend_optimization_level": 0, **older_emitter}
    return {"xla_backend_optimization_level": 2}
