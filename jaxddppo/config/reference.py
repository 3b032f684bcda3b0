"""Every option as a dotted key with its type, default and help: `--help` and
docs/configuration.md, both from the dataclasses in `config/options.py`."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from jaxddppo.config.options import RESUMABLE_KEYS, Config


@dataclass(frozen=True)
class OptionInfo:
    key: str
    type_name: str
    default: Any
    help: str
    choices: Optional[tuple[str, ...]] = None
    reference: bool = False  # besides the choices, module:attribute naming the user's code


def _type_name(annotation: Any) -> str:
    name = re.sub(r"tuple\[(\w+), \.\.\.\]", r"list[\1]", str(annotation).replace("typing.", ""))
    if name.startswith("Optional[") and name.endswith("]"):
        return name[len("Optional["):-1] + " or null"
    return name


def options(config_type: type = Config, prefix: str = "") -> list[OptionInfo]:
    """Every leaf option as a dotted key, with its type, default and help."""
    result = []
    defaults = config_type()
    for fld in dataclasses.fields(config_type):
        value = getattr(defaults, fld.name)
        if dataclasses.is_dataclass(value):
            result.extend(options(type(value), f"{prefix}{fld.name}."))
        else:
            result.append(OptionInfo(f"{prefix}{fld.name}", _type_name(fld.type), value, _help(fld.metadata),
                                     fld.metadata["choices"], fld.metadata["reference"]))
    return result


def _help(metadata: Mapping[str, Any]) -> str:
    if metadata["traced_bounds"] is None:
        return metadata["help"]
    low, high = metadata["traced_bounds"]
    return f"{metadata['help']} (traced: a sweep may vary it; PBT keeps it in [{low:g}, {high:g}])"


def help_text() -> str:
    """One line per option: key, type, default and meaning."""
    lines = []
    for opt in options():
        default = "all devices" if opt.key == "train.num_shards" else opt.default
        if isinstance(default, tuple):
            default = "[" + ",".join(str(v) for v in default) + "]"
        lines.append(f"  {opt.key} ({opt.type_name}, default {default}): {opt.help}")
    return "\n".join(lines)


def _markdown_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


REFERENCE_COMMAND = 'python -c "import jaxddppo.config.reference as c; print(c.reference_markdown())" > docs/configuration.md'


def reference_markdown() -> str:
    """The option reference, docs/configuration.md: one table per section, from the fields' help."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from jaxddppo/config/options.py by jaxddppo/config/reference.py; do not edit. Regenerate with: {REFERENCE_COMMAND} -->",
        "",
        "Options are set in a YAML file of sections (as in `experiments/*.yaml`), on the command line "
        "as `section.key=value` after `--config FILE`, or in Python with `jaxddppo.from_dict` and "
        "`jaxddppo.with_overrides`. Every value is checked before anything compiles; a bad one is one line "
        "on stderr and exit code 2. `python -m jaxddppo.train --help` prints the same list.",
        "",
        f"`--resume RUN_DIR` may change only {', '.join(f'`{key}`' for key in RESUMABLE_KEYS)}: "
        "anything else would change the algorithm mid-run.",
    ]
    for section in dataclasses.fields(Config):
        section_type = type(getattr(Config(), section.name))
        lines += ["", f"## {section.name}", "", section_type.__doc__, "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for opt in options(section_type, f"{section.name}."):
            type_name = opt.type_name
            if opt.choices:
                type_name = "one of " + ", ".join(f"`{choice}`" for choice in opt.choices)
                type_name += ", or null" if opt.type_name.endswith(" or null") else ""
                type_name += ", or `module:attribute`" if opt.reference else ""
            meaning = opt.help.replace("|", "\\|")
            lines.append(f"| `{opt.key}` | {type_name} | `{_markdown_value(opt.default)}` | {meaning} |")
    return "\n".join(lines)


