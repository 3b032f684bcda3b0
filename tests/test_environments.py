"""Every supported gymnax environment runs a jitted rollout with its default network; the rollout
carries whatever state pytree an environment returns."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddppo.config.files import from_dict
from jaxddppo.config.options import NetworkConfig
from jaxddppo.envs import available_env_ids, make_env
from jaxddppo.networks import make_actor_critic
from jaxddppo.rollout import RolloutState, collect_rollout
from jaxddppo.training.experiment import build, update_count

NUM_ENVS, NUM_STEPS = 3, 4


def _rollout_fn(env, network, critic_after_steps, keep_final_obs=True):
    @jax.jit
    def rollout(key):
        obs, env_state = env.reset(jax.random.fold_in(key, 0), NUM_ENVS)
        params = network.init(jax.random.fold_in(key, 1), obs)
        return collect_rollout(env, network.step, params, RolloutState(env_state, obs),
                               jax.random.fold_in(key, 2), NUM_STEPS, critic_after_steps, keep_final_obs)

    return rollout


# Each rollout compiles for 5-20 s. CI steps every classic-control environment and one of
# each other gymnax family (MinAtar, bsuite, misc); -m slow steps the rest.
FAMILY_MEMBER_IN_CI = {"MinAtar": "Breakout-MinAtar", "bsuite": "Catch-bsuite", "misc": "FourRooms-misc"}


def _in_ci(env_id: str) -> bool:
    family = env_id.rsplit("-", 1)[-1]
    return FAMILY_MEMBER_IN_CI.get(family, env_id) == env_id


@pytest.mark.parametrize("env_id", [
    env_id if _in_ci(env_id) else pytest.param(env_id, marks=pytest.mark.slow) for env_id in available_env_ids()])
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
    terminated, truncated = np.asarray(transitions.terminated), np.asarray(transitions.truncated)
    assert not np.any(terminated & truncated)
    assert float(stats.count) == np.sum(terminated | truncated)  # the episodes that ended in the rollout


class CountingCartPole:
    """CartPole whose state is a dict holding gymnax's state and a weakly typed float
    count of steps, as an environment built from Python numbers may return."""

    def __init__(self):
        self.inner = make_env("CartPole-v1")
        self.spec = self.inner.spec

    def reset(self, key, num_envs):
        obs, state = self.inner.reset(key, num_envs)
        count = jax.lax.broadcast(0.0, (num_envs,))  # a Python float: weakly typed
        return obs, state.replace(env_state={"gymnax": state.env_state, "count": count})

    def step_with_keys(self, keys, state, action):
        inner = state.replace(env_state=state.env_state["gymnax"])
        inner, result = self.inner.step_with_keys(keys, inner, action)
        count = state.env_state["count"] + 1.0
        return inner.replace(env_state={"gymnax": inner.env_state, "count": count}), result


def test_rollout_carries_any_environment_state_weak_types_included():
    env = CountingCartPole()
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,)), env.spec)
    obs, env_state = env.reset(jax.random.key(0), NUM_ENVS)
    assert jax.typeof(env_state.env_state["count"]).weak_type
    params = network.init(jax.random.key(1), obs)
    rollout = jax.jit(lambda state, key: collect_rollout(env, network.step, params, state, key, NUM_STEPS))
    state = RolloutState(env_state, obs)
    for _ in range(2):
        state, transitions, _ = rollout(state, jax.random.key(2))
    np.testing.assert_array_equal(state.env.env_state["count"], np.full(NUM_ENVS, 2.0 * NUM_STEPS))
    assert jax.tree.structure(state) == jax.tree.structure(RolloutState(env_state, obs))
    assert transitions.obs.shape == (NUM_STEPS, NUM_ENVS) + env.spec.obs_shape


def test_a_chunk_takes_the_state_it_returns_when_the_environment_state_is_weakly_typed():
    """The compiled chunk is called with the state it returned: the initial state must
    have the same (strong) types, or the second call would not match the compiled program."""
    config = from_dict({"env": {"num_envs": 2}, "ppo": {"num_steps": 4, "num_epochs": 1, "num_minibatches": 1},
                        "train": {"total_env_steps": 16, "updates_per_chunk": 1}})
    experiment = dataclasses.replace(build(config, jax.devices()[:1]), env=CountingCartPole())
    state = experiment.init_state()
    inputs, one = experiment.shard_inputs(), update_count(experiment.mesh, 1)
    learn = experiment.learn_fn().lower(state, inputs, one).compile()
    for _ in range(2):
        state, metrics, finite = learn(state, inputs, one)
    assert bool(np.all(finite))
    np.testing.assert_array_equal(np.asarray(state.rollout.env.env_state["count"]), np.full((1, 2), 8.0))


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_critic_after_steps_is_the_same_rollout_with_the_critic_out_of_the_loop(env_id):
    env = make_env(env_id)
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,)), env.spec)
    per_step, after = (_rollout_fn(env, network, flag) for flag in (False, True))
    key = jax.random.key(3)
    _, expected, expected_stats = per_step(key)
    _, transitions, stats = after(key)
    for name in ("obs", "action", "log_prob", "reward", "terminated", "truncated", "final_obs"):
        np.testing.assert_array_equal(getattr(transitions, name), getattr(expected, name), err_msg=name)
    np.testing.assert_array_equal(jax.tree.leaves(stats), jax.tree.leaves(expected_stats))
    # One pass over all observations instead of one per step: the same values up to rounding,
    # and the next step's value as next_value.
    for name in ("value", "next_value"):
        np.testing.assert_allclose(getattr(transitions, name), getattr(expected, name), rtol=1e-6, atol=1e-6,
                                   err_msg=name)
    # The compiled programs' torso products (8 features, feature-major: [8, samples]; XLA
    # before jaxlib 0.10 turns a product with one output, such as the critic's head, into a
    # multiply and a sum), by the samples they take: one step's environments (in the loop, in
    # the branch that values truncations, or the observation the rollout ends on) or all
    # steps' (after it). The critic's torso leaves the loop for a pass of its own; the actor's stays.
    key_spec = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    for rollout, per_step_products, batched_products in ((per_step, 4, 0), (after, 3, 1)):
        samples = [int(shape) for shape in re.findall(r"f32\[8,(\d+)\]\S* dot\(",
                                                      rollout.lower(key_spec).compile().as_text())]
        assert sorted(samples) == [NUM_ENVS] * per_step_products + [NUM_STEPS * NUM_ENVS] * batched_products


@pytest.mark.parametrize("critic_after_steps", [False, True])
def test_next_value_is_the_value_of_the_observation_reached_where_no_episode_terminated(critic_after_steps):
    """With a time limit of 5 steps, every environment truncates at steps 4 and 9 of 12 (and
    some terminate): next_value is the value of the step's final_obs wherever the episode
    did not terminate, as one pass over every step's final_obs computes it; the rollout
    keeps the final observations only when asked, and its numbers are the same without."""
    env = make_env("CartPole-v1")
    env.core.params = env.core.params.replace(max_steps_in_episode=5)
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,)), env.spec)
    key = jax.random.key(5)

    def rollout(keep_final_obs):
        obs, env_state = env.reset(jax.random.fold_in(key, 0), NUM_ENVS)
        params = network.init(jax.random.fold_in(key, 1), obs)
        _, transitions, _ = collect_rollout(env, network.step, params, RolloutState(env_state, obs),
                                            jax.random.fold_in(key, 2), 12, critic_after_steps, keep_final_obs)
        return transitions, network.step(params, None, transitions.final_obs, None)[2] if keep_final_obs else None

    (kept, value_of_final_obs), (dropped, _) = jax.jit(rollout, static_argnums=0)(True), \
        jax.jit(rollout, static_argnums=0)(False)
    truncated, terminated = np.asarray(kept.truncated), np.asarray(kept.terminated)
    assert truncated[[4, 9]].all() and truncated.sum() == 2 * NUM_ENVS
    assert np.any(np.asarray(kept.final_obs)[truncated] != np.asarray(kept.obs)[[5, 10]].reshape(-1, 4))
    not_terminated = ~terminated
    np.testing.assert_allclose(np.asarray(kept.next_value)[not_terminated],
                               np.asarray(value_of_final_obs)[not_terminated], rtol=1e-6, atol=1e-6)
    assert dropped.final_obs is None
    for name in ("obs", "action", "value", "next_value", "reward", "terminated", "truncated"):
        np.testing.assert_array_equal(getattr(dropped, name), getattr(kept, name), err_msg=name)


def test_critic_after_steps_needs_a_feed_forward_policy():
    env = make_env("CartPole-v1")
    network = make_actor_critic(NetworkConfig(hidden_sizes=(8,), recurrent="gru", recurrent_size=8), env.spec)
    obs, env_state = env.reset(jax.random.key(0), NUM_ENVS)
    params = network.init(jax.random.key(1), obs)
    state = RolloutState(env_state, obs, carry=network.initial_carry(NUM_ENVS),
                         episode_start=jnp.ones((NUM_ENVS,), bool))
    with pytest.raises(ValueError, match="critic_after_steps needs a feed-forward policy"):
        collect_rollout(env, network.step, params, state, jax.random.key(2), NUM_STEPS, critic_after_steps=True)


class Countdown:
    """Episodes end on their own after 3 + (key % 20) steps; no time limit is known (max_episode_steps=0)."""

    def __init__(self):
        from jaxddppo.envs import EnvSpec
        from jaxddppo.envs.base import observation_spec

        self.spec = EnvSpec(env_id="countdown", observation=observation_spec(self.reset), discrete=True,
                            num_actions=2, max_episode_steps=0)

    def reset(self, key):
        remaining = 3 + jax.random.randint(key, (), 0, 20)
        return jnp.stack([remaining * 1.0, 1.0]), remaining

    def step(self, key, remaining, action):
        remaining = remaining - 1
        return jnp.stack([remaining * 1.0, 1.0]), remaining, jnp.float32(1.0), remaining == 0, jnp.asarray(False)


def test_evaluation_without_a_known_time_limit_runs_every_episode_to_its_end():
    from jaxddppo.envs import BatchedEnv
    from jaxddppo.training.eval_episodes import evaluate_policy

    env = BatchedEnv(Countdown())
    network = make_actor_critic(NetworkConfig(hidden_sizes=(4,)), env.spec)
    key = jax.random.key(3)
    params = network.init(key, env.reset(key, 1)[0])
    result = jax.jit(evaluate_policy, static_argnums=(0, 1, 4))(env, network, params, key, 8)
    initial_obs, _ = env.reset(jax.random.split(key)[0], 8)
    expected = np.asarray(initial_obs[:, 0])
    # Every episode outlasts the one step a zero time limit would allow, and they end at
    # different steps: stopping at the first end would not pass either.
    assert 1 < expected.min() < expected.max()
    np.testing.assert_array_equal(np.asarray(result.lengths), expected)
    np.testing.assert_array_equal(np.asarray(result.returns), expected)
