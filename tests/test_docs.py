"""The README documents every option and every field a run writes."""

from pathlib import Path

import pytest

from jaxddppo.config import options
from jaxddppo.outputs import METRIC_FIELDS, SUMMARY_FIELDS
from jaxddppo.sweep import SWEEP_CSV_FIELDS, SWEEP_SUMMARY_FIELDS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SWEEP_DOCS = (Path(__file__).resolve().parents[1] / "docs" / "sweeps.md").read_text()


@pytest.mark.parametrize("key", [opt.key for opt in options()])
def test_readme_documents_option(key):
    assert f"| `{key}` |" in README


@pytest.mark.parametrize("field", list(METRIC_FIELDS) + list(SUMMARY_FIELDS))
def test_readme_documents_output_field(field):
    assert f"| `{field}` |" in README


@pytest.mark.parametrize("field", list(SWEEP_CSV_FIELDS) + list(SWEEP_SUMMARY_FIELDS))
def test_sweep_docs_document_output_field(field):
    assert f"| `{field}` |" in SWEEP_DOCS
    assert "docs/sweeps.md" in README


def test_readme_opens_with_the_two_commands():
    commands = [line for line in README.splitlines() if line.startswith("python3 -m venv")]
    assert commands[0].endswith("python -m jaxddppo.train --config experiments/cartpole.yaml")
    assert commands[1].endswith("pip install -e '.[test]' && python -m pytest")
    ci_script = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert ci_script.rstrip().endswith("python -m pytest")
