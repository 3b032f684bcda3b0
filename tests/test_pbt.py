"""Population-based training (docs/sweeps.md#pbt).

- The exploit copies exactly the winner's state into each loser, and nothing else moves; no
  device gathers the population's states.
- Ranking: NaN lowest, ties by member index; perturbed and resampled values stay in bounds.
- A PBT sweep makes the same decisions and, with train.batch_members=false, the same bits on
  1, 2 and 4 devices, and stopped and resumed it ends as the sweep done in one go.
- Bad input: one line, exit code 2; a single run refuses PBT.
- pbt.jsonl, sweep.csv's lineage and pbt.png say what happened.
- Slow: the benchmark's claim (benchmarks/pbt.py).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PNG_SIGNATURE, host_leaves, subprocess_env

import jaxddppo
from jaxddppo import sharding
from jaxddppo.config.files import from_dict, with_overrides
from jaxddppo.config.options import TRACED_BOUNDS, TRACED_KEYS, ConfigError, PBTConfig, PPOConfig
from jaxddppo.distributed import global_arrays
from jaxddppo.ppo import PPOHyperparams
from jaxddppo.sweep import resume_sweep
from jaxddppo.training import pbt

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMES = tuple(PPOHyperparams.__dataclass_fields__)

# 4 members (4 learning rates), 2 shards each, 32 updates of 2 x 16 steps; PBT every 8 updates.
SMALL = {
    "env": {"id": "CartPole-v1", "num_envs": 4},
    "ppo": {"num_steps": 16},
    "train": {"total_env_steps": 2048, "updates_per_chunk": 8, "num_shards": 2, "batch_members": False},
    "eval": {"num_episodes": 4},
    "run": {"progress": False},
    "pbt": {"every_updates": 8, "quantile": 0.5},
}
GRID = {"ppo.learning_rate": [1e-4, 3e-4, 1e-3, 3e-3]}


def hyperparams_of(values: dict[str, list[float]]) -> PPOHyperparams:
    defaults = PPOHyperparams.from_config(from_dict({}).ppo)
    size = len(next(iter(values.values())))
    return PPOHyperparams(**{name: jnp.asarray(values.get(name, [float(getattr(defaults, name))] * size), jnp.float32)
                             for name in NAMES})


def settings(num_members: int, quantile: float = 0.25, **changes) -> pbt.PBTSettings:
    hyperparams = [{name: 0.5 for name in NAMES} for _ in range(num_members)]
    hyperparams[0]["learning_rate"] = 1e-3
    base = pbt.PBTSettings.from_config(PBTConfig(every_updates=4, quantile=quantile), hyperparams,
                                       ["ppo.learning_rate"], last_update=100)
    return base if not changes else pbt.PBTSettings(**{**vars(base), **changes})


def test_ranking_puts_nan_last_and_breaks_ties_by_member():
    order = pbt.ranking(jnp.array([1.0, jnp.nan, 3.0, 1.0, jnp.nan, 3.0]))
    assert order.tolist() == [2, 5, 0, 3, 1, 4]


def test_losers_are_the_quantile_rounded_up_at_most_half():
    assert [pbt.losers_of(n, 0.25) for n in (2, 3, 4, 5, 8, 9)] == [1, 1, 1, 2, 2, 3]
    assert pbt.losers_of(5, 0.5) == 2


def bits(leaf: np.ndarray) -> np.ndarray:
    return np.atleast_1d(leaf).view(np.uint8) if leaf.dtype != np.bool_ else leaf


def test_exploit_copies_exactly_the_winners_state():
    """Synthetic fitness on a 2 x 2 mesh, 4 members: member 1 (worst, on the
    first member device) copies member 2 (best, on the second) bit for bit, -0.0 and NaN
    payloads, integers, booleans and 16-bit floats alike; the others keep their own; the
    record names who copied whom. No member's state is gathered: the program's all-gathers
    (fitness, hyperparameters) hold one value per member."""
    num_members = 4
    mesh = sharding.make_population_mesh(2, 2, jax.devices()[:4])
    rng = np.random.default_rng(0)
    params = rng.normal(size=(num_members, 3, 5)).astype(np.float32)
    params[2, 0, :2] = [-0.0, np.uint32(0x7FC0_1234).view(np.float32)]
    carried = {"params": params, "count": np.arange(num_members, dtype=np.int32),
               "flag": np.array([False, False, True, False]),
               "half": jnp.asarray(rng.normal(size=(num_members, 7)), jnp.bfloat16)}
    hyperparams = hyperparams_of({"learning_rate": [1e-4, 3e-4, 1e-3, 3e-3]})
    state = jax.vmap(pbt.init_pbt_state)(hyperparams, jnp.repeat(jax.random.key(0)[None], num_members))
    fitness = np.array([5.0, 1.0, 9.0, 7.0], np.float32)
    the_settings = settings(num_members)

    def step(carried, state, fitness):  # keys pass as their raw data (host arrays)
        state = state.replace(key=jax.random.wrap_key_data(state.key))
        carried, state = pbt.exploit(the_settings, carried, state, fitness, jnp.int32(4))
        return carried, state.replace(key=jax.random.key_data(state.key))

    member = sharding.PER_MEMBER
    run = sharding.shard_parallel(step, mesh, over_members=False, in_layouts=(member, member, member),
                                  out_layouts=member)
    state = state.replace(key=jax.random.key_data(state.key))
    arguments = global_arrays.put_members((carried, state, fitness), mesh, member)
    gathered = [line for line in run.lower(*arguments).compile().as_text().splitlines()
                if " all-gather(" in line or " all-gather-start(" in line]
    gathered_shapes = {shape for line in gathered
                       for shape in re.findall(r"\[([0-9,]*)\]", line.split("=", 1)[1].split("all-gather")[0])}
    assert gathered and gathered_shapes == {str(num_members)}, gathered
    new_carried, new_state = run(*arguments)
    got = jax.tree.map(np.asarray, global_arrays.all_shards(new_carried))
    carried = jax.tree.map(np.asarray, carried)
    for name in carried:
        np.testing.assert_array_equal(bits(got[name][[0, 2, 3]]), bits(carried[name][[0, 2, 3]]))
        np.testing.assert_array_equal(bits(got[name][1]), bits(carried[name][2]))
    record = global_arrays.all_shards(new_state)
    assert np.asarray(record.copied_from).tolist() == [-1, 2, -1, -1]
    learning_rates = np.asarray(record.hyperparams.learning_rate)
    np.testing.assert_array_equal(learning_rates[[0, 2, 3]], np.asarray(hyperparams.learning_rate)[[0, 2, 3]])
    assert learning_rates[1] != np.float32(3e-4)
    np.testing.assert_array_equal(np.asarray(record.previous.learning_rate), hyperparams.learning_rate)
    assert np.asarray(record.episodes).sum() == 0


@pytest.mark.parametrize("resample_probability", [0.0, 0.5, 1.0])
def test_perturbation_stays_inside_the_bounds(resample_probability):
    """Values at and beyond every key's bounds, perturbed 200 times: each new value is the
    copied value times a factor, or a grid value, clipped to TRACED_BOUNDS; keys PBT leaves alone
    are the copied member's."""
    num_members = 8
    extremes = {name: [low, high, low * 0.5, high * 2.0 + 1.0, (low + high) / 2] * 2 for name, (low, high)
                in TRACED_BOUNDS.items()}
    values = {name: [float(v) for v in extreme[:num_members]] for name, extreme in extremes.items()}
    hyperparams = hyperparams_of(values)
    the_settings = settings(num_members, quantile=0.5, keys=tuple(TRACED_BOUNDS), reported=tuple(TRACED_BOUNDS),
                            grid_values=tuple((0.1, 0.9) for _ in TRACED_BOUNDS), perturb=(0.5, 3.0),
                            resample_probability=resample_probability)
    decide = jax.jit(lambda fitness, key: pbt.decide(the_settings, fitness, hyperparams, key))
    fitness = jnp.arange(num_members, dtype=jnp.float32)
    for draw in range(200):
        decision = decide(fitness, jax.random.key(draw))
        source = np.asarray(decision.source)
        np.testing.assert_array_equal(source[4:], np.arange(4, 8))  # the winners keep their own
        assert set(source[:4].tolist()) <= {4, 5, 6, 7}
        for name, (low, high) in TRACED_BOUNDS.items():
            new = np.asarray(getattr(decision.hyperparams, name))
            copied = np.asarray(getattr(hyperparams, name))[source]
            assert np.all((new[:4] >= np.float32(low)) & (new[:4] <= np.float32(high))), (name, new)
            candidates = [np.clip(copied[:4] * np.float32(f), np.float32(low), np.float32(high)) for f in (0.5, 3.0)]
            candidates += [np.clip(np.full(4, np.float32(g)), np.float32(low), np.float32(high)) for g in (0.1, 0.9)]
            if resample_probability == 0.0:
                candidates = candidates[:2]
            if resample_probability == 1.0:
                candidates = candidates[2:]
            assert np.all(np.any(np.stack(candidates) == new[:4], axis=0)), (name, new, copied)
            np.testing.assert_array_equal(new[4:], copied[4:])


def test_every_float_of_the_update_is_traced_with_bounds_that_pbt_keys_accepts():
    """One declaration (config/options.py's `traced_bounds`) gives the keys of a grid, of `pbt.keys`,
    of PPOHyperparams and of PBT's clipping: a float option without one would be neither
    sweepable nor explorable, where it once passed `pbt.keys` and failed inside PBT."""
    floats = [fld.name for fld in dataclasses.fields(PPOConfig) if fld.type == "float"]
    assert list(TRACED_BOUNDS) == floats and NAMES == tuple(floats)
    every_key = with_overrides(from_dict(SMALL), {"pbt.keys": [f"ppo.{name}" for name in floats]})
    assert every_key.pbt.keys == TRACED_KEYS
    with pytest.raises(ConfigError, match=r"ppo\.num_epochs is not one of ppo\.learning_rate, ppo\.adam_eps"):
        with_overrides(from_dict(SMALL), {"pbt.keys": ["ppo.num_epochs"]})


# --- a PBT sweep end to end ----------------------------------------------------------------------


def pbt_sweep(run_dir: Path, num_devices: int, member_devices=None, stop_after_updates=None):
    config = with_overrides(from_dict(SMALL), {"run.dir": str(run_dir)})
    return jaxddppo.run_sweep(config, GRID, member_devices=member_devices, devices=jax.devices()[:num_devices],
                              stop_after_updates=stop_after_updates)


def pbt_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "pbt.jsonl").read_text().splitlines()]


def without_wall_time(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = sorted(rows, key=lambda row: (row["member"], row["update"]))  # a chunk's rows go member after member
    return [{k: v for k, v in row.items() if k != "wall_seconds"} for row in rows]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return pbt_sweep(tmp_path_factory.mktemp("pbt") / "run", 1)


def test_pbt_sweep_logs_exploits_lineage_and_schedules(one_device, assert_real_png):
    run_dir = Path(one_device.run_dir)
    rows = pbt_rows(run_dir)
    assert [row["member"] for row in rows if row["update"] == 0] == [0, 1, 2, 3]
    exploits = [row for row in rows if row["update"] > 0]
    assert exploits and {row["update"] for row in exploits} <= {8, 16, 24}  # none after the last update
    for row in exploits:
        assert row["copied_from"] != row["member"] and row["source_fitness"] >= row["fitness"]
        assert set(row["old"]) == set(row["new"]) == {"ppo.learning_rate"}
    with open(run_dir / "sweep.csv", newline="") as handle:
        members = list(csv.DictReader(handle))
    lineage = pbt.lineages(rows, 4)
    for member in members:
        index = int(member["member"])
        assert member["lineage"] == lineage[index]
        assert int(member["exploits"]) == sum(row["member"] == index for row in exploits)
        mine = [row for row in rows if row["member"] == index]
        assert float(member["final_ppo.learning_rate"]) == mine[-1]["new"]["ppo.learning_rate"]
    assert (run_dir / "pbt.png").read_bytes()[:8] == PNG_SIGNATURE
    result = subprocess.run([sys.executable, "-m", "jaxddppo.plot", str(run_dir), "-o", str(run_dir / "again.png")],
                            env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (run_dir / "again.png").read_bytes()[:8] == PNG_SIGNATURE


def test_pbt_sweep_is_the_same_on_1_2_and_4_devices_and_resumes_bit_for_bit(one_device, tmp_path):
    """batch_members=false: the same decisions and the same bits on a 2 x 2 mesh, and on 2
    devices stopped after 12 updates (between two exploits) and resumed."""
    reference = Path(one_device.run_dir)
    four = pbt_sweep(tmp_path / "four", 4, member_devices=2)
    assert four.summary["member_devices"] == 2 and four.summary["shard_devices"] == 2
    stopped = pbt_sweep(tmp_path / "two", 2, stop_after_updates=12)
    assert stopped.counters.update == 12
    resumed = resume_sweep(str(tmp_path / "two"), devices=jax.devices()[:2])
    for other in (four, resumed):
        assert pbt_rows(Path(other.run_dir)) == pbt_rows(reference)
        assert without_wall_time(Path(other.run_dir)) == without_wall_time(reference)
        for got, want in zip(host_leaves(other.state), host_leaves(one_device.state), strict=True):
            np.testing.assert_array_equal(got, want)
        assert other.members == one_device.members


def test_eval_return_fitness_is_the_evaluation_of_batched_members(tmp_path):
    """pbt.fitness=eval_return with the members batched: a copied member, which keeps its
    state, ranked by the return that the periodic evaluation logs for it at that update."""
    run_dir = tmp_path / "run"
    config = with_overrides(from_dict(SMALL), {"run.dir": str(run_dir), "pbt.fitness": "eval_return",
                                               "eval.every_updates": 8, "train.batch_members": True})
    jaxddppo.run_sweep(config, GRID, devices=jax.devices()[:2])
    logged = {(row["member"], row["update"]): row["eval_return_mean"] for row in without_wall_time(run_dir)
              if row["eval_return_mean"] is not None}
    exploits = [row for row in pbt_rows(run_dir) if row["update"] > 0]
    assert exploits
    for row in exploits:
        assert row["source_fitness"] == pytest.approx(logged[(row["copied_from"], row["update"])], rel=1e-6)
        assert row["source_fitness"] >= row["fitness"]


def test_single_runs_and_populations_of_one_refuse_pbt(tmp_path):
    config = with_overrides(from_dict(SMALL), {"run.dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match=r"^pbt.every_updates=8 is for a sweep's population"):
        jaxddppo.run(config, devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"^pbt.every_updates=8 needs a population of at least 2 members"):
        jaxddppo.run_sweep(config, devices=jax.devices()[:1])


@pytest.mark.parametrize("override, expected", [
    ("pbt.quantile=0.75", "error: pbt.quantile=0.75 is invalid: must be in (0, 0.5]"),
    ("pbt.perturb=[0.8,-1]", "error: pbt.perturb=[0.8, -1.0] is invalid: needs at least one factor, every factor "
                             "finite and > 0"),
    ("pbt.keys=[ppo.num_steps]", "error: pbt.keys=['ppo.num_steps'] is invalid: ppo.num_steps is not one of"),
    ("pbt.resample_probability=2", "error: pbt.resample_probability=2.0 is invalid: must be in [0, 1]"),
])
def test_bad_pbt_values_are_one_line_and_exit_2(tmp_path, override, expected):
    result = subprocess.run([sys.executable, "-m", "jaxddppo.sweep", "--config",
                             str(REPO_ROOT / "experiments" / "cartpole.yaml"), "--seeds", "2",
                             "pbt.every_updates=4", override, f"run.dir={tmp_path / 'run'}"],
                            env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(expected), result.stderr


@pytest.mark.slow
def test_pbt_benchmark_beats_the_fixed_grid(tmp_path):
    """benchmarks/pbt.py's claim: over 3 seeds of the whole experiment, the PBT population's
    median final return is above the fixed grid's and its best at least the grid's best."""
    out = tmp_path / "pbt.json"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "pbt.py"),
                             "--out", str(out), "--work-dir", str(tmp_path / "runs")],
                            env=subprocess_env(2), capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["learning"]["pbt"]["median"] > record["learning"]["grid"]["median"]
    assert record["learning"]["pbt"]["best"] >= record["learning"]["grid"]["best"]
