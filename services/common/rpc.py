"""Decorators for servicer methods: map domain errors to status codes, count RPCs, never leak a traceback."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from . import metrics
from .errors import ServiceError

log = structlog.get_logger()


def _method_name(fn: Callable[..., Any]) -> str:
    return fn.__qualname__.replace(".", "/")


MAX_DETAILS = 2048
SERVER_DEADLINE_S = 60.0


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, ServiceError):
        metrics.RPC_ERRORS.labels(method=method, code=exc.code.name).inc()
        # Details travel in a header (at most 16 KiB): a message quoting a huge input must not break the reply.
        message = exc.message if len(exc.message) <= MAX_DETAILS else exc.message[: MAX_DETAILS - 3] + "..."
        await context.abort(exc.code, message)
    log.error("rpc_internal_error", method=method, exc_info=exc)
    metrics.RPC_ERRORS.labels(method=method, code="INTERNAL").inc()
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")


def unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    method = _method_name(fn)

    # The metric children, looked up once (labels() on every call costs more than the count itself).
    calls, latency = metrics.RPCS.labels(method=method), metrics.RPC_LATENCY.labels(method=method)

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        calls.inc()
        start = time.perf_counter()
        try:
            # The server's own deadline: no unary call holds a handler longer than this, whatever the client set.
            # (asyncio.timeout: no task of its own per call, as wait_for would make.)
            async with asyncio.timeout(SERVER_DEADLINE_S):
                return await fn(self, request, context)
        except TimeoutError:
            metrics.RPC_ERRORS.labels(method=method, code="DEADLINE_EXCEEDED").inc()
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{method} took longer than the server's {SERVER_DEADLINE_S:g}s limit; try again",
            )
        except (ServiceError, Exception) as exc:  # mapped to a status, never re-raised raw
            if isinstance(exc, grpc.aio.AbortError) or _is_abort(exc):
                raise
            await _abort(context, method, exc)
        finally:
            latency.observe(time.perf_counter() - start)

    return wrapper


def stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    method = _method_name(fn)

    calls = metrics.RPCS.labels(method=method)

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        calls.inc()
        try:
            async for item in fn(self, request, context):
                yield item
        except (ServiceError, Exception) as exc:
            if _is_abort(exc):
                raise
            await _abort(context, method, exc)

    return wrapper


def _is_abort(exc: BaseException) -> bool:
    # grpc.aio raises AbortError out of context.abort(); it must pass through untouched.
    return type(exc).__name__ in {"AbortError", "CancelledError", "InternalError", "UsageError"} and (
        type(exc).__module__.startswith("grpc") or type(exc).__name__ == "CancelledError"
    )
