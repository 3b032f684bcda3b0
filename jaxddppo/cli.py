"""What every command line of the package shares (standard library only, so it imports fast)."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit code 2 (argparse's own adds the usage)."""

    def error(self, message: str) -> None:
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
