"""Checkpoint retention: the coordinator keeps the newest K complete committed checkpoints of each job and deletes
the older ones, and the shards of aborted checkpoints (docs/guides/checkpoints-and-preemption.md, "Checkpoint retention").

K is the job's own `keep_checkpoints` (JobSpec.keep_checkpoints, jobs.keep_checkpoints) when above 0, else the
coordinator's `--keep-checkpoints` (default 3). A finished job (SUCCEEDED, FAILED, CANCELLED) follows
`--finished-checkpoints`: `keep` (default) the same newest K, `latest` only its newest one, `delete` none. PENDING
checkpoints are never deleted, nor the newest K complete committed ones (the restore points, in the order restores
try them: store.restore_points._restore_points).

The policy (`effective_keep`, `select_deletions`, `deletable_path`, `protected`) is pure; `Retention` does the I/O.
A pass reads the ledger in a read-only transaction, deletes files outside any transaction (best effort: a slow or
failing file system never holds the ledger's lock), then marks the checkpoints deleted (`checkpoints.deleted_at`)
in a short second transaction. A crash in between leaves the rows undeleted: the next sweep finds them and
finishes (deleting what is already gone is a no-op). A checkpoint whose files could not be deleted (an OSError) is
not marked, and is retried by every sweep (warned once per process).

Only files of `file://` shard URIs (the path without the fragment: a collective `gang.dcp#rank-<r>` shard names
its directory) whose resolved path lies inside the job's own directory `<--checkpoint-dir>/<job>/` are deleted:
symlinks are resolved, `..` components refused. Shards elsewhere (another scheme, another directory, no
--checkpoint-dir) are left where they are, logged once per checkpoint, and the checkpoint is still marked deleted
(it is no restore point any more). A path is never deleted while a checkpoint that is not being deleted (a
retained or PENDING one) references it, the path inside it, or a path inside it; a directory a shard emptied
(`attempt-<a>/`, then `<step>/`) is removed, the job's directory never.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

import structlog
from sqlalchemy import Engine, func, select, update

from db.models import TERMINAL_JOB_STATES, Checkpoint, CheckpointShard, Job

COMMITTED = "COMMITTED"
PENDING = "PENDING"
ABORTED = "ABORTED"

DEFAULT_KEEP_CHECKPOINTS = 3
MAX_KEEP_CHECKPOINTS = 10_000
KEEP = "keep"  # a finished job keeps its newest K, as while it ran
LATEST = "latest"  # a finished job keeps only its newest checkpoint
DELETE = "delete"  # a finished job keeps none
FINISHED_POLICIES = (KEEP, LATEST, DELETE)
DEFAULT_FINISHED = KEEP
FINISHED_STATES = frozenset(TERMINAL_JOB_STATES)
MAX_PER_SWEEP = 500  # checkpoints one sweep deletes at most; the rest wait for the next

_SAFE_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # the job directories phalanx.train.LocalStore names

log = structlog.get_logger(service="checkpointd")


# -- policy (pure) ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """An undeleted checkpoint of a job, as the policy sees it. `complete`: a restore point (COMMITTED, one shard of
    each rank 0..n-1 of its world size, of an attempt up to the job's current one)."""

    id: str
    step: int
    state: str
    committed_at: float = 0.0
    created_at: float = 0.0
    complete: bool = True
    attempt: int = 0


def validate_keep(keep: int) -> int:
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= MAX_KEEP_CHECKPOINTS:
        raise ValueError(f"keep_checkpoints must be 1 to {MAX_KEEP_CHECKPOINTS}, got {keep!r}")
    return keep


def validate_finished(policy: str) -> str:
    if policy not in FINISHED_POLICIES:
        raise ValueError(f"finished_checkpoints must be one of {', '.join(FINISHED_POLICIES)}, got {policy!r}")
    return policy


def effective_keep(default_keep: int, job_keep: int, job_state: str, finished: str = DEFAULT_FINISHED) -> int:
    """How many complete committed checkpoints the job keeps: its own `keep_checkpoints` when above 0, else the
    coordinator's; once the job finished, `latest` keeps 1 and `delete` 0."""
    keep = job_keep if job_keep and job_keep > 0 else default_keep
    if job_state in FINISHED_STATES:
        if finished == LATEST:
            return 1
        if finished == DELETE:
            return 0
    return keep


def restore_order(c: Candidate) -> tuple:
    """Newest first, as restores try them: highest step, then latest commit, then latest begin (then the id)."""
    return (-c.step, -(c.committed_at or 0.0), -(c.created_at or 0.0), c.id)


def select_deletions(checkpoints: Iterable[Candidate], keep: int) -> list[Candidate]:
    """The checkpoints to delete, given a job's undeleted ones and how many complete committed ones it keeps.

    Every ABORTED one; of the COMMITTED ones, in restore order, all after the `keep`-th complete one (all of them
    when `keep` is 0). A COMMITTED one that is no restore point (incomplete) goes only once `keep` newer complete
    ones are kept. PENDING ones never."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    chosen = [c for c in checkpoints if c.state == ABORTED]
    kept = 0
    for c in sorted((c for c in checkpoints if c.state == COMMITTED), key=restore_order):
        if kept >= keep:
            chosen.append(c)
        elif c.complete:
            kept += 1
    return chosen


def local_path(uri: str) -> str | None:
    """The absolute path a `file://` URI names, without its fragment (`gang.dcp#rank-3` names `gang.dcp`); None
    for another scheme or host."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return None
    if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost"):
        return None
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        return None
    return path


def _resolve(path: str) -> Path:
    return Path(os.path.realpath(path))


def deletable_path(uri: str, root: Path | None, job_id: str, tenant: str = "") -> tuple[Path | None, str]:
    """(the resolved path to delete, "") when `uri` is a `file://` URI inside the job's directory under `root` (a
    resolved directory), else (None, why it is left alone)."""
    if root is None:
        return None, "the coordinator has no --checkpoint-dir"
    path = local_path(uri)
    if path is None:
        return None, "not a file:// URI"
    if ".." in PurePosixPath(path).parts:
        return None, "its path has a '..' component"
    if not _SAFE_JOB.match(job_id) or (tenant and not _SAFE_JOB.match(tenant)):
        return None, "the job id names no checkpoint directory"
    job_dir = root / tenant / job_id if tenant else root / job_id
    resolved = _resolve(path)
    if resolved == job_dir or job_dir not in resolved.parents:
        return None, f"not inside {job_dir}"
    return resolved, ""


def referenced_path(uri: str) -> Path | None:
    """The resolved path a shard URI references (any file:// URI), for `protected`."""
    path = local_path(uri)
    return None if path is None else _resolve(path)


def protected(path: Path, referenced: Iterable[Path]) -> bool:
    """Whether deleting `path` would delete something a kept checkpoint references: the same path, one inside it,
    or one it lies inside."""
    return any(ref == path or path in ref.parents or ref in path.parents for ref in referenced)


# -- I/O ----------------------------------------------------------------------------------------------------------


@dataclass
class Removal:
    files: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)


def _tree_size(path: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except OSError:
                pass
    return files, size


def delete_path(path: Path, stop_at: Path) -> Removal:
    """Delete a shard's file or directory (its contents never followed through symlinks), then each emptied parent
    directory up to, not including, `stop_at`. A path already gone is no error."""
    out = Removal()
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    except OSError as exc:
        out.errors.append(f"{path}: {exc.strerror or exc}")
        return out
    if st is not None:
        try:
            if path.is_dir() and not path.is_symlink():
                files, size = _tree_size(path)
                shutil.rmtree(path)
            else:
                files, size = 1, st.st_size
                path.unlink()
            out.files, out.bytes = files, size
        except FileNotFoundError:
            pass
        except OSError as exc:
            out.errors.append(f"{path}: {exc.strerror or exc}")
            return out
    parent = path.parent
    while parent != stop_at and stop_at in parent.parents:
        try:
            parent.rmdir()
        except OSError:  # not empty (another attempt's shards, a rank writing), or gone: leave it
            break
        parent = parent.parent
    return out


@dataclass(frozen=True)
class Deleted:
    """What a pass did to one checkpoint (also logged as `checkpoint_deleted`)."""

    checkpoint_id: str
    job_id: str
    step: int
    state: str
    files: int
    bytes_freed: int
    left: int  # shards left where they are (not under the job's directory, or still referenced)


@dataclass
class _Plan:
    job_id: str
    tenant: str
    delete: list[Candidate]
    shards: dict[str, list[str]]  # checkpoint id -> shard URIs, for the ones to delete
    referenced: list[Path]  # paths the job's other undeleted checkpoints reference


class Retention:
    """The coordinator's retention: `prune_job` after a commit, `sweep` periodically (aborted checkpoints,
    committed ones beyond K, finished jobs' policy). Passes run one at a time (a lock), in a worker thread."""

    def __init__(
        self, checkpoint_dir: str = "", keep: int = DEFAULT_KEEP_CHECKPOINTS, finished: str = DEFAULT_FINISHED
    ) -> None:
        self.keep = validate_keep(keep)
        self.finished = validate_finished(finished)
        self.root = Path(os.path.realpath(checkpoint_dir)) if checkpoint_dir else None
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def keep_for(self, job_keep: int, job_state: str) -> int:
        return effective_keep(self.keep, job_keep, job_state, self.finished)

    # -- passes

    def prune_job(self, engine: Engine, job_id: str, *, now: float | None = None) -> list[Deleted]:
        """Apply the policy to one job (after one of its commits)."""
        with self._lock:
            with engine.execution_options(readonly=True).begin() as conn:
                plan = self._plan(conn, job_id)
            return self._apply(engine, [plan] if plan is not None else [], now)

    def sweep(self, engine: Engine, *, now: float | None = None, limit: int = MAX_PER_SWEEP) -> list[Deleted]:
        """Apply the policy to every job with an undeleted ABORTED checkpoint or more undeleted COMMITTED ones than
        it keeps (at most `limit` checkpoints per sweep)."""
        with self._lock:
            with engine.execution_options(readonly=True).begin() as conn:
                jobs = self._due(conn)
                plans: list[_Plan] = []
                total = 0
                for job_id in jobs:
                    plan = self._plan(conn, job_id)
                    if plan is None:
                        continue
                    if total and total + len(plan.delete) > limit:
                        break
                    plans.append(plan)
                    total += len(plan.delete)
            return self._apply(engine, plans, now)

    # -- reading (read-only transaction)

    def _due(self, conn) -> list[str]:
        counts: dict[str, dict] = {}
        rows = conn.execute(
            select(Checkpoint.job_id, Job.state, Job.keep_checkpoints, Checkpoint.state.label("cstate"), func.count())
            .join(Job, Job.id == Checkpoint.job_id)
            .where(Checkpoint.deleted_at.is_(None), Checkpoint.state.in_((COMMITTED, ABORTED)))
            .group_by(Checkpoint.job_id, Job.state, Job.keep_checkpoints, Checkpoint.state)
        ).all()
        for job_id, job_state, job_keep, cstate, n in rows:
            entry = counts.setdefault(
                job_id, {"keep": self.keep_for(job_keep or 0, job_state), COMMITTED: 0, ABORTED: 0}
            )
            entry[cstate] = int(n)
        return sorted(j for j, c in counts.items() if c[ABORTED] or c[COMMITTED] > c["keep"])

    def _plan(self, conn, job_id: str) -> _Plan | None:
        job = conn.execute(
            select(Job.state, Job.attempt, Job.keep_checkpoints, Job.tenant).where(Job.id == job_id)
        ).first()
        if job is None:
            return None
        stats = (
            select(
                CheckpointShard.checkpoint_id.label("cid"),
                func.count().label("n"),
                func.min(CheckpointShard.rank).label("lo"),
                func.max(CheckpointShard.rank).label("hi"),
            )
            .join(Checkpoint, Checkpoint.id == CheckpointShard.checkpoint_id)
            .where(Checkpoint.job_id == job_id, Checkpoint.deleted_at.is_(None))
            .group_by(CheckpointShard.checkpoint_id)
            .subquery()
        )
        rows = conn.execute(
            select(
                Checkpoint.id,
                Checkpoint.step,
                Checkpoint.state,
                Checkpoint.attempt,
                Checkpoint.committed_at,
                Checkpoint.created_at,
                Checkpoint.world_size,
                stats.c.n,
                stats.c.lo,
                stats.c.hi,
            )
            .outerjoin(stats, stats.c.cid == Checkpoint.id)
            .where(Checkpoint.job_id == job_id, Checkpoint.deleted_at.is_(None))
        ).all()
        candidates = [
            Candidate(
                r.id,
                int(r.step),
                r.state,
                r.committed_at or 0.0,
                r.created_at or 0.0,
                complete=(
                    r.state == COMMITTED
                    and r.attempt <= job.attempt
                    and bool(r.n)
                    and r.lo == 0
                    and r.hi == r.n - 1
                    and (r.world_size == 0 or r.world_size == r.n)
                ),
                attempt=int(r.attempt),
            )
            for r in rows
        ]
        delete = select_deletions(candidates, self.keep_for(job.keep_checkpoints or 0, job.state))
        if not delete:
            return None
        doomed = {c.id for c in delete}
        shards: dict[str, list[str]] = {c.id: [] for c in delete}
        referenced: list[Path] = []
        for cid, uri in conn.execute(
            select(CheckpointShard.checkpoint_id, CheckpointShard.uri)
            .join(Checkpoint, Checkpoint.id == CheckpointShard.checkpoint_id)
            .where(Checkpoint.job_id == job_id, Checkpoint.deleted_at.is_(None))
            .order_by(CheckpointShard.checkpoint_id, CheckpointShard.rank)
        ):
            if cid in doomed:
                shards[cid].append(uri)
            else:
                ref = referenced_path(uri)
                if ref is not None:
                    referenced.append(ref)
        return _Plan(job_id, job.tenant or "", sorted(delete, key=restore_order), shards, referenced)

    # -- deleting (no transaction), then marking (a short one)

    def _apply(self, engine: Engine, plans: Sequence[_Plan], now: float | None) -> list[Deleted]:
        done: list[Deleted] = []
        marked: list[str] = []
        gone: set[Path] = set()  # deleted in this pass (a gang directory several shards name)
        for plan in plans:
            for c in plan.delete:
                result = self._delete_one(plan, c, gone)
                if result is None:
                    continue
                marked.append(c.id)
                done.append(result)
        if marked:
            ts = time.time() if now is None else now
            with engine.begin() as conn:
                for i in range(0, len(marked), 500):
                    conn.execute(
                        update(Checkpoint)
                        .where(
                            Checkpoint.id.in_(marked[i : i + 500]),
                            Checkpoint.deleted_at.is_(None),
                            Checkpoint.state.in_((COMMITTED, ABORTED)),
                        )
                        .values(deleted_at=ts)
                    )
        for d in done:
            log.info(
                "checkpoint_deleted",
                checkpoint_id=d.checkpoint_id,
                job_id=d.job_id,
                step=d.step,
                state=d.state,
                files=d.files,
                bytes_freed=d.bytes_freed,
                left=d.left,
            )
        return done

    def _delete_one(self, plan: _Plan, c: Candidate, gone: set[Path]) -> Deleted | None:
        """Delete one checkpoint's files; None when some could not be (it stays undeleted, retried later)."""
        files = size = 0
        left: list[tuple[str, str]] = []
        errors: list[str] = []
        seen: set[Path] = set()
        for uri in plan.shards.get(c.id, []):
            path, why = deletable_path(uri, self.root, plan.job_id, plan.tenant)
            if path is None or self.root is None:  # (no root: no path either, and `why` says so)
                left.append((uri, why))
                continue
            if path in seen or path in gone:
                continue
            seen.add(path)
            if protected(path, plan.referenced):
                left.append((uri, "a kept checkpoint references it"))
                continue
            removal = delete_path(
                path, self.root / plan.tenant / plan.job_id if plan.tenant else self.root / plan.job_id
            )
            files += removal.files
            size += removal.bytes
            errors += removal.errors
            if not removal.errors:
                gone.add(path)
        if errors:
            if c.id not in self._warned:
                self._warned.add(c.id)
                log.warning(
                    "checkpoint_delete_failed",
                    checkpoint_id=c.id,
                    job_id=plan.job_id,
                    step=c.step,
                    state=c.state,
                    errors=errors[:5],
                    error_count=len(errors),
                    detail="kept in the ledger; every sweep retries",
                )
            return None
        self._warned.discard(c.id)
        if left:
            log.warning(
                "checkpoint_files_left",
                checkpoint_id=c.id,
                job_id=plan.job_id,
                step=c.step,
                shards=len(left),
                uri=left[0][0][:300],
                reason=left[0][1],
            )
        return Deleted(c.id, plan.job_id, c.step, c.state, files, size, len(left))
