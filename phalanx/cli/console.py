"""Where a ``phalanx`` command's output, errors and scheduler connection come from: one place, so that a test can
point them elsewhere (``monkeypatch.setattr(console, "out", ...)``) for every command at once.

The command modules call these through the module (``console.emit(...)``), never import the names themselves.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from phalanx.client import Client, Job

from . import render
from .common import UsageError


def out() -> TextIO:
    """The stream a command's result goes to (standard output)."""
    return sys.stdout


def emit(text: str) -> None:
    """Write `text` and a newline (unless it ends with one) to :func:`out`, flushed."""
    stream = out()
    stream.write(text)
    if not text.endswith("\n"):
        stream.write("\n")
    stream.flush()


def error(message: str) -> None:
    """``error: <message>`` on standard error."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def client(args: argparse.Namespace) -> Client:
    """The SDK client of the global flags (--scheduler, --timeout, --token, --tls-*); a bad TLS file is a usage
    error."""
    try:
        return Client(
            args.scheduler,
            timeout=args.timeout,
            token=args.token,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except (OSError, ValueError) as exc:
        raise UsageError(f"TLS settings: {exc}") from None


def show_job(job: Job, as_json: bool) -> None:
    """One job: its JSON object, or the detail view."""
    emit(render.to_json(job.to_dict()) if as_json else render.job_detail(job))
