"""Exceptions raised by the Phalanx SDK.

Every error the SDK raises derives from :class:`PhalanxError`::

    PhalanxError                      anything the SDK raises
    └── RPCError                      the scheduler answered with a non-OK gRPC status (.code, .code_name, .message)
        ├── InvalidArgumentError      INVALID_ARGUMENT: the request is malformed (e.g. zero replicas)
        ├── NotFoundError             NOT_FOUND: no such job
        ├── FailedPreconditionError   FAILED_PRECONDITION: not possible in the current state
        ├── PermissionDeniedError     PERMISSION_DENIED
        ├── UnauthenticatedError      UNAUTHENTICATED
        ├── ResourceExhaustedError    RESOURCE_EXHAUSTED: e.g. a message over the size limit
        ├── DeadlineExceededError     DEADLINE_EXCEEDED: the call (or a wait) ran out of time
        └── UnavailableError          UNAVAILABLE: the scheduler cannot be reached (after retries)

Status codes without a dedicated subclass (INTERNAL, ABORTED, ...) are raised as a plain :class:`RPCError`.
"""

from __future__ import annotations

import grpc

__all__ = [
    "PhalanxError",
    "RPCError",
    "InvalidArgumentError",
    "NotFoundError",
    "FailedPreconditionError",
    "PermissionDeniedError",
    "UnauthenticatedError",
    "ResourceExhaustedError",
    "DeadlineExceededError",
    "UnavailableError",
    "from_grpc_error",
]


class PhalanxError(Exception):
    """Base class of every exception raised by the Phalanx SDK."""


class RPCError(PhalanxError):
    """The scheduler (or the gRPC transport) answered a call with a non-OK status.

    Attributes:
        code: The gRPC status code, a :class:`grpc.StatusCode`.
        code_name: The code's name, e.g. ``"INVALID_ARGUMENT"``.
        message: The server's message (human-readable reason).
    """

    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        """Create an error.

        Args:
            message: The human-readable reason.
            code: The status code; defaults to the subclass's code.
        """
        self.code: grpc.StatusCode = code if code is not None else self.default_code
        self.message = message
        super().__init__(f"{self.code_name}: {message}")

    @property
    def code_name(self) -> str:
        """The status code's name, e.g. ``"NOT_FOUND"``."""
        name: str = self.code.name  # grpc.StatusCode is an enum.Enum (untyped for mypy: grpc ships no types)
        return name


class InvalidArgumentError(RPCError):
    """INVALID_ARGUMENT: the request was rejected as malformed."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(RPCError):
    """NOT_FOUND: the job (or other object) does not exist."""

    default_code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(RPCError):
    """FAILED_PRECONDITION: the operation is not possible in the current state."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDeniedError(RPCError):
    """PERMISSION_DENIED: the caller may not do this."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(RPCError):
    """UNAUTHENTICATED: the caller could not be authenticated."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhaustedError(RPCError):
    """RESOURCE_EXHAUSTED: a quota or size limit was hit."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(RPCError):
    """DEADLINE_EXCEEDED: the call, or a :meth:`Client.wait`, ran out of time."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(RPCError):
    """UNAVAILABLE: the scheduler could not be reached, even after retries."""

    default_code = grpc.StatusCode.UNAVAILABLE


_BY_CODE: dict[grpc.StatusCode, type[RPCError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        FailedPreconditionError,
        PermissionDeniedError,
        UnauthenticatedError,
        ResourceExhaustedError,
        DeadlineExceededError,
        UnavailableError,
    )
}

_CONNECT_FAILURE_MARKERS = (
    "failed to connect",
    "connection refused",
    "dns resolution failed",
    "name resolution",
    "connections to all backends failing",
    "socket closed",
    "connection reset",
    "no route to host",
    "failed to resolve",
    "empty address list",
    "errors resolving",
    "address lookup failed",
)


def error_for_status(code: grpc.StatusCode, message: str) -> RPCError:
    """Build the SDK exception for a status code and message.

    Args:
        code: The gRPC status code.
        message: The message to carry.

    Returns:
        An instance of the matching :class:`RPCError` subclass (plain ``RPCError`` for other codes).
    """
    return _BY_CODE.get(code, RPCError)(message, code)


def from_grpc_error(exc: grpc.RpcError, target: str) -> RPCError:
    """Translate a :class:`grpc.RpcError` (sync or aio) into the SDK's exception.

    A transport-level connection failure becomes an :class:`UnavailableError` whose message names the target:
    ``"cannot reach scheduler at ADDR (...)"``.

    Args:
        exc: The error raised by grpc.
        target: The scheduler address the client was using.

    Returns:
        The matching :class:`RPCError`.
    """
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    message = details or code.name.lower().replace("_", " ")
    if code is grpc.StatusCode.UNAVAILABLE and is_connect_failure(message):
        message = f"cannot reach scheduler at {target} ({message})"
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED and message.lower() == "deadline exceeded":
        message = f"scheduler at {target} did not answer in time (deadline exceeded)"
    return error_for_status(code, message)


def is_connect_failure(details: str) -> bool:
    """Whether a status message describes a transport failure rather than a server's own UNAVAILABLE."""
    low = details.lower()
    return any(marker in low for marker in _CONNECT_FAILURE_MARKERS)
