"""Preemption claims (revision 0022; phalanx.core.claims): their rows, history and the detail the API shows."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, select, update

from db.models import Claim as ClaimRow
from db.models import Job, Node
from phalanx.core.claims import Claim
from phalanx.core.model import ReplicaPlacement

from ._sql import _changed_jobs, _chunks, _json_list, insert_rows
from .allocations import read_releasing


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
