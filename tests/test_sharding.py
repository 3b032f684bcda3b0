"""Distribution semantics on simulated CPU devices (tests/conftest.py asks for 4).

- N shards give the gradient of the single-shard global minibatch (DESIGN.md's trap).
- One config with num_shards=4 learns the same bits on 1, 2 and 4 devices (not so without
  train.exact_reductions).
- Replicas stay identical; shards get their own environment streams.
- run.cpu_threads sizes XLA's CPU thread pool, without changing what is learnt.
- run.cpu_devices cannot change the device count once JAX has started, and says so.
- Programs that run once compile for speed of compiling, with the same results; the
  seed is an argument of the programs, so every seed shares them.
- Zero-sized arrays in a shard_map's body compile on two devices, which jaxlib 0.11.2
  does not do by itself (its bare reproducers run in subprocesses; 0.12 does).
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO_ROOT, host_leaves, jit_stages, subprocess_env, xla_pool_threads_named

from jaxddppo import sharding
from jaxddppo.config.files import from_dict, load_config, with_overrides
from jaxddppo.config.options import Config, ConfigError, NetworkConfig, PPOConfig
from jaxddppo.cpu import tuning as cpu_tuning
from jaxddppo.distributed import global_arrays, multiprocess, topology
from jaxddppo.envs import make_env
from jaxddppo.networks import make_actor_critic
from jaxddppo.ppo import PPOHyperparams, make_update, mean_gradients
from jaxddppo.rollout import Batch
from jaxddppo.sharding import normalize_minibatch_advantages
from jaxddppo.train import run
from jaxddppo.training.experiment import ShardInputs, abstract_update_count, build, update_count

# Same maths, different reduction order (per-shard means, then the all-reduce):
# measured about 1e-7 relative L2 in float32.
GRADIENT_RTOL = 1e-5


def relative_l2(tree_a, tree_b) -> float:
    a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree_a)])
    b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree_b)])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_four_devices_are_simulated():
    assert jax.device_count() == 4


def random_batch(key, size, obs_dim, num_actions) -> Batch:
    keys = jax.random.split(key, 6)
    return Batch(
        obs=jax.random.normal(keys[0], (size, obs_dim)),
        action=jax.random.randint(keys[1], (size,), 0, num_actions),
        log_prob=jnp.log(jnp.full((size,), 1.0 / num_actions)) + 0.1 * jax.random.normal(keys[2], (size,)),
        value=jax.random.normal(keys[3], (size,)),
        advantage=2.0 + 3.0 * jax.random.normal(keys[4], (size,)),
        target=jax.random.normal(keys[5], (size,)),
    )


@pytest.fixture(scope="module")
def gradient_setup():
    env = make_env("CartPole-v1")
    network = make_actor_critic(NetworkConfig(), env.spec)
    params = network.init(jax.random.key(0), jnp.zeros((1,) + env.spec.obs_shape))
    hyperparams = PPOHyperparams.from_config(PPOConfig())
    global_batch = random_batch(jax.random.key(1), 64, env.spec.obs_shape[0], env.spec.num_actions)
    return network, params, hyperparams, global_batch


def sharded_gradients(gradient_setup, num_shards: int, num_devices: int):
    """All-reduced gradients of the global minibatch split into `num_shards` shards,
    with advantages normalised over the global minibatch as in training."""
    network, params, hyperparams, global_batch = gradient_setup
    global_size = global_batch.obs.shape[0]
    shard_size = global_size // num_shards
    mesh = sharding.make_mesh(jax.devices()[:num_devices])

    device_shards = sharding.DeviceShards()

    def per_device(batch):
        shards_per_device = batch.advantage.shape[0]
        one_minibatch = jnp.broadcast_to(jnp.arange(shard_size).reshape(1, 1, shard_size),
                                         (shards_per_device, 1, 1, shard_size))
        advantage = normalize_minibatch_advantages(batch.advantage, one_minibatch, device_shards)[:, 0, 0]
        grads, info = mean_gradients(params, batch.replace(advantage=advantage), network.apply, hyperparams, True, device_shards)
        return grads, info

    split = jax.tree.map(lambda x: x.reshape((num_shards, shard_size) + x.shape[1:]), global_batch)
    grads, info = sharding.shard_parallel(per_device, mesh, out_layouts=(sharding.PER_MEMBER, sharding.PER_SHARD))(split)
    multiprocess.check_replicas(grads, mesh, after_update=0)
    return global_arrays.local_copy(grads), global_arrays.all_shards(info)


@pytest.mark.parametrize("num_shards,num_devices", [(2, 2), (4, 4), (4, 2), (4, 1)])
def test_shard_gradients_equal_single_shard_gradient(gradient_setup, num_shards, num_devices):
    reference_grads, reference_info = sharded_gradients(gradient_setup, 1, 1)
    grads, info = sharded_gradients(gradient_setup, num_shards, num_devices)
    assert relative_l2(grads, reference_grads) < GRADIENT_RTOL
    # Each shard reports its own loss; their mean is the global minibatch's loss.
    np.testing.assert_allclose(info.policy_loss.mean(), reference_info.policy_loss[0], rtol=1e-5, atol=1e-7)
    # Plain SGD (no Adam to hide a scale error): the same step from the same parameters.
    params = gradient_setup[1]
    sgd = lambda g: jax.tree.map(lambda p, x: p - 0.1 * x, params, g)
    assert relative_l2(sgd(grads), sgd(reference_grads)) < GRADIENT_RTOL


def test_shard_gradient_differs_from_one_shards_local_gradient(gradient_setup):
    """The test above can fail: a shard's own gradient is far from the global one."""
    network, params, hyperparams, global_batch = gradient_setup
    reference_grads, _ = sharded_gradients(gradient_setup, 1, 1)
    local_only = jax.tree.map(lambda x: x[:16], global_batch)
    local_setup = (network, params, hyperparams, local_only)
    local_grads, _ = sharded_gradients(local_setup, 1, 1)
    assert relative_l2(local_grads, reference_grads) > 1e-2


def invariance_config():
    return from_dict({
        "env": {"id": "CartPole-v1", "num_envs": 8},
        "ppo": {"num_steps": 16, "num_epochs": 2, "num_minibatches": 2, "learning_rate": 1e-3},
        "train": {"num_shards": 4, "total_env_steps": 8 * 16 * 6, "updates_per_chunk": 3, "seed": 3},
    })


@pytest.fixture(scope="module")
def runs_by_device_count():
    """Two chunks of three updates with num_shards=4 on 1, 2 and 4 devices, and the jit
    stages (conftest.jit_stages) each chunk ran."""
    results = {}
    for num_devices in (1, 2, 4):
        experiment = build(invariance_config(), jax.devices()[:num_devices])
        state = experiment.init_state()
        learn, inputs, three = experiment.learn_fn(), experiment.shard_inputs(), update_count(experiment.mesh, 3)
        with jit_stages() as first_chunk:
            state, _, _ = learn(state, inputs, three)
        with jit_stages() as second_chunk:
            state, metrics, _ = learn(state, inputs, three)
        results[num_devices] = (experiment, state, metrics, (first_chunk, second_chunk))
    return results


@pytest.mark.oldest
@pytest.mark.parametrize("num_devices", [2, 4])
def test_same_learning_on_any_device_count(runs_by_device_count, num_devices):
    """train.exact_reductions (the default): the same bits on 1, 2 and 4 devices."""
    _, reference_state, reference_metrics, _ = runs_by_device_count[1]
    experiment, state, metrics, _ = runs_by_device_count[num_devices]
    assert experiment.topology.shards_per_device == 4 // num_devices
    for got, want in zip(host_leaves((state, metrics)), host_leaves((reference_state, reference_metrics)), strict=True):
        np.testing.assert_array_equal(got, want)


def learnt_on(config, num_devices: int):
    experiment = build(config, jax.devices()[:num_devices])
    learn, inputs = experiment.learn_fn(), experiment.shard_inputs()
    state, metrics, _ = learn(experiment.init_state(), inputs, update_count(experiment.mesh, 2))
    stats = experiment.eval_fn()(state.params, state.obs_moments, state.update_index, inputs)
    return host_leaves((state, metrics, stats))


def pendulum_config(yaml_name: str = "pendulum.yaml", overrides: Optional[dict] = None) -> Config:
    """Two updates of 4 shards of 2 envs, both normalisers on: continuous actions amplify
    any difference in the last bits."""
    return with_overrides(load_config(REPO_ROOT / "experiments" / yaml_name), {
        "train.num_shards": 4, "env.num_envs": 8, "ppo.num_steps": 16, "ppo.num_minibatches": 2,
        "train.total_env_steps": 8 * 16 * 2, "eval.num_episodes": 4, **(overrides or {}),
    })


@pytest.mark.parametrize("yaml_name,overrides", [
    ("pendulum.yaml", {"env.scale_rewards": True, "env.normalize_observations": True}),
    ("pendulum.yaml", {"env.scale_rewards": True, "env.normalize_observations": True, "ppo.segment_length": 4}),
    pytest.param("memory_chain.yaml", {}, marks=pytest.mark.slow),
])
def test_continuous_and_recurrent_runs_are_bit_identical_on_one_and_four_devices(yaml_name, overrides):
    """Four shards in turn on one device, or one on each of four: every state leaf, metric
    and evaluation statistic equal."""
    config = pendulum_config(yaml_name, overrides)
    for got, want in zip(learnt_on(config, 4), learnt_on(config, 1), strict=True):
        np.testing.assert_array_equal(got, want)


def test_restarts_from_first_states_are_bit_identical_on_one_and_four_devices():
    """env.start_states=first: CartPole's episodes end within the updates, each environment
    restarting from its own first state, the same on any device count."""
    config = with_overrides(invariance_config(), {"env.start_states": "first", "train.total_env_steps": 8 * 16 * 2})
    on_four, on_one = learnt_on(config, 4), learnt_on(config, 1)
    for got, want in zip(on_four, on_one, strict=True):
        np.testing.assert_array_equal(got, want)
    fresh = learnt_on(with_overrides(config, {"env.start_states": "fresh"}), 1)
    assert any(not np.array_equal(got, want) for got, want in zip(on_one, fresh))


def test_exact_reductions_loop_over_shards_only_where_there_are_several():
    """A run of one shard has one order: it runs its update unlooped either way."""
    for num_shards, exact in ((1, False), (2, True), (4, True)):
        config = with_overrides(invariance_config(), {"train.num_shards": num_shards})
        assert build(config, jax.devices()[:1]).settings.shards.exact == exact
    unexact = with_overrides(invariance_config(), {"train.exact_reductions": False})
    assert not build(unexact, jax.devices()[:1]).settings.shards.exact


@pytest.mark.slow  # two more compiles; shows that the 1-vs-4 test above could fail
def test_without_exact_reductions_one_and_four_devices_differ():
    config = pendulum_config(overrides={"env.scale_rewards": True, "env.normalize_observations": True,
                                        "train.exact_reductions": False})
    batched, reference = learnt_on(config, 4), learnt_on(config, 1)
    assert any(not np.array_equal(got, want, equal_nan=got.dtype.kind == "f") for got, want in zip(batched, reference))


@pytest.mark.slow  # a process of its own with 8 devices
def test_eight_shards_learn_the_same_bits_on_eight_devices_as_on_one(tmp_path):
    """Pendulum with both normalisers, 8 shards: one on each of 8 devices (another process)
    against all 8 in turn on one device: the same parameters and evaluation."""
    overrides = {"env.scale_rewards": True, "env.normalize_observations": True, "train.num_shards": 8,
                 "env.num_envs": 16, "ppo.num_steps": 16, "ppo.num_minibatches": 2, "eval.num_episodes": 8,
                 "train.total_env_steps": 16 * 16 * 2, "run.progress": False}
    process = subprocess.run(
        [sys.executable, "-m", "jaxddppo.train", "--config", str(REPO_ROOT / "experiments" / "pendulum.yaml"),
         *(f"{key}={value}" for key, value in overrides.items()), f"run.dir={tmp_path / 'eight'}"],
        env=subprocess_env(8), capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr
    eight = json.loads((tmp_path / "eight" / "summary.json").read_text())
    assert eight["num_devices"] == 8
    one = run(with_overrides(pendulum_config(overrides=overrides), {"run.dir": str(tmp_path / "one")}),
              devices=jax.devices()[:1])
    assert (eight["params_digest"], eight["eval_return_mean"]) == (one.summary["params_digest"],
                                                                   one.summary["eval_return_mean"])


@pytest.mark.parametrize("num_devices", [1, 2, 4])
def test_replicas_identical_and_shards_distinct(runs_by_device_count, num_devices):
    experiment, state, _, (first_chunk, second_chunk) = runs_by_device_count[num_devices]
    multiprocess.check_replicas(state.params, experiment.mesh, after_update=6)
    multiprocess.check_replicas(state.opt_state, experiment.mesh, after_update=6)
    assert int(global_arrays.local_copy(state.update_index)) == 6
    observations = global_arrays.all_shards(state.rollout.obs)
    for other in range(1, 4):
        assert not np.array_equal(observations[0], observations[other])
    assert "compile" in {stage for stage, _ in first_chunk}, first_chunk  # what a recompilation reports
    assert second_chunk == [], f"the second chunk recompiled: {second_chunk}"


def test_params_leave_their_initial_values(runs_by_device_count):
    experiment, state, _, _ = runs_by_device_count[1]
    initial = experiment.init_state()
    assert relative_l2(global_arrays.local_copy(state.params), global_arrays.local_copy(initial.params)) > 1e-4


def test_one_chunk_program_runs_chunks_of_any_length_as_a_scan_would(runs_by_device_count):
    """Chunks of 2 then 1 update through the program built for 3 (compiled once) end in the
    state a `lax.scan` of the 3 updates reaches, bit for bit; the metrics past a chunk's
    last update are zeros."""
    experiment, _, _, _ = runs_by_device_count[2]
    update = make_update(experiment.env, experiment.network, experiment.settings)

    def scan_updates(state, shard):
        return jax.lax.scan(lambda s, _: update(s, shard.hyperparams), state, length=3)

    inputs = experiment.shard_inputs()
    scanned, scan_metrics = sharding.shard_parallel(
        scan_updates, experiment.mesh, in_layouts=(experiment.state_layout, ShardInputs.layout()),
        out_layouts=(experiment.state_layout, sharding.PER_MEMBER))(experiment.init_state(), inputs)
    learn, initial, two, one = (experiment.learn_fn(), experiment.init_state(), update_count(experiment.mesh, 2),
                                update_count(experiment.mesh, 1))
    with jit_stages() as first_chunk:
        state, first_metrics, _ = learn(initial, inputs, two)
    with jit_stages() as second_chunk:
        state, second_metrics, _ = learn(state, inputs, one)
    assert "compile" in {stage for stage, _ in first_chunk}, first_chunk
    assert second_chunk == [], f"the chunk of 1 update recompiled the program of 3: {second_chunk}"
    for got, want in zip(host_leaves(state), host_leaves(scanned), strict=True):
        np.testing.assert_array_equal(got, want)
    first, second, reference = (global_arrays.local_copy(metrics) for metrics in (first_metrics, second_metrics, scan_metrics))
    for name in ("policy_loss", "value_loss", "grad_norm", "learning_rate"):
        np.testing.assert_array_equal(getattr(first, name)[:2], getattr(reference, name)[:2])
        np.testing.assert_array_equal(getattr(second, name)[:1], getattr(reference, name)[2:])
        assert getattr(first, name)[2] == 0 and np.all(getattr(second, name)[1:] == 0)


def test_topology_sizes():
    config = from_dict({"env": {"num_envs": 64}, "ppo": {"num_steps": 32, "num_minibatches": 4},
                        "train": {"num_shards": 8, "total_env_steps": 100_000}})
    sizes = topology.make_topology(config, num_devices=4)
    assert sizes.shards_per_device == 2
    assert sizes.num_envs_per_shard == 8
    assert sizes.minibatch_size_per_shard == 8 * 32 // 4
    assert sizes.global_minibatch_size == 64 * 32 // 4
    assert sizes.num_updates == 100_000 // (64 * 32)


@pytest.mark.parametrize("values,needle", [
    ({"train": {"num_shards": 3}}, "train.num_shards=3 is not divisible by the device count=4"),
    ({"env": {"num_envs": 6}, "train": {"num_shards": 4}}, "env.num_envs=6 is not divisible by train.num_shards"),
    ({"ppo": {"num_minibatches": 3}}, "ppo.num_minibatches=3"),
    ({"train": {"total_env_steps": 10}}, "train.total_env_steps=10"),
    ({"ppo": {"num_steps": 8, "segment_length": 4, "num_minibatches": 4}},
     "env.num_envs/train.num_shards x ppo.num_steps/ppo.segment_length=2 is not divisible by ppo.num_minibatches=4"),
])
def test_topology_errors_name_keys_and_numbers(values, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("=", "=")):
        topology.make_topology(from_dict(values), num_devices=4)


@pytest.mark.parametrize("values,message", [
    ({"ppo": {"segment_length": -1}}, "ppo.segment_length=-1 is invalid: must be >= 0"),
    ({"ppo": {"num_steps": 8, "segment_length": 3}}, "ppo.segment_length=3 is invalid: must divide ppo.num_steps=8"),
    ({"ppo": {"segment_length": 4}, "network": {"recurrent": "gru"}},
     "ppo.segment_length=4 is invalid: needs a feed-forward network, not network.recurrent=gru"),
])
def test_segment_length_refusals_name_the_key_and_value(values, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        from_dict(values)


def test_minibatch_advantages_normalised_over_all_shards():
    """Each global minibatch (the same indices on every shard) has mean 0 and std 1 over
    all shards' samples together, as in a float64 NumPy reference; 4 shards on 2 devices."""
    num_shards, per_shard = 4, 12
    rng = np.random.default_rng(0)
    advantages = (50.0 + rng.normal(size=(num_shards, per_shard)) * np.arange(1, 5)[:, None]).astype(np.float32)
    indices = np.stack([rng.permutation(per_shard) for _ in range(2)]).reshape(2, 3, 4)  # [E, M, n]
    mesh = sharding.make_mesh(jax.devices()[:2])
    normalise = lambda adv, idx: normalize_minibatch_advantages(adv, idx, sharding.DeviceShards())
    result = global_arrays.all_shards(sharding.shard_parallel(normalise, mesh)(
        jnp.asarray(advantages), jnp.broadcast_to(jnp.asarray(indices), (num_shards,) + indices.shape)
    ))
    gathered = advantages.astype(np.float64)[:, indices]  # [S, E, M, n]
    mean = gathered.mean(axis=(0, 3), keepdims=True)
    std = gathered.std(axis=(0, 3), keepdims=True)
    np.testing.assert_allclose(result, (gathered - mean) / (std + 1e-8), rtol=1e-4, atol=1e-4)


# --- the initialisation ------------------------------------------------------------------------

@pytest.mark.parametrize("experiment_yaml, overrides, num_devices", [
    ("cartpole.yaml", ["train.num_shards=4"], 2),
    ("memory_chain.yaml", ["train.num_shards=2"], 1),
    ("memory_chain.yaml", ["train.num_shards=2", "network.recurrent=lstm"], 1),
    ("minatar.yaml", ["train.num_shards=2", "network.torso=cnn", "network.cnn_channels=[16]"], 1),
])
def test_initialisation_factorises_one_matrix_at_a_time(experiment_yaml, overrides, num_devices):
    """With two shards per device every orthogonal initialiser (dense, convolution,
    recurrent kernels) is vmapped; its QR factorisations must still be unbatched LAPACK
    calls on single matrices: jaxlib 0.10 runs a batched one on XLA's thread pool and
    waits for it there, which deadlocked this module's tests (`networks.orthogonal`)."""
    config = load_config(str(REPO_ROOT / "experiments" / experiment_yaml), overrides)
    experiment = build(config, jax.devices()[:num_devices])
    assert experiment.topology.shards_per_device == 2
    text = experiment.init_fn().lower(experiment.shard_inputs()).as_text()
    matrices = re.findall(r"custom_call @lapack_\w+\(.*?: \(tensor<([^>]*)>", text)
    assert len(matrices) >= 2
    for matrix in matrices:
        assert len(matrix.split("x")) == 3, f"a batched LAPACK call on tensor<{matrix}>"  # rows x columns x type


# --- run.cpu_threads -------------------------------------------------------------------------------

# Run with benchmarks/ importable, for profile_update's count of XLA's pool threads.
THREADS_SCRIPT = """
import json, sys
from profile_update import xla_cpu_pool_threads
from jaxddppo import train
from jaxddppo.config.files import from_dict
from jaxddppo.cpu import tuning as cpu_tuning

result = train.run(from_dict(json.loads(sys.argv[1])))
print(json.dumps({"eigen_threads": xla_cpu_pool_threads(), "digest": result.summary["params_digest"],
                  "same_again": cpu_tuning.set_cpu_threads(3), "other_after_start": cpu_tuning.set_cpu_threads(2)}))
"""


def threads_config(tmp_path: Path, cpu_threads: int) -> dict:
    return {
        "env": {"id": "CartPole-v1", "num_envs": 4},
        "ppo": {"num_steps": 16},
        "train": {"total_env_steps": 4 * 16 * 4, "updates_per_chunk": 2},
        "checkpoint": {"every_updates": 0},
        "run": {"dir": str(tmp_path / f"threads{cpu_threads}"), "progress": False, "cpu_threads": cpu_threads},
    }


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_cpu_threads_sizes_the_thread_pool_and_leaves_results_unchanged(tmp_path):
    """A fresh process with run.cpu_threads=3 (neither XLA's default on this machine's
    cores nor 1) runs 3 XLA CPU pool threads and learns bit for bit what the
    default pool learns here; asked for another size once JAX has started, it warns."""
    env = subprocess_env(1)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO_ROOT / "benchmarks")])
    completed = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, json.dumps(threads_config(tmp_path, 3))],
                               env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    if xla_pool_threads_named():
        assert report["eigen_threads"] == 3
    assert report["same_again"] is None
    assert report["other_after_start"].startswith("warning: run.cpu_threads=2 has no effect")
    reference = run(from_dict(threads_config(tmp_path, 0)), jax.devices()[:1])
    assert report["digest"] == reference.summary["params_digest"]


def test_negative_cpu_threads_are_refused():
    with pytest.raises(ConfigError, match=r"^run.cpu_threads=-1 is invalid: must be >= 0"):
        from_dict({"run": {"cpu_threads": -1}})


def test_cpu_devices_after_the_backend_started_warns_unless_it_matches():
    count = len(jax.devices("cpu"))  # starts the backend, if no test has yet
    assert cpu_tuning.set_cpu_devices(0) is None and cpu_tuning.set_cpu_devices(count) is None
    warning = cpu_tuning.set_cpu_devices(count + 1)
    assert warning.startswith(f"warning: run.cpu_devices={count + 1} has no effect") and "\n" not in warning
    assert len(jax.devices("cpu")) == count


def test_negative_cpu_devices_are_refused():
    with pytest.raises(ConfigError, match=r"^run.cpu_devices=-2 is invalid: must be >= 0"):
        from_dict({"run": {"cpu_devices": -2}})


def test_one_compiled_initialisation_and_evaluation_serve_every_seed():
    """The seed is an argument of the programs, not a constant in them: runs with another
    seed lower to the same programs (so JAX's persistent compilation cache serves them),
    and the initialisation compiled for one seed, given another's inputs, computes that
    seed's initial state."""
    def experiment_with_seed(seed):
        return build(from_dict({"env": {"num_envs": 4}, "ppo": {"num_steps": 8, "num_epochs": 1, "num_minibatches": 2},
                                "train": {"total_env_steps": 64, "updates_per_chunk": 1, "num_shards": 2,
                                          "seed": seed}}), jax.devices()[:2])

    def lowered_programs(experiment):
        inputs = experiment.shard_inputs()
        init = experiment.init_fn().lower(inputs)
        state = init.out_info
        evaluate = experiment.eval_fn().lower(state.params, state.obs_moments, state.update_index, inputs)
        learn = experiment.learn_fn().lower(state, inputs, abstract_update_count(experiment.mesh))
        return init, evaluate, learn

    first, other = experiment_with_seed(0), experiment_with_seed(5)
    first_programs = lowered_programs(first)
    for first_program, other_program in zip(first_programs, lowered_programs(other), strict=True):
        assert first_program.as_text() == other_program.as_text()
    init = first_programs[0].compile()
    first_state, other_state = init(first.shard_inputs()), init(other.shard_inputs())
    for leaf, expected in zip(host_leaves(other_state), host_leaves(other.init_state()), strict=True):
        np.testing.assert_array_equal(leaf, expected)
    assert global_arrays.params_digest(first_state.params) != global_arrays.params_digest(other_state.params)


# jaxlib 0.11.2's compiler segfaults on these programs (see sharding._ZERO_SIZED_OPERAND_CRASH):
# a zero-sized array enters the body of a shard_map over two devices, as a constant (the int32[0]
# indices of `x.at[:].set`) or as an argument.
ZERO_SIZED_OPERAND_SCRIPT = """
import sys
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))
if sys.argv[1] == "constant":
    f = jax.jit(jax.shard_map(lambda x: x.at[:].set(1.0), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    print(f(put(jax.numpy.zeros(2))))
else:
    f = jax.jit(jax.shard_map(lambda x, empty: x + empty.sum(), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    print(f(put(jax.numpy.ones(2)), put(jax.numpy.zeros((2, 0)))))
"""


@pytest.mark.parametrize("operand", ["constant", "argument"])
def test_the_bare_zero_sized_operand_programs_crash_exactly_where_the_workaround_applies(operand):
    """In a subprocess: segfault in the range `sharding` works around (jaxlib 0.11.2; 0.12.0 and
    0.12.0.1 compile them), `[1. 1.]` elsewhere. Drop the workaround when no supported release is
    in the range."""
    process = subprocess.run([sys.executable, "-c", ZERO_SIZED_OPERAND_SCRIPT, operand], env=subprocess_env(2),
                             capture_output=True, text=True, timeout=300)
    crashed = process.returncode == -signal.SIGSEGV
    assert crashed == sharding._ZERO_SIZED_OPERAND_CRASH, (
        f"jax {jax.__version__}: the reproducer {'crashed' if crashed else 'compiled'}; "
        f"_ZERO_SIZED_OPERAND_CRASH is {sharding._ZERO_SIZED_OPERAND_CRASH}\n{process.stderr[-3000:]}")
    if not crashed:
        assert process.returncode == 0 and "[1. 1.]" in process.stdout, process.stderr[-3000:]


@pytest.mark.oldest
def test_shard_parallel_compiles_zero_sized_constants_and_arguments_on_two_devices():
    mesh = sharding.make_mesh(jax.devices()[:2])
    fill = sharding.shard_parallel(lambda x, empty: (x.at[:].set(1.0), empty + 1), mesh, donate_argnums=(1,))
    put = lambda x: jax.device_put(x, sharding.shard_sharding(mesh))
    filled, empty = fill(put(np.zeros((2, 3), np.float32)), put(np.zeros((2, 1, 0), np.uint8)))
    np.testing.assert_array_equal(np.asarray(filled), np.ones((2, 3), np.float32))
    assert empty.shape == (2, 1, 0) and empty.dtype == np.uint8
