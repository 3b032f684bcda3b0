"""A user's own environment, named by `env.id=module:attribute` or passed to the Python API.

The object may be an environment or a class or factory that returns one (called with
`env.kwargs`). An environment is one of:
- a gymnax `Environment` (its `default_params`), or an `(env, env_params)` pair;
- an object of jaxddppo's `EnvCore` protocol (`envs/base.py`);
- a MuJoCo Playground `MjxEnv` or a Jumanji `Environment`, through the same adapters as the
  families' built-in ids.
Before anything compiles, `reset` and `step` are traced once (`jax.eval_shape`) and what they
return is checked, so that a wrong structure is one line naming `env.id`, not an error deep in
the rollout.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from jaxddppo.config.options import ConfigError
from jaxddppo.envs.base import EnvCore, EnvSpec
from jaxddppo.references import article, call_user_code

KEY = "env.id"
ACCEPTED = ("a gymnax Environment or (env, env_params) pair, a jaxddppo EnvCore, a MuJoCo Playground MjxEnv or a "
            "Jumanji Environment")


def _is_gymnax(obj: Any) -> bool:
    from gymnax.environments.environment import Environment

    return isinstance(obj, Environment)


def _instance_of(obj: Any, module_name: str, class_path: str) -> bool:
    """isinstance(obj, module_name.class_path), without importing a package the user's code did not."""
    module = sys.modules.get(module_name)
    if module is None:
        return False
    cls = module
    for part in class_path.split("."):
        cls = getattr(cls, part, None)
    return isinstance(cls, type) and isinstance(obj, cls)


def _is_env_core(obj: Any) -> bool:
    return (isinstance(getattr(obj, "spec", None), EnvSpec) and callable(getattr(obj, "reset", None))
            and callable(getattr(obj, "step", None)))


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__qualname__}"
    if isinstance(obj, jax.ShapeDtypeStruct):
        return f"an array of shape {tuple(obj.shape)}"
    return article(type(obj).__qualname__)


def _gymnax_core(env: Any, params: Any, env_id: str) -> EnvCore:
    from jaxddppo.envs.gymnax import GymnaxCore

    key = jax.random.key(0)
    reset = call_user_code(KEY, env_id, "reset_env(key, params)", jax.eval_shape, env.reset_env, key, params)
    _check_tuple(env_id, "reset_env(key, params)", reset, "(observation, state)")
    action = jax.eval_shape(env.action_space(params).sample, key)
    step = call_user_code(KEY, env_id, "step_env(key, state, action, params)", jax.eval_shape,
                          env.step_env, key, reset[1], action, params)
    _check_tuple(env_id, "step_env(key, state, action, params)", step,
                 "(observation, state, reward, done, info)")
    return GymnaxCore(env, params, env_id)


def _adapt(obj: Any, env_id: str) -> Optional[EnvCore]:
    """The EnvCore of an environment object, or None if `obj` is none of the accepted kinds."""
    if _is_env_core(obj):
        return obj
    if _is_gymnax(obj):
        return _gymnax_core(obj, obj.default_params, env_id)
    if isinstance(obj, tuple) and len(obj) == 2 and _is_gymnax(obj[0]):
        return _gymnax_core(obj[0], obj[1], env_id)
    if _instance_of(obj, "mujoco_playground", "MjxEnv"):
        from jaxddppo.envs.playground import PlaygroundCore

        return PlaygroundCore(obj, env_id)
    if _instance_of(obj, "jumanji", "Environment"):
        from jaxddppo.envs.jumanji import JumanjiCore

        return JumanjiCore(obj, env_id)
    if not isinstance(obj, type) and hasattr(obj, "spec") and callable(getattr(obj, "reset", None)):
        raise ConfigError(f"{KEY}={env_id!r}: {_describe(obj)} has reset and step, but its spec is "
                          f"{_describe(obj.spec)}, not a jaxddppo.envs.EnvSpec (the EnvCore protocol)")
    return None


def _adapt_user_object(obj: Any, env_id: str) -> Optional[EnvCore]:
    return call_user_code(KEY, env_id, "building the environment", _adapt, obj, env_id)


def make_core(env_id: str, target: Any, kwargs: Mapping[str, Any]) -> EnvCore:
    """The checked EnvCore of `target`: an environment, or a class or factory called with `kwargs`."""
    core = _adapt_user_object(target, env_id)
    if core is not None and kwargs:
        raise ConfigError(f"env.kwargs={dict(kwargs)!r} is invalid for env.id={env_id!r}: it names an environment "
                          "instance, not a class or factory to pass them to")
    if core is None:
        if not callable(target):
            raise ConfigError(f"{KEY}={env_id!r} names {_describe(target)}, which is neither {ACCEPTED} nor a class "
                              "or factory that returns one")
        name = getattr(target, "__qualname__", repr(target))
        made = call_user_code(KEY, env_id, f"{name}(**env.kwargs)", lambda: target(**kwargs), origin=target)
        core = _adapt_user_object(made, env_id)
        if core is None:
            raise ConfigError(f"{KEY}={env_id!r}: {name}(**env.kwargs) returned {_describe(made)}, which is not "
                              f"{ACCEPTED}")
    check_core(core, env_id)
    return core


def _check_tuple(env_id: str, call: str, value: Any, expected: str) -> None:
    size = expected.count(",") + 1
    if not isinstance(value, tuple) or len(value) != size:
        structure = f"a tuple of {len(value)}" if isinstance(value, tuple) else _describe(value)
        raise ConfigError(f"{KEY}={env_id!r}: {call} must return {expected}, not {structure}")


def _as_observed(obs: Any) -> Any:
    """The shapes and dtypes of `obs` as `BatchedEnv` passes them on: float32, bool kept."""
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(
        leaf.shape, jnp.bool_ if leaf.dtype == jnp.bool_ else jnp.float32), obs)


def _shapes(tree: Any) -> Any:
    return jax.tree.map(lambda leaf: (tuple(leaf.shape), str(leaf.dtype)), tree)


def _same_structure(first: Any, second: Any, compare_dtypes: bool) -> bool:
    first_leaves, first_def = jax.tree.flatten(first)
    second_leaves, second_def = jax.tree.flatten(second)
    if first_def != second_def:
        return False
    return all(a.shape == b.shape and (not compare_dtypes or a.dtype == b.dtype)
               for a, b in zip(first_leaves, second_leaves))


def check_core(core: EnvCore, env_id: str) -> None:
    """Trace `core.reset` and `core.step` once and check what they return: (observation,
    state) and (observation, state, reward [], terminated [], truncated []), the observation
    as `spec.observation` says and the state of the same structure, shapes and dtypes."""
    spec = core.spec
    if spec.num_actions < 1:
        raise ConfigError(f"{KEY}={env_id!r}: spec.num_actions={spec.num_actions} must be at least 1")
    if not spec.discrete and not (len(spec.action_low) == len(spec.action_high) == spec.num_actions):
        raise ConfigError(f"{KEY}={env_id!r}: continuous actions need spec.action_low and spec.action_high of "
                          f"{spec.num_actions} values each, not {len(spec.action_low)} and {len(spec.action_high)}")
    key = jax.random.key(0)
    reset = call_user_code(KEY, env_id, "reset(key)", jax.eval_shape, core.reset, key)
    _check_tuple(env_id, "reset(key)", reset, "(observation, state)")
    obs, state = reset
    if not _same_structure(_as_observed(obs), spec.observation, compare_dtypes=True):
        raise ConfigError(f"{KEY}={env_id!r}: spec.observation {_shapes(spec.observation)} does not describe reset's "
                          f"observations as the trainer passes them on (float32 leaves, bool for an action mask): "
                          f"{_shapes(_as_observed(obs))}")
    action = (jax.ShapeDtypeStruct((), jnp.int32) if spec.discrete
              else jax.ShapeDtypeStruct((spec.num_actions,), jnp.float32))
    step = call_user_code(KEY, env_id, "step(key, state, action)", jax.eval_shape, core.step, key, state, action)
    _check_tuple(env_id, "step(key, state, action)", step, "(observation, state, reward, terminated, truncated)")
    next_obs, next_state, *signals = step
    if not _same_structure(next_obs, obs, compare_dtypes=False):
        raise ConfigError(f"{KEY}={env_id!r}: step returns observations {_shapes(next_obs)}, reset {_shapes(obs)}: "
                          "they must have one structure and shape")
    if not _same_structure(next_state, state, compare_dtypes=True):
        raise ConfigError(f"{KEY}={env_id!r}: step returns a state {_shapes(next_state)} unlike reset's "
                          f"{_shapes(state)}: the state must keep its structure, shapes and dtypes")
    for name, value in zip(("reward", "terminated", "truncated"), signals):
        if not hasattr(value, "shape") or tuple(value.shape) != ():
            shape = tuple(value.shape) if hasattr(value, "shape") else _describe(value)
            raise ConfigError(f"{KEY}={env_id!r}: step's {name} must be a scalar (one environment), not {shape}")
