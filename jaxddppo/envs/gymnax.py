"""gymnax environments (the core family: a bare `env.id` such as `CartPole-v1`)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxddppo.config.options import ConfigError
from jaxddppo.envs.base import EnvSpec, observation_spec

UNSUPPORTED = {
    "MNISTBandit-bsuite": "it downloads MNIST when created",
}

# gymnax is imported where it is used: importing it runs JAX computations, which
# would start the XLA backend before `jax.distributed.initialize` can run.


def names() -> list[str]:
    import gymnax

    return [env_id for env_id in gymnax.registered_envs if env_id not in UNSUPPORTED]


def _obs_converter(space: Any) -> Callable[[Any], Any]:
    """Discrete observations one-hot, Box ones float32; any other space's (a Dict, or a user's
    environment without `observation_space`) as they are (`BatchedEnv` casts every leaf)."""
    from gymnax.environments import spaces

    if isinstance(space, spaces.Discrete):
        return lambda obs: jax.nn.one_hot(obs, space.n, dtype=jnp.float32)
    if isinstance(space, spaces.Box):
        return lambda obs: jnp.asarray(obs, jnp.float32)
    return lambda obs: obs


def _observation_space(env: Any, params: Any) -> Any:
    try:
        return env.observation_space(params)
    except NotImplementedError:
        return None


class GymnaxCore:
    """One gymnax environment: its `reset_env` and `step_env` with `params`.

    The time limit is gymnax's own (`is_truncated`, `params.max_steps_in_episode`).
    """

    def __init__(self, env: Any, params: Any, env_id: str):
        from gymnax.environments import spaces

        self.env, self.params = env, params
        self._to_obs = _obs_converter(_observation_space(env, params))
        action_space = env.action_space(params)
        common = {"env_id": env_id, "observation": observation_spec(self.reset),
                  "max_episode_steps": int(getattr(params, "max_steps_in_episode", 0) or 0)}
        if isinstance(action_space, spaces.Discrete):
            self.spec = EnvSpec(discrete=True, num_actions=int(action_space.n), **common)
        elif isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
            low = jnp.broadcast_to(jnp.asarray(action_space.low, jnp.float32), action_space.shape)
            high = jnp.broadcast_to(jnp.asarray(action_space.high, jnp.float32), action_space.shape)
            self.spec = EnvSpec(discrete=False, num_actions=int(action_space.shape[0]),
                                action_low=tuple(float(v) for v in low),
                                action_high=tuple(float(v) for v in high), **common)
        else:
            raise ConfigError(f"env.id={env_id!r}: action space {action_space} is not supported (Discrete, or a "
                              "1-D Box)")

    def reset(self, key: jax.Array) -> tuple[jax.Array, Any]:
        obs, state = self.env.reset_env(key, self.params)
        return self._to_obs(obs), state

    def step(self, key: jax.Array, state: Any, action: jax.Array
             ) -> tuple[jax.Array, Any, jax.Array, jax.Array, jax.Array]:
        obs, state, reward, terminated, _ = self.env.step_env(key, state, action, self.params)
        truncated = self.env.is_truncated(state, self.params)
        return self._to_obs(obs), state, reward, terminated, truncated


    def render(self, state: Any) -> np.ndarray:
        """One state drawn with matplotlib (by `gymnax.visualize` where it can): [H, W, 3] uint8."""
        return draw(self.env, self.params, state, self.spec.env_id)


# gymnax.visualize draws these on a matplotlib Axes, each with the function its `Visualizer`
# picks. Its classic-control frames go through Gymnasium's pygame renderer instead (an extra
# package, and pygame prints audio errors on every frame of a machine without sound), so the
# classic-control environments are drawn here, from their states and parameters.
_DRAWN_BY_GYMNAX = {
    **dict.fromkeys(("Asterix-MinAtar", "Breakout-MinAtar", "Freeway-MinAtar", "Seaquest-MinAtar",
                     "SpaceInvaders-MinAtar", "Pong-misc"), ("vis_minatar", "init_minatar")),
    "Catch-bsuite": ("vis_catch", "init_catch"),
    "MetaMaze-misc": ("vis_maze", "init_maze"),
    "FourRooms-misc": ("vis_maze", "init_maze"),
    "PointRobot-misc": ("vis_circle", "init_circle"),
}
_FIGURE_INCHES, _FIGURE_DPI = 4, 80


def _draw_cart_pole(ax: Any, state: Any, params: Any) -> None:
    from matplotlib.patches import Rectangle

    limit = 1.2 * float(params.x_threshold)
    x, theta, pole = float(state.x), float(state.theta), 2 * float(params.length)
    ax.set_xlim(-limit, limit)
    ax.set_ylim(-0.5, 2 * limit - 0.5)
    ax.axhline(0, color="black", linewidth=1)
    ax.add_patch(Rectangle((x - 0.25, -0.075), 0.5, 0.15, color="tab:gray"))
    ax.plot([x, x + pole * np.sin(theta)], [0.075, 0.075 + pole * np.cos(theta)], color="tab:orange", linewidth=6)


def _draw_pendulum(ax: Any, state: Any, params: Any) -> None:
    theta, length = float(state.theta), float(params.l)
    ax.set_xlim(-1.3 * length, 1.3 * length)
    ax.set_ylim(-1.3 * length, 1.3 * length)
    ax.plot([0, length * np.sin(theta)], [0, length * np.cos(theta)], color="tab:red", linewidth=8)


def _draw_acrobot(ax: Any, state: Any, params: Any) -> None:
    first, second = float(state.joint_angle1), float(state.joint_angle1) + float(state.joint_angle2)
    l1, l2 = float(params.link_length_1), float(params.link_length_2)
    elbow = (l1 * np.sin(first), -l1 * np.cos(first))
    tip = (elbow[0] + l2 * np.sin(second), elbow[1] - l2 * np.cos(second))
    reach = 1.1 * (l1 + l2)
    ax.set_xlim(-reach, reach)
    ax.set_ylim(-reach, reach)
    ax.axhline(l1, color="black", linewidth=1)  # the height the tip must swing above
    ax.plot([0, elbow[0], tip[0]], [0, elbow[1], tip[1]], color="tab:blue", linewidth=6, marker="o")


def _draw_mountain_car(ax: Any, state: Any, params: Any) -> None:
    def height(x: Any) -> Any:
        return 0.45 * np.sin(3 * x) + 0.55

    track = np.linspace(float(params.min_position), float(params.max_position), 100)
    position, goal = float(state.position), float(params.goal_position)
    ax.plot(track, height(track), color="black", linewidth=1)
    ax.plot([goal, goal], [height(goal), height(goal) + 0.15], color="tab:green", linewidth=3)
    ax.plot([position], [height(position) + 0.03], color="tab:gray", marker="s", markersize=14)


_DRAWN_HERE = {
    "CartPole-v1": _draw_cart_pole,
    "Pendulum-v1": _draw_pendulum,
    "Acrobot-v1": _draw_acrobot,
    "MountainCar-v0": _draw_mountain_car,
    "MountainCarContinuous-v0": _draw_mountain_car,
}


def draw(env: Any, params: Any, state: Any, env_id: str) -> np.ndarray:
    """`state` of the gymnax environment `env` as an RGB image [H, W, 3] uint8; ConfigError
    for an environment that neither gymnax's visualisers nor this module draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    name = getattr(env, "name", type(env).__name__)
    if name not in _DRAWN_HERE and name not in _DRAWN_BY_GYMNAX:
        raise ConfigError(f"env.id={env_id!r}: cannot render: gymnax has no visualiser for {name} (these can be "
                          f"drawn: {', '.join(sorted(_DRAWN_HERE) + sorted(_DRAWN_BY_GYMNAX))})")
    figure = Figure(figsize=(_FIGURE_INCHES, _FIGURE_INCHES), dpi=_FIGURE_DPI)
    canvas = FigureCanvasAgg(figure)  # no pyplot: a notebook's figures and backend stay as they are
    ax = figure.add_subplot()
    if name in _DRAWN_HERE:
        _DRAWN_HERE[name](ax, state, params)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        module, function = _DRAWN_BY_GYMNAX[name]
        getattr(importlib.import_module(f"gymnax.visualize.{module}"), function)(ax, env, state, params)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def make_core(name: str, env_id: str) -> GymnaxCore:
    import gymnax

    if name in UNSUPPORTED:
        raise ConfigError(f"env.id={env_id!r} is not supported: {UNSUPPORTED[name]}")
    if name not in gymnax.registered_envs:
        raise ConfigError(f"env.id={env_id!r} is not a gymnax environment; valid ids: {', '.join(names())}")
    env, params = gymnax.make(name)
    return GymnaxCore(env, params, env_id)
