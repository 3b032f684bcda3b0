"""Typed, frozen configuration: defaults, YAML files, dotted overrides, validation.

The dataclasses below are the single source of truth for every option. A YAML
file fills them, `section.key=value` overrides follow, and `validate` checks
ranges and choices. Sizes that depend on the device count are derived later, in
`topology.py`. Nothing writes into a config after it is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """Bad user input; the message is one line that names the key and the value."""


def _opt(default: Any, help: str, choices: Optional[tuple[str, ...]] = None) -> Any:
    metadata = {"help": help, "choices": choices}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EnvConfig:
    """The environment and how many run at once."""

    id: str = _opt(
        "CartPole-v1", "FAMILY:NAME (e.g. craftax:Craftax-Classic-Symbolic-v1), or a bare gymnax id "
        "(see docs/environments.md)"
    )
    num_envs: int = _opt(4, "global number of parallel environments, summed over all shards")
    optimistic_reset_ratio: int = _opt(
        1, "the reset pool holds num_envs/num_shards/r fresh start states per shard, refilled when used up; 1: one "
        "per environment, every episode starts from its own; r > 1: less memory, and environments beyond the "
        "pool's size that finish on one step share states"
    )
    normalize_observations: bool = _opt(
        False, "normalise observations by a running mean and variance over all shards' rollouts"
    )
    scale_rewards: bool = _opt(
        False, "divide rewards by a running standard deviation of the discounted return, over all shards"
    )


@dataclass(frozen=True)
class NetworkConfig:
    """The actor-critic network."""

    torso: str = _opt(
        "auto", "mlp, cnn, or auto (cnn for image observations [H, W, C], or a dict observation's image leaves; "
        "else mlp)",
        choices=("auto", "mlp", "cnn"),
    )
    hidden_sizes: tuple[int, ...] = _opt((64, 64), "widths of the MLP layers (after the CNN, if any)")
    activation: str = _opt(
        "tanh", "activation of hidden layers", choices=("tanh", "relu", "gelu", "silu", "elu")
    )
    shared_torso: bool = _opt(False, "actor and critic share one torso (default: separate torsos)")
    cnn_channels: tuple[int, ...] = _opt((16,), "output channels of each 3x3 convolution layer")
    init_log_std: float = _opt(0.0, "initial log standard deviation of the Gaussian head")
    recurrent: Optional[str] = _opt(
        None, "recurrent core after the torso: gru or lstm (default: none, a feed-forward policy)",
        choices=("gru", "lstm"),
    )
    recurrent_size: int = _opt(128, "hidden units of the recurrent core")


@dataclass(frozen=True)
class PPOConfig:
    """The PPO update: rollout length, epochs, minibatches, loss and optimizer."""

    num_steps: int = _opt(128, "rollout length: environment steps per env between updates")
    num_epochs: int = _opt(4, "passes over each rollout")
    num_minibatches: int = _opt(4, "minibatches per epoch (each one global: all shards together)")
    learning_rate: float = _opt(2.5e-4, "Adam learning rate (initial value when annealed)")
    anneal_lr: bool = _opt(True, "anneal the learning rate linearly to 0 over the whole run")
    adam_eps: float = _opt(1e-5, "Adam epsilon")
    gamma: float = _opt(0.99, "discount factor")
    gae_lambda: float = _opt(0.95, "GAE lambda")
    clip_eps: float = _opt(0.2, "PPO ratio clip range")
    clip_value: bool = _opt(True, "clip the value update to clip_eps around the rollout values")
    vf_coef: float = _opt(0.5, "value loss coefficient")
    ent_coef: float = _opt(0.01, "entropy bonus coefficient")
    max_grad_norm: float = _opt(0.5, "global-norm gradient clipping threshold")
    normalize_advantages: bool = _opt(True, "normalise advantages over each global minibatch")


@dataclass(frozen=True)
class TrainConfig:
    """Length of the run, seed and logical shards."""

    total_env_steps: int = _opt(
        500_000, "environment steps over the whole run, all shards together (rounded down to whole updates)"
    )
    seed: int = _opt(0, "random seed")
    num_shards: Optional[int] = _opt(
        None, "logical data-parallel shards (default: the number of devices, over all hosts); a multiple of the "
        "device count"
    )
    updates_per_chunk: int = _opt(
        16, "updates per compiled call; the host logs and reports progress between calls (one program runs "
        "every chunk, the last and shorter ones included)"
    )
    batch_members: bool = _opt(
        True, "sweeps: train the members that share a device as one batch (vmap, the fastest); false trains "
        "them one after another, each bit for bit as the single run of its config (batched, they differ from "
        "it in the last bits)"
    )
    exact_reductions: bool = _opt(
        True, "the shards that share a device run one after another and every cross-shard sum adds the shards "
        "in order of their index: the same train.num_shards gives the same bits on any device count. false runs "
        "a device's shards as one batch (vmap) and sums with an all-reduce: faster where a device holds several "
        "shards, equal across device counts only up to float rounding. A run of one shard has one order either way"
    )


@dataclass(frozen=True)
class EvalConfig:
    """Deterministic evaluation of the policy (the mode of its action distribution)."""

    num_episodes: int = _opt(32, "episodes of every deterministic evaluation (periodic and final)")
    every_updates: int = _opt(
        0, "evaluate every this many updates during training, between chunks (0: only at the end); "
        "a multiple of train.updates_per_chunk"
    )


@dataclass(frozen=True)
class PBTConfig:
    """Population-based training of a sweep's members (docs/sweeps.md#pbt)."""

    every_updates: int = _opt(
        0, "sweeps: after every this many updates, the weakest members take the whole state of the strongest "
        "and a perturbed copy of their hyperparameters, inside the compiled program (0: off)"
    )
    quantile: float = _opt(
        0.25, "fraction of the members, in (0, 0.5], that copies (the bottom) and that is copied from (the top)"
    )
    perturb: tuple[float, ...] = _opt(
        (0.8, 1.25), "factors, one drawn per changed hyperparameter, that multiply the copied value (then clipped "
        "to the key's bounds, docs/sweeps.md#pbt)"
    )
    resample_probability: float = _opt(
        0.25, "probability that a changed hyperparameter is drawn from the sweep's grid values of its key "
        "instead of perturbed"
    )
    fitness: str = _opt(
        "train_return", "what ranks the members: train_return, the mean return of the training episodes that "
        "ended since the last exploit; eval_return, a deterministic evaluation (eval.num_episodes) at the exploit",
        choices=("train_return", "eval_return"),
    )
    keys: tuple[str, ...] = _opt(
        (), "the float hyperparameters (ppo.*) that PBT may change (default: those the sweep varies)"
    )


@dataclass(frozen=True)
class RunConfig:
    """Output directory, progress and the CPU backend's devices and threads."""

    dir: Optional[str] = _opt(None, "output directory (default: runs/<env>-<timestamp>)")
    progress: bool = _opt(True, "show progress (a bar on a terminal, else one line at most every 2 s)")
    tensorboard: bool = _opt(False, "also write every metrics.jsonl field as a TensorBoard scalar into the run dir")
    cpu_threads: int = _opt(
        0, "threads of XLA's CPU thread pool, set (as PJRT_NPROC) before JAX starts its backend; 0: XLA's "
        "default, one per core. XLA keeps at least one per CPU device. A few environments per device run faster "
        "with 1"
    )
    cpu_devices: int = _opt(
        0, "JAX devices the CPU is split into, set (as jax_num_cpu_devices) before JAX starts its backend; "
        "0: JAX's default, one (or XLA_FLAGS' --xla_force_host_platform_device_count); python -m jaxddppo.sweep "
        "then takes one device per core, as many as divide the member count (docs/sweeps.md). The CPU backend only"
    )
    cpu_tuning: str = _opt(
        "auto", "the CPU switch (jaxddppo.cpu_tuning): on, minibatch orders drawn by sorts of integers, Dense kernel "
        "gradients from transposed inputs and lower XLA optimisation levels, which XLA's CPU backend runs or compiles "
        "faster (docs/benchmarks.md); off, the plain path; auto, on where the run's devices are CPUs. Results differ "
        "between on and off beyond the last bits (the minibatch orders); config.yaml records the resolved value",
        choices=("auto", "on", "off"),
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are saved and how many are kept."""

    every_updates: int = _opt(
        0, "save a checkpoint every this many updates (0: none by update count)"
    )
    every_seconds: float = _opt(
        300.0, "save a checkpoint at the first chunk boundary once this many seconds have passed since the "
        "last save or the start of training (0: none by time). With both 0: only at the end and when stopped"
    )
    keep: int = _opt(3, "newest checkpoints kept in RUN_DIR/checkpoints; older ones are deleted")
    async_save: bool = _opt(True, "write checkpoints in the background while training goes on")


@dataclass(frozen=True)
class DistributedConfig:
    """Runs over several processes or hosts (jax.distributed)."""

    coordinator: Optional[str] = _opt(
        None, "host:port of process 0's coordinator; with num_processes and process_id starts a multi-process run"
    )
    num_processes: Optional[int] = _opt(None, "number of processes (hosts) in the run")
    process_id: Optional[int] = _opt(None, "this process's index, 0 .. num_processes-1")
    auto: bool = _opt(
        False, "let jax.distributed detect the cluster (SLURM under srun, Open MPI, Cloud TPU, Kubernetes)"
    )
    init_timeout: int = _opt(300, "seconds to wait for every process to reach the coordinator")
    heartbeat_timeout: int = _opt(100, "seconds without a heartbeat after which a peer counts as lost")


@dataclass(frozen=True)
class DebugConfig:
    """Checks for debugging."""

    check_replicas: bool = _opt(
        False, "after every chunk, compare a parameter digest of every shard on every process; stop on divergence"
    )


@dataclass(frozen=True)
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pbt: PBTConfig = field(default_factory=PBTConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


@dataclass(frozen=True)
class OptionInfo:
    key: str
    type_name: str
    default: Any
    help: str
    choices: Optional[tuple[str, ...]] = None


def _type_name(annotation: Any) -> str:
    name = re.sub(r"tuple\[(\w+), \.\.\.\]", r"list[\1]", str(annotation).replace("typing.", ""))
    if name.startswith("Optional[") and name.endswith("]"):
        return name[len("Optional["):-1] + " or null"
    return name


def options(config_type: type = Config, prefix: str = "") -> list[OptionInfo]:
    """Every leaf option as a dotted key, with its type, default and help."""
    result = []
    defaults = config_type()
    for fld in dataclasses.fields(config_type):
        value = getattr(defaults, fld.name)
        if dataclasses.is_dataclass(value):
            result.extend(options(type(value), f"{prefix}{fld.name}."))
        else:
            result.append(OptionInfo(f"{prefix}{fld.name}", _type_name(fld.type), value, fld.metadata["help"],
                                     fld.metadata["choices"]))
    return result


def help_text() -> str:
    """One line per option: key, type, default and meaning."""
    lines = []
    for opt in options():
        default = "all devices" if opt.key == "train.num_shards" else opt.default
        if isinstance(default, tuple):
            default = "[" + ",".join(str(v) for v in default) + "]"
        lines.append(f"  {opt.key} ({opt.type_name}, default {default}): {opt.help}")
    return "\n".join(lines)


def _markdown_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


REFERENCE_COMMAND = 'python -c "import jaxddppo.config as c; print(c.reference_markdown())" > docs/configuration.md'


def reference_markdown() -> str:
    """The option reference, docs/configuration.md: one table per section, from the fields' help."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from jaxddppo/config.py; do not edit. Regenerate with: {REFERENCE_COMMAND} -->",
        "",
        "Options are set in a YAML file of sections (as in `experiments/*.yaml`), on the command line "
        "as `section.key=value` after `--config FILE`, or in Python with `jaxddppo.from_dict` and "
        "`jaxddppo.with_overrides`. Every value is checked before anything compiles; a bad one is one line "
        "on stderr and exit code 2. `python -m jaxddppo.train --help` prints the same list.",
        "",
        f"`--resume RUN_DIR` may change only {', '.join(f'`{key}`' for key in RESUMABLE_KEYS)}: "
        "anything else would change the algorithm mid-run.",
    ]
    for section in dataclasses.fields(Config):
        section_type = type(getattr(Config(), section.name))
        lines += ["", f"## {section.name}", "", section_type.__doc__, "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for opt in options(section_type, f"{section.name}."):
            type_name = opt.type_name
            if opt.choices:
                type_name = "one of " + ", ".join(f"`{choice}`" for choice in opt.choices)
                type_name += ", or null" if opt.type_name.endswith(" or null") else ""
            meaning = opt.help.replace("|", "\\|")
            lines.append(f"| `{opt.key}` | {type_name} | `{_markdown_value(opt.default)}` | {meaning} |")
    return "\n".join(lines)


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


# The CPU options that `run.cpu_tuning` replaced: a run directory written with them still resumes.
REPLACED_CPU_OPTIONS = ("network.dense_gradient", "ppo.minibatch_shuffle", "ppo.flat_optimizer",
                        "run.fast_cpu_compile")


def _unknown_key_message(key: str) -> str:
    if key in REPLACED_CPU_OPTIONS:
        return f"'{key}' was replaced by run.cpu_tuning (auto, on or off; docs/configuration.md)"
    known = [opt.key for opt in options()]
    if "." not in key and key not in _sections():
        close = difflib.get_close_matches(key, _sections(), n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"sections are {', '.join(_sections())}"
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
        if name in _sections() and not isinstance(value, dict):
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
    merged = _merge(merged, _parse_overrides(overrides), "command line")
    return _validated(merged)


# YAML 1.1 reads an unquoted on / off as a boolean, which the string option receives as True / False.
_SWITCH_FROM_YAML_BOOLEAN = {"True": "on", "False": "off"}


def _validated(merged: Any) -> Config:
    """The Config of merged layers, with `run.cpu_tuning: on` read as written, validated."""
    config = OmegaConf.to_object(merged)
    switch = _SWITCH_FROM_YAML_BOOLEAN.get(config.run.cpu_tuning, config.run.cpu_tuning)
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, cpu_tuning=switch))
    validate(config)
    return config


def from_dict(values: dict) -> Config:
    """A config from a nested dict of overrides (the Python API), validated."""
    _check_sections(values, "config")
    merged = _merge(OmegaConf.structured(Config), OmegaConf.create(values), "config")
    return _validated(merged)


# What a resumed run may change: nothing here alters the algorithm (sizes, seed, hyperparameters).
RESUMABLE_KEYS = (
    "train.total_env_steps", "train.updates_per_chunk", "run.progress", "run.tensorboard", "run.cpu_threads",
    "run.cpu_devices", "eval.*", "checkpoint.*", "distributed.*", "debug.*",
)


def _resumable(key: str) -> bool:
    return any(key == safe or (safe.endswith("*") and key.startswith(safe[:-1])) for safe in RESUMABLE_KEYS)


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
    before, after = _flat(to_dict(stored)), _flat(to_dict(resumed))
    for key in before:
        if before[key] != after[key] and key != "run.dir" and not _resumable(key):
            raise ConfigError(
                f"{key}={after[key]!r} cannot change on resume (the run has {before[key]!r}): it would change "
                f"the algorithm mid-run; a resume may change {', '.join(RESUMABLE_KEYS)}"
            )
    if before["run.dir"] != after["run.dir"]:
        raise ConfigError(f"run.dir={after['run.dir']!r} cannot be set on resume: the run directory is {run_dir}")
    return dataclasses.replace(resumed, run=dataclasses.replace(resumed.run, dir=run_dir))


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
    merged = _merge(OmegaConf.structured(config), OmegaConf.create(nested), "override")
    return _validated(merged)


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


def _check(condition: bool, key: str, value: Any, requirement: str) -> None:
    if not condition:
        raise ConfigError(f"{key}={value!r} is invalid: {requirement}")


def validate(config: Config) -> None:
    """Range and choice checks that need no device information."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for fld in dataclasses.fields(values):
            key, value = f"{section.name}.{fld.name}", getattr(values, fld.name)
            choices = fld.metadata.get("choices")
            if choices is not None and value is not None:
                _check(value in choices, key, value, f"must be one of {', '.join(choices)}")
            if isinstance(value, float):
                _check(math.isfinite(value), key, value, "must be a finite number")
    positive_ints = [
        ("env.num_envs", config.env.num_envs),
        ("env.optimistic_reset_ratio", config.env.optimistic_reset_ratio),
        ("ppo.num_steps", config.ppo.num_steps),
        ("ppo.num_epochs", config.ppo.num_epochs),
        ("ppo.num_minibatches", config.ppo.num_minibatches),
        ("train.total_env_steps", config.train.total_env_steps),
        ("train.updates_per_chunk", config.train.updates_per_chunk),
        ("eval.num_episodes", config.eval.num_episodes),
        ("checkpoint.keep", config.checkpoint.keep),
        ("network.recurrent_size", config.network.recurrent_size),
    ]
    for key, value in positive_ints:
        _check(value >= 1, key, value, "must be at least 1")
    if config.train.num_shards is not None:
        _check(config.train.num_shards >= 1, "train.num_shards", config.train.num_shards,
               "must be at least 1 (or left unset for one shard per device)")
    non_negative = [
        ("checkpoint.every_updates", config.checkpoint.every_updates, " (0: none by update count)"),
        ("checkpoint.every_seconds", config.checkpoint.every_seconds, " (0: none by time)"),
        ("train.seed", config.train.seed, ""),
        ("run.cpu_threads", config.run.cpu_threads, " (0: XLA's default, one per core)"),
        ("run.cpu_devices", config.run.cpu_devices, " (0: JAX's default)"),
        ("eval.every_updates", config.eval.every_updates, " (0: evaluate only at the end)"),
    ]
    for key, value, meaning in non_negative:
        _check(value >= 0, key, value, f"must be >= 0{meaning}")
    _check(config.ppo.learning_rate > 0, "ppo.learning_rate", config.ppo.learning_rate, "must be > 0")
    _check(config.ppo.adam_eps > 0, "ppo.adam_eps", config.ppo.adam_eps, "must be > 0")
    for key in ("gamma", "gae_lambda"):
        value = getattr(config.ppo, key)
        _check(0.0 <= value <= 1.0, f"ppo.{key}", value, "must be in [0, 1]")
    for key in ("clip_eps", "max_grad_norm"):
        value = getattr(config.ppo, key)
        _check(value > 0, f"ppo.{key}", value, "must be > 0")
    for key in ("vf_coef", "ent_coef"):
        value = getattr(config.ppo, key)
        _check(value >= 0, f"ppo.{key}", value, "must be >= 0")
    _validate_pbt(config.pbt)
    _validate_distributed(config.distributed)
    _check(len(config.network.hidden_sizes) >= 1 and min(config.network.hidden_sizes) >= 1,
           "network.hidden_sizes", list(config.network.hidden_sizes), "needs at least one positive width")
    _check(all(c >= 1 for c in config.network.cnn_channels), "network.cnn_channels",
           list(config.network.cnn_channels), "widths must be positive")


# The keys `pbt.keys` may name: the float hyperparameters, which the update takes traced.
PBT_KEYS = tuple(f"ppo.{fld.name}" for fld in dataclasses.fields(PPOConfig) if fld.type == "float")


def _validate_pbt(config: PBTConfig) -> None:
    _check(config.every_updates >= 0, "pbt.every_updates", config.every_updates, "must be >= 0 (0: off)")
    _check(0 < config.quantile <= 0.5, "pbt.quantile", config.quantile, "must be in (0, 0.5]")
    _check(len(config.perturb) >= 1 and all(math.isfinite(f) and f > 0 for f in config.perturb), "pbt.perturb",
           list(config.perturb), "needs at least one factor, every factor finite and > 0")
    _check(0 <= config.resample_probability <= 1, "pbt.resample_probability", config.resample_probability,
           "must be in [0, 1]")
    for key in config.keys:
        _check(key in PBT_KEYS, "pbt.keys", list(config.keys), f"{key} is not one of {', '.join(PBT_KEYS)}")
    _check(len(set(config.keys)) == len(config.keys), "pbt.keys", list(config.keys), "names a key twice")


def _validate_distributed(config: DistributedConfig) -> None:
    explicit = {"distributed.coordinator": config.coordinator,
                "distributed.num_processes": config.num_processes,
                "distributed.process_id": config.process_id}
    given = [key for key, value in explicit.items() if value is not None]
    if given and len(given) < len(explicit):
        missing = [key for key in explicit if key not in given]
        raise ConfigError(f"{', '.join(given)} set but {', '.join(missing)} not: a multi-process run needs all three")
    if config.coordinator is not None:
        host, _, port = config.coordinator.rpartition(":")
        _check(bool(host) and port.isdigit() and 0 < int(port) < 65536, "distributed.coordinator",
               config.coordinator, "must be host:port")
    if config.num_processes is not None:
        _check(config.num_processes >= 1, "distributed.num_processes", config.num_processes, "must be at least 1")
        _check(0 <= config.process_id < config.num_processes, "distributed.process_id", config.process_id,
               f"must be in [0, {config.num_processes - 1}]")
    _check(config.init_timeout >= 1, "distributed.init_timeout", config.init_timeout, "must be at least 1 second")
    _check(config.heartbeat_timeout >= 1, "distributed.heartbeat_timeout", config.heartbeat_timeout,
           "must be at least 1 second")
