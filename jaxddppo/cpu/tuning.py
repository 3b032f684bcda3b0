"""The CPU switch, `run.cpu_tuning`, and the CPU backend's devices and threads.

`run.cpu_tuning` is `auto` (the default: on where the run's devices are CPUs), `on` or
`off`. `resolve` fixes `auto` once the devices are known; the run directory's config.yaml
records the resolved value, so a resume draws what the run drew on any backend. On, it
turns on what XLA's CPU backend runs or compiles faster written another way, each kept
because it pays on this project's large config (timings: docs/benchmarks.md, CPU
tuning). Results differ from the plain path's beyond the last bits, through the shuffle's
other random orders (the rest changes the last bits only); the algorithm is the same:

- `sort_permutations` draws the epochs' minibatch orders instead of
  `jax.random.permutation`. JAX shuffles by sorting (random key, index) pairs, and XLA's
  CPU backend sorts pairs by calling a compiled comparator for every comparison; it sorts
  one array of integers directly.
- `compiler_options`: XLA's CPU backend spends most of a compile in LLVM, whose level 3
  makes these programs no faster than its level 2, and whose level 0, with XLA's older
  kernel emitter, suffices for a program that runs once, unless it loops long
  (`init_compiler_options`). From jaxlib 0.10, XLA hands
  elementwise fusions (a multiply-reduce among them) to the YNNPACK library by default,
  at which MJX's physics steps at half its rate; the options keep YNNPACK to single dots,
  where the learner gains from it.

Accelerators get the plain path. The CPU's devices (`run.cpu_devices`, and the train and
sweep commands' default of one device per core) and XLA's thread pool (`run.cpu_threads`) are
set here too, before JAX starts its backend. Importing this module changes nothing in JAX.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import pkgutil
from dataclasses import replace
from typing import Any, Mapping, Optional

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np

from jaxddppo.config.files import with_overrides
from jaxddppo.config.options import Config, ConfigError
from jaxddppo.distributed.topology import make_topology

# The XLA_FLAGS entry that splits the CPU into N devices when JAX starts.
CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

# A block with 64-bit types on: jax.enable_x64 in newer JAX, jax.experimental.enable_x64 in older.
_SIXTY_FOUR_BITS = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64

# jaxlib 0.11.1 refuses the compile option `xla_cpu_use_fusion_emitters` ("No such compile option").
_HAS_OLDER_KERNEL_EMITTER = jax.__version_info__ < (0, 11, 1)

# From jaxlib 0.10, XLA's CPU backend hands elementwise fusions to YNNPACK by default: Playground's
# CheetahRun steps at about half its rate with them (jaxlib 0.9 hands YNNPACK nothing by default).
_YNNPACK_FOR_SINGLE_DOTS = ({"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
                            if jax.__version_info__ >= (0, 10, 0) else {})

# JAX's criterion for the random bits a shuffle needs: 3 x log2(n), so that ties are rare.
_BITS_PER_ELEMENT_FACTOR = 3

# The fewest environments per device with which the train command splits the CPU: CartPole
# (128-step rollouts, 4 x 4 minibatches, 64x64) trained on 2 devices of a 2-core CPU at 0.89x
# of one device with 4 environments each, 1.15x with 8 and 1.26x with 16 (docs/benchmarks.md).
MIN_ENVS_PER_CPU_DEVICE = 16


def resolve(config: Config, platform: str) -> Config:
    """`config` with `run.cpu_tuning=auto` decided for devices of `platform` (a device's
    `.platform`): on for "cpu", off elsewhere; `on` and `off` stay as they are."""
    if config.run.cpu_tuning != "auto":
        return config
    return replace(config, run=replace(config.run, cpu_tuning="on" if platform == "cpu" else "off"))


def is_on(config: Config) -> bool:
    """Whether a resolved config (`resolve`) trains with the CPU techniques."""
    if config.run.cpu_tuning == "auto":
        raise ValueError("run.cpu_tuning=auto is decided by cpu_tuning.resolve once the devices are known")
    return config.run.cpu_tuning == "on"


def sort_permutations(key: jax.Array, num_permutations: int, n: int) -> jax.Array:
    """Uniformly random orders of range(n) (int32, [num_permutations, n]), from stable sorts
    by random keys.

    Each round sorts one array of 64-bit integers: 32 random bits in the high word, the
    element's current position in the low word (so equal keys keep their order, as a
    stable sort would). Successive stable sorts order by all rounds' keys together, the
    last round's first; rounds are added until they hold JAX's 3 x log2(n) random bits
    (two rounds up to 2**21 elements). Every permutation's bits are drawn in one call
    (`bits(key, (num_permutations, rounds, n))`). The 64-bit integers live inside an
    `enable_x64` block, which reverts when the sort is traced.
    """
    if n <= 1:
        return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (num_permutations, n))
    if n >= 2**31:
        raise ValueError(f"sort_permutations needs n < 2**31, got {n}")
    num_rounds = math.ceil(_BITS_PER_ELEMENT_FACTOR * math.log2(n) / 32)
    all_random_words = jax.random.bits(key, (num_permutations, num_rounds, n), jnp.uint32)
    order = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (num_permutations, n))
    for random_words in jnp.moveaxis(all_random_words, 1, 0):
        with _SIXTY_FOUR_BITS(True):
            positions = jnp.arange(n, dtype=jnp.uint64)
            packed = jnp.sort((random_words.astype(jnp.uint64) << np.uint64(32)) | positions, axis=-1)
            sorted_positions = (packed & np.uint64(0xFFFFFFFF)).astype(jnp.int32)
        order = jnp.take_along_axis(order, sorted_positions, axis=-1)
    return order


def compiler_options(platform: str, runs_once: bool) -> dict[str, Any]:
    """`Lowered.compile` options for a program on `platform` (a device's `.platform`):
    on CPU, XLA's backend optimisation level 2 for a program that runs many times (XLA's
    default is 3), and for one that runs once level 0 with XLA's older kernel emitter, which
    compiles small kernels faster than its fusion emitters (jaxlib 0.11.1 removed the
    option, and XLA's CPU backend has only the fusion emitters from then on); from jaxlib
    0.10, YNNPACK for single dots only; none elsewhere (XLA's GPU backend refuses level 0)."""
    if platform != "cpu":
        return {}
    if runs_once:
        older_emitter = {"xla_cpu_use_fusion_emitters": False} if _HAS_OLDER_KERNEL_EMITTER else {}
        return {"xla_backend_optimization_level": 0, **older_emitter, **_YNNPACK_FOR_SINGLE_DOTS}
    return {"xla_backend_optimization_level": 2, **_YNNPACK_FOR_SINGLE_DOTS}


# The loop iterations from which the initialisation compiles at level 2 although it runs once:
# unoptimised code pays its slowness once per iteration. CheetahRun's reset settles the body
# for 200 physics steps (scan 200 x 8): its 2048 first states took 49 s to run at level 0
# against 9 s at level 2, which compiles them in 26 s against 13; WalkerWalk's (scan 5) ran
# in 0.2 s either way and compiled in 5 s against 19 (jax 0.9.2, 2 CPU devices).
LONG_LOOP_ITERATIONS = 100


def loop_iterations(jaxpr: Any) -> int:
    """The most iterations any loop of `jaxpr` (a jaxpr or closed jaxpr) runs, a nested
    loop's count multiplied by its enclosing loops': a `scan` its length, a `while` one (its
    count is not in the trace); 0 without loops."""
    jaxpr = jaxpr if hasattr(jaxpr, "eqns") else jaxpr.jaxpr
    most = 0
    for eqn in jaxpr.eqns:
        inner = max((loop_iterations(sub) for sub in _inner_jaxprs(tuple(eqn.params.values()))), default=0)
        count = {"scan": eqn.params.get("length", 1), "while": 1}.get(eqn.primitive.name)
        most = max(most, inner if count is None else count * max(inner, 1))
    return most


def _inner_jaxprs(values: tuple) -> list[Any]:
    """The jaxprs among an equation's parameters (a call's, a loop's body, a cond's branches)."""
    found = []
    for value in values:
        if isinstance(value, (tuple, list)):
            found.extend(_inner_jaxprs(tuple(value)))
        elif hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns"):
            found.append(value)
    return found


def init_compiler_options(platform: str, init_jaxpr: Any) -> dict[str, Any]:
    """`compiler_options` for the initialisation (`init_jaxpr`, its trace), which runs once:
    those of a program that runs once, unless it loops `LONG_LOOP_ITERATIONS` times or more.
    Its loops are the environments' resets' and the network initialisation's, whose counts are
    the same on any device count (the shards are batched), and so is the choice."""
    return compiler_options(platform, runs_once=loop_iterations(init_jaxpr) < LONG_LOOP_ITERATIONS)


def backend_started() -> bool:
    """Whether JAX's backends have started (its devices exist), through public API: the
    CPU device count may change only before they start, and JAX refuses another value after."""
    count = jax.config.jax_num_cpu_devices
    try:
        jax.config.update("jax_num_cpu_devices", -2 if count == -1 else -1)  # both mean "not set"
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", count)
    return False


def set_cpu_threads(cpu_threads: int) -> Optional[str]:
    """Size XLA's CPU thread pool (`run.cpu_threads`; 0 leaves XLA's default, one thread per core).

    The pool is created with JAX's backend, from the PJRT_NPROC environment
    variable, so this must run before the first JAX computation of the process.
    Returns a one-line warning when the backend had started already with another
    setting (in a notebook, say), else None.
    """
    if cpu_threads == 0:
        return None
    wanted = str(cpu_threads)
    if backend_started():
        if os.environ.get("PJRT_NPROC") == wanted:
            return None
        return (f"warning: run.cpu_threads={cpu_threads} has no effect: JAX's backend started before it was "
                f"set; set it in a fresh process, or PJRT_NPROC={cpu_threads} in the environment")
    os.environ["PJRT_NPROC"] = wanted
    return None


def set_cpu_devices(cpu_devices: int) -> Optional[str]:
    """Split the CPU into `cpu_devices` JAX devices (`run.cpu_devices`; 0 leaves JAX's
    default: one, or as many as XLA_FLAGS' --xla_force_host_platform_device_count says).

    Like the thread pool, the CPU devices are created with JAX's backend, so this must
    run before the first JAX computation of the process. Returns a one-line warning when
    the backend had started already with another count, else None.
    """
    if cpu_devices == 0:
        return None
    if backend_started():
        try:
            if len(jax.devices("cpu")) == cpu_devices:
                return None
        except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
            return f"warning: run.cpu_devices={cpu_devices} has no effect: JAX runs without its CPU backend"
        return (f"warning: run.cpu_devices={cpu_devices} has no effect: JAX's backend started before it was "
                f"set; set it in a fresh process, or XLA_FLAGS={CPU_DEVICE_COUNT_FLAG}={cpu_devices}")
    jax.config.update("jax_num_cpu_devices", cpu_devices)
    return None


def set_up_cpu(config: Config) -> list[str]:
    """Size the CPU thread pool and the CPU device count before JAX starts its backend;
    their warnings, if any."""
    warnings = [set_cpu_threads(config.run.cpu_threads), set_cpu_devices(config.run.cpu_devices)]
    return [warning for warning in warnings if warning is not None]


def cpu_device_count_open(config: Config, environ: Mapping[str, str]) -> bool:
    """Whether this process will run on CPU devices whose count nothing has decided yet:
    not `run.cpu_devices`, XLA_FLAGS' device count, a multi-process run (`distributed.*`)
    or a backend that has started already, and JAX runs on the CPU: JAX_PLATFORMS names it
    first, or is unset and no accelerator's plugin is installed."""
    distributed = config.distributed.coordinator is not None or config.distributed.auto
    decided = (config.run.cpu_devices > 0 or CPU_DEVICE_COUNT_FLAG in environ.get("XLA_FLAGS", "") or distributed
               or backend_started())
    platforms = environ.get("JAX_PLATFORMS")
    if platforms:
        on_cpu = platforms.split(",")[0].strip() == "cpu"
    else:
        on_cpu = not accelerator_plugin_installed()
    return not decided and on_cpu


def accelerator_plugin_installed() -> bool:
    """Whether JAX finds an accelerator here before it starts, where it looks: PJRT plugins
    (CUDA, ROCm, ...) as entry points of the group `jax_plugins` or modules of the namespace
    package `jax_plugins`, and libtpu."""
    if importlib.metadata.entry_points(group="jax_plugins") or importlib.util.find_spec("libtpu") is not None:
        return True
    namespace = importlib.util.find_spec("jax_plugins")
    return namespace is not None and any(pkgutil.iter_modules(namespace.submodule_search_locations or []))


def usable_cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_devices_per_core(num_members: int, num_cores: int) -> int:
    """The most CPU devices, at most one per core, that `num_members` split over evenly."""
    return max(devices for devices in range(1, min(num_members, num_cores) + 1) if num_members % devices == 0)


def cpu_devices_for_run(config: Config, num_cores: int) -> int:
    """The most CPU devices, at most one per core, that a run of `config` can be split over
    with at least MIN_ENVS_PER_CPU_DEVICE environments each: as many as divide
    `train.num_shards` where it is set (the run then computes the same bits on any of them),
    else one shard per device with every size dividing (`make_topology`)."""
    most = min(num_cores, config.env.num_envs // MIN_ENVS_PER_CPU_DEVICE)
    for devices in range(most, 1, -1):
        try:
            make_topology(config, num_devices=devices, num_processes=1)
        except ConfigError:
            continue
        return devices
    return 1


def with_cpu_devices(config: Config, devices: int, environ: Mapping[str, str]) -> Config:
    """The commands' default for `run.cpu_devices`: `config` with the CPU split into
    `devices` devices where that is more than one, the CPU switch is not off, nothing else
    decides the device count and JAX runs on the CPU (`cpu_device_count_open`); else `config`.

    One XLA CPU device runs most of a program's operations on one core, and a split puts
    each device on a core of its own. The train command splits by `cpu_devices_for_run`,
    the sweep command by `cpu_devices_per_core` of the member count (members never
    communicate). The Python API leaves the count alone: the devices of a process are fixed
    once JAX starts, and a training run later in the same process would share its
    gradients over all of them."""
    if devices == 1 or config.run.cpu_tuning == "off" or not cpu_device_count_open(config, environ):
        return config
    return with_overrides(config, {"run.cpu_devices": devices})
