"""Observation normalisation and reward scaling: global running statistics.

* The running moments after rollouts equal float64 NumPy mean/variance over the
  concatenated data of all shards, on 1 and on 4 simulated devices.
* The parallel (Chan) merge against NumPy, including a large mean that would
  cancel a naive E[x^2] - E[x]^2 in float32.
* The discounted return of the reward scaler against a NumPy loop.
* Training keeps the statistics in TrainState, identical on every shard and
  every device count; evaluation and the rollout use them through policy_step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import device_copies, jit_stages

from jaxddppo import sharding
from jaxddppo.config.files import from_dict
from jaxddppo.config.options import NetworkConfig
from jaxddppo.distributed import global_arrays
from jaxddppo.envs import make_env
from jaxddppo.networks import make_actor_critic
from jaxddppo.rollout import (
    OBS_CLIP,
    RolloutState,
    RunningMoments,
    collect_rollout,
    discounted_returns,
    init_moments,
    merge_moments,
    policy_step,
    scale_rollout_rewards,
    update_moments,
)
from jaxddppo.training.eval_episodes import evaluate_policy
from jaxddppo.training.experiment import build, update_count

NUM_SHARDS, NUM_ENVS, NUM_STEPS, NUM_ROLLOUTS, GAMMA = 4, 3, 24, 2, 0.9


def numpy_moments(samples: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    samples = np.asarray(samples, np.float64)
    return samples.shape[0], samples.mean(axis=0), samples.var(axis=0)


def numpy_discounted_returns(rewards: np.ndarray, dones: np.ndarray, gamma: float) -> np.ndarray:
    """G_t = r_t + gamma G_{t-1}, G restarting after a done step; [T, B] in float64."""
    returns = np.zeros(rewards.shape, np.float64)
    running = np.zeros(rewards.shape[1], np.float64)
    for t in range(rewards.shape[0]):
        running = rewards[t] + gamma * running
        returns[t] = running
        running = np.where(dones[t], 0.0, running)
    return returns


def rollouts_with_statistics(num_devices: int):
    """NUM_ROLLOUTS rollouts of CartPole (observations of unequal scales, short episodes) on each of
    NUM_SHARDS shards, acting through the running normaliser and updating it and the
    reward scaler after each rollout exactly as ppo.update does."""
    env = make_env("CartPole-v1")
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,)), env.spec)
    mesh = sharding.make_mesh(jax.devices()[:num_devices])

    device_shards = sharding.DeviceShards()

    def per_device(shard_index):
        shards_per_device = shard_index.shape[0]

        def start(index):
            key = jax.random.fold_in(jax.random.key(7), index)
            obs, env_state = env.reset(key, NUM_ENVS)
            return key, RolloutState(env_state, obs, discounted_return=jnp.zeros((NUM_ENVS,)))

        keys, rollout = jax.vmap(start)(shard_index)
        params = network.init(jax.random.key(0), jax.tree.map(lambda leaf: leaf[0], rollout.obs))
        obs_moments, return_moments = init_moments(env.spec.obs_shape), init_moments(())
        observations, rewards, dones = [], [], []
        for index in range(NUM_ROLLOUTS):
            policy = lambda p, c, o, s, m=obs_moments: policy_step(network, p, m, c, o, s)
            rollout, transitions, _ = device_shards.map(
                lambda shard, key: collect_rollout(env, policy, params, shard, jax.random.fold_in(key, index + 1),
                                                   NUM_STEPS),
                rollout, keys,
            )
            shard_observations = transitions.obs.reshape(shards_per_device, -1, *env.spec.obs_shape)
            obs_moments = update_moments(obs_moments, shard_observations, device_shards)
            scaled = scale_rollout_rewards(transitions, rollout.discounted_return, return_moments, GAMMA, device_shards)
            rollout, return_moments = rollout.replace(discounted_return=scaled.discounted_return), scaled.moments
            observations.append(transitions.obs)
            rewards.append(transitions.reward)
            dones.append(transitions.terminated | transitions.truncated)
        data = tuple(jnp.concatenate(x, axis=1) for x in (observations, rewards, dones))
        return obs_moments, return_moments, scaled.rewards, data

    indices = global_arrays.put_members(np.arange(NUM_SHARDS, dtype=np.int32)[None], mesh)
    member, shard = sharding.PER_MEMBER, sharding.PER_SHARD
    obs_moments, return_moments, rewards, data = sharding.shard_parallel(
        per_device, mesh, out_layouts=(member, member, shard, shard))(indices)
    return (*device_copies((obs_moments, return_moments)), *global_arrays.all_shards((rewards, data)))


@pytest.fixture(scope="module")
def statistics_by_device_count():
    return {num_devices: rollouts_with_statistics(num_devices) for num_devices in (1, 4)}


@pytest.mark.parametrize("num_devices", [1, 4])
def test_running_statistics_equal_numpy_over_all_shards(statistics_by_device_count, num_devices):
    obs_moments, return_moments, last_scaled_rewards, (obs, rewards, dones) = statistics_by_device_count[num_devices]
    # Every device holds the same statistics.
    for leaf in jax.tree.leaves((obs_moments, return_moments)):
        assert len(leaf) == num_devices and all(np.array_equal(leaf[0], copy) for copy in leaf)
    # Observations of every shard and every rollout together: [S, R*T, B, 4] -> [S*R*T*B, 4].
    count, mean, variance = numpy_moments(obs.reshape(-1, obs.shape[-1]))
    assert obs_moments.count[0] == count == NUM_SHARDS * NUM_ROLLOUTS * NUM_STEPS * NUM_ENVS
    assert variance.max() > 10 * variance.min(), "the observation dimensions should have unequal scales"
    np.testing.assert_allclose(obs_moments.mean[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(obs_moments.m2[0] / obs_moments.count[0], variance, rtol=1e-5)
    # Discounted returns of every shard's rollouts (the scaler's running return carries over).
    returns = np.stack([
        numpy_discounted_returns(rewards[s].astype(np.float64), dones[s], GAMMA) for s in range(NUM_SHARDS)
    ])
    assert dones.any(), "an episode should end so the return restarts"
    count, mean, variance = numpy_moments(returns.reshape(-1))
    assert return_moments.count[0] == count
    np.testing.assert_allclose(return_moments.mean[0], mean, rtol=1e-5)
    np.testing.assert_allclose(return_moments.m2[0] / return_moments.count[0], variance, rtol=1e-5)
    last_rewards = rewards[:, -NUM_STEPS:].astype(np.float64)
    np.testing.assert_allclose(last_scaled_rewards, last_rewards / np.sqrt(variance + 1e-8), rtol=1e-5)


def test_running_statistics_equal_on_one_and_four_devices(statistics_by_device_count):
    one, four = statistics_by_device_count[1], statistics_by_device_count[4]
    np.testing.assert_array_equal(one[3][0], four[3][0])  # the same observations
    # The same sums in another reduction order (measured: 2e-6 relative on a mean of -0.0025).
    for a, b in zip(jax.tree.leaves(one[:2]), jax.tree.leaves(four[:2])):  # each device's copy
        np.testing.assert_allclose(np.broadcast_to(a, b.shape), b, rtol=1e-5, atol=1e-8)


def test_merge_of_unequal_parts_equals_numpy():
    rng = np.random.default_rng(0)
    parts = [rng.normal(3.0, 2.0, size=(n, 2)).astype(np.float32) for n in (1, 17, 5)]
    moments = init_moments((2,))
    for part in parts:
        count, mean, variance = numpy_moments(part)
        moments = merge_moments(moments, RunningMoments(
            jnp.float32(count), jnp.asarray(mean, jnp.float32), jnp.asarray(variance * count, jnp.float32)
        ))
    count, mean, variance = numpy_moments(np.concatenate(parts))
    assert float(moments.count) == count
    np.testing.assert_allclose(moments.mean, mean, rtol=1e-6)
    np.testing.assert_allclose(moments.variance, variance, rtol=1e-5)


def test_large_mean_does_not_cancel_the_variance():
    """Float32 samples 1000 + N(0, 0.01^2): E[x^2] - E[x]^2 would lose every digit."""
    rng = np.random.default_rng(1)
    batches = [(1000.0 + 0.01 * rng.normal(size=(256, 1))).astype(np.float32) for _ in range(3)]
    mesh = sharding.make_mesh(jax.devices()[:2])

    def per_device(samples):
        moments = init_moments((1,))
        for index in range(len(batches)):
            moments = update_moments(moments, samples[:, index], sharding.DeviceShards())
        return moments

    split = jnp.asarray(np.stack(batches).reshape(3, 2, 128, 1).transpose(1, 0, 2, 3))  # [S, R, N, 1]
    moments = global_arrays.local_copy(sharding.shard_parallel(per_device, mesh, out_layouts=sharding.PER_MEMBER)(split))
    _, mean, variance = numpy_moments(np.concatenate(batches))
    naive = np.mean(np.square(np.concatenate(batches)), axis=0, dtype=np.float32) - np.float32(mean) ** 2
    assert abs(naive[0] - variance[0]) > 0.5 * variance[0], "the reference for the naive formula"
    np.testing.assert_allclose(moments.variance, variance, rtol=1e-3)
    np.testing.assert_allclose(moments.mean, mean, rtol=1e-7)


def test_discounted_returns_match_numpy_loop():
    rng = np.random.default_rng(2)
    rewards = rng.normal(size=(9, 4)).astype(np.float32)
    dones = rng.random((9, 4)) < 0.3
    running, returns = discounted_returns(jnp.zeros(4), jnp.asarray(rewards), jnp.asarray(dones), 0.8)
    expected = numpy_discounted_returns(rewards, dones, 0.8)
    np.testing.assert_allclose(returns, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(running, np.where(dones[-1], 0.0, expected[-1]), rtol=1e-5, atol=1e-6)


def test_policy_step_normalises_and_clips_observations():
    env = make_env("Pendulum-v1")
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,)), env.spec)
    obs = jnp.asarray([[0.5, -0.5, 3.0], [2.0, 1.0, -900.0]], jnp.float32)
    params = network.init(jax.random.key(0), obs)
    moments = RunningMoments(jnp.float32(10.0), jnp.asarray([0.5, 0.0, 1.0]), jnp.asarray([40.0, 10.0, 0.1]))
    std = np.sqrt(np.asarray([4.0, 1.0, 0.01]) + 1e-8)
    expected = np.clip((np.asarray(obs, np.float64) - [0.5, 0.0, 1.0]) / std, -OBS_CLIP, OBS_CLIP)
    assert expected[1, 2] == -OBS_CLIP
    _, dist, value = policy_step(network, params, moments, None, obs, None)
    reference_dist, reference_value = network.apply(params, jnp.asarray(expected, jnp.float32))
    np.testing.assert_allclose(dist.mean, reference_dist.mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(value, reference_value, rtol=1e-5, atol=1e-6)
    _, unnormalised, _ = policy_step(network, params, None, None, obs, None)
    assert not np.allclose(unnormalised.mean, dist.mean)


def test_training_keeps_global_statistics_in_the_state():
    """A GRU policy with both statistics, 4 shards on 4 devices, two chunks of one update:
    every shard holds the same moments, of all 4 x 2 rollouts, and the same parameters;
    the second chunk does not recompile. (Device-count invariance of the statistics is
    checked above; of training, in test_sharding.py.)"""
    config = from_dict({
        "env": {"id": "CartPole-v1", "num_envs": 8, "normalize_observations": True, "scale_rewards": True},
        "network": {"recurrent": "gru", "recurrent_size": 8, "hidden_sizes": [8], "shared_torso": True},
        "ppo": {"num_steps": 8, "num_epochs": 1, "num_minibatches": 2, "learning_rate": 1e-2},
        "train": {"num_shards": 4, "total_env_steps": 8 * 8 * 2, "updates_per_chunk": 1},
    })
    experiment = build(config, jax.devices())
    learn, inputs, one = experiment.learn_fn(), experiment.shard_inputs(), update_count(experiment.mesh, 1)
    initial = experiment.init_state()
    with jit_stages() as first_chunk:
        state, _, _ = learn(initial, inputs, one)
    with jit_stages() as second_chunk:
        state, _, _ = learn(state, inputs, one)
    assert "compile" in {stage for stage, _ in first_chunk}, first_chunk  # what a recompilation reports
    assert second_chunk == [], f"the second chunk recompiled: {second_chunk}"
    moments = device_copies((state.obs_moments, state.return_moments))
    assert np.all(moments[0].count == 2 * 8 * 8) and np.all(moments[1].count == 2 * 8 * 8)
    for leaf in jax.tree.leaves((moments, device_copies(state.params))):
        assert len(leaf) == 4 and all(np.array_equal(leaf[0], copy) for copy in leaf)
    assert np.all(moments[0].m2 > 0) and np.all(moments[1].m2 > 0)


def test_evaluation_acts_on_normalised_observations():
    """The same params evaluated with and without the statistics act differently; with
    statistics that normalise nothing (mean 0, variance 1) exactly as without."""
    env = make_env("Pendulum-v1")
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,)), env.spec)
    params = network.init(jax.random.key(0), jnp.zeros((1, 3)))
    evaluate = jax.jit(evaluate_policy, static_argnums=(0, 1, 4))
    key = jax.random.key(3)
    plain = evaluate(env, network, params, key, 4, None)
    identity = RunningMoments(jnp.float32(5.0), jnp.zeros(3), jnp.full((3,), 5.0))  # variance 1
    shifted = RunningMoments(jnp.float32(5.0), jnp.asarray([0.5, -0.5, 4.0]), jnp.full((3,), 0.5))
    np.testing.assert_allclose(evaluate(env, network, params, key, 4, identity).returns, plain.returns, rtol=1e-4)
    assert not np.allclose(evaluate(env, network, params, key, 4, shifted).returns, plain.returns, rtol=1e-3)
