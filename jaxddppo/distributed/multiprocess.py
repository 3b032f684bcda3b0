"""Many processes: starting the backend and joining a multi-process run
(`jax.distributed`), process 0's text on every process, and the check that every shard
holds the same parameters (`check_replicas`).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxddppo.config.options import Config, DistributedConfig
from jaxddppo.cpu import tuning as cpu_tuning
from jaxddppo.distributed.global_arrays import replica_checksums
from jaxddppo.sharding import is_population


def broadcast_text(text: str, max_bytes: int = 4096) -> str:
    """Process 0's `text` on every process (a collective; a no-op in a single-process run)."""
    if jax.process_count() == 1:
        return text
    encoded = text.encode()
    if len(encoded) > max_bytes:
        raise ValueError(f"broadcast_text: {len(encoded)} bytes exceed {max_bytes}")
    buffer = np.zeros(max_bytes, np.uint8)
    buffer[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return bytes(received).rstrip(b"\0").decode()


class DistributedError(RuntimeError):
    """The multi-process runtime could not start; the message is one line."""


def _wait_for_coordinator(address: str, timeout_seconds: float) -> None:
    """Fail with one line if nothing listens at `address` within the timeout.

    JAX aborts the whole process (SIGABRT, a C++ stack trace) when it cannot
    register with the coordinator, so a process that is not the coordinator
    checks first that it can reach it.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"coordinator {address} unreachable for {timeout_seconds} s (distributed.init_timeout); "
                    "check that process 0 runs and that its host and port are reachable"
                ) from None
            time.sleep(0.25)


def start_backend(config: Config) -> list[str]:
    """What a run or a sweep does before its first JAX computation: size the CPU thread
    pool and the CPU device count (`cpu_tuning.set_up_cpu`), then join a
    multi-process run if the config asks for one and none is joined yet. Returns their
    warnings, if any."""
    warnings = cpu_tuning.set_up_cpu(config)
    if not jax.distributed.is_initialized():
        initialize_distributed(config.distributed)
    return warnings


def initialize_distributed(config: DistributedConfig) -> None:
    """Join a multi-process run when the config asks for one; otherwise stay single-process.

    Explicit settings win. Cluster auto-detection (SLURM, Open MPI, Cloud TPU,
    Kubernetes) runs only with `distributed.auto=true`, so stray cluster variables
    never start it.
    """
    if config.coordinator is not None:
        where = f"coordinator {config.coordinator}"
        explicit = {
            "coordinator_address": config.coordinator,
            "num_processes": config.num_processes,
            "process_id": config.process_id,
        }
        if config.process_id != 0:
            _wait_for_coordinator(config.coordinator, config.init_timeout)
    elif config.auto:
        where, explicit = "auto-detected cluster", {}
    else:
        return
    try:
        jax.distributed.initialize(
            **explicit,
            initialization_timeout=config.init_timeout,
            heartbeat_timeout_seconds=config.heartbeat_timeout,
        )
    except Exception as error:  # JAX raises several types, each with a many-line message
        detail = " ".join(str(error).split())[:300]
        raise DistributedError(
            f"jax.distributed could not start ({where}, distributed.init_timeout={config.init_timeout} s): {detail}"
        ) from None


class ReplicaDivergence(RuntimeError):
    """Devices hold different copies of the parameters; the message is one line."""


def check_replicas(params: Any, mesh: Mesh, after_update: int) -> None:
    """Raise ReplicaDivergence unless, within every member, every device of every process
    holds bitwise the same per-member `params`."""
    checksums = replica_checksums(params, mesh)
    for member, every_device in enumerate(checksums.reshape(-1, checksums.shape[-1])):
        differing = [int(i) for i in np.flatnonzero(every_device != every_device[0])]
        if differing:
            whose = f" of member {member}" if is_population(mesh) else ""
            raise ReplicaDivergence(
                f"replicas{whose} diverged after update {after_update}: device(s) {differing} differ from device 0 "
                f"(parameter bit checksums {every_device.tolist()}); check that every host runs the same "
                "jaxddppo, JAX and jaxlib versions"
            )
