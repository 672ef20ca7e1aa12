"""What every ``phalanx`` subcommand module shares: exit codes, the usage error and the argument parser class.

The subcommand modules (main, cluster, sim, place) import this one and never each other's, so the command line has
no import cycle.
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A command line that parses but cannot be honoured; exits with code 2."""


class Parser(argparse.ArgumentParser):
    """argparse that prints ``error: ...`` in the CLI's format (still exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {message}\n")
