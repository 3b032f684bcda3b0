"""Every supported gymnax environment runs a jitted rollout with its default network."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddppo.config import NetworkConfig
from jaxddppo.envs import available_env_ids, make_env
from jaxddppo.networks import make_actor_critic
from jaxddppo.rollout import RolloutState, carried_as_one_array_per_dtype, collect_rollout

NUM_ENVS, NUM_STEPS = 3, 4


def _rollout_fn(env, network, critic_after_steps):
    @jax.jit
    def rollout(key):
        obs, env_state = env.reset(jax.random.fold_in(key, 0), NUM_ENVS)
        params = network.init(jax.random.fold_in(key, 1), obs)
        return collect_rollout(env, network.step, params, RolloutState(env_state, obs),
                               jax.random.fold_in(key, 2), NUM_STEPS, critic_after_steps)

    return rollout


@pytest.mark.parametrize("env_id", available_env_ids())
def test_rollout_runs_on_every_environment(env_id):
    env = make_env(env_id)
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,), cnn_channels=(4,)), env.spec)
    _, transitions, stats = _rollout_fn(env, network, critic_after_steps=False)(jax.random.key(0))
    assert transitions.obs.shape == (NUM_STEPS, NUM_ENVS) + env.spec.obs_shape
    assert transitions.obs.dtype == jnp.float32
    expected_action_shape = (NUM_STEPS, NUM_ENVS) + (() if env.spec.discrete else (env.spec.num_actions,))
    assert transitions.action.shape == expected_action_shape
    for name in ("obs", "log_prob", "value", "reward", "final_obs", "next_value"):
        assert np.isfinite(np.asarray(getattr(transitions, name))).all(), name
    assert not np.any(np.asarray(transitions.terminated) & np.asarray(transitions.truncated))
    assert float(stats.count) >= 0


def test_rollout_carry_packs_one_array_per_dtype_and_back():
    rng = np.random.default_rng(0)
    tree = {
        "return": rng.normal(size=(3,)).astype(np.float32),
        "grid": rng.integers(-5, 5, size=(3, 2, 2)).astype(np.int32),
        "done": np.array([True, False, True]),
        "obs": rng.normal(size=(3, 4)).astype(np.float32),
    }
    pack, unpack = carried_as_one_array_per_dtype(tree)
    packed = jax.jit(pack)(tree)
    assert sorted((array.dtype.name, array.shape) for array in packed) == [
        ("bool", (3, 1)), ("float32", (3, 5)), ("int32", (3, 4))]
    restored = jax.jit(unpack)(packed)
    for name, value in tree.items():
        assert restored[name].dtype == value.dtype and restored[name].shape == value.shape, name
        np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_critic_after_steps_is_the_same_rollout_with_the_critic_out_of_the_loop(env_id):
    env = make_env(env_id)
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,)), env.spec)
    per_step, after = (_rollout_fn(env, network, flag) for flag in (False, True))
    key = jax.random.key(3)
    _, expected, expected_stats = per_step(key)
    _, transitions, stats = after(key)
    for name in ("obs", "action", "log_prob", "reward", "terminated", "truncated", "final_obs", "next_value"):
        np.testing.assert_array_equal(getattr(transitions, name), getattr(expected, name), err_msg=name)
    np.testing.assert_array_equal(jax.tree.leaves(stats), jax.tree.leaves(expected_stats))
    # One pass over all observations instead of one per step: the same values up to rounding.
    np.testing.assert_allclose(transitions.value, expected.value, rtol=1e-6, atol=1e-6)
    # The compiled programs' torso products (8 columns; XLA before jaxlib 0.10 turns a
    # product with one column, such as the critic's head, into a multiply and a sum), by
    # the rows they take: one step's environments (in the loop) or all steps' (after it).
    # The critic's torso leaves the loop for a pass of its own; the actor's stays; the
    # final_obs pass is there either way.
    key_spec = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    for rollout, per_step_products, batched_products in ((per_step, 2, 1), (after, 1, 2)):
        rows = [int(shape) for shape in re.findall(r"f32\[(\d+),8\]\S* dot\(",
                                                   rollout.lower(key_spec).compile().as_text())]
        assert sorted(rows) == [NUM_ENVS] * per_step_products + [NUM_STEPS * NUM_ENVS] * batched_products


def test_critic_after_steps_needs_a_feed_forward_policy():
    env = make_env("CartPole-v1")
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,), recurrent="gru", recurrent_size=8), env.spec)
    obs, env_state = env.reset(jax.random.key(0), NUM_ENVS)
    params = network.init(jax.random.key(1), obs)
    state = RolloutState(env_state, obs, carry=network.initial_carry(NUM_ENVS),
                         episode_start=jnp.ones((NUM_ENVS,), bool))
    with pytest.raises(ValueError, match="critic_after_steps needs a feed-forward policy"):
        collect_rollout(env, network.step, params, state, jax.random.key(2), NUM_STEPS, critic_after_steps=True)
