"""A faster CPU lowering of JAX's Threefry-2x32 hash: the same bits, fewer XLA ops.

On CPU, JAX lowers the hash behind `jax.random` as a `while` loop over its five
blocks of four rounds (small programs, quick compiles). Every key split, fold-in
and draw then runs as a loop of a few dozen tiny XLA operations, and a PPO
rollout draws five times per environment step: on the small CartPole config that
loop was most of the operations the compiled update executed. Written out
straight, the twenty rounds are elementwise and XLA fuses them into a single
kernel. The hash is unchanged, so every key and every random number is
bit-identical to JAX's own lowering (tests/test_prng.py checks both the published
test vector and JAX's output).

`install()` registers this lowering for the CPU platform of the whole process; it
affects programs compiled afterwards, and only how they are lowered. Importing
`jaxddppo.envs` (which every training, sweep and evaluation path does) installs it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p
from jax.interpreters import mlir

# Rotation distances of Threefry-2x32 (Salmon et al., SC'11), for even and odd blocks of four rounds.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_SCHEDULE_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: jnp.ndarray, distance: int) -> jnp.ndarray:
    return (x << np.uint32(distance)) | (x >> np.uint32(32 - distance))


def threefry2x32_unrolled(key0, key1, count0, count1):
    """Threefry-2x32 with 20 rounds: the pair of uint32 words (count0, count1) hashed
    under the key (key0, key1); all four arguments broadcast to the output shape."""
    keys = (key0, key1, key0 ^ key1 ^ _KEY_SCHEDULE_PARITY)
    x0, x1 = count0 + keys[0], count1 + keys[1]
    for block in range(5):
        for distance in _ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, distance) ^ x0
        x0 = x0 + keys[(block + 1) % 3]
        x1 = x1 + keys[(block + 2) % 3] + np.uint32(block + 1)
    return x0, x1


_installed = False


def install() -> None:
    """Lower `threefry2x32_p` on CPU with `threefry2x32_unrolled` (idempotent)."""
    global _installed
    if not _installed:
        mlir.register_lowering(
            threefry2x32_p, mlir.lower_fun(threefry2x32_unrolled, multiple_results=True), platform="cpu"
        )
        _installed = True
