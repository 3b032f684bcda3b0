"""Both notebooks in experiments/ execute top to bottom (on a tiny budget, in a scratch directory);
their Colab install cell keeps a runtime's JAX that pyproject.toml's range admits."""

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("name, steps", [
    ("quickstart.ipynb", 4096),
    pytest.param("sweep.ipynb", 1024, marks=pytest.mark.slow),  # about 60 s; test_sweep.py covers its API
])
def test_notebook_executes(tmp_path, monkeypatch, name, steps):
    # The kernel inherits this environment: the simulated CPU devices of conftest.py, and the budget.
    monkeypatch.setenv("JAXDDPPO_NOTEBOOK_STEPS", str(steps))
    notebook = nbformat.read(EXPERIMENTS / name, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    if name == "sweep.ipynb":
        assert any("image/png" in output.get("data", {}) for output in outputs), "the sweep's plot is not shown"
    assert (tmp_path / "runs").is_dir() and os.listdir(tmp_path / "runs")


def install_cell(name: str) -> str:
    notebook = nbformat.read(EXPERIMENTS / name, as_version=4)
    return next(cell.source for cell in notebook.cells if cell.cell_type == "code")


def test_the_install_cell_keeps_a_runtime_s_jax_in_range_and_installs_one_otherwise():
    source = install_cell("quickstart.ipynb")
    assert install_cell("sweep.ipynb") == source
    assert "google.colab" not in sys.modules  # so running the cell installs nothing
    cell = {}
    exec(compile(source, "install cell", "exec"), cell)
    pyproject = (EXPERIMENTS.parent / "pyproject.toml").read_text()
    assert f'"jax{cell["JAX_REQUIREMENT"]}"' in pyproject, "the cell's JAX range is not pyproject.toml's"
    arguments, source_url = cell["pip_arguments"], cell["JAXDDPPO_SOURCE"]
    for version in ("0.7.2", "0.10.2", "0.11.2"):
        for accelerator in ("tpu", "gpu", "cpu"):  # a runtime's JAX in range stays, plugins and all
            assert arguments(version, version, accelerator) == [source_url, f"jax=={version}", f"jaxlib=={version}"]
    assert arguments("0.6.2", "0.6.2", "gpu") == [source_url, f"jax[cuda12]{cell['JAX_REQUIREMENT']}"]
    assert arguments("0.12.0.1", "0.12.0", "tpu") == [source_url, f"jax[tpu]{cell['JAX_REQUIREMENT']}"]
    assert arguments(None, None, "cpu") == [source_url, f"jax{cell['JAX_REQUIREMENT']}"]
