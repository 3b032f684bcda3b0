"""MuJoCo Playground adapter (PyPI `playground` 0.2.0, import `mujoco_playground`, with `mujoco-mjx`):
`playground:CartpoleBalance` and the other registered tasks.

One environment, functional, without automatic reset (the bare `MjxEnv`, no brax wrappers):
  reset(key)               -> (obs, state)
  step(key, state, action) -> (obs, state, reward f32 [], terminated bool [], truncated bool [])

Time limit: the raw playground env has none (it lives in brax's EpisodeWrapper, fed with the
config's `episode_length`). The adapter counts steps itself: state = (env_state, steps).
Each adapter step runs the env's `step` `action_repeat` times (config `action_repeat`, 1 for all
but two manipulation tasks), summing rewards, as brax's EpisodeWrapper does; steps counts raw
env steps. truncated = steps >= episode_length and not terminated; terminated = env `done` (DM
Control suite: NaN in qpos/qvel only; locomotion: a fall etc.).
`spec.max_episode_steps` = ceil(episode_length / action_repeat) adapter steps.

Observation: as the env gives it: a float32 array (DM Control suite) or a dict of arrays
(locomotion/manipulation, e.g. {'state', 'privileged_state'}).
Actions: continuous, `num_actions` = env.action_size, range [-1, 1] for every task (DM Control
suite: actuator ctrlrange is [-1, 1]; locomotion: action scales an offset from the default pose,
brax PPO's tanh range).

Physics implementation: every default config says impl='warp' (MuJoCo Warp through an XLA FFI
call). On a CPU backend, or where the `warp` package is not installed, the adapter overrides it
with impl='jax' (pure-JAX MJX); on a GPU with Warp it keeps the config's default.

Step key: playground's `env.step(state, action)` takes no key (envs that need randomness keep a
key in `state.info['rng']`), so the key passed here is unused. A typed key (jax.random.key) is
turned into raw uint32 key data for the env, which expects `jax.random.PRNGKey`-style keys.

Offline: DM Control suite tasks load from XMLs inside the wheel. Locomotion and manipulation
tasks need mujoco_menagerie, which playground `git clone`s from GitHub into
site-packages/mujoco_playground/external_deps at load time; the adapter offers them only when that
directory already exists (it never triggers the clone).
"""

from __future__ import annotations

import ctypes.util
import importlib
import importlib.util
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxddppo.config.options import ConfigError
from jaxddppo.envs.base import EnvSpec, observation_spec, strongly_typed


# Vision variants (config vision=True) need MJX's Warp renderer: not offered.


def _menagerie_present() -> bool:
    from mujoco_playground._src import mjx_env

    path = mjx_env.MENAGERIE_PATH
    return path.exists() and any(path.iterdir())


def _suites() -> dict[str, tuple[str, ...]]:
    from mujoco_playground import registry

    return {
        "dm_control_suite": tuple(registry.dm_control_suite.ALL_ENVS),
        "locomotion": tuple(registry.locomotion.ALL_ENVS),
        "manipulation": tuple(registry.manipulation.ALL_ENVS),
    }


def names() -> list[str]:
    """Tasks that can be built here: the DM Control suite always; locomotion and manipulation
    only when mujoco_menagerie is already on disk (no download at run time)."""
    suites = _suites()
    out = list(suites["dm_control_suite"])
    if _menagerie_present():
        out += list(suites["locomotion"]) + list(suites["manipulation"])
    return out


def _raw_key(key: jax.Array) -> jax.Array:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def _fresh_containers(tree: Any) -> Any:
    """Same leaves, new dicts: playground envs update state.info / state.metrics in place
    (e.g. `state.info['feet_air_time'] += dt`), which would alter the caller's state outside jit."""
    return jax.tree_util.tree_map(lambda x: x, tree)


class PlaygroundCore:
    """One playground environment (`MjxEnv`): a registered task's, or a user's own. Its
    config's `episode_length` (and `action_repeat`, if any) set the time limit."""

    def __init__(self, env: Any, env_id: str):
        self.env = env
        config = getattr(env, "_config", None)  # the env's own (locked, overridden) config
        if config is None or "episode_length" not in config:
            raise ConfigError(f"env.id={env_id!r}: the MuJoCo Playground environment has no episode_length in its "
                              "config (MjxEnv.__init__(config) keeps it), which sets the time limit")
        self.episode_length = int(config.episode_length)
        self.action_repeat = int(config.get("action_repeat", 1) or 1)
        self.num_actions = int(self.env.action_size)
        self._painter: Any = None  # made by the first `render`

        self.spec = EnvSpec(
            env_id=env_id,
            observation=observation_spec(self.reset),
            discrete=False,
            num_actions=self.num_actions,
            action_low=(-1.0,) * self.num_actions,
            action_high=(1.0,) * self.num_actions,
            max_episode_steps=math.ceil(self.episode_length / self.action_repeat),
        )

    def reset(self, key: jax.Array) -> tuple[Any, Any]:
        env_state = strongly_typed(self.env.reset(_raw_key(key)))
        return env_state.obs, (env_state, jnp.zeros((), jnp.int32))

    def step(self, key: jax.Array, state: Any, action: jax.Array
             ) -> tuple[Any, Any, jax.Array, jax.Array, jax.Array]:
        del key  # playground's step takes no key
        env_state, steps = state
        env_state = _fresh_containers(env_state)
        action = jnp.asarray(action, jnp.float32)
        if self.action_repeat == 1:
            env_state = self.env.step(env_state, action)
            reward = env_state.reward
        else:
            def body(s, _):
                s = self.env.step(_fresh_containers(s), action)
                return s, s.reward
            env_state, rewards = jax.lax.scan(body, env_state, None, length=self.action_repeat)
            reward = jnp.sum(rewards)
        steps = steps + self.action_repeat
        terminated = env_state.done > 0
        truncated = jnp.logical_and(steps >= self.episode_length, jnp.logical_not(terminated))
        env_state = strongly_typed(env_state)
        return env_state.obs, (env_state, steps), jnp.asarray(reward, jnp.float32), terminated, truncated

    def render(self, state: Any) -> np.ndarray:
        """One state drawn by MuJoCo's OpenGL renderer, headless: [240, 320, 3] uint8."""
        if self._painter is None:
            self._painter = MujocoPainter(self.env.mj_model, self.spec.env_id)
        return self._painter.draw(state[0].data)


FRAME_HEIGHT, FRAME_WIDTH = 240, 320


def gl_context_class(env_id: str) -> type:
    """MuJoCo's OpenGL context: the one MUJOCO_GL chose when MuJoCo was imported, else a headless
    one without a display, EGL where its library loads, else OSMesa.

    The class is picked here rather than by setting MUJOCO_GL, which MuJoCo reads once, on import
    (the environment imported it); PyOpenGL binds one platform per process, so a platform already
    named by PYOPENGL_PLATFORM is the only one tried."""
    if os.environ.get("MUJOCO_GL"):
        from mujoco import gl_context

        return gl_context.GLContext
    named = os.environ.get("PYOPENGL_PLATFORM", "").lower()
    for platform, library in (("egl", "EGL"), ("osmesa", "OSMesa")):
        if named in ("", platform) and ctypes.util.find_library(library):
            return importlib.import_module(f"mujoco.{platform}").GLContext
    raise ConfigError(f"env.id={env_id!r}: cannot render: MuJoCo draws headless with EGL or OSMesa and neither library "
                      "loads here (apt-get install libegl1, or libosmesa6; or set MUJOCO_GL)")


class MujocoPainter:
    """MuJoCo's renderer of one model, in an OpenGL context of its own: the model's first
    camera (the DM Control suite's side or fixed view), else MuJoCo's default free camera."""

    def __init__(self, model: Any, env_id: str):
        import mujoco

        try:
            self.context = gl_context_class(env_id)(FRAME_WIDTH, FRAME_HEIGHT)
            self.context.make_current()
        except ConfigError:
            raise
        except Exception as error:  # the GL libraries' own errors, of many types
            raise ConfigError(f"env.id={env_id!r}: cannot render: MuJoCo's OpenGL context failed: {error}") from None
        self.model, self.data = model, mujoco.MjData(model)
        self.scene = mujoco.MjvScene(model, maxgeom=10_000)
        self.option = mujoco.MjvOption()
        self.camera = mujoco.MjvCamera()
        if model.ncam:
            self.camera.type, self.camera.fixedcamid = mujoco.mjtCamera.mjCAMERA_FIXED, 0
        else:
            self.camera.type = mujoco.mjtCamera.mjCAMERA_FREE
            mujoco.mjv_defaultFreeCamera(model, self.camera)
        self.gpu = mujoco.MjrContext(model, mujoco.mjtFontScale.mjFONTSCALE_150)
        mujoco.mjr_setBuffer(mujoco.mjtFramebuffer.mjFB_OFFSCREEN, self.gpu)
        self.viewport = mujoco.MjrRect(0, 0, FRAME_WIDTH, FRAME_HEIGHT)

    def draw(self, data: Any) -> np.ndarray:
        """The scene of `data` (an MJX state's data, on the host) as [H, W, 3] uint8."""
        import mujoco

        for field in ("qpos", "qvel", "mocap_pos", "mocap_quat", "xfrc_applied"):
            getattr(self.data, field)[:] = np.asarray(getattr(data, field))
        mujoco.mj_forward(self.model, self.data)
        self.context.make_current()
        mujoco.mjv_updateScene(self.model, self.data, self.option, None, self.camera, mujoco.mjtCatBit.mjCAT_ALL,
                               self.scene)
        mujoco.mjr_render(self.viewport, self.scene, self.gpu)
        pixels = np.empty((FRAME_HEIGHT, FRAME_WIDTH, 3), np.uint8)
        mujoco.mjr_readPixels(pixels, None, self.viewport, self.gpu)
        return np.flipud(pixels).copy()  # OpenGL's first row is the bottom one


def make_core(name: str, env_id: str) -> PlaygroundCore:
    """A registered task, built by `registry.load(name, config_overrides=...)`."""
    from mujoco_playground import registry

    suites = _suites()
    every = [n for suite in suites.values() for n in suite]
    if name not in every:
        raise ConfigError(f"env.id={env_id!r} is not a MuJoCo Playground task; valid names: {', '.join(names())}")
    if name not in suites["dm_control_suite"] and not _menagerie_present():
        raise ConfigError(
            f"env.id={env_id!r} needs mujoco_menagerie on disk; fetch it once (git and network needed) with: "
            f"python -c \"from mujoco_playground import registry; registry.load('{name}')\"")
    config = registry.get_default_config(name)
    pure_jax = "impl" in config and (jax.default_backend() == "cpu" or importlib.util.find_spec("warp") is None)
    return PlaygroundCore(registry.load(name, config_overrides={"impl": "jax"} if pure_jax else None), env_id)
