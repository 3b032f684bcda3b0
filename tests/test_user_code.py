"""A user's own environment and torso, named by `module:attribute` or passed as objects, get
what a built-in environment gets: the same bits as the built-in id, on any device count,
across a stop and resume, in a sweep, in a fresh evaluation process, over two processes,
and never a stale compiled program. (Bad references: tests/test_user_code_errors.py.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env

from jaxddppo.config.files import from_dict, load_resume_config
from jaxddppo.config.options import ConfigError
from jaxddppo.envs import make_core
from jaxddppo.networks import make_actor_critic, unroll
from jaxddppo.outputs.policy import load_policy
from jaxddppo.references import UserObjects, with_objects
from jaxddppo.sweep import run_sweep
from jaxddppo.train import run
from jaxddppo.training.population import split_overrides

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULE = "jaxddppo_test_user_code"
GYMNAX_CARTPOLE = "gymnax.environments.classic_control.cartpole:CartPole"

# A user's file: gymnax's CartPole in every accepted form, an EnvCore of its own (a corridor
# with a dict observation and an action mask, its length a keyword argument) and a torso.
USER_MODULE = '''
import flax.linen as nn
import jax
import jax.numpy as jnp
from gymnax.environments.classic_control.cartpole import CartPole

from jaxddppo.envs import EnvSpec, observation_spec

REWARD = 1.0
CARTPOLE = CartPole()


def cartpole():
    return CartPole()


def cartpole_with_params(max_steps=500):
    env = CartPole()
    return env, env.default_params.replace(max_steps_in_episode=max_steps)


class Corridor:
    """Walk right from cell 0 to the last cell (reward REWARD, terminated); left is masked at cell 0."""

    def __init__(self, length=5, max_steps=20):
        self.length, self.max_steps = length, max_steps
        self.spec = EnvSpec(env_id="corridor", observation=observation_spec(self.reset), discrete=True,
                            num_actions=2, max_episode_steps=max_steps, action_mask_key="legal")

    def _observe(self, cell):
        return {"cell": jax.nn.one_hot(cell, self.length), "legal": jnp.stack([cell > 0, jnp.bool_(True)])}

    def reset(self, key):
        cell = jax.random.randint(key, (), 0, self.length - 1)
        return self._observe(cell), (cell, jnp.int32(0))

    def step(self, key, state, action):
        cell, steps = state
        cell = jnp.clip(cell + 2 * action - 1, 0, self.length - 1)
        steps = steps + 1
        terminated = cell == self.length - 1
        truncated = steps >= self.max_steps
        reward = jnp.where(terminated, REWARD, 0.0)
        return self._observe(cell), (cell, steps), reward, terminated, truncated


class Torso(nn.Module):
    features: int = 16

    @nn.compact
    def __call__(self, observations):
        leaves = jax.tree.leaves(observations)
        assert all(leaf.ndim >= 2 for leaf in leaves) and len({leaf.shape[0] for leaf in leaves}) == 1
        x = jnp.concatenate([leaf.reshape(leaf.shape[0], -1) for leaf in leaves], axis=-1)
        return nn.LayerNorm()(jnp.tanh(nn.Dense(self.features)(x)))
'''

TINY = {
    "env": {"num_envs": 4},
    "ppo": {"num_steps": 8, "num_minibatches": 2, "num_epochs": 2},
    "network": {"hidden_sizes": [16]},
    "train": {"total_env_steps": 4 * 8 * 4, "updates_per_chunk": 2, "num_shards": 2},
    "eval": {"num_episodes": 2},
    "checkpoint": {"every_seconds": 0},
    "run": {"progress": False},
}
CORRIDOR = {"id": f"{MODULE}:Corridor", "kwargs": {"length": 6}}
TORSO = {"torso": f"{MODULE}:Torso", "torso_kwargs": {"features": 8}}


def tiny(run_dir: Path, **sections: dict):
    values = {name: dict(section) for name, section in TINY.items()}
    for name, section in sections.items():
        values.setdefault(name, {}).update(section)
    values["run"]["dir"] = str(run_dir)
    return from_dict(values)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """The directory of the user's module, importable for this test process and its subprocesses' cwd."""
    directory = tmp_path_factory.mktemp("user_code")
    (directory / f"{MODULE}.py").write_text(USER_MODULE)
    sys.path.insert(0, str(directory))
    yield directory
    sys.path.remove(str(directory))
    sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def one_go(user_dir, tmp_path_factory):
    """The user's corridor and torso, 4 updates in 2 shards on 2 devices, in one go."""
    run_dir = tmp_path_factory.mktemp("one_go") / "run"
    return run(tiny(run_dir, env=CORRIDOR, network=TORSO), devices=jax.devices()[:2])


def core_outputs(core) -> list[np.ndarray]:
    key = jax.random.key(3)
    obs, state = core.reset(key)
    outputs = [obs, core.step(key, state, jnp.int32(1))]
    return [np.asarray(leaf) for leaf in jax.tree.leaves(outputs)]


@pytest.mark.parametrize("reference", [GYMNAX_CARTPOLE, f"{MODULE}:CARTPOLE", f"{MODULE}:cartpole",
                                       f"{MODULE}:cartpole_with_params"])
def test_every_form_of_a_gymnax_environment_steps_as_the_built_in_id(user_dir, reference):
    built_in, referenced = make_core("CartPole-v1"), make_core(reference)
    assert replace(referenced.spec, env_id="CartPole-v1") == built_in.spec
    for ours, theirs in zip(core_outputs(referenced), core_outputs(built_in), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_env_kwargs_reach_the_factory(user_dir):
    assert make_core(f"{MODULE}:cartpole_with_params", {"max_steps": 50}).spec.max_episode_steps == 50
    config = from_dict({"env": {"id": f"{MODULE}:Corridor", "kwargs": {"length": 9, "max_steps": 7}}})
    spec = make_core(config.env.id, config.env.kwargs).spec
    assert (spec.observation["cell"].shape, spec.max_episode_steps) == ((9,), 7)


def test_a_referenced_environment_trains_to_the_built_in_id_s_parameters(tmp_path):
    built_in = run(tiny(tmp_path / "built_in"), devices=jax.devices()[:2])
    referenced = run(tiny(tmp_path / "referenced", env={"id": GYMNAX_CARTPOLE}), devices=jax.devices()[:2])
    assert referenced.summary["params_digest"] == built_in.summary["params_digest"]
    assert referenced.summary["eval_return_mean"] == built_in.summary["eval_return_mean"]


def test_the_user_s_environment_and_torso_learn_the_same_bits_on_one_and_two_devices(one_go, tmp_path):
    params = one_go.state.params["params"]
    assert {"actor_torso", "critic_torso"} <= set(params) and "LayerNorm_0" in params["actor_torso"]
    assert params["actor_torso"]["Dense_0"]["kernel"].shape[-1] == 8  # torso_kwargs reached the torso
    alone = run(tiny(tmp_path / "one_device", env=CORRIDOR, network=TORSO), devices=jax.devices()[:1])
    assert alone.summary["params_digest"] == one_go.summary["params_digest"]


def test_a_stopped_run_resumes_to_the_same_bits(one_go, tmp_path):
    config = tiny(tmp_path / "resumed", env=CORRIDOR, network=TORSO)
    stopped = run(config, devices=jax.devices()[:2], stop_after_updates=2)
    assert stopped.stopped_by == "stop_after_updates"
    resumed = run(config, devices=jax.devices()[:2], resume=True)
    assert resumed.summary["params_digest"] == one_go.summary["params_digest"]


def test_a_shared_torso_feeds_a_recurrent_core_over_a_sequence(user_dir):
    config = from_dict({"env": CORRIDOR, "network": {**TORSO, "shared_torso": True, "recurrent": "gru",
                                                     "recurrent_size": 8}})
    spec = make_core(config.env.id, config.env.kwargs).spec
    network = make_actor_critic(config.network, spec)
    obs = jax.tree.map(lambda leaf: jnp.zeros((3, 5, *leaf.shape), leaf.dtype), spec.observation)  # [T, B, ...]
    params = network.init(jax.random.key(0), jax.tree.map(lambda leaf: leaf[0], obs))
    assert set(params["params"]) == {"torso", "torso_core", "Dense_0", "Dense_1"}
    carry, dist, value = unroll(network, params, network.initial_carry(5), obs, jnp.zeros((3, 5), bool))
    assert dist.logits.shape == (3, 5, 2) and value.shape == (3, 5) and carry[0].shape == (5, 8)


def test_a_sweep_trains_every_member_on_the_user_s_code(user_dir, tmp_path):
    result = run_sweep(tiny(tmp_path / "sweep", env=CORRIDOR, network=TORSO), seeds=2)
    digests = [row["params_digest"] for row in result.members]
    assert len(set(digests)) == 2


def test_an_object_without_a_reference_is_recorded_and_must_be_passed_again(user_dir, tmp_path):
    import jaxddppo_test_user_code as user

    class NotebookTorso(nn.Module):  # defined in a function: no importable reference
        @nn.compact
        def __call__(self, observations):
            return jnp.tanh(nn.Dense(4)(observations["cell"]))

    corridor = user.Corridor(length=4)
    run_dir = tmp_path / "objects"
    result = run(tiny(run_dir), devices=jax.devices()[:2], env=corridor, torso=NotebookTorso)
    recorded = (run_dir / "config.yaml").read_text()
    assert "id: <object>:Corridor" in recorded and "torso: <object>:test_an_object" in recorded

    with pytest.raises(ConfigError, match=r"network.torso='<object>:.*NotebookTorso'.*pass the same object again"):
        load_policy(str(run_dir))
    acting = load_policy(str(run_dir), torso=NotebookTorso)  # acting needs no environment; episodes do
    with pytest.raises(ConfigError, match=r"env.id='<object>:Corridor' .*pass the same object again as env="):
        acting.env
    policy = load_policy(str(run_dir), env=corridor, torso=NotebookTorso)
    assert policy.env.spec == acting.spec
    assert np.all(np.asarray(policy.params["params"]["actor_torso"]["Dense_0"]["kernel"])
                  == np.asarray(result.state.params["params"]["actor_torso"]["Dense_0"]["kernel"]))
    assert (run_dir / "config.yaml").read_text() == recorded

    # A class of an importable module is recorded by its reference, which needs no object later.
    recorded, objects = with_objects(tiny(tmp_path / "by_class"), env=user.Corridor, torso=user.Torso)
    assert (recorded.env.id, recorded.network.torso) == (f"{MODULE}:Corridor", f"{MODULE}:Torso")
    assert objects == UserObjects(user.Corridor, user.Torso)


def test_an_instance_given_for_a_run_from_a_config_with_kwargs_drops_them(user_dir):
    import jaxddppo_test_user_code as user

    config = from_dict({"env": CORRIDOR, "network": TORSO})
    recorded, _ = with_objects(config, env=user.Corridor(length=6), torso=user.Torso(features=8))
    assert (recorded.env.kwargs, recorded.network.torso_kwargs) == ({}, {})
    kept, _ = with_objects(config, env=user.Corridor, torso=user.Torso)
    assert (kept.env.kwargs, kept.network.torso_kwargs) == ({"length": 6}, {"features": 8})


def test_a_resume_refuses_a_keyword_argument_the_run_did_not_have(one_go):
    with pytest.raises(ConfigError, match=r"env.kwargs.max_steps=9 cannot change on resume \(the run has None\)"):
        load_resume_config(one_go.run_dir, ["env.kwargs.max_steps=9"])


def test_a_sweep_takes_a_list_valued_keyword_argument_as_its_value():
    plain, grid = split_overrides(["network.torso_kwargs.features=[64,64]", "env.kwargs.sizes=[3,5]",
                                   "ppo.learning_rate=[1e-3,3e-4]"])
    assert plain == ["network.torso_kwargs.features=[64,64]", "env.kwargs.sizes=[3,5]"]
    assert list(grid) == ["ppo.learning_rate"]


def test_evaluate_in_a_fresh_process_reproduces_the_final_evaluation(one_go, user_dir):
    evaluated = subprocess.run([sys.executable, "-m", "jaxddppo.evaluate", one_go.run_dir, "--json"], cwd=user_dir,
                               env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["return_mean"] == one_go.summary["eval_return_mean"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def command_line(values: dict) -> list[str]:
    """`values` (a nested dict of options) as section.key=value overrides."""
    flat = []
    for section, options in values.items():
        for key, value in options.items():
            if isinstance(value, dict):
                flat += [f"{section}.{key}.{name}={item}" for name, item in value.items()]
            elif isinstance(value, list):
                flat.append(f"{section}.{key}=[{','.join(map(str, value))}]")
            else:
                flat.append(f"{section}.{key}={value}")
    return flat


@pytest.mark.slow  # the CI suite's two-process run names gymnax's CartPole by reference (tests/test_multihost.py)
def test_two_processes_each_import_the_user_s_module(one_go, user_dir, tmp_path):
    port = free_port()
    overrides = command_line({**TINY, "env": {**TINY["env"], **CORRIDOR}, "network": {**TINY["network"], **TORSO}})
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxddppo.train", *overrides, f"run.dir={tmp_path / 'multi'}", "run.cpu_devices=1",
             f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
             f"distributed.process_id={process_id}", "distributed.init_timeout=120"],
            cwd=user_dir, env=subprocess_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for process_id in range(2)
    ]
    try:
        outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    from test_multihost import exit_code

    for worker, output in zip(workers, outputs):
        assert exit_code(worker.returncode, output) == 0, output
    summary = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert (summary["num_processes"], summary["num_shards"]) == (2, 2)
    assert summary["params_digest"] == one_go.summary["params_digest"]


@pytest.mark.slow  # two trainings that compile in processes of their own; JAX keys its cache by the program
def test_the_compilation_cache_never_serves_a_program_of_an_older_version_of_the_user_s_file(tmp_path):
    """The same file, its reward per step edited, trained twice with one cache: each run's
    returns are its own reward times the episode lengths."""
    module = tmp_path / "edited_corridor.py"
    overrides = command_line({**TINY, "env": {**TINY["env"], "id": "edited_corridor:Corridor"}})

    def train(name: str, reward: float) -> dict:
        module.write_text(USER_MODULE.replace("reward = jnp.where(terminated, REWARD, 0.0)",
                                              f"reward = jnp.float32({reward})"))
        trained = subprocess.run(
            [sys.executable, "-m", "jaxddppo.train", *overrides, "train.num_shards=1", f"run.dir={tmp_path / name}",
             f"run.compilation_cache={tmp_path / 'cache'}"],
            cwd=tmp_path, env=subprocess_env(1), capture_output=True, text=True, timeout=300)
        assert trained.returncode == 0, trained.stderr
        return json.loads((tmp_path / name / "summary.json").read_text())

    first = train("first", 1.0)
    assert any((tmp_path / "cache").iterdir())
    second = train("second", 3.0)
    assert first["eval_return_mean"] == first["eval_length_mean"] > 0
    assert second["eval_return_mean"] == 3 * second["eval_length_mean"]
