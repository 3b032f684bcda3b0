"""The maths of the trainer against independent float64 NumPy references.

* `rollout.gae` against a plain backward loop, and two hand-worked cases.
* `ppo.segment_gradients` (ppo.segment_length): `ppo_loss`'s gradient with GAE of each
  segment from the current values, normalised over the shards' minibatch, by the same loop.
* `ppo.ppo_loss` (value, LossInfo and gradient) against a closed form on a tiny
  batch whose "network" is its own parameters.
* `networks.Categorical` / `DiagGaussian` against closed forms.
* `envs.BatchedEnv`: termination vs truncation, final_obs, episode statistics,
  action clipping, unknown ids.

JAX computes in float32 and the references in float64, so comparisons use
rtol=1e-5, atol=1e-5 unless a test says otherwise.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddppo import networks, sharding
from jaxddppo.config.options import ConfigError, NetworkConfig
from jaxddppo.cpu.tuning import sort_permutations
from jaxddppo.distributed import global_arrays
from jaxddppo.envs import BatchedEnv, make_env
from jaxddppo.envs.base import take_pending
from jaxddppo.networks import Categorical, DiagGaussian, FeatureMajorDense, make_actor_critic, orthogonal
from jaxddppo.ppo import (
    LossInfo,
    PPOHyperparams,
    UpdateSettings,
    optimizer_state,
    ppo_loss,
    run_epochs,
    segment_gradients,
)
from jaxddppo.rollout import Batch, Segments, Transition, gae, segment_rollout, take_segments
from jaxddppo.sharding import epoch_indices, random_permutations

RTOL = 1e-5
ATOL = 1e-5
LOG_2PI = math.log(2.0 * math.pi)


# --------------------------------------------------------------------------- GAE


def gae_reference(rewards, values, next_values, terminated, truncated, gamma, lam):
    """Float64 backward loop over t; every argument is [T, B]."""
    rewards, values, next_values = (np.asarray(x, np.float64) for x in (rewards, values, next_values))
    terminated = np.asarray(terminated, bool)
    truncated = np.asarray(truncated, bool)
    num_steps = rewards.shape[0]
    advantages = np.zeros_like(rewards)
    next_advantage = np.zeros_like(rewards[0])  # A_T = 0 beyond the last step
    for t in reversed(range(num_steps)):
        not_term = 1.0 - terminated[t]
        not_trunc = 1.0 - truncated[t]
        delta = rewards[t] + gamma * next_values[t] * not_term - values[t]
        next_advantage = delta + gamma * lam * not_term * not_trunc * next_advantage
        advantages[t] = next_advantage
    return advantages


def random_gae_inputs(seed: int, num_steps: int = 7, num_envs: int = 5):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    values = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    next_values = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    terminated = rng.random((num_steps, num_envs)) < 0.2
    # envs.BatchedEnv guarantees truncated excludes terminated: draw them disjoint.
    truncated = (rng.random((num_steps, num_envs)) < 0.25) & ~terminated
    # The draw must exercise every case, and a step followed by another in the same column.
    assert terminated[:-1].any() and truncated[:-1].any() and (~terminated & ~truncated)[:-1].any()
    assert not (terminated & truncated).any()
    return rewards, values, next_values, terminated, truncated


@pytest.mark.parametrize("gamma, lam", [(0.99, 0.95), (0.9, 0.8), (1.0, 1.0), (0.97, 0.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_float64_loop(seed, gamma, lam):
    rewards, values, next_values, terminated, truncated = random_gae_inputs(seed)
    expected = gae_reference(rewards, values, next_values, terminated, truncated, gamma, lam)
    args = tuple(jnp.asarray(x) for x in (rewards, values, next_values, terminated, truncated))

    eager = gae(*args, gamma, lam)
    # Jitted, with gamma and lambda traced as float32 scalars (as PPOHyperparams passes them).
    jitted = jax.jit(gae)(*args, jnp.float32(gamma), jnp.float32(lam))

    assert eager.shape == (7, 5) and eager.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(eager), expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(jitted), expected, rtol=RTOL, atol=ATOL)


def test_gae_lambda_zero_is_one_step_td_error():
    rewards, values, next_values, terminated, truncated = random_gae_inputs(3)
    out = gae(*(jnp.asarray(x) for x in (rewards, values, next_values, terminated, truncated)), 0.9, 0.0)
    td = rewards + 0.9 * next_values * (1.0 - terminated) - values
    np.testing.assert_allclose(np.asarray(out), td, rtol=RTOL, atol=ATOL)


# Hand-worked, T=3, B=1, gamma = lambda = 0.5 (so gamma * lambda = 0.25); all numbers exact in binary.
#
# Case "trunc_then_term": flags [neither, truncated, terminated]
#   t=2 terminated: r=2, v=1, nv=8 -> delta2 = 2 + 0 (no bootstrap) - 1 = 1;  A2 = 1   (end of rollout)
#   t=1 truncated:  r=1, v=2, nv=4 -> delta1 = 1 + 0.5*4 (bootstraps) - 2 = 1; A1 = 1 + 0 * A2 = 1  (trace stops)
#   t=0 neither:    r=1, v=1, nv=2 -> delta0 = 1 + 0.5*2 - 1 = 1;          A0 = 1 + 0.25 * A1 = 1.25
#   (Bootstrapping the terminated step would give A2 = 5; not bootstrapping the truncated one
#    gives delta1 = -1; not stopping the trace at truncation gives A1 = 1.25.)
#
# Case "term_then_trunc": flags [neither, terminated, truncated]
#   t=2 truncated:  r=1, v=2, nv=4 -> delta2 = 1 + 2 - 2 = 1;  A2 = 1
#   t=1 terminated: r=2, v=1, nv=8 -> delta1 = 2 + 0 - 1 = 1;  A1 = 1 + 0 * A2 = 1  (trace stops)
#   t=0 neither:    r=1, v=1, nv=2 -> delta0 = 1;              A0 = 1 + 0.25 * 1 = 1.25
#   (Not stopping the trace at termination gives A1 = 1.25, A0 = 1.3125.)
HAND_CASES = {
    "trunc_then_term": {
        "rewards": [1.0, 1.0, 2.0], "values": [1.0, 2.0, 1.0], "next_values": [2.0, 4.0, 8.0],
        "terminated": [False, False, True], "truncated": [False, True, False], "expected": [1.25, 1.0, 1.0],
    },
    "term_then_trunc": {
        "rewards": [1.0, 2.0, 1.0], "values": [1.0, 1.0, 2.0], "next_values": [2.0, 8.0, 4.0],
        "terminated": [False, True, False], "truncated": [False, False, True], "expected": [1.25, 1.0, 1.0],
    },
}


@pytest.mark.parametrize("name", sorted(HAND_CASES))
def test_gae_hand_worked(name):
    case = HAND_CASES[name]
    column = lambda key, dtype: jnp.asarray(case[key], dtype)[:, None]
    args = (
        column("rewards", jnp.float32), column("values", jnp.float32), column("next_values", jnp.float32),
        column("terminated", bool), column("truncated", bool),
    )
    expected = np.asarray(case["expected"])[:, None]
    np.testing.assert_allclose(np.asarray(gae(*args, 0.5, 0.5)), expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(gae)(*args, 0.5, 0.5)), expected, rtol=0, atol=1e-6)
    # The independent loop agrees with the hand-worked numbers too.
    ref = gae_reference(*(np.asarray(a) for a in args), 0.5, 0.5)
    np.testing.assert_allclose(ref, expected, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- PPO loss

CLIP_EPS = 0.2
VF_COEF = 0.7
ENT_COEF = 0.03


def hyperparams() -> PPOHyperparams:
    return PPOHyperparams(
        learning_rate=jnp.float32(3e-4),
        gamma=jnp.float32(0.99),
        gae_lambda=jnp.float32(0.95),
        clip_eps=jnp.float32(CLIP_EPS),
        vf_coef=jnp.float32(VF_COEF),
        ent_coef=jnp.float32(ENT_COEF),
        max_grad_norm=jnp.float32(0.5),
        adam_eps=jnp.float32(1e-5),
    )


def tabular_apply(params, obs):
    """A 'network' whose outputs are its parameters: one row of logits and one value per sample."""
    del obs
    return Categorical(params["logits"]), params["values"]


def log_softmax64(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def make_loss_problem():
    """N=8 samples, A=3 actions; each sample's ratio and advantage sign is chosen on purpose.

    eps = 0.2. (ratio, sign of A) per sample:
      0: 1.5  +  clipped above, surrogate flat (no policy gradient)
      1: 1.5  -  above the range but unclipped branch is the min (gradient flows)
      2: 0.6  +  below the range, unclipped branch is the min (gradient flows)
      3: 0.6  -  clipped below, flat
      4: 1.05 +  inside
      5: 0.95 -  inside
      6: 1.1  -  inside
      7: 0.75 +  below, unclipped (gradient flows)
    Value offsets v - v_old and targets (relative to v_old), eps = 0.2:
      0: +0.5, t=+1.0  -> clipped error (0.8^2) > unclipped (0.5^2): flat
      1: +0.5, t=-0.3  -> unclipped (0.8^2) wins: gradient
      2: -0.5, t=-1.0  -> clipped wins: flat
      3: -0.5, t=+0.3  -> unclipped wins: gradient
      4: +0.1, t=+0.4  -> inside: both equal
      5: -0.05, t=-0.6 -> inside
      6: +0.3, t=+0.27 -> clipped (0.07^2) > unclipped (0.03^2): flat
      7: -0.3, t=-0.1  -> unclipped (0.2^2) > clipped (0.1^2): gradient
    """
    rng = np.random.default_rng(42)
    n, a = 8, 3
    logits = rng.normal(size=(n, a)).astype(np.float32)
    actions = np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int32)
    ratios = np.array([1.5, 1.5, 0.6, 0.6, 1.05, 0.95, 1.1, 0.75])  # mean(r) != 1
    advantages = np.array([1.3, -0.7, 0.9, -1.1, 0.4, -0.8, -0.5, 2.0], np.float32)
    new_log_prob = log_softmax64(logits)[np.arange(n), actions]
    old_log_prob = (new_log_prob - np.log(ratios)).astype(np.float32)

    old_values = rng.normal(size=n).astype(np.float32)
    offsets = np.array([0.5, 0.5, -0.5, -0.5, 0.1, -0.05, 0.3, -0.3])
    target_offsets = np.array([1.0, -0.3, -1.0, 0.3, 0.4, -0.6, 0.27, -0.1])
    values = (old_values + offsets).astype(np.float32)
    targets = (old_values + target_offsets).astype(np.float32)

    params = {"logits": logits, "values": values}
    batch = {
        "obs": np.zeros((n, 1), np.float32),
        "action": actions,
        "log_prob": old_log_prob,
        "value": old_values,
        "advantage": advantages,
        "target": targets,
    }
    return params, batch


def loss_reference(logits, values, batch, clip_value):
    """Float64 PPO loss and its parts."""
    n = logits.shape[0]
    log_probs = log_softmax64(logits)
    probs = np.exp(log_probs)
    log_prob = log_probs[np.arange(n), batch["action"]]
    log_ratio = log_prob - np.asarray(batch["log_prob"], np.float64)
    ratio = np.exp(log_ratio)
    adv = np.asarray(batch["advantage"], np.float64)
    policy_loss = -np.mean(np.minimum(ratio * adv, np.clip(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS) * adv))
    target = np.asarray(batch["target"], np.float64)
    old_value = np.asarray(batch["value"], np.float64)
    error = (values - target) ** 2
    if clip_value:
        clipped = old_value + np.clip(values - old_value, -CLIP_EPS, CLIP_EPS)
        error = np.maximum(error, (clipped - target) ** 2)
    value_loss = 0.5 * np.mean(error)
    entropy = np.mean(-np.sum(probs * log_probs, axis=-1))
    loss = policy_loss + VF_COEF * value_loss - ENT_COEF * entropy
    parts = {
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy": entropy,
        "approx_kl": np.mean((ratio - 1) - log_ratio),
        "clip_fraction": np.mean(np.abs(ratio - 1) > CLIP_EPS),
    }
    return loss, parts


def grad_reference(logits, values, batch, clip_value):
    """Closed-form float64 gradient of `loss_reference` w.r.t. logits and values."""
    n, num_actions = logits.shape
    log_probs = log_softmax64(logits)
    probs = np.exp(log_probs)
    actions = batch["action"]
    ratio = np.exp(log_probs[np.arange(n), actions] - np.asarray(batch["log_prob"], np.float64))
    adv = np.asarray(batch["advantage"], np.float64)
    clipped_ratio = np.clip(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
    # The unclipped branch carries the gradient where it is the min (inside the range both coincide).
    unclipped_active = (np.abs(ratio - 1) <= CLIP_EPS) | (ratio * adv < clipped_ratio * adv)
    d_log_prob = -ratio * adv * unclipped_active / n  # d policy_loss / d log pi(a_i)
    onehot = np.eye(num_actions)[actions]
    grad_logits = d_log_prob[:, None] * (onehot - probs)
    entropy_rows = -np.sum(probs * log_probs, axis=-1)
    d_entropy = -probs * (log_probs + entropy_rows[:, None])  # dH_i / dz_ij
    grad_logits += -ENT_COEF * d_entropy / n

    target = np.asarray(batch["target"], np.float64)
    old_value = np.asarray(batch["value"], np.float64)
    value_active = np.ones(n, bool)
    if clip_value:
        delta = values - old_value
        clipped = old_value + np.clip(delta, -CLIP_EPS, CLIP_EPS)
        clipped_wins = (clipped - target) ** 2 > (values - target) ** 2
        value_active = ~(clipped_wins & (np.abs(delta) > CLIP_EPS))
    grad_values = VF_COEF * (values - target) * value_active / n
    return grad_logits, grad_values


def finite_difference(fn, x, h=1e-6):
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += h
        down[index] -= h
        grad[index] = (fn(up) - fn(down)) / (2 * h)
    return grad


@pytest.mark.parametrize("clip_value", [False, True])
def test_ppo_loss_and_gradient(clip_value):
    params, batch_np = make_loss_problem()
    logits64 = params["logits"].astype(np.float64)
    values64 = params["values"].astype(np.float64)

    # The problem covers what it claims to.
    ratio = np.exp(log_softmax64(logits64)[np.arange(8), batch_np["action"]] - batch_np["log_prob"])
    assert (ratio > 1 + CLIP_EPS + 0.05).sum() >= 2 and (ratio < 1 - CLIP_EPS - 0.05).sum() >= 2
    assert (np.abs(ratio - 1) < CLIP_EPS - 0.05).sum() >= 2
    assert (batch_np["advantage"] > 0).any() and (batch_np["advantage"] < 0).any()
    clipped_ratio = np.clip(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
    flat = clipped_ratio * batch_np["advantage"] < ratio * batch_np["advantage"]  # clipped branch is the min
    np.testing.assert_array_equal(np.flatnonzero(flat), [0, 3])

    ref_loss, ref_parts = loss_reference(logits64, values64, batch_np, clip_value)
    ref_grad_logits, ref_grad_values = grad_reference(logits64, values64, batch_np, clip_value)

    # The closed-form gradient is checked against a central difference of the float64 loss.
    fd_logits = finite_difference(lambda z: loss_reference(z, values64, batch_np, clip_value)[0], logits64)
    fd_values = finite_difference(lambda v: loss_reference(logits64, v, batch_np, clip_value)[0], values64)
    np.testing.assert_allclose(ref_grad_logits, fd_logits, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(ref_grad_values, fd_values, rtol=1e-6, atol=1e-8)
    # The clipping cases matter: some value gradients are exactly zero, some are not.
    if clip_value:
        np.testing.assert_array_equal(np.flatnonzero(ref_grad_values == 0), [0, 2, 6])
    else:
        assert (ref_grad_values != 0).all()

    jparams = jax.tree.map(jnp.asarray, params)
    batch = Batch(**{k: jnp.asarray(v) for k, v in batch_np.items()})
    hp = hyperparams()
    loss_fn = functools.partial(ppo_loss, apply_fn=tabular_apply, hyperparams=hp, clip_value=clip_value)

    # Jitted, as in sgd_step (the un-jitted call is checked in the next test).
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, batch=b), has_aux=True))
    (loss, info), grads = value_and_grad(jparams, batch)
    assert isinstance(info, LossInfo)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=RTOL, atol=ATOL)
    for name, expected in ref_parts.items():
        np.testing.assert_allclose(float(getattr(info, name)), expected, rtol=RTOL, atol=ATOL, err_msg=name)
    assert float(info.grad_norm) == 0.0
    # Gradients: float32 against float64, rtol 1e-4, atol 1e-6 (entries are O(0.01 - 0.1)).
    np.testing.assert_allclose(np.asarray(grads["logits"]), ref_grad_logits, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["values"]), ref_grad_values, rtol=1e-4, atol=1e-6)

    # clip_fraction counts samples 0-3 and 7 (|r - 1| > 0.2): 5 of 8.
    assert ref_parts["clip_fraction"] == 5 / 8


def mlp_gradients_float64(params, obs, logits_grad, value_grad):
    """Backpropagation through the two-torso tanh MLP by hand, in float64, with activations
    [N, F] and kernels [out, in]: the gradients of sum(logits * logits_grad) + sum(value *
    value_grad) for every parameter."""
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), params["params"])
    flat_obs = obs.reshape(-1, obs.shape[-1]).astype(np.float64)

    def torso_forward(torso):
        activations = [flat_obs]
        for layer in ("Dense_0", "Dense_1"):
            activations.append(np.tanh(activations[-1] @ torso[layer]["kernel"].T + torso[layer]["bias"]))
        return activations

    def torso_backward(torso, activations, output_grad):
        grads = {}
        for index, layer in reversed(list(enumerate(("Dense_0", "Dense_1")))):
            pre_activation_grad = output_grad * (1.0 - activations[index + 1] ** 2)
            grads[layer] = {"kernel": pre_activation_grad.T @ activations[index], "bias": pre_activation_grad.sum(0)}
            output_grad = pre_activation_grad @ torso[layer]["kernel"]
        return grads

    grads = {}
    for torso_name, head, head_grad in (("actor_torso", "Dense_1", logits_grad.reshape(-1, logits_grad.shape[-1])),
                                        ("critic_torso", "Dense_0", value_grad.reshape(-1, 1))):
        activations = torso_forward(params[torso_name])
        grads[head] = {"kernel": head_grad.T @ activations[-1], "bias": head_grad.sum(0)}
        features_grad = head_grad @ params[head]["kernel"]
        grads[torso_name] = torso_backward(params[torso_name], activations, features_grad)
    return {"params": grads}


def test_a_feature_major_dense_layer_is_flax_s_dense_with_its_kernel_transposed():
    """Drawn from the same key, the kernel is nn.Dense's transposed, bit for bit; on inputs [T, B, in]
    (batch-major) and [in, T, B] (feature-major) the outputs [out, T, B] are nn.Dense's, up to the
    order of a float32 sum of 5 terms."""
    x = jax.random.normal(jax.random.key(1), (3, 4, 5))
    dense = nn.Dense(6, kernel_init=orthogonal(2.0))
    dense_params = dense.init(jax.random.key(0), x)
    for feature_axis, inputs in ((-1, x), (0, jnp.moveaxis(x, -1, 0))):
        layer = FeatureMajorDense(6, 2.0)
        params = layer.init(jax.random.key(0), inputs, feature_axis)
        assert np.array_equal(params["params"]["kernel"], dense_params["params"]["kernel"].T)
        outputs = layer.apply(params, inputs, feature_axis)
        assert outputs.shape == (6, 3, 4)
        np.testing.assert_allclose(outputs, jnp.moveaxis(dense.apply(dense_params, x), -1, 0), rtol=1e-6, atol=1e-6)


@pytest.mark.oldest
@pytest.mark.parametrize("transposed_kernel_min_macs", [networks.TRANSPOSED_KERNEL_MIN_MACS, 0])
def test_network_gradients_match_float64_backpropagation(monkeypatch, transposed_kernel_min_macs):
    """The MLP's parameter gradients against NumPy float64; observations [T, B, obs] as
    in a rollout, jitted and under the shard vmap; with the hidden layer's input gradient
    through its kernel as XLA computes it, and through the kernel transposed (as large layers take it)."""
    monkeypatch.setattr(networks, "TRANSPOSED_KERNEL_MIN_MACS", transposed_kernel_min_macs)
    network = make_actor_critic(NetworkConfig(hidden_sizes=(16, 8)), make_env("CartPole-v1").spec)
    rng = np.random.default_rng(3)
    obs = rng.normal(size=(2, 5, 3, 4)).astype(np.float32)  # [shards, T, B, obs]
    logits_grad = rng.normal(size=(2, 5, 3, 2)).astype(np.float32)
    value_grad = rng.normal(size=(2, 5, 3)).astype(np.float32)
    params = network.init(jax.random.key(0), jnp.zeros((1, 4)))

    def objective(params, obs, logits_grad, value_grad):
        dist, value = network.apply(params, obs)
        return jnp.sum(dist.logits * logits_grad) + jnp.sum(value * value_grad)

    per_shard = jax.jit(jax.vmap(jax.grad(objective), in_axes=(None, 0, 0, 0)))(params, obs, logits_grad, value_grad)
    for shard in range(2):
        expected = mlp_gradients_float64(params, obs[shard], logits_grad[shard], value_grad[shard])
        got = jax.tree.map(lambda x: np.asarray(x[shard]), per_shard)
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(got)):
            np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    # Eager and jitted-vmapped float32 add the 15 rows' products in other orders: each gradient
    # sums terms of about 1, so they may differ by ~15 float32 ulps of 1 (measured: 1.5e-7 on jax 0.7.2).
    eager = jax.grad(objective)(params, obs[0], logits_grad[0], value_grad[0])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b)[0], rtol=1e-6, atol=1e-6),
                 eager, per_shard)


def test_the_actor_torso_takes_its_own_widths_and_the_critic_hidden_sizes():
    """network.actor_hidden_sizes (Brax's default networks: a narrow policy beside a wide value MLP)."""
    spec = make_env("Pendulum-v1").spec

    def widths(config: NetworkConfig) -> dict[str, list[int]]:
        params = make_actor_critic(config, spec).init(jax.random.key(0), jnp.zeros((1, 3)))["params"]
        return {torso: [params[torso][f"Dense_{i}"]["kernel"].shape[0] for i in range(len(params[torso]))]
                for torso in ("actor_torso", "critic_torso")}

    assert widths(NetworkConfig(hidden_sizes=(16, 16, 16), actor_hidden_sizes=(4, 8))) == {
        "actor_torso": [4, 8], "critic_torso": [16, 16, 16]}
    assert widths(NetworkConfig(hidden_sizes=(16, 16, 16))) == {"actor_torso": [16, 16, 16],
                                                                "critic_torso": [16, 16, 16]}
    with pytest.raises(ConfigError, match=r"network.actor_hidden_sizes=\[4\] sizes the built-in torso"):
        make_actor_critic(NetworkConfig(actor_hidden_sizes=(4,)), spec, torso=nn.Dense(3))


# In CI each shape once and each scale the networks use at least once; every pairing under -m slow.
ORTHOGONAL_CASES = [(shape, scale) for shape in [(64, 64), (4, 64), (64, 2), (3, 3, 8, 16)]
                    for scale in [1.0, math.sqrt(2.0), 0.01]]
ORTHOGONAL_IN_CI = {((64, 64), math.sqrt(2.0)), ((4, 64), 0.01), ((64, 2), 1.0), ((3, 3, 8, 16), math.sqrt(2.0))}


@pytest.mark.parametrize("shape, scale", [
    pytest.param(shape, scale, marks=() if (shape, scale) in ORTHOGONAL_IN_CI else pytest.mark.slow)
    for shape, scale in ORTHOGONAL_CASES])
def test_orthogonal_initialiser_is_flaxs_unbatched_or_vmapped(shape, scale):
    """`networks.orthogonal` draws flax's orthogonal matrices bit for bit: called on one key,
    vmapped twice over a [2, 3] grid of keys (where it factorises one matrix at a time) and
    over a batch of one key, each entry the matrix of its own key; the matrices are
    orthogonal, times `scale`."""
    keys = jax.random.split(jax.random.key(3), 6).reshape(2, 3)
    flax_init = lambda key: nn.initializers.orthogonal(scale)(key, shape, jnp.float32)
    ours = lambda key: orthogonal(scale)(key, shape, jnp.float32)
    want = jax.jit(jax.vmap(jax.vmap(flax_init)))(keys)
    got = jax.jit(jax.vmap(jax.vmap(ours)))(keys)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ours(keys[1, 2]), want[1, 2])
    np.testing.assert_array_equal(jax.jit(jax.vmap(ours))(keys[1, 2:]), want[1, 2:])  # a batch of one
    assert not np.array_equal(got[0, 0], got[1, 2])
    columns = np.asarray(got[1, 2], np.float64).reshape(-1, shape[-1]) / scale
    small = min(columns.shape)
    gram = columns.T @ columns if columns.shape[0] >= columns.shape[1] else columns @ columns.T
    np.testing.assert_allclose(gram, np.eye(small), atol=1e-5)


def test_ppo_loss_unjitted_call():
    """A plain (eager, un-differentiated) call gives the same loss and parts."""
    params, batch_np = make_loss_problem()
    batch = Batch(**{k: jnp.asarray(v) for k, v in batch_np.items()})
    loss, info = ppo_loss(jax.tree.map(jnp.asarray, params), tabular_apply, batch, hyperparams(), True)
    ref_loss, ref_parts = loss_reference(
        params["logits"].astype(np.float64), params["values"].astype(np.float64), batch_np, True
    )
    np.testing.assert_allclose(float(loss), ref_loss, rtol=RTOL, atol=ATOL)
    for name, expected in ref_parts.items():
        np.testing.assert_allclose(float(getattr(info, name)), expected, rtol=RTOL, atol=ATOL, err_msg=name)


# --------------------------------------------------------------------------- optimizer

ADAM_B1, ADAM_B2 = 0.9, 0.999  # optax.scale_by_adam's defaults


def sample_indexed_apply(params, obs):
    """The tabular "network" again, one row per sample: obs[:, 0] is the sample's row."""
    rows = obs[:, 0].astype(jnp.int32)
    return Categorical(params["logits"][rows]), params["values"][rows]


def clipped_adam_reference(params, batch, minibatches, learning_rate, max_grad_norm, adam_eps):
    """Float64 minibatch SGD with global-norm clipping and Adam, leaf by leaf; returns the
    final parameters and each step's gradient norm before clipping."""
    params = {name: np.asarray(value, np.float64) for name, value in params.items()}
    first = {name: np.zeros_like(value) for name, value in params.items()}
    second = {name: np.zeros_like(value) for name, value in params.items()}
    norms = []
    for step, rows in enumerate(minibatches, start=1):
        minibatch = {name: np.asarray(value)[rows] for name, value in batch.items()}
        grad_logits, grad_values = grad_reference(params["logits"][rows], params["values"][rows], minibatch, True)
        grads = {"logits": np.zeros_like(params["logits"]), "values": np.zeros_like(params["values"])}
        grads["logits"][rows], grads["values"][rows] = grad_logits, grad_values
        norm = math.sqrt(sum(float(np.sum(g ** 2)) for g in grads.values()))
        norms.append(norm)
        scale = 1.0 if norm < max_grad_norm else max_grad_norm / norm
        for name, grad in grads.items():
            first[name] = ADAM_B1 * first[name] + (1 - ADAM_B1) * grad * scale
            second[name] = ADAM_B2 * second[name] + (1 - ADAM_B2) * (grad * scale) ** 2
            first_hat = first[name] / (1 - ADAM_B1 ** step)
            second_hat = second[name] / (1 - ADAM_B2 ** step)
            params[name] = params[name] - learning_rate * first_hat / (np.sqrt(second_hat) + adam_eps)
    return params, norms


@pytest.mark.parametrize("permutations", [random_permutations, sort_permutations])
def test_minibatch_steps_are_clipped_adam_over_every_parameter(permutations):
    """`run_epochs` against leaf-by-leaf float64 Adam after global-norm clipping: 2 epochs x 2 minibatches of the loss problem, some
    steps clipped and some not; in the minibatch orders of either shuffle (run.cpu_tuning off and on)."""
    params, batch_np = make_loss_problem()
    batch_np["obs"] = np.arange(8, dtype=np.float32)[:, None]
    learning_rate, max_grad_norm, adam_eps = 0.05, 0.25, 1e-5
    hp = hyperparams().replace(learning_rate=jnp.float32(learning_rate), max_grad_norm=jnp.float32(max_grad_norm),
                               adam_eps=jnp.float32(adam_eps))
    settings = UpdateSettings(
        num_steps=8, num_envs_per_shard=1, num_epochs=2, num_minibatches=2, num_shards=1, num_updates=1,
        clip_value=True, normalize_advantages=False, anneal_lr=False, recurrent=False,
        critic_after_steps=False, normalize_observations=False, scale_rewards=False,
        permutations=permutations,
    )
    key = jax.random.key(3)
    jparams = jax.tree.map(jnp.asarray, params)

    def per_device(batch):
        opt_state = optimizer_state(jparams, hp, settings)
        new_params, opt_state, info = run_epochs(jparams, opt_state, batch, key[None], sample_indexed_apply, hp, settings)
        return new_params, opt_state, info

    batch = Batch(**{name: jnp.asarray(value)[None] for name, value in batch_np.items()})
    mesh = sharding.make_mesh(jax.devices()[:1])
    member, shard = sharding.PER_MEMBER, sharding.PER_SHARD
    new_params, _, info = sharding.shard_parallel(per_device, mesh, out_layouts=(member, member, shard))(batch)
    new_params, info = global_arrays.local_copy(new_params), global_arrays.first_shard(info)

    minibatches = np.asarray(epoch_indices(key, 2, 2, 8, permutations)).reshape(4, 4)
    expected, norms = clipped_adam_reference(params, batch_np, minibatches, learning_rate, max_grad_norm, adam_eps)
    assert min(norms) < max_grad_norm < max(norms), norms  # clipped and unclipped steps both
    np.testing.assert_allclose(np.ravel(info.grad_norm), norms, rtol=1e-5)  # every step's, in order
    for name in ("logits", "values"):
        moved = np.abs(expected[name] - params[name]).max()
        assert moved > 0.05, (name, moved)  # steps large enough for a wrong update to show
        np.testing.assert_allclose(np.asarray(new_params[name]), expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


# --------------------------------------------------------------------------- segments


def test_segments_are_consecutive_steps_of_one_environment():
    """Segment k x B + b holds steps k S .. k S + S - 1 of environment b, every field alike, and
    the observation its last step reached."""
    num_steps, num_envs, length = 6, 3, 2
    step_env = (np.arange(num_steps)[:, None] * 100 + np.arange(num_envs)).astype(np.float32)  # 100 t + b
    field = jnp.asarray(step_env)
    obs = jnp.stack([field, -field], axis=-1)  # [T, B, 2]
    transitions = Transition(obs=obs, action=field, log_prob=field + 1, value=field + 2, reward=field,
                             terminated=field > 0, truncated=field > 0, final_obs=obs, next_value=field + 3)
    segments = segment_rollout(transitions, 2 * field, obs, obs + 0.5, length)
    num_segments = num_steps // length * num_envs
    for k in range(num_steps // length):
        for b in range(num_envs):
            steps = step_env[k * length:(k + 1) * length, b]
            column = k * num_envs + b
            for name, offset in (("action", 0), ("log_prob", 1), ("value", 2), ("next_value", 3)):
                np.testing.assert_array_equal(np.asarray(getattr(segments, name))[:, column], steps + offset,
                                              err_msg=name)
            np.testing.assert_array_equal(np.asarray(segments.reward)[:, column], 2 * steps)
            np.testing.assert_array_equal(np.asarray(segments.obs)[:, column], np.stack([steps, -steps], -1))
            np.testing.assert_array_equal(np.asarray(segments.last_obs)[column], [steps[-1] + 0.5, -steps[-1] + 0.5])
    assert segments.terminated.shape == (length, num_segments) and segments.terminated.dtype == jnp.bool_
    index = jnp.asarray([7, 2, 4])
    taken = take_segments(segments, index)
    for name in Segments.__dataclass_fields__:
        axis = 0 if name == "last_obs" else 1
        expected = np.take(np.asarray(getattr(segments, name)), index, axis)
        np.testing.assert_array_equal(getattr(taken, name), expected, err_msg=name)


def linear_apply(params, obs):
    """A "network" whose logits and value are linear in the observation [N, D]."""
    return Categorical(obs @ params["logits"]), obs @ params["w"] + params["b"]


@pytest.mark.parametrize("normalize,clip_value", [(True, False), (False, True)])
def test_segment_gradients_are_the_loss_gradient_with_gae_from_the_current_values(normalize, clip_value):
    """Two shards of 4 segments of 5 steps: the value pass's and the policy pass's gradients
    add up to `ppo_loss`'s gradient, averaged over the shards, on the minibatch whose
    advantages are a float64 GAE within each segment from the given parameters' values of
    the observations acted on and reached (truncations bootstrapped, terminations not; a
    truncation inside a segment from the rollout's next_value), normalised over both
    shards' 40 samples together, and whose targets add the current values."""
    num_shards, length, num_segments, obs_dim, num_actions = 2, 5, 4, 3, 3
    rng = np.random.default_rng(5)
    gae_inputs = [random_gae_inputs(seed, length + 1, num_segments) for seed in (0, 1)]
    reward, _, rollout_next_value, terminated, truncated = (np.stack(x)[:, :length] for x in zip(*gae_inputs))
    assert truncated[:, :-1].any() and truncated[:, -1].any() and terminated[:, -1].any()
    obs = rng.normal(size=(num_shards, length + 1, num_segments, obs_dim)).astype(np.float32)
    # Where an episode ends, the observation reached is not the next one acted on.
    done = (terminated | truncated)[..., None]
    final_obs = np.where(done, rng.normal(size=(num_shards, length, num_segments, obs_dim)), obs[:, 1:])
    final_obs, obs = final_obs.astype(np.float32), obs[:, :length]
    params = {"w": rng.normal(size=obs_dim).astype(np.float32), "b": np.float32(0.3),
              "logits": rng.normal(size=(obs_dim, num_actions)).astype(np.float32)}
    value = obs.astype(np.float64) @ params["w"] + params["b"]
    # Old values 0.5 off, beyond clip_eps: with clip_value, some value errors clip.
    old_value = (value + rng.choice([-0.5, 0.5], size=reward.shape)).astype(np.float32)
    segments = Segments(obs=obs, last_obs=final_obs[:, -1], action=rng.integers(0, num_actions, reward.shape),
                        log_prob=(rng.normal(size=reward.shape) - 1.0).astype(np.float32), value=old_value,
                        next_value=rollout_next_value, reward=reward, terminated=terminated, truncated=truncated)
    hp = hyperparams()
    jparams = jax.tree.map(jnp.asarray, params)
    settings = UpdateSettings(num_steps=length, num_envs_per_shard=num_segments, num_epochs=1, num_minibatches=1,
                              num_shards=num_shards, num_updates=1, clip_value=clip_value,
                              normalize_advantages=normalize, anneal_lr=False, recurrent=False,
                              critic_after_steps=False, normalize_observations=False, scale_rewards=False,
                              segment_length=length)

    def per_device(shard_segments):
        return segment_gradients(jparams, shard_segments, linear_apply, hp, settings)

    mesh = sharding.make_mesh(jax.devices()[:1])
    grads, info = sharding.shard_parallel(per_device, mesh, out_layouts=(sharding.PER_MEMBER, sharding.PER_SHARD))(
        jax.tree.map(jnp.asarray, segments))

    next_value = final_obs.astype(np.float64) @ params["w"] + params["b"]
    next_value[:, :-1] = np.where(truncated[:, :-1], rollout_next_value[:, :-1], next_value[:, :-1])
    advantage = np.stack([gae_reference(reward[i], value[i], next_value[i], terminated[i], truncated[i], 0.99, 0.95)
                          for i in range(num_shards)])
    normalized = (advantage - advantage.mean()) / (advantage.std() + 1e-8) if normalize else advantage

    def flat(x):
        return jnp.asarray(np.reshape(x, (length * num_segments,) + np.shape(x)[2:]), jnp.float32)

    batches = [Batch(obs=flat(obs[i]), action=flat(segments.action[i]).astype(jnp.int32),
                     log_prob=flat(segments.log_prob[i]), value=flat(old_value[i]), advantage=flat(normalized[i]),
                     target=flat(advantage[i] + value[i])) for i in range(num_shards)]
    expected = [jax.grad(ppo_loss, has_aux=True)(jparams, linear_apply, batch, hp, clip_value) for batch in batches]
    for name in params:
        np.testing.assert_allclose(np.asarray(grads[name]), np.mean([g[name] for g, _ in expected], 0),
                                   rtol=1e-4, atol=1e-6, err_msg=name)
    for name in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction"):
        np.testing.assert_allclose(np.asarray(getattr(info, name)), [getattr(i, name) for _, i in expected],
                                   rtol=RTOL, atol=ATOL, err_msg=name)
    norm = np.sqrt(sum(np.sum(np.square(np.asarray(leaf))) for leaf in jax.tree.leaves(grads)))
    np.testing.assert_allclose(np.asarray(info.grad_norm), [norm] * num_shards, rtol=RTOL)
    unclipped = [float(ppo_loss(jparams, linear_apply, batch, hp, False)[1].value_loss) for batch in batches]
    assert (np.asarray(info.value_loss) != unclipped).all() == clip_value  # the clipping case is exercised


# --------------------------------------------------------------------------- distributions


def test_categorical_log_prob_entropy_mode():
    rng = np.random.default_rng(7)
    logits = rng.normal(scale=2.0, size=(4, 6, 5)).astype(np.float32)  # any leading batch shape
    actions = rng.integers(0, 5, size=(4, 6)).astype(np.int32)
    dist = Categorical(jnp.asarray(logits))

    log_probs = log_softmax64(logits)
    expected_log_prob = np.take_along_axis(log_probs, actions[..., None], axis=-1)[..., 0]
    expected_entropy = -np.sum(np.exp(log_probs) * log_probs, axis=-1)

    np.testing.assert_allclose(np.asarray(dist.log_prob(jnp.asarray(actions))), expected_log_prob,
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(dist.entropy()), expected_entropy, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(dist.mode()), np.argmax(logits, axis=-1))
    # Actions stored as floats (e.g. in a generic buffer) still index correctly.
    np.testing.assert_allclose(np.asarray(dist.log_prob(jnp.asarray(actions, jnp.float32))),
                               expected_log_prob, rtol=RTOL, atol=ATOL)


def test_categorical_extreme_logits_are_finite():
    dist = Categorical(jnp.asarray([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]]))
    np.testing.assert_allclose(np.asarray(dist.entropy()), [0.0, math.log(3.0)], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(dist.log_prob(jnp.asarray([0, 2]))), [0.0, -math.log(3.0)],
                               rtol=RTOL, atol=ATOL)


def test_categorical_sample_frequencies():
    n = 20000
    logits = np.array([0.5, -1.0, 1.2, 0.0], np.float32)
    probs = np.exp(log_softmax64(logits))
    samples = np.asarray(Categorical(jnp.broadcast_to(jnp.asarray(logits), (n, 4))).sample(jax.random.key(0)))
    assert samples.shape == (n,)
    assert samples.min() >= 0 and samples.max() <= 3
    freqs = np.bincount(samples, minlength=4) / n
    standard_error = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(freqs - probs) < 5 * standard_error), (freqs, probs)


def gaussian_reference(mean, log_std, action):
    mean, action = np.asarray(mean, np.float64), np.asarray(action, np.float64)
    log_std = np.broadcast_to(np.asarray(log_std, np.float64), mean.shape)
    sigma = np.exp(log_std)
    log_prob = np.sum(-0.5 * ((action - mean) / sigma) ** 2 - log_std - 0.5 * LOG_2PI, axis=-1)
    entropy = np.sum(log_std + 0.5 * (1.0 + LOG_2PI), axis=-1)
    return log_prob, entropy


def test_diag_gaussian_log_prob_entropy_mode_with_broadcast_log_std():
    rng = np.random.default_rng(11)
    n, d = 9, 3
    mean = rng.normal(size=(n, d)).astype(np.float32)
    log_std = np.array([-1.0, 0.0, 0.7], np.float32)  # state-independent, [D]
    action = (mean + rng.normal(size=(n, d)) * 2.0).astype(np.float32)
    dist = DiagGaussian(jnp.asarray(mean), jnp.asarray(log_std))
    expected_log_prob, expected_entropy = gaussian_reference(mean, log_std, action)

    log_prob = np.asarray(dist.log_prob(jnp.asarray(action)))
    entropy = np.asarray(dist.entropy())
    assert log_prob.shape == (n,) and entropy.shape == (n,)
    np.testing.assert_allclose(log_prob, expected_log_prob, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(entropy, expected_entropy, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(dist.mode()), mean)

    # A state-dependent log_std of the full shape gives the same numbers.
    full = DiagGaussian(jnp.asarray(mean), jnp.broadcast_to(jnp.asarray(log_std), (n, d)))
    np.testing.assert_allclose(np.asarray(full.log_prob(jnp.asarray(action))), expected_log_prob,
                               rtol=RTOL, atol=ATOL)
    # And under jit.
    np.testing.assert_allclose(np.asarray(jax.jit(lambda g, a: g.log_prob(a))(dist, jnp.asarray(action))),
                               expected_log_prob, rtol=RTOL, atol=ATOL)


def test_diag_gaussian_sample_statistics():
    n = 20000
    mu = np.array([0.3, -2.0, 5.0], np.float32)
    log_std = np.array([-1.0, 0.0, 0.7], np.float32)
    sigma = np.exp(log_std.astype(np.float64))
    dist = DiagGaussian(jnp.broadcast_to(jnp.asarray(mu), (n, 3)), jnp.asarray(log_std))
    samples = np.asarray(dist.sample(jax.random.key(1)), np.float64)
    assert samples.shape == (n, 3)
    assert np.all(np.abs(samples.mean(axis=0) - mu) < 5 * sigma / np.sqrt(n))
    # Standard error of a sample std is about sigma / sqrt(2 n).
    assert np.all(np.abs(samples.std(axis=0) - sigma) < 5 * sigma / np.sqrt(2 * n))


# --------------------------------------------------------------------------- environments

CARTPOLE_X_THRESHOLD = 2.4
CARTPOLE_THETA_THRESHOLD = 12 * 2 * math.pi / 360


@functools.partial(jax.jit, static_argnums=(0, 4))
def _scan_steps(env, state, action, key, num_steps):
    """`num_steps` steps of `env` from `state` with a fixed action; per-step (StepResult, EpisodeState)."""

    def one_step(state, step_key):
        new_state, result = env.step(step_key, state, action)
        return new_state, (result, new_state)

    _, out = jax.lax.scan(one_step, state, jax.random.split(key, num_steps))
    return out


def run_steps(env, state, action_value, num_steps, seed=0):
    """Steps a batch with a constant action; a list over steps of (StepResult, EpisodeState after it)."""
    num_envs = state.episode_length.shape[0]
    action = jnp.full((num_envs,), action_value, jnp.int32)
    results, states = jax.device_get(_scan_steps(env, state, action, jax.random.key(seed), num_steps))
    take = lambda t: lambda x: x[t]
    return [(jax.tree.map(take(t), results), jax.tree.map(take(t), states)) for t in range(num_steps)]


TIME_LIMIT = 5


@pytest.fixture(scope="module")
def short_cartpole():
    """CartPole whose gymnax time limit is TIME_LIMIT steps instead of 500.

    The gymnax adapter's core keeps its params in a public attribute; this replaces them.
    Shared by the tests below so that its step is compiled once.
    """
    env = make_env("CartPole-v1")
    env.core.params = env.core.params.replace(max_steps_in_episode=TIME_LIMIT)
    return env


def test_cartpole_termination_final_obs_and_episode_stats():
    num_envs, num_steps = 8, 40
    env = make_env("CartPole-v1")
    assert env.spec.discrete and env.spec.num_actions == 2 and env.spec.obs_shape == (4,)
    obs, state = env.reset(jax.random.key(0), num_envs)
    assert obs.shape == (num_envs, 4) and obs.dtype == jnp.float32
    history = run_steps(env, state, 1, num_steps)

    counter = np.zeros(num_envs, np.int64)  # length of the running episode, by our own count
    terminations = 0
    for result, new_state in history:
        counter += 1
        terminated = np.asarray(result.terminated)
        truncated = np.asarray(result.truncated)
        done = terminated | truncated
        assert terminated.dtype == bool and truncated.dtype == bool
        assert not (terminated & truncated).any()
        assert not truncated.any()  # 40 steps is far below the 500-step limit
        final_obs = np.asarray(result.final_obs)
        next_obs = np.asarray(result.obs)
        np.testing.assert_array_equal(final_obs[~done], next_obs[~done])
        np.testing.assert_array_equal(np.asarray(result.reward), np.ones(num_envs, np.float32))
        # Where an episode ended, final_obs is past a threshold and the next obs is a fresh reset.
        if terminated.any():
            terminations += terminated.sum()
            x, theta = final_obs[terminated, 0], final_obs[terminated, 2]
            assert np.all((np.abs(x) > CARTPOLE_X_THRESHOLD) | (np.abs(theta) > CARTPOLE_THETA_THRESHOLD))
            assert np.all(np.abs(next_obs[terminated]) <= 0.05)
        # Episode stats: reward is 1 a step, so return == length == our count where it ended, 0 elsewhere.
        np.testing.assert_array_equal(np.asarray(result.episode_length), np.where(done, counter, 0))
        np.testing.assert_array_equal(np.asarray(result.episode_return), np.where(done, counter, 0.0))
        counter[done] = 0
        # The running counters restart where an episode ended.
        np.testing.assert_array_equal(np.asarray(new_state.episode_length), counter)
        np.testing.assert_array_equal(np.asarray(new_state.episode_return), counter.astype(np.float32))
    assert terminations >= num_envs  # every env fell at least once under a constant push


def test_cartpole_truncation_bootstrap_obs_and_counters(short_cartpole):
    env, limit, num_envs = short_cartpole, TIME_LIMIT, 8
    _, state = env.reset(jax.random.key(1), num_envs)
    history = run_steps(env, state, 0, 3 * limit)

    counter = np.zeros(num_envs, np.int64)
    truncations = 0
    for result, new_state in history:
        counter += 1
        terminated = np.asarray(result.terminated)
        truncated = np.asarray(result.truncated)
        # A constant push does not topple the pole within 5 steps of a reset: every end is a time limit.
        assert not terminated.any()
        np.testing.assert_array_equal(truncated, counter == limit)
        final_obs, next_obs = np.asarray(result.final_obs), np.asarray(result.obs)
        np.testing.assert_array_equal(final_obs[~truncated], next_obs[~truncated])
        if truncated.any():
            truncations += truncated.sum()
            # final_obs is the state reached (to bootstrap from), not the reset observation.
            assert np.all(np.any(final_obs[truncated] != next_obs[truncated], axis=-1))
            assert np.all(np.abs(next_obs[truncated]) <= 0.05)
            # ...and the pole has visibly moved over 5 pushed steps, out of the reset range.
            assert np.all(np.abs(final_obs[truncated, 3]) > 0.05)
        np.testing.assert_array_equal(np.asarray(result.episode_length), np.where(truncated, limit, 0))
        np.testing.assert_array_equal(np.asarray(result.episode_return), np.where(truncated, float(limit), 0.0))
        counter[truncated] = 0
        np.testing.assert_array_equal(np.asarray(new_state.episode_length), counter)
        np.testing.assert_array_equal(np.asarray(new_state.episode_return), counter.astype(np.float32))
    assert truncations == 3 * num_envs


@pytest.mark.parametrize("ratio", [1, 2, 8])
def test_optimistic_resets_share_a_few_fresh_states_among_the_finished_envs(short_cartpole, ratio):
    """Every env truncates on step TIME_LIMIT together. With ratio r, num_envs / r fresh states
    are drawn (from the first envs' reset keys) and the k-th finished env takes state k mod that;
    ratio 1 is each env's own reset. The running envs are untouched either way. The finished
    envs' states are put in place at the start of their next step (`take_pending`)."""
    num_envs = 8
    env = BatchedEnv(short_cartpole.core, optimistic_reset_ratio=ratio)
    _, state = env.reset(jax.random.key(4), num_envs)
    history = run_steps(env, state, 0, TIME_LIMIT)
    result, new_state = history[-1]
    own, _ = run_steps(short_cartpole, state, 0, TIME_LIMIT)[-1]
    assert np.asarray(result.truncated).all()
    np.testing.assert_array_equal(result.final_obs, own.final_obs)  # the steps before the reset are the same
    num_fresh = num_envs // ratio
    restarted = np.asarray(result.obs)
    for k in range(num_envs):
        np.testing.assert_array_equal(restarted[k], np.asarray(own.obs)[k % num_fresh])
    assert len(np.unique(restarted, axis=0)) == num_fresh
    np.testing.assert_array_equal(np.asarray(new_state.reset_pool.pending_slot), np.arange(num_envs) % num_fresh)
    np.testing.assert_array_equal(np.asarray(new_state.env_state.x), np.asarray(result.final_obs)[:, 0])
    pool, next_states = take_pending(new_state.reset_pool, new_state.env_state)
    np.testing.assert_array_equal(np.asarray(next_states.x), restarted[:, 0])
    assert (np.asarray(pool.pending_slot) == -1).all()
    for result_before, _ in history[:-1]:
        np.testing.assert_array_equal(result_before.obs, result_before.final_obs)


def test_optimistic_reset_ratio_below_one_is_refused():
    with pytest.raises(ConfigError, match="env.optimistic_reset_ratio=0 must be at least 1"):
        make_env("CartPole-v1", optimistic_reset_ratio=0)


def test_cartpole_termination_at_the_time_limit_is_not_truncation(short_cartpole):
    """gymnax reports truncated=True on the last allowed step even when the pole fell on it."""
    env, limit, num_envs = short_cartpole, TIME_LIMIT, 8
    _, state = env.reset(jax.random.key(2), num_envs)
    # One step before the limit; the first half of the batch is about to fall (theta 0.2 + 0.02 * 2 > 0.21).
    falls = np.arange(num_envs) < num_envs // 2
    env_state = state.env_state.replace(
        time=state.env_state.time + (limit - 1),  # (keeps gymnax's dtype: no recompilation)
        theta=jnp.where(falls, 0.2, state.env_state.theta),
        theta_dot=jnp.where(falls, 2.0, state.env_state.theta_dot),
    )
    state = state.replace(env_state=env_state, episode_length=jnp.full((num_envs,), limit - 1, jnp.int32),
                          episode_return=jnp.full((num_envs,), limit - 1, jnp.float32))
    result, new_state = run_steps(env, state, 1, 3 * limit)[0]
    np.testing.assert_array_equal(np.asarray(result.terminated), falls)
    np.testing.assert_array_equal(np.asarray(result.truncated), ~falls)
    np.testing.assert_array_equal(np.asarray(result.episode_length), np.full(num_envs, limit))
    np.testing.assert_array_equal(np.asarray(new_state.episode_length), np.zeros(num_envs))


def test_unknown_env_id_lists_valid_ids():
    with pytest.raises(ConfigError) as excinfo:
        make_env("CartPoel-v1")
    message = str(excinfo.value)
    assert "CartPoel-v1" in message
    for valid in ("CartPole-v1", "Pendulum-v1", "Acrobot-v1"):
        assert valid in message
    assert "MNISTBandit-bsuite" not in message.split("valid ids:")[-1]


def test_unsupported_env_id_says_why():
    with pytest.raises(ConfigError, match="MNIST"):
        make_env("MNISTBandit-bsuite")


def test_pendulum_actions_are_clipped_to_the_action_space():
    env = make_env("Pendulum-v1")
    assert not env.spec.discrete and env.spec.num_actions == 1
    assert env.spec.action_low == (-2.0,) and env.spec.action_high == (2.0,)
    # gymnax's Pendulum clips to params.max_torque itself; raise that so only BatchedEnv's clip
    # (from the action space) can make out-of-bounds actions equal to the bounds.
    env.core.params = env.core.params.replace(max_torque=1000.0)
    num_envs = 3
    _, state = env.reset(jax.random.key(0), num_envs)
    step = jax.jit(env.step)
    key = jax.random.key(5)

    def next_state(value):
        new_state, result = step(key, state, jnp.full((num_envs, 1), value, jnp.float32))
        return np.asarray(new_state.env_state.theta_dot), np.asarray(result.obs), np.asarray(result.reward)

    for outside, bound in ((100.0, 2.0), (-100.0, -2.0), (2.5, 2.0)):
        for got, expected in zip(next_state(outside), next_state(bound)):
            np.testing.assert_array_equal(got, expected)
    # Inside the bounds the action matters.
    assert not np.array_equal(next_state(1.0)[0], next_state(2.0)[0])
