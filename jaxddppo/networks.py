"""Flax actor-critic networks and the two action distributions they parameterise.

`make_actor_critic(network_config, env_spec)` returns an `ActorCritic` of pure
functions: `init(key, obs) -> params` and `step(params, carry, obs,
episode_start) -> (carry, distribution, value)`; a feed-forward network also
has `apply(params, obs) -> (distribution, value)` and ignores the carry (None).
A recurrent one (`network.recurrent`) zeroes its carry where `episode_start` is
true before the core; `unroll` runs `step` over a [T, B] sequence. The rest of
the trainer sees only those and the distribution methods (`sample`,
`log_prob`, `entropy`, `mode`); it acts through `rollout.policy_step`.

Observations are pytrees (`EnvSpec.observation`): every leaf but the action mask
is a torso input (`ObservationLayout`), and the mask, where the environment gives
one, restricts the categorical head to the legal actions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax import custom_batching

from jaxddppo.config.options import ConfigError, NetworkConfig, is_reference
from jaxddppo.envs import EnvSpec, batch_size
from jaxddppo.references import make_user_torso, user_torso_features

_LOG_2PI = math.log(2.0 * math.pi)
# An illegal action's logit: its probability is exactly 0 in float32, and being finite it
# makes no NaN (an entropy term 0 * log 0 would be one with -inf).
MASKED_LOGIT = -1e9

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

    @classmethod
    def masked(cls, logits: jax.Array, legal: jax.Array) -> Categorical:
        """The distribution of `logits` restricted to the actions where `legal` [..., A] is true:
        an illegal action is never sampled nor the mode, has probability 0 and adds 0 to the entropy."""
        return cls(jnp.where(legal, logits, MASKED_LOGIT))

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


class FeatureMajorDense(nn.Module):
    """A dense layer with outputs feature-major, [out, ...], from inputs with their features on
    `feature_axis`: 0 (another layer's outputs, [in, ...]) or -1 (observations, a user's torso's or
    a recurrent core's features, [..., in]). Its kernel [out, in] is `nn.Dense`'s transposed, drawn
    alike: the same function from the same initial values. Why: a weight gradient sums over the
    batch; on [N, F] activations over both operands' leading axis, which XLA's CPU backend leaves
    to Eigen (0.73 ms for MinAtar Freeway's first layer on this project's 2-core CPU), on [F, N]
    over their trailing axis, which it hands to YNNPACK (0.50 ms)."""

    features: int
    scale: float

    @nn.compact
    def __call__(self, x: jax.Array, feature_axis: int) -> jax.Array:
        draw = orthogonal(self.scale)
        kernel_shape = (self.features, x.shape[feature_axis])
        kernel = self.param("kernel", lambda key, shape: draw(key, shape[::-1]).T, kernel_shape)
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        # 2-D operands: XLA's CPU backend would copy a [T, B, in] input with its features in front.
        if feature_axis == 0:
            samples_shape, flat = x.shape[1:], x.reshape(x.shape[0], -1)
            outputs = _product(kernel, flat)
        else:
            samples_shape, flat = x.shape[:-1], x.reshape(-1, x.shape[-1])
            outputs = jax.lax.dot_general(kernel, flat, (((1,), (1,)), ((), ())))
        return (outputs + bias[:, None]).reshape((self.features,) + samples_shape)


# A feature-major layer's input gradient, kernel^T @ gradient, sums over the kernel's leading axis, which
# XLA's CPU backend leaves to Eigen. From this many multiply-adds on, the product takes the kernel transposed
# (behind a barrier, or XLA folds the transpose back), which YNNPACK runs: a gradient step of Playground's 5 x 256
# value MLP on 30,720 samples took 0.87x the time. Below, the barrier costs more (MinAtar's 64 x 64 on 1,024: 1.13x).
TRANSPOSED_KERNEL_MIN_MACS = 2**26


def _product(kernel: jax.Array, x: jax.Array) -> jax.Array:
    """kernel [out, in] @ x [in, N] (N symbolic in `jax.export`, where no gradient is taken)."""
    large = all(isinstance(size, int) for size in x.shape) and x.size * kernel.shape[0] >= TRANSPOSED_KERNEL_MIN_MACS
    return _product_transposing_kernel(kernel, x) if large else kernel @ x


@jax.custom_vjp
def _product_transposing_kernel(kernel: jax.Array, x: jax.Array) -> jax.Array:
    return kernel @ x


def _product_backward(residuals: tuple[jax.Array, jax.Array], gradient: jax.Array) -> tuple[jax.Array, jax.Array]:
    kernel, x = residuals
    return gradient @ x.T, jax.lax.optimization_barrier(kernel.T) @ gradient


_product_transposing_kernel.defvjp(lambda kernel, x: (kernel @ x, (kernel, x)), _product_backward)


def _heads(num_actions: int, actor_features: jax.Array, critic_features: jax.Array, feature_axis: int
           ) -> tuple[jax.Array, jax.Array]:
    """The value [...] and policy head [..., num_actions] of features on `feature_axis` (layers Dense_0, Dense_1)."""
    value = FeatureMajorDense(1, 1.0, name="Dense_0")(critic_features, feature_axis)[0]
    head = FeatureMajorDense(num_actions, 0.01, name="Dense_1")(actor_features, feature_axis)
    return value, jnp.moveaxis(head, 0, -1)


@struct.dataclass
class TorsoInputs:
    """A batch of observations as a torso takes it: images [..., H, W, C] for its CNN, vectors [..., D]."""

    images: tuple[jax.Array, ...]
    vectors: tuple[jax.Array, ...]


def _convolve(images: jax.Array, channels: Sequence[int], act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Features [..., F] of `images` [..., H, W, C]: 3x3 convolutions, flattened (call inside a
    module's compact method: the layers are its own, named Conv_0, Conv_1, ...)."""
    x = images
    for width in channels:
        x = act(nn.Conv(width, (3, 3), padding="VALID", kernel_init=orthogonal(math.sqrt(2.0)))(x))
    return x.reshape(x.shape[:-3] + (-1,))


class Torso(nn.Module):
    """3x3 convolutions on each image input, then an MLP on their features and the vector
    inputs laid end to end. Returns its features feature-major, [F, ...] (`FeatureMajorDense`)."""

    hidden_sizes: Sequence[int]
    activation: str
    cnn_channels: Sequence[int] = ()

    @nn.compact
    def __call__(self, inputs: TorsoInputs) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        images = [_convolve(image, self.cnn_channels, act) for image in inputs.images]
        x = jnp.concatenate(images + list(inputs.vectors), axis=-1)
        x = jnp.moveaxis(x, -1, 0) if not self.hidden_sizes else x
        for index, width in enumerate(self.hidden_sizes):
            x = act(FeatureMajorDense(width, math.sqrt(2.0), name=f"Dense_{index}")(x, -1 if index == 0 else 0))
        return x


class ActorCriticModule(nn.Module):
    hidden_sizes: Sequence[int]
    actor_hidden_sizes: Optional[Sequence[int]]  # the actor torso's widths, where not hidden_sizes
    activation: str
    cnn_channels: Sequence[int]
    shared_torso: bool
    discrete: bool
    num_actions: int
    init_log_std: float
    # A user's torso (`network.torso=module:attribute`), unbound, cloned for each use; its inputs are
    # the observations (without the action mask), whose first leaf has this rank per environment.
    custom_torso: Optional[nn.Module]
    observation_rank: int

    @property
    def feature_axis(self) -> int:  # of the torsos' features: the built-in torso's [F, ...], a user's [..., F]
        return 0 if self.custom_torso is None else -1

    def torso_features(self, name: str, inputs: Any) -> jax.Array:
        """The features of the torso called `name`, on `feature_axis` (call inside the compact method)."""
        if self.custom_torso is None:
            widths = self.actor_hidden_sizes if name == "actor_torso" and self.actor_hidden_sizes else self.hidden_sizes
            return Torso(widths, self.activation, self.cnn_channels, name=name)(inputs)
        return user_torso_features(self.custom_torso.clone(parent=self, name=name), inputs, self.observation_rank)

    @nn.compact
    def __call__(self, inputs: TorsoInputs) -> tuple[Distribution, jax.Array]:
        actor_features = self.torso_features("torso" if self.shared_torso else "actor_torso", inputs)
        critic_features = actor_features if self.shared_torso else self.torso_features("critic_torso", inputs)
        value, head = _heads(self.num_actions, actor_features, critic_features, self.feature_axis)
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


class RecurrentActorCriticModule(ActorCriticModule):
    """Torso, then a GRU or LSTM core, then the heads. Separate torsos get separate cores,
    so the carry is a tuple with one entry per core (actor, critic) or one (shared)."""

    recurrent: str
    recurrent_size: int

    @nn.compact
    def __call__(
        self, carry: tuple[Any, ...], inputs: TorsoInputs, episode_start: jax.Array
    ) -> tuple[tuple[Any, ...], Distribution, jax.Array]:
        names = ("torso",) if self.shared_torso else ("actor_torso", "critic_torso")
        new_carry, features = [], []
        for name, core_carry in zip(names, carry):
            x = jnp.moveaxis(self.torso_features(name, inputs), self.feature_axis, -1)
            core_carry = jax.tree.map(lambda c: jnp.where(episode_start[:, None], 0.0, c), core_carry)
            core_carry, out = _recurrent_cell(self.recurrent, self.recurrent_size, f"{name}_core")(core_carry, x)
            new_carry.append(core_carry)
            features.append(out)
        value, head = _heads(self.num_actions, features[0], features[-1], feature_axis=-1)
        if self.discrete:
            return tuple(new_carry), Categorical(head), value
        log_std = self.param("log_std", nn.initializers.constant(self.init_log_std), (self.num_actions,))
        # Full shape, so that distributions stacked over time by `unroll` stay aligned with their means.
        return tuple(new_carry), DiagGaussian(head, jnp.broadcast_to(log_std, head.shape)), value


StepFn = Callable[[dict, Any, Any, Optional[jax.Array]], tuple[Any, Distribution, jax.Array]]


@dataclass(frozen=True)
class ActorCritic:
    """The network as pure functions.

    `step` acts on a batch of observations (a pytree, leaves [B, ...]): (params, carry,
    obs, episode_start) -> (carry, distribution, value). Feed-forward: carry and
    episode_start are None and `apply(params, obs)` works on any leading batch shape.
    Recurrent: `initial_carry(B)` is the carry of B fresh episodes and `apply` is None.
    """

    init: Callable[[jax.Array, Any], dict]
    step: StepFn
    apply: Optional[Callable[[dict, Any], tuple[Distribution, jax.Array]]]
    initial_carry: Callable[[int], Any]

    @property
    def recurrent(self) -> bool:
        return self.apply is None


def unroll(
    network: ActorCritic, params: dict, carry: Any, obs: Any, episode_start: jax.Array
) -> tuple[Any, Distribution, jax.Array]:
    """`network.step` over a sequence: obs leaves [T, B, ...], episode_start [T, B]; the carry
    is reset where an episode starts. Returns the last carry, distributions and values [T, B]."""

    def step(carry: Any, inputs: tuple[Any, jax.Array]) -> tuple[Any, tuple[Distribution, jax.Array]]:
        carry, dist, value = network.step(params, carry, *inputs)
        return carry, (dist, value)

    carry, (dist, value) = jax.lax.scan(step, carry, (obs, episode_start))
    return carry, dist, value


@dataclass(frozen=True)
class ObservationLayout:
    """How observations reach the network. Every leaf but the action mask is a torso
    input: an image leaf ([H, W, C] per environment) goes through the CNN if `use_cnn`,
    any other leaf is flattened; the action mask, if the environment gives one, masks
    the categorical head's logits."""

    features: Any  # EnvSpec.observation without the action mask
    use_cnn: bool
    mask_key: Optional[str]
    custom_torso: bool = False  # a user's torso takes the observations as they are (without the mask)

    def torso_inputs(self, obs: Any) -> Any:
        """A batch of observations (leaves [..., *leaf shape]) as the torso's inputs: images and vectors,
        each in tree order (the observations without the mask, for a user's torso)."""
        if self.custom_torso:
            return _without_mask(obs, self.mask_key)
        images, vectors = [], []
        for leaf, spec in zip(jax.tree.leaves(_without_mask(obs, self.mask_key)), jax.tree.leaves(self.features)):
            if self.use_cnn and _is_image(spec):
                images.append(leaf)
            else:
                vectors.append(leaf.reshape(leaf.shape[: leaf.ndim - len(spec.shape)] + (-1,)))
        return TorsoInputs(tuple(images), tuple(vectors))

    def mask(self, dist: Distribution, obs: Any) -> Distribution:
        """`dist` restricted to the legal actions of `obs`, if it gives them."""
        if self.mask_key is None:
            return dist
        return Categorical.masked(dist.logits, obs[self.mask_key])


def _without_mask(obs: Any, mask_key: Optional[str]) -> Any:
    if mask_key is None:
        return obs
    return {key: value for key, value in obs.items() if key != mask_key}


def _is_image(spec: jax.ShapeDtypeStruct) -> bool:
    return len(spec.shape) == 3


def _check_action_mask(spec: EnvSpec) -> None:
    """A mask must be a bool [num_actions] leaf of a dict observation, over discrete actions."""
    key = spec.action_mask_key
    if not spec.discrete:
        raise ConfigError(f"env.id={spec.env_id!r} gives an action mask (observation[{key!r}]) but its actions are "
                          "continuous: masks need discrete actions")
    mask = spec.observation.get(key) if isinstance(spec.observation, Mapping) else None
    if mask is None or mask.dtype != jnp.bool_ or tuple(mask.shape) != (spec.num_actions,):
        raise ConfigError(f"env.id={spec.env_id!r}: its action mask observation[{key!r}] must be a bool "
                          f"[{spec.num_actions}] leaf of a dict observation, not {mask}")


def observation_layout(config: NetworkConfig, spec: EnvSpec, custom_torso: bool = False) -> ObservationLayout:
    """The layout of `spec`'s observations, or ConfigError for a torso or mask that cannot apply."""
    if spec.action_mask_key is not None:
        _check_action_mask(spec)
    features = _without_mask(spec.observation, spec.action_mask_key)
    if custom_torso:
        return ObservationLayout(features=features, use_cnn=False, mask_key=spec.action_mask_key, custom_torso=True)
    has_image = any(_is_image(leaf) for leaf in jax.tree.leaves(features))
    use_cnn = config.torso == "cnn" or (config.torso == "auto" and has_image)
    if use_cnn and not has_image:
        shapes = jax.tree.map(lambda leaf: tuple(leaf.shape), features)
        raise ConfigError(f"network.torso='cnn' needs image observations [H, W, C]; {spec.env_id} has shape {shapes}")
    return ObservationLayout(features=features, use_cnn=use_cnn, mask_key=spec.action_mask_key)


def make_actor_critic(config: NetworkConfig, spec: EnvSpec, torso: Any = None) -> ActorCritic:
    """The actor-critic `config` describes for `spec`'s observations and actions. `torso`: the
    object given to the Python API in place of `network.torso`'s reference, if any."""
    custom = torso is not None or is_reference(config.torso)
    if custom and config.actor_hidden_sizes is not None:
        raise ConfigError(f"network.actor_hidden_sizes={list(config.actor_hidden_sizes)} sizes the built-in torso: "
                          "leave it unset with your own torso")
    layout = observation_layout(config, spec, custom_torso=custom)
    custom_torso = make_user_torso(config, layout.features, torso) if custom else None
    common = {
        "hidden_sizes": tuple(config.hidden_sizes),
        "actor_hidden_sizes": None if config.actor_hidden_sizes is None else tuple(config.actor_hidden_sizes),
        "activation": config.activation,
        "cnn_channels": tuple(config.cnn_channels) if layout.use_cnn else (),
        "shared_torso": config.shared_torso,
        "discrete": spec.discrete,
        "num_actions": spec.num_actions,
        "init_log_std": config.init_log_std,
        "custom_torso": custom_torso,
        "observation_rank": len(jax.tree.leaves(layout.features)[0].shape),
    }
    if config.recurrent is not None:
        return _recurrent_actor_critic(config, RecurrentActorCriticModule(
            **common, recurrent=config.recurrent, recurrent_size=config.recurrent_size
        ), layout)
    module = ActorCriticModule(**common)

    def init(key: jax.Array, obs: Any) -> dict:
        return module.init(key, layout.torso_inputs(obs))

    def apply(params: dict, obs: Any) -> tuple[Distribution, jax.Array]:
        dist, value = module.apply(params, layout.torso_inputs(obs))
        return layout.mask(dist, obs), value

    def step(params: dict, carry: None, obs: Any, episode_start: Optional[jax.Array]
             ) -> tuple[None, Distribution, jax.Array]:
        return (carry, *apply(params, obs))

    return ActorCritic(init=init, step=step, apply=apply, initial_carry=lambda batch_size: None)


def _recurrent_actor_critic(
    config: NetworkConfig, module: RecurrentActorCriticModule, layout: ObservationLayout
) -> ActorCritic:
    num_cores = 1 if config.shared_torso else 2

    def initial_carry(num_envs: int) -> tuple[Any, ...]:
        return tuple(zero_carry(config.recurrent, config.recurrent_size, num_envs) for _ in range(num_cores))

    def init(key: jax.Array, obs: Any) -> dict:
        num_envs = batch_size(obs)
        return module.init(key, initial_carry(num_envs), layout.torso_inputs(obs), jnp.ones((num_envs,), bool))

    def step(params: dict, carry: Any, obs: Any, episode_start: jax.Array
             ) -> tuple[Any, Distribution, jax.Array]:
        carry, dist, value = module.apply(params, carry, layout.torso_inputs(obs), episode_start)
        return carry, layout.mask(dist, obs), value

    return ActorCritic(init=init, step=step, apply=None, initial_carry=initial_carry)
