"""structlog set-up: JSON lines on stderr when not on a terminal, a readable console renderer when on one."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog for a process, once, and return a logger bound to `service`.

    Everything goes to standard error, so standard output carries only a command's result.
    """
    level_name = (level or os.environ.get("PHALANX_LOG_LEVEL", "INFO")).upper()
    numeric = getattr(logging, level_name, logging.INFO)
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if sys.stderr.isatty():
        renderer: list = [structlog.dev.ConsoleRenderer()]
    else:
        renderer = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
    return structlog.get_logger(service=service)
