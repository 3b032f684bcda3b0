"""The commands' compilation cache (`run.compilation_cache`, jaxddppo/training/compile_cache.py)."""

import json
import platform
import subprocess
import sys

import jax
import pytest
from conftest import REPO_ROOT, subprocess_env

from jaxddppo.config.files import from_dict, load_config, to_yaml
from jaxddppo.config.options import ConfigError
from jaxddppo.train import main
from jaxddppo.training.compile_cache import MAX_CACHE_BYTES, MIN_COMPILE_SECONDS, machine_tag, use_compilation_cache

SETTINGS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_compilation_cache_max_size",
            "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def no_jax_cache():
    """JAX's cache settings as a process without JAX_COMPILATION_CACHE_DIR starts; restored after."""
    saved = {name: getattr(jax.config, name) for name in SETTINGS}
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_max_size", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_the_machine_tag_names_the_architecture_and_the_instruction_set():
    avx512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f\n"
    assert machine_tag(avx512) == machine_tag("flags : avx512f avx2 sse2 fpu\n")
    assert machine_tag(avx512) != machine_tag("flags\t\t: fpu sse2 avx2\n")
    assert machine_tag("Features\t: fp asimd sve\n") != machine_tag("Features\t: fp asimd\n")
    assert machine_tag(avx512).startswith(f"{platform.machine()}-")
    assert machine_tag() == machine_tag()


def test_auto_takes_a_limited_cache_under_xdg_cache_home(no_jax_cache, tmp_path):
    directory = use_compilation_cache("auto", {"XDG_CACHE_HOME": str(tmp_path)})
    assert directory == str(tmp_path / "jaxddppo" / "compiled" / machine_tag())
    assert jax.config.jax_compilation_cache_dir == directory and (tmp_path / "jaxddppo" / "compiled").is_dir()
    assert jax.config.jax_compilation_cache_max_size == MAX_CACHE_BYTES
    assert jax.config.jax_persistent_cache_min_compile_time_secs == MIN_COMPILE_SECONDS


def test_auto_keeps_jax_own_settings(no_jax_cache, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "chosen"))
    assert use_compilation_cache("auto", {"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "chosen")
    assert jax.config.jax_compilation_cache_max_size == -1 and not (tmp_path / "jaxddppo").exists()
    jax.config.update("jax_enable_compilation_cache", False)
    assert use_compilation_cache("auto", {"XDG_CACHE_HOME": str(tmp_path)}) is None
    # JAX's own size and threshold variables are left to JAX.
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", True)
    use_compilation_cache("auto", {"XDG_CACHE_HOME": str(tmp_path), "JAX_COMPILATION_CACHE_MAX_SIZE": "-1",
                                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1"})
    assert jax.config.jax_compilation_cache_max_size == -1
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0


def test_off_and_a_directory(no_jax_cache, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "from-the-environment"))
    assert use_compilation_cache("off", {}) is None and jax.config.jax_compilation_cache_dir is None
    jax.config.update("jax_enable_compilation_cache", False)
    assert use_compilation_cache(str(tmp_path / "a" / "b"), {}) == str(tmp_path / "a" / "b")
    assert jax.config.jax_enable_compilation_cache
    assert (tmp_path / "a" / "b").is_dir() and jax.config.jax_compilation_cache_dir == str(tmp_path / "a" / "b")


def test_a_directory_that_cannot_be_written_is_refused(no_jax_cache, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^run.compilation_cache='.*/file/cache' is invalid: the directory cannot "
                       r"be written \(Not a directory\)$"):
        use_compilation_cache(str(tmp_path / "file" / "cache"), {})
    assert jax.config.jax_compilation_cache_dir is None


def test_auto_goes_without_a_cache_it_cannot_write(no_jax_cache, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert use_compilation_cache("auto", {"XDG_CACHE_HOME": str(tmp_path / "file")}) is None
    assert jax.config.jax_compilation_cache_dir is None
    assert capsys.readouterr().err == (f"jaxddppo: no compilation cache: {tmp_path}/file/jaxddppo/compiled/"
                                       f"{machine_tag()} cannot be written (Not a directory); "
                                       "run.compilation_cache=DIR names another\n")


def test_off_is_read_as_written_in_yaml_and_on_the_command_line(tmp_path):
    """YAML 1.1 reads an unquoted off as a boolean: the option still gets "off" (not a
    directory named False), and keeps it through config.yaml."""
    (tmp_path / "config.yaml").write_text("run:\n  compilation_cache: off\n")
    from_file = load_config(str(tmp_path / "config.yaml"))
    assert from_file.run.compilation_cache == "off"
    assert load_config(None, ["run.compilation_cache=off"]).run.compilation_cache == "off"
    (tmp_path / "written.yaml").write_text(to_yaml(from_file))
    assert load_config(str(tmp_path / "written.yaml")).run.compilation_cache == "off"
    assert from_dict({"run": {"compilation_cache": "~/cache"}}).run.compilation_cache == "~/cache"


@pytest.mark.parametrize("value", ["on", "''"])
def test_a_value_that_names_no_cache_is_refused(value):
    with pytest.raises(ConfigError, match="^run.compilation_cache='(on)?' is invalid: must be auto, off or a directory$"):
        load_config(None, [f"run.compilation_cache={value}"])


def test_the_command_refuses_a_cache_it_cannot_write_in_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["--config", str(REPO_ROOT / "experiments" / "cartpole.yaml"), f"run.dir={tmp_path / 'run'}",
                 f"run.compilation_cache={tmp_path / 'file'}"]) == 2
    assert capsys.readouterr().err == (f"error: run.compilation_cache='{tmp_path / 'file'}' is invalid: the "
                                       "directory cannot be written (File exists)\n")
    assert not (tmp_path / "run").exists()


def test_a_second_run_loads_the_programs_the_first_compiled(tmp_path):
    """The train command by default, without JAX's variable: the first run writes its training
    and evaluation programs under XDG_CACHE_HOME, the second reads them (JAX stamps an entry's
    access time as it reads it) and trains to the same parameters, and a run of another seed
    uses the same programs. (Whether the eager operations' small programs are written depends
    on how fast they compile, so they are left out.)"""
    env = subprocess_env(1)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    cache = tmp_path / "xdg" / "jaxddppo" / "compiled" / machine_tag()

    def train(name: str, seed: int = 0) -> dict:
        subprocess.run([sys.executable, "-m", "jaxddppo.train", "--config",
                        str(REPO_ROOT / "experiments" / "cartpole.yaml"), "train.total_env_steps=4096",
                        "eval.num_episodes=2", "run.progress=false", f"train.seed={seed}",
                        f"run.dir={tmp_path / name}"],
                       env=env, check=True, capture_output=True, timeout=300)
        return json.loads((tmp_path / name / "summary.json").read_text())

    def programs() -> dict[str, int]:
        """Each training or evaluation program's entry and the access time stamped in it."""
        return {path.name[:-len("-cache")]: int.from_bytes(path.with_name(path.name[:-len("cache")] + "atime")
                                                           .read_bytes(), "little")
                for pattern in ("jit_learn-*-cache", "jit_evaluate_policy-*-cache") for path in cache.glob(pattern)}

    first = train("first")
    written = programs()
    assert len(written) == 2
    second = train("second")
    assert programs().keys() == written.keys()
    assert all(stamp > written[name] for name, stamp in programs().items())
    assert second["params_digest"] == first["params_digest"]
    assert train("another seed", seed=1)["params_digest"] != first["params_digest"]
    assert programs().keys() == written.keys()
