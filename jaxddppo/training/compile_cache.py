"""The commands' compilation cache (`run.compilation_cache`): JAX's persistent cache of
compiled programs, on by default for `python -m jaxddppo.train`, `.sweep` and `.evaluate`.

A run writes the programs it compiles (in 0.1 s or more) to the cache; a later run of the
same programs loads them instead of compiling them: the same config again, another seed
(keys are inputs, not constants), a resume, an evaluation. JAX keys each program by its
text, the compiler options and flags, and the jax, XLA and device versions, so a loaded
program computes what compiling it would have, bit for bit. Tracing is not cached: a run
still traces its programs before it looks them up.

The Python API leaves JAX's own setting alone (`jax.config.update("jax_compilation_cache_dir",
...)` turns it on in a notebook).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path
from typing import Mapping, Optional

import jax

from jaxddppo.config.options import ConfigError

# Least recently used programs are deleted beyond this (a CheetahRun run writes 3.5 MB).
MAX_CACHE_BYTES = 2 * 1024 ** 3
# Programs that compile faster are not written (the eager operations' many small ones).
MIN_COMPILE_SECONDS = 0.1
CPUINFO = Path("/proc/cpuinfo")


def machine_tag(cpuinfo: Optional[str] = None) -> str:
    """This machine's architecture and a digest of its CPU's instruction-set features.

    XLA compiles CPU code for the features of the host it compiles on, and JAX's cache key
    leaves them out: machines that share a home directory (a cluster's login and compute
    nodes) keep apart caches, where a program compiled for one would be refused by the other
    at every load. `cpuinfo`: the text of /proc/cpuinfo (read here if None)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            cpuinfo = ""
    fields = (line.partition(":") for line in cpuinfo.splitlines())
    features = next((" ".join(sorted(value.split())) for name, _, value in fields
                     if name.strip() in ("flags", "Features")), "") or platform.processor()  # x86, ARM
    return f"{platform.machine() or 'unknown'}-{hashlib.sha256(features.encode()).hexdigest()[:12]}"


def default_directory(environ: Mapping[str, str]) -> Path:
    """The cache of `run.compilation_cache=auto`: $XDG_CACHE_HOME (else ~/.cache)/jaxddppo/compiled/MACHINE."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxddppo" / "compiled" / machine_tag()


def writable_directory(path: Path) -> Optional[str]:
    """None if `path` is (now) a directory this process can write to, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return error.strerror or str(error)
    if not os.access(path, os.W_OK | os.X_OK):
        return "Permission denied"
    return None


def use_compilation_cache(setting: str, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """Set JAX's compilation cache for a command from `run.compilation_cache` before it
    compiles anything; return the directory in use (None: no cache).

    `auto`: JAX's own setting where one is made (JAX_COMPILATION_CACHE_DIR, or the cache
    turned off with JAX_ENABLE_COMPILATION_CACHE=false), else `default_directory`, or no cache
    (with a line on stderr) if that cannot be written. `off`: no cache. Anything else: that
    directory, or ConfigError if it cannot be written."""
    if setting == "off":
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    if setting == "auto":
        if not jax.config.jax_enable_compilation_cache:
            return None
        if jax.config.jax_compilation_cache_dir:
            return jax.config.jax_compilation_cache_dir
        directory = default_directory(environ)
        problem = writable_directory(directory)
        if problem is not None:
            print(f"jaxddppo: no compilation cache: {directory} cannot be written ({problem}); "
                  "run.compilation_cache=DIR names another", file=sys.stderr, flush=True)
            return None
    else:
        directory = Path(setting).expanduser()
        problem = writable_directory(directory)
        if problem is not None:
            raise ConfigError(f"run.compilation_cache={setting!r} is invalid: the directory cannot be written "
                              f"({problem})")
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_enable_compilation_cache", True)  # a directory named wins over JAX's variable
    # Where JAX's own variables leave them unset: a size limit, and a lower threshold than JAX's
    # default (a second, which most of a small run's programs take less than).
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return str(directory)
