"""The compiled programs of a population of members (a single run being a population of
one): `build` and `assemble` go from a config to an `Experiment` (topology, environment,
network, update settings, mesh), whose entry points `compile_programs` compiles: the
initialisation, the chunk of updates and the evaluations. Loading a trained policy
needs this module, not the training loop.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.flatten_util import ravel_pytree

from jaxddppo import sharding
from jaxddppo.config.options import Config, ConfigError
from jaxddppo.cpu import tuning as cpu_tuning
from jaxddppo.distributed import global_arrays
from jaxddppo.distributed.topology import Topology, make_topology
from jaxddppo.envs import BatchedEnv, make_env
from jaxddppo.networks import ActorCritic, make_actor_critic
from jaxddppo.ppo import (
    PPOHyperparams,
    TrainState,
    UpdateMetrics,
    UpdateSettings,
    init_train_state,
    make_update,
)
from jaxddppo.references import UserObjects
from jaxddppo.training import pbt
from jaxddppo.training.eval_episodes import EvalResult, EvalStats, evaluate_on_shards, evaluate_policy_program


def run_updates(update: Callable[[TrainState, Any], tuple[TrainState, UpdateMetrics]], hyperparams: Any,
                state: TrainState, num_updates: jax.Array, capacity: int) -> tuple[TrainState, UpdateMetrics]:
    """`num_updates` successive updates (a traced count, 1 to `capacity`) and their metrics,
    stacked [capacity] with zeros after the last one.

    The count is an argument, not the length of a scan, so that one compiled program runs
    every chunk of a run: the last, shorter chunk and the chunks cut short by checkpoints
    need no program of their own. The loop computes what a scan of the same updates
    computes, bit for bit (tests/test_sharding.py).
    """
    update = jax.jit(update, inline=True)  # traced once, for the metrics' shapes and for the loop

    def one_update(index: jax.Array, carry: tuple[TrainState, UpdateMetrics]) -> tuple[TrainState, UpdateMetrics]:
        state, stacked = carry
        state, metrics = update(state, hyperparams)
        return state, jax.tree.map(lambda column, value: column.at[index].set(value), stacked, metrics)

    shapes = jax.eval_shape(update, state, hyperparams)[1]
    stacked = jax.tree.map(lambda shape: jnp.zeros((capacity, *shape.shape), shape.dtype), shapes)
    return jax.lax.fori_loop(0, num_updates, one_update, (state, stacked))


def update_count(mesh: jax.sharding.Mesh, num_updates: int) -> jax.Array:
    """The `num_updates` argument of `run_updates`, replicated on every device of `mesh`."""
    return global_arrays.shared_array(mesh, np.int32(num_updates))


def abstract_update_count(mesh: jax.sharding.Mesh) -> jax.ShapeDtypeStruct:
    """The shape, dtype and placement of `update_count(mesh, ...)`, for lowering."""
    return jax.ShapeDtypeStruct((), np.int32, sharding=global_arrays.replicated_sharding(mesh))


@dataclass(frozen=True)
class Member:
    """One member of a population: a grid point and a seed. A single run is the only
    member of its population."""

    index: int
    setting: int
    seed: int
    values: dict[str, Any]  # swept key -> value, as typed in the config (empty for a single run)
    config: Config  # the single run this member is equivalent to


@struct.dataclass
class ShardInputs:
    """The programs' traced inputs: each shard's global index within its member (per shard),
    and each member's seed and hyperparameters (per member; `layout`). They are arguments,
    not constants of the programs, so that one compiled program serves every seed and every
    hyperparameter (and JAX's persistent compilation cache serves a run with other ones)."""

    shard_index: jax.Array
    seed: jax.Array
    hyperparams: PPOHyperparams

    @classmethod
    def layout(cls) -> ShardInputs:
        return sharding.field_layouts(cls, ("shard_index",))


@dataclass(frozen=True)
class Experiment:
    """Everything static about a population of members, and its compiled-on-demand entry
    points. A single run is a population of one on a mesh without a member axis; a sweep's
    mesh has one (`sharding.make_population_mesh`)."""

    config: Config  # the base config, train.num_shards resolved
    members: tuple[Member, ...]
    topology: Topology  # of one member
    mesh: jax.sharding.Mesh
    env: BatchedEnv
    network: ActorCritic
    settings: UpdateSettings
    pbt: Optional[pbt.PBTSettings] = None  # population-based training, if pbt.every_updates asks for it

    @property
    def is_sweep(self) -> bool:
        """A sweep's outputs name the member of every metrics row, even a population of one."""
        return sharding.is_population(self.mesh)

    @property
    def batch_members(self) -> bool:
        return self.config.train.batch_members

    @property
    def state_layout(self) -> TrainState:
        return (TrainState if self.pbt is None else pbt.PBTTrainState).layout()

    def init_fn(self) -> Callable[[ShardInputs], TrainState]:
        """`(shard_inputs) -> TrainState`: the initial global state, placed as `state_layout` says."""
        pbt_key = jax.random.fold_in(jax.random.key(self.config.train.seed), 4)

        def init(shard: ShardInputs) -> TrainState:
            state = init_train_state(shard.shard_index, shard.seed, self.env, self.network, shard.hyperparams,
                                     self.settings)
            if self.pbt is None:
                return state
            return pbt.PBTTrainState(**vars(state), pbt=pbt.init_pbt_state(shard.hyperparams, pbt_key))

        # The shards' initial states are keys and elementwise draws, which batching leaves alone
        # (tests/test_sharding.py compares them on 1, 2 and 4 devices).
        return sharding.shard_parallel(init, self.mesh, batch_members=self.batch_members,
                                       in_layouts=(ShardInputs.layout(),), out_layouts=self.state_layout)

    def shard_inputs(self) -> ShardInputs:
        hyperparams = [PPOHyperparams.from_config(member.config.ppo) for member in self.members]
        return global_arrays.put_members(ShardInputs(
            shard_index=np.tile(np.arange(self.topology.num_shards, dtype=np.int32), (len(self.members), 1)),
            seed=np.array([member.seed for member in self.members], np.int32),
            hyperparams=jax.tree.map(lambda *leaves: np.stack(leaves), *hyperparams),
        ), self.mesh, ShardInputs.layout())

    def init_state(self) -> TrainState:
        """The global training state, placed on the mesh."""
        return self.init_fn()(self.shard_inputs())

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of `init_state()`, computing nothing (a restore target)."""
        shapes = jax.eval_shape(self.init_fn(), self.shard_inputs())
        return jax.tree.map(lambda leaf, placement: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placement),
                            shapes, sharding.leaf_placements(self.state_layout, shapes, self.mesh))

    def learn_fn(self) -> Callable[[TrainState, ShardInputs, jax.Array], tuple[TrainState, UpdateMetrics, jax.Array]]:
        """`(state, shard_inputs, num_updates)`: up to `updates_per_chunk` updates of every
        member in one jitted call, as many as `num_updates` says (`update_count(mesh, n)`).
        Returns the new state, the metrics (per member, leaves [..., updates_per_chunk], see
        `run_updates`) and whether every parameter is finite afterwards (a bool per member,
        checked in the same program to spare the host loop a call)."""
        update = make_update(self.env, self.network, self.settings)
        capacity = self.topology.updates_per_chunk

        def learn(state: TrainState, shard: ShardInputs, num_updates: jax.Array
                  ) -> tuple[TrainState, UpdateMetrics, jax.Array]:
            hyperparams = shard.hyperparams if self.pbt is None else state.pbt.hyperparams
            state, metrics = run_updates(update, hyperparams, state, num_updates, capacity)
            if self.pbt is not None:
                state = state.replace(pbt=pbt.accumulate(state.pbt, metrics.episode_return_mean,
                                                         metrics.episodes_completed))
            return state, metrics, all_finite(state.params)

        layouts = dict(in_layouts=(self.state_layout, ShardInputs.layout(), None),
                       out_layouts=(self.state_layout, sharding.PER_MEMBER, sharding.PER_MEMBER))
        if self.pbt is None:
            return sharding.shard_parallel(learn, self.mesh, donate_argnums=(0,), shared_argnums=(2,),
                                          batch_members=self.batch_members, **layouts)
        learn_members = sharding.over_leading_axis(learn, (2,), batched=self.batch_members)

        def learn_and_exploit(state: TrainState, shard: ShardInputs, num_updates: jax.Array
                              ) -> tuple[TrainState, UpdateMetrics, jax.Array]:
            state, metrics, finite = learn_members(state, shard, num_updates)
            state = jax.lax.cond(self.pbt.due(state.update_index[0]), lambda state: self._exploit(state, shard),
                                 lambda state: state, state)
            return state, metrics, finite

        return sharding.shard_parallel(learn_and_exploit, self.mesh, donate_argnums=(0,), shared_argnums=(2,),
                                      over_members=False, **layouts)

    def _exploit(self, state: TrainState, shard: ShardInputs) -> TrainState:
        """PBT's step on a device's members (leaves [members_per_device, ...])."""
        update_index = state.update_index[0]
        if self.pbt.fitness == "eval_return":
            evaluate = sharding.over_leading_axis(self._evaluate, (), batched=self.batch_members)
            fitness = evaluate(state.params, state.obs_moments, state.update_index, shard).return_mean
        else:
            fitness = jax.vmap(pbt.interval_fitness)(state.pbt)
        carried = (state.params, state.opt_state, state.obs_moments, state.return_moments)
        carried, pbt_state = pbt.exploit(self.pbt, carried, state.pbt, fitness, update_index)
        params, opt_state, obs_moments, return_moments = carried
        return state.replace(params=params, opt_state=opt_state, obs_moments=obs_moments,
                             return_moments=return_moments, pbt=pbt_state)

    def eval_fn(self) -> Callable[[Any, Any, jax.Array, ShardInputs], EvalStats]:
        """`(params, obs_moments, update_index, shard_inputs) -> EvalStats`, per member but the inputs.

        The evaluation after update `u` uses the same episode keys whatever the shard count.
        """
        member = sharding.PER_MEMBER
        return sharding.shard_parallel(self._evaluate, self.mesh, batch_members=self.batch_members,
                                       in_layouts=(member, member, member, ShardInputs.layout()), out_layouts=member)

    def _evaluate(self, params: Any, obs_moments: Any, update_index: jax.Array, shard: ShardInputs) -> EvalStats:
        """`eval_fn` on one member's shards of a device."""
        eval_root = jax.random.fold_in(jax.random.key(shard.seed), 3)
        return evaluate_on_shards(
            self.env, self.network, params, jax.random.fold_in(eval_root, update_index), shard.shard_index,
            self.config.eval.num_episodes, self.topology.num_shards, self.settings.shards, obs_moments,
        )

    def final_evaluations(self, state: TrainState, program: Optional[Callable[..., EvalResult]] = None
                          ) -> list[EvalResult]:
        """Every member's final deterministic evaluation, on the host, one member after another
        with one compiled program (`jaxddppo.evaluate` reproduces it): `program`
        (`Programs.final_evaluate`), else compiled now."""
        params, obs_moments = global_arrays.member_values((state.params, state.obs_moments), self.mesh)
        evaluate = program if program is not None else self.lower_final_evaluation(state).compile()
        return [
            evaluate(jax.tree.map(lambda leaf: leaf[member.index], params), final_eval_key(member.config),
                     jax.tree.map(lambda leaf: leaf[member.index], obs_moments))
            for member in self.members
        ]

    def lower_final_evaluation(self, state: TrainState) -> jax.stages.Lowered:
        """`final_evaluations`' program, lowered from the shapes of `state` (its leaves, or
        their shapes and dtypes) for one member on this process's default device."""
        member_axes = 1 if sharding.is_population(self.mesh) else 0

        def one_member(leaf: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(leaf.shape[member_axes:], leaf.dtype)

        params, obs_moments = jax.tree.map(one_member, (state.params, state.obs_moments))
        key = jax.eval_shape(lambda: final_eval_key(self.config))
        return evaluate_policy_program.lower(
            self.env, self.network, params, key, self.config.eval.num_episodes, obs_moments)


def assemble(config: Config, members: Sequence[Member], mesh: jax.sharding.Mesh,
             topology: Topology, objects: UserObjects = UserObjects()) -> Experiment:
    """The experiment of `members` (whose configs differ from `config` in seed and
    hyperparameters at most) on `mesh`; compiles nothing. The experiment's config has
    `run.cpu_tuning` resolved for the mesh's devices. `objects`: the environment and torso
    given to the Python API in place of `env.id` and `network.torso`, if any."""
    config = cpu_tuning.resolve(config, mesh.devices.flat[0].platform)
    pbt_settings = population_training(config, members, topology) if sharding.is_population(mesh) else None
    env = make_env(config.env.id, config.env.optimistic_reset_ratio, config.env.start_states, config.env.kwargs,
                   objects.env)
    return Experiment(
        config=config,
        members=tuple(members),
        topology=topology,
        mesh=mesh,
        env=env,
        network=make_actor_critic(config.network, env.spec, objects.torso),
        settings=update_settings(config, topology),
        pbt=pbt_settings,
    )


def update_settings(config: Config, topology: Topology) -> UpdateSettings:
    """The update's static choices and one shard's sizes; with the CPU switch on, its shuffle."""
    ppo = config.ppo
    return UpdateSettings(
        num_steps=ppo.num_steps,
        num_envs_per_shard=topology.num_envs_per_shard,
        num_epochs=ppo.num_epochs,
        num_minibatches=ppo.num_minibatches,
        num_shards=topology.num_shards,
        num_updates=topology.num_updates,
        clip_value=ppo.clip_value,
        normalize_advantages=ppo.normalize_advantages,
        anneal_lr=ppo.anneal_lr,
        recurrent=config.network.recurrent is not None,
        critic_after_steps=config.network.recurrent is None and not config.network.shared_torso,
        normalize_observations=config.env.normalize_observations,
        scale_rewards=config.env.scale_rewards,
        segment_length=config.ppo.segment_length,
        permutations=cpu_tuning.sort_permutations if cpu_tuning.is_on(config) else sharding.random_permutations,
        exact_reductions=config.train.exact_reductions,
    )


def population_training(config: Config, members: Sequence[Member], topology: Topology
                        ) -> Optional[pbt.PBTSettings]:
    """The population's PBT settings, None with pbt.every_updates 0; ConfigError for a
    population of one."""
    every = config.pbt.every_updates
    if not every:
        return None
    if len(members) < 2:
        raise ConfigError(f"pbt.every_updates={every} needs a population of at least 2 members to rank, this "
                          f"sweep has {len(members)}; add seeds (--seeds) or grid values")
    member_hyperparams = [{name: float(getattr(member.config.ppo, name))
                           for name in PPOHyperparams.__dataclass_fields__} for member in members]
    return pbt.PBTSettings.from_config(config.pbt, member_hyperparams, list(members[0].values),
                                       topology.num_updates)


def build(config: Config, devices: Optional[Sequence[jax.Device]] = None,
          objects: UserObjects = UserObjects()) -> Experiment:
    """A single run: a population of one on a mesh over `devices` (default: every device
    of every process). Validates everything that needs the environment and the devices;
    compiles nothing. The experiment's config has train.num_shards resolved."""
    if config.pbt.every_updates:
        raise ConfigError(f"pbt.every_updates={config.pbt.every_updates} is for a sweep's population: a run trains "
                          "one member; use python -m jaxddppo.sweep with a grid or --seeds")
    mesh = sharding.make_mesh(devices)
    topology = make_topology(config, num_devices=mesh.devices.size)
    config = replace(config, train=replace(config.train, num_shards=topology.num_shards))
    member = Member(index=0, setting=0, seed=config.train.seed, values={}, config=config)
    return assemble(config, [member], mesh, topology, objects)


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every leaf of `tree` is finite: a bool scalar.

    One test over the leaves laid end to end: tested leaf by leaf, the check compiled into
    one or two kernels per parameter shape (10 kernels more in the CartPole chunk)."""
    return jnp.all(jnp.isfinite(ravel_pytree(tree)[0]))


@dataclass(frozen=True)
class Programs:
    """Everything a population executes, compiled, and their traced inputs: the
    initialisation, the chunk of updates (`Experiment.learn_fn`, one program for chunks of
    every length), and those compiled while the first updates run: the checksums of a
    checkpoint's digest, the periodic evaluation (None when `eval.every_updates` is 0) and
    the final evaluation."""

    inputs: ShardInputs
    init: Callable[[ShardInputs], TrainState]
    learn: Callable[[TrainState, ShardInputs, jax.Array], tuple[TrainState, UpdateMetrics, jax.Array]]
    evaluate: Optional[Callable[[Any, Any, jax.Array, ShardInputs], EvalStats]]
    checksum: Callable[..., tuple[jax.Array, jax.Array]]  # a checkpoint's digest (`global_arrays.state_checksums`)
    final_evaluate: Optional[Callable[..., EvalResult]]  # `Experiment.final_evaluations`' program, if asked for

    def evaluate_after(self, state: TrainState, updates_done: int, every_updates: int,
                       mesh: jax.sharding.Mesh) -> Optional[EvalStats]:
        """Every member's current policy evaluated if `updates_done` is on the cadence: host
        statistics, leaves [num_members], or None. A collective over all shards: every
        process calls it after the same chunks."""
        if self.evaluate is None or updates_done % every_updates:
            return None
        stats = self.evaluate(state.params, state.obs_moments, state.update_index, self.inputs)
        return global_arrays.member_values(stats, mesh)


@dataclass(frozen=True)
class CompilingProgram:
    """A program being compiled in a background thread: a call waits for it, and raises
    what its lowering or compilation raised."""

    future: Future

    def __call__(self, *args: Any) -> Any:
        return self.future.result()(*args)


def learn_compiler_options(experiment: Experiment) -> dict[str, Any]:
    """The compiler options of the training chunk (and of the programs that run as often):
    `cpu_tuning.compiler_options` with `run.cpu_tuning` on, none otherwise."""
    platform = experiment.mesh.devices.flat[0].platform
    return cpu_tuning.compiler_options(platform, runs_once=False) if cpu_tuning.is_on(experiment.config) else {}


def compile_programs(experiment: Experiment, final_evaluation: bool = False) -> Programs:
    """The initialisation, the chunk of updates, the checkpoints' checksums and, if asked,
    the periodic evaluation and the final one, lowered from the initialisation's output
    shapes alone (nothing runs before the first update's programs are compiled).

    What the first update needs, the longest first: the calling thread lowers each, and
    each compiles in a thread of its own as soon as it is lowered (XLA compiles without
    holding Python's GIL, so the next lowering runs beside it; lowerings in threads of their
    own would take turns at the GIL, slower). Once they are compiled, one background thread
    lowers and compiles the checksums, the periodic evaluation, then the final evaluation,
    while the training starts: none is needed before the first checkpoint, the first
    evaluation or the end. The final evaluation's compile took 7 of the 26 s before the
    first update on a MinAtar game; CheetahRun's periodic evaluation traced its physics
    step for 26 s and compiled for 28.

    With `run.cpu_tuning` on, `cpu_tuning.compiler_options` apply (to the initialisation,
    `init_compiler_options`), except to the final evaluation, compiled as `jaxddppo.evaluate`
    compiles it, on the calling thread's `jax.default_device`."""
    inputs = experiment.shard_inputs()
    traced_init = experiment.init_fn().trace(inputs)
    state = traced_init.out_info
    platform = experiment.mesh.devices.flat[0].platform

    # name: (lowering, compiler options)
    first = {"learn": (lambda: experiment.learn_fn().lower(state, inputs, abstract_update_count(experiment.mesh)),
                       learn_compiler_options(experiment))}
    init_options = cpu_tuning.init_compiler_options(platform, traced_init.jaxpr) \
        if cpu_tuning.is_on(experiment.config) else {}
    first["init"] = (traced_init.lower, init_options)
    with ThreadPoolExecutor(max_workers=len(first)) as pool:
        futures = {name: pool.submit(lower().compile, options) for name, (lower, options) in first.items()}
        compiled = {name: future.result() for name, future in futures.items()}

    checksum = global_arrays.checksum_program(experiment.mesh)
    later = {"checksum": (lambda: checksum.lower(*global_arrays.by_layout(state)), learn_compiler_options(experiment))}
    if experiment.config.eval.every_updates:
        later["evaluate"] = (lambda: experiment.eval_fn().lower(
            state.params, state.obs_moments, state.update_index, inputs
        ), learn_compiler_options(experiment))
    if final_evaluation:
        later["final_evaluate"] = (lambda: experiment.lower_final_evaluation(state), {})
    default_device = jax.config.jax_default_device  # a per-thread setting: the background thread's is unset

    def lower_and_compile(lower: Callable[[], jax.stages.Lowered], options: dict) -> jax.stages.Compiled:
        with jax.default_device(default_device):
            return lower().compile(options)

    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxddppo-compile")
    deferred = {name: CompilingProgram(background.submit(lower_and_compile, lower, options))
                for name, (lower, options) in later.items()}
    background.shutdown(wait=False)
    return Programs(inputs=inputs, init=compiled["init"], learn=compiled["learn"], evaluate=deferred.get("evaluate"),
                    checksum=deferred["checksum"], final_evaluate=deferred.get("final_evaluate"))


def final_eval_key(config: Config) -> jax.Array:
    """The key of the final evaluation (`jaxddppo.evaluate` uses it too, to reproduce it)."""
    return jax.random.fold_in(jax.random.key(config.train.seed), 2)
