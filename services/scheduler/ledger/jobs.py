"""Job rows: inserting, reading them into view records, and the deferred updates a cycle flushes at its end."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

from sqlalchemy import Connection, Table, and_, bindparam, literal_column, select, update

from db.models import Allocation, Job, Rank

from ..state import JobRecord, Partial, layout_ranks, touch
from ._sql import _changed_jobs, _chunks, _json_list, in_pipeline, insert_rows


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
            .where(Allocation.job_id.in_(chunk), Allocation.kind != "hold", Allocation.released_at.is_(None))
            .order_by(Allocation.job_id, Allocation.replica, Allocation.gpu_index, Allocation.unit)
        )
        for job_id, (allocs, partials) in _group_allocations(rows, names).items():
            # A negative replica is a spare kept in the domain (services/scheduler/spares.py): held, never launched
            jobs[job_id].allocations = [a for a in allocs if a[0] >= 0]
            jobs[job_id].spares = [a for a in allocs if a[0] < 0]
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
        service=j.get("service") or "",
        serving=dict(j.get("serving") or {}),
        shape=dict(j.get("shape") or {}),
        ready=bool(j.get("ready")),
        ready_at=j.get("ready_at") or 0.0,
        after=[dict(d) for d in _json_list(j.get("after"))],
        array=dict(j.get("array") or {}),
        array_parent=j.get("array_parent") or "",
        array_task=-1 if j.get("array_task") is None else j.get("array_task"),
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
                service=j.service,
                serving=j.serving,
                shape=j.shape,
                ready=j.ready,
                ready_at=j.ready_at,
                after=j.after,
                array=j.array,
                array_parent=j.array_parent,
                array_task=j.array_task,
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
    queue_job_update(conn, job.id, job.version, changes)
    job.version += 1
    for key, value in changes.items():
        setattr(job, key, value)
    touch(job)


def queue_job_update(conn: Connection, job_id: str, read: int, changes: dict[str, Any]) -> None:
    """The row write of update_job alone: `changes` to the job whose view record was at version `read` (and is at
    `read` + 1 once changed; the caller changes the record). Written by flush_job_updates."""
    pending: dict[str, list[Any]] = conn.info.setdefault(JOB_WRITES, {})
    entry = pending.get(job_id)
    if entry is None:
        pending[job_id] = [read, dict(changes), read + 1]
    else:
        entry[1].update(changes)
        entry[2] = read + 1
    _changed_jobs(conn, job_id)


def flush_job_updates(conn: Connection, *, checked_by_server: bool = False) -> None:
    """Write the jobs update_job changed since the last flush, each from the version the view had read to the
    version it has now; StaleJobs when a row did not hold the version read.

    `checked_by_server`, on PostgreSQL: each update checks its own row count in the server
    (phalanx_expect_updated, revision 0026) and fails the transaction when the row moved (a DBAPIError,
    serialization_failure, at the latest at the COMMIT), so the caller need not wait for the answers: the cycle sends
    them in its closing pipeline with its other writes and its COMMIT (UnitOfWork.write_deferred), one round trip
    for all, where each set of changed columns cost one of its own."""
    pending: dict[str, list[Any]] | None = conn.info.pop(JOB_WRITES, None)
    if not pending:
        return
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for job_id in sorted(pending):  # one lock order for every writer
        read, values, version = pending[job_id]
        groups.setdefault(tuple(sorted(values)), []).append(
            {"b_id": job_id, "b_read": read, "b_version": version, **{f"v_{k}": v for k, v in values.items()}}
        )
    driver = conn.connection.driver_connection if conn.dialect.name == "postgresql" else None
    # (outside a pipeline an answer costs nothing more: the row counts are checked here, as StaleJobs)
    by_server = checked_by_server and in_pipeline(conn)
    for keys, rows in groups.items():
        if by_server and driver is not None:
            sql, processors = _checked_job_update(conn, keys)
            with driver.cursor() as cursor:
                cursor.executemany(
                    sql, [{k: (processors[k](v) if k in processors else v) for k, v in r.items()} for r in rows]
                )
            continue
        _check_updated(conn.execute(_job_update(keys), rows).rowcount, len(rows), [r["b_id"] for r in rows[:5]])


def _check_updated(changed: int, expected: int, ids: list[str]) -> None:
    if changed != expected:
        raise StaleJobs(
            f"{expected - changed} of {expected} job(s) changed in the ledger since the view read "
            f"them (among {', '.join(ids)})"
        )


_JOB_UPDATES: dict[tuple[str, ...], Any] = {}
_COMPILED_JOB_UPDATES: dict[tuple[str, tuple[str, ...]], tuple[str, dict[str, Any]]] = {}


def _job_update(keys: tuple[str, ...]) -> Any:
    """The compare-and-set of the columns `keys`, built once per set of columns."""
    stmt = _JOB_UPDATES.get(keys)
    if stmt is None:
        table = cast(Table, Job.__table__)
        stmt = _JOB_UPDATES[keys] = (
            update(table)
            .where(table.c.id == bindparam("b_id"), table.c.version == bindparam("b_read"))
            .values({"version": bindparam("b_version"), **{k: bindparam(f"v_{k}") for k in keys}})
        )
    return stmt


def _checked_job_update(conn: Connection, keys: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """The compare-and-set of `keys` that fails in the server unless it changed its row (phalanx_expect_updated), as
    SQL for the driver (named parameters), and the parameters' conversions (JSON columns); compiled once."""
    key = (conn.dialect.name, keys)
    got = _COMPILED_JOB_UPDATES.get(key)
    if got is None:
        compiled = _job_update(keys).returning(literal_column("1")).compile(dialect=conn.dialect)
        sql = f"WITH updated AS ({compiled.string}) SELECT phalanx_expect_updated((SELECT count(*) FROM updated), %(b_id)s)"
        got = _COMPILED_JOB_UPDATES[key] = (sql, dict(compiled._bind_processors))
    return got
