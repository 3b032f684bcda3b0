"""A trained policy, loaded from a run directory for use in notebooks and scripts.

    policy = jaxddppo.load_policy("runs/CartPole-v1-20261122-101500")
    action = policy(obs)                                   # the policy's mode
    action = policy(obs, key, deterministic=False)         # a sample
    act = jax.jit(policy.act, static_argnames="deterministic")
    action = act(policy.params, obs, key)                  # pure: jit, vmap, grad
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax

from jaxddppo import sharding
from jaxddppo.checkpoint import Checkpointer, RunCounters
from jaxddppo.config import Config, load_resume_config
from jaxddppo.envs import BatchedEnv
from jaxddppo.networks import ActorCritic
from jaxddppo.train import build


@dataclass(frozen=True)
class Policy:
    """The actor of one checkpoint: its parameters and a pure `act`."""

    config: Config
    env: BatchedEnv
    network: ActorCritic
    params: Any  # one shard's parameters (every shard holds the same)
    counters: RunCounters  # the checkpoint's update, env steps, training time

    def act(self, params: Any, obs: jax.Array, key: Optional[jax.Array] = None,
            deterministic: bool = True) -> jax.Array:
        """Actions for a batch of observations [N, *obs_shape]: the mode, or a sample drawn with `key`."""
        dist, _ = self.network.apply(params, obs)
        if deterministic:
            return dist.mode()
        if key is None:
            raise ValueError("a stochastic action (deterministic=False) needs a key")
        return dist.sample(key)

    @functools.cached_property
    def _jitted_act(self) -> Callable:
        return jax.jit(self.act, static_argnames="deterministic")

    def __call__(self, obs: jax.Array, key: Optional[jax.Array] = None, deterministic: bool = True) -> jax.Array:
        return self._jitted_act(self.params, obs, key, deterministic)


def load_policy(run_dir: str, step: Optional[int] = None,
                report: Callable[[str], None] = warnings.warn) -> Policy:
    """The policy of `run_dir`'s newest readable checkpoint (or of checkpoint `step`).

    Works on any number of devices: the run's shards are restored onto one local device.
    Raises ConfigError or CheckpointError (one-line messages) for a bad directory;
    unreadable newer checkpoints that were skipped are passed to `report`.
    """
    config = load_resume_config(run_dir)
    experiment = build(config, devices=jax.local_devices()[:1])
    checkpointer = Checkpointer(run_dir, read_only=True)
    try:
        target = experiment.abstract_state()
        if step is None:
            state, counters = checkpointer.restore_latest(target, report)
        else:
            state, counters = checkpointer.restore(step, target)
    finally:
        checkpointer.close()
    return Policy(config=config, env=experiment.env, network=experiment.network,
                  params=sharding.first_shard(state.params), counters=counters)
