"""Your own environment and torso, as a user writes them: a gymnax environment and a flax module.

`Corridor(length)`: a corridor of `length` cells; the agent's cell and the goal's, another one, are
drawn at each reset. The observation [2, length] marks the agent's cell (row 0) and the goal's
(row 1); the actions are 0 (left) and 1 (right), a step into a wall stays. Reaching the goal ends
the episode (a termination) with the reward shortest / taken: the shortest walk's steps over the
steps taken, 1 for the shortest walk. The episode is truncated at max_steps = 4 length (return 0).

`LayerNormMLP(features)`: every observation leaf flattened and laid end to end, then Dense,
LayerNorm and ReLU for each width in `features`.

Train both from the repository root (`examples` imports from the working directory):

    python -m jaxddppo.train --config examples/corridor.yaml
    python -m jaxddppo.train --config examples/corridor.yaml env.kwargs.length=7
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import environment, spaces


@struct.dataclass
class EnvState(environment.EnvState):
    position: jax.Array  # the agent's cell, 0 .. length - 1
    goal: jax.Array  # the goal's cell, another one
    shortest: jax.Array  # the shortest walk's steps, |goal - start|
    time: int  # steps taken; gymnax truncates at params.max_steps_in_episode


@struct.dataclass
class EnvParams(environment.EnvParams):
    max_steps_in_episode: int = 36  # Corridor's default_params: 4 length


class Corridor(environment.Environment[EnvState, EnvParams]):
    """Walk to the goal's cell of a corridor of `length` cells."""

    def __init__(self, length: int):
        super().__init__()
        if length < 2:
            raise ValueError(f"length={length} must be at least 2")
        self.length = length  # static: it sets the observation's shape

    @property
    def default_params(self) -> EnvParams:
        return EnvParams(max_steps_in_episode=4 * self.length)

    def reset_env(self, key: jax.Array, params: EnvParams) -> tuple[jax.Array, EnvState]:
        start_key, offset_key = jax.random.split(key)
        start = jax.random.randint(start_key, (), 0, self.length)
        goal = (start + jax.random.randint(offset_key, (), 1, self.length)) % self.length
        state = EnvState(position=start, goal=goal, shortest=jnp.abs(goal - start), time=0)
        return self.get_obs(state), state

    def step_env(self, key: jax.Array, state: EnvState, action: jax.Array, params: EnvParams
                 ) -> tuple[jax.Array, EnvState, jax.Array, jax.Array, dict[str, Any]]:
        move = jnp.where(action == 1, 1, -1)
        position = jnp.clip(state.position + move, 0, self.length - 1).astype(jnp.int32)
        state = state.replace(position=position, time=state.time + 1)
        terminated = self.is_terminated(state, params)
        reward = jnp.where(terminated, state.shortest / state.time, 0.0)
        return self.get_obs(state), state, reward.astype(jnp.float32), terminated, {}

    def get_obs(self, state: EnvState, params: Any = None, key: Any = None) -> jax.Array:
        cells = jnp.arange(self.length)
        return jnp.stack([cells == state.position, cells == state.goal]).astype(jnp.float32)

    def is_terminated(self, state: EnvState, params: EnvParams) -> jax.Array:
        return state.position == state.goal

    @property
    def name(self) -> str:
        return f"Corridor-{self.length}"

    @property
    def num_actions(self) -> int:
        return 2

    def action_space(self, params: EnvParams | None = None) -> spaces.Discrete:
        return spaces.Discrete(2)

    def observation_space(self, params: EnvParams) -> spaces.Box:
        return spaces.Box(0.0, 1.0, (2, self.length), jnp.float32)


class LayerNormMLP(nn.Module):
    """Features [batch, features[-1]] of a batch of observations (any pytree, leaves [batch, ...])."""

    features: Sequence[int] = (64, 64)

    @nn.compact
    def __call__(self, observations: Any) -> jax.Array:
        x = jnp.concatenate([leaf.reshape(leaf.shape[0], -1) for leaf in jax.tree.leaves(observations)], axis=-1)
        for width in self.features:
            x = nn.relu(nn.LayerNorm()(nn.Dense(width)(x)))
        return x
