"""Both notebooks in experiments/ execute top to bottom (on a tiny budget, in a scratch directory)."""

import os
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
