"""structlog set-up: JSON lines on stderr when not on a terminal, a readable console renderer when on one."""

from __future__ import annotations

import logging
import os
import sys

import structlog
from structlog.typing import Processor


def configure_logging(service: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog for a process, once, and return a logger bound to `service`.

    Everything goes to standard error, so standard output carries only a command's result.
    """
    level_name = (level or os.environ.get("PHALANX_LOG_LEVEL", "INFO")).upper()
    numeric = getattr(logging, level_name, logging.INFO)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if sys.stderr.isatty():
        renderer: list[Processor] = [structlog.dev.ConsoleRenderer()]
    else:
        renderer = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
    # structlog.get_logger is typed Any (the logger class depends on the configuration); the caller gets it as the
    # BoundLogger interface, as this function has always declared.
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(service=service)
    return logger
