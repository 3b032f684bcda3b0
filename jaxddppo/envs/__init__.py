"""Environments: one protocol (`base.EnvCore`), one adapter module per family.

`env.id` is `FAMILY:NAME` (`craftax:Craftax-Classic-Symbolic-v1`), or a bare gymnax
id (`CartPole-v1`). A family other than gymnax is an optional extra: its adapter
module, and the family's package, are imported only when an id asks for it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from jaxddppo.config import ConfigError
from jaxddppo.envs.base import BatchedEnv, EnvCore, EnvSpec, EpisodeState, StepResult, batch_size

__all__ = ["BatchedEnv", "EnvCore", "EnvSpec", "EpisodeState", "StepResult", "FAMILIES", "available_env_ids",
           "batch_size", "make_core", "make_env"]


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


def split_env_id(env_id: str) -> tuple[str, str]:
    """(family, name) of an `env.id`; a bare id is gymnax's."""
    family, separator, name = env_id.partition(":")
    if not separator:
        return "gymnax", env_id
    if family not in FAMILIES:
        raise ConfigError(f"env.id={env_id!r}: unknown environment family {family!r}; "
                          f"families: {', '.join(FAMILIES)}")
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


def make_core(env_id: str) -> EnvCore:
    """The family adapter's single environment for `env_id`, or ConfigError naming the valid ids."""
    module, name = _adapter(env_id)
    return module.make_core(name, env_id)


def make_env(env_id: str, optimistic_reset_ratio: int = 1, start_states: str = "fresh") -> BatchedEnv:
    """The batched, auto-resetting environment for `env_id`."""
    return BatchedEnv(make_core(env_id), optimistic_reset_ratio, start_states)
