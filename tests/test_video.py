"""Videos of the deterministic policy: `python -m jaxddppo.evaluate RUN_DIR --video FILE` and a
run's periodic `eval.video_every_updates`.

An episode of length L gives L + 1 frames (its first state, then one per step) that change
over the episode; the GIF decodes to them (identical neighbours merged into one longer frame).
An environment that cannot draw itself is one line and exit code 2. With TensorBoard on, a
run's periodic videos are in its events too, as animated GIF images.
"""

import io
import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from jaxddppo import evaluate
from jaxddppo.config.files import from_dict
from jaxddppo.config.options import ConfigError
from jaxddppo.envs import BatchedEnv, EnvSpec
from jaxddppo.envs.gymnax import GymnaxCore
from jaxddppo.outputs import video
from jaxddppo.outputs.policy import load_policy
from jaxddppo.train import run
from jaxddppo.training.experiment import build

from conftest import family_installed


def tiny_run(run_dir: Path, env_id: str, **eval_section) -> dict:
    return {
        "env": {"id": env_id, "num_envs": 4},
        "ppo": {"num_steps": 8, "num_epochs": 1, "num_minibatches": 1},
        "train": {"total_env_steps": 4 * 8 * 2, "updates_per_chunk": 1, "num_shards": 1},
        "eval": {"num_episodes": 1, **eval_section},
        "run": {"dir": str(run_dir), "progress": False},
    }


def random_params(experiment, seed: int = 0):  # an Experiment or a Policy
    """Standard normal parameters of the policy's shapes (no initialiser to compile): a
    policy whose episodes end early."""
    obs = jax.tree.map(lambda leaf: jnp.zeros((1, *leaf.shape), leaf.dtype), experiment.env.spec.observation)
    shapes = jax.eval_shape(experiment.network.init, jax.random.key(0), obs)

    def draw(key):
        leaves, treedef = jax.tree.flatten(shapes)
        keys = jax.random.split(key, len(leaves))
        return treedef.unflatten([jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)])

    return jax.jit(draw)(jax.random.key(seed))


def gif_frames(path: Path) -> tuple[list[np.ndarray], list[int]]:
    """Every frame of a GIF as RGB, and each one's duration in milliseconds."""
    frames, durations = [], []
    with Image.open(path) as image:
        for index in range(image.n_frames):
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB")))
            durations.append(image.info["duration"])
    return frames, durations


def assert_episode_video(env, network, params, tmp_path: Path, ended: Callable[[Any], bool]) -> list[np.ndarray]:
    """One episode drawn and written: its L steps give L + 1 frames (the last state the first
    where `ended` holds), frames that change, and a GIF that holds them."""
    key = jax.random.key(5)
    states = list(video.episode_states(env, network, params, None, jax.random.fold_in(key, 0)))
    assert [ended(state) for state in states] == [False] * (len(states) - 1) + [True]
    [frames] = video.render_episodes(env, network, params, None, key)
    assert len(frames) == len(states) >= 3
    assert all(frame.dtype == np.uint8 and frame.shape == frames[0].shape and frame.std() > 0 for frame in frames)
    assert len({frame.tobytes() for frame in frames}) >= 2
    path = tmp_path / "episode.gif"
    video.write_video(str(path), frames)
    decoded, durations = gif_frames(path)
    assert 2 <= len(decoded) <= len(frames)
    for shown, drawn in ((decoded[0], frames[0]), (decoded[-1], frames[-1])):  # 256 colours a frame
        assert shown.shape == drawn.shape and np.abs(shown.astype(int) - drawn).mean() < 3
    frame_ms = round(1000 / video.FRAMES_PER_SECOND)
    assert abs(sum(durations) - len(frames) * frame_ms) <= 10 * len(decoded)  # GIFs count centiseconds
    return frames


def test_a_cartpole_episode_is_drawn_frame_by_frame(cartpole_run, tmp_path):
    policy = load_policy(str(cartpole_run))
    core = policy.env.core
    assert_episode_video(policy.env, policy.network, random_params(policy), tmp_path,
                         lambda state: bool(core.env.is_terminal(state, core.params)))


def test_a_grid_world_episode_is_drawn_frame_by_frame(tmp_path):
    experiment = build(from_dict(tiny_run(tmp_path / "unused", "xminigrid:MiniGrid-Empty-6x6")), jax.devices()[:1])
    # a policy that moves, then runs into the time limit (144 steps)
    frames = assert_episode_video(experiment.env, experiment.network, random_params(experiment, seed=2), tmp_path,
                                  lambda timestep: int(timestep.step_type) == 2)  # xminigrid's StepType.LAST
    assert len(frames) == 145


@pytest.mark.families
def test_a_playground_episode_is_drawn_by_mujoco_headless(tmp_path):
    """CartpoleBalance with a 30-step time limit (MuJoCo draws a frame in about 0.1 s on a CPU)."""
    if not family_installed("playground"):
        pytest.skip("the playground extra is not installed")
    from mujoco_playground import registry

    from jaxddppo.envs.playground import PlaygroundCore, gl_context_class

    try:
        gl_context_class("playground:CartpoleBalance")
    except ConfigError as error:
        pytest.skip(f"no headless OpenGL here: {error}")
    experiment = build(from_dict(tiny_run(tmp_path / "unused", "playground:CartpoleBalance")), jax.devices()[:1])
    short = registry.load("CartpoleBalance", config_overrides={"impl": "jax", "episode_length": 30})
    env = BatchedEnv(PlaygroundCore(short, "playground:CartpoleBalance"))
    frames = assert_episode_video(env, experiment.network, random_params(experiment), tmp_path,
                                  lambda state: int(state[1]) >= 30)
    assert len(frames) == 31 and frames[0].shape == (240, 320, 3)


@pytest.mark.families
def test_a_jumanji_episode_is_drawn_by_its_viewer(tmp_path):
    if not family_installed("jumanji"):
        pytest.skip("the jumanji extra is not installed")
    experiment = build(from_dict(tiny_run(tmp_path / "unused", "jumanji:Knapsack-v1")), jax.devices()[:1])
    # an episode ends when no unpacked item fits the remaining budget
    frames = assert_episode_video(experiment.env, experiment.network, random_params(experiment), tmp_path,
                                  lambda state: not np.any(~state.packed_items & (state.weights <= state.remaining_budget)))
    assert frames[0].shape == (400, 400, 3)


@pytest.mark.families
def test_a_craftax_episode_is_drawn_by_its_pixel_renderer(tmp_path):
    """Craftax-Classic with a 30-step time limit (its own is 10,000)."""
    if not family_installed("craftax"):
        pytest.skip("the craftax extra is not installed")
    experiment = build(from_dict(tiny_run(tmp_path / "unused", "craftax:Craftax-Classic-Symbolic-v1")),
                       jax.devices()[:1])
    core = experiment.env.core
    core.params = core.params.replace(max_timesteps=30)
    frames = assert_episode_video(experiment.env, experiment.network, random_params(experiment), tmp_path,
                                  lambda state: int(state.timestep) >= 30)
    assert len(frames) == 31 and frames[0].shape == (288, 288, 3)


@pytest.mark.families
def test_a_navix_episode_is_drawn_by_its_rgb_observation(tmp_path):
    if not family_installed("navix"):
        pytest.skip("the navix extra is not installed")
    experiment = build(from_dict(tiny_run(tmp_path / "unused", "navix:Navix-Empty-5x5-v0")), jax.devices()[:1])
    # a policy that changes the grid, but never reaches the goal (most random ones never change it):
    # the episode ends at the time limit (100 steps)
    frames = assert_episode_video(experiment.env, experiment.network, random_params(experiment, seed=3), tmp_path,
                                  lambda state: int(state[0]) >= 100)
    assert len(frames) == 101 and frames[0].shape == (320, 320, 3)


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    """Two updates of CartPole with a video after each, and TensorBoard on."""
    run_dir = tmp_path_factory.mktemp("cartpole") / "run"
    config = tiny_run(run_dir, "CartPole-v1", video_every_updates=1)
    config["run"]["tensorboard"] = True
    run(from_dict(config), devices=jax.devices()[:1])
    return run_dir


def test_a_run_writes_a_video_at_every_cadence(cartpole_run):
    assert sorted(path.name for path in (cartpole_run / "videos").iterdir()) == ["update_1.gif", "update_2.gif"]
    for path in (cartpole_run / "videos").iterdir():
        frames, _ = gif_frames(path)
        assert frames[0].shape == (320, 320, 3)


def test_tensorboard_shows_each_video_as_an_animated_gif_at_its_env_steps(cartpole_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cartpole_run), size_guidance={"images": 0})
    events.Reload()
    assert events.Tags()["images"] == ["video"]
    images = events.Images("video")
    assert [image.step for image in images] == [32, 64]  # 4 environments x 8 steps an update
    for image, update in zip(images, (1, 2)):
        path = cartpole_run / "videos" / f"update_{update}.gif"
        assert image.encoded_image_string == path.read_bytes()
        with Image.open(io.BytesIO(image.encoded_image_string)) as shown:
            assert shown.format == "GIF" and (image.width, image.height) == shown.size == (320, 320)
            assert shown.n_frames == len(gif_frames(path)[0]) >= 2


def test_evaluate_writes_the_policy_s_episodes_one_after_another(cartpole_run, tmp_path, capsys):
    path = tmp_path / "out" / "cartpole.gif"
    assert evaluate.main([str(cartpole_run), "--video", str(path), "--video-episodes", "2", "--seed", "1",
                          "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["episode_lengths"]) == 2 and min(printed["episode_lengths"]) >= 1
    assert printed["frames"] == sum(printed["episode_lengths"]) + 2
    assert 2 <= len(gif_frames(path)[0]) <= printed["frames"]


def test_bad_video_arguments_are_one_line(cartpole_run, capsys):
    assert evaluate.main([str(cartpole_run), "--video", "out.avi"]) == 2
    assert capsys.readouterr().err == "error: --video out.avi: the file must end in .gif or .mp4\n"
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([str(cartpole_run), "--video", "out.gif", "--video-episodes", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --video-episodes=0 must be at least 1 (see --help)\n"


class Counter:
    """A user's EnvCore that cannot draw itself (it has no `render`): COUNTER."""

    spec = EnvSpec(env_id="test_video:COUNTER", observation=jax.ShapeDtypeStruct((1,), jnp.float32), discrete=True,
                   num_actions=2, max_episode_steps=5)

    def reset(self, key):
        return jnp.zeros((1,)), jnp.zeros((), jnp.int32)

    def step(self, key, state, action):
        state = state + 1
        return state[None].astype(jnp.float32), state, jnp.ones(()), state >= 5, jnp.zeros((), bool)


COUNTER = Counter()


def test_an_environment_without_render_is_one_line_and_exit_2(cartpole_run, tmp_path, capsys, monkeypatch):
    """The run's environment as one without `render` (a user's EnvCore that has none)."""
    monkeypatch.delattr(GymnaxCore, "render")
    assert evaluate.main([str(cartpole_run), "--video", str(tmp_path / "cartpole.gif")]) == 2
    assert capsys.readouterr().err == ("error: env.id='CartPole-v1': cannot render: its environment has no "
                                       "render(state) method (the optional method of jaxddppo.envs.EnvCore)\n")
    assert not (tmp_path / "cartpole.gif").exists()


def test_a_run_that_cannot_draw_its_videos_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"^env.id='test_video:COUNTER': cannot render: its environment has no "):
        run(from_dict(tiny_run(tmp_path / "refused", "test_video:COUNTER", video_every_updates=1)),
            devices=jax.devices()[:1])


def test_an_mp4_holds_every_frame_cropped_to_even_sides(tmp_path):
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg", reason="the video extra is not installed")
    frames = [np.full((41, 61, 3), 20 * index, np.uint8) for index in range(10)]
    video.write_video(str(tmp_path / "gray.mp4"), frames)
    reader = imageio_ffmpeg.read_frames(str(tmp_path / "gray.mp4"))
    assert next(reader)["size"] == (60, 40)
    assert sum(1 for _ in reader) == 10
