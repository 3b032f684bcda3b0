"""Every supported gymnax environment runs a jitted rollout with its default network."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddppo.config import NetworkConfig
from jaxddppo.envs import available_env_ids, make_env
from jaxddppo.networks import make_actor_critic
from jaxddppo.rollout import RolloutState, carried_as_one_array_per_dtype, collect_rollout

NUM_ENVS, NUM_STEPS = 3, 4


@pytest.mark.parametrize("env_id", available_env_ids())
def test_rollout_runs_on_every_environment(env_id):
    env = make_env(env_id)
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,), cnn_channels=(4,)), env.spec)

    @jax.jit
    def rollout(key):
        obs, env_state = env.reset(jax.random.fold_in(key, 0), NUM_ENVS)
        params = network.init(jax.random.fold_in(key, 1), obs)
        return collect_rollout(env, network.step, params, RolloutState(env_state, obs),
                               jax.random.fold_in(key, 2), NUM_STEPS)

    _, transitions, stats = rollout(jax.random.key(0))
    assert transitions.obs.shape == (NUM_STEPS, NUM_ENVS) + env.spec.obs_shape
    assert transitions.obs.dtype == jnp.float32
    expected_action_shape = (NUM_STEPS, NUM_ENVS) + (() if env.spec.discrete else (env.spec.num_actions,))
    assert transitions.action.shape == expected_action_shape
    for name in ("obs", "log_prob", "value", "reward", "final_obs"):
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
