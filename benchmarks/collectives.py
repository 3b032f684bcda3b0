"""What each device sends per SGD step: `python benchmarks/collectives.py [--devices 2,8] [--config FILE]`.

Compiles the training program of the large benchmark config (experiments/cartpole.yaml with
2048 environments, as bench.py's `large`) on N simulated CPU devices, with
train.exact_reductions true and false, and reads the collectives from the HLO compiled as the
train command compiles it.
The gradient's reduction is the collective (or the pair) as large as the parameter vector;
it runs once per minibatch. Each device's share of the traffic follows the usual ring
model: an all-reduce of N values sends 2(D-1)/D x N, an all-to-all of N values or an
all-gather to N values sends (D-1)/D x N.

Every device count runs in a fresh process (the device count is fixed when JAX starts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from bench import CPU_DEVICE_COUNT_FLAG, EXIT_TRIAL_FAILED, REPO_ROOT, OneLineParser, importing

LARGE_OVERRIDES = {"env.num_envs": 2048, "ppo.num_steps": 128, "train.total_env_steps": 2048 * 128 * 4,
                   "train.updates_per_chunk": 4}
COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-to-all|all-gather|reduce-scatter|collective-permute)(?:-start)?\(")
SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def elements(shape_text: str) -> int:
    """Values in an HLO result type: `f32[8,1145]{1,0}` or a tuple of such types."""
    return sum(math.prod(int(dim) for dim in dims.split(",") if dim) for dims in SHAPE.findall(shape_text))


def sent_per_device(kind: str, values: int, devices: int) -> float:
    """Values one device sends in a ring implementation of the collective."""
    share = (devices - 1) / devices
    return 2 * share * values if kind == "all-reduce" else share * values


def collectives(hlo_text: str) -> list[tuple[str, int]]:
    """(kind, values) of every collective in a compiled HLO module's text; an async pair counts once."""
    found = []
    for line in hlo_text.splitlines():
        if "-done(" in line:
            continue
        match = COLLECTIVE.search(line)
        if match:
            found.append((match.group(2), elements(match.group(1))))
    return found


def measure(config_path: str, exact: bool) -> dict[str, Any]:
    """Compile the training chunk on this process's devices; its collectives and parameter count."""
    import jax

    from jaxddppo.config.files import load_config, with_overrides
    from jaxddppo.training.experiment import build, learn_compiler_options, update_count

    config = with_overrides(load_config(config_path), {**LARGE_OVERRIDES, "train.exact_reductions": exact})
    experiment = build(config)
    state = experiment.init_state()
    program = experiment.learn_fn().lower(state, experiment.shard_inputs(),
                                          update_count(experiment.mesh, config.train.updates_per_chunk))
    parameters = sum(leaf.size for leaf in jax.tree.leaves(state.params))
    return {"devices": jax.device_count(), "exact_reductions": exact, "parameters": parameters,
            "collectives": collectives(program.compile(learn_compiler_options(experiment)).as_text())}


def gradient_row(result: dict[str, Any]) -> dict[str, Any]:
    """The collectives at least as large as the parameters (the gradient's reduction) and the
    values each device sends for them; the smaller ones (statistics) counted apart."""
    devices, parameters = result["devices"], result["parameters"]
    large = [(kind, values) for kind, values in result["collectives"] if values >= parameters]
    small = [(kind, values) for kind, values in result["collectives"] if values < parameters]
    return {
        "devices": devices, "exact_reductions": result["exact_reductions"], "parameters": parameters,
        "gradient_collectives": ", ".join(f"{kind} of {values:,}" for kind, values in large),
        "sent_per_device": sum(sent_per_device(kind, values, devices) for kind, values in large),
        "other_collectives": len(small), "other_values": sum(values for _, values in small),
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| devices | exact_reductions | gradient's collectives (values) | values each device sends per "
             "SGD step | other collectives (values in all) |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['devices']} | {str(row['exact_reductions']).lower()} | {row['gradient_collectives']} | "
                     f"{row['sent_per_device']:,.0f} ({row['sent_per_device'] / row['parameters']:.2f} x "
                     f"{row['parameters']:,} parameters) | {row['other_collectives']} ({row['other_values']:,}) |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(prog="python benchmarks/collectives.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="2,8", help="comma-separated simulated device counts (default 2,8)")
    parser.add_argument("--config", default=str(REPO_ROOT / "experiments" / "cartpole.yaml"),
                        help="the experiment, sized up to 2048 envs x 128 steps (default experiments/cartpole.yaml)")
    parser.add_argument("--out", metavar="FILE", help="write the rows as JSON to FILE")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process on its devices
    args = parser.parse_args(argv)
    listed = args.devices
    try:
        args.devices = [int(count) for count in listed.split(",")]
    except ValueError:
        args.devices = []
    if not args.devices or min(args.devices) < 2:
        parser.error(f"--devices={listed} must list device counts of at least 2")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps([measure(args.config, exact) for exact in (True, False)]))
        return 0
    rows = []
    for count in args.devices:
        env = importing(REPO_ROOT, {**os.environ, "XLA_FLAGS": f"{CPU_DEVICE_COUNT_FLAG}={count}"})
        child = subprocess.run([sys.executable, __file__, "--one", "--config", args.config, "--devices", str(count)],
                               env=env, capture_output=True, text=True)
        if child.returncode != 0:
            print(f"error: {count} devices: exit code {child.returncode}\n{child.stderr[-2000:]}", file=sys.stderr)
            return EXIT_TRIAL_FAILED
        rows += [gradient_row(result) for result in json.loads(child.stdout.strip().splitlines()[-1])]
    print(format_table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
