"""`python -m jaxddppo.export` and `jaxddppo.export_policy`: a policy as a `jax.export` program.

* A feed-forward policy's program gives load_policy's actions exactly, for any batch size.
* A recurrent policy on dict observations with an action mask takes and returns its carry,
  step after step: the actions of `policy.step` exactly, its carry to the last bits.
* The program runs in a fresh environment holding only jax and numpy (no jaxddppo, no flax).
* Bad input to the command is one line and exit code 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env
from test_pytree_obs import NUM_ACTIONS, MaskedWalk

from jaxddppo.config.files import from_dict
from jaxddppo.export import main
from jaxddppo.outputs.export import export_for, export_policy
from jaxddppo.outputs.policy import load_policy
from jaxddppo.outputs.run_dir import write_config
from jaxddppo.references import with_objects
from jaxddppo.training.checkpoint import Checkpointer, RunCounters
from jaxddppo.training.experiment import build


def made_up_state(abstract_state, seed: int):
    """A state of the shapes, dtypes and placements of `abstract_state`: random floats, zero
    integers, keys from `seed`, and observation statistics of 100 samples with a random mean
    and variance per element (a checkpoint's parameters and statistics, without compiling)."""
    rng = np.random.default_rng(seed)

    def made_up(leaf):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            values = jax.random.split(jax.random.key(seed), leaf.shape)
        elif jnp.issubdtype(leaf.dtype, jnp.floating):
            values = rng.uniform(-1.0, 1.0, leaf.shape).astype(leaf.dtype)
        else:
            values = np.zeros(leaf.shape, leaf.dtype)
        return jax.device_put(values, leaf.sharding)

    state = jax.tree.map(made_up, abstract_state)
    moments = state.obs_moments
    count = jax.device_put(np.float32(100.0), moments.count.sharding)
    m2 = jax.tree.map(lambda leaf: 100 * (jnp.abs(leaf) + 0.2), moments.m2)
    return state.replace(obs_moments=moments.replace(count=count, m2=m2))


def checkpointed_run(run_dir: Path, values: dict, env=None) -> str:
    """A run directory with the config `values` and a checkpoint (update 1) of a made-up state:
    what load_policy reads."""
    config, objects = with_objects(from_dict({**values, "run": {"dir": str(run_dir), "progress": False}}), env)
    run_dir.mkdir(parents=True)
    write_config(str(run_dir), config)
    state = made_up_state(build(config, jax.devices()[:1], objects).abstract_state(), seed=1)
    checkpointer = Checkpointer(str(run_dir), asynchronous=False)
    try:
        checkpointer.save(state, RunCounters(update=1, env_steps=64, train_seconds=1.0, final_episode_returns=(None,)))
    finally:
        checkpointer.close()
    return str(run_dir)


SMALL = {"env": {"num_envs": 8, "normalize_observations": True}, "ppo": {"num_steps": 8},
         "train": {"total_env_steps": 64, "num_shards": 1}}


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory) -> str:
    return checkpointed_run(tmp_path_factory.mktemp("export") / "cartpole",
                            {**SMALL, "network": {"hidden_sizes": [16]}})


@pytest.fixture(scope="module")
def masked_walk_run(tmp_path_factory) -> str:
    network = {"hidden_sizes": [8], "cnn_channels": [2], "recurrent": "gru", "recurrent_size": 8}
    return checkpointed_run(tmp_path_factory.mktemp("export") / "walk", {**SMALL, "network": network}, MaskedWalk())


def deserialize(path: str) -> jax.export.Exported:
    return jax.export.deserialize(bytearray(Path(path).read_bytes()))


def cartpole_observations(batch_size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=2.0, size=(batch_size, 4)).astype(np.float32)


def test_a_feed_forward_policy_exports_its_exact_actions_for_any_batch_size(cartpole_run, tmp_path):
    program, description = export_policy(cartpole_run, str(tmp_path / "policy.jaxexport"))
    assert description == program + ".json"
    exported, policy = deserialize(program), load_policy(cartpole_run)
    for batch_size, seed in ((256, 0), (3, 1), (1, 2)):
        obs = cartpole_observations(batch_size, seed)
        actions = np.asarray(exported.call(obs))
        assert actions.shape == (batch_size,) and actions.dtype == np.int32
        np.testing.assert_array_equal(actions, np.asarray(policy(obs)))
    assert len(set(np.asarray(exported.call(cartpole_observations(256, 0))))) == 2
    info = json.loads(Path(description).read_text())
    assert info["platforms"] == list(exported.platforms) and "cpu" in info["platforms"]
    assert info["inputs"] == {"observations": {"shape": ["batch", 4], "dtype": "float32"}}
    assert info["outputs"] == {"actions": {"shape": ["batch"], "dtype": "int32"}}
    assert info["action"] == {"kind": "discrete", "num_actions": 2, "action_mask_key": None}
    assert (info["checkpoint_update"], info["recurrent"], info["jax_version"]) == (1, None, jax.__version__)
    assert info["run_dir"] == os.path.abspath(cartpole_run) and info["program"] == "policy.jaxexport"


def walk_observations(batch_size: int, seed: int) -> dict:
    """Random MaskedWalk observations, each with a random non-empty set of legal actions."""
    rng = np.random.default_rng(seed)
    mask = rng.random((batch_size, NUM_ACTIONS)) < 0.5
    mask[np.arange(batch_size), rng.integers(0, NUM_ACTIONS, batch_size)] = True
    return {"image": rng.random((batch_size, 5, 5, 3)).astype(np.float32),
            "vector": rng.normal(size=(batch_size, 4)).astype(np.float32), "action_mask": mask}


def test_a_recurrent_policy_on_masked_dict_observations_steps_exactly_as_load_policy(masked_walk_run, tmp_path):
    program, description = export_policy(masked_walk_run, str(tmp_path / "walk"), env=MaskedWalk())
    exported, policy = deserialize(program), load_policy(masked_walk_run, env=MaskedWalk())
    step = jax.jit(policy.step)
    batch_size = 6
    (carry, _, _), _ = jax.tree.unflatten(exported.in_tree, exported.in_avals)  # as docs/outputs.md makes it
    ours = jax.tree.map(lambda aval: np.zeros((batch_size, *aval.shape[1:]), aval.dtype), carry)
    theirs = policy.initial_carry(batch_size)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    episode_start = np.ones(batch_size, bool)
    for seed in range(4):
        obs = walk_observations(batch_size, seed)
        ours, actions = exported.call(ours, obs, episode_start)
        theirs, expected = step(policy.params, theirs, obs, episode_start)
        np.testing.assert_array_equal(np.asarray(actions), np.asarray(expected))
        # XLA compiles the two programs apart (the statistics are constants in one), and may turn a
        # division into a product by the reciprocal in one only: the carries agree to the last bits.
        for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert obs["action_mask"][np.arange(batch_size), np.asarray(actions)].all()
        episode_start = np.arange(batch_size) % 3 == seed % 3
    assert len(exported.call(policy.initial_carry(2), walk_observations(2, 9), np.ones(2, bool))[1]) == 2
    info = json.loads(Path(description).read_text())
    assert info["inputs"]["observations"] == {
        "action_mask": {"shape": ["batch", NUM_ACTIONS], "dtype": "bool"},
        "image": {"shape": ["batch", 5, 5, 3], "dtype": "float32"},
        "vector": {"shape": ["batch", 4], "dtype": "float32"}}
    carry = [{"shape": ["batch", 8], "dtype": "float32"}] * 2  # separate actor and critic cores
    assert info["inputs"]["carry"] == info["outputs"]["carry"] == carry
    assert info["inputs"]["episode_start"] == {"shape": ["batch"], "dtype": "bool"}
    assert info["action"]["action_mask_key"] == "action_mask" and info["recurrent"] == "gru"
    assert info["call"] == "carry, actions = exported.call(carry, observations, episode_start)"
    assert "'action_mask'" in info["observation_structure"]


def test_a_platform_the_program_cannot_lower_for_is_left_out_with_why():
    def only_elsewhere(x):  # on CPU, a call to a C function that JAX does not know to be stable
        on_cpu = lambda x: jax.ffi.ffi_call("not_a_stable_target", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        return jax.lax.platform_dependent(x, cpu=on_cpu, default=jnp.negative)

    args = (jax.ShapeDtypeStruct(jax.export.symbolic_shape("batch, 3"), jnp.float32),)
    exported, left_out = export_for(jax.jit(only_elsewhere), args, ("cpu", "cuda", "tpu"))
    assert exported.platforms == ("cuda", "tpu") and list(left_out) == ["cpu"]
    assert left_out["cpu"].startswith("ValueError: Cannot serialize code with custom calls")
    with pytest.raises(ValueError, match="no compatibility guarantees"):
        export_for(jax.jit(only_elsewhere), args, ("cpu",))


# The packages of a fresh environment: jax and what it imports, flatbuffers for deserializing.
JAX_ALONE = ("jax", "jaxlib", "numpy", "ml_dtypes", "opt_einsum", "scipy", "flatbuffers")

IN_JAX_ALONE = r"""
import importlib, json, sys
import jax.export, numpy as np
exported = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
actions = exported.call(np.load(sys.argv[2]))
missing = []
for name in ("jaxddppo", "flax"):
    try:
        importlib.import_module(name)
    except ImportError:
        missing.append(name)
print(json.dumps({"actions": np.asarray(actions).tolist(), "missing": missing}))
"""


def environment_with_jax_alone(directory: Path) -> Path:
    """A virtual environment (no pip, no network) whose site-packages links only `JAX_ALONE`
    from this interpreter's; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=120)
    site = directory / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for name in JAX_ALONE:
        package = Path(importlib.util.find_spec(name).submodule_search_locations[0])
        for path in [package, *package.parent.glob(f"{name}.libs"), *package.parent.glob(f"{name}-*.dist-info")]:
            (site / path.name).symlink_to(path)
    return directory / "bin" / "python"


def test_the_command_writes_a_program_that_runs_with_jax_and_numpy_alone(cartpole_run, tmp_path, capsys):
    program = tmp_path / "policy.jaxexport"
    assert main([cartpole_run, "--output", str(program)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {program} and {program}.json"
    obs = cartpole_observations(64, 3)
    np.save(tmp_path / "obs.npy", obs)
    python = environment_with_jax_alone(tmp_path / "venv")
    env = {key: value for key, value in subprocess_env(1).items() if key != "PYTHONPATH"}
    ran = subprocess.run([str(python), "-c", IN_JAX_ALONE, str(program), str(tmp_path / "obs.npy")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    printed = json.loads(ran.stdout.splitlines()[-1])
    assert printed["missing"] == ["jaxddppo", "flax"]
    assert printed["actions"] == np.asarray(load_policy(cartpole_run)(obs)).tolist()


@pytest.mark.parametrize("args,message", [
    (["{run}/missing", "--output", "{tmp}/p"], "error: run directory {run}/missing does not exist"),
    (["{run}", "--output", "{tmp}/p", "--checkpoint", "7"],
     "error: no checkpoint 7 in {run}/checkpoints (there are: [1])"),
    (["{run}", "--output", "{tmp}/missing/p"],
     "error: --output={tmp}/missing/p: directory {tmp}/missing does not exist (see --help)"),
    (["{run}", "--output", "{tmp}"], "error: cannot write {tmp}: Is a directory"),
    (["{run}"], "error: the following arguments are required: --output (see --help)"),
    (["{tmp}/sweep", "--output", "{tmp}/p"], "error: {tmp}/sweep is a sweep's run directory (sweep.json), not a single run's"),
])
def test_bad_input_is_one_line_and_exit_2(cartpole_run, tmp_path, capsys, args, message):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_status:
        sys.exit(main([arg.format(run=cartpole_run, tmp=tmp_path) for arg in args]))
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.strip() == message.format(run=cartpole_run, tmp=tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
