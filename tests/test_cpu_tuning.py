"""jaxddppo.cpu_tuning: the opt-in shuffle is a uniformly random permutation, drawn as the
stable sorts it describes, and training takes it through ppo.minibatch_shuffle."""

import collections
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddppo.cpu_tuning import sort_permutation
from jaxddppo.ppo import UpdateSettings, minibatch_indices, sequence_indices


def reference_permutation(key: jax.Array, n: int) -> np.ndarray:
    """The same rounds in NumPy: each a stable argsort by the round's 32 random bits alone."""
    num_rounds = math.ceil(3 * math.log2(n) / 32)
    order = np.arange(n)
    for round_key in jax.random.split(key, num_rounds):
        order = order[np.argsort(np.asarray(jax.random.bits(round_key, (n,), jnp.uint32)), kind="stable")]
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


@pytest.mark.slow
def test_training_with_cpu_sorts_learns_the_same_on_one_and_two_devices(tmp_path):
    from jaxddppo.train import run

    def train(num_devices):
        config = {"env": {"num_envs": 8}, "ppo": {"num_steps": 16, "minibatch_shuffle": "cpu_sorts"},
                  "train": {"total_env_steps": 8 * 16 * 4, "num_shards": 2}, "eval": {"num_episodes": 2},
                  "run": {"progress": False, "dir": str(tmp_path / str(num_devices))}}
        return run(config, devices=jax.devices()[:num_devices]).summary

    one, two = train(1), train(2)
    assert np.isfinite(one["params_digest"])
    np.testing.assert_allclose(two["params_digest"], one["params_digest"], rtol=1e-6)
