"""Videos of the deterministic policy: episodes played on device, drawn on the host, written
as a GIF (Pillow) or an MP4 (imageio-ffmpeg, the `video` extra).

An episode is played by one jitted program, `CHUNK_STEPS` steps per call (`lax.scan`), which
returns the environment's state after every step; the host draws the states one at a time
with the environment's `render(state)` (the optional method of `envs.base.EnvCore`) until
the episode ends or reaches its time limit. A chunk, not a whole episode, is held at once:
full Craftax allows 100,000 steps. An episode of L steps gives L + 1 frames, its first state
and the state after every step. Episode `i` of key `k` is the one `evaluate_policy` plays
with key `fold_in(k, i)`, as the periodic evaluation's episode `i` (`evaluate_on_shards`).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxddppo.config.options import ConfigError
from jaxddppo.envs import BatchedEnv, EpisodeState
from jaxddppo.networks import ActorCritic
from jaxddppo.rollout import RunningMoments, policy_step

CHUNK_STEPS = 128
FRAMES_PER_SECOND = 30
FORMATS = (".gif", ".mp4")


@struct.dataclass
class _PlayCarry:
    env_state: EpisodeState  # one environment: leaves [1, ...]
    obs: Any
    policy_carry: Any  # recurrent policies only, else None
    episode_start: Optional[jax.Array]  # recurrent policies only, else None
    step: jax.Array


def _start(env: BatchedEnv, network: ActorCritic, key_reset: jax.Array) -> _PlayCarry:
    obs, env_state = env.reset(key_reset, 1, auto_reset=False)
    episode_start = jnp.ones((1,), bool) if network.recurrent else None
    return _PlayCarry(env_state, obs, network.initial_carry(1), episode_start, jnp.zeros((), jnp.int32))


def _play_chunk(env: BatchedEnv, network: ActorCritic, params: Any, obs_moments: Optional[RunningMoments],
                key_steps: jax.Array, carry: _PlayCarry) -> tuple[_PlayCarry, tuple[Any, jax.Array]]:
    """`CHUNK_STEPS` steps of the policy's mode: the core's states [CHUNK_STEPS, 1, ...] and done [CHUNK_STEPS]."""

    def step(carry: _PlayCarry, _: None) -> tuple[_PlayCarry, tuple[Any, jax.Array]]:
        policy_carry, dist, _ = policy_step(network, params, obs_moments, carry.policy_carry, carry.obs,
                                            carry.episode_start)
        env_state, result = env.step_without_reset(jax.random.fold_in(key_steps, carry.step), carry.env_state,
                                                   dist.mode())
        done = result.terminated | result.truncated
        carry = _PlayCarry(env_state, result.obs, policy_carry, done if network.recurrent else None, carry.step + 1)
        return carry, (env_state.env_state, done[0])

    return jax.lax.scan(step, carry, None, length=CHUNK_STEPS)


_start_program = jax.jit(_start, static_argnums=(0, 1))
_play_chunk_program = jax.jit(_play_chunk, static_argnums=(0, 1))


def _on_host(leaf: jax.Array) -> Any:
    """A NumPy copy of `leaf`; a typed PRNG key, which NumPy cannot hold, stays a JAX array."""
    return leaf if jax.dtypes.issubdtype(jnp.result_type(leaf), jax.dtypes.prng_key) else np.asarray(leaf)


def episode_states(env: BatchedEnv, network: ActorCritic, params: Any, obs_moments: Optional[RunningMoments],
                   key: jax.Array) -> Iterator[Any]:
    """One episode's states of the environment's core, unbatched, on the host: the first,
    then the state after every step, until the episode ends or reaches `max_episode_steps`."""
    key_reset, key_steps = jax.random.split(key)
    carry = _start_program(env, network, key_reset)
    yield jax.tree.map(lambda leaf: _on_host(leaf)[0], carry.env_state.env_state)
    limit, steps = env.spec.max_episode_steps, 0
    while True:
        carry, (states, done) = _play_chunk_program(env, network, params, obs_moments, key_steps, carry)
        states, done = jax.tree.map(_on_host, states), np.asarray(done)
        for index in range(CHUNK_STEPS):
            yield jax.tree.map(lambda leaf: leaf[index, 0], states)
            steps += 1
            if done[index] or steps == limit:
                return


def renderer(env: BatchedEnv) -> Callable[[Any], Any]:
    """The environment's `render(state)`; ConfigError for one that cannot draw itself."""
    render = getattr(env.core, "render", None)
    if not callable(render):
        raise ConfigError(f"env.id={env.spec.env_id!r}: cannot render: its environment has no render(state) method "
                          "(the optional method of jaxddppo.envs.EnvCore)")
    return render


def check_renders(env: BatchedEnv) -> None:
    """ConfigError now if the environment cannot draw its first state (render is the host's
    work, so a run finds out before it trains)."""
    render = renderer(env)
    state = jax.jit(lambda key: env.reset(key, 1, auto_reset=False)[1].env_state)(jax.random.key(0))
    _frame(env.spec.env_id, render(jax.tree.map(lambda leaf: _on_host(leaf)[0], state)))


def _frame(env_id: str, image: Any) -> np.ndarray:
    frame = np.asarray(image)
    if frame.ndim != 3 or frame.shape[-1] != 3 or frame.dtype != np.uint8:
        raise ConfigError(f"env.id={env_id!r}: render(state) returned an array of shape {frame.shape} and dtype "
                          f"{frame.dtype}, not [H, W, 3] uint8")
    return frame


def render_episodes(env: BatchedEnv, network: ActorCritic, params: Any, obs_moments: Optional[RunningMoments],
                    key: jax.Array, num_episodes: int = 1) -> list[list[np.ndarray]]:
    """The frames of `num_episodes` deterministic episodes, episode `i` from `fold_in(key, i)`:
    one list per episode, its length + 1 frames [H, W, 3] uint8."""
    render = renderer(env)
    return [[_frame(env.spec.env_id, render(state))
             for state in episode_states(env, network, params, obs_moments, jax.random.fold_in(key, episode))]
            for episode in range(num_episodes)]


def check_video_path(path: str) -> None:
    """ConfigError unless `path` ends in a known format whose encoder is installed."""
    if not path.lower().endswith(FORMATS):
        raise ConfigError(f"--video {path}: the file must end in {' or '.join(FORMATS)}")
    if path.lower().endswith(".mp4") and importlib.util.find_spec("imageio_ffmpeg") is None:
        raise ConfigError(f"--video {path}: MP4 needs the video extra: pip install 'jaxddppo[video]'")


def write_video(path: str, frames: Sequence[np.ndarray], fps: int = FRAMES_PER_SECOND) -> None:
    """`frames` ([H, W, 3] uint8, all one size) as a looping GIF or an MP4 (H.264), by `path`'s suffix.

    A GIF merges a frame identical to the one before it into that one's duration."""
    check_video_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.lower().endswith(".gif"):
        from PIL import Image

        images = [Image.fromarray(frame) for frame in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
        return
    import imageio_ffmpeg

    # H.264 in yuv420p needs even sides: drop a last odd row or column.
    height, width = (side - side % 2 for side in frames[0].shape[:2])
    writer = imageio_ffmpeg.write_frames(path, (width, height), fps=fps, macro_block_size=1)
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame[:height, :width]))
    writer.close()
