"""What PBT's exploit step costs: `python benchmarks/pbt_cost.py [--rounds 20] [--devices 1] [--hidden-size 64]`.

benchmarks/pbt.py's population (CartPole-v1, `ppo.learning_rate=[1e-5,1e-4,1e-3]` x 4
seeds, 4 envs x 128 steps per update) compiled twice in one process: with
`pbt.every_updates` equal to the chunk (14 updates), so that each chunk ends with an
exploit, and with an interval no chunk reaches, so that the same program skips it. Both
start every timed chunk from the same initial state, so both run the same 14 updates; the
difference is the exploit alone (ranking, the losers' copies of their winners' states, the
draws). The two take turns; the cost is the median of the per-round ratios of chunk times,
minus one: the share of a sweep's steps/s that exploiting after every 14 updates takes.
Also reported: the chunk's temporary memory per device (XLA's memory analysis of the
compiled program), with PBT (both programs above: the exploit is a branch of each) and for
the same population without PBT; the difference is what the exploit holds beside the
members' own states.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from bench import OneLineParser

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

CHUNK = 14
NEVER = 10**6  # an exploit interval that no chunk reaches


def population(every_updates: int, devices: int, hidden_size: Optional[int]) -> tuple[Any, Any, Any]:
    """(experiment, compiled programs, initial state) of benchmarks/pbt.py's population;
    with `hidden_size`, its MLPs that wide."""
    import jax
    import pbt as pbt_benchmark

    from jaxddppo.config.files import load_config
    from jaxddppo.training.experiment import compile_programs
    from jaxddppo.training.population import build_population

    overrides = [*pbt_benchmark.OVERRIDES, f"pbt.every_updates={every_updates}", f"train.updates_per_chunk={CHUNK}"]
    if hidden_size is not None:
        overrides.append(f"network.hidden_sizes=[{hidden_size},{hidden_size}]")
    config = load_config(str(REPO_ROOT / "experiments" / "cartpole.yaml"), overrides)
    grid = {"ppo.learning_rate": [1e-5, 1e-4, 1e-3]}
    experiment = build_population(config, grid, pbt_benchmark.SEEDS_PER_SETTING, devices=jax.devices()[:devices])
    programs = compile_programs(experiment)
    return experiment, programs, programs.init(programs.inputs)


def temporary_megabytes(compiled: Any) -> Optional[float]:
    """A compiled program's temporary buffers per device in MB, None where the backend does not say."""
    analysis = compiled.memory_analysis()
    return None if analysis is None else analysis.temp_size_in_bytes / 2**20


def chunk_seconds(experiment: Any, programs: Any, initial: Any) -> float:
    """One chunk of CHUNK updates from a copy of `initial` (the program donates its state)."""
    import jax

    from jaxddppo.training.experiment import update_count

    state = jax.tree.map(lambda leaf: leaf.copy(), initial)
    jax.block_until_ready(state)
    start = time.perf_counter()
    jax.block_until_ready(programs.learn(state, programs.inputs, update_count(experiment.mesh, CHUNK)))
    return time.perf_counter() - start


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(prog="python benchmarks/pbt_cost.py", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed chunks of each program (default 20)")
    parser.add_argument("--devices", type=int, default=1, help="simulated CPU devices (default 1)")
    parser.add_argument("--hidden-size", type=int, metavar="N",
                        help="MLP widths N x N (default: the experiment's, 64 x 64)")
    parser.add_argument("--out", metavar="FILE", help="write the chunk times and the ratio as JSON to FILE")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: at least 2 (the ratio's quartiles need two rounds)")
    if args.devices < 1:
        parser.error(f"--devices {args.devices}: at least 1")
    if args.hidden_size is not None and args.hidden_size < 1:
        parser.error(f"--hidden-size {args.hidden_size}: at least 1")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    arms = {"exploit": population(CHUNK, args.devices, args.hidden_size),
            "no exploit": population(NEVER, args.devices, args.hidden_size)}
    temporary_mb = {"with PBT": temporary_megabytes(arms["exploit"][1].learn),
                    "without PBT": temporary_megabytes(population(0, args.devices, args.hidden_size)[1].learn)}
    for arm in arms.values():
        chunk_seconds(*arm)  # the first execution pays one-time costs
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            times[name].append(chunk_seconds(*arm))
    ratios = [a / b for a, b in zip(times["exploit"], times["no exploit"], strict=True)]
    ratio = statistics.median(ratios)
    with_exploit, without = (statistics.median(times[name]) * 1e3 for name in ("exploit", "no exploit"))
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"chunk of {CHUNK} updates, 12 members on {args.devices} device(s): with the exploit {with_exploit:.1f} ms, "
          f"without {without:.1f} ms (medians of {args.rounds}); ratio {ratio:.4f} (quartiles {quartiles[0]:.4f}, "
          f"{quartiles[2]:.4f}): the exploit costs {100 * (1 - 1 / ratio):.2f} % of the steps/s")
    print("temporary memory per device: " + ", ".join(
        f"{name} {'not reported' if megabytes is None else f'{megabytes:.1f} MB'}" for name, megabytes in temporary_mb.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["python", "benchmarks/pbt_cost.py", *sys.argv[1:]]),
                                             "chunk_updates": CHUNK, "times": times, "ratios": ratios,
                                             "ratio": ratio, "temporary_mb": temporary_mb}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
