"""Four simulated CPU devices for every test process (set before JAX is imported); a PNG check."""

import contextlib
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

_DEVICE_FLAG = "--xla_force_host_platform_device_count"

if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}=4".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO_ROOT = Path(__file__).resolve().parents[1]
# One small id per environment family but gymnax: arrays (navix), images (xminigrid), a dict with a
# mask (jumanji), a costly reset (craftax), continuous actions (playground).
FAMILY_IDS = {
    "craftax": "craftax:Craftax-Classic-Symbolic-v1",
    "jumanji": "jumanji:Snake-v1",
    "navix": "navix:Navix-Empty-5x5-v0",
    "playground": "playground:CartpoleBalance",
    "xminigrid": "xminigrid:MiniGrid-Empty-6x6",
}


def family_installed(family: str) -> bool:
    """Whether the package of an environment family's extra is installed."""
    import importlib.util

    from jaxddppo.envs import FAMILIES

    return importlib.util.find_spec(FAMILIES[family].package) is not None


_CACHE_VARIABLE = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
    """One JAX persistent compilation cache for the whole test session, shared by the xdist
    workers and every subprocess (they inherit the variable): most tests compile the same few
    small programs, and loading one from the cache takes a fifth of compiling it. Set in the
    controller before the workers start; removed at the end. A cache directory the caller
    chose is used as it is."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get(_CACHE_VARIABLE):
        return
    directory = tempfile.mkdtemp(prefix="jaxddppo-tests-compilation-cache-")
    os.environ[_CACHE_VARIABLE] = directory
    config.add_cleanup(lambda: (os.environ.pop(_CACHE_VARIABLE, None), shutil.rmtree(directory, ignore_errors=True)))


def subprocess_env(num_devices: int) -> dict[str, str]:
    """The environment of a jaxddppo subprocess: this interpreter's, with `num_devices`
    simulated CPU devices, this checkout importable, and no CPU thread pool size
    inherited (a test process may have set PJRT_NPROC for itself: run.cpu_threads; NPROC
    sizes XLA's default pool)."""
    env = {key: value for key, value in os.environ.items() if key not in ("PJRT_NPROC", "NPROC")}
    env["XLA_FLAGS"] = f"{_DEVICE_FLAG}={num_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def xla_pool_threads_named() -> bool:
    """Whether jaxlib names the threads of XLA's CPU pool (tf_XLAEigen), which
    tests/test_sharding.py counts: from jaxlib 0.8 on; 0.7 leaves them unnamed."""
    import jax

    return jax.__version_info__ >= (0, 8)


# The stages of a jitted call that misses jit's caches, as JAX reports them through the public
# jax.monitoring (under these names in every JAX CI runs, 0.7.2 to 0.11): tracing the function,
# lowering it to MLIR and compiling it (or loading it from the persistent compilation cache:
# reported as a compile all the same).
_JIT_STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_jit_stages_seen: list[tuple[str, str]] = []
_listening_for_jit_stages = False


def _record_jit_stage(event: str, _seconds: float, fun_name: str = "?", **_) -> None:
    stage = _JIT_STAGES.get(event)
    if stage is not None:
        _jit_stages_seen.append((stage, str(fun_name)))


@contextlib.contextmanager
def jit_stages() -> Iterator[list[tuple[str, str]]]:
    """The jit stages run inside the block, as (stage, function name) pairs in order, stage
    "trace", "lower" or "compile"; the list fills when the block ends. A call that JAX serves
    from its caches runs none: `with jit_stages() as stages: f(x)` then `assert stages == []`
    checks that the call did not recompile. (jax.monitoring cannot take a listener back in
    every JAX CI runs, so one listener, registered on first use, serves the whole process.)"""
    global _listening_for_jit_stages
    if not _listening_for_jit_stages:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_record_jit_stage)
        _listening_for_jit_stages = True
    start = len(_jit_stages_seen)
    stages: list[tuple[str, str]] = []
    try:
        yield stages
    finally:
        stages.extend(_jit_stages_seen[start:])


def host_leaves(tree) -> list[np.ndarray]:
    """Every leaf of a global state on the host (all shards), typed keys as their raw key data."""
    import jax

    from jaxddppo.distributed.global_arrays import all_shards

    def raw(leaf):
        return jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf

    return [np.asarray(leaf) for leaf in jax.tree.leaves(all_shards(jax.tree.map(raw, tree)))]


def device_copies(tree):
    """Each local device's copy of every leaf of a per-member global `tree`: leaves [devices, ...]."""
    import jax

    return jax.tree.map(lambda leaf: np.stack([np.asarray(copy.data) for copy in leaf.addressable_shards]), tree)


# A small CartPole run of 12 updates in 4 shards with a checkpoint every 4 updates: what the
# checkpoint and storage tests train, stop, damage and resume.
SMALL_CHECKPOINTED_RUN = {
    "env": {"num_envs": 8, "normalize_observations": True, "scale_rewards": True},
    "ppo": {"num_steps": 16},
    "train": {"total_env_steps": 12 * 128, "updates_per_chunk": 4, "num_shards": 4},
    "checkpoint": {"every_updates": 4},
    "eval": {"num_episodes": 4},
    "run": {"progress": False},
}


def small_config(run_dir: Path, **sections: dict):
    """`SMALL_CHECKPOINTED_RUN` in `run_dir`, with `sections`' keys overriding or adding to it."""
    from jaxddppo.config.files import from_dict

    values = {name: dict(section) for name, section in SMALL_CHECKPOINTED_RUN.items()}
    for name, section in sections.items():
        values.setdefault(name, {}).update(section)
    values["run"]["dir"] = str(run_dir)
    return from_dict(values)


def flip_a_stored_bit(step_dir: Path) -> str:
    """Flip one bit of one number of a checkpoint's parameters, as a bad disk or a torn copy
    does: the checkpoint still reads back, with one number changed. Returns the array's name.

    The change goes through tensorstore (OCDBT stores it as the array's newest version) rather
    than into the files' bytes: the data is zstd-compressed, zstd finds a flipped bit at some
    positions ("Data corruption detected", so the checkpoint is unreadable instead, as in
    tests/test_checkpoint.py), and which array lies where changes from run to run."""
    import tensorstore

    state = {"driver": "ocdbt", "base": f"file://{step_dir / 'state'}/"}
    names = sorted(key.decode()[:-len("/.zarray")] for key in tensorstore.KvStore.open(state).result().list().result()
                   if key.startswith(b"params.") and key.endswith(b"kernel/.zarray"))
    assert names, f"no parameter array in {step_dir / 'state'}"
    array = tensorstore.open({"driver": "zarr", "kvstore": {**state, "path": f"{names[0]}/"}}).result()
    values = array.read().result()
    values.reshape(-1).view(np.uint8)[values.nbytes // 2] ^= 0x10
    array.write(values).result()
    return names[0]


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def assert_real_png():
    """A check that a file is a PNG of the learning-curve figure's size that decodes to a picture."""
    from PIL import Image

    from jaxddppo.plot import DPI, FIGURE_SIZE

    shape = (int(FIGURE_SIZE[1] * DPI), int(FIGURE_SIZE[0] * DPI))  # rows, columns

    def check(path: Path) -> None:
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE, data[:8]
        assert data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert (height, width) == shape
        with Image.open(path) as image:
            image.load()  # decodes every chunk, checking their CRCs
            pixels = np.asarray(image.convert("RGB"))
        assert pixels.shape == shape + (3,)
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 10, "the image is (nearly) one colour"

    return check
