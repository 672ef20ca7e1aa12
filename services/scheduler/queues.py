"""Queue status from the ledger (`phalanx queue`): quotas, usage per flavor, fair share, and the pending jobs in the
order the next scheduling pass would consider them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from db.models import Gpu, Job, Node
from phalanx.api.v1 import scheduler_pb2
from phalanx.core.model import GangRequest
from phalanx.core.quota import (
    DEFAULT_QUEUE,
    FlavorQuota,
    QueueSpec,
    QuotaBook,
    cluster_totals,
    fair_order,
    usage_of,
)
from services.common.errors import InvalidArgument

from . import ledger

MAX_QUEUE_NAME = 64


def _request(j: Any) -> GangRequest:
    return GangRequest(
        j["id"],
        j["replicas"],
        j["gpus_per_replica"],
        j["priority"],
        j["submitted_at"],
        gpu_model=j["gpu_model"] or "",
        mig_profile=j["mig_profile"] or "",
        gpu_milli=j["gpu_milli"] or 0,
    )


def read_queues(conn: Connection, name: str = "", tenant: str | None = None) -> list[scheduler_pb2.QueueStatus]:
    """Every queue (or `name`). `tenant`: a user's view: its own pending jobs only (positions stay global)."""
    specs = ledger.load_queues(conn)
    jobs = list(
        conn.execute(
            select(
                Job.id,
                Job.name,
                Job.state,
                Job.priority,
                Job.submitted_at,
                Job.replicas,
                Job.gpus_per_replica,
                Job.gpu_model,
                Job.mig_profile,
                Job.gpu_milli,
                Job.queue,
                Job.flavor,
                Job.message,
                Job.tenant,
            ).where(Job.state.in_(("PENDING", "RUNNING")))
        ).mappings()
    )
    running = [j for j in jobs if j["state"] == "RUNNING"]
    # The DRF denominators: whole GPUs outside MIG mode, MIG compute slices of the GPUs in MIG mode.
    gpus = conn.execute(
        select(Gpu.name, Gpu.memory_mib, Gpu.mig_mode).join(Node, Node.id == Gpu.node_id).where(Gpu.index < Node.gpus)
    )
    book = QuotaBook(
        specs,
        usage_of((j["queue"], j["flavor"], _request(j)) for j in running),
        cluster_totals((g.name or "", g.memory_mib or 0, g.mig_mode == "ENABLED") for g in gpus),
    )
    pending = [j for j in jobs if j["state"] == "PENDING"]
    order = list(fair_order(((j["queue"], _request(j)) for j in pending), book))
    position = {r.job_id: i for i, (_, r) in enumerate(order, 1)}
    names = sorted({DEFAULT_QUEUE, *specs, *(j["queue"] for j in jobs)})
    if name:
        names = [n for n in names if n == name]
    out = []
    for queue in names:
        spec = specs.get(queue) or QueueSpec(queue)
        status = scheduler_pb2.QueueStatus(
            spec=spec_to_proto(spec), share=book.share(queue), running=sum(1 for j in running if j["queue"] == queue)
        )
        for flavor, (g, s) in sorted(book.usage.get(queue, {}).items()):
            status.usage.add(flavor=flavor, gpus=g, mig_slices=int(s), borrowing=book.borrowing(queue, flavor))
        mine = (j for j in pending if j["queue"] == queue and (tenant is None or j["tenant"] == tenant))
        for j in sorted(mine, key=lambda j: position[j["id"]]):
            status.pending.add(
                job_id=j["id"], name=j["name"], position=position[j["id"]], priority=j["priority"], message=j["message"]
            )
        out.append(status)
    return out


def spec_to_proto(spec: QueueSpec) -> scheduler_pb2.QueueSpec:
    msg = scheduler_pb2.QueueSpec(
        name=spec.name,
        cohort=spec.cohort,
        weight=spec.weight,
        tenants=sorted(spec.tenants),
        max_priority=spec.max_priority,
    )
    for flavor, q in spec.quotas.items():
        msg.quotas.add(
            flavor=flavor,
            gpus=q.gpus,
            mig_slices=q.mig_slices,
            has_borrow_limit=q.borrow_limit is not None,
            borrow_limit=q.borrow_limit or 0.0,
        )
    return msg


def spec_from_proto(msg: scheduler_pb2.QueueSpec) -> QueueSpec:
    """Validate a queue definition (InvalidArgument with every problem) and build it."""
    problems = []
    name = msg.name
    if not name or len(name) > MAX_QUEUE_NAME or not all(c.isalnum() or c in "._-" for c in name):
        problems.append(f"queue name {name[:80]!r} must be 1-{MAX_QUEUE_NAME} letters, digits, '.', '_' or '-'")
    if len(msg.cohort) > 64 or any(not (c.isalnum() or c in "._-") for c in msg.cohort):
        problems.append(f"cohort {msg.cohort[:80]!r} must be at most 64 letters, digits, '.', '_' or '-'")
    weight = msg.weight or 1.0
    if not 0 < weight <= 1e6:  # also NaN
        problems.append(f"weight must be in (0, 1e6], got {msg.weight}")
    quotas: dict[str, FlavorQuota] = {}
    for q in msg.quotas:
        if not q.flavor or len(q.flavor) > 64 or "\x00" in q.flavor:
            problems.append(f"flavor {q.flavor[:80]!r} must be a GPU model key (e.g. H100) or '*'")
            continue
        if q.flavor in quotas:
            problems.append(f"flavor {q.flavor!r} is given twice")
            continue
        try:
            quotas[q.flavor] = FlavorQuota(
                gpus=q.gpus, mig_slices=q.mig_slices, borrow_limit=q.borrow_limit if q.has_borrow_limit else None
            )
        except ValueError as exc:
            problems.append(f"flavor {q.flavor!r}: {exc}")
        if q.gpus > 1e7 or (q.has_borrow_limit and q.borrow_limit > 1e7):
            problems.append(f"flavor {q.flavor!r}: at most 1e7 GPUs")
    tenants = list(msg.tenants)
    if any(not t or len(t) > 64 or "\x00" in t for t in tenants):
        problems.append("tenants must be 1-64 characters, without NUL")
    if problems:
        raise InvalidArgument("invalid queue: " + "; ".join(problems))
    return QueueSpec(
        name, quotas, cohort=msg.cohort, weight=weight, tenants=frozenset(tenants), max_priority=msg.max_priority
    )
