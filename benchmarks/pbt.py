"""Population-based training against the same fixed grid: learning and the exploit's cost.

    python benchmarks/pbt.py [--experiment-seeds 3] [--out docs/benchmarks-pbt.json]
                             [--figure docs/pbt-curves.png]

Each experiment seed trains two sweeps of the same members, a learning-rate grid spanning
100x x seeds on CartPole-v1, at the same env steps: the fixed grid, and the grid with PBT.
Both run through `python -m jaxddppo.sweep` in fresh processes, alternating (grid, PBT, grid,
PBT, ...). Reported per arm: the median and the best over the members of their final
evaluation return (sweep.csv's eval_return_mean), averaged over the experiment seeds, and
the population's steps/s (summary.json), PBT / grid as the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from jaxddppo.plot import hyperparameter_schedules, read_metrics  # noqa: E402

LEARNING_RATES = "[1e-5,1e-4,1e-3]"
SEEDS_PER_SETTING = 4
OVERRIDES = [
    "env.num_envs=4", "ppo.num_steps=128", "train.total_env_steps=100352", "train.updates_per_chunk=14",
    "eval.num_episodes=32", "run.progress=false",
]
PBT_OVERRIDES = ["pbt.every_updates=14"]  # 196 updates: 13 exploits, one per chunk


def sweep(run_dir: Path, experiment_seed: int, with_pbt: bool) -> dict:
    """One sweep in a fresh process; its members' rows and summary."""
    command = [sys.executable, "-m", "jaxddppo.sweep", "--config", str(REPO_ROOT / "experiments" / "cartpole.yaml"),
               "--seeds", str(SEEDS_PER_SETTING), f"ppo.learning_rate={LEARNING_RATES}",
               f"train.seed={100 * experiment_seed}", *OVERRIDES, *(PBT_OVERRIDES if with_pbt else []),
               f"run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    with open(run_dir / "sweep.csv", newline="") as handle:
        members = list(csv.DictReader(handle))
    summary = json.loads((run_dir / "summary.json").read_text())
    returns = np.array([float(row["eval_return_mean"]) for row in members])
    return {"run_dir": str(run_dir), "median": float(np.median(returns)), "best": float(returns.max()),
            "returns": returns.tolist(), "steps_per_second": summary["env_steps_per_second"]}


def population_curve(run_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """(env steps, median over members of the training return) of a sweep."""
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    members = sorted({row["member"] for row in rows})
    steps = np.array([row["env_steps"] for row in rows if row["member"] == members[0]], np.float64)
    returns = np.array([[np.nan if row["episode_return_mean"] is None else row["episode_return_mean"]
                         for row in rows if row["member"] == member] for member in members], np.float64)
    return steps, np.nanmedian(returns, axis=0)


def draw(record: dict, path: str) -> None:
    """Median training return of each population (mean over experiment seeds) beside the
    learning rates of the first PBT population."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11.0, 4.5), dpi=100)
    curves, schedule = figure.subplots(1, 2)
    for arm, label in (("grid", "fixed grid"), ("pbt", "PBT")):
        runs = [population_curve(run["run_dir"]) for run in record["runs"][arm]]
        curves.plot(runs[0][0], np.mean([median for _, median in runs], axis=0), label=label)
    curves.set(title="median training return over the members", xlabel="environment steps (per member)",
               ylabel="episode return")
    curves.legend()
    first = record["runs"]["pbt"][0]["run_dir"]
    per_member = hyperparameter_schedules(read_metrics(os.path.join(first, "pbt.jsonl")))["ppo.learning_rate"]
    steps_per_update = 512
    last = max(row["update"] for row in read_metrics(os.path.join(first, "metrics.jsonl")))
    for changes in per_member.values():
        updates = [update for update, _ in changes] + [last]
        values = [value for _, value in changes]
        schedule.step(np.array(updates) * steps_per_update, values + values[-1:], where="post", linewidth=1.0)
    schedule.set(title="learning rate of each PBT member (experiment seed 0)", xlabel="environment steps (per member)",
                 yscale="log")
    for ax in (curves, schedule):
        ax.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, format="png")


def run(experiment_seeds: int, work_dir: Path) -> dict:
    runs: dict[str, list[dict]] = {"grid": [], "pbt": []}
    for seed in range(experiment_seeds):
        for arm in ("grid", "pbt"):
            runs[arm].append(sweep(work_dir / f"{arm}-{seed}", seed, arm == "pbt"))
            print(f"seed {seed} {arm}: median {runs[arm][-1]['median']:.1f}, best {runs[arm][-1]['best']:.1f}, "
                  f"{runs[arm][-1]['steps_per_second']:,.0f} steps/s", flush=True)
    learning = {arm: {"median": float(np.mean([r["median"] for r in arm_runs])),
                      "best": float(np.mean([r["best"] for r in arm_runs]))} for arm, arm_runs in runs.items()}
    ratios = [p["steps_per_second"] / g["steps_per_second"] for p, g in zip(runs["pbt"], runs["grid"])]
    return {"runs": runs, "learning": learning, "steps_per_second_ratio": float(np.median(ratios)),
            "steps_per_second_ratios": ratios}


def table(record: dict) -> str:
    lines = ["| population | median final eval return | best final eval return | steps/s |", "|---|---|---|---|"]
    for arm, label in (("grid", "fixed grid"), ("pbt", "PBT")):
        rates = [r["steps_per_second"] for r in record["runs"][arm]]
        lines.append(f"| {label} | {record['learning'][arm]['median']:.1f} | {record['learning'][arm]['best']:.1f} "
                     f"| {np.median(rates):,.0f} |")
    lines.append(f"\nPBT / grid steps/s, median of {len(record['steps_per_second_ratios'])} rounds: "
                 f"{record['steps_per_second_ratio']:.3f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment-seeds", type=int, default=3, help="seeds of the whole experiment")
    parser.add_argument("--out", help="write the record as JSON")
    parser.add_argument("--figure", help="write the curves as a PNG")
    parser.add_argument("--work-dir", help="where the sweeps' run directories go (default: a temporary one)")
    args = parser.parse_args(argv)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="jaxddppo-pbt-"))
    record = run(args.experiment_seeds, work_dir)
    record["command"] = "python benchmarks/pbt.py " + " ".join(argv if argv is not None else sys.argv[1:])
    record["machine"] = {"platform": platform.platform(), "python": platform.python_version(),
                         "cpu_count": os.cpu_count()}
    record["config"] = {"learning_rates": LEARNING_RATES, "seeds_per_setting": SEEDS_PER_SETTING,
                        "overrides": OVERRIDES, "pbt_overrides": PBT_OVERRIDES}
    print(table(record))
    if args.figure:
        draw(record, args.figure)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=1)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
