"""Learning: the README's CartPole experiment solves the task within its budget, and the
policy loaded back from its checkpoint reproduces its evaluation."""

from pathlib import Path

import jax

import jaxddppo
from jaxddppo.config.files import load_config
from jaxddppo.evaluate import evaluate, statistics
from jaxddppo.train import run

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def test_cartpole_experiment_learns_and_its_loaded_policy_reproduces_the_evaluation(tmp_path):
    config = load_config(
        str(EXPERIMENTS / "cartpole.yaml"), [f"run.dir={tmp_path / 'run'}", "run.progress=false"]
    )
    result = run(config, devices=jax.devices()[:1])
    assert result.summary["eval_return_mean"] >= 400, result.summary
    assert result.summary["final_episode_return"] >= 400, result.summary

    policy = jaxddppo.load_policy(result.run_dir)
    assert policy.counters.update == result.summary["num_updates"]
    stats = statistics(evaluate(policy))
    assert stats["return_mean"] == result.summary["eval_return_mean"]
    assert stats["return_std"] == result.summary["eval_return_std"]
    assert stats["length_mean"] == result.summary["eval_length_mean"]
