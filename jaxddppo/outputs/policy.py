"""A trained policy, loaded from a run directory for use in notebooks and scripts.

    policy = jaxddppo.load_policy("runs/CartPole-v1-20261122-101500")
    action = policy(obs)                                   # the policy's mode
    action = policy(obs, key, deterministic=False)         # a sample
    act = jax.jit(policy.act, static_argnames="deterministic")
    action = act(policy.params, obs, key)                  # pure: jit, vmap, grad
    carry, action = policy.step(policy.params, carry, obs, episode_start)   # recurrent policies
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax

from jaxddppo.config.files import load_resume_config
from jaxddppo.config.options import Config
from jaxddppo.distributed import global_arrays
from jaxddppo.envs import BatchedEnv
from jaxddppo.networks import ActorCritic
from jaxddppo.references import with_objects
from jaxddppo.rollout import RunningMoments, policy_step
from jaxddppo.training.checkpoint import Checkpointer, RunCounters
from jaxddppo.training.experiment import build


@dataclass(frozen=True)
class Policy:
    """The actor of one checkpoint: its parameters, the run's observation statistics, and pure functions.

    Feed-forward policies: `act(params, obs, key, deterministic)`, or `policy(obs)`.
    Recurrent ones carry a hidden state: `step(params, carry, obs, episode_start, ...)`
    from `initial_carry(batch_size)`. Observations are normalised as in training.
    """

    config: Config
    env: BatchedEnv
    network: ActorCritic
    params: Any  # one shard's parameters (every shard holds the same)
    obs_moments: Optional[RunningMoments]  # the run's observation statistics, if it normalised
    counters: RunCounters  # the checkpoint's update, env steps, training time

    @property
    def recurrent(self) -> bool:
        return bool(self.network.recurrent)

    def initial_carry(self, batch_size: int) -> Any:
        """The hidden state before a first observation (None for a feed-forward policy)."""
        return self.network.initial_carry(batch_size)

    def step(self, params: Any, carry: Any, obs: Any, episode_start: Optional[jax.Array] = None,
             key: Optional[jax.Array] = None, deterministic: bool = True) -> tuple[Any, jax.Array]:
        """(carry, actions) for a batch of raw observations (leaves [N, ...], as the environment gives them).

        `episode_start` [N] marks observations that begin an episode (the carry is reset
        there); recurrent policies need it, feed-forward ones ignore it.
        """
        if self.recurrent and episode_start is None:
            raise ValueError("a recurrent policy needs episode_start [N] (True where an episode begins)")
        carry, dist, _ = policy_step(self.network, params, self.obs_moments, carry, obs, episode_start)
        if deterministic:
            return carry, dist.mode()
        if key is None:
            raise ValueError("a stochastic action (deterministic=False) needs a key")
        return carry, dist.sample(key)

    def act(self, params: Any, obs: Any, key: Optional[jax.Array] = None,
            deterministic: bool = True) -> jax.Array:
        """Actions of a feed-forward policy for a batch of observations: the mode, or a sample drawn with `key`."""
        if self.recurrent:
            raise ValueError(f"network.recurrent={self.network.recurrent}: use policy.step with a carry")
        return self.step(params, None, obs, None, key, deterministic)[1]

    @functools.cached_property
    def _jitted_act(self) -> Callable:
        return jax.jit(self.act, static_argnames="deterministic")

    def __call__(self, obs: Any, key: Optional[jax.Array] = None, deterministic: bool = True) -> jax.Array:
        return self._jitted_act(self.params, obs, key, deterministic)


def load_policy(run_dir: str, step: Optional[int] = None,
                report: Callable[[str], None] = warnings.warn, *, env: Any = None, torso: Any = None) -> Policy:
    """The policy of `run_dir`'s newest intact checkpoint (or of checkpoint `step`).

    Works on any number of devices: the run's state is restored onto one local device.
    Raises ConfigError or CheckpointError (one-line messages) for a bad directory or a
    damaged `step`; unreadable or damaged newer checkpoints that were skipped are passed to
    `report`. A run trained on an environment or
    torso object without an importable reference needs the same `env` or `torso` again.
    """
    config, objects = with_objects(load_resume_config(run_dir), env, torso)
    experiment = build(config, devices=jax.local_devices()[:1], objects=objects)
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
                  params=global_arrays.local_copy(state.params),
                  obs_moments=global_arrays.local_copy(state.obs_moments), counters=counters)
