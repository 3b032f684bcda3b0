"""Periodic evaluation, TensorBoard event files and the learning-curve PNG.

- The evaluation over shards equals a NumPy float64 reduction of the same
  episodes run one by one, on 1 and on 4 devices.
- A run logs evaluations exactly on its cadence, with the final policy's numbers
  on the last one; its TensorBoard scalars read back (with TensorBoard's own
  reader) equal metrics.jsonl; its learning_curve.png is a real image.
"""

import io
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxddppo import sharding
from jaxddppo.config.files import from_dict
from jaxddppo.config.options import ConfigError
from jaxddppo.distributed import global_arrays
from jaxddppo.outputs.writers import METRIC_FIELDS, Progress
from jaxddppo.train import run
from jaxddppo.training.eval_episodes import evaluate_policy
from jaxddppo.training.experiment import build

# Per-shard sums, an all-reduce, then a scale: float32 reduction order only.
EVAL_RTOL = 1e-6


def small_config(tmp_path: Path, **sections) -> dict:
    values = {
        "env": {"id": "CartPole-v1", "num_envs": 8},
        "ppo": {"num_steps": 16},
        "train": {"total_env_steps": 8 * 16 * 8, "updates_per_chunk": 2},
        "eval": {"num_episodes": 6, "every_updates": 4},
        "run": {"dir": str(tmp_path / "run"), "progress": False},
    }
    for name, overrides in sections.items():
        values[name] = {**values.get(name, {}), **overrides}
    return values


# --- the evaluation over shards ---------------------------------------------------------------------


def noisy_params(experiment):
    """Network parameters plus unit noise (the initial policy's mode balances CartPole to the
    end; a noisy one ends episodes at different times), one copy on every device."""
    obs = np.zeros((1,) + experiment.env.spec.obs_shape, np.float32)
    leaves, treedef = jax.tree.flatten(experiment.network.init(jax.random.key(0), obs))
    keys = jax.random.split(jax.random.key(42), len(leaves))
    noisy = [np.asarray(leaf + jax.random.normal(key, leaf.shape)) for leaf, key in zip(leaves, keys)]
    placement = sharding.shard_sharding(experiment.mesh, sharding.PER_MEMBER)
    return treedef.unflatten([jax.device_put(leaf, placement) for leaf in noisy])


def eval_on_shards(config_values: dict, num_devices: int, update_index: int):
    """An evaluation as the run computes it, of `noisy_params`, and those parameters."""
    experiment = build(from_dict(config_values), jax.devices()[:num_devices])
    params = noisy_params(experiment)
    update = jax.device_put(np.int32(update_index), sharding.shard_sharding(experiment.mesh, sharding.PER_MEMBER))
    stats = experiment.eval_fn()(params, None, update, experiment.shard_inputs())
    return experiment, global_arrays.local_copy(params), stats


def test_evaluation_over_shards_matches_numpy_on_1_and_4_devices(tmp_path):
    # 6 episodes on 4 shards: 2 per shard, the last 2 slots masked.
    update_index = 5
    results = {}
    for num_devices in (1, 4):
        values = small_config(tmp_path, train={"num_shards": num_devices})
        experiment, params, stats = eval_on_shards(values, num_devices, update_index)
        for field in ("return_mean", "return_std", "length_mean"):  # identical on every device
            copies = [np.asarray(copy.data) for copy in getattr(stats, field).addressable_shards]
            assert len(copies) == num_devices and all(copy == copies[0] for copy in copies), (field, copies)
        results[num_devices] = jax.tree.map(float, global_arrays.local_copy(stats))

    # The reference: each episode alone, with the key of its global index, reduced in float64.
    eval_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 3), update_index)
    evaluate_one = jax.jit(evaluate_policy, static_argnums=(0, 1, 4))
    episodes = [evaluate_one(experiment.env, experiment.network, params, jax.random.fold_in(eval_key, i), 1)
                for i in range(6)]
    returns = np.array([float(e.returns[0]) for e in episodes], np.float64)
    lengths = np.array([float(e.lengths[0]) for e in episodes], np.float64)
    assert returns.std() > 0, "the reference episodes should differ for the test to mean something"
    for num_devices, stats in results.items():
        np.testing.assert_allclose(stats.return_mean, returns.mean(), rtol=EVAL_RTOL, err_msg=str(num_devices))
        np.testing.assert_allclose(stats.return_std, returns.std(), rtol=10 * EVAL_RTOL, err_msg=str(num_devices))
        np.testing.assert_allclose(stats.length_mean, lengths.mean(), rtol=EVAL_RTOL, err_msg=str(num_devices))


@pytest.mark.parametrize("train, every, expected", [
    ({"updates_per_chunk": 2}, 3, "eval.every_updates=3 is not a multiple of train.updates_per_chunk=2"),
    ({"updates_per_chunk": 16}, 4,
     "eval.every_updates=4 is not a multiple of train.updates_per_chunk (capped at the run's 8 updates)=8"),
])
def test_eval_cadence_off_the_chunk_boundaries_is_refused(tmp_path, train, every, expected):
    values = small_config(tmp_path, train=train, eval={"every_updates": every})
    with pytest.raises(ConfigError, match=r"^" + expected.replace("(", r"\(").replace(")", r"\)")):
        build(from_dict(values), jax.devices()[:1])


def test_negative_eval_cadence_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^eval.every_updates=-1 is invalid"):
        from_dict(small_config(tmp_path, eval={"every_updates": -1}))


# --- a run: metrics.jsonl, TensorBoard, PNG ---------------------------------------------------------


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """8 updates in chunks of 2 on 2 devices, evaluated every 4, with TensorBoard."""
    tmp_path = tmp_path_factory.mktemp("logged")
    config = from_dict(small_config(tmp_path, run={"tensorboard": True}))
    result = run(config, devices=jax.devices()[:2])
    rows = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return config, result, rows


def test_run_evaluates_on_its_cadence_with_the_current_policy(logged_run):
    config, result, rows = logged_run
    assert [row["update"] for row in rows] == list(range(1, 9))
    eval_names = ("eval_return_mean", "eval_return_std", "eval_length_mean")
    for row in rows:
        assert set(row) == set(METRIC_FIELDS)
        evaluated = row["update"] % 4 == 0
        for name in eval_names:
            assert (row[name] is not None) == evaluated, (name, row)
    # The last evaluation is of the final parameters, with the key of update 8.
    experiment = build(config, jax.devices()[:2])
    final = global_arrays.local_copy(experiment.eval_fn()(result.state.params, result.state.obs_moments,
                                                     result.state.update_index, experiment.shard_inputs()))
    assert [rows[-1][name] for name in eval_names] == [
        float(final.return_mean), float(final.return_std), float(final.length_mean)
    ]
    assert 1 <= rows[-1]["eval_return_mean"] <= 500
    assert rows[-1]["eval_length_mean"] == pytest.approx(rows[-1]["eval_return_mean"])  # +1 per CartPole step


def test_tensorboard_scalars_read_back_equal_metrics_jsonl(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, result, rows = logged_run
    assert len(list(Path(result.run_dir).glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(result.run_dir, size_guidance={"scalars": 0})
    events.Reload()
    expected_tags = {name for row in rows for name, value in row.items()
                     if name not in ("update", "env_steps") and value is not None}
    assert "eval_return_mean" in expected_tags and "policy_loss" in expected_tags
    assert set(events.Tags()["scalars"]) == expected_tags
    for tag in expected_tags:
        logged = [(row["env_steps"], np.float32(row[tag])) for row in rows if row[tag] is not None]
        read = [(event.step, np.float32(event.value)) for event in events.Scalars(tag)]
        assert read == logged, tag  # TensorBoard stores float32


def test_run_ends_with_a_learning_curve_png(logged_run, assert_real_png):
    _, result, _ = logged_run
    assert_real_png(Path(result.run_dir) / "learning_curve.png")



@pytest.mark.parametrize("episode_return, shown", [(0.958, "0.958"), (487.25, "487.2"), (-3.5, "-3.500"), (None, "n/a")])
def test_progress_lines_show_returns_as_the_summary_does(episode_return, shown):
    """MiniGrid's 0.958 is not rounded to 1.0; CartPole's returns keep one decimal."""
    stream = io.StringIO()
    progress = Progress(1000, enabled=True, stream=stream)
    progress.update(500, 1234.0, episode_return)
    assert stream.getvalue() == f"[ 50.0%] env steps 500/1,000 | 1,234 steps/s | episode return {shown}\n"
