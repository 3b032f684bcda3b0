"""jaxddppo.cpu_tuning: the opt-in shuffle is a uniformly random permutation, drawn as the
stable sorts it describes, and training takes it through ppo.minibatch_shuffle; the opt-in
compiler options reach every program and start training from the same state."""

import collections
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import host_leaves
from jaxddppo.cpu_tuning import compiler_options, sort_permutation
from jaxddppo.ppo import UpdateSettings, minibatch_indices, sequence_indices


def reference_permutation(key: jax.Array, n: int) -> np.ndarray:
    """The same rounds in NumPy: each a stable argsort by the round's 32 random bits alone."""
    num_rounds = math.ceil(3 * math.log2(n) / 32)
    order = np.arange(n)
    for random_words in np.asarray(jax.random.bits(key, (num_rounds, n), jnp.uint32)):
        order = order[np.argsort(random_words, kind="stable")]
    return order


@pytest.mark.parametrize("n", [2, 3, 7, 512, 4096, 300_000, 3_000_000])
def test_sort_permutation_is_the_stable_sorts_of_its_random_keys(n):
    key = jax.random.key(n)
    got = np.asarray(jax.jit(sort_permutation, static_argnums=1)(key, n))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(np.sort(got), np.arange(n))
    np.testing.assert_array_equal(got, reference_permutation(key, n))
    assert jnp.arange(2).dtype == jnp.int32  # its 64-bit block is over once it is traced


def test_sort_permutation_of_one_or_no_element():
    np.testing.assert_array_equal(sort_permutation(jax.random.key(0), 1), [0])
    assert sort_permutation(jax.random.key(0), 0).shape == (0,)


def test_sort_permutation_draws_every_order_equally_often():
    draws = 24_000
    orders = jax.jit(jax.vmap(lambda key: sort_permutation(key, 4)))(jax.random.split(jax.random.key(1), draws))
    counts = collections.Counter(tuple(int(i) for i in row) for row in np.asarray(orders))
    assert set(counts) == set(itertools.permutations(range(4)))
    expected = draws / 24  # 1000, standard deviation about 31
    assert all(abs(count - expected) < 150 for count in counts.values()), counts


@pytest.mark.parametrize("shuffle", ["jax", "cpu_sorts"])
def test_minibatches_are_a_fresh_permutation_per_epoch_either_way(shuffle):
    settings = UpdateSettings(
        num_steps=8, num_epochs=3, num_minibatches=4, minibatch_size=16, num_shards=1, num_updates=1,
        clip_value=True, normalize_advantages=True, anneal_lr=False, num_envs=8, recurrent=False,
        critic_after_steps=False, normalize_observations=False, scale_rewards=False, minibatch_shuffle=shuffle,
    )
    key = jax.random.key(5)
    samples = np.asarray(minibatch_indices(key, settings)).reshape(3, -1)
    sequences = np.asarray(sequence_indices(key, settings)).reshape(3, -1)
    for epochs, size in ((samples, 64), (sequences, 8)):
        for epoch in epochs:
            np.testing.assert_array_equal(np.sort(epoch), np.arange(size))
        assert not np.array_equal(epochs[0], epochs[1])
    if shuffle == "cpu_sorts":
        np.testing.assert_array_equal(samples[0], sort_permutation(jax.random.split(key, 3)[0], 64))
    else:
        np.testing.assert_array_equal(samples[0], jax.random.permutation(jax.random.split(key, 3)[0], 64))


def test_fast_cpu_compile_compiles_at_lower_levels_the_same_initial_state(monkeypatch):
    """run.fast_cpu_compile: every program compiles with `compiler_options` for its
    platform, the initialisation as a program that runs once; it starts from the state
    a default compile starts from, but for the last bits."""
    from jaxddppo import cpu_tuning, train
    from jaxddppo.config import from_dict, with_overrides

    config = from_dict({"env": {"num_envs": 8}, "ppo": {"num_steps": 16}})
    default = train.build(config, jax.devices()[:1])
    asked = []

    def recorded(platform, runs_once):
        asked.append((platform, runs_once))
        return compiler_options(platform, runs_once)

    monkeypatch.setattr(cpu_tuning, "compiler_options", recorded)
    fast = train.build(with_overrides(config, {"run.fast_cpu_compile": True}), jax.devices()[:1])
    fast_programs = train.compile_programs(fast)
    assert sorted(asked) == [("cpu", False), ("cpu", True)]  # the chunk; the initialisation
    want = default.init_state()
    got = fast_programs.init(fast_programs.inputs)
    for got_leaf, want_leaf in zip(host_leaves(got), host_leaves(want), strict=True):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-6)


def test_compiler_options_lower_levels_on_cpu_only():
    assert compiler_options("cpu", runs_once=True) == {"xla_backend_optimization_level": 0}
    assert compiler_options("cpu", runs_once=False) == {"xla_backend_optimization_level": 2}
    assert compiler_options("gpu", runs_once=True) == compiler_options("tpu", runs_once=False) == {}


@pytest.mark.slow
def test_training_with_cpu_tuning_learns_the_same_bits_on_one_and_two_devices(tmp_path):
    from jaxddppo.train import run

    def train(num_devices):
        config = {"env": {"num_envs": 8}, "ppo": {"num_steps": 16, "minibatch_shuffle": "cpu_sorts"},
                  "train": {"total_env_steps": 8 * 16 * 4, "num_shards": 2}, "eval": {"num_episodes": 2},
                  "run": {"progress": False, "dir": str(tmp_path / str(num_devices)), "fast_cpu_compile": True}}
        return run(config, devices=jax.devices()[:num_devices]).summary

    one, two = train(1), train(2)
    assert np.isfinite(one["params_digest"])
    assert two["params_digest"] == one["params_digest"]
