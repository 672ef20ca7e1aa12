"""Where shards live: a small interface for checkpoint stores, and the local/shared-directory store.

A store writes one rank's shard bytes and answers a URI for them; the coordinator records only the URI, the size
and the checksum. An object store (S3, GCS) implements the same two methods with its own URI scheme.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

from .errors import CheckpointError

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def sha256_checksum(data: bytes) -> str:
    """The checksum format the coordinator stores: "sha256:<hex>"."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


class CheckpointStore(Protocol):
    def put(self, job_id: str, attempt: int, step: int, rank: int, data: bytes) -> str:
        """Durably write one shard and return its URI (the write is complete, or it raises).

        The URI must differ per attempt, so a rank of a superseded attempt can never overwrite a shard of the
        current one (the coordinator refuses its report, but only after it wrote).
        """
        ...

    def get(self, uri: str) -> bytes:
        """The bytes behind a URI that `put` returned."""
        ...


class LocalStore:
    """Shards as files `<root>/<job>/<step>/attempt-<a>/rank-<r>.json` on a local or shared (NFS, Lustre) directory
    (phalanx.train.state_format; older versions wrote pickles, `rank-<r>.pkl`), or directories `rank-<r>.dcp/` for
    torch state_dicts, written by phalanx.train.torch_dcp. For restores to find every rank's shard after a
    relaunch on other nodes (and to verify them all, `restore(verify="gang")`), the directory must be shared.

    Each write goes to a temporary file in the same directory, is fsynced, then renamed into place, so a reader
    never sees half a shard. URIs are `file://` URIs of absolute paths.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()

    def path(self, job_id: str, attempt: int, step: int, rank: int, suffix: str = ".json") -> Path:
        if not _SAFE.match(job_id):
            raise CheckpointError(f"job id {job_id!r} cannot name a checkpoint directory")
        if min(attempt, step, rank) < 0:
            raise CheckpointError(f"attempt, step and rank must be >= 0, got {attempt}, {step}, {rank}")
        return self.root / job_id / str(step) / f"attempt-{attempt}" / f"rank-{rank}{suffix}"

    def shard_dir(self, job_id: str, attempt: int, step: int, rank: int) -> Path:
        """Where a directory shard (a torch.distributed.checkpoint of this rank) lives:
        `<root>/<job>/<step>/attempt-<a>/rank-<r>.dcp/`. Having this method makes a store a directory store
        (phalanx.train.torch_dcp); the caller writes the directory and reports its `file://` URI."""
        return self.path(job_id, attempt, step, rank, suffix=".dcp")

    def put(self, job_id: str, attempt: int, step: int, rank: int, data: bytes) -> str:
        target = self.path(job_id, attempt, step, rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target.as_uri()

    def get(self, uri: str) -> bytes:
        parsed = urlparse(uri)
        if parsed.scheme not in ("file", ""):
            raise CheckpointError(f"LocalStore cannot read {uri!r} (scheme {parsed.scheme!r})")
        path = Path(unquote(parsed.path))
        try:
            return path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"cannot read shard {uri}: {exc}") from exc
