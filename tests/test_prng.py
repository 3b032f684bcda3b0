"""The faster CPU lowering of the Threefry hash: the same bits as JAX's own, with no loop;
the same bits again from keys hashed on the host; the permutation's one-array sort."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.random import threefry2x32_p

from jaxddppo import prng

# Known-answer vectors of Threefry-2x32 with 20 rounds (Random123's kat_vectors).
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]

# Draws a training run makes (splits, fold-ins, uniform, normal, categorical), as uint32/float bits.
DRAWS = """
import json, jax, jax.numpy as jnp, numpy as np
def draws(key):
    split = jax.random.key_data(jax.random.split(key, 7))
    folded = jax.random.key_data(jax.random.fold_in(key, 3))
    uniform = jax.lax.bitcast_convert_type(jax.random.uniform(key, (1001,)), jnp.uint32)
    normal = jax.lax.bitcast_convert_type(jax.random.normal(key, (33,)), jnp.uint32)
    categorical = jax.random.categorical(key, jnp.zeros((5, 3))).astype(jnp.uint32)
    return jnp.concatenate([split.ravel(), folded.ravel(), uniform, normal, categorical])
print(json.dumps(np.asarray(jax.jit(draws)(jax.random.key(42))).tolist()))
"""


@pytest.mark.parametrize("key, count, expected", KNOWN_ANSWERS)
def test_known_answers(key, count, expected):
    words = [jnp.uint32(word) for word in (*key, *count)]
    assert tuple(int(word) for word in prng.threefry2x32_unrolled(*words)) == expected


def draws_in_subprocess(prelude: str) -> list[int]:
    result = subprocess.run([sys.executable, "-c", prelude + DRAWS], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def test_compiled_draws_equal_jax_own_lowering():
    stock = draws_in_subprocess("")  # never imports jaxddppo: JAX lowers the hash its own way
    ours = draws_in_subprocess("import jaxddppo.envs\n")  # importing envs installs the unrolled lowering
    assert len(stock) == 7 * 2 + 2 + 1001 + 33 + 5
    assert ours == stock


def test_installed_lowering_has_no_loop():
    prng.install()
    text = jax.jit(lambda key: jax.random.uniform(key, (4,))).lower(jax.random.key(0)).compile().as_text()
    assert " while(" not in text


def test_installed_lowering_broadcasts_operands_like_numpy():
    """JAX's callers pass operands of one shape, but the primitive allows broadcasting (a
    scalar, size-1 dimensions): the lowering must broadcast as NumPy does."""
    prng.install()
    words = np.arange(1, 21, dtype=np.uint32) * np.uint32(0x9E3779B9)
    operands = (words[0], words[1:4].reshape(3, 1), words[4:8].reshape(1, 4), words[8:20].reshape(3, 4))
    hashed = jax.jit(lambda *operands: threefry2x32_p.bind(*operands))(*operands)
    expected = prng.threefry2x32_unrolled(*np.broadcast_arrays(*operands))
    for got, want in zip(hashed, expected):
        np.testing.assert_array_equal(np.asarray(got), want)


def draws_of_every_kind(key):
    """Splits (of several shapes), fold-ins, bits of every width and the floats built on them."""
    return (
        jax.random.key_data(jax.random.split(key)),
        jax.random.key_data(jax.random.split(key, (2, 3))),
        jax.random.key_data(jax.random.fold_in(key, 7)),
        jax.random.key_data(jax.random.fold_in(jax.random.fold_in(key, 0), 2**32 - 1)),
        *(jax.random.bits(key, (5, 3), dtype) for dtype in (jnp.uint8, jnp.uint16, jnp.uint32)),
        jax.random.bits(key, (), jnp.uint32),
        jax.random.uniform(jax.random.fold_in(key, 1), (33,)),
        jax.random.normal(jax.random.split(key, 3)[2], (4, 7)),
        jax.random.categorical(key, jnp.zeros((6, 3))),
    )


@pytest.mark.parametrize("how", ["eager", "jit", "vmap", "vmap of vmap"])
def test_keys_hashed_on_host_draw_jax_own_bits(how):
    seeds = np.array([[0, 1, 2**31 - 1], [42, 7, 123456]], np.int32)
    def draws_from_seed(impl):
        return lambda seed: draws_of_every_kind(jax.random.key(seed, impl=impl))
    def run(impl):
        if how == "eager":
            return draws_from_seed(impl)(seeds[1, 0])
        if how == "jit":
            return jax.jit(draws_from_seed(impl))(seeds[1, 0])
        if how == "vmap":
            return jax.jit(jax.vmap(draws_from_seed(impl)))(seeds[1])
        return jax.jit(jax.vmap(jax.vmap(draws_from_seed(impl))))(seeds)
    on_host, own = run(prng.HOST_THREEFRY), run(None)
    for got, want in zip(on_host, own, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_keys_hashed_on_host_compile_no_hash():
    """The hash runs in a host callback: the compiled program has none of its rounds (one
    exclusive-or each, twenty per hash; here a fold-in and a draw)."""
    prng.install()
    def draws(impl):
        return jax.jit(lambda seed: jax.random.normal(jax.random.fold_in(jax.random.key(seed, impl=impl), 3), (8,)))
    def xors(impl):
        return draws(impl).lower(np.int32(0)).compile().as_text().count(" xor(")
    assert xors(None) >= 40
    assert xors(prng.HOST_THREEFRY) == 0


def test_run_once_key_impl_is_the_host_hash_on_cpu_with_jax_default_keys():
    assert prng.run_once_key_impl("cpu") is prng.HOST_THREEFRY
    assert prng.run_once_key_impl("gpu") is None
    default = jax.config.jax_default_prng_impl
    try:
        jax.config.update("jax_default_prng_impl", "rbg")
        assert prng.run_once_key_impl("cpu") is None
    finally:
        jax.config.update("jax_default_prng_impl", default)


def test_with_default_impl_gives_host_keys_jax_own_impl_and_keeps_other_leaves():
    host_key, own_key = jax.random.key(5, impl=prng.HOST_THREEFRY), jax.random.key(5)
    tree = {"host": host_key, "own": own_key, "array": jnp.arange(3)}
    converted = jax.jit(prng.with_default_impl)(tree)
    for name in ("host", "own"):
        assert jax.random.key_impl(converted[name]) == jax.random.key_impl(own_key)
        np.testing.assert_array_equal(jax.random.key_data(converted[name]), jax.random.key_data(own_key))
    np.testing.assert_array_equal(converted["array"], np.arange(3))


# 512 and 65,536 are the small and large configs' batches; past 1,625 JAX sorts twice.
@pytest.mark.parametrize("n", [0, 1, 2, 7, 512, 1625, 1626, 65536])
def test_permutation_equals_jax_permutation(n):
    for seed in range(3):
        key = jax.random.key(seed)
        expected = np.asarray(jax.random.permutation(key, n))
        jitted = jax.jit(prng.permutation, static_argnums=1)(key, n)
        assert jitted.dtype == expected.dtype
        np.testing.assert_array_equal(np.asarray(jitted), expected)
        np.testing.assert_array_equal(np.asarray(prng.permutation(key, n)), expected)  # eager


def test_permutation_under_vmap_as_the_epochs_draw_it():
    keys = jax.random.split(jax.random.key(7), 6).reshape(2, 3)
    expected = jax.vmap(jax.vmap(lambda key: jax.random.permutation(key, 300)))(keys)
    got = jax.jit(jax.vmap(jax.vmap(lambda key: prng.permutation(key, 300))))(keys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_stable_argsort_keeps_ties_in_order_like_numpy():
    rng = np.random.default_rng(0)
    sort_keys = np.concatenate([
        rng.integers(0, 4, size=(3, 50)),  # many ties
        rng.integers(2**32 - 3, 2**32, size=(1, 50)),  # the top of the uint32 range
    ]).astype(np.uint32)
    expected = np.argsort(sort_keys, axis=-1, kind="stable")
    np.testing.assert_array_equal(np.asarray(jax.jit(prng.stable_argsort)(sort_keys)), expected)
    np.testing.assert_array_equal(np.asarray(prng.stable_argsort(sort_keys)), expected)
    # vmapped over the last axis: the batching rule moves it out of the way of the sort
    batched = jax.jit(jax.vmap(prng.stable_argsort, in_axes=1))(sort_keys.T)
    np.testing.assert_array_equal(np.asarray(batched), expected)


def test_stable_argsort_on_cpu_sorts_one_array():
    """The CPU program sorts a single array of 64-bit integers (XLA's direct `std::sort`),
    not keys with a second array carried along."""
    text = jax.jit(prng.stable_argsort).lower(np.zeros((4, 512), np.uint32)).compile().as_text()
    sorts = [line for line in text.splitlines() if " sort(" in line]
    assert len(sorts) == 1 and sorts[0].split("=")[1].strip().startswith("u64[4,512]")
