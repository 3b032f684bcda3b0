"""Profile one compiled chunk of updates: where a run's time goes, without the host loop.

    python benchmarks/profile_update.py --config experiments/cartpole.yaml [--chunks 61] [--trace DIR]
        [section.key=value ...]

It profiles the jaxddppo of the checkout it sits in.

The config's `run.cpu_threads`, `run.cpu_devices` and `run.cpu_tuning` apply as in training
(the CartPole config's single CPU thread, for instance; the chunk is compiled with the
train command's compiler options, which it prints). Prints the seconds spent
building, tracing and lowering, and compiling; the optimised program's `while`
loops (each is a loop of small XLA operations, run once per iteration); and the
steady-state time per update of the compiled chunk (the median over `--chunks`
calls, the first two excluded as warm-up), with the devices and the threads of
XLA's CPU pool it ran on. With
`--trace DIR` it also records one chunk with `jax.profiler` and counts, from the
Chrome trace (`*.trace.json.gz`) the profiler writes, the XLA operations
(thunks) executed per update: on CPU each costs a fixed overhead, so
fewer, larger operations run faster. Compare two versions of the code by running
this at each, alternately.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import jax


def xla_cpu_pool_threads() -> Optional[int]:
    """Threads of XLA's CPU thread pool in this process (Linux names them tf_XLAEigen), or None
    where /proc does not list threads."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    count = 0
    for task in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, task, "comm")) as handle:
                count += handle.read().strip() == "tf_XLAEigen"
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return count


def executed_operations(trace_dir: str) -> collections.Counter:
    """XLA operations executed, by name, in the newest Chrome trace under `trace_dir`."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")))
    if not paths:
        return collections.Counter()
    events = json.load(gzip.open(paths[-1]))["traceEvents"]
    counts: collections.Counter = collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") == "X" and not name.startswith(("end:", "$", "Thread", "Pjit")) and "Execute" not in name:
            counts[name] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="experiments/cartpole.yaml")
    parser.add_argument("--chunks", type=int, default=61, help="chunk calls to time")
    parser.add_argument("--trace", metavar="DIR", help="record one chunk with jax.profiler into DIR")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()

    # The jaxddppo of the checkout this script is in, whichever one is installed.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jaxddppo.config.files import load_config
    from jaxddppo.distributed import multiprocess
    from jaxddppo.training.experiment import abstract_update_count, build, learn_compiler_options, update_count

    config = load_config(args.config, ["checkpoint.every_updates=0", *args.overrides])
    for warning in multiprocess.start_backend(config):
        print(warning)
    start = time.perf_counter()
    experiment = build(config)
    build_seconds = time.perf_counter() - start
    size = experiment.topology.updates_per_chunk
    start = time.perf_counter()
    shard_inputs = experiment.shard_inputs()
    lowered = experiment.learn_fn().lower(experiment.abstract_state(), shard_inputs,
                                          abstract_update_count(experiment.mesh))
    lower_seconds = time.perf_counter() - start
    start = time.perf_counter()
    options = learn_compiler_options(experiment)  # as the train command compiles the chunk
    chunk = lowered.compile(options)
    compile_seconds = time.perf_counter() - start
    loops = chunk.as_text().count(" while(")
    print(f"build {build_seconds:.2f} s, trace+lower {lower_seconds:.2f} s, XLA compile {compile_seconds:.2f} s; "
          f"{loops} while loops in the optimised program")
    print(f"compiler options: {options or 'XLA defaults'}")

    state, full_chunk = experiment.init_state(), update_count(experiment.mesh, size)
    seconds = []
    for _ in range(args.chunks):
        start = time.perf_counter()
        state, metrics, _ = chunk(state, shard_inputs, full_chunk)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - start)
    per_update = statistics.median(seconds[2:] or seconds) / size
    steps = experiment.topology.env_steps_per_update
    pool_threads = xla_cpu_pool_threads()
    print(f"{per_update * 1e3:.2f} ms per update (median of {len(seconds[2:] or seconds)} chunks of {size}): "
          f"{steps / per_update:,.0f} env steps/s on {experiment.topology.num_devices} "
          f"{jax.default_backend()} device(s)"
          + (f", {pool_threads} XLA CPU pool thread(s)" if pool_threads else ""))

    if args.trace:
        jax.profiler.start_trace(args.trace)
        state, metrics, _ = chunk(state, shard_inputs, full_chunk)
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        counts = executed_operations(args.trace)
        if not counts:
            print(f"trace in {args.trace}; the profiler wrote no Chrome trace to count operations from")
            return
        kinds: collections.Counter = collections.Counter()
        for name, count in counts.items():
            kinds[name.rsplit(".", 1)[0]] += count
        print(f"{sum(counts.values()) / size:,.0f} XLA operations executed per update; the most frequent kinds:")
        for kind, count in kinds.most_common(12):
            print(f"  {count / size:8.1f}  {kind}")


if __name__ == "__main__":
    main()
