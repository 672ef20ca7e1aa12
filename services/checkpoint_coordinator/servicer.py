"""gRPC face of the checkpoint coordinator: proto <-> store records; database work runs off the event loop."""

from __future__ import annotations

import asyncio
import time

import structlog
from sqlalchemy import Engine

from phalanx.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from phalanx.core.checkpoint_policy import CheckpointPolicy
from services.common import metrics
from services.common.auth import CHECKPOINT, audit_denied, current_identity
from services.common.errors import InvalidArgument, NotFound, PermissionDenied
from services.common.rpc import unary

from . import store
from .confine import StorageRoot
from .retention import Retention

log = structlog.get_logger(service="checkpointd")

SERVICE_NAME = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointCoordinator"].full_name


def to_proto(record: store.CheckpointRecord) -> checkpoint_pb2.Checkpoint:
    return checkpoint_pb2.Checkpoint(
        id=record.id,
        job_id=record.job_id,
        attempt=record.attempt,
        step=record.step,
        committed_at=record.committed_at,
        state=record.state,
        world_size=record.world_size,
        deadline_at=record.deadline_at,
        created_at=record.created_at,
        message=record.message,
        shards=[
            checkpoint_pb2.Shard(rank=s.rank, uri=s.uri, size_bytes=s.size_bytes, checksum=s.checksum)
            for s in record.shards
        ],
    )


def _skipped_proto(s: store.SkippedRecord) -> checkpoint_pb2.SkippedCheckpoint:
    return checkpoint_pb2.SkippedCheckpoint(checkpoint_id=s.checkpoint_id, reason=s.reason, step=s.step)


def restore_proto(r: store.RestoreRecord) -> checkpoint_pb2.RestoreReport:
    return checkpoint_pb2.RestoreReport(
        job_id=r.job_id,
        attempt=r.attempt,
        rank=r.rank,
        checkpoint_id=r.checkpoint_id,
        step=r.step,
        skipped=[_skipped_proto(s) for s in r.skipped],
        fell_back_from=r.fell_back_from,
        message=r.message,
        reported_at=r.reported_at,
    )


def _request_proto(record: store.RequestRecord) -> checkpoint_pb2.CheckpointRequestState:
    state = checkpoint_pb2.CheckpointRequestState(
        requested=record.requested,
        reason=record.reason,
        requested_at=record.requested_at,
        agreeing=True,
        ranks_reported=record.ranks_reported,
    )
    if record.target_step is not None:
        state.target_step = record.target_step
    if record.policy is not None:
        state.interval_s = record.policy.interval_s
        state.mtbf_s = record.policy.mtbf_s
        state.cost_s = record.policy.cost_s
    return state


def policy_proto(job_id: str, p: CheckpointPolicy) -> checkpoint_pb2.CheckpointPolicy:
    return checkpoint_pb2.CheckpointPolicy(
        job_id=job_id,
        interval_s=p.interval_s,
        mtbf_s=p.mtbf_s,
        node_mtbf_s=p.node_mtbf_s,
        cost_s=p.cost_s,
        nodes=p.nodes,
        events=p.events,
        node_hours=p.node_hours,
        cost_samples=p.cost_samples,
        cost_source=p.cost_source,
        mtbf_source=p.mtbf_source,
        method=p.method,
        prior_events=p.prior_events,
        prior_node_hours=p.prior_node_hours,
    )


class CheckpointCoordinatorServicer(checkpoint_pb2_grpc.CheckpointCoordinatorServicer):
    """`retention`: after each commit the job's checkpoints beyond what it keeps are deleted (retention.py), in the
    background: the commit's answer never waits for the file system."""

    def __init__(self, engine: Engine, retention: Retention | None = None, root: StorageRoot | None = None) -> None:
        self.engine = engine
        self.retention = retention
        self.root = root  # given: every shard must lie under its job's prefix (confine.py)
        self._pruning: dict[str, asyncio.Task] = {}  # job id -> its retention pass under way
        self._again: set[str] = set()  # jobs that committed again meanwhile: one more pass

    def _committed(self, job_id: str) -> None:
        retention = self.retention
        if retention is None:
            return
        task = self._pruning.get(job_id)
        if task is not None and not task.done():
            self._again.add(job_id)
            return
        self._pruning[job_id] = asyncio.create_task(self._prune(retention, job_id))

    async def _prune(self, retention: Retention, job_id: str) -> None:
        try:
            while True:
                self._again.discard(job_id)
                try:
                    await asyncio.to_thread(retention.prune_job, self.engine, job_id)
                except Exception as exc:  # best effort: the sweep finds what is left
                    log.warning("checkpoint_retention_failed", job_id=job_id, error=str(exc)[:500])
                if job_id not in self._again:
                    break
        finally:
            if self._pruning.get(job_id) is asyncio.current_task():
                del self._pruning[job_id]

    async def _authorize(self, method: str, job_id: str, attempt: int | None = None) -> None:
        """The caller may touch `job_id` (and `attempt`, when the request names one), or this raises, after one
        audit line, and nothing is written. Authentication off, an admin, or a `service` (the cluster's own
        processes): anything. A user: its tenant's jobs; another's is NOT_FOUND, as if it did not exist. A rank
        credential (PHALANX_JOB_TOKEN): its own job and attempt, while that attempt is the job's running one."""
        ident = current_identity()
        if ident is None or ident.admin or ident.role == "service":
            return
        full = CHECKPOINT + method
        if ident.role == "rank":
            why = ""
            if job_id != ident.job:
                why = f"the credential of job {ident.job} may not touch job {job_id[:40]!r}"
            elif attempt and attempt != ident.attempt:
                why = f"the credential of job {ident.job} attempt {ident.attempt} may not act for attempt {attempt}"
            else:
                owner = await asyncio.to_thread(store.job_owner, self.engine, job_id)
                if owner is None or owner.state != "RUNNING" or owner.attempt != ident.attempt:
                    now = "gone" if owner is None else f"{owner.state}, attempt {owner.attempt}"
                    why = f"the credential of job {ident.job} attempt {ident.attempt} has expired (the job is {now})"
            if why:
                audit_denied(full, f"job/{job_id[:40]}", why, ident, attempt=ident.attempt)
                raise PermissionDenied(why)
            return
        if ident.role == "user":
            owner = await asyncio.to_thread(store.job_owner, self.engine, job_id)
            if owner is not None and owner.tenant != ident.tenant:
                audit_denied(full, f"job/{job_id[:40]}", "another tenant's job", ident)
                raise NotFound(f"no job with id {job_id[:40]!r}")
            return
        audit_denied(full, f"job/{job_id[:40]}", f"role {ident.role!r} may not call the coordinator", ident)
        raise PermissionDenied(f"role {ident.role!r} may not call {method}")

    async def _confine(self, job_id: str, shards) -> None:
        """INVALID_ARGUMENT unless every shard lies under the job's own storage prefix (with a root)."""
        if self.root is None:
            return
        owner = await asyncio.to_thread(store.job_owner, self.engine, job_id)
        if owner is None:
            return  # the store answers NOT_FOUND
        for s in shards:
            why = self.root.check(s.uri, owner.tenant, job_id)
            if why:
                raise InvalidArgument(f"shard {s.rank}: location {s.uri[:200]!r} is {why}")

    async def settle(self, timeout: float | None = None) -> None:
        """Wait for the retention passes that commits started (tests; shutdown)."""
        while self._pruning:
            _, pending = await asyncio.wait(list(self._pruning.values()), timeout=timeout)
            if pending:
                return

    @unary
    async def RecordCheckpoint(self, request, context):
        await self._authorize("RecordCheckpoint", request.job_id, request.attempt)
        shards = [store.ShardRecord(s.rank, s.uri, s.size_bytes, s.checksum) for s in request.shards]
        await self._confine(request.job_id, shards)
        record = await asyncio.to_thread(
            store.record_checkpoint, self.engine, request.job_id, request.attempt, request.step, shards
        )
        log.info(
            "checkpoint_committed",
            checkpoint_id=record.id,
            job_id=record.job_id,
            step=record.step,
            attempt=record.attempt,
            shards=len(record.shards),
        )
        self._committed(record.job_id)
        return to_proto(record)

    @unary
    async def BeginCheckpoint(self, request, context):  # world_size 0: the ledger's (store.begin_checkpoint)
        await self._authorize("BeginCheckpoint", request.job_id, request.attempt)
        record = await asyncio.to_thread(
            store.begin_checkpoint,
            self.engine,
            request.job_id,
            request.attempt,
            request.step,
            request.world_size,
            request.deadline_s,
        )
        log.info(
            "checkpoint_begun",
            checkpoint_id=record.id,
            job_id=record.job_id,
            step=record.step,
            attempt=record.attempt,
            world_size=record.world_size,
            state=record.state,
        )
        return to_proto(record)

    @unary
    async def ReportShard(self, request, context):
        await self._authorize("ReportShard", request.job_id, request.attempt)
        if not request.HasField("shard"):
            raise InvalidArgument("shard is required")
        s = request.shard
        shard = store.ShardRecord(s.rank, s.uri, s.size_bytes, s.checksum)
        await self._confine(request.job_id, [shard])
        started = time.time()
        record = await asyncio.to_thread(
            store.report_shard,
            self.engine,
            request.job_id,
            request.attempt,
            request.step,
            request.world_size,
            shard,
            request.deadline_s,
        )
        log.info(
            "checkpoint_shard_reported",
            checkpoint_id=record.id,
            job_id=record.job_id,
            step=record.step,
            attempt=record.attempt,
            rank=s.rank,
            reported=len(record.shards),
            world_size=record.world_size,
            state=record.state,
        )
        if record.state == store.COMMITTED:
            self._committed(record.job_id)
            if record.committed_at >= started:  # this report committed it (a repeated one finds an older commit)
                metrics.CHECKPOINT_COMMIT_SECONDS.observe(max(record.committed_at - record.created_at, 0.0))
        return to_proto(record)

    @unary
    async def RequestCheckpoint(self, request, context):
        await self._authorize("RequestCheckpoint", request.job_id)
        record = await asyncio.to_thread(store.request_checkpoint, self.engine, request.job_id, request.reason)
        log.info("checkpoint_requested", job_id=request.job_id, reason=record.reason)
        return _request_proto(record)

    @unary
    async def GetCheckpointRequest(self, request, context):
        await self._authorize("GetCheckpointRequest", request.job_id, request.attempt)
        step = request.step if request.HasField("step") else None  # set: the rank takes part in the step agreement
        record = await asyncio.to_thread(
            store.get_request, self.engine, request.job_id, request.attempt, request.rank, step
        )
        if record.decided:
            log.info(
                "checkpoint_step_agreed",
                job_id=request.job_id,
                attempt=request.attempt,
                target_step=record.target_step,
                ranks=record.ranks_reported,
                reason=record.reason,
            )
        elif record.restarted:
            log.warning(
                "checkpoint_step_agreement_restarted",
                job_id=request.job_id,
                attempt=request.attempt,
                rank=request.rank,
                step=step,
                reason=record.reason,
            )
        return _request_proto(record)

    @unary
    async def GetCheckpointPolicy(self, request, context):
        await self._authorize("GetCheckpointPolicy", request.job_id)
        policy = await asyncio.to_thread(store.checkpoint_policy, self.engine, request.job_id)
        return policy_proto(request.job_id, policy)

    @unary
    async def GetLatestCheckpoint(self, request, context):
        await self._authorize("GetLatestCheckpoint", request.job_id)
        record = await asyncio.to_thread(store.latest_checkpoint, self.engine, request.job_id)
        return to_proto(record)

    @unary
    async def ListCheckpoints(self, request, context):
        await self._authorize("ListCheckpoints", request.job_id)
        records, token = await asyncio.to_thread(
            store.list_checkpoints, self.engine, request.job_id, request.page_size, request.page_token
        )
        return checkpoint_pb2.ListCheckpointsResponse(checkpoints=[to_proto(r) for r in records], next_page_token=token)

    @unary
    async def ReportRestore(self, request, context):
        await self._authorize("ReportRestore", request.job_id, request.attempt)
        skipped = [store.SkippedRecord(s.checkpoint_id, s.reason) for s in request.skipped]
        record = await asyncio.to_thread(
            store.report_restore,
            self.engine,
            request.job_id,
            request.attempt,
            request.rank,
            request.checkpoint_id,
            skipped,
        )
        event = "checkpoint_restore_fell_back" if record.skipped else "checkpoint_restore_reported"
        (log.warning if record.skipped else log.info)(
            event,
            job_id=record.job_id,
            attempt=record.attempt,
            rank=record.rank,
            step=record.step,
            checkpoint_id=record.checkpoint_id,
            fell_back_from=record.fell_back_from,
            message=record.message[:500],
        )
        return restore_proto(record)

    @unary
    async def GetRestore(self, request, context):
        await self._authorize("GetRestore", request.job_id, request.attempt if request.HasField("attempt") else None)
        attempt = request.attempt if request.HasField("attempt") else None
        state = await asyncio.to_thread(store.get_restore, self.engine, request.job_id, attempt)
        return checkpoint_pb2.RestoreState(
            job_id=state.job_id,
            attempt=state.attempt,
            step=state.step,
            fell_back_from=state.fell_back_from,
            message=state.message,
            consistent=state.consistent,
            ranks=[restore_proto(r) for r in state.ranks],
        )
