"""The API's consistent snapshots: jobs and nodes pages, GPUs, restore messages, where a rank's logs are."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, and_, case, func, or_, select

from db.migrate import ensure_cluster_id as _ensure_cluster_id
from db.migrate import read_cluster_id
from db.models import Allocation, CheckpointRestore, Gpu, Job, Node, Rank

from ..state import Partial
from ._sql import _json_list


def rank_log_sources(
    conn: Connection,
    job_id: str,
    attempt: int,
    rank: int | None,
    tenant: str | None,
    layout: dict[int, dict[int, str]] | None = None,
) -> tuple[int, list[tuple[int, str, str, int]]]:
    """(the attempt, [(rank, node, address, logs port)]) of a job's ranks, for GetRankLogs; NotFound for a job the
    caller's tenant (None: any) does not have, an attempt it never had, or one no rank of which has started.
    `layout`: attempt -> {rank: node} the view knows (a running attempt's ranks, reported or not yet)."""
    from services.common.errors import NotFound

    job = conn.execute(select(Job.tenant, Job.attempt).where(Job.id == job_id)).first()
    if job is None or (tenant is not None and job.tenant != tenant):
        raise NotFound(f"no job with id {job_id!r}")
    attempt = attempt or job.attempt
    if not 1 <= attempt <= job.attempt:
        raise NotFound(f"job {job_id} has no attempt {attempt} (it has had {job.attempt})")
    stmt = (
        select(Rank.rank, Node.name, Node.address, Node.logs_port)
        .join(Node, Node.id == Rank.node_id)
        .where(Rank.job_id == job_id, Rank.attempt == attempt)
        .order_by(Rank.rank)
    )
    if rank is not None:
        stmt = stmt.where(Rank.rank == rank)
    rows = [(int(r), str(n), str(a or ""), int(p or 0)) for r, n, a, p in conn.execute(stmt)]
    known = (layout or {}).get(attempt, {})
    missing = {r: n for r, n in known.items() if (rank is None or r == rank) and r not in {row[0] for row in rows}}
    if missing:  # ranks that have not reported yet: their nodes are in the view
        where = {
            name: (str(address or ""), int(port or 0))
            for name, address, port in conn.execute(
                select(Node.name, Node.address, Node.logs_port).where(Node.name.in_(sorted(set(missing.values()))))
            )
        }
        rows += [(r, n, *where.get(n, ("", 0))) for r, n in missing.items()]
        rows.sort()
    if not rows:
        if rank is not None:
            raise NotFound(f"rank {rank} of job {job_id} attempt {attempt} has not started, so it has no log")
        raise NotFound(f"no rank of job {job_id} attempt {attempt} has started yet, so there is no log")
    return attempt, rows


def cluster_id(conn: Connection) -> str:
    """The ledger's identity (revision 0015, written by `phalanx db upgrade`), "" when it has none."""
    return read_cluster_id(conn)


def ensure_cluster_id(conn: Connection) -> str:
    """The ledger's identity, written now (a random UUID) when its row is missing, e.g. after the tables were
    emptied; every replica then reads the same one (db.migrate.ensure_cluster_id)."""
    return _ensure_cluster_id(conn)


def read_jobs(
    conn: Connection,
    *,
    job_ids: Sequence[str] | None = None,
    states: Sequence[str] = (),
    limit: int = 0,
    tenant: str | None = None,
    after: tuple[float, str] | None = None,
) -> list[tuple[Any, list[tuple[int, str, list[int]]], dict[int, Partial]]]:
    """Jobs with the allocations they hold, newest first, from one statement: each as (job row, [(replica, node,
    GPUs)], {replica: partial-GPU use}). Only a RUNNING job (PREEMPTING included) holds any: those of its current
    attempt. A job that is not running shows none, not the GPUs an earlier attempt (or its last one) released: a
    requeued gang waits holding nothing (those GPUs are in the allocations table, its history). `tenant`: only that
    tenant's jobs.

    `states` may name the pseudo-state PREEMPTING: a RUNNING job with a preemptor (RUNNING includes those). Paging
    (ListJobs, paging.py): `after` (submitted_at, id) keeps only the jobs after it in this order, and `limit` the
    first that many; both apply after the filters, with the (submitted_at, id) index."""
    stmt = (
        select(
            *Job.__table__.c,
            Allocation.replica.label("a_replica"),
            Node.name.label("a_node"),
            Allocation.gpu_index.label("a_gpu"),
            Allocation.kind.label("a_kind"),
            Allocation.unit.label("a_unit"),
            Allocation.profile.label("a_profile"),
            Allocation.gpu_milli.label("a_milli"),
        )
        .outerjoin(
            Allocation,
            and_(
                Allocation.job_id == Job.id,
                Allocation.attempt == Job.attempt,
                Job.state == "RUNNING",
                Allocation.kind != "hold",
                Allocation.released_at.is_(None),  # a spare lost or swapped out (scheduler.spares) is history
            ),
        )
        .outerjoin(Node, Node.id == Allocation.node_id)
        .order_by(Job.submitted_at.desc(), Job.id.desc(), Allocation.replica, Allocation.gpu_index, Allocation.unit)
    )
    where: list[Any] = []
    if job_ids is not None:
        where.append(Job.id.in_(list(job_ids)))
    if states:
        plain = [s for s in states if s != "PREEMPTING"]
        wanted: list[Any] = [Job.state.in_(plain)] if plain else []
        if "PREEMPTING" in states and "RUNNING" not in plain:
            # (an elastic gang checkpointing for its own grow names itself: it is RUNNING, not PREEMPTING)
            wanted.append(and_(Job.state == "RUNNING", Job.preempted_by != "", Job.preempted_by != Job.id))
        where.append(or_(*wanted))
    if tenant is not None:
        where.append(Job.tenant == tenant)
    if after is not None:
        at, last_id = after
        # `submitted_at <= at` bounds the index scan; the OR only drops the ties at `at` up to `last_id`.
        where.append(and_(Job.submitted_at <= at, or_(Job.submitted_at < at, Job.id < last_id)))
    if limit:
        newest = select(Job.id).where(*where).order_by(Job.submitted_at.desc(), Job.id.desc()).limit(limit)
        stmt = stmt.where(Job.id.in_(newest.scalar_subquery()))
    elif where:
        stmt = stmt.where(*where)
    out: dict[str, tuple[Any, dict[int, tuple[str, list[int]]], dict[int, Partial]]] = {}
    for row in conn.execute(stmt).mappings():
        entry = out.setdefault(row["id"], (row, {}, {}))
        replica = row["a_replica"]
        if replica is None:
            continue
        gpus = entry[1].setdefault(replica, (row["a_node"], []))[1]
        if row["a_gpu"] not in gpus:
            gpus.append(row["a_gpu"])
        if row["a_kind"] == "mig":
            known = entry[2].get(replica)
            entry[2][replica] = Partial(
                profile=row["a_profile"],
                start=row["a_unit"] if known is None else known.start,
                size=1 if known is None else known.size + 1,
            )
        elif row["a_kind"] == "share":
            entry[2][replica] = Partial(milli=row["a_milli"])
    return [
        (job, [(rep, node, gpus) for rep, (node, gpus) in sorted(allocs.items())], parts)
        for job, allocs, parts in out.values()
    ]


def read_nodes(conn: Connection, *, after: str | None = None, limit: int = 0) -> list[tuple[Any, int, int]]:
    """Nodes by name with (GPUs held whole or split, GPUs split into MIG instances or shares). Paging (ListNodes,
    paging.py): only the nodes named after `after`, the first `limit` of them (0: all); the allocations counted are
    those of these nodes only."""
    nodes = select(*Node.__table__.c).order_by(Node.name)
    if after is not None:
        nodes = nodes.where(Node.name > after)
    if limit:
        nodes = nodes.limit(limit)
    page = nodes.subquery()
    used = (
        select(
            Allocation.node_id,
            func.count().label("used"),
            func.sum(case((Allocation.kind == "hold", 1), else_=0)).label("shared"),
        )
        .where(
            Allocation.released_at.is_(None),
            Allocation.kind.in_(("gpu", "hold")),
            Allocation.node_id.in_(select(page.c.id)),
        )
        .group_by(Allocation.node_id)
        .subquery()
    )
    rows = conn.execute(
        select(
            *page.c,
            func.coalesce(used.c.used, 0).label("used_gpus"),
            func.coalesce(used.c.shared, 0).label("shared_gpus"),
        )
        .outerjoin(used, used.c.node_id == page.c.id)
        .order_by(page.c.name)
    ).mappings()
    return [(r, int(r["used_gpus"]), int(r["shared_gpus"])) for r in rows]


def read_node_gpus(conn: Connection, node_ids: Sequence[int] | None = None) -> dict[int, list[dict[str, Any]]]:
    """Every node's GPUs in index order (by node id), or those of `node_ids` only (a page of ListNodes): index,
    uuid, name, memory, MIG mode and instances, and whether an active allocation holds the GPU whole (`held`) or
    split (`split`: a hold row of MIG instances or shares)."""
    if node_ids is None:
        scopes: list[Any] = [None]
    else:
        ids = list(dict.fromkeys(node_ids))
        scopes = [ids[i : i + 500] for i in range(0, len(ids), 500)]
    held: dict[tuple[int, int], str] = {}
    out: dict[int, list[dict[str, Any]]] = {}
    for scope in scopes:
        held_stmt = select(Allocation.node_id, Allocation.gpu_index, Allocation.kind).where(
            Allocation.released_at.is_(None), Allocation.kind.in_(("gpu", "hold"))
        )
        gpu_stmt = select(
            Gpu.node_id,
            Gpu.index,
            Gpu.uuid,
            Gpu.name,
            Gpu.memory_mib,
            Gpu.mig_mode,
            Gpu.mig_instances,
            Gpu.mig_mode_pending,
            Gpu.mig_switch_to,
            Gpu.mig_switch_error,
        ).order_by(Gpu.node_id, Gpu.index)
        if scope is not None:
            held_stmt = held_stmt.where(Allocation.node_id.in_(scope))
            gpu_stmt = gpu_stmt.where(Gpu.node_id.in_(scope))
        for row in conn.execute(held_stmt):
            held[(row.node_id, row.gpu_index)] = row.kind
        _gpu_rows(conn.execute(gpu_stmt), held, out)
    return out


def _gpu_rows(rows: Iterable[Any], held: dict[tuple[int, int], str], out: dict[int, list[dict[str, Any]]]) -> None:
    for row in rows:
        kind = held.get((row.node_id, row.index))
        out.setdefault(row.node_id, []).append(
            dict(
                index=row.index,
                uuid=row.uuid or "",
                name=row.name or "",
                memory_mib=row.memory_mib or 0,
                mig_mode=row.mig_mode or "UNSUPPORTED",
                mig_instances=_json_list(row.mig_instances),
                held=kind == "gpu",
                split=kind == "hold",
                mig_mode_pending=row.mig_mode_pending or "",
                mig_switching=bool(row.mig_switch_to) and not row.mig_switch_error,
                mig_switch_error=row.mig_switch_error or "",
            )
        )


def restore_message(conn: Connection, job_id: str) -> str:
    """What the job's current attempt restored from, as its ranks reported it to the checkpoint coordinator (the
    fullest account when they agree); "" when no rank has reported."""
    attempt = conn.execute(select(Job.attempt).where(Job.id == job_id)).scalar()
    if attempt is None:
        return ""
    rows = conn.execute(
        select(CheckpointRestore.checkpoint_id, CheckpointRestore.skipped, CheckpointRestore.message).where(
            CheckpointRestore.job_id == job_id, CheckpointRestore.attempt == attempt
        )
    ).all()
    if not rows:
        return ""
    if len({r.checkpoint_id for r in rows}) > 1:
        return "ranks restored different checkpoints (GetRestore lists each rank's)"
    return max(rows, key=lambda r: len(r.skipped or [])).message
