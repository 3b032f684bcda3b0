"""The one way to act with a policy, shared by the rollout, evaluation and loaded policies.

`policy_step` maps an observation to an action distribution (and a value):
it normalises the observation with the run's running statistics, if the run
keeps them, and advances the recurrent carry, if the network has one.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from jaxddppo.networks import ActorCritic, Distribution
from jaxddppo.normalization import RunningMoments, normalize


def prepare_observations(obs_moments: Optional[RunningMoments], obs: jax.Array) -> jax.Array:
    """What the network sees: `obs` normalised by `obs_moments`, or as it is when there are none."""
    return obs if obs_moments is None else normalize(obs_moments, obs)


def policy_step(
    network: ActorCritic,
    params: Any,
    obs_moments: Optional[RunningMoments],
    carry: Any,
    obs: jax.Array,
    episode_start: Optional[jax.Array],
) -> tuple[Any, Distribution, jax.Array]:
    """(carry, distribution, value) for a batch of raw observations `obs` [B, ...].

    Feed-forward networks take and return `carry=None` and ignore
    `episode_start`; recurrent ones reset the carry where `episode_start` [B]
    is true (the observation is the first of its episode).
    """
    return network.step(params, carry, prepare_observations(obs_moments, obs), episode_start)
