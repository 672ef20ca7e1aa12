"""SQL over the ledger for the scheduler: loading the view, and the writes each transition makes.

Every function takes an open Connection inside the caller's transaction and never commits: the scheduling cycle
groups a whole batch of decisions into one durable commit.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import structlog
from sqlalchemy import Connection, Table, and_, bindparam, case, func, insert, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError

from db.migrate import ensure_cluster_id as _ensure_cluster_id
from db.migrate import read_cluster_id
from db.models import (
    Allocation,
    Assignment,
    Checkpoint,
    CheckpointRequest,
    CheckpointRestore,
    Gpu,
    Job,
    JobAttempt,
    LedgerClock,
    Node,
    NodeEvent,
    Queue,
    Rank,
    ServiceEndpoint,
)
from db.models import (
    Claim as ClaimRow,
)
from phalanx.core import mig
from phalanx.core.claims import Claim
from phalanx.core.closeness import GpuCloseness
from phalanx.core.model import ReplicaPlacement
from phalanx.core.quota import FlavorQuota, QueueSpec

from .state import JobRecord, MigSwitch, NodeRecord, Partial, SchedulerState, layout_ranks, touch

log = structlog.get_logger()

T = TypeVar("T")
NOTIFY_CHANNEL = "phalanx_events"
CHANGES = "phalanx_changes"  # Connection.info key of the transaction's Changes (see track_changes)


class Changes:
    """What one scheduling transaction changed in the rows the replicas' views hold, recorded by the writes below
    and stored with the generation it made (ledger_changes), so another replica reloads only these rows.

    `jobs`: job ids whose job, allocation or rank rows changed; `nodes`, `gpus`: ids of node and GPU rows changed
    in what a view holds (state, health, topology, MIG); `beats`, `acks`, `revisions`: node id -> the new value of
    a monotonic column (applied as it is, no reload); `queues`: a queue changed; `assigned`: nodes given
    assignments (their streams wake)."""

    __slots__ = ("acks", "assigned", "beats", "gpus", "jobs", "nodes", "queues", "revisions", "sched")

    def __init__(self) -> None:
        self.jobs: set[str] = set()
        self.nodes: set[int] = set()
        self.gpus: set[int] = set()
        self.beats: dict[int, float] = {}
        self.acks: dict[int, int] = {}
        self.revisions: dict[int, int] = {}
        self.queues = False
        self.assigned: set[str] = set()
        # Whether a write changed what a scheduling pass decides on (a job's state, allocations, a node, a GPU, a
        # queue); rank reports, heartbeats and acks do not: a cycle without such a write need not pass again.
        self.sched = False

    @property
    def any(self) -> bool:
        return bool(self.jobs or self.nodes or self.gpus or self.beats or self.acks or self.revisions or self.queues)

    def to_json(self) -> str:
        return json.dumps(
            {
                "jobs": sorted(self.jobs),
                "nodes": sorted(self.nodes),
                "gpus": sorted(self.gpus),
                "beats": self.beats,
                "acks": self.acks,
                "revisions": self.revisions,
                "queues": self.queues,
                "assigned": sorted(self.assigned),
                "sched": self.sched,
            },
            separators=(",", ":"),
        )

    def merge_json(self, body: str) -> None:
        d = json.loads(body)
        self.jobs.update(d["jobs"])
        self.nodes.update(d["nodes"])
        self.gpus.update(d["gpus"])
        for mine, theirs in ((self.beats, d["beats"]), (self.acks, d["acks"]), (self.revisions, d["revisions"])):
            for key, value in theirs.items():
                if value > mine.get(int(key), value - 1):
                    mine[int(key)] = value
        self.queues = self.queues or d["queues"]
        self.assigned.update(d["assigned"])
        self.sched = self.sched or d["sched"]


def track_changes(conn: Connection) -> Changes:
    """Record what this transaction writes to the view's rows (until untrack_changes)."""
    changes = conn.info[CHANGES] = Changes()
    return changes


def untrack_changes(conn: Connection) -> None:
    conn.info.pop(CHANGES, None)


def _changed_jobs(conn: Connection, *job_ids: str, sched: bool = True) -> None:
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.jobs.update(job_ids)
        changes.sched = changes.sched or sched


def _changed_nodes(conn: Connection, *node_ids: int) -> None:
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.nodes.update(node_ids)
        changes.sched = True


def _changed_queues(conn: Connection) -> None:
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.queues = changes.sched = True


def _raised(conn: Connection, column: str, values: dict[int, Any]) -> None:
    changes = conn.info.get(CHANGES)
    if changes is None:
        return
    mine = {"last_heartbeat": changes.beats, "acked_revision": changes.acks, "revision": changes.revisions}[column]
    for key, value in values.items():
        if value > mine.get(key, value - 1):
            mine[key] = value


class Clock(NamedTuple):
    """The clock row as a cycle finds it under its lock: the generation and who leads (see `take_lease`)."""

    generation: int
    leader: str
    epoch: int
    until: float
    now: float  # the database's clock (PostgreSQL), so replicas on different hosts compare leases alike


def begin_cycle(conn: Connection) -> Clock:
    """Serialise scheduling transactions across replicas; return the ledger generation and the leadership lease.

    On PostgreSQL the row lock on the clock row (held to commit) makes cycles of different replicas take turns,
    so their other row locks can never deadlock and each cycle decides on a view no older than the last commit;
    SQLite's BEGIN IMMEDIATE already does this. The generation tells whether anyone else wrote since this
    replica's last cycle. The lease columns change only under this same lock, so what a cycle reads here holds
    until it commits.
    """
    if conn.dialect.name == "postgresql":
        # Pipelined, psycopg sends its BEGIN and this query together: one round trip where there were two.
        # (On the driver's connection: SQLAlchemy wants a result's columns before a pipeline has them.)
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.pipeline():
            cursor = driver.execute(
                "SELECT generation, leader, leader_epoch, leader_until, extract(epoch FROM clock_timestamp())::float8 "
                "FROM ledger_clock WHERE id = 1 FOR UPDATE"
            )
            row = cursor.fetchone()
        return Clock(int(row[0]), row[1] or "", int(row[2] or 0), float(row[3] or 0.0), float(row[4]))
    row = conn.execute(
        select(LedgerClock.generation, LedgerClock.leader, LedgerClock.leader_epoch, LedgerClock.leader_until).where(
            LedgerClock.id == 1
        )
    ).one()
    return Clock(int(row[0]), row[1] or "", int(row[2] or 0), float(row[3] or 0.0), time.time())


def take_lease(conn: Connection, clock: Clock, replica: str, lease_s: float, *, epoch: int | None) -> Clock | None:
    """Acquire or renew the leadership lease; the caller holds the clock row (begin_cycle).

    `epoch`: the epoch this replica holds (renewal), None to acquire (the row must be free or expired; the epoch
    goes up by one). Fenced: the statement's WHERE clause checks the epoch the caller read, and a renewal the
    leader and epoch it holds, so a deposed leader's renewal changes nothing. Returns the new row, None when
    refused."""
    until = clock.now + lease_s
    if epoch is None:
        new_epoch = clock.epoch + 1
        stmt = (
            update(LedgerClock)
            .where(
                LedgerClock.id == 1,
                LedgerClock.leader_epoch == clock.epoch,
                or_(LedgerClock.leader == "", LedgerClock.leader == replica, LedgerClock.leader_until < clock.now),
            )
            .values(leader=replica, leader_epoch=new_epoch, leader_until=until)
        )
    else:
        new_epoch = epoch
        stmt = (
            update(LedgerClock)
            .where(LedgerClock.id == 1, LedgerClock.leader == replica, LedgerClock.leader_epoch == epoch)
            .values(leader_until=until)
        )
    if conn.execute(stmt).rowcount != 1:
        return None
    return clock._replace(leader=replica, epoch=new_epoch, until=until)


def release_lease(conn: Connection, replica: str, epoch: int) -> bool:
    """Give the lease up (a graceful stop), so another replica leads at once instead of after the lease."""
    return (
        conn.execute(
            update(LedgerClock)
            .where(LedgerClock.id == 1, LedgerClock.leader == replica, LedgerClock.leader_epoch == epoch)
            .values(leader="", leader_until=0.0)
        ).rowcount
        == 1
    )


def bump_generation(conn: Connection, generation: int, notice: dict[str, Any] | None = None) -> int:
    """Set the next generation (the caller holds the clock row, so it knows the current one); on PostgreSQL the
    same statement queues the NOTIFY that wakes other replicas (delivered at commit, never on rollback)."""
    if conn.dialect.name == "postgresql" and notice is not None:
        body = json.dumps(notice, separators=(",", ":"))
        if len(body) > 7000:
            body = json.dumps({"replica": notice.get("replica"), "all": True})
        conn.exec_driver_sql(
            "UPDATE ledger_clock SET generation = %s WHERE id = 1 AND pg_notify(%s, %s) IS NOT NULL",
            (generation + 1, NOTIFY_CHANNEL, body),
        )
    else:
        conn.execute(update(LedgerClock).where(LedgerClock.id == 1).values(generation=generation + 1))
    return generation + 1


CHANGES_KEPT_S = 600.0  # ledger_changes rows older than this are deleted: a replica further behind reloads whole


def record_changes(conn: Connection, generation: int, replica: str, changes: Changes, now: float) -> None:
    """Store what the transaction that made `generation` changed (the caller holds the clock row)."""
    conn.execute(
        text("INSERT INTO ledger_changes (generation, replica, at, body) VALUES (:g, :r, :at, :body)"),
        dict(g=generation, r=replica, at=now, body=changes.to_json()),
    )


def read_changes(conn: Connection, after: int, upto: int) -> Changes | None:
    """What the transactions that made generations after+1 .. upto changed, merged; None when a row is missing
    (pruned, or written by a version that did not record changes): the caller reloads its whole view."""
    if upto - after > 100_000:
        return None
    rows = conn.execute(
        text("SELECT generation, body FROM ledger_changes WHERE generation > :a AND generation <= :u"),
        dict(a=after, u=upto),
    ).all()
    if len(rows) != upto - after:
        return None
    merged = Changes()
    for _, body in sorted(rows):
        merged.merge_json(body)
    return merged


def prune_changes(conn: Connection, before: float) -> None:
    conn.execute(text("DELETE FROM ledger_changes WHERE at < :t"), dict(t=before))


@contextlib.contextmanager
def pipelined(conn: Connection, enabled: bool = True):
    """On PostgreSQL, send the statements issued inside without waiting for each reply (psycopg pipeline mode):
    a cycle's closing writes need no results, so they cost one round trip instead of one each."""
    if conn.dialect.name != "postgresql" or not enabled:
        yield
        return
    with conn.connection.driver_connection.pipeline():
        yield


def load_state(conn: Connection, state: SchedulerState, fabric_path) -> None:
    """Replace the in-memory view with what the ledger holds now (built aside, then swapped in at once)."""
    recount_use(conn)
    nodes = read_node_records(conn, fabric_path)
    jobs = read_job_records(conn, {n.id: n.name for n in nodes.values()})
    state.nodes, state.jobs = nodes, jobs
    state.claims = read_claims(conn)
    state.queues = load_queues(conn)
    state.rebuild_capacity()


def read_node_records(conn: Connection, fabric_path, node_ids: Iterable[int] | None = None) -> dict[str, NodeRecord]:
    """The nodes (all, or those of `node_ids`) as view records, with their GPUs' ids, MIG modes and switches."""
    wanted = None if node_ids is None else sorted(set(node_ids))
    nodes: dict[str, NodeRecord] = {}
    if wanted is not None and not wanted:
        return nodes
    gpu_ids: dict[int, dict[int, int]] = {}
    memory: dict[int, int] = {}
    mig_gpus: dict[int, set[int]] = {}
    foreign: dict[int, dict[int, int]] = {}
    switches: dict[int, tuple[dict, dict, dict]] = {}  # node id -> (switches, pending modes, switched at)
    gpu_stmt = select(
        Gpu.id, Gpu.node_id, Gpu.index, Gpu.memory_mib, Gpu.mig_mode, Gpu.mig_instances, *MIG_SWITCH_COLUMNS
    )
    node_stmt = select(*Node.__table__.c)
    if wanted is not None:
        gpu_stmt = gpu_stmt.where(Gpu.node_id.in_(wanted))
        node_stmt = node_stmt.where(Node.id.in_(wanted))
    for row in conn.execute(gpu_stmt):
        gpu_ids.setdefault(row.node_id, {})[row.index] = row.id
        if row.mig_switch_to or row.mig_mode_pending or row.mig_switched_at:
            mine = switches.setdefault(row.node_id, ({}, {}, {}))
            if row.mig_switch_to:
                mine[0][row.index] = MigSwitch(
                    row.mig_switch_to == "ENABLED",
                    row.mig_switch_at or 0.0,
                    int(row.mig_switch_revision or 0),
                    row.mig_switch_error or "",
                    row.mig_retry_after or 0.0,
                )
            if row.mig_mode_pending:
                mine[1][row.index] = row.mig_mode_pending == "ENABLED"
            if row.mig_switched_at:
                mine[2][row.index] = row.mig_switched_at
        memory[row.node_id] = max(memory.get(row.node_id, 0), row.memory_mib or 0)
        if row.mig_mode == "ENABLED":
            mig_gpus.setdefault(row.node_id, set()).add(row.index)
        mask = foreign_mask(_json_list(row.mig_instances))
        if mask:
            foreign.setdefault(row.node_id, {})[row.index] = mask
    releasing = read_releasing(conn, wanted)
    releasing_use = read_releasing_use(conn, wanted)
    for n in conn.execute(node_stmt).mappings():
        path = tuple(n["fabric_path"] or ()) or fabric_path(n["name"])
        nodes[n["name"]] = NodeRecord(
            id=n["id"],
            name=n["name"],
            state=n["state"],
            gpus=n["gpus"],
            gpu_ids=gpu_ids.get(n["id"], {}),
            gpu_model=n["gpu_model"] or "",
            memory_mib=memory.get(n["id"], 0),
            path=path,
            address=n["address"],
            last_heartbeat=n["last_heartbeat"],
            persisted_heartbeat=n["last_heartbeat"],
            agent_instance=n["agent_instance"],
            revision=n["revision"],
            closeness=node_closeness(n["topology"]),
            health=n["health"] or "HEALTHY",
            health_reason=(n["health_detail"] or {}).get("reason", ""),
            gpu_health=gpu_health_from_detail(n["health_detail"]),
            mig_gpus=frozenset(mig_gpus.get(n["id"], ())),
            foreign=foreign.get(n["id"], {}),
            mig_manage=bool(n["mig_manage"]),
            acked_revision=int(n["acked_revision"] or 0),
            confirms_release=bool(n["confirms_release"]),
            releasing=releasing.get(n["id"], {}),
            releasing_use=releasing_use.get(n["id"], {}),
            rank_ports=(int(n["rank_port_low"] or 0), int(n["rank_port_high"] or 0)),
            cpu_milli=int(n["cpu_milli"] or 0),
            memory=int(n["memory"] or 0),
        )
        if n["id"] in switches:
            node = nodes[n["name"]]
            node.mig_switches, node.mig_pending, node.mig_switched_at = switches[n["id"]]
    return nodes


def read_job_records(
    conn: Connection, names: dict[int, str], job_ids: Iterable[str] | None = None
) -> dict[str, JobRecord]:
    """The active (PENDING and RUNNING) jobs, all or those of `job_ids`, with the current attempt's allocations
    and ranks. `names`: node id -> name."""
    jobs: dict[str, JobRecord] = {}
    stmt = select(*Job.__table__.c).where(Job.state.in_(("PENDING", "RUNNING")))
    if job_ids is None:
        for j in conn.execute(stmt).mappings():
            jobs[j["id"]] = job_from_row(j)
    else:
        for chunk in _chunks(sorted(set(job_ids)), 500):
            for j in conn.execute(stmt.where(Job.id.in_(chunk))).mappings():
                jobs[j["id"]] = job_from_row(j)
    running = [j.id for j in jobs.values() if j.state == "RUNNING"]
    for chunk in _chunks(running, 500):
        rows = conn.execute(
            select(
                Allocation.job_id,
                Allocation.replica,
                Allocation.node_id,
                Allocation.gpu_index,
                Allocation.kind,
                Allocation.unit,
                Allocation.profile,
                Allocation.gpu_milli,
            )
            .join(Job, and_(Job.id == Allocation.job_id, Job.attempt == Allocation.attempt))
            .where(Allocation.job_id.in_(chunk), Allocation.kind != "hold")
            .order_by(Allocation.job_id, Allocation.replica, Allocation.gpu_index, Allocation.unit)
        )
        for job_id, (allocs, partials) in _group_allocations(rows, names).items():
            jobs[job_id].allocations = allocs
            jobs[job_id].partials = partials
            jobs[job_id].ranks = layout_ranks(jobs[job_id])
        ranks = conn.execute(
            select(*Rank.__table__.c)
            .join(Job, and_(Job.id == Rank.job_id, Job.attempt == Rank.attempt))
            .where(Rank.job_id.in_(chunk))
        ).mappings()
        for r in ranks:
            known = jobs[r["job_id"]].ranks.get(r["rank"])
            if known is not None:
                known.state, known.exit_code = r["state"], r["exit_code"]
    return jobs


def nodes_of_gpus(conn: Connection, gpu_ids: Iterable[int]) -> set[int]:
    wanted = sorted(set(gpu_ids))
    if not wanted:
        return set()
    return {r.node_id for r in conn.execute(select(Gpu.node_id).where(Gpu.id.in_(wanted)))}


def queue_spec(row: Any) -> QueueSpec:
    quotas = {}
    for flavor, q in (row["quotas"] or {}).items():
        quotas[flavor] = FlavorQuota(
            gpus=float(q.get("gpus", 0)),
            mig_slices=int(q.get("mig_slices", 0)),
            borrow_limit=None if q.get("borrow_limit") is None else float(q["borrow_limit"]),
        )
    return QueueSpec(
        row["name"],
        quotas,
        cohort=row["cohort"] or "",
        weight=float(row["weight"] or 1.0),
        tenants=frozenset(row["tenants"] or ()),
        max_priority=int(row.get("max_priority") or 0),
    )


def load_queues(conn: Connection) -> dict[str, QueueSpec]:
    return {r["name"]: queue_spec(r) for r in conn.execute(select(*Queue.__table__.c)).mappings()}


def upsert_queue(conn: Connection, spec: QueueSpec, now: float) -> None:
    values = dict(
        cohort=spec.cohort,
        weight=spec.weight,
        tenants=sorted(spec.tenants),
        max_priority=spec.max_priority,
        updated_at=now,
        quotas={
            f: {"gpus": q.gpus, "mig_slices": q.mig_slices, "borrow_limit": q.borrow_limit}
            for f, q in spec.quotas.items()
        },
    )
    _changed_queues(conn)
    dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    conn.execute(
        dialect_insert(Queue)
        .values(name=spec.name, **values)
        .on_conflict_do_update(index_elements=["name"], set_=values)
    )


def delete_queue(conn: Connection, name: str) -> None:
    _changed_queues(conn)
    conn.execute(Queue.__table__.delete().where(Queue.name == name))


def node_closeness(topology: Any) -> GpuCloseness | None:
    """The GPU closeness of a node from its stored `topology` (the registered HostTopology as a dict); None when
    it has no GPU matrix or cannot be read (placement then chooses GPUs by index)."""
    if isinstance(topology, str):  # a JSON column read back as text by some drivers
        try:
            topology = json.loads(topology)
        except ValueError:
            return None
    if not isinstance(topology, dict):
        return None
    try:
        return GpuCloseness.from_topology(topology)
    except (TypeError, ValueError, AttributeError):
        return None


_RECORDSET_SQL: dict[tuple[str, tuple[str, ...]], tuple[str, tuple[str, ...]]] = {}


def insert_rows(conn: Connection, table, rows: list[dict[str, Any]]) -> None:
    """Insert many rows in one statement.

    On PostgreSQL the rows travel as one JSON document, expanded by `json_to_recordset`: one round trip and one
    cached statement whatever the gang size, and the encoding runs in C (psycopg's `executemany` sends a statement
    per row, and adapting per-column arrays costs more than the insert). SQLite's executemany runs in C already.
    """
    if not rows:
        return
    if conn.dialect.name != "postgresql":
        conn.execute(insert(table), rows)
        return
    tbl = table.__table__
    names = tuple(rows[0])
    key = (tbl.name, names)
    cached = _RECORDSET_SQL.get(key)
    if cached is None:
        types = [tbl.c[n].type.compile(dialect=conn.dialect) for n in names]
        binary = tuple(n for n, t in zip(names, types, strict=True) if t.upper() == "BYTEA")
        cols = ", ".join(f'"{n}"' for n in names)
        select_list = ", ".join(f"decode(\"{n}\", 'base64')" if n in binary else f'"{n}"' for n in names)
        record = ", ".join(f'"{n}" {"text" if n in binary else t}' for n, t in zip(names, types, strict=True))
        sql = f'INSERT INTO "{tbl.name}" ({cols}) SELECT {select_list} FROM json_to_recordset(%s::json) AS t({record})'
        cached = _RECORDSET_SQL[key] = (sql, binary)
    sql, binary = cached
    if binary:
        rows = [{**r, **{n: base64.b64encode(r[n]).decode() for n in binary}} for r in rows]
    conn.exec_driver_sql(sql, (json.dumps(rows, separators=(",", ":")),))


def _chunks(items: Sequence[T], size: int) -> Iterable[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _group_allocations(rows, names: dict[int, str]) -> dict[str, tuple[list, dict[int, Partial]]]:
    """Allocation rows (job, replica, node id, GPU, kind, unit, profile, milli) -> per job: (replica, node, GPUs)
    in replica order, and the partial-GPU use of the replicas that have one."""
    grouped: dict[str, dict[int, tuple[str, list[int]]]] = {}
    partials: dict[str, dict[int, Partial]] = {}
    for job_id, replica, node_id, gpu_index, kind, unit, profile, milli in rows:
        gpus = grouped.setdefault(job_id, {}).setdefault(replica, (names[node_id], []))[1]
        if gpu_index not in gpus:
            gpus.append(gpu_index)
        if kind == "mig":
            known = partials.setdefault(job_id, {}).get(replica)
            start = unit if known is None else min(known.start, unit)
            size = 1 if known is None else known.size + 1
            partials[job_id][replica] = Partial(profile=profile, start=start, size=size)
        elif kind == "share":
            partials.setdefault(job_id, {})[replica] = Partial(milli=milli)
    return {
        job_id: ([(rep, node, tuple(gpus)) for rep, (node, gpus) in sorted(reps.items())], partials.get(job_id, {}))
        for job_id, reps in grouped.items()
    }


def job_from_row(j) -> JobRecord:
    return JobRecord(
        id=j["id"],
        name=j["name"],
        state=j["state"],
        priority=j["priority"],
        replicas=j["replicas"],
        gpus_per_replica=j["gpus_per_replica"],
        procs_per_replica=j["procs_per_replica"],
        command=list(j["command"]),
        env=dict(j["env"] or {}),
        submitted_at=j["submitted_at"],
        request_id=j["request_id"],
        attempt=j["attempt"],
        message=j["message"],
        exit_code=j["exit_code"],
        placement=dict(j["placement"] or {}),
        started_at=j["started_at"],
        finished_at=j["finished_at"],
        version=j["version"],
        required_tier=j["required_tier"] or "",
        preferred_tier=j["preferred_tier"] or "",
        gpu_model=j["gpu_model"] or "",
        mig_profile=j["mig_profile"] or "",
        gpu_milli=j["gpu_milli"] or 0,
        failures=j["failures"] or 0,
        preemptions=j["preemptions"] or 0,
        not_before=j["not_before"] or 0.0,
        preempted_by=j["preempted_by"] or "",
        preempt_deadline=j["preempt_deadline"] or 0.0,
        max_restarts=j["max_restarts"] or 0,
        tenant=j["tenant"] or "",
        time_limit=j["time_limit"] or 0.0,
        queue=j["queue"] or "default",
        flavor=j["flavor"] or "",
        struck_nodes=[str(n) for n in _json_list(j.get("struck_nodes"))],
        keep_checkpoints=j.get("keep_checkpoints") or 0,
        cpu_milli=j.get("cpu_milli") or 0,
        memory=j.get("memory") or 0,
        by_admin=bool(j.get("by_admin", True)),
    )


def insert_jobs(conn: Connection, jobs: Sequence[JobRecord]) -> None:
    _changed_jobs(conn, *(j.id for j in jobs))
    insert_rows(
        conn,
        Job,
        [
            dict(
                id=j.id,
                request_id=j.request_id,
                name=j.name,
                state=j.state,
                priority=j.priority,
                replicas=j.replicas,
                gpus_per_replica=j.gpus_per_replica,
                procs_per_replica=j.procs_per_replica,
                command=j.command,
                env=j.env,
                attempt=j.attempt,
                message=j.message,
                exit_code=j.exit_code,
                placement=j.placement,
                submitted_at=j.submitted_at,
                started_at=j.started_at,
                finished_at=j.finished_at,
                version=j.version,
                required_tier=j.required_tier,
                preferred_tier=j.preferred_tier,
                gpu_model=j.gpu_model,
                mig_profile=j.mig_profile,
                gpu_milli=j.gpu_milli,
                failures=j.failures,
                preemptions=j.preemptions,
                not_before=j.not_before,
                preempted_by=j.preempted_by,
                preempt_deadline=j.preempt_deadline,
                max_restarts=j.max_restarts,
                tenant=j.tenant,
                time_limit=j.time_limit,
                queue=j.queue,
                flavor=j.flavor,
                struck_nodes=list(j.struck_nodes),
                keep_checkpoints=j.keep_checkpoints,
                cpu_milli=j.cpu_milli,
                memory=j.memory,
                by_admin=j.by_admin,
            )
            for j in jobs
        ],
    )


def find_by_request_ids(conn: Connection, request_ids: Sequence[str]) -> dict[str, str]:
    if not request_ids:
        return {}
    rows = conn.execute(select(Job.request_id, Job.id).where(Job.request_id.in_(request_ids)))
    return {r.request_id: r.id for r in rows}


JOB_WRITES = "phalanx_job_writes"  # Connection.info key of the transaction's deferred job writes (update_job)


class StaleJobs(Exception):
    """The ledger did not hold a job as the view did when its deferred compare-and-set was written: another
    writer changed it. The transaction must not commit (the service rolls it back and reloads its view)."""


def update_job(conn: Connection, job: JobRecord, **changes: Any) -> None:
    """Change a job, compare-and-set on its version. The view changes now; the row is written by
    flush_job_updates (one statement per set of changed columns for the whole cycle, not one round trip per
    job), which raises StaleJobs when another writer got there first. Cycles take turns on a view no older than
    the last commit (begin_cycle), so that means a bug or a writer outside the scheduler, never a normal race.
    Several changes of one job in a cycle are written as one."""
    pending: dict[str, list[Any]] = conn.info.setdefault(JOB_WRITES, {})
    entry = pending.get(job.id)
    if entry is None:
        pending[job.id] = [job.version, dict(changes), job.version + 1]
    else:
        entry[1].update(changes)
        entry[2] = job.version + 1
    _changed_jobs(conn, job.id)
    job.version += 1
    for key, value in changes.items():
        setattr(job, key, value)
    touch(job)


def flush_job_updates(conn: Connection) -> None:
    """Write the jobs update_job changed since the last flush, each from the version the view had read to the
    version it has now; StaleJobs when a row did not hold the version read."""
    pending: dict[str, list[Any]] | None = conn.info.pop(JOB_WRITES, None)
    if not pending:
        return
    table = cast(Table, Job.__table__)
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for job_id in sorted(pending):  # one lock order for every writer
        read, values, version = pending[job_id]
        groups.setdefault(tuple(sorted(values)), []).append(
            {"b_id": job_id, "b_read": read, "b_version": version, **{f"v_{k}": v for k, v in values.items()}}
        )
    for keys, rows in groups.items():
        stmt = (
            update(table)
            .where(table.c.id == bindparam("b_id"), table.c.version == bindparam("b_read"))
            .values({"version": bindparam("b_version"), **{k: bindparam(f"v_{k}") for k in keys}})
        )
        result = conn.execute(stmt, rows)
        if result.rowcount != len(rows):
            raise StaleJobs(
                f"{len(rows) - result.rowcount} of {len(rows)} job(s) changed in the ledger since the view read "
                f"them (among {', '.join(r['b_id'] for r in rows[:5])})"
            )


def insert_allocations(conn: Connection, jobs: Sequence[JobRecord], nodes: dict[str, NodeRecord], now: float) -> None:
    """Every GPU (or part of one) of every gang reserved in this cycle: the rows in one statement, then the holds
    of split GPUs (see db.models.Allocation)."""
    rows: list[dict[str, Any]] = []
    split: list[tuple[JobRecord, int, NodeRecord, int, Partial]] = []
    use: dict[int, list[int]] = {}  # node id -> [thousandths of CPUs, bytes] this cycle's gangs take there
    _changed_jobs(conn, *(j.id for j in jobs))
    for job in jobs:
        for replica, node, gpus in job.allocations:
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


RANK_VALUES = ("state", "exit_code", "pid", "message", "updated_at")


def record_ranks(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """`record_rank` for many reports in one statement; each row has the Rank columns. The last row of a rank
    wins (one statement may not update a row twice)."""
    last = {(r["job_id"], r["attempt"], r["rank"]): r for r in rows}
    if not last:
        return
    _changed_jobs(conn, *{k[0] for k in last}, sched=False)
    stmt = (pg_insert if conn.dialect.name == "postgresql" else sqlite_insert)(Rank)
    stmt = stmt.on_conflict_do_update(
        index_elements=["job_id", "attempt", "rank"], set_={c: stmt.excluded[c] for c in RANK_VALUES}
    )
    conn.execute(stmt, list(last.values()))


def append_assignments(
    conn: Connection, items: Sequence[tuple[NodeRecord, str, int, str, Any]], now: float
) -> list[tuple[str, int, Any]]:
    """Store assignments, each under its node's next revision. Returns (node name, revision, Assignment) each.

    Revisions come from the view: cycles hold the clock row and decide on a fresh view, so the next revision of a
    node is known without asking; the unique (node_id, revision) constraint would refuse a wrong one.
    `items` are (node, job id, attempt, kind, build) where `build(revision)` returns the phalanx.v1.Assignment.
    """
    rows, out = [], []
    touched: dict[int, NodeRecord] = {}
    for node, job_id, attempt, kind, build in items:
        node.revision += 1
        touched[node.id] = node
        revision = node.revision
        message = build(revision)
        payload = message.SerializeToString()
        rows.append(
            dict(
                node_id=node.id,
                revision=revision,
                job_id=job_id,
                attempt=attempt,
                kind=kind,
                payload=payload,
                created_at=now,
            )
        )
        out.append((node.name, revision, message))
    insert_rows(conn, Assignment, rows)
    _raise_node_column(conn, "revision", "int8", {nid: n.revision for nid, n in touched.items()})
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.assigned.update(n.name for n in touched.values())
    return out


def assignments_after(conn: Connection, node_name: str, after: int, limit: int = 500) -> list[tuple[int, bytes]]:
    rows = conn.execute(
        select(Assignment.revision, Assignment.payload)
        .join(Node, Node.id == Assignment.node_id)
        .where(Node.name == node_name, Assignment.revision > after)
        .order_by(Assignment.revision)
        .limit(limit)
    )
    return [(r.revision, bytes(r.payload)) for r in rows]


class Registered(NamedTuple):
    """A node's rows after its registration: ids, the acked and last assignment revisions, whether an admin
    drained it, and its GPUs' row ids by index."""

    node_id: int
    acked: int
    revision: int
    cordoned: bool
    gpu_ids: dict[int, int]


def upsert_node(
    conn: Connection,
    *,
    name: str,
    gpus: list[dict[str, Any]],
    topology: dict[str, Any],
    address: str,
    agent_instance: str,
    profile: str,
    gpu_model: str,
    fabric_path: Sequence[str],
    now: float,
    mig_manage: bool = False,
) -> tuple[int, int, int]:
    """Insert or refresh a node and its GPU rows; the node becomes READY.

    Returns (node id, acked revision, last assignment revision).
    """
    got = upsert_nodes(
        conn,
        [
            dict(
                name=name,
                gpus=gpus,
                topology=topology,
                address=address,
                agent_instance=agent_instance,
                profile=profile,
                gpu_model=gpu_model,
                fabric_path=fabric_path,
                now=now,
                mig_manage=mig_manage,
            )
        ],
    )[name]
    return got.node_id, got.acked, got.revision


_GPU_COLUMNS = ("uuid", "name", "memory_mib", "mig_mode", "mig_instances")


def upsert_nodes(conn: Connection, rows: Sequence[dict[str, Any]]) -> dict[str, Registered]:
    """Insert or refresh many nodes and their GPU rows at once (a registration storm costs a handful of
    statements per cycle, not a handful per node); every node becomes READY. `rows`: upsert_node's arguments each,
    names distinct."""
    if not rows:
        return {}
    names = [r["name"] for r in rows]
    assert len(set(names)) == len(names), "one registration per node per call"
    found: dict[str, Any] = {}
    for chunk in _chunks(names, 500):
        for hit in conn.execute(
            select(Node.id, Node.name, Node.acked_revision, Node.revision, Node.cordoned).where(Node.name.in_(chunk))
        ):
            found[hit.name] = hit
    nodes_t, gpus_t = cast(Table, Node.__table__), cast(Table, Gpu.__table__)

    def values(r: dict[str, Any]) -> dict[str, Any]:
        return dict(
            state="READY",
            message="",
            gpus=len(r["gpus"]),
            gpu_model=r["gpu_model"],
            profile=r["profile"],
            address=r["address"],
            topology=r["topology"],
            fabric_path=list(r["fabric_path"]),
            agent_instance=r["agent_instance"],
            last_heartbeat=r["now"],
            mig_manage=r.get("mig_manage", False),
            containment=r.get("containment", ""),
            confirms_release=r.get("confirms_release", False),
            rank_port_low=r.get("rank_ports", (0, 0))[0],
            rank_port_high=r.get("rank_ports", (0, 0))[1],
            cpu_milli=r.get("cpu_milli", 0),
            memory=r.get("memory", 0),
            logs_port=r.get("logs_port", 0),
        )

    new = [r for r in rows if r["name"] not in found]
    old = [r for r in rows if r["name"] in found]
    ids: dict[str, int] = {name: found[name].id for name in found}
    if new:
        inserted = conn.execute(
            insert(nodes_t).returning(nodes_t.c.id, nodes_t.c.name),
            [dict(values(r), name=r["name"], registered_at=r["now"], revision=0, acked_revision=0) for r in new],
        )
        ids.update({row.name: row.id for row in inserted})
    if old:
        cols = list(values(old[0]))
        conn.execute(
            update(nodes_t).where(nodes_t.c.id == bindparam("node_id")).values({c: bindparam(c) for c in cols}),
            [dict(values(r), node_id=ids[r["name"]]) for r in old],
        )
    known: dict[int, dict[int, int]] = {}
    old_ids = [ids[r["name"]] for r in old]
    recount_use(conn, old_ids)  # each registration re-counts its node's held host resources
    for id_chunk in _chunks(old_ids, 500):
        for node_id, index, gpu_id in conn.execute(
            select(Gpu.node_id, Gpu.index, Gpu.id).where(Gpu.node_id.in_(id_chunk))
        ):
            known.setdefault(node_id, {})[index] = gpu_id
    updates, inserts = [], []
    for reg in rows:
        node_id = ids[reg["name"]]
        mine = known.get(node_id, {})
        for g in reg["gpus"]:
            gpu = dict(
                uuid=g["uuid"],
                name=g["name"],
                memory_mib=g["memory_mib"],
                mig_mode=g.get("mig_mode", "UNSUPPORTED"),
                mig_instances=list(g.get("mig_instances", ())),
            )
            if g["index"] in mine:
                updates.append(dict(gpu, gpu_id=mine[g["index"]]))
            else:
                inserts.append(dict(gpu, node_id=node_id, index=g["index"]))
    if updates:
        conn.execute(
            update(gpus_t).where(gpus_t.c.id == bindparam("gpu_id")).values({c: bindparam(c) for c in _GPU_COLUMNS}),
            updates,
        )
    if inserts:
        made = conn.execute(insert(gpus_t).returning(gpus_t.c.node_id, gpus_t.c.index, gpus_t.c.id), inserts)
        for node_id, index, gpu_id in made:
            known.setdefault(node_id, {})[index] = gpu_id
    _changed_nodes(conn, *ids.values())
    return {
        r["name"]: Registered(
            ids[r["name"]],
            int(found[r["name"]].acked_revision or 0) if r["name"] in found else 0,
            int(found[r["name"]].revision or 0) if r["name"] in found else 0,
            bool(found[r["name"]].cordoned) if r["name"] in found else False,
            dict(known.get(ids[r["name"]], {})),
        )
        for r in rows
    }


def foreign_mask(instances: Iterable[Any]) -> int:
    """The memory slices held by MIG instances Phalanx did not make (managed false), as a GPU's slice mask. An
    instance whose geometry cannot be read holds the whole GPU."""
    mask = 0
    for inst in instances:
        if not isinstance(inst, dict) or inst.get("managed"):
            continue
        try:
            start, size = int(inst.get("start", -1)), int(inst.get("size", 0))
        except (TypeError, ValueError):
            start = size = -1
        if 0 <= start < mig.MEMORY_SLICES and 1 <= size <= mig.MEMORY_SLICES - start:
            mask |= ((1 << size) - 1) << start
        else:
            mask |= mig.FULL_MASK
        if mig.is_media(str(inst.get("profile", ""))):
            mask |= mig.MEDIA_BIT  # a +me instance holds the GPU's media engines (one set per GPU)
    return mask


def _json_list(value: Any) -> list[Any]:
    if isinstance(value, str):  # a JSON column read back as text by some drivers
        try:
            value = json.loads(value)
        except ValueError:
            return []
    return list(value) if isinstance(value, list) else []


MIG_SWITCH_COLUMNS = (
    Gpu.mig_mode_pending,
    Gpu.mig_switch_to,
    Gpu.mig_switch_at,
    Gpu.mig_switch_revision,
    Gpu.mig_switch_error,
    Gpu.mig_retry_after,
    Gpu.mig_switched_at,
)


def set_gpu_mig(conn: Connection, gpu_id: int, **values: Any) -> None:
    """Update a GPU row's MIG mode or switch columns (mig_mode, mig_instances, mig_mode_pending, mig_switch_*, ...)."""
    conn.execute(update(Gpu).where(Gpu.id == gpu_id).values(**values))
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.gpus.add(gpu_id)
        changes.sched = True


def strike_node(conn: Connection, node_id: int) -> int:
    """Count one more strike against the node (a rank its host could not set up); returns the new count."""
    conn.execute(update(Node).where(Node.id == node_id).values(strikes=Node.strikes + 1))
    return int(conn.scalar(select(Node.strikes).where(Node.id == node_id)) or 0)


def gpu_ids(conn: Connection, node_id: int) -> dict[int, int]:
    return {r.index: r.id for r in conn.execute(select(Gpu.index, Gpu.id).where(Gpu.node_id == node_id))}


def set_node_state(
    conn: Connection, node_id: int, state: str, message: str, *, only_if_heartbeat_before: float | None = None
) -> bool:
    stmt = update(Node).where(Node.id == node_id)
    if only_if_heartbeat_before is not None:
        stmt = stmt.where(Node.last_heartbeat < only_if_heartbeat_before, Node.state != state)
    _changed_nodes(conn, node_id)
    return conn.execute(stmt.values(state=state, message=message)).rowcount == 1


def node_cordoned(conn: Connection, node_id: int) -> bool:
    """Whether an admin drained the node (`phalanx node drain`): it stays DRAINED when its agent registers."""
    return bool(conn.execute(select(Node.cordoned).where(Node.id == node_id)).scalar())


def set_node_cordoned(conn: Connection, node_id: int, cordoned: bool) -> None:
    _changed_nodes(conn, node_id)
    conn.execute(update(Node).where(Node.id == node_id).values(cordoned=cordoned))


def gpu_health_from_detail(detail: dict[str, Any] | None) -> dict[int, tuple[str, tuple[str, ...]]]:
    gpus = (detail or {}).get("gpus") or {}
    return {int(i): (g.get("state", "HEALTHY"), tuple(g.get("reasons", ()))) for i, g in gpus.items()}


def set_node_health(
    conn: Connection, node_id: int, health: str, reason: str, gpus: dict[int, tuple[str, tuple[str, ...]]]
) -> None:
    detail = {
        "reason": reason,
        "gpus": {str(i): {"state": h, "reasons": list(r)} for i, (h, r) in sorted(gpus.items())},
    }
    _changed_nodes(conn, node_id)
    conn.execute(update(Node).where(Node.id == node_id).values(health=health, health_detail=detail))


def add_node_events(conn: Connection, node_id: int, events: list[dict[str, Any]]) -> None:
    if events:
        conn.execute(insert(NodeEvent), [dict(node_id=node_id, **e) for e in events])


def read_node_events(conn: Connection, node_name: str | None = None, limit: int = 100) -> list[Any]:
    """The latest health events, newest first (with the node's name)."""
    stmt = (
        select(
            Node.name, NodeEvent.at, NodeEvent.gpu, NodeEvent.severity, NodeEvent.kind, NodeEvent.code, NodeEvent.reason
        )
        .join(Node, Node.id == NodeEvent.node_id)
        .order_by(NodeEvent.at.desc(), NodeEvent.id.desc())
        .limit(limit)
    )
    if node_name is not None:
        stmt = stmt.where(Node.name == node_name)
    return list(conn.execute(stmt).mappings())


def persist_heartbeats(conn: Connection, beats: dict[int, float]) -> None:
    _raise_node_column(conn, "last_heartbeat", "float8", beats)


def persist_acks(conn: Connection, acks: dict[int, int]) -> None:
    _raise_node_column(conn, "acked_revision", "int8", acks)


def _raise_node_column(conn: Connection, column: str, pg_type: str, values: dict[int, Any]) -> None:
    """Raise a monotonic node column to new values for many nodes in one statement."""
    if not values:
        return
    _raised(conn, column, values)
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            f"UPDATE nodes SET {column} = v.x FROM unnest(%s::int4[], %s::{pg_type}[]) AS v(id, x) "
            f"WHERE nodes.id = v.id AND nodes.{column} < v.x",
            (list(values), list(values.values())),
        )
    else:
        conn.execute(
            text(f"UPDATE nodes SET {column} = :x WHERE id = :id AND {column} < :x"),
            [{"id": k, "x": v} for k, v in values.items()],
        )


# ---- attempts, checkpoints and preemption ---------------------------------------------------------------------


def latest_commits(conn: Connection, job_ids: Sequence[str]) -> dict[str, tuple[int, int, float]]:
    """Each job's latest committed checkpoint (highest step) as (step, attempt, created_at: when the step was
    reached), for the jobs that have one."""
    if not job_ids:
        return {}
    out: dict[str, tuple[int, int, float]] = {}
    for chunk in _chunks(list(job_ids), 500):
        ranked = (
            select(
                Checkpoint.job_id,
                Checkpoint.step,
                Checkpoint.attempt,
                Checkpoint.created_at,
                func.row_number()
                .over(partition_by=Checkpoint.job_id, order_by=(Checkpoint.step.desc(), Checkpoint.committed_at.desc()))
                .label("n"),
            )
            .where(Checkpoint.job_id.in_(chunk), Checkpoint.state == "COMMITTED")
            .subquery()
        )
        for row in conn.execute(select(ranked).where(ranked.c.n == 1)):
            out[row.job_id] = (int(row.step), int(row.attempt), float(row.created_at))
    return out


def insert_attempts(conn: Connection, jobs: Sequence[JobRecord], now: float) -> None:
    """One job_attempts row per reservation of this cycle, with the step it restarts from (a closing write: no
    reads here, see pipelined)."""
    if not jobs:
        return
    insert_rows(
        conn,
        JobAttempt,
        [
            dict(
                job_id=j.id,
                attempt=j.attempt,
                gpus=j.gpu_equivalents,
                reserved_at=now,
                running_at=None,
                ended_at=None,
                outcome="",
                reason="",
                restored_step=j.restored_step,
                committed_step=-1,
                kept_until=None,
            )
            for j in jobs
        ],
    )


def mark_attempt_running(conn: Connection, job: JobRecord, now: float) -> None:
    conn.execute(
        update(JobAttempt)
        .where(JobAttempt.job_id == job.id, JobAttempt.attempt == job.attempt, JobAttempt.running_at.is_(None))
        .values(running_at=now)
    )


def _attempt_end_statement():
    """end_attempt's update with its values as parameters (b_job, b_attempt, b_now, b_outcome, b_reason): built
    once, for one attempt (end_attempt) or many in one executemany (end_attempts)."""
    att, ck = cast(Table, JobAttempt.__table__), cast(Table, Checkpoint.__table__)
    latest = (
        select(ck.c.step, ck.c.attempt, ck.c.created_at)
        .where(ck.c.job_id == bindparam("b_job"), ck.c.state == "COMMITTED")
        .order_by(ck.c.step.desc(), ck.c.committed_at.desc())
        .limit(1)
    )
    step = func.coalesce(latest.with_only_columns(ck.c.step).scalar_subquery(), -1)
    kept = latest.with_only_columns(
        case((ck.c.attempt == bindparam("b_attempt"), ck.c.created_at), else_=None)
    ).scalar_subquery()
    return (
        update(att)
        .where(att.c.job_id == bindparam("b_job"), att.c.attempt == bindparam("b_attempt"), att.c.ended_at.is_(None))
        .values(
            ended_at=bindparam("b_now"),
            outcome=bindparam("b_outcome"),
            reason=bindparam("b_reason"),
            committed_step=step,
            kept_until=kept,
        )
    )


_END_ATTEMPTS = _attempt_end_statement()
_MARK_RUNNING = (
    update(cast(Table, JobAttempt.__table__))
    .where(
        JobAttempt.__table__.c.job_id == bindparam("b_job"),
        JobAttempt.__table__.c.attempt == bindparam("b_attempt"),
        JobAttempt.__table__.c.running_at.is_(None),
    )
    .values(running_at=bindparam("b_now"))
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


def end_attempts(conn: Connection, ends: Sequence[tuple[JobRecord, str, str, float]]) -> None:
    """`end_attempt` without answers for many attempts, (job, outcome, reason, now) each: one statement, executed
    for all of them at once (a cycle's deferred writes)."""
    if ends:
        conn.execute(
            _END_ATTEMPTS,
            [
                dict(b_job=j.id, b_attempt=j.attempt, b_now=now, b_outcome=outcome, b_reason=reason[:2000])
                for j, outcome, reason, now in ends
            ],
        )


def mark_attempts_running(conn: Connection, items: Sequence[tuple[JobRecord, float]]) -> None:
    """`mark_attempt_running` for many attempts at once."""
    if items:
        conn.execute(_MARK_RUNNING, [dict(b_job=j.id, b_attempt=j.attempt, b_now=now) for j, now in items])


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


def end_attempt(
    conn: Connection, job: JobRecord, outcome: str, reason: str, now: float, answer: bool = True
) -> tuple[int, float | None]:
    """Close the job's current attempt: its end, and the committed step the next attempt restarts from with when
    this attempt reached it (None when the latest committed checkpoint is not this attempt's). Returns those two.
    One statement (a teardown is on the cycle's path): the latest commit is read by the update itself."""
    params = dict(b_job=job.id, b_attempt=job.attempt, b_now=now, b_outcome=outcome, b_reason=reason[:2000])
    if not answer:  # a deferred write, sent pipelined: nothing to read back
        conn.execute(_END_ATTEMPTS, params)
        return -1, None
    att = cast(Table, JobAttempt.__table__)
    row = conn.execute(_END_ATTEMPTS.returning(att.c.committed_step, att.c.kept_until), params).first()
    if row is None:  # no open attempt (already ended): nothing written
        got = latest_commits(conn, [job.id]).get(job.id, (-1, -1, 0.0))
        return got[0], got[2] if got[0] >= 0 and got[1] == job.attempt else None
    return int(row[0]), None if row[1] is None else float(row[1])


def request_checkpoint(conn: Connection, job_id: str, reason: str, now: float) -> tuple[str, float]:
    """Ask the job's ranks to checkpoint (the checkpoint coordinator answers their polls from this table and clears
    it when a checkpoint begun after it commits). An outstanding request is kept; returns (reason, requested_at)."""
    row = conn.execute(
        select(CheckpointRequest.reason, CheckpointRequest.requested_at).where(CheckpointRequest.job_id == job_id)
    ).first()
    if row is not None:
        return row.reason, row.requested_at
    conn.execute(insert(CheckpointRequest).values(job_id=job_id, reason=reason, requested_at=now))
    return reason, now


def service_endpoint(conn: Connection, name: str) -> tuple[str, dict[str, Any]] | None:
    row = conn.execute(
        select(ServiceEndpoint.address, ServiceEndpoint.detail).where(ServiceEndpoint.name == name)
    ).first()
    return None if row is None else (row.address, dict(row.detail or {}))


def outstanding_requests(conn: Connection, job_ids: Sequence[str]) -> set[str]:
    """The jobs among `job_ids` whose checkpoint request is not yet satisfied by a commit."""
    if not job_ids:
        return set()
    return set(conn.scalars(select(CheckpointRequest.job_id).where(CheckpointRequest.job_id.in_(list(job_ids)))))


def read_attempts(conn: Connection, job_ids: Sequence[str] | None = None) -> dict[str, list[Any]]:
    """job_attempts rows by job, in attempt order."""
    stmt = select(*JobAttempt.__table__.c).order_by(JobAttempt.job_id, JobAttempt.attempt)
    if job_ids is not None:
        stmt = stmt.where(JobAttempt.job_id.in_(list(job_ids)))
    out: dict[str, list[Any]] = {}
    for row in conn.execute(stmt).mappings():
        out.setdefault(row["job_id"], []).append(row)
    return out


# ---- reads (the API's consistent snapshots) --------------------------------------------------------------------


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
            wanted.append(and_(Job.state == "RUNNING", Job.preempted_by != ""))
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


# ---- preemption claims (revision 0022; phalanx.core.claims) -----------------------------------------------------------


def _claim_replicas(claim: Claim) -> list[dict[str, Any]]:
    return [
        dict(
            replica=r.replica,
            node=r.node,
            gpus=list(r.gpus),
            mig_profile=r.mig_profile,
            mig_start=r.mig_start,
            mig_size=r.mig_size,
            gpu_milli=r.gpu_milli,
            cpu_milli=r.cpu_milli,
            memory=r.memory,
        )
        for r in claim.replicas
    ]


def claim_from_row(row: Any) -> Claim:
    reps = tuple(
        ReplicaPlacement(
            int(r.get("replica", i)),
            str(r["node"]),
            tuple(int(g) for g in r["gpus"]),
            str(r.get("mig_profile", "")),
            int(r.get("mig_start", -1)),
            int(r.get("mig_size", 0)),
            int(r.get("gpu_milli", 0)),
            int(r.get("cpu_milli", 0)),
            int(r.get("memory", 0)),
        )
        for i, r in enumerate(_json_list(row.replicas))
    )
    return Claim(
        row.job_id,
        int(row.priority),
        reps,
        tuple(str(v) for v in _json_list(row.victims)),
        float(row.created_at),
        row.queue or "",
        row.flavor or "",
    )


def read_claims(conn: Connection, job_ids: Iterable[str] | None = None) -> dict[str, Claim]:
    """The standing claims, all or those of `job_ids`, by job."""
    stmt = select(ClaimRow).where(ClaimRow.ended_at.is_(None))
    out: dict[str, Claim] = {}
    if job_ids is None:
        rows: Iterable[Any] = conn.execute(stmt)
    else:
        wanted = sorted(set(job_ids))
        rows = (r for chunk in _chunks(wanted, 500) for r in conn.execute(stmt.where(ClaimRow.job_id.in_(chunk))))
    for row in rows:
        out[row.job_id] = claim_from_row(row)
    return out


def set_claim(conn: Connection, claim: Claim, now: float) -> None:
    """Make `claim` the job's standing claim (one it had ends: replaced)."""
    end_claim(conn, claim.job, "replaced by a new claim", now)
    insert_rows(  # (no RETURNING: a closing write, sent pipelined)
        conn,
        ClaimRow,
        [
            dict(
                job_id=claim.job,
                priority=claim.priority,
                queue=claim.queue,
                flavor=claim.flavor,
                replicas=_claim_replicas(claim),
                victims=list(claim.victims),
                created_at=now,
                end_reason="",
            )
        ],
    )
    _changed_jobs(conn, claim.job)


def end_claim(conn: Connection, job_id: str, reason: str, now: float) -> None:
    """End the job's standing claim, if any (a closing write: no answer read, see pipelined)."""
    conn.execute(
        update(ClaimRow)
        .where(ClaimRow.job_id == job_id, ClaimRow.ended_at.is_(None))
        .values(ended_at=now, end_reason=reason[:2000])
    )
    _changed_jobs(conn, job_id)


def read_claim_history(conn: Connection, job_ids: Sequence[str] | None = None) -> list[Any]:
    """Every claim made (standing or ended), oldest first: for `phalanx job` and the invariant checks."""
    stmt = select(ClaimRow).order_by(ClaimRow.created_at, ClaimRow.id)
    if job_ids is not None:
        stmt = stmt.where(ClaimRow.job_id.in_(list(job_ids)))
    return list(conn.execute(stmt))


def mark_attempt_preempted(conn: Connection, job_id: str, attempt: int, by: str) -> None:
    """Record the gang an attempt was preempted for (job_attempts.preempted_by)."""
    conn.execute(
        update(JobAttempt).where(JobAttempt.job_id == job_id, JobAttempt.attempt == attempt).values(preempted_by=by)
    )


def claim_detail(conn: Connection, job_id: str, now: float) -> dict[str, Any] | None:
    """The job's standing claim as GetJob shows it, with what it still waits for: its victims still running
    (checkpointing, then stopped), and claimed GPUs whose old processes are still exiting. None: no standing claim."""
    claims = read_claims(conn, [job_id])
    claim = claims.get(job_id)
    if claim is None:
        return None
    stopping = [
        (r.id, r.preempt_deadline)
        for r in conn.execute(
            select(Job.id, Job.preempt_deadline)
            .where(Job.state == "RUNNING", Job.preempted_by == job_id)
            .order_by(Job.id)
        )
    ]
    names = {r.name: r.id for r in conn.execute(select(Node.name, Node.id).where(Node.name.in_(list(claim.nodes))))}
    releasing = read_releasing(conn, list(names.values())) if names else {}
    claimed = {(r.node, g) for r in claim.replicas for g in r.gpus}
    held = 0
    of: set[str] = set()
    for name, node_id in names.items():
        for key, gpus in releasing.get(node_id, {}).items():
            mine = [g for g in gpus if (name, g) in claimed]
            if mine:
                held += len(mine)
                of.add(key.split("/", 1)[0])
    parts = []
    if stopping:
        until = max(d for _, d in stopping)
        parts.append(
            f"{len(stopping)} gang(s) asked to stop ({', '.join(j for j, _ in stopping)}), checkpointing until "
            f"{time.strftime('%H:%M:%S', time.gmtime(until))} UTC at the latest"
        )
    if held:
        parts.append(f"{held} claimed GPU(s) still releasing (processes of {', '.join(sorted(of))} exiting)")
    return dict(
        nodes=list(claim.nodes),
        gpus=claim.gpus,
        victims=list(claim.victims),
        since=claim.since,
        stopping=[j for j, _ in stopping],
        releasing_gpus=held,
        waits_for="; ".join(parts),
    )
