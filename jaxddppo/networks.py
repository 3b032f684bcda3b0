"""Flax actor-critic networks and the two action distributions they parameterise.

`make_actor_critic(network_config, env_spec)` returns an `ActorCritic` of pure
functions: `init(key, obs) -> params` and `step(params, carry, obs,
episode_start) -> (carry, distribution, value)`; a feed-forward network also
has `apply(params, obs) -> (distribution, value)` and ignores the carry (None).
A recurrent one (`network.recurrent`) zeroes its carry where `episode_start` is
true before the core; `unroll` runs `step` over a [T, B] sequence. The rest of
the trainer sees only those and the distribution methods (`sample`,
`log_prob`, `entropy`, `mode`). `policy_step` is the one way to act, shared by
the rollout, evaluation and loaded policies: it normalises observations with the
run's running statistics, if it keeps them, then calls `step`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax import custom_batching

from jaxddppo.config import ConfigError, NetworkConfig
from jaxddppo.envs import EnvSpec
from jaxddppo.normalization import RunningMoments, normalize

_LOG_2PI = math.log(2.0 * math.pi)

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "tanh": jnp.tanh,
    "relu": nn.relu,
    "gelu": nn.gelu,
    "silu": nn.silu,
    "elu": nn.elu,
}


@struct.dataclass
class Categorical:
    """Categorical distribution over the last axis of `logits`."""

    logits: jax.Array

    def _log_probs(self) -> jax.Array:
        return jax.nn.log_softmax(self.logits, axis=-1)

    def sample(self, key: jax.Array) -> jax.Array:
        return jax.random.categorical(key, self.logits, axis=-1)

    def mode(self) -> jax.Array:
        return jnp.argmax(self.logits, axis=-1)

    def log_prob(self, action: jax.Array) -> jax.Array:
        log_probs = self._log_probs()
        return jnp.take_along_axis(log_probs, action[..., None].astype(jnp.int32), axis=-1)[..., 0]

    def entropy(self) -> jax.Array:
        log_probs = self._log_probs()
        return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


@struct.dataclass
class DiagGaussian:
    """Independent Gaussians over the last axis; `log_std` broadcasts against `mean`."""

    mean: jax.Array
    log_std: jax.Array

    def sample(self, key: jax.Array) -> jax.Array:
        noise = jax.random.normal(key, self.mean.shape, self.mean.dtype)
        return self.mean + jnp.exp(self.log_std) * noise

    def mode(self) -> jax.Array:
        return self.mean

    def log_prob(self, action: jax.Array) -> jax.Array:
        log_std = jnp.broadcast_to(self.log_std, self.mean.shape)
        z = (action - self.mean) * jnp.exp(-log_std)
        return jnp.sum(-0.5 * z**2 - log_std - 0.5 * _LOG_2PI, axis=-1)

    def entropy(self) -> jax.Array:
        log_std = jnp.broadcast_to(self.log_std, self.mean.shape)
        return jnp.sum(log_std + 0.5 * (1.0 + _LOG_2PI), axis=-1)


Distribution = Categorical | DiagGaussian


def orthogonal(scale: float = 1.0) -> Callable[..., jax.Array]:
    """`nn.initializers.orthogonal(scale)` bit for bit, except that under `vmap` its QR
    factorisations run one matrix after another (`lax.map`) instead of batched.

    Why: jaxlib 0.10's CPU QR spreads a batch of matrices over XLA's thread pool and waits
    for them on a thread of that same pool. An initialisation holds several independent QRs
    (one per layer); batched (several shards on a device, or a caller's vmap over seeds)
    and run at once on every thread of the pool, each waits for work no thread is left to
    run, and the program never finishes. One matrix at a time, the QR runs on the thread
    that calls it."""
    draw_one = nn.initializers.orthogonal(scale)

    def init(key: jax.Array, shape: Sequence[int], dtype: Any = None) -> jax.Array:
        @custom_batching.custom_vmap
        def draw(key: jax.Array) -> jax.Array:
            return draw_one(key, shape, dtype)

        @draw.def_vmap
        def draw_each(axis_size: int, in_batched: Sequence[bool], keys: jax.Array) -> tuple[jax.Array, bool]:
            if axis_size == 1:
                return draw(keys[0])[None], True
            return jax.lax.map(draw, keys), True

        return draw(key)

    return init


def _dense(features: int, scale: float) -> nn.Dense:
    return nn.Dense(features, kernel_init=orthogonal(scale), bias_init=nn.initializers.zeros)


class Torso(nn.Module):
    """Optional 3x3 convolutions (image observations), then an MLP."""

    hidden_sizes: Sequence[int]
    activation: str
    cnn_channels: Sequence[int] = ()

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        x = obs
        if self.cnn_channels:
            for channels in self.cnn_channels:
                conv = nn.Conv(channels, (3, 3), padding="VALID",
                               kernel_init=orthogonal(math.sqrt(2.0)))
                x = act(conv(x))
            x = x.reshape(x.shape[:-3] + (-1,))
        for width in self.hidden_sizes:
            x = act(_dense(width, math.sqrt(2.0))(x))
        return x


class ActorCriticModule(nn.Module):
    hidden_sizes: Sequence[int]
    activation: str
    cnn_channels: Sequence[int]
    shared_torso: bool
    discrete: bool
    num_actions: int
    init_log_std: float

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[Distribution, jax.Array]:
        torso = lambda name: Torso(self.hidden_sizes, self.activation, self.cnn_channels, name=name)
        actor_features = torso("torso" if self.shared_torso else "actor_torso")(obs)
        critic_features = actor_features if self.shared_torso else torso("critic_torso")(obs)
        value = _dense(1, 1.0)(critic_features)[..., 0]
        head = _dense(self.num_actions, 0.01)(actor_features)
        if self.discrete:
            return Categorical(head), value
        log_std = self.param("log_std", nn.initializers.constant(self.init_log_std), (self.num_actions,))
        return DiagGaussian(head, log_std), value


def _recurrent_cell(kind: str, size: int, name: str) -> nn.RNNCellBase:
    if kind == "gru":
        return nn.GRUCell(size, recurrent_kernel_init=orthogonal(), name=name)
    return nn.OptimizedLSTMCell(size, recurrent_kernel_init=orthogonal(), name=name)


def zero_carry(kind: str, size: int, batch_size: int) -> Any:
    """The recurrent state of `batch_size` fresh episodes: GRU h, or LSTM (c, h)."""
    zeros = jnp.zeros((batch_size, size), jnp.float32)
    return zeros if kind == "gru" else (zeros, zeros)


class RecurrentActorCriticModule(nn.Module):
    """Torso, then a GRU or LSTM core, then the heads. Separate torsos get separate cores,
    so the carry is a tuple with one entry per core (actor, critic) or one (shared)."""

    hidden_sizes: Sequence[int]
    activation: str
    cnn_channels: Sequence[int]
    shared_torso: bool
    discrete: bool
    num_actions: int
    init_log_std: float
    recurrent: str
    recurrent_size: int

    @nn.compact
    def __call__(
        self, carry: tuple[Any, ...], obs: jax.Array, episode_start: jax.Array
    ) -> tuple[tuple[Any, ...], Distribution, jax.Array]:
        names = ("torso",) if self.shared_torso else ("actor_torso", "critic_torso")
        new_carry, features = [], []
        for name, core_carry in zip(names, carry):
            x = Torso(self.hidden_sizes, self.activation, self.cnn_channels, name=name)(obs)
            core_carry = jax.tree.map(lambda c: jnp.where(episode_start[:, None], 0.0, c), core_carry)
            core_carry, out = _recurrent_cell(self.recurrent, self.recurrent_size, f"{name}_core")(core_carry, x)
            new_carry.append(core_carry)
            features.append(out)
        actor_features, critic_features = features[0], features[-1]
        value = _dense(1, 1.0)(critic_features)[..., 0]
        head = _dense(self.num_actions, 0.01)(actor_features)
        if self.discrete:
            return tuple(new_carry), Categorical(head), value
        log_std = self.param("log_std", nn.initializers.constant(self.init_log_std), (self.num_actions,))
        # Full shape, so that distributions stacked over time by `unroll` stay aligned with their means.
        return tuple(new_carry), DiagGaussian(head, jnp.broadcast_to(log_std, head.shape)), value


StepFn = Callable[[dict, Any, jax.Array, Optional[jax.Array]], tuple[Any, Distribution, jax.Array]]


@dataclass(frozen=True)
class ActorCritic:
    """The network as pure functions.

    `step` acts on a batch [B, ...]: (params, carry, obs, episode_start) ->
    (carry, distribution, value). Feed-forward: carry and episode_start are
    None and `apply(params, obs)` works on any leading batch shape. Recurrent:
    `initial_carry(B)` is the carry of B fresh episodes and `apply` is None.
    """

    init: Callable[[jax.Array, jax.Array], dict]
    step: StepFn
    apply: Optional[Callable[[dict, jax.Array], tuple[Distribution, jax.Array]]]
    initial_carry: Callable[[int], Any]

    @property
    def recurrent(self) -> bool:
        return self.apply is None


def unroll(
    network: ActorCritic, params: dict, carry: Any, obs: jax.Array, episode_start: jax.Array
) -> tuple[Any, Distribution, jax.Array]:
    """`network.step` over a sequence: obs [T, B, ...], episode_start [T, B]; the carry is
    reset where an episode starts. Returns the last carry, distributions and values [T, B]."""

    def step(carry: Any, inputs: tuple[jax.Array, jax.Array]) -> tuple[Any, tuple[Distribution, jax.Array]]:
        carry, dist, value = network.step(params, carry, *inputs)
        return carry, (dist, value)

    carry, (dist, value) = jax.lax.scan(step, carry, (obs, episode_start))
    return carry, dist, value


def make_actor_critic(config: NetworkConfig, spec: EnvSpec) -> ActorCritic:
    image_obs = len(spec.obs_shape) == 3
    use_cnn = config.torso == "cnn" or (config.torso == "auto" and image_obs)
    if use_cnn and not image_obs:
        raise ConfigError(
            f"network.torso='cnn' needs image observations [H, W, C]; {spec.env_id} has shape {spec.obs_shape}"
        )
    common = {
        "hidden_sizes": tuple(config.hidden_sizes),
        "activation": config.activation,
        "cnn_channels": tuple(config.cnn_channels) if use_cnn else (),
        "shared_torso": config.shared_torso,
        "discrete": spec.discrete,
        "num_actions": spec.num_actions,
        "init_log_std": config.init_log_std,
    }
    flat_obs = not use_cnn and len(spec.obs_shape) != 1

    def prepare(obs: jax.Array) -> jax.Array:
        if flat_obs:
            return obs.reshape(obs.shape[: obs.ndim - len(spec.obs_shape)] + (-1,))
        return obs

    if config.recurrent is not None:
        return _recurrent_actor_critic(config, RecurrentActorCriticModule(
            **common, recurrent=config.recurrent, recurrent_size=config.recurrent_size
        ), prepare)
    module = ActorCriticModule(**common)

    def init(key: jax.Array, obs: jax.Array) -> dict:
        return module.init(key, prepare(obs))

    def apply(params: dict, obs: jax.Array) -> tuple[Distribution, jax.Array]:
        return module.apply(params, prepare(obs))

    def step(params: dict, carry: None, obs: jax.Array, episode_start: Optional[jax.Array]
             ) -> tuple[None, Distribution, jax.Array]:
        return (carry, *apply(params, obs))

    return ActorCritic(init=init, step=step, apply=apply, initial_carry=lambda batch_size: None)


def _recurrent_actor_critic(
    config: NetworkConfig, module: RecurrentActorCriticModule, prepare: Callable[[jax.Array], jax.Array]
) -> ActorCritic:
    num_cores = 1 if config.shared_torso else 2

    def initial_carry(batch_size: int) -> tuple[Any, ...]:
        return tuple(zero_carry(config.recurrent, config.recurrent_size, batch_size) for _ in range(num_cores))

    def init(key: jax.Array, obs: jax.Array) -> dict:
        batch_size = obs.shape[0]
        return module.init(key, initial_carry(batch_size), prepare(obs), jnp.ones((batch_size,), bool))

    def step(params: dict, carry: Any, obs: jax.Array, episode_start: jax.Array
             ) -> tuple[Any, Distribution, jax.Array]:
        return module.apply(params, carry, prepare(obs), episode_start)

    return ActorCritic(init=init, step=step, apply=None, initial_carry=initial_carry)


def prepare_observations(obs_moments: Optional[RunningMoments], obs: jax.Array) -> jax.Array:
    """What the network sees: `obs` normalised by `obs_moments`, or as it is when there are none."""
    return obs if obs_moments is None else normalize(obs_moments, obs)


def policy_step(
    network: ActorCritic,
    params: Any,
    obs_moments: Optional[RunningMoments],
    carry: Any,
    obs: jax.Array,
    episode_start: Optional[jax.Array],
) -> tuple[Any, Distribution, jax.Array]:
    """(carry, distribution, value) for a batch of raw observations `obs` [B, ...].

    Feed-forward networks take and return `carry=None` and ignore
    `episode_start`; recurrent ones reset the carry where `episode_start` [B]
    is true (the observation is the first of its episode).
    """
    return network.step(params, carry, prepare_observations(obs_moments, obs), episode_start)
