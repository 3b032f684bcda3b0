"""Every supported gymnax environment runs a jitted rollout with its default network."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddppo.config import NetworkConfig
from jaxddppo.envs import available_env_ids, make_env
from jaxddppo.networks import make_actor_critic
from jaxddppo.rollout import RolloutState, collect_rollout

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
