"""What every ``phalanx`` subcommand module shares: exit codes, the usage error, the argument parser class and the
``--json`` flag.

It imports no other module of the CLI, so the command modules (main, jobs, observe, admin, database, cluster, demo,
place, sim) can all import it without an import cycle.
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


def add_json_flag(p: argparse.ArgumentParser) -> None:
    """``--json``: print JSON instead of a table."""
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
