"""Environments: one protocol (`base.EnvCore`), one adapter module per family, and a
user's own environment (`user.py`).

`env.id` is `FAMILY:NAME` (`craftax:Craftax-Classic-Symbolic-v1`), a bare gymnax id
(`CartPole-v1`), or `module.path:attribute` naming the user's own environment (any prefix
that is not a family's name). A family other than gymnax is an optional extra: its adapter
module, and the family's package, are imported only when an id asks for it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from dataclasses import dataclass

from typing import Any, Mapping, Optional

from jaxddppo.config.options import ConfigError
from jaxddppo.envs.base import BatchedEnv, EnvCore, EnvSpec, EpisodeState, StepResult, batch_size, observation_spec
from jaxddppo.references import resolve

__all__ = ["BatchedEnv", "EnvCore", "EnvSpec", "EpisodeState", "StepResult", "FAMILIES", "available_env_ids",
           "batch_size", "make_core", "make_env", "observation_spec"]


@dataclass(frozen=True)
class Family:
    adapter: str  # module under jaxddppo.envs
    package: str  # the module the family's package installs
    extra: str  # pip install 'jaxddppo[extra]'


FAMILIES: dict[str, Family] = {
    "gymnax": Family(adapter="gymnax", package="gymnax", extra=""),
    "craftax": Family(adapter="craftax", package="craftax", extra="craftax"),
    "jumanji": Family(adapter="jumanji", package="jumanji", extra="jumanji"),
    "navix": Family(adapter="navix", package="navix", extra="navix"),
    "playground": Family(adapter="playground", package="mujoco_playground", extra="playground"),
    "xminigrid": Family(adapter="xminigrid", package="xminigrid", extra="xminigrid"),
}


def split_env_id(env_id: str) -> tuple[Optional[str], str]:
    """(family, name) of an `env.id`; a bare id is gymnax's, and a reference to the user's own
    environment (`module:attribute`, the module not a family's name) has family None."""
    family, separator, name = env_id.partition(":")
    if not separator:
        return "gymnax", env_id
    if family not in FAMILIES:
        return None, env_id
    return family, name


def _adapter(env_id: str):
    family_name, name = split_env_id(env_id)
    family = FAMILIES[family_name]
    if family.extra and importlib.util.find_spec(family.package) is None:
        raise ConfigError(f"env.id={env_id!r} needs the {family.extra} extra: "
                          f"pip install 'jaxddppo[{family.extra}]'")
    return importlib.import_module(f"jaxddppo.envs.{family.adapter}"), name


def available_env_ids(family: str = "gymnax") -> list[str]:
    """Every `env.id` of an installed family (bare ids for gymnax)."""
    module, _ = _adapter(f"{family}:")
    prefix = "" if family == "gymnax" else f"{family}:"
    return [prefix + name for name in module.names()]


def make_core(env_id: str, kwargs: Optional[Mapping[str, Any]] = None, given: Any = None) -> EnvCore:
    """The single environment of `env_id`: a family adapter's (ConfigError naming the valid
    ids), or the user's own (`module:attribute`, or the object `given` to the Python API, made
    with `kwargs` where it is a class or factory)."""
    kwargs = dict(kwargs or {})
    family, _ = split_env_id(env_id)
    if given is not None or family is None:
        from jaxddppo.envs import user

        prefix = env_id.partition(":")[0]
        close = difflib.get_close_matches(prefix, FAMILIES, n=1, cutoff=0.7)
        hint = ((f"; did you mean the family {close[0]!r}?" if close else "") +
                f"; env.id is FAMILY:NAME with a family of {', '.join(FAMILIES)}, or module:attribute naming your "
                "own environment")
        return user.make_core(env_id, resolve("env.id", env_id, given, "env", hint), kwargs)
    if kwargs:
        raise ConfigError(f"env.kwargs={kwargs!r} is invalid for env.id={env_id!r}: env.kwargs are passed to your own "
                          "environment's class or factory (env.id=module:attribute)")
    module, name = _adapter(env_id)
    return module.make_core(name, env_id)


def make_env(env_id: str, optimistic_reset_ratio: int = 1, start_states: str = "fresh",
             kwargs: Optional[Mapping[str, Any]] = None, given: Any = None) -> BatchedEnv:
    """The batched, auto-resetting environment for `env_id` (`make_core`'s)."""
    return BatchedEnv(make_core(env_id, kwargs, given), optimistic_reset_ratio, start_states)
