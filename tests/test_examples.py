"""examples/: a user's own environment and torso, named by module:attribute, trained as the
example's YAML header says (`python -m jaxddppo.train` from the repository root), to the
return its header states; the bound asserted is read from the header, so the two agree."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import subprocess_env

REPO_ROOT = Path(__file__).resolve().parents[1]
CORRIDOR_YAML = REPO_ROOT / "examples" / "corridor.yaml"
RUN_TIMEOUT_S = 600


def header(path: Path) -> str:
    """The comment lines before the first key, joined."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


def stated_returns(path: Path) -> tuple[float, float]:
    """(the eval return the header says the example reached, the bound it says CI asserts)."""
    text = header(path)
    reached = re.search(r"Eval return ([0-9]+(?:\.[0-9]+)?) on seeds", text)
    bound = re.search(r"CI asserts >= ([0-9]+(?:\.[0-9]+)?)", text)
    assert reached and bound, f"{path.name}'s header states no 'Eval return X on seeds' or no 'CI asserts >= Y'"
    return float(reached.group(1)), float(bound.group(1))


def test_the_header_states_a_return_above_the_asserted_bound():
    reached, bound = stated_returns(CORRIDOR_YAML)
    assert reached > bound
    config = yaml.safe_load(CORRIDOR_YAML.read_text())
    assert config["env"]["id"] == "examples.corridor:Corridor" and config["env"]["kwargs"]
    assert config["network"]["torso"] == "examples.corridor:LayerNormMLP" and config["network"]["torso_kwargs"]


def test_the_corridor_example_trains_to_the_return_its_header_states(tmp_path):
    _, bound = stated_returns(CORRIDOR_YAML)
    run_dir = tmp_path / "corridor"
    env = subprocess_env(1)
    # `examples` is found as a user finds it: in the working directory, not through PYTHONPATH.
    env["PYTHONPATH"] = os.pathsep.join(path for path in env["PYTHONPATH"].split(os.pathsep) if path != str(REPO_ROOT))
    completed = subprocess.run(
        [sys.executable, "-m", "jaxddppo.train", "--config", "examples/corridor.yaml", f"run.dir={run_dir}",
         "run.progress=false"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_id"] == "examples.corridor:Corridor"
    assert summary["eval_return_mean"] >= bound, summary
    recorded, given = (yaml.safe_load(path.read_text()) for path in (run_dir / "config.yaml", CORRIDOR_YAML))
    assert recorded["env"]["kwargs"] == given["env"]["kwargs"]
    assert recorded["network"]["torso"] == given["network"]["torso"]
    assert recorded["network"]["torso_kwargs"] == given["network"]["torso_kwargs"]
