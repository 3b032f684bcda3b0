"""Dict observations and legal-action masks, end to end, on a synthetic environment.

* A rollout never takes an illegal action, and illegal actions have probability 0.
* The masked categorical's log-probabilities, entropy and mode against NumPy float64.
* Per-leaf observation moments against NumPy float64; the bool mask is never normalised.
* PPO updates (feed-forward and recurrent) train finite, and the same config with
  train.num_shards=2 learns the same on 1 and 2 simulated devices; the state with
  pytree moments survives a checkpoint, and evaluation acts on dict observations.
* A mask over continuous actions, or a malformed one, is refused with one line.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import host_leaves

from jaxddppo import sharding
from jaxddppo.config.files import from_dict
from jaxddppo.config.options import ConfigError, NetworkConfig
from jaxddppo.distributed import global_arrays
from jaxddppo.envs import BatchedEnv, EnvSpec
from jaxddppo.envs.base import observation_spec
from jaxddppo.networks import Categorical, make_actor_critic
from jaxddppo.rollout import (
    OBS_CLIP,
    RolloutState,
    collect_rollout,
    init_observation_moments,
    normalize,
    update_moments,
)
from jaxddppo.outputs.env_spec import ENV_SPEC_FILE, env_spec_record, read_env_spec
from jaxddppo.outputs.policy import load_policy
from jaxddppo.outputs.run_dir import write_config, write_env_spec
from jaxddppo.training.checkpoint import Checkpointer, RunCounters
from jaxddppo.training.experiment import build, update_count

NUM_ACTIONS, NUM_POSITIONS, TIME_LIMIT = 4, 10, 12


def legal_actions(position: jax.Array) -> jax.Array:
    """[NUM_ACTIONS] bool: action a is legal where (position + a) % 3 != 0 (two or three of four)."""
    return (position + jnp.arange(NUM_ACTIONS)) % 3 != 0


class MaskedWalk:
    """A walk on a ring of NUM_POSITIONS cells whose legal actions change with the position.

    Action a moves a + 1 cells and pays 1 if a is the highest legal action; reaching
    cell 5 terminates, TIME_LIMIT steps truncate. Observation: an image [5, 5, 3]
    lit at the position, a vector [4] (position, time, noise, 1) and the mask.
    """

    def __init__(self):
        self.spec = EnvSpec(env_id="masked-walk", observation=observation_spec(self.reset), discrete=True,
                            num_actions=NUM_ACTIONS, max_episode_steps=TIME_LIMIT, action_mask_key="action_mask")

    def observe(self, key, position, time):
        image = jnp.zeros((5, 5, 3)).at[position // 5, position % 5].set(1.0) + 0.1 * time
        vector = jnp.stack([position * 1.0, time * 1.0, jax.random.normal(key), 1.0])
        return {"image": image, "vector": vector, "action_mask": legal_actions(position)}

    def reset(self, key):
        position = jax.random.randint(key, (), 0, NUM_POSITIONS)
        state = {"position": position, "time": jnp.zeros((), jnp.int32)}
        return self.observe(key, position, state["time"]), state

    def step(self, key, state, action):
        legal = legal_actions(state["position"])
        best = NUM_ACTIONS - 1 - jnp.argmax(legal[::-1])
        position = (state["position"] + action + 1) % NUM_POSITIONS
        time = state["time"] + 1
        reward = jnp.where(action == best, 1.0, 0.0)
        new_state = {"position": position, "time": time}
        return self.observe(key, position, time), new_state, reward, position == 5, time >= TIME_LIMIT


def tiny_network(**overrides) -> NetworkConfig:
    return NetworkConfig(hidden_sizes=(8,), cnn_channels=(2,), **overrides)


def every_log_prob(dist: Categorical, batch_shape: tuple[int, ...]) -> jax.Array:
    """[*batch_shape, NUM_ACTIONS]: the log-probability of every action."""
    return jax.vmap(lambda action: dist.log_prob(jnp.full(batch_shape, action)), out_axes=-1)(jnp.arange(NUM_ACTIONS))


def test_a_rollout_never_takes_an_illegal_action():
    env = BatchedEnv(MaskedWalk())
    network = make_actor_critic(tiny_network(), env.spec)
    num_envs, num_steps = 16, 48

    @jax.jit
    def rollout(key):
        obs, env_state = env.reset(jax.random.fold_in(key, 0), num_envs)
        params = network.init(jax.random.fold_in(key, 1), obs)
        _, transitions, _ = collect_rollout(env, network.step, params, RolloutState(env_state, obs),
                                            jax.random.fold_in(key, 2), num_steps)
        dist, _ = network.apply(params, transitions.obs)  # as the PPO loss computes it
        return transitions, jnp.exp(every_log_prob(dist, transitions.action.shape))

    transitions, probabilities = rollout(jax.random.key(0))
    mask = np.asarray(transitions.obs["action_mask"])
    taken = np.take_along_axis(mask, np.asarray(transitions.action)[..., None], axis=-1)[..., 0]
    assert taken.all(), f"{np.sum(~taken)} illegal actions of {taken.size}"
    assert not mask.all(), "the environment offers illegal actions"
    assert len(np.unique(np.asarray(transitions.action))) == NUM_ACTIONS
    assert np.all(np.asarray(transitions.log_prob) > -10.0)
    probabilities = np.asarray(probabilities)
    assert np.all(probabilities[~mask] == 0.0)
    np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-5)
    assert np.asarray(transitions.terminated).any() and np.asarray(transitions.truncated).any()


def numpy_masked_categorical(logits: np.ndarray, legal: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 log-probabilities (-inf where illegal), entropy and mode of the legal actions."""
    masked = np.where(legal, np.asarray(logits, np.float64), -np.inf)
    top = masked.max(-1, keepdims=True)
    log_probs = masked - top - np.log(np.sum(np.exp(masked - top), -1, keepdims=True))
    entropy = -np.sum(np.exp(log_probs) * np.where(legal, log_probs, 0.0), -1)
    return log_probs, entropy, np.argmax(masked, -1)


def test_masked_categorical_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 3.0, size=(64, NUM_ACTIONS)).astype(np.float32)
    legal = rng.random((64, NUM_ACTIONS)) < 0.5
    legal[np.arange(64), rng.integers(0, NUM_ACTIONS, 64)] = True  # at least one legal action
    legal[0] = [False, False, False, True]  # one legal action: entropy 0
    assert not legal[np.arange(64), logits.argmax(-1)].all(), "some unmasked modes are illegal"
    log_probs, entropy, mode = numpy_masked_categorical(logits, legal)

    def stats(logits):
        dist = Categorical.masked(logits, jnp.asarray(legal))
        return every_log_prob(dist, (64,)), dist.entropy(), dist.mode()

    got_log_probs, got_entropy, got_mode = jax.jit(stats)(jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(got_log_probs)[legal], log_probs[legal], rtol=1e-5, atol=1e-6)
    assert np.all(np.exp(np.asarray(got_log_probs)[~legal]) == 0.0)
    np.testing.assert_allclose(got_entropy, entropy, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_mode, mode)
    dist = Categorical.masked(jnp.asarray(logits), jnp.asarray(legal))
    samples = np.asarray(jax.vmap(dist.sample)(jax.random.split(jax.random.key(1), 100)))  # [100, 64]
    assert legal[np.arange(64), samples].all()

    def objective(x):
        log_probs, entropy, _ = stats(x)
        return jnp.sum(entropy) + jnp.sum(jnp.where(legal, log_probs, 0.0))

    gradient = np.asarray(jax.grad(objective)(jnp.asarray(logits)))
    assert np.isfinite(gradient).all() and np.all(gradient[~legal] == 0.0)


def test_observation_moments_are_per_leaf_and_leave_the_mask_alone():
    spec = MaskedWalk().spec.observation
    rng = np.random.default_rng(2)
    batches = [{"image": rng.normal(2.0, 3.0, (2, 6, 5, 5, 3)).astype(np.float32),
                "vector": rng.normal(-1.0, 0.5, (2, 6, 4)).astype(np.float32),
                "action_mask": rng.random((2, 6, NUM_ACTIONS)) < 0.5} for _ in range(2)]
    mesh = sharding.make_mesh(jax.devices()[:2])

    def per_device(samples):
        moments = init_observation_moments(spec)
        for batch in samples:
            moments = update_moments(moments, batch, sharding.DeviceShards())
        return moments, normalize(moments, samples[-1])

    program = sharding.shard_parallel(per_device, mesh, out_layouts=(sharding.PER_MEMBER, sharding.PER_SHARD))
    moments, normalised = program(batches)
    moments, normalised = global_arrays.local_copy(moments), global_arrays.first_shard(normalised)
    assert moments.mean["action_mask"] is None and moments.m2["action_mask"] is None
    assert float(moments.count) == 24
    for name in ("image", "vector"):
        samples = np.concatenate([batch[name].reshape((12,) + batch[name].shape[2:]) for batch in batches])
        samples = samples.astype(np.float64)
        np.testing.assert_allclose(moments.mean[name], samples.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(moments.variance[name], samples.var(0), rtol=1e-5)
        expected = np.clip((batches[-1][name][0] - samples.mean(0)) / np.sqrt(samples.var(0) + 1e-8),
                           -OBS_CLIP, OBS_CLIP)
        np.testing.assert_allclose(normalised[name], expected, rtol=1e-4, atol=1e-5)
    assert normalised["action_mask"].dtype == np.bool_
    np.testing.assert_array_equal(normalised["action_mask"], batches[-1]["action_mask"][0])


def walk_experiment(num_devices: int, **network):
    config = from_dict({
        "env": {"num_envs": 8, "normalize_observations": True},
        "network": {"hidden_sizes": [8], "cnn_channels": [2], **network},
        "ppo": {"num_steps": 8, "num_epochs": 2, "num_minibatches": 2, "learning_rate": 1e-3},
        "train": {"num_shards": 2, "total_env_steps": 8 * 8 * 3, "updates_per_chunk": 3},
        "eval": {"num_episodes": 4},
    })
    core = MaskedWalk()
    experiment = build(config, jax.devices()[:num_devices])
    return dataclasses.replace(experiment, env=BatchedEnv(core), network=make_actor_critic(config.network, core.spec))


def learn(experiment):
    """Three updates in one chunk: the initial parameters (shard 0, on the host) and the final state."""
    state = experiment.init_state()
    initial_params = global_arrays.local_copy(state.params)
    count = update_count(experiment.mesh, 3)
    state, metrics, finite = experiment.learn_fn()(state, experiment.shard_inputs(), count)
    assert np.all(np.asarray(finite))
    assert np.isfinite(np.asarray(metrics.policy_loss)).all() and np.isfinite(np.asarray(metrics.entropy)).all()
    return initial_params, state


def relative_l2(tree_a, tree_b) -> float:
    a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree_a)])
    b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree_b)])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def trained_on_one_and_two_devices():
    """(experiment, initial parameters, state after three updates) on 1 and 2 devices."""
    experiments = {num_devices: walk_experiment(num_devices) for num_devices in (1, 2)}
    return {num_devices: (experiment, *learn(experiment)) for num_devices, experiment in experiments.items()}


def test_training_on_dict_observations_is_the_same_on_one_and_two_devices(trained_on_one_and_two_devices):
    _, initial, one = trained_on_one_and_two_devices[1]
    _, _, two = trained_on_one_and_two_devices[2]
    assert relative_l2(global_arrays.local_copy(one.params), initial) > 1e-4
    assert relative_l2(global_arrays.local_copy(two.params), global_arrays.local_copy(one.params)) < 1e-6
    moments = global_arrays.local_copy(one.obs_moments)
    assert moments.mean["action_mask"] is None and moments.mean["image"].shape == (5, 5, 3)
    assert float(moments.count) == 8 * 8 * 3
    params = global_arrays.local_copy(one.params)["params"]["actor_torso"]
    assert set(params) == {"Conv_0", "Dense_0"}
    assert params["Dense_0"]["kernel"].shape == (8, 3 * 3 * 2 + 4)  # [out, in]: CNN features, then the vector


def test_a_dict_observation_state_checkpoints_and_evaluates(trained_on_one_and_two_devices, tmp_path):
    experiment, _, state = trained_on_one_and_two_devices[2]
    checkpointer = Checkpointer(str(tmp_path), asynchronous=False)
    try:
        checkpointer.save(state, RunCounters(update=3, env_steps=192, train_seconds=1.0,
                                             final_episode_returns=(None,)))
        restored, _ = checkpointer.restore(3, experiment.abstract_state())
    finally:
        checkpointer.close()
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(host_leaves(restored), host_leaves(state), strict=True):
        np.testing.assert_array_equal(got, want)
    evaluation = experiment.final_evaluations(restored)[0]
    assert np.isfinite(np.asarray(evaluation.returns)).all()
    assert np.all(np.asarray(evaluation.lengths) >= 1)


def test_a_dict_observation_policy_loads_from_config_and_env_spec_alone(trained_on_one_and_two_devices, tmp_path):
    """config.yaml names CartPole-v1 (`walk_experiment` swaps in MaskedWalk), so only
    env_spec.json can give the network its observations: no environment is built."""
    experiment, _, state = trained_on_one_and_two_devices[2]
    checkpointer = Checkpointer(str(tmp_path), asynchronous=False)
    try:
        checkpointer.save(state, RunCounters(update=3, env_steps=192, train_seconds=1.0,
                                             final_episode_returns=(None,)))
    finally:
        checkpointer.close()
    write_config(str(tmp_path), experiment.config)
    write_env_spec(str(tmp_path), env_spec_record(experiment.env.spec))
    policy = load_policy(str(tmp_path))
    assert policy.spec == MaskedWalk().spec and policy.counters.update == 3
    trained = global_arrays.local_copy((state.params, state.obs_moments))
    assert jax.tree.structure((policy.params, policy.obs_moments)) == jax.tree.structure(trained)
    for got, want in zip(jax.tree.leaves((policy.params, policy.obs_moments)), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(got, want)
    obs, _ = experiment.env.reset(jax.random.key(5), 16)
    dist, _ = experiment.network.apply(trained[0], normalize(trained[1], obs))
    np.testing.assert_array_equal(np.asarray(policy(obs)), np.asarray(dist.mode()))


def test_env_spec_json_records_pytree_observations_and_continuous_actions_exactly(tmp_path):
    reach = EnvSpec(
        env_id="reach",
        observation=({"joints": jax.ShapeDtypeStruct((7,), jnp.float32),
                      "camera": jax.ShapeDtypeStruct((8, 8, 3), jnp.bfloat16)}, jax.ShapeDtypeStruct((), jnp.float32)),
        discrete=False, num_actions=3, action_low=(-1.0, -0.1, -math.inf), action_high=(1.0, 1e-7, 2.5),
    )
    for spec in (MaskedWalk().spec, reach):
        write_env_spec(str(tmp_path), env_spec_record(spec))
        assert read_env_spec(str(tmp_path)) == spec
    written = json.loads((tmp_path / ENV_SPEC_FILE).read_text())
    assert written["observation"] == [{"joints": "float32[7]", "camera": "bfloat16[8, 8, 3]"}, "float32[]"]
    assert (written["discrete"], written["num_actions"], written["action_high"]) == (False, 3, [1.0, 1e-7, 2.5])
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("text, problem", [
    ("{", "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ('{"observation": "float32[4]"}', "KeyError: 'action_low'"),
    ('{"observation": "float32(4)", "action_low": [], "action_high": []}',
     "ValueError: observation leaf 'float32(4)' is not dtype[shape]"),
])
def test_a_malformed_env_spec_json_is_one_line(tmp_path, text, problem):
    (tmp_path / ENV_SPEC_FILE).write_text(text)
    with pytest.raises(ConfigError) as error:
        read_env_spec(str(tmp_path))
    assert str(error.value) == f"{tmp_path / ENV_SPEC_FILE} is malformed: {problem}"


Position = collections.namedtuple("Position", ["x", "y"])


@pytest.mark.parametrize("observation", [
    [jax.ShapeDtypeStruct((3,), jnp.float32)],
    Position(*[jax.ShapeDtypeStruct((3,), jnp.float32)] * 2),
    {"nested": {1: jax.ShapeDtypeStruct((3,), jnp.float32)}},
])
def test_an_observation_env_spec_json_cannot_hold_is_not_recorded(observation):
    """Such a run writes no env_spec.json, and loading its policy builds the environment."""
    assert env_spec_record(EnvSpec(env_id="odd", observation=observation, discrete=True, num_actions=2)) is None


@pytest.mark.slow  # about 35 s; dict observations train in CI, recurrent policies in test_recurrent.py
def test_a_recurrent_policy_trains_on_dict_observations():
    experiment = walk_experiment(1, recurrent="gru", recurrent_size=8, torso="mlp", shared_torso=True)
    initial, state = learn(experiment)
    assert relative_l2(global_arrays.local_copy(state.params), initial) > 1e-4


def masked_spec(**changes) -> EnvSpec:
    observation = {"vector": jax.ShapeDtypeStruct((3,), jnp.float32),
                   "action_mask": jax.ShapeDtypeStruct((2,), jnp.bool_)}
    fields = {"env_id": "masked", "observation": observation, "discrete": True, "num_actions": 2,
              "action_mask_key": "action_mask"}
    return EnvSpec(**{**fields, **changes})


@pytest.mark.parametrize("changes, message", [
    ({"discrete": False, "action_low": (-1.0, -1.0), "action_high": (1.0, 1.0)},
     re.escape("env.id='masked' gives an action mask (observation['action_mask']) but its actions are continuous")),
    ({"num_actions": 3}, r"observation\['action_mask'\] must be a bool \[3\] leaf"),
    ({"action_mask_key": "legal"}, r"observation\['legal'\] must be a bool \[2\] leaf"),
    ({"observation": {"vector": jax.ShapeDtypeStruct((3,), jnp.float32),
                      "action_mask": jax.ShapeDtypeStruct((2,), jnp.float32)}}, "must be a bool"),
])
def test_impossible_masks_are_refused_in_one_line(changes, message):
    with pytest.raises(ConfigError, match=message) as error:
        make_actor_critic(NetworkConfig(), masked_spec(**changes))
    assert "\n" not in str(error.value)


def test_a_cnn_torso_needs_an_image_leaf():
    with pytest.raises(ConfigError, match=r"network.torso='cnn' needs image observations .* \{'vector': \(3,\)\}"):
        make_actor_critic(NetworkConfig(torso="cnn"), masked_spec())
