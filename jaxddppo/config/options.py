"""The options: typed, frozen dataclasses with their defaults and help, which of them a
resume may change, and `validate`'s range and choice checks.

These dataclasses are the single source of truth for every option; `config/files.py`
fills them from YAML files, dotted overrides and dicts, and `config/reference.py` lists
them for `--help` and docs/configuration.md. Sizes that depend on the device count are
derived later, in `distributed/topology.py`. Nothing writes into a config after it is built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """Bad user input; the message is one line that names the key and the value."""


def _opt(default: Any, help: str, choices: Optional[tuple[str, ...]] = None, reference: bool = False,
         traced_bounds: Optional[tuple[float, float]] = None) -> Any:
    """An option's field; `reference`: besides `choices`, the value may be `module:attribute`;
    `traced_bounds`: a float the update takes traced (a sweep may vary it, PBT may change it),
    and the interval PBT keeps it in."""
    metadata = {"help": help, "choices": choices, "reference": reference, "traced_bounds": traced_bounds}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=metadata)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def is_reference(value: Any) -> bool:
    """Whether an option's value names the user's own code (`module:attribute`)."""
    return isinstance(value, str) and ":" in value


# Where an episode restarts: a fresh state from the reset pool, or the environment's own first state.
START_STATES = ("fresh", "first")


@dataclass(frozen=True)
class EnvConfig:
    """The environment and how many run at once."""

    id: str = _opt(
        "CartPole-v1", "FAMILY:NAME (e.g. craftax:Craftax-Classic-Symbolic-v1), a bare gymnax id, or "
        "module.path:attribute naming your own environment, imported from the working directory or PYTHONPATH "
        "(see docs/environments.md)"
    )
    kwargs: dict[str, Any] = _opt(
        {}, "keyword arguments of your own environment's class or factory (env.id=module:attribute), e.g. "
        "env.kwargs.size=8"
    )
    num_envs: int = _opt(4, "global number of parallel environments, summed over all shards")
    optimistic_reset_ratio: int = _opt(
        1, "the reset pool holds num_envs/num_shards/r fresh start states per shard, refilled when used up; 1: one "
        "per environment, every episode starts from its own; r > 1: less memory, and environments beyond the "
        "pool's size that finish on one step share states"
    )
    start_states: str = _opt(
        "fresh", "fresh: every episode starts from a fresh state of the core's reset (the reset pool); first: each "
        "environment restarts every episode from its own first state, as Brax's auto-reset does: no reset work "
        "after the first, but only num_envs distinct starts in the whole run (see docs/environments.md)",
        choices=START_STATES,
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
        "auto", "mlp, cnn, auto (cnn for image observations [H, W, C], or a dict observation's image leaves; "
        "else mlp), or module.path:attribute naming your own flax Module class or factory, called on a batch of "
        "observations and returning features [batch, F] (see docs/algorithm.md)",
        choices=("auto", "mlp", "cnn"), reference=True,
    )
    torso_kwargs: dict[str, Any] = _opt(
        {}, "keyword arguments of your own torso's class or factory (network.torso=module:attribute)"
    )
    hidden_sizes: tuple[int, ...] = _opt((64, 64), "widths of the MLP layers (after the CNN, if any)")
    actor_hidden_sizes: Optional[tuple[int, ...]] = _opt(
        None, "widths of the actor's MLP layers where they differ from the critic's (default: hidden_sizes; "
        "separate built-in torsos only)"
    )
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
    learning_rate: float = _opt(2.5e-4, "Adam learning rate (initial value when annealed)", traced_bounds=(1e-7, 1.0))
    anneal_lr: bool = _opt(True, "anneal the learning rate linearly to 0 over the whole run")
    adam_eps: float = _opt(1e-5, "Adam epsilon", traced_bounds=(1e-10, 1.0))
    gamma: float = _opt(0.99, "discount factor", traced_bounds=(0.0, 0.9999))
    gae_lambda: float = _opt(0.95, "GAE lambda", traced_bounds=(0.0, 0.9999))
    clip_eps: float = _opt(0.2, "PPO ratio clip range", traced_bounds=(1e-3, 1.0))
    clip_value: bool = _opt(True, "clip the value update to clip_eps around the rollout values")
    vf_coef: float = _opt(0.5, "value loss coefficient", traced_bounds=(0.0, 100.0))
    ent_coef: float = _opt(0.01, "entropy bonus coefficient", traced_bounds=(0.0, 1.0))
    max_grad_norm: float = _opt(0.5, "global-norm gradient clipping threshold", traced_bounds=(1e-3, 1e3))
    normalize_advantages: bool = _opt(True, "normalise advantages over each global minibatch")
    segment_length: int = _opt(
        0, "0: minibatches of single steps, with the rollout's advantages. L > 0: minibatches of L-step segments of "
        "one environment (ppo.num_steps a multiple of L), whose advantages and value targets the current value "
        "network recomputes before every SGD step, in the pass that takes the value loss's gradient (Brax PPO's "
        "scheme, L its unroll_length); feed-forward networks"
    )


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
    video_every_updates: int = _opt(
        0, "every this many updates, draw one episode of the deterministic policy into RUN_DIR/videos/"
        "update_<N>.gif (a sweep: update_<N>_member_<M>.gif), for environments that can draw themselves, "
        "and into TensorBoard and W&B when those are on (0: off); a multiple of train.updates_per_chunk"
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
    """Output directory, progress, the compilation cache and the CPU backend's devices and threads."""

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
        "0: JAX's default, one (or XLA_FLAGS' --xla_force_host_platform_device_count), where python -m "
        "jaxddppo.train takes one device per core, as many as train.num_shards (if set) and the sizes allow with "
        "at least 16 environments each, and python -m jaxddppo.sweep as many as divide the member count "
        "(docs/sweeps.md); either records its choice in config.yaml. The CPU backend only"
    )
    compilation_cache: str = _opt(
        "auto", "where python -m jaxddppo.train and .sweep keep the programs they compile, for later runs of the "
        "same programs to load instead of compiling (JAX's persistent compilation cache; .evaluate takes auto): "
        "auto, JAX's own setting if made (JAX_COMPILATION_CACHE_DIR, JAX_ENABLE_COMPILATION_CACHE=false), else "
        "$XDG_CACHE_HOME (~/.cache)/jaxddppo/compiled/MACHINE; off; or a directory. Results are the same with or "
        "without. The Python API leaves JAX's setting alone"
    )
    cpu_tuning: str = _opt(
        "auto", "the CPU switch (jaxddppo.cpu.tuning): on, minibatch orders drawn by sorts of integers, lower XLA "
        "optimisation levels and (jaxlib 0.10+) YNNPACK for dots only, which XLA's CPU backend runs or compiles "
        "faster (docs/benchmarks.md); off, the plain path; auto, on where the "
        "run's devices are CPUs. Results differ between on and off beyond the last bits (the minibatch orders); "
        "config.yaml records the resolved value",
        choices=("auto", "on", "off"),
    )


TRACKER_MODES = ("off", "online", "offline")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases: process 0 logs every metrics.jsonl field, the config and the summary (docs/outputs.md)."""

    mode: str = _opt(
        "off", "off; online, to W&B's server as the run goes (after wandb login or with WANDB_API_KEY); offline, "
        "into RUN_DIR/wandb for wandb sync to upload later. Needs pip install 'jaxddppo[wandb]'",
        choices=TRACKER_MODES,
    )
    project: Optional[str] = _opt(None, "W&B project (default: W&B's: WANDB_PROJECT, else uncategorized)")
    entity: Optional[str] = _opt(None, "W&B entity, a user or team (default: W&B's: WANDB_ENTITY, else the login's)")
    group: Optional[str] = _opt(
        None, "W&B group (default: none for a run; a sweep's members: the run directory's name)"
    )
    tags: tuple[str, ...] = _opt((), "W&B tags of the run (of every member of a sweep)")


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
        False, "after every chunk, compare the parameters held by every device of every process; stop on divergence"
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
    wandb: WandbConfig = field(default_factory=WandbConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def config_value(config: Config, key: str) -> Any:
    """The value of the option `key` (`section.name`) in `config`."""
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


# What a resumed run may change: nothing here alters the algorithm (sizes, seed, hyperparameters).
RESUMABLE_KEYS = (
    "train.total_env_steps", "train.updates_per_chunk", "run.progress", "run.tensorboard", "run.cpu_threads",
    "run.cpu_devices", "run.compilation_cache", "wandb.*", "eval.*", "checkpoint.*", "distributed.*", "debug.*",
)


def is_resumable(key: str) -> bool:
    return any(key == safe or (safe.endswith("*") and key.startswith(safe[:-1])) for safe in RESUMABLE_KEYS)


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
            if fld.metadata.get("reference") and is_reference(value):
                continue
            if choices is not None and value is not None:
                alternative = " or module:attribute" if fld.metadata.get("reference") else ""
                _check(value in choices, key, value, f"must be one of {', '.join(choices)}{alternative}")
            if isinstance(value, float):
                _check(math.isfinite(value), key, value, "must be a finite number")
    for key in ("env.num_envs", "env.optimistic_reset_ratio", "ppo.num_steps", "ppo.num_epochs",
                "ppo.num_minibatches", "train.total_env_steps", "train.updates_per_chunk", "eval.num_episodes",
                "checkpoint.keep", "network.recurrent_size"):
        _check((value := config_value(config, key)) >= 1, key, value, "must be at least 1")
    if config.env.start_states == "first":
        _check(config.env.optimistic_reset_ratio == 1, "env.optimistic_reset_ratio", config.env.optimistic_reset_ratio,
               "sizes the pool of fresh states, which env.start_states=first does not keep: leave it at 1")
    if config.train.num_shards is not None:
        _check(config.train.num_shards >= 1, "train.num_shards", config.train.num_shards,
               "must be at least 1 (or left unset for one shard per device)")
    non_negative = {"checkpoint.every_updates": " (0: none by update count)",
                    "checkpoint.every_seconds": " (0: none by time)", "train.seed": "",
                    "run.cpu_threads": " (0: XLA's default, one per core)", "run.cpu_devices": " (0: JAX's default)",
                    "eval.every_updates": " (0: evaluate only at the end)", "eval.video_every_updates": " (0: off)"}
    for key, meaning in non_negative.items():
        _check((value := config_value(config, key)) >= 0, key, value, f"must be >= 0{meaning}")
    _check(config.run.compilation_cache.strip() not in ("", "on"), "run.compilation_cache",
           config.run.compilation_cache, "must be auto, off or a directory")
    for key in ("learning_rate", "adam_eps"):
        _check((value := getattr(config.ppo, key)) > 0, f"ppo.{key}", value, "must be > 0")
    for key in ("gamma", "gae_lambda"):
        _check(0.0 <= (value := getattr(config.ppo, key)) <= 1.0, f"ppo.{key}", value, "must be in [0, 1]")
    for key in ("clip_eps", "max_grad_norm"):
        _check((value := getattr(config.ppo, key)) > 0, f"ppo.{key}", value, "must be > 0")
    for key in ("vf_coef", "ent_coef"):
        _check((value := getattr(config.ppo, key)) >= 0, f"ppo.{key}", value, "must be >= 0")
    segment_length = config.ppo.segment_length
    _check(segment_length >= 0, "ppo.segment_length", segment_length, "must be >= 0 (0: single-step minibatches)")
    if segment_length:
        _check(config.ppo.num_steps % segment_length == 0, "ppo.segment_length", segment_length,
               f"must divide ppo.num_steps={config.ppo.num_steps}")
        _check(config.network.recurrent is None, "ppo.segment_length", segment_length,
               f"needs a feed-forward network, not network.recurrent={config.network.recurrent}: set it to 0")
    _validate_pbt(config.pbt)
    _validate_wandb(config.wandb)
    _validate_distributed(config.distributed)
    actor_sizes = config.network.actor_hidden_sizes
    for key, sizes in (("hidden_sizes", config.network.hidden_sizes), ("actor_hidden_sizes", actor_sizes)):
        if sizes is not None:
            _check(len(sizes) >= 1 and min(sizes) >= 1, f"network.{key}", list(sizes),
                   "needs at least one positive width")
    if actor_sizes is not None:
        _check(not config.network.shared_torso, "network.actor_hidden_sizes", list(actor_sizes),
               "needs separate torsos: network.shared_torso is true")
    _check(all(c >= 1 for c in config.network.cnn_channels), "network.cnn_channels",
           list(config.network.cnn_channels), "widths must be positive")


# The update's traced hyperparameters, declared by `traced_bounds` on their PPOConfig fields: the
# keys a sweep may vary and `pbt.keys` may name, with the interval PBT clips each into, inside its
# valid range and away from the values that break the update (a discount or lambda of 1 on a run
# without ends, a zero clip range, learning rate, Adam epsilon or gradient norm).
TRACED_BOUNDS: dict[str, tuple[float, float]] = {
    fld.name: fld.metadata["traced_bounds"] for fld in dataclasses.fields(PPOConfig) if fld.metadata["traced_bounds"]}
TRACED_KEYS = tuple(f"ppo.{name}" for name in TRACED_BOUNDS)


def _validate_pbt(config: PBTConfig) -> None:
    _check(config.every_updates >= 0, "pbt.every_updates", config.every_updates, "must be >= 0 (0: off)")
    _check(0 < config.quantile <= 0.5, "pbt.quantile", config.quantile, "must be in (0, 0.5]")
    _check(len(config.perturb) >= 1 and all(math.isfinite(f) and f > 0 for f in config.perturb), "pbt.perturb",
           list(config.perturb), "needs at least one factor, every factor finite and > 0")
    _check(0 <= config.resample_probability <= 1, "pbt.resample_probability", config.resample_probability,
           "must be in [0, 1]")
    for key in config.keys:
        _check(key in TRACED_KEYS, "pbt.keys", list(config.keys), f"{key} is not one of {', '.join(TRACED_KEYS)}")
    _check(len(set(config.keys)) == len(config.keys), "pbt.keys", list(config.keys), "names a key twice")


def _validate_wandb(config: WandbConfig) -> None:
    for name in ("project", "entity", "group"):
        value = getattr(config, name)
        _check(value is None or (isinstance(value, str) and value.strip() != ""), f"wandb.{name}", value,
               "must be a non-empty string (or left unset for W&B's default)")
    _check(all(isinstance(tag, str) and 0 < len(tag) <= 64 for tag in config.tags), "wandb.tags", list(config.tags),
           "must be a list of strings of 1 to 64 characters")


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
