"""The documents: the README's opening commands and size, the option reference generated from
the config, every output field documented, short experiment headers, no broken relative links."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxddppo.config.files import load_config
from jaxddppo.config.reference import REFERENCE_COMMAND, reference_markdown
from jaxddppo.outputs.writers import METRIC_FIELDS, SUMMARY_FIELDS
from jaxddppo.sweep import SWEEP_CSV_FIELDS, SWEEP_SUMMARY_FIELDS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
OUTPUT_DOCS = (ROOT / "docs" / "outputs.md").read_text()
SWEEP_DOCS = (ROOT / "docs" / "sweeps.md").read_text()
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))


def test_configuration_reference_is_generated_from_the_config():
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == reference_markdown() + "\n", f"docs/configuration.md is out of date; run: {REFERENCE_COMMAND}"
    assert "docs/configuration.md" in README


def test_configuration_reference_command_prints_the_reference():
    command = REFERENCE_COMMAND.split(" > ")[0].replace("python", sys.executable, 1)
    printed = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert printed == reference_markdown() + "\n"


@pytest.mark.parametrize("field", list(METRIC_FIELDS) + list(SUMMARY_FIELDS))
def test_output_docs_document_field(field):
    assert f"| `{field}` |" in OUTPUT_DOCS
    assert "docs/outputs.md" in README


@pytest.mark.parametrize("field", list(SWEEP_CSV_FIELDS) + list(SWEEP_SUMMARY_FIELDS))
def test_sweep_docs_document_output_field(field):
    assert f"| `{field}` |" in SWEEP_DOCS
    assert "docs/sweeps.md" in README


def test_readme_opens_with_the_two_commands():
    commands = [line for line in README.splitlines() if line.startswith("python3 -m venv")]
    assert commands[0].endswith("python -m jaxddppo.train --config experiments/cartpole.yaml")
    assert commands[1].endswith("pip install -e '.[test]' && python -m pytest")
    # CI runs the README's test command as it is, right after making a fresh environment of the test extra.
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    function = ci_lines[ci_lines.index("test_environment() {"):]
    assert "python -m pip install --quiet --no-compile -e '.[test]'" in function[:function.index("}")]
    assert ci_lines[ci_lines.index("python -m pytest") - 1].startswith("test_environment ")


def test_readme_is_at_most_15_kb():
    size = len(README.encode())
    assert size <= 15_000, f"README.md is {size} bytes; move reference material into docs/"


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda path: path.name)
def test_experiment_header_is_at_most_three_comment_lines(path):
    header = []
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            break
        header.append(line)
    comments = [line for line in header if line.startswith("#")]
    assert 1 <= len(comments) <= 3, f"{path.name}: {len(comments)} comment lines before the first key"


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda path: path.name)
def test_experiment_config_loads(path):
    assert load_config(str(path)).env.id


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown text (outside code blocks)."""
    anchors, in_code = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = re.match(r"#{1,6} (.+)", line)
        if heading and not in_code:
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings(document):
    broken = []
    for target in _LINK.findall(document.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        linked = (document.parent / path) if path else document
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text())):
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)} has broken links: {broken}"
