"""Recurrent policies (network.recurrent: gru, lstm).

* The carry resets where an episode starts: in the network, and in a rollout,
  where every step that follows an episode end acts as from a fresh carry.
* Replaying a rollout's sequences through `unroll` reproduces what the rollout
  computed (the training path sees what the acting path saw).
* Sequence minibatches keep each environment's steps in order.
* Sizes that cannot split into whole sequences per shard fail at config time.
* The memory task (experiments/memory_chain.yaml) is learned by the GRU policy,
  while the feed-forward one stays at chance.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddppo import sharding
from jaxddppo.config.files import from_dict, load_config
from jaxddppo.config.options import ConfigError, NetworkConfig, PPOConfig
from jaxddppo.distributed import global_arrays, topology
from jaxddppo.envs import make_env
from jaxddppo.networks import make_actor_critic, unroll
from jaxddppo.ppo import PPOHyperparams, loss_apply_fn, mean_gradients
from jaxddppo.rollout import Batch, RolloutState, SequenceObs, collect_rollout, policy_step, take_sequences
from jaxddppo.sharding import epoch_indices, sequence_advantages
from jaxddppo.train import run

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def recurrent_network(kind: str, shared: bool, env_id: str = "CartPole-v1"):
    env = make_env(env_id)
    config = NetworkConfig(hidden_sizes=(16,), recurrent=kind, recurrent_size=8, shared_torso=shared)
    return env, make_actor_critic(config, env.spec)


@pytest.mark.parametrize("kind,shared", [("gru", True), ("lstm", False)])
def test_carry_resets_where_an_episode_starts(kind, shared):
    env, network = recurrent_network(kind, shared)
    obs = jax.random.normal(jax.random.key(0), (3,) + env.spec.obs_shape)
    params = network.init(jax.random.key(1), obs)
    fresh = network.initial_carry(3)
    assert len(fresh) == (1 if shared else 2)
    used = jax.tree.map(lambda c: c + jax.random.normal(jax.random.key(2), c.shape), fresh)
    start = jnp.asarray([True, False, True])
    carry, dist, value = network.step(params, used, obs, start)
    fresh_carry, fresh_dist, fresh_value = network.step(params, fresh, obs, start)
    for a, b in zip(jax.tree.leaves((carry, dist, value)), jax.tree.leaves((fresh_carry, fresh_dist, fresh_value))):
        np.testing.assert_array_equal(np.asarray(a)[[0, 2]], np.asarray(b)[[0, 2]])
        assert not np.allclose(np.asarray(a)[1], np.asarray(b)[1])


@pytest.fixture(scope="module")
def recurrent_rollout():
    """A GRU policy (separate actor and critic cores) on 4 CartPole envs for 48 steps."""
    env, network = recurrent_network("gru", False)
    num_envs, num_steps = 4, 48

    @jax.jit
    def rollout(key):
        obs, env_state = env.reset(jax.random.fold_in(key, 0), num_envs)
        params = network.init(jax.random.fold_in(key, 1), obs)
        initial = RolloutState(env_state, obs, network.initial_carry(num_envs), jnp.ones((num_envs,), bool))
        policy = lambda p, c, o, s: policy_step(network, p, None, c, o, s)
        state, transitions, _ = collect_rollout(env, policy, params, initial, jax.random.fold_in(key, 2), num_steps)
        return params, initial, state, transitions

    return env, network, *rollout(jax.random.key(4))


def test_rollout_resets_hidden_state_where_episodes_end(recurrent_rollout):
    env, network, params, _, state, transitions = recurrent_rollout
    done = np.asarray(transitions.terminated | transitions.truncated)
    start = np.asarray(transitions.episode_start)
    assert start[0].all()
    np.testing.assert_array_equal(start[1:], done[:-1])
    np.testing.assert_array_equal(np.asarray(state.episode_start), done[-1])
    assert 2 <= start[1:].sum() < start[1:].size // 2, "the rollout should hold a few episode ends"
    # Acting on each observation from a fresh carry: the same where an episode starts, not elsewhere.
    flat_obs = transitions.obs.reshape((-1,) + env.spec.obs_shape)
    _, _, fresh_value = network.step(params, network.initial_carry(flat_obs.shape[0]), flat_obs,
                                              jnp.ones(flat_obs.shape[0], bool))
    fresh_value = np.asarray(fresh_value).reshape(start.shape)
    value = np.asarray(transitions.value)
    np.testing.assert_allclose(value[start], fresh_value[start], rtol=1e-5, atol=1e-6)
    assert np.all(np.abs(value[~start] - fresh_value[~start]) > 1e-7)


def test_unrolled_sequences_reproduce_the_rollout(recurrent_rollout):
    _, network, params, initial, state, transitions = recurrent_rollout
    last_carry, dist, value = jax.jit(lambda p, c, o, s: unroll(network, p, c, o, s))(
        params, initial.carry, transitions.obs, transitions.episode_start
    )
    np.testing.assert_allclose(value, transitions.value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dist.log_prob(transitions.action), transitions.log_prob, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(last_carry), jax.tree.leaves(state.carry)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_unrolled_gaussian_policy_scores_whole_sequences():
    """Continuous actions: distributions stacked over time by `unroll` give each step's
    log-probability, as stepping one step at a time does."""
    env, network = recurrent_network("lstm", True, "Pendulum-v1")
    obs = jax.random.normal(jax.random.key(0), (3, 2) + env.spec.obs_shape)
    start = jnp.asarray([[True, True], [False, True], [False, False]])
    actions = jax.random.normal(jax.random.key(1), (3, 2, env.spec.num_actions))
    params = network.init(jax.random.key(2), obs[0])
    _, dist, _ = unroll(network, params, network.initial_carry(2), obs, start)
    carry, expected = network.initial_carry(2), []
    for t in range(3):
        carry, step_dist, _ = network.step(params, carry, obs[t], start[t])
        expected.append(step_dist.log_prob(actions[t]))
    np.testing.assert_allclose(dist.log_prob(actions), np.stack(expected), rtol=1e-5, atol=1e-6)


def test_sequence_minibatches_keep_each_environments_steps_in_order():
    num_steps, num_envs = 5, 6
    indices = np.asarray(epoch_indices(jax.random.key(0), 3, 2, num_envs))
    assert indices.shape == (3, 2, 3)
    for epoch in indices:
        assert sorted(epoch.ravel().tolist()) == list(range(num_envs))
    assert not all(np.array_equal(indices[0], indices[e]) for e in (1, 2)), "each epoch draws a new order"
    # Every field encodes (t, env) as 100 t + env; the carry encodes the env.
    code = (100 * np.arange(num_steps)[:, None] + np.arange(num_envs)[None, :]).astype(np.float32)
    batch = Batch(
        obs=SequenceObs(obs=jnp.asarray(code)[..., None], episode_start=jnp.asarray(code % 7 == 0),
                        carry=(jnp.arange(num_envs, dtype=jnp.float32)[:, None] * jnp.ones((1, 2)),)),
        action=jnp.asarray(code), log_prob=jnp.asarray(code), value=jnp.asarray(code),
        advantage=jnp.asarray(code), target=jnp.asarray(code),
    )
    for env_index in indices.reshape(-1, 3):
        minibatch = take_sequences(batch, jnp.asarray(env_index))
        expected = code[:, env_index]
        for name in ("action", "log_prob", "value", "advantage", "target"):
            np.testing.assert_array_equal(getattr(minibatch, name), expected)
        np.testing.assert_array_equal(minibatch.obs.obs[..., 0], expected)
        np.testing.assert_array_equal(minibatch.obs.episode_start, expected % 7 == 0)
        np.testing.assert_array_equal(minibatch.obs.carry[0][:, 0], env_index)
    raw = np.asarray(sharding.shard_parallel(
        lambda adv, idx: sequence_advantages(adv, idx, False, sharding.DeviceShards()), sharding.make_mesh(jax.devices()[:1])
    )(jnp.asarray(code)[None], jnp.asarray(indices)[None]))[0]
    assert raw.shape == (3, 2, num_steps, 3)
    np.testing.assert_array_equal(raw, np.moveaxis(code[:, indices], 0, 2))


def test_sequence_advantages_normalised_over_the_global_minibatch():
    """Two shards with different advantages: each minibatch (the same env positions on
    both shards) has mean 0 and std 1 over both shards' sequences, as in float64 NumPy."""
    rng = np.random.default_rng(0)
    advantages = np.stack([5.0 + rng.normal(size=(5, 4)), -3.0 + 4.0 * rng.normal(size=(5, 4))]).astype(np.float32)
    indices = np.asarray([[[2, 0], [3, 1]]])  # [E=1, M=2, n=2]
    mesh = sharding.make_mesh(jax.devices()[:2])
    normalised = global_arrays.all_shards(sharding.shard_parallel(
        lambda adv, idx: sequence_advantages(adv, idx, True, sharding.DeviceShards()), mesh
    )(jnp.asarray(advantages), jnp.broadcast_to(jnp.asarray(indices), (2,) + indices.shape)))
    for m in range(2):
        gathered = advantages.astype(np.float64)[:, :, indices[0, m]]  # [S, T, n]
        expected = (gathered - gathered.mean()) / (gathered.std() + 1e-8)
        np.testing.assert_allclose(normalised[:, 0, m], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.oldest
def test_sharded_sequence_gradient_equals_single_shard_gradient(recurrent_rollout):
    """The rollout's 4 sequences as one minibatch on 1 shard, or split 2 + 2 over 2 shards
    on 2 devices: the all-reduced gradient is the same (DESIGN.md's gradient trap)."""
    _, network, params, initial, _, transitions = recurrent_rollout
    rng = np.random.default_rng(5)
    batch = Batch(
        obs=SequenceObs(transitions.obs, transitions.episode_start, initial.carry),
        action=transitions.action, log_prob=transitions.log_prob + 0.05 * rng.normal(size=transitions.value.shape),
        value=transitions.value, advantage=jnp.asarray(rng.normal(size=transitions.value.shape), jnp.float32),
        target=jnp.asarray(rng.normal(size=transitions.value.shape), jnp.float32),
    )
    hyperparams = PPOHyperparams.from_config(PPOConfig())

    def gradients(num_shards: int):
        mesh = sharding.make_mesh(jax.devices()[:num_shards])
        per_device = lambda b: mean_gradients(params, b, loss_apply_fn(network), hyperparams, True,
                                              sharding.DeviceShards())[0]
        envs = jnp.arange(4).reshape(num_shards, -1)
        split = jax.tree.map(lambda *x: jnp.stack(x), *[take_sequences(batch, e) for e in envs])
        return global_arrays.local_copy(sharding.shard_parallel(per_device, mesh, out_layouts=sharding.PER_MEMBER)(split))

    single, sharded = gradients(1), gradients(2)
    a, b = (np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(g)]) for g in (sharded, single))
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5
    assert np.linalg.norm(b) > 0


@pytest.mark.parametrize("values,needle", [
    ({"env": {"num_envs": 12}, "train": {"num_shards": 4}, "ppo": {"num_minibatches": 2},
      "network": {"recurrent": "gru"}},
     "env.num_envs/train.num_shards=3 is not divisible by ppo.num_minibatches=2; network.recurrent=gru"),
    ({"env": {"num_envs": 4}, "ppo": {"num_minibatches": 4, "num_steps": 16}, "network": {"recurrent": "lstm"}},
     "env.num_envs/train.num_shards (default: devices)=1 is not divisible by ppo.num_minibatches=4"),
])
def test_sizes_that_do_not_split_into_sequences_fail_at_config_time(values, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        topology.make_topology(from_dict(values), num_devices=4)
    feed_forward = {**values, "network": {"recurrent": None}}
    topology.make_topology(from_dict(feed_forward), num_devices=4)


def test_unknown_recurrent_core_is_a_config_error():
    with pytest.raises(ConfigError, match="network.recurrent='rnn' is invalid: must be one of gru, lstm"):
        from_dict({"network": {"recurrent": "rnn"}})


@pytest.mark.slow
def test_memory_task_learned_by_gru_while_feed_forward_stays_at_chance(tmp_path):
    """experiments/memory_chain.yaml as it is (GRU), and with network.recurrent=null.
    Returns are +1 or -1 per episode, 0 in expectation when guessing; 256 evaluation
    episodes put chance within +-0.25 (4 standard deviations)."""
    results = {}
    for name, override in (("gru", []), ("feed_forward", ["network.recurrent=null"])):
        config = load_config(str(EXPERIMENTS / "memory_chain.yaml"),
                             [f"run.dir={tmp_path / name}", "run.progress=false", "train.num_shards=2", *override])
        results[name] = run(config, devices=jax.devices()[:2]).summary
    assert results["gru"]["eval_return_mean"] >= 0.9, results["gru"]
    assert results["gru"]["final_episode_return"] >= 0.8, results["gru"]
    assert abs(results["feed_forward"]["eval_return_mean"]) <= 0.25, results["feed_forward"]
    assert abs(results["feed_forward"]["final_episode_return"]) <= 0.25, results["feed_forward"]
