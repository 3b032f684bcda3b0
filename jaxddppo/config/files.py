"""Reading a Config: defaults, then a YAML file, then `section.key=value` overrides (or a
nested dict, or dotted keys from Python); a run directory's config for a resume, with the
overrides that are safe mid-run; and writing one back as YAML. Every result is validated.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Iterable, Mapping, Optional, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxddppo.config.options import RESUMABLE_KEYS, Config, ConfigError, is_resumable, section_names, validate
from jaxddppo.config.reference import options

SWEEP_SPEC_FILE = "sweep.json"  # in a sweep's run directory: the grid, seeds and member devices, for a resume

# The CPU options that `run.cpu_tuning` replaced: a run directory written with them still resumes.
REPLACED_CPU_OPTIONS = ("network.dense_gradient", "ppo.minibatch_shuffle", "ppo.flat_optimizer",
                        "run.fast_cpu_compile")


def _unknown_key_message(key: str) -> str:
    if key in REPLACED_CPU_OPTIONS:
        return f"'{key}' was replaced by run.cpu_tuning (auto, on or off; docs/configuration.md)"
    known = [opt.key for opt in options()]
    if "." not in key and key not in section_names():
        close = difflib.get_close_matches(key, section_names(), n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"sections are {', '.join(section_names())}"
        return f"unknown section '{key}'; {hint}"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if not close and "." in key:
        leaf = key.rsplit(".", 1)[1]
        close = [k for k in known if k.rsplit(".", 1)[1] == leaf][:1]
    return f"unknown key '{key}'" + (f"; did you mean '{close[0]}'?" if close else "")


def _error_from_omegaconf(error: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(error, "full_key", None) or "?"
    if type(error).__name__ == "ConfigKeyError":
        return ConfigError(f"{source}: {_unknown_key_message(key)}")
    type_names = {opt.key: opt.type_name for opt in options()}
    if key in type_names:
        value = getattr(error, "value", None)
        return ConfigError(f"{source}: {key}={value!r} is invalid: expected {type_names[key]}")
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    return ConfigError(f"{source}: {key}: {first_line}")


def _check_sections(layer: Any, source: str) -> None:
    """Top-level entries must be sections holding keys (OmegaConf's own error names no key)."""
    for name, value in layer.items():
        if name in section_names() and not isinstance(value, dict):
            example = options(type(getattr(Config(), name)))[0].key
            raise ConfigError(
                f"{source}: '{name}' is a section, not a value ({name}={value!r}); "
                f"set its keys, e.g. {name}.{example}=..."
            )


def _load_yaml(path: str) -> Any:
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"config file is a directory: {path}")
    try:
        with open(path) as handle:
            raw = yaml.safe_load(handle)
    except (yaml.YAMLError, UnicodeDecodeError) as error:  # the parser's own messages are many-lined
        detail = " ".join(str(error).split())[:200]
        raise ConfigError(f"config file {path} is not valid YAML: {detail}") from None
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read: {error.strerror}") from None
    if raw is None:
        raise ConfigError(f"config file {path} is empty; give at least one section, e.g. 'env: {{id: CartPole-v1}}'")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections, e.g. 'env: {{id: CartPole-v1}}', "
            f"not a {type(raw).__name__}"
        )
    _check_sections(raw, path)
    return OmegaConf.load(path)


def _parse_overrides(overrides: Iterable[str]) -> Any:
    pairs = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or key.strip() != key:
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        if not value:
            raise ConfigError(f"override '{item}' has no value")
        if value.endswith(":") and value[0] not in "'\"[{":
            value = "'" + value.replace("'", "''") + "'"  # a string (an attribute-less reference), not a mapping
        pairs.append(f"{key}={value}")
    try:
        layer = OmegaConf.from_dotlist(pairs)
    except OmegaConfBaseException as error:
        raise _error_from_omegaconf(error, "command line") from None
    _check_sections(OmegaConf.to_container(layer), "command line")
    return layer


def _merge(base: Any, layer: Any, source: str) -> Any:
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as error:
        raise _error_from_omegaconf(error, source) from None


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> Config:
    """Defaults, then the YAML file (if any), then `key=value` overrides; validated."""
    return _load(None if path is None else _load_yaml(path), path, overrides)


def _load(layer: Any, source: Optional[str], overrides: Iterable[str]) -> Config:
    merged = OmegaConf.structured(Config)
    if layer is not None:
        merged = _merge(merged, layer, source)
    return _validated(_merge(merged, _parse_overrides(overrides), "command line"))


# YAML 1.1 reads an unquoted on / off as a boolean, which a string option receives as True / False.
_SWITCH_FROM_YAML_BOOLEAN = {"True": "on", "False": "off"}


def _validated(merged: Any) -> Config:
    """The Config of merged layers, with `run.cpu_tuning: on`, `run.compilation_cache: off` and
    `wandb.mode: off` read as written, validated."""
    config = OmegaConf.to_object(merged)
    run, wandb = config.run, config.wandb
    config = dataclasses.replace(config, run=dataclasses.replace(
        run, cpu_tuning=_SWITCH_FROM_YAML_BOOLEAN.get(run.cpu_tuning, run.cpu_tuning),
        compilation_cache=_SWITCH_FROM_YAML_BOOLEAN.get(run.compilation_cache, run.compilation_cache)),
        wandb=dataclasses.replace(wandb, mode=_SWITCH_FROM_YAML_BOOLEAN.get(wandb.mode, wandb.mode)))
    validate(config)
    return config


def from_dict(values: dict) -> Config:
    """A config from a nested dict of overrides (the Python API), validated."""
    _check_sections(values, "config")
    return _validated(_merge(OmegaConf.structured(Config), OmegaConf.create(values), "config"))


def _flat(values: dict, prefix: str = "") -> dict:
    flat = {}
    for name, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def load_resume_config(run_dir: str, overrides: Iterable[str] = ()) -> Config:
    """The config of the run in `run_dir` (its config.yaml), with overrides that are safe mid-run."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isdir(run_dir):
        raise ConfigError(f"run directory {run_dir} does not exist")
    if not os.path.isfile(path):
        raise ConfigError(f"run directory {run_dir} has no config.yaml; is it a jaxddppo run directory?")
    layer = _with_cpu_tuning(_load_yaml(path), path)
    stored = _load(layer, path, ())
    resumed = _load(layer, path, overrides)
    _refuse_algorithm_changes(stored, resumed)
    if stored.run.dir != resumed.run.dir:
        raise ConfigError(f"run.dir={resumed.run.dir!r} cannot be set on resume: the run directory is {run_dir}")
    return dataclasses.replace(resumed, run=dataclasses.replace(resumed.run, dir=run_dir))


def check_resume(config: Config) -> None:
    """Refuses `config` as the continuation of the run in `config.run.dir` where it changes
    a key that is not resumable: what `load_resume_config` refuses in overrides, for a
    config given whole (the Python API's `resume=True`)."""
    _refuse_algorithm_changes(load_resume_config(config.run.dir), config)


def _refuse_algorithm_changes(stored: Config, resumed: Config) -> None:
    before, after = _flat(to_dict(stored)), _flat(to_dict(resumed))
    for key in [*before, *(key for key in after if key not in before)]:  # env.kwargs' keys may come or go
        if before.get(key) != after.get(key) and key != "run.dir" and not is_resumable(key):
            raise ConfigError(
                f"{key}={after.get(key)!r} cannot change on resume (the run has {before.get(key)!r}): it would change "
                f"the algorithm mid-run; a resume may change {', '.join(RESUMABLE_KEYS)}"
            )


def _with_cpu_tuning(layer: Any, path: str) -> Any:
    """A run directory's config, with the CPU options of a run written before `run.cpu_tuning`
    replaced by the switch that draws the same minibatch orders (the others changed only the
    last bits, and a resume could change them)."""
    values = OmegaConf.to_container(layer)
    replaced = {}
    for key in REPLACED_CPU_OPTIONS:
        section, name = key.split(".")
        if isinstance(values.get(section), dict) and name in values[section]:
            replaced[key] = values[section].pop(name)
    if not replaced:
        return layer
    if replaced.get("ppo.flat_optimizer"):
        raise ConfigError(f"{path}: ppo.flat_optimizer=true is gone (its optimizer state was one vector; this "
                          "version's is a tree): resume this run with the jaxddppo that started it")
    tuning = "on" if replaced.get("ppo.minibatch_shuffle") == "cpu_sorts" else "off"
    values.setdefault("run", {})["cpu_tuning"] = tuning
    return OmegaConf.create(values)


def with_overrides(config: Config, overrides: Mapping[str, Any]) -> Config:
    """`config` with dotted keys replaced, e.g. {"ppo.learning_rate": 1e-3}; validated."""
    nested: dict = {}
    for key, value in overrides.items():
        *sections, leaf = key.split(".")
        if not sections:
            _check_sections({key: value}, "override")
            raise ConfigError(f"override: {_unknown_key_message(key)}")
        target = nested
        for name in sections:
            target = target.setdefault(name, {})
        target[leaf] = list(value) if isinstance(value, tuple) else value
    return _validated(_merge(OmegaConf.structured(config), OmegaConf.create(nested), "override"))


def as_config(config: Union[Config, Mapping, str, os.PathLike]) -> Config:
    """A Config from a Config, a nested dict (`from_dict`) or a YAML path (`load_config`)."""
    if isinstance(config, Config):
        validate(config)
        return config
    if isinstance(config, Mapping):
        return from_dict(dict(config))
    if isinstance(config, (str, os.PathLike)):
        return load_config(os.fspath(config))
    raise ConfigError(f"config must be a Config, a dict or a YAML path, not {type(config).__name__}")


def to_dict(config: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(config))


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


