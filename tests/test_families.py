"""Environment families behind `env.id=FAMILY:NAME`: the ids, the one-line errors, and per installed
family a few PPO updates of a two-seed sweep: exact after a checkpoint, a member the same as its
single run on 4 devices (logical shards); a run with observation normalisation whose evaluation
is finite and whose policy loads."""

import importlib.util

import jax
import numpy as np
import pytest
from conftest import FAMILY_IDS, family_installed, host_leaves

from jaxddppo.config.files import from_dict
from jaxddppo.config.options import ConfigError
from jaxddppo.envs import FAMILIES, available_env_ids, make_env, split_env_id
from jaxddppo.outputs.policy import load_policy
from jaxddppo.train import run
from jaxddppo.training.checkpoint import Checkpointer, RunCounters
from jaxddppo.training.experiment import Experiment, build, update_count
from jaxddppo.training.population import build_population


def test_a_bare_id_is_gymnax_and_a_prefixed_id_names_its_family():
    assert split_env_id("CartPole-v1") == ("gymnax", "CartPole-v1")
    assert split_env_id("navix:Navix-Empty-5x5-v0") == ("navix", "Navix-Empty-5x5-v0")
    assert make_env("gymnax:CartPole-v1").spec.obs_shape == make_env("CartPole-v1").spec.obs_shape == (4,)


def test_an_unknown_family_lists_the_families():
    with pytest.raises(ConfigError) as excinfo:
        make_env("gymnaz:CartPole-v1")
    message = str(excinfo.value)
    assert "'gymnaz'" in message and all(family in message for family in FAMILIES)


@pytest.mark.parametrize("family", [name for name in FAMILIES if name != "gymnax"])
def test_a_family_without_its_extra_names_the_extra_to_install(family, monkeypatch):
    package = FAMILIES[family].package
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == package else real_find_spec(name, *args))
    with pytest.raises(ConfigError, match=rf"needs the {family} extra: pip install 'jaxddppo\[{family}\]'"):
        make_env(f"{family}:Anything")


@pytest.mark.parametrize("family", [name for name in FAMILIES if name != "gymnax"])
def test_an_unknown_name_lists_the_family_s_valid_names(family):
    if not family_installed(family):
        pytest.skip(f"the {family} extra is not installed")
    valid = available_env_ids(family)
    assert valid and all(env_id.startswith(f"{family}:") for env_id in valid)
    with pytest.raises(ConfigError) as excinfo:
        make_env(f"{family}:No-Such-Env-v0")
    message = str(excinfo.value)
    assert "No-Such-Env-v0" in message and valid[0].split(":", 1)[1] in message


def smoke_config(env_id: str):
    """2 PPO updates of 4 logical shards of 1 env each, a small network."""
    return from_dict({
        "env": {"id": env_id, "num_envs": 4},
        "ppo": {"num_steps": 8, "num_epochs": 1, "num_minibatches": 2},
        "train": {"total_env_steps": 64, "updates_per_chunk": 2, "num_shards": 4},
        "network": {"hidden_sizes": [16]},
    })


def two_updates(experiment: Experiment, checkpoint_dir=None) -> tuple[list[np.ndarray], dict]:
    """Parameters and metrics after 2 updates (leaves [members,] shards, ...); with `checkpoint_dir`,
    the state after them goes through a checkpoint, and 2 more updates from the restored state must
    equal 2 more from the state itself, bit for bit (environment states included)."""
    state, inputs = experiment.init_state(), experiment.shard_inputs()
    learn = experiment.learn_fn()
    state, metrics, finite = learn(state, inputs, update_count(experiment.mesh, 2))
    assert bool(np.all(finite)), experiment.config.env.id
    params = host_leaves(state.params)
    if checkpoint_dir is not None:
        checkpointer = Checkpointer(str(checkpoint_dir), asynchronous=False)
        checkpointer.save(state, RunCounters(update=2, env_steps=32, train_seconds=0.0,
                                             final_episode_returns=(None,) * len(experiment.members)))
        restored, _ = checkpointer.restore(2, experiment.abstract_state())
        checkpointer.close()
        resumed, _, _ = learn(restored, inputs, update_count(experiment.mesh, 2))  # learn donates its state
        continued, _, _ = learn(state, inputs, update_count(experiment.mesh, 2))
        for a, b in zip(host_leaves(continued), host_leaves(resumed)):
            np.testing.assert_array_equal(a, b)
    return params, jax.tree.map(np.asarray, metrics)


@pytest.mark.parametrize("family", sorted(FAMILY_IDS))
def test_ppo_updates_are_finite_as_a_sweep_member_resume_exactly_and_match_four_devices(family, tmp_path):
    """Seeds 0 and 1 as a sweep on one device; member 0 matches the run of seed 0 on 4 devices."""
    if not family_installed(family):
        pytest.skip(f"the {family} extra is not installed")
    config = smoke_config(FAMILY_IDS[family])
    members, metrics = two_updates(build_population(config, {"train.seed": [0, 1]}, devices=jax.devices()[:1]),
                                   checkpoint_dir=tmp_path)
    four_devices, _ = two_updates(build(config, jax.devices()[:4]))
    assert np.isfinite(metrics.policy_loss).all() and np.isfinite(metrics.value_loss).all()
    for member, single in zip(members, four_devices):
        np.testing.assert_allclose(member[0], single, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(members[-1][1], members[-1][0])


@pytest.mark.slow  # about 45 s per family; the sweep-member smoke above runs each installed family in CI
@pytest.mark.parametrize("family", sorted(FAMILY_IDS))
def test_a_normalising_run_evaluates_and_its_policy_loads_and_acts_legally(family, tmp_path):
    if not family_installed(family):
        pytest.skip(f"the {family} extra is not installed")
    result = run(from_dict({
        "env": {"id": FAMILY_IDS[family], "num_envs": 4, "normalize_observations": True},
        "ppo": {"num_steps": 8, "num_epochs": 1, "num_minibatches": 2},
        "train": {"total_env_steps": 64, "updates_per_chunk": 2, "num_shards": 2},
        "network": {"hidden_sizes": [16]},
        "eval": {"num_episodes": 2},
        "run": {"dir": str(tmp_path / "run"), "progress": False},
    }), devices=jax.devices()[:2])
    assert np.isfinite(result.summary["eval_return_mean"])
    policy = load_policy(result.run_dir)
    assert policy.counters.update == 2 and policy.obs_moments is not None
    obs, _ = policy.env.reset(jax.random.key(1), 5)
    actions = np.asarray(policy(obs))
    spec = policy.env.spec
    if not spec.discrete:  # the environment clips continuous actions into its bounds
        assert actions.shape == (5, spec.num_actions) and np.isfinite(actions).all()
        return
    assert actions.shape == (5,) and ((0 <= actions) & (actions < spec.num_actions)).all()
    mask_key = spec.action_mask_key
    if mask_key is not None:
        assert np.asarray(obs[mask_key])[np.arange(5), actions].all()
