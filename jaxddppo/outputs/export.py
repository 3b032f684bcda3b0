"""A trained policy as one `jax.export` program, which runs with `jax` alone (no jaxddppo, no flax).

The program is the deterministic policy (the mode of its action distribution) with the
checkpoint's parameters and observation statistics baked in, for a batch of any size:

    exported = jax.export.deserialize(open("policy.jaxexport", "rb").read())
    actions = exported.call(observations)                               # feed-forward
    carry, actions = exported.call(carry, observations, episode_start)  # recurrent

`FILE.json`, beside it, describes its inputs and outputs (docs/outputs.md).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Callable, Optional

import jax
import jax.export  # jax 0.7 imports it only when asked
import jax.numpy as jnp

from jaxddppo.envs import EnvSpec
from jaxddppo.outputs.policy import Policy, load_policy
from jaxddppo.outputs.writers import write_atomically

PLATFORMS = ("cpu", "cuda", "tpu")
BATCH_AXIS = "batch"


def deterministic_program(policy: Policy) -> Callable:
    """The function exported: `act(observations)`, or `step(carry, observations, episode_start)`
    for a recurrent policy, with the parameters and statistics as constants."""
    if policy.recurrent:
        def step(carry: Any, observations: Any, episode_start: jax.Array) -> tuple[Any, jax.Array]:
            return policy.step(policy.params, carry, observations, episode_start)

        return step

    def act(observations: Any) -> jax.Array:
        return policy.act(policy.params, observations)

    return act


def argument_specs(policy: Policy) -> tuple[Any, ...]:
    """The program's arguments with a symbolic batch axis, shared by every one of them."""
    batch, = jax.export.symbolic_shape(BATCH_AXIS)
    observations = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((batch, *leaf.shape), leaf.dtype),
                                policy.spec.observation)
    if not policy.recurrent:
        return (observations,)
    carry = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((batch, *leaf.shape[1:]), leaf.dtype),
                         jax.eval_shape(lambda: policy.initial_carry(1)))
    return carry, observations, jax.ShapeDtypeStruct((batch,), jnp.bool_)


def lowering_error(program: Callable, args: tuple[Any, ...], platform: str) -> Optional[str]:
    """Why the jitted `program` cannot be exported for `platform`, in a line; None if it can."""
    try:
        jax.export.export(program, platforms=(platform,))(*args)
    except Exception as error:  # lowering errors have no common type
        return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    return None


def export_for(program: Callable, args: tuple[Any, ...], platforms: tuple[str, ...]
               ) -> tuple[jax.export.Exported, dict[str, str]]:
    """The jitted `program` exported for `platforms`, or for those of them it lowers for (a
    user's torso may use an operation some platform lacks), and why each other one was left out."""
    try:
        return jax.export.export(program, platforms=platforms)(*args), {}
    except Exception:
        left_out = {platform: error for platform in platforms
                    if (error := lowering_error(program, args, platform)) is not None}
        if not left_out or len(left_out) == len(platforms):
            raise
    lowered = tuple(platform for platform in platforms if platform not in left_out)
    return jax.export.export(program, platforms=lowered)(*args), left_out


def describe_arrays(tree: Any, treedef: Any) -> Any:
    """A flat list of abstract arrays as `{shape, dtype}` objects in the pytree `treedef`
    (tuples as JSON lists), the batch axis named."""
    leaves = [{"shape": [dim if isinstance(dim, int) else str(dim) for dim in leaf.shape], "dtype": str(leaf.dtype)}
              for leaf in tree]
    return jax.tree.unflatten(treedef, leaves)


def action_description(spec: EnvSpec) -> dict:
    if spec.discrete:
        return {"kind": "discrete", "num_actions": spec.num_actions, "action_mask_key": spec.action_mask_key}
    return {"kind": "continuous", "dimensions": spec.num_actions, "low": list(spec.action_low),
            "high": list(spec.action_high), "note": "the mean, unclipped: the environment clips it to [low, high]"}


def description(policy: Policy, exported: jax.export.Exported, left_out: dict[str, str],
                run_dir: str, program_file: str) -> dict:
    """What FILE.json holds: how to call the program, its arrays, the action, where it came from."""
    spec = policy.spec
    (inputs, _), outputs = (describe_arrays(exported.in_avals, exported.in_tree),
                            describe_arrays(exported.out_avals, exported.out_tree))
    if policy.recurrent:
        call = "carry, actions = exported.call(carry, observations, episode_start)"
        inputs = dict(zip(("carry", "observations", "episode_start"), inputs))
        outputs = dict(zip(("carry", "actions"), outputs))
    else:
        call = "actions = exported.call(observations)"
        inputs, outputs = {"observations": inputs[0]}, {"actions": outputs}
    return {
        "program": program_file,
        "call": call,
        "batch_axis": BATCH_AXIS,
        "platforms": list(exported.platforms),
        "platforms_left_out": left_out,
        "inputs": inputs,
        "outputs": outputs,
        "observation_structure": str(jax.tree.structure(spec.observation)),
        "action": action_description(spec),
        "recurrent": policy.config.network.recurrent or None,
        "env_id": spec.env_id,
        "run_dir": os.path.abspath(run_dir),
        "checkpoint_update": policy.counters.update,
        "env_steps": policy.counters.env_steps,
        "jax_version": jax.__version__,
    }


def description_path(output: str) -> str:
    """Where the description of the program in `output` goes: beside it, `output + ".json"`."""
    return f"{output}.json"


def export_policy(run_dir: str, output: str, step: Optional[int] = None,
                  report: Callable[[str], None] = warnings.warn, *, env: Any = None,
                  torso: Any = None) -> tuple[str, str]:
    """Export the deterministic policy of `run_dir`'s newest intact checkpoint (or of checkpoint
    `step`) to `output`, described in `output + ".json"`; returns both paths.

    Raises what `load_policy` raises, and OSError when `output` cannot be written. Skipped
    checkpoints and platforms left out go to `report`; `env` and `torso` as for `load_policy`.
    """
    policy = load_policy(run_dir, step, report, env=env, torso=torso)
    exported, left_out = export_for(jax.jit(deterministic_program(policy)), argument_specs(policy), PLATFORMS)
    for platform, reason in left_out.items():
        report(f"not exported for {platform}: {reason}")
    info = description(policy, exported, left_out, run_dir, os.path.basename(output))
    write_atomically(output, exported.serialize())
    write_atomically(description_path(output), (json.dumps(info, indent=2) + "\n").encode())
    return output, description_path(output)
