"""Export a trained policy: `python -m jaxddppo.export RUN_DIR --output FILE [--checkpoint STEP]`.

Writes the deterministic policy of the newest intact checkpoint (or of `--checkpoint STEP`),
observation normalisation included, as a serialized `jax.export` program that runs with
`jax` alone, and `FILE.json` beside it describing its inputs and outputs (docs/outputs.md).
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from jaxddppo.cli import OneLineParser
from jaxddppo.config.options import ConfigError
from jaxddppo.outputs.export import PLATFORMS, export_policy
from jaxddppo.training.checkpoint import CheckpointError


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(prog="python -m jaxddppo.export",
                           description="Export the deterministic policy of a run's checkpoint as a jax.export "
                           f"program for {', '.join(PLATFORMS)} (those it lowers for), and FILE.json describing it.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by python -m jaxddppo.train")
    parser.add_argument("--output", required=True, metavar="FILE", help="where to write the program")
    parser.add_argument("--checkpoint", type=int, metavar="STEP", help="checkpoint to export (default: the newest)")
    args = parser.parse_args(argv)
    directory = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(directory):
        parser.error(f"--output={args.output}: directory {directory} does not exist")
    try:
        program, description = export_policy(args.run_dir, args.output, args.checkpoint,
                                             report=lambda message: print(message, file=sys.stderr))
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: cannot write {args.output}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(f"wrote {program} and {description}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
