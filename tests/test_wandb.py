"""Weights & Biases (`wandb.mode`), with the real package offline, read back from its files.

- A run's W&B history holds every metrics.jsonl row, its config the resolved config and its
  summary summary.json; a resumed run continues the same W&B run.
- A sweep logs each member as its own W&B run in one group, with its hyperparameters and PBT
  lineage (slow).
- A tracker that fails leaves training as it was, with one warning line; a missing package
  is one line and exit code 2, before a run directory exists.
"""

import importlib.util
import json
import struct
import sys
from pathlib import Path

import jax
import pytest

from conftest import REPO_ROOT

from jaxddppo.config.files import from_dict, load_config
from jaxddppo.config.options import ConfigError
from jaxddppo.outputs.tracker import RUN_IDS_FILE
from jaxddppo.outputs.writers import Progress
from jaxddppo.sweep import run_sweep
from jaxddppo.train import main, run

# 4 envs x 16 steps = 64 env steps per update, 8 updates in chunks of 4, a checkpoint every 4.
SMALL = {
    "env": {"id": "CartPole-v1", "num_envs": 4},
    "ppo": {"num_steps": 16},
    "train": {"total_env_steps": 8 * 64, "updates_per_chunk": 4},
    "eval": {"num_episodes": 2},
    "checkpoint": {"every_updates": 4},
    "run": {"progress": False},
}


def small(run_dir: Path, mode: str = "offline", **sections: dict) -> dict:
    values = {name: dict(section) for name, section in SMALL.items()}
    for name, section in sections.items():
        values.setdefault(name, {}).update(section)
    values["run"]["dir"] = str(run_dir)
    values["wandb"] = {"mode": mode, "project": "jaxddppo-tests", "tags": ["test"]}
    return values


# Evaluated before any fixture: without the package (the main suite in CI), nothing trains.
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs the wandb extra")


@pytest.fixture
def wandb(monkeypatch, tmp_path):
    """The wandb package, kept off the network and out of the home directory, without the system
    metrics, machine details and package list it would collect for a user."""
    import wandb as module

    for name, value in {"WANDB_SILENT": "true", "WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_META": "true",
                        "WANDB__SAVE_REQUIREMENTS": "false", "WANDB_DISABLE_GIT": "true",
                        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                        "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return module


# --- reading an offline run back -------------------------------------------------------------------

BLOCK = 32 * 1024  # a .wandb file is a LevelDB log: 32 KiB blocks of records with 7-byte headers
FULL, LAST = 1, 4


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline run's .wandb file (after its 7-byte ':W&B' header)."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def item_key(item) -> str:
    return item.key or ".".join(item.nested_key)


def offline_runs(run_dir: Path) -> dict[str, dict]:
    """Per W&B run id, what its offline files (in order of start) hold: its history rows,
    group, config and summary (the last value of each key)."""
    runs: dict[str, dict] = {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found = runs.setdefault(record.run.run_id, {"history": [], "config": {}, "summary": {}, "files": 0})
                found["files"] += 1
                found["group"] = record.run.run_group
                found["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "history":
                found["history"].append({item_key(item): json.loads(item.value_json)
                                         for item in record.history.item if not item_key(item).startswith("_")})
            elif kind == "summary":
                found["summary"].update({item_key(item): json.loads(item.value_json)
                                         for item in record.summary.update})
    return runs


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_history_holds(history: list[dict], rows: list[dict]) -> None:
    """Every metrics row's non-null fields, as W&B history rows (the member is the W&B run)."""
    expected = [{k: v for k, v in row.items() if v is not None and k != "member"} for row in rows]
    assert history == expected


# --- tests --------------------------------------------------------------------------------------------


@pytest.fixture
def messages(monkeypatch) -> list[str]:
    """The lines the runs print through their progress output (warnings among them)."""
    printed: list[str] = []
    monkeypatch.setattr(Progress, "message", lambda self, text: printed.append(text))
    return printed


@pytest.fixture(scope="module")
def reference_digest(tmp_path_factory) -> float:
    """params_digest of the run with W&B off."""
    return run(small(tmp_path_factory.mktemp("off") / "run", mode="off"), devices=jax.devices()[:1]).summary[
        "params_digest"]


@needs_wandb
@pytest.mark.wandb
def test_a_run_logs_its_rows_config_and_summary_and_a_resume_continues_the_same_wandb_run(
        wandb, reference_digest, tmp_path, messages):
    run_dir = tmp_path / "run"
    with_video = {"num_episodes": 2, "video_every_updates": 8}
    stopped = run(small(run_dir, eval=with_video), devices=jax.devices()[:1], stop_after_updates=4)
    assert stopped.summary is None
    resumed = run(from_dict(small(run_dir, eval=with_video)), devices=jax.devices()[:1], resume=True)
    assert resumed.summary["params_digest"] == reference_digest

    runs = offline_runs(run_dir)
    (run_id,) = runs
    assert json.loads((run_dir / RUN_IDS_FILE).read_text()) == {"ids": [run_id]}
    logged = runs[run_id]
    assert logged["files"] == 2  # the first start and the resume: one W&B run
    rows = metric_rows(run_dir)
    assert [row["update"] for row in rows] == list(range(1, 9))
    videos = [row for row in logged["history"] if "video._type" in row]  # W&B flattens a logged object's fields
    assert [(row["env_steps"], row["video._type"]) for row in videos] == [(8 * 64, "video-file")]
    assert len(list((run_dir / "wandb").glob(f"offline-run-*/files/{videos[0]['video.path']}"))) == 1
    assert_history_holds([row for row in logged["history"] if "video._type" not in row], rows)
    assert logged["config"]["ppo"]["num_steps"] == 16 and logged["config"]["run"]["dir"] == str(run_dir)
    assert logged["config"]["train"]["num_shards"] == 1 and logged["config"]["wandb"]["mode"] == "offline"
    assert logged["summary"] == {**logged["summary"], **json.loads((run_dir / "summary.json").read_text())}
    assert logged["group"] == ""
    assert [line for line in messages if "W&B" in line] == [f"W&B offline: {run_dir}/wandb (upload with wandb sync)"] * 2
    assert not (Path.cwd() / "wandb").exists()


@pytest.mark.slow  # a population's programs compile in about 30 s more on 2 cores
@needs_wandb
@pytest.mark.wandb
def test_a_sweep_logs_each_member_as_its_own_run_in_one_group(wandb, tmp_path):
    run_dir = tmp_path / "sweep"
    result = run_sweep(small(run_dir, pbt={"every_updates": 4, "quantile": 0.5}), {"ppo.learning_rate": [1e-3, 3e-3]},
                       devices=jax.devices()[:1])
    runs = offline_runs(run_dir)
    ids = json.loads((run_dir / RUN_IDS_FILE).read_text())["ids"]
    assert sorted(ids) == sorted(runs) and len(ids) == 2
    rows = metric_rows(run_dir)
    for member, run_id in enumerate(ids):
        logged = runs[run_id]
        assert logged["group"] == "sweep"
        assert_history_holds(logged["history"], [row for row in rows if row["member"] == member])
        assert logged["config"]["member"] == member
        assert logged["config"]["ppo"]["learning_rate"] == [1e-3, 3e-3][member]
        csv_row = result.members[member]
        assert {key: logged["summary"][key] for key in ("lineage", "exploits", "final_ppo.learning_rate",
                                                        "params_digest")} == {
            key: csv_row[key] for key in ("lineage", "exploits", "final_ppo.learning_rate", "params_digest")}


def raise_on_log(*args, **kwargs):
    raise RuntimeError("no space left for W&B\nsecond line")


def raise_on_init(*args, **kwargs):
    raise TimeoutError("no answer from the server")


@needs_wandb
@pytest.mark.wandb
def test_a_failing_tracker_leaves_training_unchanged_with_one_warning(wandb, reference_digest, tmp_path, monkeypatch,
                                                                        messages):
    for name, target, failure in (("log", wandb.sdk.wandb_run.Run, raise_on_log), ("init", wandb, raise_on_init)):
        messages.clear()
        with monkeypatch.context() as patch:
            patch.setattr(target, name, failure)
            result = run(small(tmp_path / name), devices=jax.devices()[:1])
        assert result.summary["params_digest"] == reference_digest, name
        assert len(metric_rows(tmp_path / name)) == 8
        warnings = [line for line in messages if "warning" in line]
        assert len(warnings) == 1 and warnings[0].startswith("warning: W&B logging stopped ("), (name, warnings)
        assert warnings[0].endswith("); metrics.jsonl keeps the record"), warnings


def test_a_missing_package_is_one_line_and_exit_code_2_before_a_run_dir(tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` finds when it is not installed
    run_dir = tmp_path / "run"
    assert main(["--config", str(REPO_ROOT / "experiments" / "cartpole.yaml"), "wandb.mode=offline",
                 f"run.dir={run_dir}"]) == 2
    assert capfd.readouterr().err == (
        "error: wandb.mode=offline needs the wandb package: pip install 'jaxddppo[wandb]'\n")
    assert not run_dir.exists()


@pytest.mark.parametrize("override, message", [
    ("wandb.mode=on", "wandb.mode='on' is invalid: must be one of off, online, offline"),
    ("wandb.project=''", "wandb.project='' is invalid: must be a non-empty string"),
    (f"wandb.tags=[a,{'x' * 65}]", "wandb.tags=['a', 'xxx"),
])
def test_wandb_options_are_checked(override, message):
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("(", r"\(")):
        load_config(None, [override])
    assert load_config(None, ["wandb.mode=off"]).wandb.mode == "off"
