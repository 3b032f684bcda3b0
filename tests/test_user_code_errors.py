"""Bad references to the user's own code (`env.id=module:attribute`, `network.torso=module:attribute`).

Each case writes a small module of its own (a name no other case uses, so that no module
cached in `sys.modules` can stand in for it) into its working directory and runs the train
command on it in-process (`jaxddppo.train.main`, what `python -m jaxddppo.train` calls): exit
2, one line on stderr naming the key, the value and the problem (an exception raised in the
user's code with its type, message and `file:line` there), nothing compiled and no run
directory. One case also runs as its own process (a slow test).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import jax
import pytest
from conftest import subprocess_env

from jaxddppo.train import main

COMMON = ["run.progress=false", "run.compilation_cache=off"]
Fragment = Union[str, "re.Pattern[str]"]

# --- the user's modules: a good one of each kind, and bad variants ------------------------------------------

GOOD_CORE = """\
import jax
import jax.numpy as jnp
from jaxddppo.envs.base import EnvSpec


class Core:
    def __init__(self, size=3):
        self.size = size
        self.spec = EnvSpec(env_id="core", observation=jax.ShapeDtypeStruct((size,), jnp.float32),
                            discrete=True, num_actions=2, max_episode_steps=10)

    def reset(self, key):
        return jnp.zeros(self.size), {"t": jnp.zeros((), jnp.int32)}

    def step(self, key, state, action):
        t = state["t"] + 1
        return jnp.zeros(self.size), {"t": t}, jnp.float32(1.0), t >= 10, jnp.bool_(False)
"""

GOOD_GYMNAX = """\
import jax.numpy as jnp
from gymnax.environments import environment, spaces


class Env(environment.Environment):
    @property
    def default_params(self):
        return environment.EnvParams(max_steps_in_episode=10)

    def reset_env(self, key, params):
        return jnp.zeros(3), environment.EnvState(time=0)

    def step_env(self, key, state, action, params):
        state = environment.EnvState(time=state.time + 1)
        return jnp.zeros(3), state, jnp.float32(1.0), state.time >= 10, {}

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params):
        return spaces.Box(-1.0, 1.0, (3,), jnp.float32)
"""

GOOD_TORSO = """\
import flax.linen as nn
import jax.numpy as jnp


class Torso(nn.Module):
    width: int = 8

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width)(x)
"""


def torso_variant(body: str) -> str:
    """GOOD_TORSO with a class Bad whose __call__ is `body` (indented for the method)."""
    return GOOD_TORSO + "\n\nclass Bad(nn.Module):\n    @nn.compact\n    def __call__(self, x):\n" + textwrap.indent(
        textwrap.dedent(body), " " * 8)


def core_variant(methods: str) -> str:
    """GOOD_CORE with a subclass Bad of Core defining `methods`."""
    return GOOD_CORE + "\n\nclass Bad(Core):\n" + textwrap.indent(textwrap.dedent(methods), " " * 4)


def gymnax_variant(methods: str) -> str:
    """GOOD_GYMNAX with a subclass Bad of Env defining `methods`."""
    return GOOD_GYMNAX + "\n\nclass Bad(Env):\n" + textwrap.indent(textwrap.dedent(methods), " " * 4)


@dataclass
class Case:
    """A user module (None: none written), the overrides and what the error line must hold.

    In `source`, `overrides` and `expected`, "{mod}" stands for the case's module name. `raises_at` marks
    the line (the only one holding that text) where the user's code raises: the error line must
    then name `file:line` of it."""

    source: Optional[str]
    overrides: list[str]
    expected: list[Fragment]
    raises_at: Optional[str] = None
    # The (key, value) pair the line must name; default: the first override.
    names: Optional[tuple[str, str]] = None
    extra_files: dict[str, str] = field(default_factory=dict)


def words(*pattern: str) -> "re.Pattern[str]":
    return re.compile(" ".join(pattern))


CASES: dict[str, Case] = {
    # --- the module ---
    "env_module_not_found": Case(None, ["env.id={mod}:Thing"], ["no module named '{mod}'", "working directory"]),
    "torso_module_not_found": Case(None, ["network.torso={mod}:Torso"], ["no module named '{mod}'"]),
    "env_submodule_not_found": Case(None, ["env.id={mod}.sub:Thing"], ["no module named '{mod}.sub'"],
                                    extra_files={"{mod}/__init__.py": ""}),
    "env_module_import_raises": Case("import math\nratio = 1 / 0  # raises\n", ["env.id={mod}:Thing"],
                                     ["importing {mod}", "ZeroDivisionError: division by zero"], raises_at="# raises"),
    "torso_module_import_raises": Case("raise RuntimeError('no torso here')  # raises\n", ["network.torso={mod}:Torso"],
                                       ["importing {mod}", "RuntimeError: no torso here"], raises_at="# raises"),
    "env_module_syntax_error": Case("x = 1\ndef broken(:  # raises\n    pass\n", ["env.id={mod}:Thing"],
                                    ["importing {mod}", "SyntaxError"], raises_at="# raises"),
    "env_module_imports_a_missing_module": Case("import {mod}_dependency  # raises\n", ["env.id={mod}:Thing"],
                                                ["importing {mod}", "ModuleNotFoundError",
                                                 "No module named '{mod}_dependency'"], raises_at="# raises"),
    "env_module_getattr_raises": Case("def __getattr__(name):\n    raise RuntimeError(f'no {name} here')  # raises\n",
                                      ["env.id={mod}:Thing"], ["RuntimeError: no Thing here"], raises_at="# raises"),
    # --- the attribute ---
    "env_attribute_missing": Case("x = 1\n", ["env.id={mod}:Thing"], ["has no attribute 'Thing'"]),
    "env_dotted_attribute_missing": Case("class Thing:\n    pass\n", ["env.id={mod}:Thing.make"],
                                         ["has no attribute 'make'"]),
    "torso_attribute_missing": Case("x = 1\n", ["network.torso={mod}:Torso"], ["has no attribute 'Torso'"]),
    "env_no_attribute_named": Case("x = 1\n", ["env.id={mod}:"], ["module.path:attribute"]),
    "torso_no_module_named": Case("x = 1\n", ["network.torso=:Torso"], ["module.path:attribute"]),
    "env_attribute_an_int": Case("thing = 3\n", ["env.id={mod}:thing"],
                                 [words(r"names an? int\b"), "gymnax Environment", "factory"]),
    "env_attribute_a_string": Case("thing = 'CartPole-v1'\n", ["env.id={mod}:thing"],
                                   [words(r"names an? str\b"), "gymnax Environment", "factory"]),
    "env_attribute_an_object_without_spec": Case(
        "class Thing:\n    def reset(self, key):\n        pass\n\n    def step(self, key, state, action):\n"
        "        pass\n\n\nthing = Thing()\n", ["env.id={mod}:thing"],
        [words(r"names an? Thing\b"), "gymnax Environment", "EnvCore", "factory"]),
    "torso_attribute_an_int": Case("torso = 3\n", ["network.torso={mod}:torso"],
                                   [words(r"names an? int\b"), "flax linen Module", "factory"]),
    "torso_attribute_a_string": Case("torso = 'mlp'\n", ["network.torso={mod}:torso"],
                                     [words(r"names an? str\b"), "flax linen Module", "factory"]),
    # --- factories ---
    "env_factory_raises_with_the_kwargs": Case(
        "def make(size):\n    raise ValueError(f'size={size!r} refused')  # raises\n",
        ["env.id={mod}:make", "env.kwargs.size=7"], ["make(**env.kwargs)", "ValueError: size=7 refused"],
        raises_at="# raises"),
    "env_class_init_raises_with_the_kwargs": Case(
        GOOD_CORE + "\n\nclass Big(Core):\n    def __init__(self, size=3):\n"
        "        assert size < 5, f'size {size} is too big'  # raises\n",
        ["env.id={mod}:Big", "env.kwargs.size=6"], ["Big(**env.kwargs)", "AssertionError: size 6 is too big"],
        raises_at="# raises"),
    "torso_factory_raises_with_the_kwargs": Case(
        "def make(width):\n    raise ValueError(f'width={width!r} refused')  # raises\n",
        ["network.torso={mod}:make", "network.torso_kwargs.width=5"],
        ["make(**network.torso_kwargs)", "ValueError: width=5 refused"], raises_at="# raises"),
    "env_factory_returns_an_int": Case("def make():\n    return 5\n", ["env.id={mod}:make"],
                                       ["make(**env.kwargs) returned", words(r"\ban? int\b"), "gymnax Environment"]),
    "env_class_is_no_environment": Case("class Thing:\n    pass\n", ["env.id={mod}:Thing"],
                                        ["Thing(**env.kwargs) returned", words(r"\ban? Thing\b"), "EnvCore"]),
    "torso_factory_returns_a_dict": Case("def make():\n    return {}\n", ["network.torso={mod}:make"],
                                         ["make(**network.torso_kwargs) returned", words(r"\ban? dict\b"),
                                          "flax linen Module"]),
    # --- kwargs where none can go ---
    "env_kwargs_for_an_instance": Case(GOOD_CORE + "\nenv = Core()\n", ["env.id={mod}:env", "env.kwargs.size=4"],
                                       ["env.kwargs={'size': 4}", "instance"], names=("env.id", "{mod}:env")),
    "env_kwargs_for_a_gymnax_instance": Case(GOOD_GYMNAX + "\nenv = Env()\n", ["env.id={mod}:env", "env.kwargs.size=4"],
                                             ["env.kwargs={'size': 4}", "instance"], names=("env.id", "{mod}:env")),
    "env_kwargs_for_a_builtin_id": Case(None, ["env.id=CartPole-v1", "env.kwargs.size=3"],
                                        ["env.kwargs={'size': 3}", "module:attribute"]),
    "torso_kwargs_for_an_instance": Case(GOOD_TORSO + "\ntorso = Torso()\n",
                                         ["network.torso={mod}:torso", "network.torso_kwargs.width=4"],
                                         ["network.torso_kwargs={'width': 4}", "instance"],
                                         names=("network.torso", "{mod}:torso")),
    # --- a gymnax Environment's reset_env and step_env ---
    "gymnax_step_env_returns_four_values": Case(
        gymnax_variant("""\
            def step_env(self, key, state, action, params):
                obs, state, reward, done, _ = super().step_env(key, state, action, params)
                return obs, state, reward, done
            """), ["env.id={mod}:Bad"],
        ["step_env", "(observation, state, reward, done, info)", "tuple of 4"]),
    "gymnax_reset_env_raises": Case(
        gymnax_variant("""\
            def reset_env(self, key, params):
                raise ValueError("reset refused")  # raises
            """), ["env.id={mod}:Bad"], ["reset_env", "ValueError: reset refused"], raises_at="# raises"),
    "gymnax_pair_reset_env_raises": Case(
        gymnax_variant("""\
            def reset_env(self, key, params):
                raise ValueError("reset refused")  # raises
            """) + "\n\ndef make():\n    return Bad(), Bad().default_params\n",
        ["env.id={mod}:make"], ["reset_env", "ValueError: reset refused"], raises_at="# raises"),
    # --- an EnvCore's reset and step ---
    "core_reset_returns_one_value": Case(
        core_variant("""\
            def reset(self, key):
                return jnp.zeros(self.size)
            """), ["env.id={mod}:Bad"], ["reset(key)", "(observation, state)"]),
    "core_reset_returns_three_values": Case(
        core_variant("""\
            def reset(self, key):
                return jnp.zeros(self.size), {"t": jnp.zeros((), jnp.int32)}, 0.0
            """), ["env.id={mod}:Bad"], ["reset(key)", "(observation, state)", "tuple of 3"]),
    "core_step_returns_four_values": Case(
        core_variant("""\
            def step(self, key, state, action):
                return super().step(key, state, action)[:4]
            """), ["env.id={mod}:Bad"], ["step(key, state, action)", "tuple of 4"]),
    "core_step_state_of_another_structure": Case(
        core_variant("""\
            def step(self, key, state, action):
                obs, state, reward, terminated, truncated = super().step(key, state, action)
                return obs, {**state, "extra": state["t"]}, reward, terminated, truncated
            """), ["env.id={mod}:Bad"], ["state", "reset", "extra"]),
    "core_step_state_of_another_dtype": Case(
        core_variant("""\
            def step(self, key, state, action):
                obs, state, reward, terminated, truncated = super().step(key, state, action)
                return obs, {"t": state["t"].astype(jnp.float32)}, reward, terminated, truncated
            """), ["env.id={mod}:Bad"], ["state", "reset", "float32", "int32"]),
    "core_step_observation_of_another_shape": Case(
        core_variant("""\
            def step(self, key, state, action):
                obs, state, reward, terminated, truncated = super().step(key, state, action)
                return jnp.zeros(4), state, reward, terminated, truncated
            """), ["env.id={mod}:Bad"], ["observations", "(4,)", "(3,)"]),
    "core_reward_not_a_scalar": Case(
        core_variant("""\
            def step(self, key, state, action):
                obs, state, reward, terminated, truncated = super().step(key, state, action)
                return obs, state, jnp.ones(2), terminated, truncated
            """), ["env.id={mod}:Bad"], ["reward", "scalar", "(2,)"]),
    "core_terminated_not_a_scalar": Case(
        core_variant("""\
            def step(self, key, state, action):
                obs, state, reward, terminated, truncated = super().step(key, state, action)
                return obs, state, reward, jnp.zeros(3, bool), truncated
            """), ["env.id={mod}:Bad"], ["terminated", "scalar", "(3,)"]),
    "core_spec_observation_disagrees_with_reset": Case(
        core_variant("""\
            def __init__(self):
                super().__init__()
                self.spec = dataclasses.replace(self.spec, observation=jax.ShapeDtypeStruct((4,), jnp.float32))
            """).replace("import jax\n", "import dataclasses\nimport jax\n", 1),
        ["env.id={mod}:Bad"], ["spec.observation", "(4,)", "(3,)"]),
    "core_no_actions": Case(
        core_variant("""\
            def __init__(self):
                super().__init__()
                self.spec = dataclasses.replace(self.spec, num_actions=0)
            """).replace("import jax\n", "import dataclasses\nimport jax\n", 1),
        ["env.id={mod}:Bad"], ["spec.num_actions=0"]),
    "core_step_raises": Case(
        core_variant("""\
            def step(self, key, state, action):
                raise RuntimeError("step refused")  # raises
            """), ["env.id={mod}:Bad"], ["step", "RuntimeError: step refused"], raises_at="# raises"),
    "core_step_adds_mismatched_shapes": Case(
        core_variant("""\
            def step(self, key, state, action):
                obs = jnp.zeros(self.size) + jnp.zeros(self.size + 1)  # raises
                return obs, state, jnp.float32(0.0), jnp.bool_(False), jnp.bool_(False)
            """), ["env.id={mod}:Bad"], ["step", "TypeError", "(3,)", "(4,)"], raises_at="# raises"),
    # --- a torso's output and variables ---
    "torso_returns_batch": Case(torso_variant("return nn.Dense(8)(x)[:, 0]\n"), ["network.torso={mod}:Bad"],
                                ["[batch, F]", "(2,)"]),
    "torso_returns_batch_f_g": Case(torso_variant("return jnp.stack([nn.Dense(8)(x)] * 3, axis=-1)\n"),
                                    ["network.torso={mod}:Bad"], ["[batch, F]", "(2, 8, 3)"]),
    "torso_returns_ints": Case(torso_variant("return nn.Dense(8)(x).astype(jnp.int32)\n"),
                               ["network.torso={mod}:Bad"], ["float features", "int32"]),
    "torso_returns_a_tuple": Case(torso_variant("h = nn.Dense(8)(x)\nreturn h, h\n"),
                                  ["network.torso={mod}:Bad"], ["[batch, F]", "tuple"]),
    "torso_keeps_batch_stats": Case(torso_variant("return nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x))\n"),
                                    ["network.torso={mod}:Bad"], ["batch_stats"]),
    "torso_call_raises": Case(torso_variant("raise ValueError(f'no features for {x.shape}')  # raises\n"),
                              ["network.torso={mod}:Bad"], ["ValueError: no features for (2, 4)"],
                              raises_at="# raises"),
    # --- objects and typos ---
    "env_object_marker": Case(None, ["env.id=<object>:Foo"], ["pass the same object again", "env="]),
    "torso_object_marker": Case(None, ["network.torso=<object>:Foo"], ["pass the same object again", "torso="]),
    "env_family_typo": Case(None, ["env.id=gymnaz:CartPole-v1"],
                            ["gymnaz", "gymnax", "craftax", "jumanji", "navix", "playground", "xminigrid"]),
}


# --- running the command -----------------------------------------------------------------------------------

_compilations: list[float] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: _compilations.append(seconds) if event == "/jax/core/compile/backend_compile_duration"
    else None)


@pytest.fixture(scope="module", autouse=True)
def compiled_what_the_command_always_compiles():
    """What a failing command may compile before it fails, once: a key, and the small eager
    computations of the default environment's spaces (CartPole-v1, which the torso cases use).
    Afterwards a case that fails before compiling compiles nothing."""
    from jaxddppo.envs import make_core

    jax.block_until_ready(jax.random.key(0))
    make_core("CartPole-v1")


@pytest.fixture
def module_name(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module name of this test's own, in a working directory of its own; sys.path and
    sys.modules are restored afterwards (the command adds the working directory to sys.path)."""
    callspec = getattr(request.node, "callspec", None)
    name = f"user_case_{callspec.id}" if callspec is not None else f"user_{request.node.originalname}"
    name = re.sub(r"\W+", "_", name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    for loaded in [key for key in sys.modules if key == name or key.startswith(f"{name}.")
                   or key.startswith(f"{name}_")]:
        del sys.modules[loaded]


def write_module(directory: Path, name: str, source: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(source)
    return path


def line_of(path: Path, marker: str) -> str:
    """`path:line` of the only line of `path` that holds `marker`."""
    lines = [number for number, text in enumerate(path.read_text().splitlines(), 1) if marker in text]
    assert len(lines) == 1, f"{marker!r} is on lines {lines} of {path}"
    return f"{path}:{lines[0]}"


def train(tmp_path: Path, capsys: pytest.CaptureFixture, overrides: list[str]) -> tuple[int, str, int]:
    """The command's exit code, its stderr and how many programs it compiled."""
    capsys.readouterr()
    compiled = len(_compilations)
    code = main([*overrides, f"run.dir={tmp_path / 'run'}", *COMMON])
    out, err = capsys.readouterr()
    assert out == "", out
    return code, err, len(_compilations) - compiled


def assert_one_line_error(code: int, err: str, key: str, value: str, expected: list[Fragment]) -> str:
    """The error line, checked: exit 2, one line `error: ...` naming `key=value` and `expected`."""
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, f"want exactly one line on stderr:\n{err}"
    line = err[:-1]
    assert line.startswith("error: "), line
    assert re.search(rf"{re.escape(key)}='?{re.escape(value)}'?", line), f"{key}={value} is not in {line!r}"
    for fragment in expected:
        if isinstance(fragment, str):
            assert fragment in line, f"{fragment!r} is not in {line!r}"
        else:
            assert fragment.search(line), f"{fragment.pattern!r} does not match {line!r}"
    return line


@pytest.mark.parametrize("name", list(CASES))
def test_bad_reference_is_one_line_exit_2_before_compiling_or_writing(
        name: str, module_name: str, tmp_path: Path, capsys: pytest.CaptureFixture):
    case = CASES[name]
    path = (write_module(tmp_path, module_name, case.source.replace("{mod}", module_name))
            if case.source is not None else None)
    for relative, text in case.extra_files.items():
        extra = tmp_path / relative.replace("{mod}", module_name)
        extra.parent.mkdir(parents=True, exist_ok=True)
        extra.write_text(text)
    overrides = [override.replace("{mod}", module_name) for override in case.overrides]
    key, value = case.names or overrides[0].split("=", 1)
    expected = [fragment.replace("{mod}", module_name) if isinstance(fragment, str)
                else re.compile(fragment.pattern.replace("{mod}", module_name)) for fragment in case.expected]
    if case.raises_at is not None:
        assert path is not None
        expected.append(re.compile(re.escape(line_of(path, case.raises_at)) + r"(?!\d)"))

    code, err, compiled = train(tmp_path, capsys, overrides)

    assert_one_line_error(code, err, key, value.replace("{mod}", module_name), expected)
    assert not (tmp_path / "run").exists(), f"the failed command made {tmp_path / 'run'}: " \
                                            f"{sorted(p.name for p in (tmp_path / 'run').iterdir())}"
    assert compiled == 0, f"it compiled {compiled} programs before failing"


def test_a_kwarg_the_factory_does_not_take_is_placed_in_the_users_file(
        module_name: str, tmp_path: Path, capsys: pytest.CaptureFixture):
    path = write_module(tmp_path, module_name, "def make(size=3):\n    return None\n")

    code, err, compiled = train(tmp_path, capsys, [f"env.id={module_name}:make", "env.kwargs.sizee=3"])

    line = assert_one_line_error(code, err, "env.id", f"{module_name}:make",
                                 ["TypeError", "unexpected keyword argument 'sizee'"])
    assert re.search(rf"{re.escape(str(path))}:\d", line), f"{line!r} does not say where in {path}"
    assert f"jaxddppo{os.sep}references.py" not in line, line
    assert not (tmp_path / "run").exists()
    assert compiled == 0


# The valid modules the bad ones vary: each accepted, so that each bad case fails for its one change.

def test_the_good_modules_are_accepted(module_name: str, tmp_path: Path):
    from jaxddppo.config.options import NetworkConfig
    from jaxddppo.envs import make_core
    from jaxddppo.networks import make_actor_critic

    write_module(tmp_path, f"{module_name}_core", GOOD_CORE)
    write_module(tmp_path, f"{module_name}_gymnax",
                 GOOD_GYMNAX + "\n\ndef make():\n    return Env(), Env().default_params\n")
    write_module(tmp_path, f"{module_name}_torso", GOOD_TORSO)
    core = make_core(f"{module_name}_core:Core", {"size": 5})
    assert core.spec.observation.shape == (5,)
    assert make_core(f"{module_name}_gymnax:Env").spec.num_actions == 2
    assert make_core(f"{module_name}_gymnax:make").spec.max_episode_steps == 10
    make_actor_critic(NetworkConfig(torso=f"{module_name}_torso:Torso", torso_kwargs={"width": 4}), core.spec)


def test_resuming_a_run_of_an_object_without_it_says_to_pass_it_again(
        module_name: str, tmp_path: Path, capsys: pytest.CaptureFixture):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stored = f"env:\n  id: <object>:Foo\nrun:\n  dir: {run_dir}\n"
    (run_dir / "config.yaml").write_text(stored)
    capsys.readouterr()

    code = main(["--resume", str(run_dir)])

    out, err = capsys.readouterr()
    assert out == ""
    assert_one_line_error(code, err, "env.id", "<object>:Foo", ["pass the same object again", "env="])
    assert sorted(path.name for path in run_dir.iterdir()) == ["config.yaml"]
    assert (run_dir / "config.yaml").read_text() == stored


@pytest.mark.slow  # the in-process cases run what the command runs; tests/test_cli.py has a real process
def test_bad_reference_in_its_own_process_is_one_line_and_exit_2(tmp_path: Path):
    write_module(tmp_path, "own_process_env", "def make(size):\n    raise ValueError(f'size={size!r} refused')\n")
    completed = subprocess.run(
        [sys.executable, "-m", "jaxddppo.train", "env.id=own_process_env:make", "env.kwargs.size=9",
         f"run.dir={tmp_path / 'run'}", *COMMON],
        cwd=tmp_path, env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    described = f"exit {completed.returncode}\n--- stdout:\n{completed.stdout}\n--- stderr:\n{completed.stderr}"

    assert completed.returncode == 2, described
    assert "Traceback" not in completed.stdout + completed.stderr, described
    assert completed.stderr.count("\n") == 1 and completed.stderr.startswith("error: "), described
    assert "env.id='own_process_env:make'" in completed.stderr, described
    assert f"ValueError: size=9 refused (at {tmp_path / 'own_process_env.py'}:2)" in completed.stderr, described
    assert not (tmp_path / "run").exists()
