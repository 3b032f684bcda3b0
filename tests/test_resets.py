"""Resets paid only when episodes end (`jaxddppo/envs/base.py`).

A stand-in environment counts the executions of its `reset` through `io_callback`: a step
on which no episode ends must run none, and every episode must start from a fresh state
of its own, alone, under `vmap` (batched members and shards) and nested `vmap`; its state
is taken from the pool at its next step (`take_pending`). With `start_states="first"` no
step runs a reset, and each environment restarts from its own first state. A gymnax game
steps as gymnax's own `step_env` from the state its observation shows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from jaxddppo.config.options import ConfigError
from jaxddppo.envs import BatchedEnv, EnvSpec, make_env
from jaxddppo.envs.base import (
    ResetPool,
    branch_as_cond,
    branch_as_loop,
    observation_spec,
    take_pending,
    take_slot_states,
    update_if_any,
)

NUM_ENVS = 8


class CountedResets:
    """Episodes of `length(key)` steps; the observation is (steps left, a start value drawn
    by the reset). `resets` counts the resets executed (one per environment reset)."""

    def __init__(self, min_length: int, max_length: int):
        self.min_length, self.max_length = min_length, max_length
        self.resets = 0
        self.spec = EnvSpec(env_id="counted", observation=observation_spec(self._reset), discrete=True,
                            num_actions=2, max_episode_steps=0)

    def _count(self, key_data: np.ndarray) -> np.ndarray:
        self.resets += 1
        return np.zeros((), np.float32)

    def _reset(self, key):
        length_key, start_key = jax.random.split(key)
        remaining = jax.random.randint(length_key, (), self.min_length, self.max_length + 1)
        start = jax.random.uniform(start_key)
        return jnp.stack([remaining.astype(jnp.float32), start]), (remaining, start)

    def reset(self, key):
        marker = io_callback(self._count, jax.ShapeDtypeStruct((), jnp.float32), jax.random.key_data(key))
        obs, state = self._reset(key)
        return obs + marker, state

    def step(self, key, state, action):
        remaining, start = state
        remaining = remaining - 1
        obs = jnp.stack([remaining.astype(jnp.float32), start])
        return obs, (remaining, start), jnp.float32(1.0), remaining == 0, jnp.asarray(False)


class TracedResets(CountedResets):
    """`CountedResets` that also counts the traces of its reset (`traces`) and step (`step_traces`)."""

    traces = 0
    step_traces = 0

    def reset(self, key):
        self.traces += 1
        return super().reset(key)

    def step(self, key, state, action):
        self.step_traces += 1
        return super().step(key, state, action)


def run_steps(env: BatchedEnv, num_steps: int, key=jax.random.key(0), num_envs: int = NUM_ENVS):
    """Observations and done flags of `num_steps` steps, one jitted call per step, and
    the resets executed by each step."""
    obs, state = env.reset(jax.random.fold_in(key, 0), num_envs)
    step = jax.jit(env.step)
    observations, dones, resets = [np.asarray(obs)], [], []
    for index in range(num_steps):
        before = env.core.resets
        state, result = step(jax.random.fold_in(key, index + 1), state, jnp.zeros((num_envs,), jnp.int32))
        jax.block_until_ready(result.obs)
        resets.append(env.core.resets - before)
        observations.append(np.asarray(result.obs))
        dones.append(np.asarray(result.terminated | result.truncated))
    return np.stack(observations), np.stack(dones), np.asarray(resets)


def test_a_step_on_which_no_episode_ends_runs_no_reset():
    core = CountedResets(3, 3)  # every episode ends after 3 steps, all together
    observations, dones, resets = run_steps(BatchedEnv(core), 9)
    assert dones.any(axis=1).tolist() == [False, False, True] * 3
    # One refill of the whole pool (one reset per environment) on each step where episodes end.
    assert resets.tolist() == [0, 0, NUM_ENVS] * 3


def test_every_episode_starts_from_a_fresh_state_of_its_own():
    core = CountedResets(2, 6)
    observations, dones, resets = run_steps(BatchedEnv(core), 40)
    starts = [observations[0][:, 1]]
    for step_index in range(dones.shape[0]):
        ended = dones[step_index]
        starts.append(observations[step_index + 1][ended, 1])
        # The restarted environments show a new episode's first observation: its full length left.
        assert (observations[step_index + 1][ended, 0] >= 2).all()
        if step_index + 1 < dones.shape[0]:
            # Their next step goes on from that first state (its state was taken from the pool).
            going_on = ended & ~dones[step_index + 1]
            np.testing.assert_array_equal(observations[step_index + 2][going_on],
                                          observations[step_index + 1][going_on] - np.array([1.0, 0.0], np.float32))
    starts = np.concatenate(starts)
    episodes_ended = int(dones.sum())
    assert episodes_ended > 3 * NUM_ENVS
    assert len(np.unique(starts)) == len(starts) == NUM_ENVS + episodes_ended
    # Reset work in proportion to the episodes that end: the whole pool is refilled on a step
    # only when fewer slots are left than episodes end on it.
    np.testing.assert_array_equal(resets, reference_refills(dones.sum(axis=1), NUM_ENVS) * NUM_ENVS)
    assert resets.sum() < 1.5 * episodes_ended


def reference_refills(ended_per_step: np.ndarray, pool_size: int) -> np.ndarray:
    """1 on the steps where a pool of `pool_size` slots, starting used up, is refilled."""
    next_slot, refills = pool_size, []
    for ended in ended_per_step:
        refill = ended > 0 and next_slot + ended > pool_size
        next_slot = min((0 if refill else next_slot) + ended, pool_size)
        refills.append(int(refill))
    return np.asarray(refills)


def test_a_smaller_pool_shares_slots_only_when_more_episodes_end_than_it_holds():
    core = CountedResets(3, 3)
    observations, dones, resets = run_steps(BatchedEnv(core, optimistic_reset_ratio=4), 3)
    assert resets.tolist() == [0, 0, NUM_ENVS // 4]
    starts = observations[3][:, 1]
    # Environment k takes slot k mod 2.
    np.testing.assert_array_equal(starts, np.tile(starts[:2], NUM_ENVS // 2))
    assert starts[0] != starts[1]


def test_first_start_states_restart_each_environment_from_its_own_first_state_without_resets():
    core = CountedResets(2, 6)
    observations, dones, resets = run_steps(BatchedEnv(core, start_states="first"), 30)
    assert core.resets == NUM_ENVS  # the first reset's, none after
    assert not resets.any()
    first = observations[0]
    assert len(np.unique(first[:, 1])) == NUM_ENVS
    assert int(dones.sum()) > 2 * NUM_ENVS
    for step_index in range(dones.shape[0]):
        ended = dones[step_index]
        np.testing.assert_array_equal(observations[step_index + 1][ended], first[ended])
        running = observations[step_index + 1][~ended]
        np.testing.assert_array_equal(running[:, 0], observations[step_index][~ended, 0] - 1)
    # Each environment's episodes repeat its first one's length.
    for env_index in range(NUM_ENVS):
        ends = np.flatnonzero(dones[:, env_index])
        np.testing.assert_array_equal(np.diff(ends), np.full(len(ends) - 1, int(first[env_index, 0])))


def test_an_unknown_start_states_value_is_refused():
    with pytest.raises(ConfigError, match="env.start_states='cached' is invalid: must be one of fresh, first"):
        BatchedEnv(CountedResets(2, 2), start_states="cached")


def test_first_start_states_refuse_a_reset_ratio_they_would_ignore():
    with pytest.raises(ConfigError, match="env.optimistic_reset_ratio=4 is invalid with env.start_states='first'"):
        BatchedEnv(CountedResets(2, 2), optimistic_reset_ratio=4, start_states="first")


def test_every_program_reuses_one_trace_of_the_cores_reset_and_step():
    """The environments' restarts and steps in every program (the first states, the rollout's
    steps with their resets, the evaluation's steps without, batched members, other batch
    sizes) trace the core's `reset` and `step` once each: Playground's CheetahRun reset took
    5 s to trace on a CPU."""
    core = TracedResets(2, 4)
    env = BatchedEnv(core)
    _, state = env.reset(jax.random.key(0), NUM_ENVS)
    actions = jnp.zeros((NUM_ENVS,), jnp.int32)
    jax.jit(env.step).lower(jax.random.key(1), state, actions)
    jax.jit(env.step_without_reset).lower(jax.random.key(1), state, actions)
    members = jax.tree.map(lambda leaf: jnp.stack([leaf] * 3), state)
    jax.jit(jax.vmap(env.step)).lower(jax.random.split(jax.random.key(1), 3), members, jnp.stack([actions] * 3))
    jax.jit(lambda key: env.reset(key, 2 * NUM_ENVS)).lower(jax.random.key(2))
    assert (core.traces, core.step_traces) == (1, 1)


def batched_steps(env: BatchedEnv, keys: jax.Array, num_steps: int):
    """`num_steps` steps of every member (leading axis of `keys`), batched with `vmap`."""

    def member(key):
        obs, state = env.reset(jax.random.fold_in(key, 0), NUM_ENVS)

        def one(state, step_key):
            state, result = env.step(step_key, state, jnp.zeros((NUM_ENVS,), jnp.int32))
            return state, (result.obs, result.terminated)

        return jax.lax.scan(one, state, jax.random.split(jax.random.fold_in(key, 1), num_steps))[1]

    return jax.jit(jax.vmap(member))(keys)


def test_batched_members_reset_only_when_one_of_them_needs_it_and_each_as_alone():
    core = CountedResets(3, 3)
    env = BatchedEnv(core)
    keys = jax.random.split(jax.random.key(4), 2)
    batched_obs, batched_done = batched_steps(env, keys, 2)
    assert not bool(batched_done.any())
    assert core.resets == 2 * NUM_ENVS  # the initial resets only
    core.resets = 0
    batched_obs, batched_done = batched_steps(env, keys, 3)
    assert core.resets == 2 * NUM_ENVS + 2 * NUM_ENVS  # initial resets, one refill of both pools
    for member in range(2):
        alone_obs, alone_done = batched_steps(env, keys[member:member + 1], 3)
        np.testing.assert_array_equal(batched_obs[member], alone_obs[0])


def test_batched_members_restart_from_their_own_first_states_each_as_alone():
    env = BatchedEnv(CountedResets(2, 5), start_states="first")
    keys = jax.random.split(jax.random.key(5), 3)
    batched_obs, batched_done = batched_steps(env, keys, 12)
    assert batched_done.any() and not batched_done.all()
    for member in range(3):
        alone_obs, _ = batched_steps(env, keys[member:member + 1], 12)
        np.testing.assert_array_equal(batched_obs[member], alone_obs[0])
    assert not np.array_equal(batched_obs[0], batched_obs[1])


def counted_update(executed: list):
    """v -> 2 v + 1 through a host callback that appends to `executed` each time it runs."""

    def costly(v):
        executed.append(1)
        return np.asarray(v) * 2.0 + 1.0

    return lambda v: io_callback(costly, jax.ShapeDtypeStruct(v.shape, v.dtype), v)


@pytest.mark.parametrize("batch_shape", [(3,), (2, 3)])
def test_update_if_any_computes_each_member_as_alone_and_skips_when_none_needs_it(batch_shape):
    executed = []

    def member(predicate, x):
        return update_if_any(predicate, counted_update(executed), x)

    function = member
    for _ in batch_shape:
        function = jax.vmap(function)
    function = jax.jit(function)
    values = jnp.arange(np.prod(batch_shape) * 2, dtype=jnp.float32).reshape(*batch_shape, 2)
    predicates = (jnp.arange(np.prod(batch_shape)) % 2 == 1).reshape(batch_shape)
    out = function(predicates, values)
    expected = np.where(np.asarray(predicates)[..., None], np.asarray(values) * 2.0 + 1.0, np.asarray(values))
    np.testing.assert_array_equal(out, expected)
    assert executed
    executed.clear()
    np.testing.assert_array_equal(function(jnp.zeros(batch_shape, bool), values), values)
    assert not executed


@pytest.mark.parametrize("form", [branch_as_loop, branch_as_cond])
def test_each_branch_form_updates_only_when_its_predicate_holds(form):
    executed = []
    function = jax.jit(lambda predicate, x: form(counted_update(executed), predicate, x))
    values = jnp.arange(3, dtype=jnp.float32)
    np.testing.assert_array_equal(function(True, values), np.arange(3) * 2.0 + 1.0)
    assert executed == [1]
    np.testing.assert_array_equal(function(False, values), values)
    assert executed == [1]


@pytest.mark.parametrize("platform,loop", [("cpu", True), ("cuda", False), ("tpu", False)])
def test_update_if_any_is_a_loop_on_cpus_and_a_cond_elsewhere(platform, loop):
    traced = jax.jit(lambda predicate, x: update_if_any(predicate, lambda v: v * 2.0, x)).trace(
        True, jnp.zeros(3, jnp.float32))
    program = traced.lower(lowering_platforms=(platform,)).as_text()
    assert ("stablehlo.while" in program) == loop


def test_pending_slots_are_taken_once_and_only_where_set():
    pool = ResetPool(obs=jnp.zeros((3, 1)), state=(jnp.array([10.0, 11.0, 12.0]), jnp.array([20, 21, 22])),
                     next_slot=jnp.asarray(3, jnp.int32), pending_slot=jnp.array([-1, 2, -1, 0], jnp.int32))
    state = (jnp.arange(4.0), jnp.arange(4))
    expected = ([0.0, 12.0, 2.0, 10.0], [0, 22, 2, 20])
    for take in (take_pending, take_slot_states):
        taken_pool, taken = jax.jit(take)(pool, state)
        for leaf, values in zip(taken, expected):
            np.testing.assert_array_equal(leaf, values)
        assert (np.asarray(taken_pool.pending_slot) == -1).all()
        again = jax.jit(take)(taken_pool, taken)[1]
        for leaf, values in zip(again, expected):
            np.testing.assert_array_equal(leaf, values)


@pytest.mark.parametrize("platform,branch", [("cpu", True), ("cuda", False), ("tpu", False)])
def test_pending_slots_are_taken_in_a_branch_on_cpus_and_at_every_step_elsewhere(platform, branch):
    pool = ResetPool(obs=jnp.zeros((3, 1)), state=jnp.zeros(3), next_slot=jnp.asarray(3, jnp.int32),
                     pending_slot=jnp.full((4,), -1, jnp.int32))
    program = jax.jit(take_pending).trace(pool, jnp.zeros(4)).lower(lowering_platforms=(platform,)).as_text()
    assert ("stablehlo.while" in program) == branch
    assert "stablehlo.gather" in program


def test_evaluation_steps_restart_nothing_and_match_the_resetting_steps_until_an_end():
    core = CountedResets(3, 3)
    env = BatchedEnv(core)
    key = jax.random.key(5)
    actions = jnp.zeros((NUM_ENVS,), jnp.int32)
    _, resetting = env.reset(key, NUM_ENVS)
    _, plain = env.reset(key, NUM_ENVS, auto_reset=False)
    assert plain.reset_pool is None
    core.resets = 0
    for index in range(4):
        step_key = jax.random.fold_in(key, index)
        resetting, restarted = env.step(step_key, resetting, actions)
        plain, result = env.step_without_reset(step_key, plain, actions)
        if index < 3:  # the same steps up to the end of the first episodes
            np.testing.assert_array_equal(result.final_obs, restarted.final_obs)
        if index < 2:
            np.testing.assert_array_equal(result.obs, restarted.obs)
    # The episodes ended on the third step: the plain environments stepped on past the end.
    np.testing.assert_array_equal(np.asarray(result.obs)[:, 0], np.full(NUM_ENVS, -1.0))
    assert core.resets == NUM_ENVS  # the resetting environments' one refill, none for the plain ones
    with pytest.raises(ValueError, match="no reset pool"):
        env.step(key, plain, actions)


def test_a_gymnax_game_steps_as_gymnax_steps_it_from_the_state_its_observation_shows():
    """Over many episodes of Asterix (its step draws enemies from the step key): each
    observation handed out is the one of the state the next step starts from, and each step
    is gymnax's own `step_env` from that state with the environment's step key."""
    env = make_env("Asterix-MinAtar")
    game, params = env.core.env, env.core.params
    num_envs, key = 16, jax.random.key(3)
    obs, state = env.reset(key, num_envs)
    step = jax.jit(env.step_with_keys)
    gymnax_step = jax.jit(jax.vmap(lambda k, s, a: game.step_env(k, s, a, params)))
    gymnax_obs = jax.jit(jax.vmap(game.get_obs))
    episodes_ended = 0
    for index in range(200):
        action_key, env_key = jax.random.split(jax.random.fold_in(key, index))
        actions = jax.random.randint(action_key, (num_envs,), 0, env.spec.num_actions)
        keys = jax.random.split(env_key, (num_envs, 2))
        _, starting = take_pending(state.reset_pool, state.env_state)
        np.testing.assert_array_equal(gymnax_obs(starting), obs)
        expected_obs, _, expected_reward, expected_end, _ = gymnax_step(keys[:, 0], starting, actions)
        state, result = step(keys, state, actions)
        np.testing.assert_array_equal(result.final_obs, expected_obs)
        np.testing.assert_array_equal(result.reward, expected_reward)
        np.testing.assert_array_equal(result.terminated, expected_end)
        episodes_ended += int(jnp.sum(result.terminated | result.truncated))
        obs = result.obs
    assert episodes_ended > 2 * num_envs
