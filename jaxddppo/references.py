"""A user's own code named in a config: `module.path:attribute` references (gymnasium's
entry-point form), the objects the Python API takes in their place, and one-line errors
for whatever goes wrong in them; a user's torso, checked and called as its contract says.

A reference is imported as Python imports a module (the working directory first, then
`PYTHONPATH` and the installed packages): a config that names one runs that code when it
is loaded. An object passed to the API (`jaxddppo.run(config, env=...)`) is recorded in
config.yaml by its reference where it has one, else as `<object>:NAME`, which only the same
object, passed again, can stand for.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxddppo.config.options import Config, ConfigError, NetworkConfig

# The module part of an object's `env.id` / `network.torso` when it has no importable reference.
OBJECT_PREFIX = "<object>"


@dataclass(frozen=True)
class UserObjects:
    """Objects passed to the Python API in place of `env.id` and `network.torso` references."""

    env: Any = None
    torso: Any = None


def _library_directories() -> tuple[str, ...]:
    """Where code that is not the user's lives: the standard library, the installed packages
    and jaxddppo itself (an editable install is outside site-packages)."""
    paths = sysconfig.get_paths()
    directories = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    directories.add(str(Path(__file__).resolve().parent))
    return tuple(os.path.realpath(directory) + os.sep for directory in directories)


def _definition(obj: Any) -> Optional[str]:
    """`file:line` where `obj` (a function or class of the user's) is defined, if Python knows."""
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError):
        return None


def user_code_location(error: BaseException, origin: Any = None) -> Optional[str]:
    """`file:line` of the innermost frame of `error`'s traceback in the user's code (outside
    the standard library, the installed packages and jaxddppo); else, where the user's
    `origin` (the function or class that was called) is defined; else None."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    libraries = _library_directories()
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not os.path.realpath(frame.filename).startswith(libraries) and not frame.filename.startswith("<frozen"):
            return f"{frame.filename}:{frame.lineno}"
    return None if origin is None else _definition(origin)


def describe_error(error: BaseException, origin: Any = None) -> str:
    """An exception raised in the user's code as one line: type, message and where."""
    message = " ".join(str(error).split())
    if len(message) > 300:
        message = message[:297] + "..."
    location = user_code_location(error, origin)
    return f"{type(error).__name__}{': ' + message if message else ''}" + (f" (at {location})" if location else "")


def call_user_code(key: str, value: str, what: str, function: Callable[..., Any], *args: Any,
                   origin: Any = None) -> Any:
    """`function(*args)`, with an exception it raises as a ConfigError naming `key`,
    `value`, `what` was being done and where in the user's code it failed (`origin`: the
    user's function or class called, whose definition is named when no frame of the
    traceback is the user's, as for a keyword argument it does not take)."""
    try:
        return function(*args)
    except ConfigError:
        raise
    except (Exception, SystemExit) as error:  # any failure of the user's code becomes one line
        raise ConfigError(f"{key}={value!r}: {what} raised {describe_error(error, origin)}") from None


def article(noun: str) -> str:
    """`noun` with its indefinite article."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _getattr(key: str, value: str, target: Any, part: str, module_name: str) -> Any:
    try:
        return getattr(target, part)
    except AttributeError:
        raise ConfigError(f"{key}={value!r}: {getattr(target, '__name__', module_name)} has no attribute "
                          f"{part!r}") from None
    except (Exception, SystemExit) as error:  # a module's __getattr__ or a property of the user's
        raise ConfigError(f"{key}={value!r}: reading {part} raised {describe_error(error)}") from None


def import_reference(key: str, value: str, hint: str = "") -> Any:
    """The object `value` (`module.path:attribute`, the attribute possibly dotted) names, or a
    ConfigError naming `key`, `value` and what is wrong; `hint` is added to the message of a
    module that cannot be found."""
    module_name, _, attribute = value.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{key}={value!r} is not a reference of the form module.path:attribute")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` and a notebook import: the working directory first
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name == error.name or module_name.startswith(f"{error.name}.")):
            raise ConfigError(f"{key}={value!r}: no module named {error.name!r} (searched the working directory, "
                              f"PYTHONPATH and the installed packages){hint}") from None
        raise ConfigError(f"{key}={value!r}: importing {module_name} raised {describe_error(error)}") from None
    except (Exception, SystemExit) as error:  # the module's own code failed (SyntaxError included)
        raise ConfigError(f"{key}={value!r}: importing {module_name} raised {describe_error(error)}") from None
    target = module
    for part in attribute.split("."):
        target = _getattr(key, value, target, part, module_name)
    return target


def reference_of(obj: Any) -> Optional[str]:
    """`module:qualified.name` if importing it gives `obj` back (a class or function defined at
    the top of an importable module), else None (an instance, a lambda, a notebook's object)."""
    module_name, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module_name or not name or module_name == "__main__" or "<" in name:
        return None
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__file__", None) is None:
        return None
    target = module
    for part in name.split("."):
        target = getattr(target, part, None)
    return f"{module_name}:{name}" if target is obj else None


def config_value_of(obj: Any) -> str:
    """What config.yaml records for an object passed to the API: its reference, or an `<object>:` marker."""
    from jaxddppo.envs import FAMILIES  # envs imports this module

    reference = reference_of(obj)
    if reference is not None and reference.partition(":")[0] not in FAMILIES:  # `navix:X` would name the family
        return reference
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{OBJECT_PREFIX}:{name.replace('<', '').replace('>', '')}"


def resolve(key: str, value: str, given: Any, argument: str, hint: str = "") -> Any:
    """The object behind `key=value`: `given` (an object passed as the API's `argument`) if
    any, else the imported reference; an `<object>:` marker without `given` is a ConfigError
    that says to pass the object again."""
    if given is not None:
        return given
    if value.startswith(f"{OBJECT_PREFIX}:"):
        raise ConfigError(
            f"{key}={value!r} was an object passed to the Python API, with no importable reference: pass the same "
            f"object again as {argument}=... (jaxddppo.run, run_sweep, load_policy), or name it by module:attribute"
        )
    return import_reference(key, value, hint)


def is_factory(obj: Any) -> bool:
    """Whether `obj` is a class or function to call with keyword arguments, not an instance."""
    return isinstance(obj, (type, functools.partial)) or inspect.isroutine(obj)


def with_objects(config: Config, env: Any = None, torso: Any = None) -> tuple[Config, UserObjects]:
    """`config` with `env.id` and `network.torso` recording the objects given to the Python API
    (`config_value_of`), and the objects to build the experiment with. An instance takes no
    keyword arguments: the config's `env.kwargs` (`network.torso_kwargs`) are dropped for it,
    as when a run from a config with them is loaded with the instance they made."""
    if env is not None:
        config = replace(config, env=replace(config.env, id=config_value_of(env),
                                             kwargs=config.env.kwargs if is_factory(env) else {}))
    if torso is not None:
        config = replace(config, network=replace(
            config.network, torso=config_value_of(torso),
            torso_kwargs=config.network.torso_kwargs if is_factory(torso) else {}))
    return config, UserObjects(env, torso)


def _torso_name(target: Any) -> str:
    return getattr(target, "__qualname__", None) or type(target).__qualname__


def make_user_torso(config: NetworkConfig, observations: Any, given: Any = None) -> nn.Module:
    """The user's torso (`network.torso=module:attribute`, or the module or factory `given` to the
    Python API) as an unbound flax module, checked on a batch of 2 `observations` (the shapes and
    dtypes of their leaves, without the action mask): ConfigError unless it initialises and
    returns features [2, F] of a float dtype and keeps only parameters."""
    key, value = "network.torso", config.torso
    target = resolve(key, value, given, "torso")
    kwargs = dict(config.torso_kwargs)
    if isinstance(target, nn.Module):
        if kwargs:
            raise ConfigError(f"network.torso_kwargs={kwargs!r} is invalid for {key}={value!r}: it names a module "
                              "instance, not a class or factory to pass them to")
        torso = target
    elif callable(target):
        torso = call_user_code(key, value, f"{_torso_name(target)}(**network.torso_kwargs)", lambda: target(**kwargs),
                               origin=target)
        if not isinstance(torso, nn.Module):
            raise ConfigError(f"{key}={value!r}: {_torso_name(target)}(**network.torso_kwargs) returned "
                              f"{article(type(torso).__qualname__)}, not a flax linen Module")
    else:
        raise ConfigError(f"{key}={value!r} names {article(type(target).__qualname__)}, neither a flax linen Module "
                          "nor a class or factory that returns one")
    batch = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((2, *leaf.shape), leaf.dtype), observations)
    features, variables = call_user_code(key, value, "calling the torso on a batch of observations", jax.eval_shape,
                                         lambda obs: torso.init_with_output(jax.random.key(0), obs), batch)
    if set(variables) - {"params"}:
        raise ConfigError(f"{key}={value!r}: the torso keeps variables other than parameters "
                          f"({', '.join(sorted(set(variables) - {'params'}))}), which the trainer does not update")
    shape = getattr(features, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != 2 or not jnp.issubdtype(features.dtype, jnp.floating):
        got = f"{tuple(shape)} {features.dtype}" if shape is not None else article(type(features).__qualname__)
        raise ConfigError(f"{key}={value!r}: the torso must return float features [batch, F]; on a batch of 2 "
                          f"observations it returned {got}")
    return torso


def user_torso_features(torso: nn.Module, observations: Any, observation_rank: int) -> jax.Array:
    """A user's torso on observations of any leading batch shape [..., *leaf shape]: called on
    one batch axis [N, ...], as its contract says, its features [N, F] returned as [..., F]."""
    first = jax.tree.leaves(observations)[0]
    batch_shape = first.shape[:first.ndim - observation_rank]
    flat = jax.tree.map(lambda leaf: leaf.reshape((-1,) + leaf.shape[len(batch_shape):]), observations)
    features = torso(flat)
    return features.reshape(batch_shape + features.shape[1:])
