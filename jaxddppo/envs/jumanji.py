"""jumanji adapter (PyPI `jumanji` 1.1.2): `jumanji:Snake-v1` and the other single-agent envs with
one discrete action (`specs.DiscreteArray`).

One environment, functional, without automatic reset (the bare env, no AutoResetWrapper):
  reset(key)               -> (obs, state)
  step(key, state, action) -> (obs, state, reward f32 [], terminated bool [], truncated bool [])

Observation: jumanji's observation NamedTuple as a dict of arrays, one entry per field. A field
that is itself a small pytree of arrays (e.g. Maze's `agent_position: Position(row, col)`) is
flattened into one 1-D array; other non-array fields are dropped. `action_mask` (bool
[num_actions]) is kept and named in `spec.action_mask_key`.

Step: jumanji's `env.step(state, action)` takes no key (randomness lives in `state.key`), so the
key passed here is unused. Termination vs truncation: jumanji's single-agent envs end an episode
at their own `time_limit` with `termination(...)` (discount 0), exactly as a true end. The adapter
calls an end truncated when the env has a `time_limit` and the new state's `step_count` has
reached it, or when jumanji itself gave a LAST step with a non-zero discount (`truncation(...)`);
every other end is terminated. (An episode that truly ends on the time-limit step counts as
truncated: jumanji's timestep cannot tell the two apart.)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxddppo.config.options import ConfigError
from jaxddppo.envs.base import EnvSpec, observation_spec

MASK_KEY = "action_mask"

# Reasons for registered names that this adapter does not offer (beyond non-discrete actions).
UNSUPPORTED = {
    "Sokoban-v0": "it downloads the Boxoban levels from Hugging Face when created",
}


def _registered() -> list[str]:
    import jumanji

    return sorted(jumanji.registered_environments())


def _action_problem(env: Any) -> str | None:
    """Why the env's actions or rewards do not fit the protocol, or None."""
    from jumanji import specs

    action_spec = env.action_spec
    if isinstance(action_spec, specs.MultiDiscreteArray):
        return (f"its action spec is multi-discrete (MultiDiscreteArray, num_values "
                f"{[int(v) for v in jnp.ravel(action_spec.num_values)]}), which this adapter does not support")
    if not isinstance(action_spec, specs.DiscreteArray):
        return (f"its action spec is {type(action_spec).__name__} of shape {tuple(action_spec.shape)}, "
                f"not one discrete action (specs.DiscreteArray)")
    if tuple(env.reward_spec.shape) != ():
        return f"its reward has shape {tuple(env.reward_spec.shape)} (one per agent), not a scalar"
    return None


# Names whose action spec is a single DiscreteArray with a scalar reward, found once by
# building each env (`_action_problem`); kept as a list so that `names()` stays cheap.
DISCRETE = [
    "CVRP-v1", "Game2048-v1", "GraphColoring-v1", "Knapsack-v1", "Maze-v0", "PacMan-v1",
    "SlidingTilePuzzle-v0", "Snake-v1", "TSP-v1",
]


# Envs without a `time_limit` whose episodes still end within a known number of steps (each step
# visits a city / a node, or packs an item); used as `max_episode_steps` so that an evaluation that
# steps at most that many times sees every episode end. Game2048-v1 has no such bound (0).
EPISODE_BOUND = {
    "TSP-v1": lambda env: env.num_cities,
    "Knapsack-v1": lambda env: env.num_items,
    "GraphColoring-v1": lambda env: env.num_nodes,
    "CVRP-v1": lambda env: 2 * env.num_nodes,  # the length of its `trajectory` observation
}


def names() -> list[str]:
    registered = set(_registered())
    return [name for name in DISCRETE if name in registered and name not in UNSUPPORTED]


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def _field_converter(value: Any) -> Callable[[Any], jax.Array] | None:
    """How to turn one observation field (as `jax.eval_shape` gives it) into an array, or None to drop it."""
    if _is_array(value):
        return lambda v: v
    leaves = jax.tree_util.tree_leaves(value)
    if leaves and all(_is_array(leaf) for leaf in leaves):
        dtype = jnp.result_type(*leaves)
        return lambda v: jnp.concatenate([jnp.ravel(leaf).astype(dtype) for leaf in jax.tree_util.tree_leaves(v)])
    return None


class JumanjiCore:
    """One jumanji environment (a built-in id's `jumanji.make(name)`, or a user's own);
    `episode_bound`: the most steps an episode without a `time_limit` takes (0: unknown)."""

    def __init__(self, env: Any, env_id: str, episode_bound: int = 0):
        problem = _action_problem(env)
        if problem is not None:
            raise ConfigError(f"env.id={env_id!r} is not supported: {problem}")
        self.env = env
        self.num_actions = int(env.action_spec.num_values)
        self.time_limit = getattr(env, "time_limit", None)

        _, timestep = jax.eval_shape(env.reset, jax.random.key(0))
        fields = timestep.observation._asdict()
        self._converters = {}
        for field, value in fields.items():
            converter = _field_converter(value)
            if converter is not None:
                self._converters[field] = converter
        obs = observation_spec(self.reset)
        # A malformed mask is refused where every family's is checked (networks.observation_layout).
        mask_key = MASK_KEY if MASK_KEY in obs else None
        self.spec = EnvSpec(
            env_id=env_id,
            observation=obs,
            discrete=True,
            num_actions=self.num_actions,
            max_episode_steps=int(self.time_limit or episode_bound),
            action_mask_key=mask_key,
        )

    def render(self, state: Any) -> np.ndarray:
        """`state` drawn by the environment's own matplotlib viewer, from the figure it draws
        into (jumanji's viewers return an image only when built to, which its environments
        are not): [H, W, 3] uint8, 400 x 400 for the viewers' 10-inch figures."""
        import matplotlib.pyplot as plt

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "cannot be shown" on a non-interactive backend
            self.env.render(state)
        figure = plt.gcf()
        figure.set_dpi(40)
        figure.canvas.draw()
        return np.array(figure.canvas.buffer_rgba())[..., :3]

    def _obs(self, observation: Any) -> dict[str, jax.Array]:
        return {field: convert(getattr(observation, field)) for field, convert in self._converters.items()}

    def reset(self, key: jax.Array) -> tuple[dict[str, jax.Array], Any]:
        state, timestep = self.env.reset(key)
        # some states hold Python scalars outside jit (PacMan-v1: `dead`, positions): make them arrays
        state = jax.tree.map(lambda leaf: leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf), state)
        return self._obs(timestep.observation), state

    def step(self, key: jax.Array, state: Any, action: jax.Array
             ) -> tuple[dict[str, jax.Array], Any, jax.Array, jax.Array, jax.Array]:
        del key  # jumanji's step takes no key
        state, timestep = self.env.step(state, jnp.asarray(action, jnp.int32))
        last = timestep.last()
        at_limit = jnp.asarray(False)
        step_count = getattr(state, "step_count", None)
        if self.time_limit and step_count is not None:
            at_limit = step_count >= self.time_limit
        truncated = jnp.logical_and(last, jnp.logical_or(at_limit, timestep.discount != 0))
        terminated = jnp.logical_and(last, jnp.logical_not(truncated))
        reward = jnp.asarray(timestep.reward, jnp.float32)
        return self._obs(timestep.observation), state, reward, terminated, truncated


def make_core(name: str, env_id: str) -> JumanjiCore:
    import jumanji

    if name in UNSUPPORTED:
        raise ConfigError(f"env.id={env_id!r} is not supported: {UNSUPPORTED[name]}")
    if name not in _registered():
        raise ConfigError(f"env.id={env_id!r} is not a jumanji environment; valid names: {', '.join(names())}")
    env = jumanji.make(name)
    return JumanjiCore(env, env_id, EPISODE_BOUND[name](env) if name in EPISODE_BOUND else 0)
