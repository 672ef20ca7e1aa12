"""Optional torch.distributed.checkpoint (DCP) adapter of phalanx.train: torch state_dicts as directory shards.

`Checkpointer.save(step, state)` uses it when torch (with torch.distributed) is importable, `state` is a torch
state_dict (a Mapping whose values, recursively through dicts, lists and tuples, include at least one
torch.Tensor) and the store is a directory store (has `shard_dir(job, attempt, step, rank)`, as LocalStore does).
Two layouts:

- **Collective** (torch.distributed is initialized, with the RANK and WORLD_SIZE Phalanx gave the rank): every
  rank calls `dcp.save` on the same step into one directory per checkpoint, `<dir>/<job>/<step>/attempt-<a>/
  gang.dcp/`. DCP's planner de-duplicates replicated tensors (a DDP model's parameters and optimizer state are the
  same on every rank), so each rank writes its own part once, `__<rank>_<n>.distcp`, and no rank writes a full
  copy; rank 0 (DCP's coordinator) also writes `.metadata`. Each rank reports its own files as its shard: the URI
  is the directory's with the fragment `#rank-<r>`, the size and "sha256:" cover only that rank's files
  (`rank_files`), so the coordinator's one-shard-per-rank commit means every rank's part is in. A restore
  verifies the shards, then `dcp.load`s collectively (each rank reads what it needs from every rank's files).
- **Per rank** (no process group): the shard is the directory `<dir>/<job>/<step>/attempt-<a>/rank-<r>.dcp/`,
  written by `dcp.save` with `no_dist=True`: every rank writes its own whole DCP checkpoint.

The coordinator gets `file://` URIs, sizes and "sha256:" over the files (see `dir_checksum`). Any other state is
written in phalanx.train's JSON format (phalanx.train.state_format); so is a tensor state with a store that is
not a directory store (an object store): its tensors go in as raw bytes after the JSON, and come back as CPU
tensors. Nothing is pickled by phalanx.train (DCP keeps non-tensor entries, e.g. an optimizer's param_groups, in
its own format).

`Checkpointer.restore(into=template)` verifies the checksums, then `dcp.load`s into the template in place (DCP's
contract: the template names every entry to load, with tensors of the right shape; for an optimizer, build the
template with `torch.distributed.checkpoint.state_dict.get_state_dict`, which creates its state) and returns
`(step, template)`. Without a template a DCP shard raises CheckpointError: torch 2.13's only public template-less
load (`format_utils.dcp_to_torch_save`) turns nested non-str keys into strings (an optimizer's `state` is keyed by
int), which would silently drop optimizer state on `optimizer.load_state_dict`.

torch is imported lazily: this module imports without it, and a state can only hold tensors when the training
code has imported torch already, so a non-torch job never pays for importing it.
"""

from __future__ import annotations

import hashlib
import os
import re
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
GANG_DIR = "gang" + SUFFIX
METADATA = ".metadata"  # DCP's global metadata, written by its coordinator rank (0)
_RANK_FRAGMENT = re.compile(r"^rank-(\d{1,7})$")
_RANK_FILE = re.compile(r"^__(\d+)_")
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


def _dist():
    """torch.distributed when it is imported, available and initialized (a process group exists), else None.
    Never imports torch."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def collective(rank: int, world_size: int) -> bool:
    """Whether this rank saves and restores DCP checkpoints collectively: torch.distributed is initialized. Its
    default group must then be the gang as Phalanx launched it (CheckpointError otherwise: a shard would be
    reported under the wrong rank)."""
    dist = _dist()
    if dist is None:
        return False
    got_rank, got_world = dist.get_rank(), dist.get_world_size()
    if (got_rank, got_world) != (rank, world_size):
        raise CheckpointError(
            f"torch.distributed's default group has rank {got_rank} of {got_world}, but Phalanx launched this rank "
            f"as RANK={rank} of WORLD_SIZE={world_size}: initialize the process group from the environment "
            "(init_process_group() reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
        )
    return True


def _split(uri: str) -> tuple[Path, int | None]:
    """(directory, rank) of a DCP shard URI: the rank of a collective shard's `#rank-<r>` fragment, else None."""
    parsed = urlparse(uri)
    match = _RANK_FRAGMENT.match(parsed.fragment)
    return Path(unquote(parsed.path)), (int(match.group(1)) if match else None)


def file_rank(name: str) -> int:
    """The rank whose shard a file of a collective DCP directory belongs to: `__<r>_<n>.distcp` is rank r's;
    every other file (DCP's `.metadata`) is rank 0's, DCP's coordinator."""
    match = _RANK_FILE.match(name)
    return int(match.group(1)) if match else 0


def rank_files(root: str | os.PathLike[str], rank: int) -> list[str]:
    """The relative names of `rank`'s files in a collective DCP directory (`file_rank`)."""
    return [rel for rel, _ in _files(Path(root)) if file_rank(rel.split("/", 1)[0]) == rank]


def _files(root: Path) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            out.append((path.relative_to(root).as_posix(), path))
    return sorted(out)


def dir_checksum(root: str | os.PathLike[str], only: list[str] | None = None) -> tuple[str, int]:
    """("sha256:<hex>", total bytes) of a directory shard: sha256 over its files in sorted relative-name order,
    each as name (UTF-8), NUL, 8-byte big-endian length, content. Renaming, moving bytes between files, adding or
    removing a file all change it. `only`: just these relative names (one rank's files of a collective
    directory); one of them missing raises FileNotFoundError."""
    h = hashlib.sha256()
    total = 0
    files = _files(Path(root)) if only is None else [(rel, Path(root) / rel) for rel in sorted(only)]
    for rel, path in files:
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


def save(
    store: Any, job_id: str, attempt: int, step: int, rank: int, state: Mapping[str, Any], world_size: int = 0
) -> tuple[str, int, str]:
    """Write `state` with dcp.save as this rank's shard; returns (uri, size_bytes, checksum).

    With torch.distributed initialized (`collective(rank, world_size)`), every rank of the gang must call it for
    the same step (phalanx.train's step agreement sees to that): see `save_collective`. Otherwise the checkpoint is
    written into a temporary sibling directory (files fsynced by the FileSystemWriter) and renamed into place, so a
    reader never sees half a shard; a shard this rank wrote before for the same attempt and step (a retried save)
    is replaced.
    """
    dcp = _dcp()
    if dcp is None:
        raise CheckpointError("torch.distributed.checkpoint is not available (install torch)")
    if world_size and collective(rank, world_size):
        return save_collective(store, job_id, attempt, step, rank, state)
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


def save_collective(
    store: Any, job_id: str, attempt: int, step: int, rank: int, state: Mapping[str, Any]
) -> tuple[str, int, str]:
    """The collective save: every rank of the process group calls it for the same step. The directory is the
    attempt's `gang.dcp/` for the step (emptied first by rank 0 when a retried save finds one); `dcp.save` writes
    each rank's de-duplicated part and rank 0 the metadata, and returns on every rank once all of it is written.
    Returns this rank's (uri `...gang.dcp#rank-<r>`, size of its files, sha256 of its files)."""
    dcp = _dcp()
    dist = _dist()
    assert dcp is not None and dist is not None
    target = Path(store.shard_dir(job_id, attempt, step, rank)).parent / GANG_DIR
    try:
        if rank == 0:
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
        dist.barrier()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(target, sync_files=True))
        _fsync_dir(target)
        checksum, size = dir_checksum(target, rank_files(target, rank))
    except CheckpointError:
        raise
    except BaseException as exc:
        if not _is_dcp_error(exc):
            raise
        raise CheckpointError(
            f"torch.distributed.checkpoint collective save of {target} failed: {_dcp_failure(exc)}"
        ) from exc
    return f"{target.as_uri()}#rank-{rank}", size, checksum


def verify(uri: str, checksum: str, size_bytes: int) -> tuple[str, str] | None:
    """None when the directory shard behind `uri` matches the committed checksum and size, else (kind, detail):
    kind "missing", "unreadable", "size" or "sha256". A collective shard (`#rank-<r>`) is that rank's files of the
    directory (`rank_files`). Needs no torch."""
    path, rank = _split(uri)
    if not path.exists():
        return "missing", str(path)
    if not path.is_dir():
        return "unreadable", f"{path} is not a directory"
    try:
        actual, size = dir_checksum(path, None if rank is None else rank_files(path, rank))
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
    the caller has just checked the checksum (`verify`); it is not read twice. A collective shard is loaded
    collectively when torch.distributed is initialized (every rank of the gang loads the same checkpoint), else
    by this process alone.
    """
    path, rank = _split(uri)
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
        raise CheckpointError(
            f"{what} is a torch.distributed.checkpoint directory ({uri}): install torch to restore it"
        )
    if not path.is_dir():
        raise CheckpointError(f"cannot read shard {uri}: not a directory")
    if not verified:
        try:
            actual, size = dir_checksum(path, None if rank is None else rank_files(path, rank))
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
            dcp.load(into, storage_reader=dcp.FileSystemReader(path), no_dist=rank is None or _dist() is None)
    except BaseException as exc:
        if not _is_dcp_error(exc):
            raise
        raise CheckpointError(
            f"torch.distributed.checkpoint load of {what} ({uri}) into the template failed: {_dcp_failure(exc)}"
        ) from exc
    return into
