"""A trained policy, loaded from a run directory for use in notebooks and scripts.

    policy = jaxddppo.load_policy("runs/CartPole-v1-20261122-101500")
    action = policy(obs)                                   # the policy's mode
    action = policy(obs, key, deterministic=False)         # a sample
    act = jax.jit(policy.act, static_argnames="deterministic")
    action = act(policy.params, obs, key)                  # pure: jit, vmap, grad
    carry, action = policy.step(policy.params, carry, obs, episode_start)   # recurrent policies

The network is rebuilt from config.yaml and env_spec.json: loading builds no environment;
`policy.env` builds it when first used (evaluating episodes).
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax

from jaxddppo import sharding
from jaxddppo.config.files import SWEEP_SPEC_FILE, load_resume_config
from jaxddppo.config.options import Config, ConfigError
from jaxddppo.distributed import global_arrays
from jaxddppo.envs import BatchedEnv, EnvSpec, make_env
from jaxddppo.networks import ActorCritic, make_actor_critic
from jaxddppo.outputs.env_spec import ENV_SPEC_FILE, read_env_spec
from jaxddppo.ppo import TrainState
from jaxddppo.references import UserObjects, with_objects
from jaxddppo.rollout import RunningMoments, init_observation_moments, policy_step
from jaxddppo.training.checkpoint import Checkpointer, RunCounters


@dataclass(frozen=True)
class Policy:
    """The actor of one checkpoint: its parameters, the run's observation statistics, and pure functions.

    Feed-forward policies: `act(params, obs, key, deterministic)`, or `policy(obs)`.
    Recurrent ones carry a hidden state: `step(params, carry, obs, episode_start, ...)`
    from `initial_carry(batch_size)`. Observations are normalised as in training.
    """

    config: Config
    spec: EnvSpec  # the run's environment's observations and actions (env_spec.json)
    network: ActorCritic
    params: Any
    obs_moments: Optional[RunningMoments]  # the run's observation statistics, if it normalised
    counters: RunCounters  # the checkpoint's update, env steps, training time
    objects: UserObjects = UserObjects()  # the environment and torso objects given to `load_policy`

    @functools.cached_property
    def env(self) -> BatchedEnv:
        """The run's environment, built when first used: evaluating episodes needs it, acting does not."""
        env = self.config.env
        return make_env(env.id, env.optimistic_reset_ratio, env.start_states, env.kwargs, self.objects.env)

    @property
    def recurrent(self) -> bool:
        return bool(self.network.recurrent)

    def initial_carry(self, batch_size: int) -> Any:
        """The hidden state before a first observation (None for a feed-forward policy)."""
        return self.network.initial_carry(batch_size)

    def step(self, params: Any, carry: Any, obs: Any, episode_start: Optional[jax.Array] = None,
             key: Optional[jax.Array] = None, deterministic: bool = True) -> tuple[Any, jax.Array]:
        """(carry, actions) for a batch of raw observations (leaves [N, ...], as the environment gives them).

        `episode_start` [N] marks observations that begin an episode (the carry is reset
        there); recurrent policies need it, feed-forward ones ignore it.
        """
        if self.recurrent and episode_start is None:
            raise ValueError("a recurrent policy needs episode_start [N] (True where an episode begins)")
        carry, dist, _ = policy_step(self.network, params, self.obs_moments, carry, obs, episode_start)
        if deterministic:
            return carry, dist.mode()
        if key is None:
            raise ValueError("a stochastic action (deterministic=False) needs a key")
        return carry, dist.sample(key)

    def act(self, params: Any, obs: Any, key: Optional[jax.Array] = None,
            deterministic: bool = True) -> jax.Array:
        """Actions of a feed-forward policy for a batch of observations: the mode, or a sample drawn with `key`."""
        if self.recurrent:
            raise ValueError(f"network.recurrent={self.network.recurrent}: use policy.step with a carry")
        return self.step(params, None, obs, None, key, deterministic)[1]

    @functools.cached_property
    def _jitted_act(self) -> Callable:
        return jax.jit(self.act, static_argnames="deterministic")

    def __call__(self, obs: Any, key: Optional[jax.Array] = None, deterministic: bool = True) -> jax.Array:
        return self._jitted_act(self.params, obs, key, deterministic)


def _on_one_device(saved: Any) -> Any:
    """A single run's state as saved (`Checkpointer.saved_shapes`), placed on this process's
    first device as `TrainState.layout` says: what a checkpoint restores into without the
    environment that made its rollout."""
    mesh, layout = sharding.make_mesh(jax.local_devices()[:1]), TrainState.layout()
    layouts = {name: getattr(layout, name) for name in saved}
    return jax.tree.map(lambda leaf, placement: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placement),
                        saved, sharding.leaf_placements(layouts, saved, mesh))


def _as_the_network_needs(restored: dict, wanted: Any, source: str) -> Any:
    """The tree of `wanted` (shapes and dtypes) holding the `restored` arrays of the same
    names; ConfigError (one line) naming the first that is missing, extra or shaped otherwise."""
    found, needed = global_arrays.named_leaves(restored), global_arrays.named_leaves(wanted)

    def described(leaf: Any) -> str:
        return "missing" if leaf is None else f"{leaf.dtype}[{', '.join(str(size) for size in leaf.shape)}]"

    for name in sorted(found.keys() | needed.keys()):
        got, want = described(found.get(name)), described(needed.get(name))
        if got != want:
            raise ConfigError(f"checkpoint {source} does not fit the network that config.yaml and {ENV_SPEC_FILE} "
                              f"describe: {name} is {got} there, {want} in the network")
    return jax.tree.unflatten(jax.tree.structure(wanted), [found[name] for name in needed])


def load_policy(run_dir: str, step: Optional[int] = None,
                report: Callable[[str], None] = warnings.warn, *, env: Any = None, torso: Any = None) -> Policy:
    """The policy of `run_dir`'s newest intact checkpoint (or of checkpoint `step`).

    Builds the network from config.yaml and env_spec.json, and no environment (unless the
    run recorded no env_spec.json: see `outputs.env_spec`). Works on any number of devices:
    the run's state is restored onto one local device. Raises ConfigError or
    CheckpointError (one-line messages) for a bad directory or a damaged `step`; unreadable
    or damaged newer checkpoints that were skipped are passed to `report`. A run trained
    on a torso object without an importable reference needs the same `torso` again; on an
    environment object, the same `env` for `policy.env` (evaluating episodes).
    """
    if os.path.exists(os.path.join(run_dir, SWEEP_SPEC_FILE)):
        raise ConfigError(f"{run_dir} is a sweep's run directory ({SWEEP_SPEC_FILE}), not a single run's")
    config, objects = with_objects(load_resume_config(run_dir), env, torso)
    spec = read_env_spec(run_dir)
    if spec is None:
        spec = make_env(config.env.id, kwargs=config.env.kwargs, given=objects.env).spec
    network = make_actor_critic(config.network, spec, objects.torso)
    checkpointer = Checkpointer(run_dir, read_only=True)
    try:
        if step is None:
            state, counters = checkpointer.restore_latest(_on_one_device, report)
        else:
            state, counters = checkpointer.restore(step, _on_one_device)
    finally:
        checkpointer.close()
    observation = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((1, *leaf.shape), leaf.dtype), spec.observation)
    wanted = jax.eval_shape(lambda obs: {
        "params": network.init(jax.random.key(0), obs),
        "obs_moments": init_observation_moments(spec.observation) if config.env.normalize_observations else None,
    }, observation)
    arrays = _as_the_network_needs({"params": state["params"], "obs_moments": state["obs_moments"]}, wanted,
                                   checkpointer.path(counters.update))
    return Policy(config=config, spec=spec, network=network, params=global_arrays.local_copy(arrays["params"]),
                  obs_moments=global_arrays.local_copy(arrays["obs_moments"]), counters=counters, objects=objects)
