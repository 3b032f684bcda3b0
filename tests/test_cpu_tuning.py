"""jaxddppo.cpu.tuning: run.cpu_tuning resolves auto by platform; its shuffle is a uniformly
random permutation, drawn as the stable sorts it describes; its compiler options reach every
program, start training from the same state and keep elementwise fusions from YNNPACK; its
Dense product has Dense's forward pass and the gradients of a float64 NumPy reference; the
train command splits the CPU into one device per core only as far as the run's sizes allow."""

import collections
import importlib.machinery
import importlib.metadata
import importlib.util
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import host_leaves

from jaxddppo.config.files import from_dict, with_overrides
from jaxddppo.cpu import tuning as cpu_tuning
from jaxddppo.cpu.tuning import (
    LONG_LOOP_ITERATIONS,
    compiler_options,
    cpu_devices_for_run,
    is_on,
    loop_iterations,
    resolve,
    sort_permutations,
    with_cpu_devices,
)
from jaxddppo.envs import EnvSpec, observation_spec
from jaxddppo.references import UserObjects
from jaxddppo.sharding import epoch_indices, random_permutations


def reference_permutations(key: jax.Array, num_permutations: int, n: int) -> np.ndarray:
    """The same rounds in NumPy: each a stable argsort by the round's 32 random bits alone."""
    num_rounds = math.ceil(3 * math.log2(n) / 32)
    all_random_words = np.asarray(jax.random.bits(key, (num_permutations, num_rounds, n), jnp.uint32))
    orders = []
    for permutation_words in all_random_words:
        order = np.arange(n)
        for random_words in permutation_words:
            order = order[np.argsort(random_words, kind="stable")]
        orders.append(order)
    return np.stack(orders)


@pytest.mark.parametrize("num_permutations, n", [(1, 2), (2, 3), (3, 7), (4, 512), (1, 4096), (2, 300_000),
                                                 (1, 3_000_000)])
def test_sort_permutations_are_the_stable_sorts_of_their_random_keys(num_permutations, n):
    key = jax.random.key(n)
    got = np.asarray(jax.jit(sort_permutations, static_argnums=(1, 2))(key, num_permutations, n))
    assert got.dtype == np.int32 and got.shape == (num_permutations, n)
    for order in got:
        np.testing.assert_array_equal(np.sort(order), np.arange(n))
    np.testing.assert_array_equal(got, reference_permutations(key, num_permutations, n))
    assert jnp.arange(2).dtype == jnp.int32  # its 64-bit block is over once it is traced


def test_sort_permutations_of_one_or_no_element():
    np.testing.assert_array_equal(sort_permutations(jax.random.key(0), 2, 1), [[0], [0]])
    assert sort_permutations(jax.random.key(0), 3, 0).shape == (3, 0)


def test_sort_permutations_draw_every_order_equally_often():
    draws = 24_000
    orders = jax.jit(sort_permutations, static_argnums=(1, 2))(jax.random.key(1), draws, 4)
    counts = collections.Counter(tuple(int(i) for i in row) for row in np.asarray(orders))
    assert set(counts) == set(itertools.permutations(range(4)))
    expected = draws / 24  # 1000, standard deviation about 31
    assert all(abs(count - expected) < 150 for count in counts.values()), counts


@pytest.mark.parametrize("permutations", [random_permutations, sort_permutations])
def test_minibatches_are_a_fresh_permutation_per_epoch_either_way(permutations):
    key = jax.random.key(5)
    samples = np.asarray(epoch_indices(key, 3, 4, 64, permutations)).reshape(3, -1)  # 4 minibatches of 16 samples
    sequences = np.asarray(epoch_indices(key, 3, 4, 8, permutations)).reshape(3, -1)  # of 2 environments' sequences
    for epochs, size in ((samples, 64), (sequences, 8)):
        for epoch in epochs:
            np.testing.assert_array_equal(np.sort(epoch), np.arange(size))
        assert not np.array_equal(epochs[0], epochs[1])
    if permutations is sort_permutations:
        np.testing.assert_array_equal(samples, sort_permutations(key, 3, 64))
    else:
        np.testing.assert_array_equal(samples[0], jax.random.permutation(jax.random.split(key, 3)[0], 64))


@pytest.fixture
def asked_options(monkeypatch):
    """(platform, runs_once) of every `compiler_options` call from here on, each still answered."""
    asked = []

    def recorded(platform, runs_once):
        asked.append((platform, runs_once))
        return compiler_options(platform, runs_once)

    monkeypatch.setattr(cpu_tuning, "compiler_options", recorded)
    return asked


def test_the_cpu_switch_compiles_at_lower_levels_the_same_initial_state(asked_options):
    """run.cpu_tuning on: every program compiles with `compiler_options` for its platform,
    the initialisation as a program that runs once; it starts from the state the plain path
    starts from, but for the last bits."""
    from jaxddppo.config.files import from_dict, with_overrides
    from jaxddppo.training import experiment

    config = from_dict({"env": {"num_envs": 8}, "ppo": {"num_steps": 16}, "run": {"cpu_tuning": "off"}})
    plain = experiment.build(config, jax.devices()[:1])
    experiment.compile_programs(plain)
    assert asked_options == []
    tuned = experiment.build(with_overrides(config, {"run.cpu_tuning": "auto"}), jax.devices()[:1])
    assert tuned.config.run.cpu_tuning == "on" and tuned.settings.permutations is sort_permutations
    tuned_programs = experiment.compile_programs(tuned)
    assert sorted(asked_options) == [("cpu", False), ("cpu", False), ("cpu", True)]  # the chunk, the checksums; the init
    # What profile_update.py compiles the chunk with.
    assert experiment.learn_compiler_options(tuned) == compiler_options("cpu", runs_once=False)
    assert experiment.learn_compiler_options(plain) == {}
    want = plain.init_state()
    got = tuned_programs.init(tuned_programs.inputs)
    for got_leaf, want_leaf in zip(host_leaves(got), host_leaves(want), strict=True):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-6)


class SettledPoint:
    """A point that falls for `settle_steps` steps of 0.01 s before its episode starts (as a
    physics task's reset lets the body settle), then is pushed left or right for 16 steps."""

    def __init__(self, settle_steps):
        self.settle_steps = settle_steps
        self.spec = EnvSpec(env_id="settled", observation=observation_spec(self.reset), discrete=True,
                            num_actions=2, max_episode_steps=16)

    def reset(self, key):
        start = jax.random.uniform(key, (2,))

        def fall(position_velocity, _):
            position, velocity = position_velocity
            return (position + 0.01 * velocity, velocity - 0.0981), None

        (height, speed), _ = jax.lax.scan(fall, (start[0], start[1]), None, length=self.settle_steps)
        obs = jnp.stack([height, speed])
        return obs, (obs, jnp.int32(0))

    def step(self, key, state, action):
        obs, steps = state
        obs = obs + jnp.stack([jnp.where(action == 1, 0.1, -0.1), 0.0])
        return obs, (obs, steps + 1), -jnp.abs(obs[0]), jnp.asarray(False), steps + 1 >= 16


def test_loop_iterations_multiply_nested_scans_and_count_a_while_once():
    def settle(x):
        def outer(carry, _):
            return jax.lax.scan(lambda inner, _: (inner * 0.5, None), carry, None, length=8)[0], None

        settled = jax.lax.scan(outer, x, None, length=200)[0]
        return jax.lax.while_loop(lambda value: value < 1.0, lambda value: value + 1.0, settled)

    def branches(x):
        long = lambda value: jax.lax.scan(lambda c, _: (c + 1.0, None), value, None, length=300)[0]
        return jax.lax.cond(x > 0, long, lambda value: value, x)

    def while_around_a_scan(x):
        body = lambda value: jax.lax.scan(lambda c, _: (c + 1.0, None), value, None, length=4)[0]
        return jax.lax.while_loop(lambda value: value < 10.0, body, x)

    assert loop_iterations(jax.make_jaxpr(settle)(1.0)) == 1600
    assert loop_iterations(jax.make_jaxpr(jax.vmap(jax.jit(settle)))(jnp.ones(3))) == 1600
    assert loop_iterations(jax.make_jaxpr(branches)(1.0)) == 300
    assert loop_iterations(jax.make_jaxpr(while_around_a_scan)(1.0)) == 4
    assert loop_iterations(jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(1.0)) == 0


@pytest.mark.parametrize("settle_steps, init_runs_once", [(LONG_LOOP_ITERATIONS - 1, True),
                                                          (LONG_LOOP_ITERATIONS, False)])
def test_an_initialisation_that_loops_long_compiles_as_the_programs_that_run_many_times(
        asked_options, settle_steps, init_runs_once):
    """CheetahRun's reset settles the body for 200 physics steps: unoptimised, its first states
    took 5x as long to run as level 2 takes to compile more. Whichever level, the first state
    is the same on 1 and 2 devices."""
    from jaxddppo.training import experiment

    config = from_dict({"env": {"num_envs": 8}, "ppo": {"num_steps": 16}, "train": {"num_shards": 2}})
    objects = UserObjects(env=SettledPoint(settle_steps))
    states = []
    for num_devices in (1, 2):
        asked_options.clear()
        built = experiment.build(config, jax.devices()[:num_devices], objects)
        programs = experiment.compile_programs(built)
        # the chunk, the checksums; the init
        assert sorted(asked_options) == sorted([("cpu", False), ("cpu", False), ("cpu", init_runs_once)])
        states.append(host_leaves(programs.init(programs.inputs)))
    for one, two in zip(*states, strict=True):
        np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("setting, platform, resolved", [
    ("auto", "cpu", "on"), ("auto", "gpu", "off"), ("auto", "tpu", "off"), ("on", "gpu", "on"), ("off", "cpu", "off"),
])
def test_the_cpu_switch_resolves_auto_by_platform(setting, platform, resolved):
    from jaxddppo.config.files import from_dict

    config = resolve(from_dict({"run": {"cpu_tuning": setting}}), platform)
    assert config.run.cpu_tuning == resolved and is_on(config) == (resolved == "on")


def test_an_unresolved_switch_is_refused():
    from jaxddppo.config.files import from_dict

    with pytest.raises(ValueError, match="run.cpu_tuning=auto is decided by cpu_tuning.resolve"):
        is_on(from_dict({}))


def test_compiler_options_lower_levels_on_cpu_only():
    older_emitter = {"xla_cpu_use_fusion_emitters": False} if jax.__version_info__ < (0, 11, 1) else {}
    single_dots = ({"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
                   if jax.__version_info__ >= (0, 10) else {})
    assert compiler_options("cpu", runs_once=True) == {"xla_backend_optimization_level": 0, **older_emitter,
                                                       **single_dots}
    assert compiler_options("cpu", runs_once=False) == {"xla_backend_optimization_level": 2, **single_dots}
    assert compiler_options("gpu", runs_once=True) == compiler_options("tpu", runs_once=False) == {}


@pytest.mark.skipif(jax.__version_info__ < (0, 10), reason="jaxlib < 0.10 hands YNNPACK no fusion by default")
@pytest.mark.parametrize("runs_once", [False, True])
def test_compiler_options_keep_elementwise_fusions_out_of_the_dot_library(runs_once):
    """XLA's default hands a multiply-reduce fusion to YNNPACK (MJX's physics steps at half its
    rate so); with the options it stays XLA's own, and computes the same sums."""
    values = jnp.linspace(-1.0, 1.0, 1024 * 64, dtype=jnp.float32).reshape(1024, 64)
    lowered = jax.jit(lambda x: (x * x).sum(axis=-1)).lower(values)
    default = lowered.compile()
    tuned = lowered.compile(compiler_options=compiler_options("cpu", runs_once))
    assert "ynn_fusion" in default.as_text()
    assert "ynn_fusion" not in tuned.as_text()
    reference = (np.asarray(values, np.float64) ** 2).sum(axis=-1)
    np.testing.assert_allclose(np.asarray(tuned(values)), reference, rtol=1e-5)


@pytest.mark.slow
def test_training_with_cpu_tuning_learns_the_same_bits_on_one_and_two_devices(tmp_path):
    from jaxddppo.train import run

    def train(num_devices):
        config = {"env": {"num_envs": 8}, "ppo": {"num_steps": 16},
                  "train": {"total_env_steps": 8 * 16 * 4, "num_shards": 2}, "eval": {"num_episodes": 2},
                  "run": {"progress": False, "dir": str(tmp_path / str(num_devices)), "cpu_tuning": "on"}}
        return run(config, devices=jax.devices()[:num_devices]).summary

    one, two = train(1), train(2)
    assert np.isfinite(one["params_digest"])
    assert two["params_digest"] == one["params_digest"]


# 256 CartPoles x 16 steps, 4 minibatches: 128 environments per device on 2.
SPLIT_BASE = {"env": {"id": "CartPole-v1", "num_envs": 256}, "ppo": {"num_steps": 16, "num_minibatches": 4},
              "train": {"total_env_steps": 8192}}


@pytest.mark.parametrize("overrides, cores, expected", [
    ({}, 2, 2),
    ({}, 1, 1),
    ({"env.num_envs": 32}, 2, 2),  # 16 environments per device, the fewest a split takes
    ({"env.num_envs": 24}, 2, 1),
    ({"env.num_envs": 4}, 8, 1),
    ({"env.num_envs": 48}, 4, 3),  # 12 each on 4 devices, 16 on 3
    ({"env.num_envs": 40}, 2, 2),
    ({"env.num_envs": 40}, 4, 2),  # 10 each on 4 devices, and 3 do not divide 40
    ({"train.num_shards": 1}, 2, 1),  # the devices divide the shards the config sets
    ({"train.num_shards": 4}, 8, 4),
    ({"train.num_shards": 6, "env.num_envs": 96}, 4, 3),
    ({"train.num_shards": 8}, 2, 2),
    ({"ppo.num_steps": 1, "ppo.num_minibatches": 256}, 2, 1),  # 128 samples a shard: not 256 minibatches
])
def test_the_train_command_splits_the_cpu_as_far_as_the_sizes_allow(overrides, cores, expected):
    config = with_overrides(from_dict(SPLIT_BASE), overrides)
    assert cpu_devices_for_run(config, cores) == expected


def test_a_split_into_one_device_leaves_the_config_alone(monkeypatch):
    monkeypatch.setattr(cpu_tuning, "backend_started", lambda: False)
    monkeypatch.setattr(cpu_tuning, "accelerator_plugin_installed", lambda: False)
    config = from_dict(SPLIT_BASE)
    assert with_cpu_devices(config, 1, {}) is config
    assert with_cpu_devices(config, 2, {}).run.cpu_devices == 2


@pytest.mark.parametrize("environ, expected", [({}, 1), ({"JAX_PLATFORMS": "cpu"}, 2), ({"JAX_PLATFORMS": "cuda"}, 1)])
def test_the_cpu_is_left_alone_where_jax_would_start_on_an_accelerator(monkeypatch, environ, expected):
    monkeypatch.setattr(cpu_tuning, "backend_started", lambda: False)
    monkeypatch.setattr(cpu_tuning, "accelerator_plugin_installed", lambda: True)
    config = from_dict(SPLIT_BASE)
    assert with_cpu_devices(config, 2, environ).run.cpu_devices == (0 if expected == 1 else 2)


@pytest.mark.parametrize("entry_points, libtpu, namespace_modules, found", [
    ([], False, None, False),
    ([], False, [], False),  # an empty namespace package
    (["cuda12"], False, None, True),
    ([], True, None, True),
    ([], False, ["xla_cuda12"], True),
])
def test_an_accelerator_plugin_is_found_where_jax_looks(monkeypatch, tmp_path, entry_points, libtpu,
                                                       namespace_modules, found):
    namespace = None
    if namespace_modules is not None:
        for name in namespace_modules:
            (tmp_path / name).mkdir()
            (tmp_path / name / "__init__.py").write_text("")
        namespace = importlib.machinery.ModuleSpec("jax_plugins", None, is_package=True)
        namespace.submodule_search_locations = [str(tmp_path)]
    specs = {"libtpu": importlib.machinery.ModuleSpec("libtpu", None) if libtpu else None, "jax_plugins": namespace}
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: entry_points if group == "jax_plugins" else [])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: specs[name])
    assert cpu_tuning.accelerator_plugin_installed() == found
