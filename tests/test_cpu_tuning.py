"""jaxddppo.cpu_tuning: the opt-in shuffle is a uniformly random permutation, drawn as the
stable sorts it describes, and training takes it through ppo.minibatch_shuffle; the
written-out Threefry draws JAX's bits, and training takes it through
run.written_out_threefry."""

import collections
import json
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddppo import cpu_tuning
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


KEY_DRAWS = {
    "split": lambda key: jax.random.key_data(jax.random.split(key, 7)),
    "split of a shape": lambda key: jax.random.key_data(jax.random.split(key, (3, 5))),
    "fold_in": lambda key: jax.random.key_data(jax.random.fold_in(key, 4_000_000_000)),
    "bits": lambda key: jax.random.bits(key, (5, 3)),
    "bits, uint8": lambda key: jax.random.bits(key, (11,), jnp.uint8),
    "bits, uint16": lambda key: jax.random.bits(key, (11,), jnp.uint16),
    "bits, a scalar": lambda key: jax.random.bits(key, ()),
    "uniform": lambda key: jax.random.uniform(key, (1000,)),
    "normal": lambda key: jax.random.normal(key, (1000,)),
    "categorical": lambda key: jax.random.categorical(key, jnp.zeros((64, 6))),
    "permutation": lambda key: jax.random.permutation(key, 1000),
    "split under vmap": lambda key: jax.random.key_data(jax.vmap(jax.random.split)(jax.random.split(key, 4))),
}


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1])
@pytest.mark.parametrize("draw", sorted(KEY_DRAWS))
def test_written_out_threefry_draws_the_bits_of_jax_threefry(seed, draw):
    key = jax.random.key(seed)
    written_out = cpu_tuning.written_out_keys(key)
    assert jax.random.key_impl(written_out) == cpu_tuning.WRITTEN_OUT_THREEFRY
    for transform in (lambda f: f, jax.jit):
        expected = np.asarray(transform(KEY_DRAWS[draw])(key))
        np.testing.assert_array_equal(np.asarray(transform(KEY_DRAWS[draw])(written_out)), expected)


def test_written_out_threefry_is_the_published_block_cipher():
    """Known-answer vectors of Threefry-2x32, 20 rounds (Random123's kat_vectors)."""
    vectors = [((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
               ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
               ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0))]
    for key, (high, low), expected in vectors:
        got = cpu_tuning.threefry2x32(jnp.asarray(key, jnp.uint32), jnp.uint32(high), jnp.uint32(low))
        assert tuple(int(word) for word in got) == expected


def test_keys_change_implementation_and_nothing_else():
    tree = {"key": jax.random.split(jax.random.key(3), 2), "count": jnp.arange(3), "raw": jax.random.PRNGKey(1)}
    written_out = cpu_tuning.written_out_keys(tree)
    assert jax.random.key_impl(written_out["key"]) == cpu_tuning.WRITTEN_OUT_THREEFRY
    back = cpu_tuning.jax_keys(written_out)
    assert back["key"].dtype == tree["key"].dtype
    for leaf, other in zip(jax.tree.leaves(jax.random.key_data(back["key"])), [jax.random.key_data(tree["key"])]):
        np.testing.assert_array_equal(leaf, other)
    np.testing.assert_array_equal(back["count"], tree["count"])
    np.testing.assert_array_equal(back["raw"], tree["raw"])  # raw uint32 keys are not keys to rekey


def test_an_update_sees_written_out_keys_and_hands_back_jax_keys():
    seen = []

    def update(state, step):
        seen.append(jax.random.key_impl(state["key"]))
        return {"key": jax.random.fold_in(state["key"], step), "x": state["x"] + 1}, jax.random.uniform(state["key"])

    state = {"key": jax.random.key(0), "x": jnp.zeros(())}
    new_state, drawn = jax.jit(cpu_tuning.with_written_out_threefry(update))(state, 2)
    assert seen == [cpu_tuning.WRITTEN_OUT_THREEFRY]
    assert new_state["key"].dtype == state["key"].dtype
    np.testing.assert_array_equal(jax.random.key_data(new_state["key"]),
                                  jax.random.key_data(jax.random.fold_in(state["key"], 2)))
    assert drawn == jax.random.uniform(state["key"])


def test_training_with_written_out_threefry_resumes_without_it(tmp_path):
    """The option changes the programs, not the state: a run with it stops, resumes without
    it and stays close to the run without it all along (XLA fuses the programs otherwise,
    so float results may differ in the last bits)."""
    from jaxddppo.train import run

    def train(name, written_out, updates, resume=False):
        config = {"env": {"num_envs": 8}, "ppo": {"num_steps": 16},
                  "train": {"total_env_steps": 8 * 16 * 4, "updates_per_chunk": 1},
                  "eval": {"num_episodes": 2}, "checkpoint": {"every_seconds": 0},
                  "run": {"progress": False, "dir": str(tmp_path / name), "written_out_threefry": written_out}}
        return run(config, resume=resume, stop_after_updates=updates)

    plain = train("plain", False, None)
    train("switched", True, 2)
    switched = train("switched", False, None, resume=True)
    rows = [[json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in ("plain", "switched")]
    assert [row["episode_return_mean"] for row in rows[1]] == [row["episode_return_mean"] for row in rows[0]]
    np.testing.assert_allclose(switched.summary["params_digest"], plain.summary["params_digest"], rtol=1e-5)
