"""Every environment family imports and steps, jitted, through the trainer's `BatchedEnv`.

Marked `families`: CI runs these in a step of its own, after installing every family's
extra (the main suite installs only xminigrid; a family not installed is skipped).
"""

from dataclasses import replace

import jax
import numpy as np
import pytest

from jaxddppo.envs import FAMILIES, make_core, make_env
from jaxddppo.envs.base import random_actions, strongly_typed

from conftest import FAMILY_IDS, family_installed

NUM_ENVS, NUM_STEPS = 3, 6


def test_every_family_has_an_example_id_in_the_tests():
    assert set(FAMILY_IDS) == set(FAMILIES) - {"gymnax"}


@pytest.mark.families
@pytest.mark.parametrize("family", sorted(FAMILY_IDS))
def test_a_family_steps_jitted_with_random_legal_actions(family):
    if not family_installed(family):
        pytest.skip(f"the {family} extra is not installed")
    env = make_env(FAMILY_IDS[family])
    spec = env.spec

    @jax.jit
    def rollout(key):
        obs, state = env.reset(key, NUM_ENVS)

        def one(carry, step_key):
            obs, state = carry
            action_key, env_key = jax.random.split(step_key)
            action = random_actions(spec, action_key, obs)
            state, result = env.step(env_key, strongly_typed(state), action)
            return (result.obs, state), (obs, result, action)

        _, (acted_on, results, actions) = jax.lax.scan(one, (obs, state), jax.random.split(key, NUM_STEPS))
        return obs, acted_on, results, actions

    first_obs, acted_on, results, actions = jax.tree.map(np.asarray, rollout(jax.random.key(0)))

    last = jax.tree.map(lambda leaf: leaf[-1], (results.obs, results.final_obs))
    for observed in (first_obs, *last):
        assert jax.tree.structure(observed) == jax.tree.structure(spec.observation)
        for leaf, leaf_spec in zip(jax.tree.leaves(observed), jax.tree.leaves(spec.observation)):
            assert leaf.shape == (NUM_ENVS,) + tuple(leaf_spec.shape) and leaf.dtype == leaf_spec.dtype
            assert leaf.dtype == bool or np.isfinite(leaf).all()
    assert results.reward.shape == (NUM_STEPS, NUM_ENVS) and np.isfinite(results.reward).all()
    assert results.terminated.dtype == results.truncated.dtype == bool
    changed = [not np.array_equal(reached, first[None]) for first, reached in
               zip(jax.tree.leaves(first_obs), jax.tree.leaves(results.final_obs))]
    assert any(changed), f"{FAMILY_IDS[family]}: {NUM_STEPS} steps left every observation as the reset made it"
    if spec.discrete:
        assert ((0 <= actions) & (actions < spec.num_actions)).all()
        if spec.action_mask_key is not None:
            legal = np.take_along_axis(acted_on[spec.action_mask_key], actions[..., None], axis=-1)
            assert legal.all()
    else:
        assert actions.shape == (NUM_STEPS, NUM_ENVS, spec.num_actions)
        assert ((np.asarray(spec.action_low) <= actions) & (actions <= np.asarray(spec.action_high))).all()


@pytest.mark.families
@pytest.mark.parametrize("family", ["jumanji", "playground"])
def test_a_family_s_environment_object_steps_as_its_built_in_id(family):
    """The built-in id's own environment object (a Jumanji `Environment`, a Playground `MjxEnv`),
    given as a user's object, goes through the family's adapter and steps the same."""
    if not family_installed(family):
        pytest.skip(f"the {family} extra is not installed")
    built_in = make_core(FAMILY_IDS[family])
    given = make_core("<object>:Env", given=built_in.env)
    assert type(given) is type(built_in) and given is not built_in
    assert replace(given.spec, env_id=built_in.spec.env_id) == built_in.spec

    def trajectory(core):
        key = jax.random.key(1)
        obs, state = core.reset(key)
        action = random_actions(core.spec, key, jax.tree.map(lambda leaf: leaf[None], obs))[0]
        outputs = (obs, jax.jit(core.step)(key, state, action))
        return [np.asarray(jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
                           else leaf) for leaf in jax.tree.leaves(outputs)]

    for ours, theirs in zip(trajectory(given), trajectory(built_in), strict=True):
        np.testing.assert_array_equal(ours, theirs)
