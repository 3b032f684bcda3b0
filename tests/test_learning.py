"""Learning: the README's CartPole experiment solves the task within its budget."""

from pathlib import Path

import jax

from jaxddppo.config import load_config
from jaxddppo.train import run

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def test_cartpole_experiment_learns(tmp_path):
    config = load_config(
        str(EXPERIMENTS / "cartpole.yaml"), [f"run.dir={tmp_path / 'run'}", "run.progress=false"]
    )
    result = run(config, devices=jax.devices()[:1])
    assert result.summary["eval_return_mean"] >= 400, result.summary
    assert result.summary["final_episode_return"] >= 400, result.summary
