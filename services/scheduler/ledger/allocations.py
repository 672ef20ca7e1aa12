"""Allocation rows: whole GPUs, parts of split GPUs (holds) and host resources, reserved and given back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import structlog
from sqlalchemy import Connection, Table, bindparam, func, or_, select, text, update
from sqlalchemy.exc import IntegrityError

from db.models import Allocation, Node

from ..state import JobRecord, NodeRecord, Partial
from ._sql import _changed_jobs, _changed_nodes, insert_rows

log = structlog.get_logger()


def insert_allocations(conn: Connection, jobs: Sequence[JobRecord], nodes: dict[str, NodeRecord], now: float) -> None:
    """Every GPU (or part of one) of every gang reserved in this cycle: the rows in one statement, then the holds
    of split GPUs (see db.models.Allocation)."""
    rows: list[dict[str, Any]] = []
    split: list[tuple[JobRecord, int, NodeRecord, int, Partial]] = []
    use: dict[int, list[int]] = {}  # node id -> [thousandths of CPUs, bytes] this cycle's gangs take there
    _changed_jobs(conn, *(j.id for j in jobs))
    for job in jobs:
        for replica, node, gpus in (*job.allocations, *job.spares):  # spares: negative replicas (scheduler.spares)
            rec = nodes[node]
            part = job.partials.get(replica)
            base = dict(
                job_id=job.id, attempt=job.attempt, replica=replica, node_id=rec.id, reserved_at=now, released_at=None
            )
            first = len(rows)
            if part is None:
                rows += [
                    dict(base, gpu_id=rec.gpu_ids[g], gpu_index=g, kind="gpu", unit=-1, profile="", gpu_milli=0)
                    for g in gpus
                ]
            if job.cpu_milli or job.memory:
                if part is None:
                    rows[first] = dict(rows[first], cpu_milli=job.cpu_milli, memory=job.memory)
                else:
                    base = dict(base, cpu_milli=job.cpu_milli, memory=job.memory)
                held = use.setdefault(rec.id, [0, 0])
                held[0] += job.cpu_milli
                held[1] += job.memory
            if part is None:
                continue
            (g,) = gpus
            split.append((job, replica, rec, g, part))
            if part.profile:
                rows += [
                    dict(
                        base if u == part.start or "cpu_milli" not in base else dict(base, cpu_milli=0, memory=0),
                        gpu_id=rec.gpu_ids[g],
                        gpu_index=g,
                        kind="mig",
                        unit=u,
                        profile=part.profile,
                        gpu_milli=0,
                    )
                    for u in range(part.start, part.start + part.size)
                ]
            else:
                rows.append(
                    dict(
                        base,
                        gpu_id=rec.gpu_ids[g],
                        gpu_index=g,
                        kind="share",
                        unit=None,
                        profile="",
                        gpu_milli=part.milli,
                    )
                )
    if use:
        _take_use(conn, use, {rec.id: rec.name for rec in nodes.values() if rec.id in use})
        for row in rows:
            row.setdefault("cpu_milli", 0)
            row.setdefault("memory", 0)
    insert_rows(conn, Allocation, rows)
    for job, replica, rec, g, part in split:
        _hold(conn, job, replica, rec, g, part, now)


def _take_use(conn: Connection, use: dict[int, list[int]], names: dict[int, str]) -> None:
    """Raise each node's held host resources, guarded: a node never holds more CPUs or memory than its agent
    reported, whatever another writer did meanwhile (the row lock orders two racing replicas; the second one's
    guard then sees the first's use)."""
    for node_id, (cpu, memory) in sorted(use.items()):
        result = conn.execute(
            text(
                "UPDATE nodes SET cpu_used = cpu_used + :cpu, memory_used = memory_used + :memory WHERE id = :id "
                "AND cpu_used + :cpu <= cpu_milli AND memory_used + :memory <= memory"
            ),
            dict(id=node_id, cpu=cpu, memory=memory),
        )
        if result.rowcount != 1:
            params = dict(node=names.get(node_id, node_id), cpu=cpu, memory=memory)
            raise IntegrityError(
                "host resources",
                params,
                RuntimeError(
                    f"node {params['node']} has too few CPUs or too little memory free for this cycle's gangs"
                ),
            )


def recount_use(conn: Connection, node_ids: Sequence[int] | None = None) -> int:
    """Set the nodes' held host resources (cpu_used, memory_used) to what their active allocation rows carry, where
    they differ; returns how many nodes were off. The counters are kept in the same transactions as the rows, so
    this finds nothing unless a bug or a hand edit made them drift; but a counter left too high would make every
    reservation on its node fail the guard, so a full reload (after a failed cycle) and a registration put it
    right. Reads only the active rows (the partial index on node_id) and the nodes whose counters are not 0."""
    if node_ids is not None and not node_ids:
        return 0
    held: dict[int, tuple[int, int]] = {}
    rows = select(Allocation.node_id, func.sum(Allocation.cpu_milli), func.sum(Allocation.memory)).where(
        Allocation.released_at.is_(None), or_(Allocation.cpu_milli > 0, Allocation.memory > 0)
    )
    nodes = select(Node.id, Node.cpu_used, Node.memory_used).where(or_(Node.cpu_used != 0, Node.memory_used != 0))
    wanted = None if node_ids is None else set(node_ids)
    if wanted is not None and len(wanted) <= 500:
        rows, nodes = rows.where(Allocation.node_id.in_(sorted(wanted))), nodes.where(Node.id.in_(sorted(wanted)))
    for node_id, cpu, memory in conn.execute(rows.group_by(Allocation.node_id)):
        if wanted is None or node_id in wanted:
            held[node_id] = (int(cpu or 0), int(memory or 0))
    counted = {i: (int(c), int(m)) for i, c, m in conn.execute(nodes) if wanted is None or i in wanted}
    fixes = [
        dict(b_id=i, b_cpu=held.get(i, (0, 0))[0], b_memory=held.get(i, (0, 0))[1])
        for i in sorted(set(held) | set(counted))
        if held.get(i, (0, 0)) != counted.get(i, (0, 0))
    ]
    if fixes:
        nodes_t = cast(Table, Node.__table__)
        conn.execute(
            update(nodes_t)
            .where(nodes_t.c.id == bindparam("b_id"))
            .values(cpu_used=bindparam("b_cpu"), memory_used=bindparam("b_memory")),
            fixes,
        )
        log.warning("host_use_recounted", nodes=len(fixes))
    return len(fixes)


def _give_back_use(conn: Connection, job_id: str, attempt: int, only: str = "", **params: Any) -> None:
    """Lower the nodes' held host resources by what the attempt's active allocation rows carry (those matching
    `only`, an SQL condition on `a`), before the caller releases those rows in the same transaction. It reads
    nothing back, so it can go in a pipeline (ledger.pipelined); the cycle lock keeps a second writer from
    releasing the same rows meanwhile."""
    rows = (
        "FROM allocations a WHERE a.job_id = :job_id AND a.attempt = :attempt AND a.released_at IS NULL "
        f"AND a.kind != 'hold' AND (a.cpu_milli > 0 OR a.memory > 0){' AND ' + only if only else ''}"
    )
    conn.execute(
        text(
            f"UPDATE nodes SET cpu_used = cpu_used - (SELECT COALESCE(SUM(a.cpu_milli), 0) {rows} "
            f"AND a.node_id = nodes.id), memory_used = memory_used - (SELECT COALESCE(SUM(a.memory), 0) {rows} "
            f"AND a.node_id = nodes.id) WHERE id IN (SELECT a.node_id {rows})"
        ),
        dict(params, job_id=job_id, attempt=attempt),
    )


def _hold(
    conn: Connection, job: JobRecord, replica: int, node: NodeRecord, gpu: int, part: Partial, now: float
) -> None:
    """Open the GPU's hold row if it has none (the unique index refuses it while a whole-GPU job holds the GPU),
    then add this part's use to it, guarded so a GPU never goes over 1000 thousandths nor mixes MIG and shares."""
    gpu_id = node.gpu_ids[gpu]
    mode = "mig" if part.profile else "milli"
    used = part.size * 125 if part.profile else part.milli
    params = dict(
        job_id=job.id,
        attempt=job.attempt,
        replica=replica,
        node_id=node.id,
        gpu_id=gpu_id,
        gpu_index=gpu,
        now=now,
        mode=mode,
        used=used,
    )
    conn.execute(
        text(
            "INSERT INTO allocations (job_id, attempt, replica, node_id, gpu_id, gpu_index, reserved_at, kind, unit, "
            "profile, gpu_milli) SELECT :job_id, :attempt, :replica, :node_id, :gpu_id, :gpu_index, :now, 'hold', -1, "
            ":mode, 0 WHERE NOT EXISTS (SELECT 1 FROM allocations WHERE gpu_id = :gpu_id AND kind = 'hold' "
            "AND released_at IS NULL)"
        ),
        params,
    )
    result = conn.execute(
        text(
            "UPDATE allocations SET gpu_milli = gpu_milli + :used WHERE gpu_id = :gpu_id AND kind = 'hold' "
            "AND released_at IS NULL AND profile = :mode AND gpu_milli + :used <= 1000"
        ),
        params,
    )
    if result.rowcount != 1:
        raise IntegrityError(
            "hold",
            params,
            RuntimeError(
                f"GPU {gpu} of {node.name} cannot take {'MIG ' + part.profile if part.profile else str(part.milli) + '/1000'} "
                "now: it is used another way or has too little left"
            ),
        )


def read_releasing(conn: Connection, node_ids: Sequence[int] | None = None) -> dict[int, dict[str, tuple[int, ...]]]:
    """Whole GPUs held for ended attempts until their node's agent says the attempt's processes are gone: node id ->
    {"job/attempt": GPU indexes}. An active allocation row of an attempt that is not its job's running one."""
    stmt = text(
        "SELECT a.node_id, a.job_id, a.attempt, a.gpu_index FROM allocations a JOIN jobs j ON j.id = a.job_id "
        "WHERE a.released_at IS NULL AND a.kind = 'gpu' AND NOT (j.state = 'RUNNING' AND j.attempt = a.attempt)"
    )
    out: dict[int, dict[str, list[int]]] = {}
    wanted = None if node_ids is None else set(node_ids)
    for node_id, job_id, attempt, gpu in conn.execute(stmt):
        if wanted is None or node_id in wanted:
            out.setdefault(node_id, {}).setdefault(f"{job_id}/{attempt}", []).append(gpu)
    return {n: {k: tuple(sorted(g)) for k, g in held.items()} for n, held in out.items()}


def read_releasing_use(
    conn: Connection, node_ids: Sequence[int] | None = None
) -> dict[int, dict[str, tuple[int, int]]]:
    """The host resources held with read_releasing's GPUs: node id -> {"job/attempt": (thousandths of CPUs,
    bytes)}, only where they are not 0."""
    stmt = text(
        "SELECT a.node_id, a.job_id, a.attempt, a.cpu_milli, a.memory FROM allocations a JOIN jobs j ON j.id = a.job_id "
        "WHERE a.released_at IS NULL AND a.kind = 'gpu' AND (a.cpu_milli > 0 OR a.memory > 0) "
        "AND NOT (j.state = 'RUNNING' AND j.attempt = a.attempt)"
    )
    out: dict[int, dict[str, tuple[int, int]]] = {}
    wanted = None if node_ids is None else set(node_ids)
    for node_id, job_id, attempt, cpu, memory in conn.execute(stmt):
        if wanted is None or node_id in wanted:
            held = out.setdefault(node_id, {})
            key = f"{job_id}/{attempt}"
            was = held.get(key, (0, 0))
            held[key] = (was[0] + cpu, was[1] + memory)
    return out


def release_attempt_on_node(conn: Connection, node_id: int, job_id: str, attempt: int, now: float) -> int:
    """The agent of `node_id` says the attempt's processes there are gone: its GPUs (and host resources) there are
    free. Returns rows."""
    _changed_nodes(conn, node_id)
    _give_back_use(conn, job_id, attempt, "a.node_id = :node_id AND a.kind = 'gpu'", node_id=node_id)
    return conn.execute(
        update(Allocation)
        .where(
            Allocation.node_id == node_id,
            Allocation.job_id == job_id,
            Allocation.attempt == attempt,
            Allocation.released_at.is_(None),
            Allocation.kind == "gpu",
        )
        .values(released_at=now)
    ).rowcount


def release_allocations(conn: Connection, job: JobRecord, now: float, keep: frozenset[int] = frozenset()) -> None:
    """Release the job's rows; a split GPU's hold gives back their use and is released with its last part. The
    whole-GPU rows on the nodes of `keep` (ids) stay held until their agents confirm the attempt's processes are
    gone (release_attempt_on_node)."""
    _changed_jobs(conn, job.id)
    where = [
        Allocation.job_id == job.id,
        Allocation.attempt == job.attempt,
        Allocation.released_at.is_(None),
        Allocation.kind != "hold",
    ]
    if keep:
        _changed_nodes(conn, *keep)
        where.append(~(Allocation.node_id.in_(sorted(keep)) & (Allocation.kind == "gpu")))
    if job.cpu_milli or job.memory:
        kept = ", ".join(str(int(n)) for n in sorted(keep))
        _give_back_use(conn, job.id, job.attempt, f"NOT (a.node_id IN ({kept}) AND a.kind = 'gpu')" if keep else "")
    conn.execute(update(Allocation).where(*where).values(released_at=now))
    if job.partials:
        _release_holds(conn, job, now)


def _release_holds(conn: Connection, job: JobRecord, now: float) -> None:
    """A split GPU's hold gives back the use of the job's parts on it, and is released with its last part. While
    other jobs' parts remain, the hold passes to one of them: it always carries a job that holds part of the GPU
    (so it never outlives its job's rows, which retention deletes, while the GPU is still split)."""
    remaining = (
        "(SELECT a.{col} FROM allocations a WHERE a.gpu_id = allocations.gpu_id AND a.kind IN ('mig', 'share') "
        "AND a.released_at IS NULL ORDER BY a.id LIMIT 1)"
    )
    for replica, _node_name, _gpus in job.allocations:
        part = job.partials.get(replica)
        if part is None:
            continue
        used = part.size * 125 if part.profile else part.milli
        conn.execute(
            text(
                "UPDATE allocations SET gpu_milli = gpu_milli - :used, "
                "released_at = CASE WHEN EXISTS (SELECT 1 FROM allocations a WHERE a.gpu_id = allocations.gpu_id "
                "AND a.kind IN ('mig', 'share') AND a.released_at IS NULL) THEN NULL ELSE :now END, "
                f"job_id = COALESCE({remaining.format(col='job_id')}, job_id), "
                f"attempt = COALESCE({remaining.format(col='attempt')}, attempt), "
                f"replica = COALESCE({remaining.format(col='replica')}, replica) "
                "WHERE kind = 'hold' AND released_at IS NULL AND gpu_id = (SELECT gpu_id FROM allocations b "
                "WHERE b.job_id = :job_id AND b.attempt = :attempt AND b.replica = :replica LIMIT 1)"
            ),
            dict(used=used, now=now, job_id=job.id, attempt=job.attempt, replica=replica),
        )


_RELEASE = (
    update(cast(Table, Allocation.__table__))
    .where(
        Allocation.__table__.c.job_id == bindparam("b_job"),
        Allocation.__table__.c.attempt == bindparam("b_attempt"),
        Allocation.__table__.c.released_at.is_(None),
        Allocation.__table__.c.kind != "hold",
    )
    .values(released_at=bindparam("b_now"))
)


def release_allocations_many(conn: Connection, items: Sequence[tuple[Any, ...]]) -> None:
    """`release_allocations` for many jobs: the whole-GPU and part rows in one statement for all; a split GPU's
    hold, which needs its own statement, job by job; a job keeping GPUs held on some nodes, on its own."""
    alone = [row for row in items if (len(row) > 2 and row[2]) or row[0].cpu_milli or row[0].memory]
    for row in alone:  # keeping GPUs held on some nodes, or giving back host resources: one statement each
        release_allocations(conn, row[0], row[1], row[2] if len(row) > 2 else frozenset())
    items = [(row[0], row[1]) for row in items if not ((len(row) > 2 and row[2]) or row[0].cpu_milli or row[0].memory)]
    if not items:
        return
    _changed_jobs(conn, *(j.id for j, _ in items))
    conn.execute(_RELEASE, [dict(b_job=j.id, b_attempt=j.attempt, b_now=now) for j, now in items])
    for job, now in items:
        if job.partials:
            _release_holds(conn, job, now)
