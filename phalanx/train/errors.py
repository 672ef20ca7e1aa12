"""Errors of the rank-side checkpoint library."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every phalanx.train error."""


class CheckpointConfigError(CheckpointError, ValueError):
    """The environment the agent sets is missing or malformed (names the variable)."""


class CheckpointCorruptError(CheckpointError):
    """A shard's bytes do not match the checksum the coordinator committed."""


class CheckpointPickleError(CheckpointError):
    """A shard is a pickle (written by an older phalanx.train) and restore() was not passed allow_pickle=True:
    unpickling bytes from storage can run arbitrary code."""


class CheckpointRejectedError(CheckpointError):
    """The coordinator refused a request; `code` is the gRPC status code name (e.g. FAILED_PRECONDITION when this
    attempt has been superseded: the process should exit)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
