"""jaxddppo is a library imported into other people's programs: importing it, training
and sweeping leave JAX and the process as they were, and the package uses public JAX only.
"""

import ast
import json
import re
import subprocess
import sys

from conftest import REPO_ROOT, subprocess_env

SCRIPT = r"""
import gc, importlib, json, os, pkgutil, sys
import jax
# The dependencies' own import-time effects are theirs (gymnasium, under gymnax, sets
# PYGAME_HIDE_SUPPORT_PROMPT): import them before the first snapshot.
import flax, gymnax, matplotlib, omegaconf, optax, orbax.checkpoint, tensorboardX, tqdm

gc.disable() if sys.argv[2] == "off" else gc.enable()
thresholds = gc.get_threshold()
CONFIG_KEYS = ("jax_num_cpu_devices", "jax_default_prng_impl", "jax_enable_x64", "jax_threefry_partitionable")


def lowered_text():
    def program(key):
        keys = jax.random.split(jax.random.fold_in(key, 3), 4)
        return jax.random.permutation(keys[0], 16), jax.random.normal(keys[1], (3,)), jax.random.categorical(
            keys[2], jax.numpy.zeros((5, 2)))
    return jax.jit(program).lower(jax.random.key(0)).as_text()


def snapshot():
    return {"text": lowered_text(), "environ": dict(os.environ), "gc": [gc.isenabled(), gc.get_threshold()],
            "config": {key: getattr(jax.config, key) for key in CONFIG_KEYS}}


before = snapshot()
import jaxddppo
modules = [importlib.import_module(info.name) for info in pkgutil.walk_packages(jaxddppo.__path__, "jaxddppo.")]
after_import = snapshot()
small = {"env": {"num_envs": 4}, "ppo": {"num_steps": 8, "num_epochs": 1, "num_minibatches": 2},
         "train": {"total_env_steps": 64}, "eval": {"num_episodes": 2}, "run": {"progress": False}}
# a run with the collector on, a sweep with it off: each path meets each state once in CI time
if sys.argv[2] == "on":
    jaxddppo.run({**small, "run": {**small["run"], "dir": os.path.join(sys.argv[1], "run")}})
else:
    jaxddppo.run_sweep({**small, "run": {**small["run"], "dir": os.path.join(sys.argv[1], "sweep")}}, seeds=2)
after_training = snapshot()
print("RESULT " + json.dumps({
    "before": before, "after_import": after_import, "after_training": after_training,
    "module_types": sorted({type(module).__name__ for module in modules + [jaxddppo]}),
    "num_modules": len(modules),
}))
"""


def run_script(tmp_path, collector: str) -> dict:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), collector], capture_output=True,
                            text=True, env=subprocess_env(1), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_importing_and_training_change_nothing_in_jax_or_the_process(tmp_path):
    """A program using jax.random lowers to the same text before `import jaxddppo`, after
    importing every module, and after a run (or a sweep); the environment variables, the
    garbage collector (on, or switched off by the caller) and JAX's configuration are as
    they were, and every module is a plain module."""
    for collector in ("on", "off"):
        state = run_script(tmp_path / collector, collector)
        before = state["before"]
        assert before["gc"][0] == (collector == "on")
        assert state["num_modules"] > 10
        assert state["module_types"] == ["module"]
        for later in ("after_import", "after_training"):
            for aspect in ("text", "environ", "gc", "config"):
                assert state[later][aspect] == before[aspect], (later, aspect)
        assert "threefry" in before["text"] or "while" in before["text"]  # JAX's own lowering was compared


PRIVATE_JAX = re.compile(r"jax\._src|jax\.interpreters|jax\.extend|register_lowering|primitive_batchers"
                         r"|__class__\s*=|gc\.disable|gc\.enable")


def test_the_package_uses_public_jax_only_and_registers_nothing():
    offending = [f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
                 for path in sorted((REPO_ROOT / "jaxddppo").rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), start=1)
                 if PRIVATE_JAX.search(line)]
    assert offending == []


IMPORTS_SCRIPT = r"""
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(name for name in sys.modules if name.startswith("jaxddppo"))))
"""


def imported_modules(module: str) -> set[str]:
    """The package's modules that importing `module` in a fresh process imports."""
    result = subprocess.run([sys.executable, "-c", IMPORTS_SCRIPT, module], cwd=REPO_ROOT, env=subprocess_env(1),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_one_update_is_read_in_five_modules_and_a_policy_imports_no_trainer():
    """The update needs the design's four modules and the environments' base, besides the
    options and `references` (one-line errors in user code), and none of them is long."""
    algorithm = {"jaxddppo.ppo", "jaxddppo.rollout", "jaxddppo.networks", "jaxddppo.sharding", "jaxddppo.envs.base"}
    imported = imported_modules("jaxddppo.ppo")
    assert {name for name in imported if not name.startswith("jaxddppo.config")} == algorithm | {
        "jaxddppo", "jaxddppo.envs", "jaxddppo.references"}, imported
    for module in algorithm:
        path = REPO_ROOT / (module.replace(".", "/") + ".py")
        assert len(path.read_text().splitlines()) <= 470, path
    trainer = {"jaxddppo.training.loop", "jaxddppo.train", "jaxddppo.sweep", "jaxddppo.outputs.run_dir"}
    start_up = {"jaxddppo.distributed.multiprocess", "jaxddppo.training.experiment", "jaxddppo.training.population"}
    assert not imported_modules("jaxddppo.training.eval_episodes") & (start_up | trainer)
    assert not imported_modules("jaxddppo.export") & (start_up | trainer)  # the export imports the policy
    imported = imported_modules("jaxddppo.evaluate")
    assert "jaxddppo.training.experiment" in imported and not imported & trainer, imported


# The algorithm (design: the update, the rollout, the networks, the shard semantics and the
# environments, with the modules they are built from) imports only itself and the options; the
# options import nothing else of the package; what runs the algorithm (the subpackages) imports
# no command. Lazy imports inside functions count.
ALGORITHM = {"ppo", "rollout", "networks", "sharding", "references", "envs"}
COMMANDS = {"train", "sweep", "evaluate", "export", "plot", "launch", "cli"}
MACHINERY = {"training", "outputs", "cpu", "distributed"}


def package_imports() -> dict[str, set[str]]:
    """Each module of the package (dotted, without `jaxddppo.`) and the package's modules it
    imports, at the top or inside a function."""
    imports = {}
    for path in sorted((REPO_ROOT / "jaxddppo").rglob("*.py")):
        parts = path.relative_to(REPO_ROOT / "jaxddppo").with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "jaxddppo":
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxddppo."):
                names.add(node.module.removeprefix("jaxddppo."))
            elif isinstance(node, ast.Import):
                names.update(alias.name.removeprefix("jaxddppo.") for alias in node.names
                             if alias.name.startswith("jaxddppo."))
        imports[module] = names
    return imports


def test_the_algorithm_imports_no_machinery_and_the_machinery_no_command():
    imports = package_imports()
    assert {"ppo", "rollout", "networks", "sharding", "training.loop", "config.options"} <= set(imports)
    wrong = []
    for module, imported in imports.items():
        top = module.split(".")[0]
        for name in imported:
            target = name.split(".")[0]
            if top == "config" and target != "config":
                wrong.append(f"the options import {name} ({module})")
            elif top in ALGORITHM and target not in ALGORITHM | {"config"}:
                wrong.append(f"the algorithm imports {name} ({module})")
            elif top in MACHINERY and target in COMMANDS:
                wrong.append(f"{module} imports the command module {name}")
    assert wrong == []
