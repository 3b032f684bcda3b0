"""benchmarks/learning.py: curves from each trainer's raw outputs, medians, ranges and "time to reach" on
hand-made curves, the suites' settings, and the figure and table of a tiny real run (PureJaxRL's side
only with PUREJAXRL set to a clone of it and distrax installed)."""

import importlib.util
import json
import os
import py_compile
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT

from jaxddppo.config.files import from_dict, load_config

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import brax_peer  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import learning  # noqa: E402
import peers  # noqa: E402

Curve = learning.Curve


def test_updates_of_a_call_spread_evenly_over_it():
    # Call 1 ends at 10 s after 4 s of work: its 2 updates at 8 and 10; call 2 ends at 16 after 6: 12, 14, 16.
    assert learning.spread_over_calls([10.0, 16.0], [4.0, 6.0], [2, 3]) == [8.0, 10.0, 12.0, 14.0, 16.0]


def test_a_band_is_the_median_and_range_from_where_every_seed_has_begun_to_the_last_end():
    curves = [Curve([0, 10], [0, 10], [0.0, 10.0]),  # y = x
              Curve([0, 10], [0, 10], [2.0, 2.0]),  # y = 2
              Curve([2, 12], [2, 12], [4.0, 14.0])]  # y = x + 2
    drawn = learning.band(curves, "env_steps", points=3)
    np.testing.assert_array_equal(drawn.x, [2, 7, 12])  # from 2, where the third begins, to 12, its end
    # At 2: (2, 2, 4); at 7: (7, 2, 9); at 12: (10, 2, 14), the first two keeping their last returns.
    np.testing.assert_array_equal(drawn.median, [2, 7, 10])
    np.testing.assert_array_equal(drawn.low, [2, 2, 2])
    np.testing.assert_array_equal(drawn.high, [4, 9, 14])
    # Seeds whose seconds do not overlap: the first has ended (at 4.0) when the second begins.
    apart = learning.band([Curve([0, 1], [1, 3], [0.0, 4.0]), Curve([0, 1], [5, 6], [0.0, 1.0])], "seconds", 2)
    np.testing.assert_array_equal(apart.x, [5, 6])
    np.testing.assert_array_equal(apart.median, [2.0, 2.5])
    assert learning.band([Curve([], [], [])], "seconds").x.size == 0  # no point at all


def test_first_reach_is_the_first_point_at_or_above_the_target():
    x, y = np.array([0.0, 1.0, 2.0, 3.0]), np.array([0.0, 5.0, 3.0, 7.0])
    assert learning.first_reach(x, y, 5.0) == 1.0
    assert learning.first_reach(x, y, 6.0) == 3.0
    assert learning.first_reach(x, y, 7.5) is None


def test_jaxddppo_curves_spread_each_chunk_over_its_training_seconds():
    rows = [{"update": 1, "env_steps": 100, "wall_seconds": 4.0, "episode_return_mean": 1.0, "eval_return_mean": None,
             "seen_seconds": 10.0},
            {"update": 2, "env_steps": 200, "wall_seconds": 4.0, "episode_return_mean": None, "eval_return_mean": 5.0,
             "seen_seconds": 10.1},
            {"update": 3, "env_steps": 300, "wall_seconds": 7.0, "episode_return_mean": 3.0, "eval_return_mean": 6.0,
             "seen_seconds": 14.0}]
    # Chunk 1 (updates 1-2) trained 4 s and appeared at 10.1: updates at 8.1 and 10.1; chunk 2 trained 3 s.
    training = learning.jaxddppo_curve({"rows": rows}, "training")
    assert training == Curve([100, 300], [pytest.approx(8.1), 14.0], [1.0, 3.0])  # update 2 ended no episode
    assert learning.jaxddppo_curve({"rows": rows}, "evaluation") == Curve([200, 300], [10.1, 14.0], [5.0, 6.0])


def test_purejaxrl_curve_places_its_updates_at_a_constant_rate_after_compiling():
    outputs = {"update_env_steps": [8, 16, 24], "update_returns": [None, 2.0, 4.0], "call_start_seconds": 5.0,
               "train_seconds": 3.0}
    assert learning.purejaxrl_curve(outputs) == Curve([16, 24], [7.0, 8.0], [2.0, 4.0])


def test_brax_curve_is_its_evaluations_after_training_calls():
    outputs = {"reports": [{"step": 0, "process_seconds": 50.0, "eval/episode_reward": 1.0},
                           {"step": 10, "process_seconds": 90.0, "eval/episode_reward": 7.0}]}
    assert learning.brax_curve(outputs) == Curve([10], [90.0], [7.0])


def test_purejaxrl_episode_returns_are_the_mean_of_the_episodes_ended_in_each_update():
    # [updates=2, steps=2, envs=2]: update 0 ends episodes of 3 and 5; update 1 none.
    returns = np.array([[[3.0, 9.0], [1.0, 5.0]], [[5.0, 5.0], [5.0, 5.0]]])
    ended = np.array([[[True, False], [False, True]], [[False, False], [False, False]]])
    assert peers.episode_return_means(returns, ended) == [4.0, None]


def test_final_returns():
    spec = {"num_envs": 2, "num_steps": 5, "total_env_steps": 200}  # 20 updates of 10 steps
    updates = range(1, 21)
    curve = Curve([10 * update for update in updates], list(updates), [float(update) for update in updates])
    assert learning.final_return(curve, "training", spec) == np.mean(range(5, 21))  # the last 16 updates
    assert learning.final_return(curve, "evaluation", spec) == 20.0


def test_the_final_return_counts_updates_not_points():
    # Episodes that all end together, in one update of 6 (updates 4, 10 and 16 of 20): the last 16
    # updates (5-20) hold the points of updates 10 and 16 only.
    spec = {"num_envs": 2, "num_steps": 5, "total_env_steps": 200}
    ended = [4, 10, 16]
    curve = Curve([10 * update for update in ended], ended, [1.0, 2.0, 4.0])
    assert learning.final_return(curve, "training", spec) == np.mean([2.0, 4.0])
    # No episode ended in the last 16 updates: the last update in which some did.
    early = Curve([10, 20], [1, 2], [3.0, 5.0])
    assert learning.final_return(early, "training", spec) == 5.0
    # No episode ended in the whole run (a budget shorter than one Freeway episode): no number.
    assert np.isnan(learning.final_return(Curve([], [], []), "training", spec))


def test_modules_without_compiled_bytecode_are_named(tmp_path, monkeypatch):
    for name in ("compiled_module", "source_only_module"):
        (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    py_compile.compile(str(tmp_path / "compiled_module.py"),
                       cfile=importlib.util.cache_from_source(str(tmp_path / "compiled_module.py")))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert learning.uncached_bytecode(["compiled_module", "source_only_module", "no_such_module"]) == \
        ["source_only_module"]


def test_the_minatar_suite_has_purejaxrls_settings_and_experiments_minatar_yaml_is_them():
    chosen = learning.suite("minatar")
    assert list(chosen.specs) == ["Breakout-MinAtar", "Asterix-MinAtar", "Freeway-MinAtar", "SpaceInvaders-MinAtar"]
    assert chosen.seeds == 3 and chosen.reference == "purejaxrl"
    spec = chosen.specs["Breakout-MinAtar"]
    assert spec["total_env_steps"] == 1220 * 64 * 128  # 1e7 rounded down to whole updates, as PureJaxRL does
    written = from_dict(learning.jaxddppo_config("minatar", spec, 1, Path("run")))
    experiment = load_config(str(REPO_ROOT / "experiments" / "minatar.yaml"))
    assert (written.env, written.network, written.ppo) == (experiment.env, experiment.network, experiment.ppo)
    assert written.train.seed == 1 and written.run.compilation_cache == "off" and written.run.cpu_devices == 0
    one_device = learning.suite("minatar", ["Breakout-MinAtar"], cpu_devices=1).specs["Breakout-MinAtar"]
    assert from_dict(learning.jaxddppo_config("minatar", one_device, 0, Path("run"))).run.cpu_devices == 1
    assert experiment.train.total_env_steps == 10_000_000
    pure = peers.purejaxrl_config(learning.purejaxrl_spec(spec))
    assert (pure["NUM_ENVS"], pure["NUM_STEPS"], pure["UPDATE_EPOCHS"], pure["NUM_MINIBATCHES"]) == (64, 128, 4, 8)
    assert (pure["LR"], pure["ANNEAL_LR"], pure["ACTIVATION"]) == (5e-3, True, "relu")
    assert learning.suite("minatar", ["Freeway-MinAtar"], 2, 200_000).specs["Freeway-MinAtar"]["total_env_steps"] == \
        24 * 64 * 128


def test_playground_budgets_split_into_brax_evaluation_intervals():
    per_update = 2048 * 480
    defaults = learning.suite("playground")
    assert list(defaults.specs) == ["CartpoleBalance", "CheetahRun", "WalkerWalk"] and defaults.seeds == 2
    # Three updates, an evaluation after each.
    assert {(spec["total_env_steps"], spec["num_evals"]) for spec in defaults.specs.values()} == {(3 * per_update, 4)}
    spec = learning.playground_spec("CheetahRun", 9 * per_update)
    assert (spec["num_steps"], spec["num_evals"], spec["eval_every_updates"]) == (480, 10, 1)
    assert learning.playground_spec("CheetahRun", 18 * per_update)["eval_every_updates"] == 2
    small = learning.playground_spec("CheetahRun", 1)  # one update, one evaluation after it
    assert (small["total_env_steps"], small["num_evals"], small["eval_every_updates"]) == (per_update, 2, 1)
    three = learning.playground_spec("WalkerWalk", 2 * per_update + 1)
    assert (three["total_env_steps"], three["num_evals"]) == (3 * per_update, 4)

    config = learning.jaxddppo_config("playground", spec, 1, Path("run"))
    assert config["env"]["id"] == "playground:CheetahRun"
    # jaxddppo accepts every key and value (validated on a core environment: no playground needed).
    validated = from_dict({**config, "env": {**config["env"], "id": "Pendulum-v1"}})
    assert (validated.env.num_envs, validated.ppo.num_steps, validated.ppo.num_minibatches,
            validated.ppo.num_epochs) == (2048, 480, 32, 16)
    assert validated.eval.every_updates == validated.train.updates_per_chunk == 1
    assert (validated.ppo.clip_eps, validated.ppo.ent_coef, validated.ppo.gamma) == (0.3, 0.01, 0.995)
    assert validated.ppo.segment_length == 30  # Brax recomputes advantages per 30-step trajectory
    # Brax's default networks: a 4 x 32 policy, a 5 x 256 value MLP.
    assert (validated.network.actor_hidden_sizes, validated.network.hidden_sizes) == ((32,) * 4, (256,) * 5)
    # experiments/playground_dm_control.yaml is these settings (at Playground's own budget).
    experiment = load_config(str(REPO_ROOT / "experiments" / "playground_dm_control.yaml"), ["env.id=Pendulum-v1"])
    assert (experiment.env, experiment.network, experiment.ppo) == (validated.env, validated.network, validated.ppo)
    assert experiment.eval.num_episodes == validated.eval.num_episodes == 128
    assert experiment.train.total_env_steps == 60_000_000

    out = Path("result.json")
    brax = brax_peer.parse_args(learning.reference_arguments("playground", spec, 1, out, None)[1:])
    assert brax.playground_settings and brax.task == "CheetahRun" and brax.seed == 1
    assert (brax.total_env_steps, brax.num_evals, brax.eval_episodes) == (9 * per_update, 10, 128)


def brax_updates(settings):
    """The updates Brax 0.14.2's PPO trains with these settings (brax/training/agents/ppo/train.py)."""
    per_update = (settings["batch_size"] * settings["unroll_length"] * settings["num_minibatches"]
                  * settings["action_repeat"])
    intervals, groups = max(settings["num_evals"] - 1, 1), max(settings["num_resets_per_eval"], 1)
    return intervals * groups * int(np.ceil(settings["num_timesteps"] / (intervals * per_update * groups)))


def test_brax_trains_the_playground_budget_exactly_restarting_after_every_update():
    per_update = 1024 * 30 * 32
    # Playground 0.2.0's DM Control settings: at its own 6e7 steps Brax trains 90 updates, a restart after each.
    playground = {"batch_size": 1024, "unroll_length": 30, "num_minibatches": 32, "action_repeat": 1,
                  "num_timesteps": 60_000_000, "num_evals": 10, "num_resets_per_eval": 10}
    assert brax_updates(playground) == 90
    for updates, num_evals in ((1, 2), (3, 4), (9, 10), (18, 10)):
        settings = {**playground, "num_timesteps": updates * per_update, "num_evals": num_evals}
        assert brax_updates(settings) >= 10  # as Playground sets it: at least 10 updates an interval
        resets = brax_peer.resets_per_eval(settings)
        assert brax_updates({**settings, "num_resets_per_eval": resets}) == updates
        # One update per group: a restart after every update, as at Playground's own budget.
        assert resets * (num_evals - 1) == updates
    no_restarts = {**playground, "num_timesteps": 2 * per_update, "num_evals": 3, "num_resets_per_eval": 0}
    assert brax_peer.resets_per_eval(no_restarts) == 0
    for steps, num_evals in ((per_update + 1, 2), (2 * per_update, 4)):
        with pytest.raises(ValueError, match=f"--total-env-steps={steps} is not"):
            brax_peer.resets_per_eval({**playground, "num_timesteps": steps, "num_evals": num_evals})


def test_arguments_are_checked(tmp_path, capsys):
    for arguments, message in ((["--out", "x"], "give --suite NAME to train, or --report RECORD"),
                               (["--suite", "minatar", "--out", "x"], "needs --purejaxrl PATH"),
                               (["--suite", "playground", "--tasks", "Pong", "--out", "x"], "--tasks=Pong is not"),
                               (["--suite", "playground", "--seeds", "0", "--out", "x"], "--seeds=0 must be"),
                               (["--suite", "playground", "--jaxddppo-cpu-devices", "-1", "--out", "x"],
                                "--jaxddppo-cpu-devices=-1 must be"),
                               (["--suite", "playground", "--purejaxrl", "p", "--out", "x"], "read only by"),
                               (["--report", str(tmp_path / "none.json"), "--out", "x"], "is not a file"),
                               (["--report", "r.json", "--resume", "--out", "x"], "not --report")):
        with pytest.raises(SystemExit) as exit_info:
            learning.parse_args(arguments)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------- resuming a record


# The sizes of a made-up trial: two updates of 8 steps.
MADE_UP_SPEC = {"num_envs": 2, "num_steps": 4, "total_env_steps": 16}


def made_up_trial(trainer: str, task: str, seed: int) -> dict:
    """What run_trial returns for jaxddppo or PureJaxRL, without running anything: two updates."""
    if trainer == "jaxddppo":
        rows = [{"update": update, "env_steps": 8 * update, "wall_seconds": 1.0, "episode_return_mean": 1.0 + seed,
                 "eval_return_mean": None, "seen_seconds": 2.0} for update in (1, 2)]
        outputs = {"rows": rows, "summary": {"compile_seconds": 0.5, "eval_return_mean": 1.5}}
    else:
        outputs = {"update_env_steps": [8, 16], "update_returns": [1.0, 2.0 + seed], "call_start_seconds": 1.0,
                   "train_seconds": 1.0, "compile_seconds": 0.5}
    return {"trainer": trainer, "seed": seed, "command": ["made-up"], "config": None, "wall_seconds": 3.0 + seed,
            "peak_rss_mb": 1.0, "jaxddppo_revision": None, "outputs": outputs}


def test_a_run_saves_after_each_trial_and_runs_only_what_the_record_lacks():
    chosen = learning.Suite("minatar", {"A": MADE_UP_SPEC, "B": MADE_UP_SPEC}, seeds=2, curve="training")
    run, saved = [], []
    first = learning.measure(chosen, lambda *trial: run.append(trial) or made_up_trial(*trial), ("purejaxrl",),
                             after_trial=lambda trials: saved.append(len(trials)))
    assert run == [("purejaxrl", "A", 0), ("purejaxrl", "B", 0), ("purejaxrl", "A", 1), ("purejaxrl", "B", 1)]
    assert saved == [1, 2, 3, 4]

    run.clear()
    more = learning.Suite("minatar", {"A": MADE_UP_SPEC, "B": MADE_UP_SPEC}, seeds=3, curve="training")
    trials = learning.measure(more, lambda *trial: run.append(trial) or made_up_trial(*trial), ("purejaxrl",),
                              done=first[:3])
    assert run == [("purejaxrl", "B", 1), ("purejaxrl", "A", 2), ("purejaxrl", "B", 2)]
    assert trials[:3] == first[:3] and [(t["task"], t["seed"]) for t in trials[3:]] == [("B", 1), ("A", 2), ("B", 2)]


@pytest.fixture
def breakout_record(tmp_path):
    """OUT/minatar.json of a 1-seed Breakout suite at 8,192 steps whose trials are all made up, and the
    arguments that continue it."""
    purejaxrl = tmp_path / "purejaxrl"
    (purejaxrl / "purejaxrl").mkdir(parents=True)
    (purejaxrl / "purejaxrl" / "ppo.py").write_text("")
    chosen = learning.suite("minatar", ["Breakout-MinAtar"], 1, 8192, 1)
    trials = learning.measure(chosen, made_up_trial, ("jaxddppo", "purejaxrl"))
    record = learning.build_record(chosen, trials, "made up", purejaxrl.resolve(),
                                   learning.cpu_description(learning.read_cpuinfo()))
    out = tmp_path / "out"
    out.mkdir()
    (out / "minatar.json").write_text(json.dumps(record))
    return out, ["--suite", "minatar", "--tasks", "Breakout-MinAtar", "--seeds", "1", "--total-env-steps", "8192",
                 "--jaxddppo-cpu-devices", "1", "--purejaxrl", str(purejaxrl), "--out", str(out)]


def test_resume_refuses_another_runs_record_and_a_record_is_never_overwritten(breakout_record, capsys):
    out, arguments = breakout_record
    before = (out / "minatar.json").read_bytes()
    assert learning.main(arguments) == learning.EXIT_BAD_ARGUMENTS
    assert capsys.readouterr().err == f"error: {out / 'minatar.json'} exists: --resume continues its run, or give " \
        "another --out\n"
    longer = [*arguments[:7], "16384", *arguments[8:], "--resume"]
    assert learning.main(longer) == learning.EXIT_BAD_ARGUMENTS
    assert capsys.readouterr().err == (f"error: --resume: {out / 'minatar.json'} trained Breakout-MinAtar with "
                                       "total_env_steps=8192, this run total_env_steps=16384\n")
    (out / "other.json").write_text("[1, 2]")
    previous, problem = learning.record_to_resume(out / "other.json", {})
    assert previous is None and problem.startswith(f"--resume: {out / 'other.json'} is not a record")
    assert (out / "minatar.json").read_bytes() == before


def test_resume_of_a_finished_record_trains_nothing_and_draws_the_report(breakout_record, capsys):
    out, arguments = breakout_record
    record = json.loads((out / "minatar.json").read_text())
    assert learning.main([*arguments, "--resume"]) == 0
    assert "2 trial(s) already in" in capsys.readouterr().out
    assert json.loads((out / "minatar.json").read_text())["trials"] == record["trials"]
    assert (out / "minatar.png").is_file() and (out / "minatar.md").is_file()


# ---------------------------------------------------------------- a tiny real run

# CartPole in a few seconds a trial: 8 updates of 8 envs x 32 steps.
TINY = {**learning.MINATAR_SETTINGS, "env_id": "CartPole-v1", "num_envs": 8, "num_steps": 32, "num_epochs": 2,
        "num_minibatches": 2, "activation": "tanh", "learning_rate": 2.5e-3, "total_env_steps": 8 * 8 * 32}
PUREJAXRL = os.environ.get("PUREJAXRL")
WITH_PUREJAXRL = bool(PUREJAXRL) and importlib.util.find_spec("distrax") is not None


def test_the_report_derives_the_numbers_again_from_the_raw_outputs(breakout_record, tmp_path):
    out, _ = breakout_record
    record = json.loads((out / "minatar.json").read_text())
    stale = {**record, "trials": [{**trial, "final_return": 1234.5} for trial in record["trials"]]}
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    assert learning.main(["--report", str(tmp_path / "stale.json"), "--out", str(tmp_path)]) == 0
    assert learning.remeasured(stale)["trials"] == record["trials"]
    assert "1,234.5" not in (tmp_path / "minatar.md").read_text()


@pytest.fixture(scope="module")
def tiny_record(tmp_path_factory):
    """A record of 2 seeds of the tiny config: jaxddppo, and PureJaxRL where it can run."""
    chosen = learning.Suite("minatar", {"CartPole-v1": TINY}, seeds=2, curve="training")
    purejaxrl = Path(PUREJAXRL) if WITH_PUREJAXRL else None
    trainers = ("jaxddppo", "purejaxrl") if WITH_PUREJAXRL else ("jaxddppo",)
    trials = learning.measure(chosen, lambda trainer, task, seed: learning.run_trial(
        trainer, "minatar", TINY, seed, purejaxrl, timeout=300), trainers)
    record = learning.build_record(chosen, trials, "test", purejaxrl, {"cpu_model": None, "cpu_vector_isa": []})
    path = tmp_path_factory.mktemp("learning") / "minatar.json"
    path.write_text(json.dumps(record))
    return path


def check_png(path: Path, width: int, height: int) -> None:
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (width, height)
    with Image.open(path) as image:
        image.load()


def table_numbers(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_a_tiny_run_records_curves_and_the_report_shows_their_medians(tiny_record, tmp_path, capsys):
    record = json.loads(tiny_record.read_text())
    ours = [trial for trial in record["trials"] if trial["trainer"] == "jaxddppo"]
    assert [trial["seed"] for trial in ours] == [0, 1]
    for trial in ours:
        curve = trial["curve"]
        assert curve["env_steps"] == sorted(curve["env_steps"]) and curve["env_steps"][-1] == 8 * 8 * 32
        assert 0 < trial["compile_seconds"] < curve["seconds"][0] < curve["seconds"][-1] < trial["wall_seconds"]
        assert trial["config"]["train"]["seed"] == trial["seed"] and trial["eval_return"] is not None
        assert len(trial["outputs"]["rows"]) == 8

    assert learning.main(["--report", str(tiny_record), "--out", str(tmp_path)]) == 0
    check_png(tmp_path / "minatar.png", 450, 700)
    assert learning.draw_figure(record, tmp_path / "again.png") == [
        "CartPole-v1, by env steps", "CartPole-v1, by seconds"]
    lines = (tmp_path / "minatar.md").read_text().splitlines()
    assert len(lines) == 3 and capsys.readouterr().out.startswith(lines[0])
    cells = table_numbers(lines[2])
    finals = sorted(trial["final_return"] for trial in ours)
    assert cells[1] == f"{np.median(finals):,.1f} ({finals[0]:,.1f}-{finals[1]:,.1f})"
    evaluations = sorted(trial["eval_return"] for trial in ours)
    assert cells[3] == f"{np.median(evaluations):,.1f} ({evaluations[0]:,.1f}-{evaluations[1]:,.1f})"
    assert cells[5] == f"{np.median([trial['compile_seconds'] for trial in ours]):,.1f}"
    if not WITH_PUREJAXRL:
        assert cells[2] == cells[4] == cells[6] == "-" and cells[9:] == ["-", "-"]


@pytest.mark.skipif(not WITH_PUREJAXRL, reason="set PUREJAXRL to a clone of PureJaxRL, with distrax installed")
def test_purejaxrl_trials_alternate_with_jaxddppos_and_the_table_compares_them(tiny_record):
    record = json.loads(tiny_record.read_text())
    assert [(trial["trainer"], trial["seed"]) for trial in record["trials"]] == [
        ("jaxddppo", 0), ("purejaxrl", 0), ("jaxddppo", 1), ("purejaxrl", 1)]
    theirs = [trial for trial in record["trials"] if trial["trainer"] == "purejaxrl"]
    for trial in theirs:
        assert trial["curve"]["env_steps"][-1] == 8 * 8 * 32 and trial["eval_return"] is None
        assert trial["compile_seconds"] < trial["curve"]["seconds"][0] < trial["wall_seconds"]
    (row,) = learning.summary_rows(record)
    finals = [trial["final_return"] for trial in theirs]
    assert row["purejaxrl_final_return"] == np.median(finals) and row["purejaxrl_final_return_range"] == sorted(finals)
    cells = table_numbers(learning.format_table(record).splitlines()[2])
    assert cells[2] == f"{np.median(finals):,.1f} ({min(finals):,.1f}-{max(finals):,.1f})"
    ours = learning.band(learning.curves_of(record, "CartPole-v1", "jaxddppo"), "seconds")
    expected = learning.first_reach(ours.x, ours.median, np.median(finals))
    assert cells[10] == ("not reached" if expected is None else f"{expected:,.0f}")


@pytest.mark.skipif(importlib.util.find_spec("mujoco_playground") is None, reason="needs playground (its extra)")
def test_the_playground_settings_are_playgrounds_own():
    from mujoco_playground.config import dm_control_suite_params

    ours = learning.PLAYGROUND_SETTINGS
    for task in learning.PLAYGROUND_TASKS:
        own = dm_control_suite_params.brax_ppo_config(task)
        assert (own.num_envs, own.unroll_length, own.batch_size, own.num_minibatches, own.num_updates_per_batch,
                own.learning_rate, own.entropy_cost, own.discounting, own.reward_scaling, own.num_evals,
                own.normalize_observations) == (
            ours["num_envs"], ours["unroll_length"], ours["batch_size"], ours["num_minibatches"], ours["num_epochs"],
            ours["learning_rate"], ours["ent_coef"], ours["gamma"], ours["reward_scaling"], ours["num_evals"],
            ours["normalize_observations"])
