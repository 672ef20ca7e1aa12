"""Optional torch.distributed.checkpoint (DCP) adapter of phalanx.train: torch state_dicts as directory shards.

`Checkpointer.save(step, state)` uses it when torch (with torch.distributed) is importable, `state` is a torch
state_dict (a Mapping whose values, recursively through dicts, lists and tuples, include at least one
torch.Tensor) and the store is a directory store (has `shard_dir(job, attempt, step, rank)`, as LocalStore does).
The shard is then the directory `<dir>/<job>/<step>/attempt-<a>/rank-<r>.dcp/`, written by `dcp.save` with a
FileSystemWriter and `no_dist=True`: every rank writes its own DCP checkpoint (the coordinator's protocol is one
shard per rank; there is no resharding). The coordinator gets the directory's `file://` URI, its total size and
"sha256:" over its files (see `dir_checksum`). Any other state is written in phalanx.train's JSON format
(phalanx.train.state_format); so is a tensor state with a store that is not a directory store (an object store):
its tensors go in as raw bytes after the JSON, and come back as CPU tensors. Nothing is pickled.

`Checkpointer.restore(into=template)` verifies the directory's checksum, then `dcp.load`s into the template in
place (DCP's contract: the template names every entry to load, with tensors of the right shape) and returns
`(step, template)`. Without a template a DCP shard raises CheckpointError: torch 2.13's only public template-less
load (`format_utils.dcp_to_torch_save`) turns nested non-str keys into strings (an optimizer's `state` is keyed by
int), which would silently drop optimizer state on `optimizer.load_state_dict`.

torch is imported lazily: this module imports without it, and a state can only hold tensors when the training
code has imported torch already, so a non-torch job never pays for importing it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from .errors import CheckpointCorruptError, CheckpointError

SUFFIX = ".dcp"
_CHUNK = 1 << 20
# dcp.save/load warn that they "assume the intent" to run in a single process when no_dist=True: it is the intent.
_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


def _dcp():
    """torch.distributed.checkpoint, or None when torch or torch.distributed is not available."""
    try:
        import torch.distributed as dist
        if not dist.is_available():
            return None
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return None
    return dcp


def available() -> bool:
    """True when torch with torch.distributed.checkpoint is importable (imports torch)."""
    return _dcp() is not None


def is_state_dict(state: Any) -> bool:
    """True when `state` is a Mapping whose values, recursively through Mappings, lists and tuples, include a
    torch.Tensor. Never imports torch: without it imported, no value can be a tensor."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(state, Mapping):
        return False
    tensor = torch.Tensor
    seen: set[int] = set()
    stack: list[Any] = list(state.values())
    while stack:
        value = stack.pop()
        if isinstance(value, tensor):
            return True
        if isinstance(value, (Mapping, list, tuple)):
            if id(value) in seen:
                continue
            seen.add(id(value))
            stack.extend(value.values() if isinstance(value, Mapping) else value)
    return False


def supports(store: Any, state: Any) -> bool:
    """Whether `Checkpointer.save` writes `state` with DCP into `store` (else phalanx.train.state_format)."""
    return callable(getattr(store, "shard_dir", None)) and is_state_dict(state) and available()


def is_dcp_uri(uri: str) -> bool:
    """Whether a shard URI names a DCP directory shard (a `file://` URI ending in `.dcp`)."""
    parsed = urlparse(uri)
    return parsed.scheme in ("file", "") and unquote(parsed.path).rstrip("/").endswith(SUFFIX)


def _files(root: Path) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            out.append((path.relative_to(root).as_posix(), path))
    return sorted(out)


def dir_checksum(root: str | os.PathLike[str]) -> tuple[str, int]:
    """("sha256:<hex>", total bytes) of a directory shard: sha256 over its files in sorted relative-name order,
    each as name (UTF-8), NUL, 8-byte big-endian length, content. Renaming, moving bytes between files, adding or
    removing a file all change it."""
    h = hashlib.sha256()
    total = 0
    for rel, path in _files(Path(root)):
        size = path.stat().st_size
        h.update(rel.encode() + b"\0" + size.to_bytes(8, "big"))
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                total += len(chunk)
    return "sha256:" + h.hexdigest(), total


def _dcp_failure(exc: BaseException) -> str:
    """A one-line cause of a DCP failure: CheckpointException (a BaseException) carries each rank's exception and
    prints their tracebacks; keep only the exceptions."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
        return "; ".join(f"{type(c).__name__}: {c}" for c in causes)
    return f"{type(exc).__name__}: {exc}"


def _is_dcp_error(exc: BaseException) -> bool:
    # torch.distributed.checkpoint.api.CheckpointException derives from BaseException, not Exception.
    return isinstance(exc, Exception) or type(exc).__name__ == "CheckpointException"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(store: Any, job_id: str, attempt: int, step: int, rank: int, state: Mapping[str, Any]) -> tuple[str, int, str]:
    """Write `state` with dcp.save as this rank's directory shard; returns (uri, size_bytes, checksum).

    The checkpoint is written into a temporary sibling directory (files fsynced by the FileSystemWriter) and
    renamed into place, so a reader never sees half a shard; a shard this rank wrote before for the same
    attempt and step (a retried save) is replaced.
    """
    dcp = _dcp()
    if dcp is None:
        raise CheckpointError("torch.distributed.checkpoint is not available (install torch)")
    target = Path(store.shard_dir(job_id, attempt, step, rank))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex}"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
        _fsync_dir(tmp)
        checksum, size = dir_checksum(tmp)
        if target.exists():
            old = target.parent / f".{target.name}.old.{uuid.uuid4().hex}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        _fsync_dir(target.parent)
    except CheckpointError:
        raise
    except BaseException as exc:
        if not _is_dcp_error(exc):
            raise
        raise CheckpointError(f"torch.distributed.checkpoint save of {target} failed: {_dcp_failure(exc)}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target.as_uri(), size, checksum


def verify(uri: str, checksum: str, size_bytes: int) -> tuple[str, str] | None:
    """None when the directory shard behind `uri` matches the committed checksum and size, else (kind, detail):
    kind "missing", "unreadable", "size" or "sha256". Needs no torch."""
    path = Path(unquote(urlparse(uri).path))
    if not path.exists():
        return "missing", str(path)
    if not path.is_dir():
        return "unreadable", f"{path} is not a directory"
    try:
        actual, size = dir_checksum(path)
    except OSError as exc:
        return "unreadable", str(exc)
    if size != size_bytes:
        return "size", f"expected {size_bytes} bytes, found {size}"
    if actual != checksum:
        return "sha256", f"expected {checksum}, found {actual}"
    return None


def load(uri: str, checksum: str, size_bytes: int, into: Any, what: str, *, verified: bool = False) -> Any:
    """Verify a directory shard against the committed checksum and size, then dcp.load it into `into` in place.

    `what` names the shard in errors (checkpoint id, step, rank). Raises CheckpointCorruptError on a mismatch and
    CheckpointError when torch is missing, the template is missing or does not match the checkpoint. `verified`:
    the caller has just checked the checksum (`verify`); it is not read twice.
    """
    path = Path(unquote(urlparse(uri).path))
    if into is None:
        raise CheckpointError(
            f"{what} is a torch.distributed.checkpoint directory ({uri}): pass the template state_dict to load it "
            "into, e.g. restore(into={'model': model.state_dict(), 'optim': optimizer.state_dict()}); it is loaded "
            "in place and returned"
        )
    if not isinstance(into, dict):
        raise CheckpointError(f"restore(into=...) needs a dict state_dict template, got {type(into).__name__}")
    dcp = _dcp()
    if dcp is None:
        raise CheckpointError(f"{what} is a torch.distributed.checkpoint directory ({uri}): install torch to restore it")
    if not path.is_dir():
        raise CheckpointError(f"cannot read shard {uri}: not a directory")
    if not verified:
        try:
            actual, size = dir_checksum(path)
        except OSError as exc:
            raise CheckpointError(f"cannot read shard {uri}: {exc}") from exc
        if actual != checksum or size != size_bytes:
            raise CheckpointCorruptError(
                f"shard {uri} of {what} is corrupt: expected {checksum} ({size_bytes} bytes), found {actual} "
                f"({size} bytes)"
            )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.load(into, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except BaseException as exc:
        if not _is_dcp_error(exc):
            raise
        raise CheckpointError(
            f"torch.distributed.checkpoint load of {what} ({uri}) into the template failed: {_dcp_failure(exc)}"
        ) from exc
    return into
