"""Flax actor-critic networks and the two action distributions they parameterise.

`make_actor_critic(network_config, env_spec)` returns an `ActorCritic` with two
pure functions: `init(key, obs) -> params` and `apply(params, obs) ->
(distribution, value)`. The rest of the trainer sees only those and the
distribution methods (`sample`, `log_prob`, `entropy`, `mode`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from jaxddppo.config import ConfigError, NetworkConfig
from jaxddppo.envs import EnvSpec

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


def _dense(features: int, scale: float) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale), bias_init=nn.initializers.zeros)


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
                               kernel_init=nn.initializers.orthogonal(math.sqrt(2.0)))
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


@dataclass(frozen=True)
class ActorCritic:
    """The network as two pure functions; `apply` works on any leading batch shape."""

    init: Callable[[jax.Array, jax.Array], dict]
    apply: Callable[[dict, jax.Array], tuple[Distribution, jax.Array]]


def make_actor_critic(config: NetworkConfig, spec: EnvSpec) -> ActorCritic:
    image_obs = len(spec.obs_shape) == 3
    use_cnn = config.torso == "cnn" or (config.torso == "auto" and image_obs)
    if use_cnn and not image_obs:
        raise ConfigError(
            f"network.torso='cnn' needs image observations [H, W, C]; {spec.env_id} has shape {spec.obs_shape}"
        )
    module = ActorCriticModule(
        hidden_sizes=tuple(config.hidden_sizes),
        activation=config.activation,
        cnn_channels=tuple(config.cnn_channels) if use_cnn else (),
        shared_torso=config.shared_torso,
        discrete=spec.discrete,
        num_actions=spec.num_actions,
        init_log_std=config.init_log_std,
    )
    flat_obs = not use_cnn and len(spec.obs_shape) != 1

    def prepare(obs: jax.Array) -> jax.Array:
        if flat_obs:
            return obs.reshape(obs.shape[: obs.ndim - len(spec.obs_shape)] + (-1,))
        return obs

    def init(key: jax.Array, obs: jax.Array) -> dict:
        return module.init(key, prepare(obs))

    def apply(params: dict, obs: jax.Array) -> tuple[Distribution, jax.Array]:
        return module.apply(params, prepare(obs))

    return ActorCritic(init=init, apply=apply)
