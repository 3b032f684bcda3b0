"""What every command line of the package shares (standard library only, so it imports fast)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit code 2 (argparse's own adds the usage)."""

    def error(self, message: str) -> None:
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def add_start_arguments(parser: argparse.ArgumentParser, resume_help: str, stop_help: str) -> None:
    """What the train and sweep commands share: where the run comes from (`--config FILE` or
    `--resume RUN_DIR`, not both) and `--stop-after-updates N`; `parse_start_arguments` checks N."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help="YAML config file, e.g. experiments/cartpole.yaml")
    source.add_argument("--resume", metavar="RUN_DIR", help=resume_help)
    parser.add_argument("--stop-after-updates", type=int, metavar="N", help=stop_help)


def parse_start_arguments(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """`argv` parsed (options and section.key=value items in any order), `--stop-after-updates` at least 1."""
    args = parser.parse_intermixed_args(argv)
    if args.stop_after_updates is not None and args.stop_after_updates < 1:
        parser.error(f"--stop-after-updates={args.stop_after_updates} must be at least 1")
    return args
