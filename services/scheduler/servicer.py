"""gRPC servicers: thin adapters that validate requests, run commands through the service, and convert."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Sequence

import structlog
from google.protobuf.json_format import MessageToDict
from sqlalchemy.exc import SQLAlchemyError

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.common.tokens import log_credential, node_logs_key
from phalanx.core import mig
from phalanx.core.resources import MAX_CPUS, MAX_MEMORY, cpu_milli, parse_size
from services.common.auth import (
    SCHEDULER as SCHEDULER_PREFIX,
)
from services.common.auth import (
    TenantLimits,
    audit_admin,
    audit_denied,
    check_node_caller,
    current_identity,
    peer_common_name,
    tenant_scope,
)
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from services.common.rpc import stream, unary

from . import accounting, ledger, paging, queues, retention
from .commands import (
    AttemptReleased,
    Cancel,
    CordonNode,
    DeleteQueue,
    RankReport,
    ReadinessReport,
    Register,
    RequestCheckpoint,
    SetQueue,
    Submit,
)
from .convert import JOB_STATE_NAMES, JOB_STATES, NODE_STATES, RANK_STATE_NAMES, job_from_row, node_from_row
from .elastic_fields import elastic_problems, smallest
from .graph_fields import DEFAULT_MAX_ARRAY_SIZE, graph_problems
from .pool_rpcs import PoolRpcs
from .segment_fields import check_segments_fit, segment_problems
from .service import SchedulerService
from .serving_fields import normalize_roles, serving_problems
from .settings import SchedulerSettings
from .spare_fields import check_spares_fit, spare_problems

MAX_NAME = 253
MAX_COMMAND_ARGS = 4096
MAX_COMMAND_BYTES = 256 * 1024
# The environment is bounded like the command, so that a Job message stays small (the pages of ListJobs: paging.py).
MAX_ENV_VARS = 4096
MAX_ENV_BYTES = 256 * 1024
MAX_REPLICAS = 100_000
LOG_CREDENTIAL_S = 3600  # how long GetRankLogs's credentials read logs
MAX_GPUS_PER_REPLICA = 1024
MAX_RESTARTS = 1000
MAX_KEEP_CHECKPOINTS = 10_000
MAX_TIME_LIMIT_S = 366 * 24 * 3600.0
CONTAINMENT_KINDS = ("", "cgroup-v2", "cgroup-v1", "process-group")  # "": an agent of before containment
# \Z, not $: "$" also matches before a trailing newline.
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_JOB_ID = re.compile(r"[0-9a-f]{12}\Z")
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
log = structlog.get_logger()


def _clean(value: str, limit: int) -> str:
    return value.replace("\x00", "")[:limit]


def check_text(what: str, value: str, limit: int) -> None:
    """A string the ledger stores: at most `limit` characters (its column), no NUL (PostgreSQL refuses it)."""
    if len(value) > limit or "\x00" in value:
        raise InvalidArgument(f"{what} must be at most {limit} characters, without NUL (got {len(value)})")


def tier_choices(fabric_tiers: Sequence[str] = ()) -> list[str]:
    """Tier names a job may ask for, lowest first: the node, the scheduler's fabric tiers, the whole cluster."""
    return list(dict.fromkeys(["node", *fabric_tiers, "cluster"]))


def validate_spec(
    spec: common_pb2.JobSpec, fabric_tiers: Sequence[str] = (), settings: SchedulerSettings | None = None
) -> None:
    """Raise InvalidArgument with a message a person understands; nothing has been written yet.

    `fabric_tiers` are the scheduler's fabric tier names (SchedulerSettings.fabric.tiers), for the tier fields.
    """
    problems = []
    max_replicas = settings.max_replicas if settings else MAX_REPLICAS
    max_command = settings.max_command_bytes if settings else MAX_COMMAND_BYTES
    max_vars = settings.max_env_vars if settings else MAX_ENV_VARS
    max_env = settings.max_env_bytes if settings else MAX_ENV_BYTES
    if not spec.name.strip():
        problems.append("name must not be empty")
    elif len(spec.name) > MAX_NAME:
        problems.append(f"name is {len(spec.name)} characters; at most {MAX_NAME}")
    elif "\x00" in spec.name:
        problems.append("name must not contain NUL characters")
    if spec.replicas < 1:
        problems.append(f"replicas must be at least 1, got {spec.replicas}")
    elif spec.replicas > max_replicas:
        problems.append(f"replicas must be at most {max_replicas} (--max-replicas), got {spec.replicas}")
    if spec.gpus_per_replica < 1:
        problems.append(f"gpus_per_replica must be at least 1, got {spec.gpus_per_replica}")
    elif spec.gpus_per_replica > MAX_GPUS_PER_REPLICA:
        problems.append(f"gpus_per_replica must be at most {MAX_GPUS_PER_REPLICA}, got {spec.gpus_per_replica}")
    if spec.procs_per_replica < 0:
        problems.append(f"procs_per_replica must be 0 (one per GPU) or 1, got {spec.procs_per_replica}")
    elif spec.procs_per_replica > 1 and spec.procs_per_replica != spec.gpus_per_replica:
        problems.append(f"procs_per_replica must be 0 or 1 (or equal gpus_per_replica), got {spec.procs_per_replica}")
    if not spec.command or not spec.command[0].strip():
        problems.append("command must not be empty")
    elif len(spec.command) > MAX_COMMAND_ARGS or sum(len(a) for a in spec.command) > max_command:
        problems.append(
            f"command is too long: at most {MAX_COMMAND_ARGS} arguments and {max_command} bytes (--max-command-bytes)"
        )
    elif any("\x00" in a for a in spec.command):
        problems.append("command arguments must not contain NUL characters")
    if len(spec.env) > max_vars or sum(len(k) + len(v) for k, v in spec.env.items()) > max_env:
        problems.append(
            f"env is too large: at most {max_vars} variables (--max-env-vars) and {max_env} bytes (--max-env-bytes)"
        )
    for key, value in spec.env.items():
        if not _ENV_KEY.match(key):
            problems.append(f"env name {key!r} is not a valid variable name")
            break
        if "\x00" in value:
            problems.append(f"env {key} must not contain NUL characters")
            break
    choices = tier_choices(fabric_tiers)
    for field_name in ("required_tier", "preferred_tier"):
        value = getattr(spec, field_name)
        if value and value not in choices:
            problems.append(
                f"{field_name} {value[:80]!r} is not a tier of this cluster; valid tiers: {', '.join(choices)}"
            )
    if len(spec.gpu_model) > 128 or "\x00" in spec.gpu_model:
        problems.append("gpu_model must be at most 128 characters, without NUL")
    if spec.mig_profile and spec.gpu_milli:
        problems.append("ask for a MIG profile (mig_profile) or a GPU share (gpu_milli), not both")
    if spec.mig_profile and not mig.known_profile(spec.mig_profile):
        problems.append(
            f"mig_profile {spec.mig_profile[:40]!r} is not a MIG profile; valid profiles: "
            f"{', '.join(mig.all_profile_names())}"
        )
    if spec.gpu_milli and not 1 <= spec.gpu_milli <= 999:
        problems.append(
            f"gpu_milli must be 1-999 thousandths of a GPU (use gpus_per_replica for whole GPUs), got {spec.gpu_milli}"
        )
    if (spec.mig_profile or spec.gpu_milli) and spec.gpus_per_replica != 1:
        problems.append(
            f"a replica on a MIG instance or a GPU share uses one GPU: gpus_per_replica must be 1, "
            f"got {spec.gpus_per_replica}"
        )
    if len(spec.queue) > 64 or any(not (c.isalnum() or c in "._-") for c in spec.queue):
        problems.append(f"queue {spec.queue[:80]!r} must be at most 64 letters, digits, '.', '_' or '-'")
    if not 0 <= spec.time_limit_s <= MAX_TIME_LIMIT_S:  # also refuses NaN
        problems.append(f"time_limit_s must be 0 (none) to {MAX_TIME_LIMIT_S:.0f} seconds, got {spec.time_limit_s}")
    if not 0 <= spec.max_restarts <= MAX_RESTARTS:
        problems.append(f"max_restarts must be 0-{MAX_RESTARTS}, got {spec.max_restarts}")
    if not 0 <= spec.keep_checkpoints <= MAX_KEEP_CHECKPOINTS:
        problems.append(
            f"keep_checkpoints must be 0 (the checkpoint coordinator's default) to "
            f"{MAX_KEEP_CHECKPOINTS}, got {spec.keep_checkpoints}"
        )
    try:
        cpu_milli(spec.cpus_per_replica)
    except ValueError:
        problems.append(
            f"cpus_per_replica must be 0 (no limit) or a count of CPUs from 0.001 to {MAX_CPUS}, "
            f"got {spec.cpus_per_replica}"
        )
    if spec.memory_per_replica:
        try:
            parse_size(spec.memory_per_replica)
        except ValueError:
            problems.append(
                f"memory_per_replica {spec.memory_per_replica[:40]!r} is not a size like 512M or 64G "
                "(a number with a binary unit K, M, G, T or P)"
            )
    problems += serving_problems(spec)
    problems += segment_problems(spec, choices) + spare_problems(spec) + elastic_problems(spec)
    problems += graph_problems(spec, settings.max_array_size if settings else DEFAULT_MAX_ARRAY_SIZE)
    if problems:
        raise InvalidArgument("invalid job: " + "; ".join(problems))


def _state(job) -> int:
    if job["state"] == "RUNNING" and job["preempted_by"] and job["preempted_by"] != job["id"]:  # (itself: a grow)
        return common_pb2.JOB_STATE_PREEMPTING
    return JOB_STATES[job["state"]]


def check_job_id(job_id: str) -> str:
    """Any malformed id is simply an id no job has: NOT_FOUND, like an unknown well-formed one."""
    if not _JOB_ID.match(job_id or ""):
        raise NotFound(f"no job with id {job_id[:80]!r}")
    return job_id


def scoped_request_id(tenant: str, request_id: str) -> str:
    """A tenant's idempotency keys live apart from every other tenant's: one tenant repeating another's key gets
    a job of its own, never the other's."""
    if not tenant or not request_id:
        return request_id
    return "t:" + hashlib.sha256(f"{tenant}\x00{request_id}".encode()).hexdigest()


class SchedulerServicer(PoolRpcs, scheduler_pb2_grpc.SchedulerServicer):
    """The job API. With authentication on (services.common.auth), a `user` sees, watches, cancels and checkpoints
    only its own tenant's jobs (another tenant's job answers NOT_FOUND, like one that does not exist); an `admin`
    sees every job. Per-tenant limits (`limits`) are checked here, before anything is queued to the cycle."""

    def __init__(self, service: SchedulerService, limits: TenantLimits | None = None) -> None:
        self.service = service
        self.limits = limits or TenantLimits()
        self._inflight: dict[str, int] = {}  # tenant -> submissions queued to the cycle, not yet answered
        self._watches: dict[str, int] = {}  # tenant -> WatchJobs streams open

    async def _job(self, result) -> common_pb2.Job:
        if isinstance(result, tuple):  # ("read", id): finished or created elsewhere; the ledger has it
            jobs = await self.service.read_jobs(job_ids=[result[1]], tenant=tenant_scope())
            if not jobs:
                raise NotFound(f"no job with id {result[1]!r}")
            return jobs[0]
        return result

    async def _own(self, job_id: str) -> common_pb2.Job | None:
        """NotFound unless the caller may see `job_id` (checked only for a user; None: not read)."""
        scope = tenant_scope()
        if scope is None:
            return None
        jobs = await self.service.read_jobs(job_ids=[job_id], tenant=scope)
        if not jobs:
            audit_denied(SCHEDULER_PREFIX + "GetJob", f"job/{job_id}", "not a job of the caller's tenant, or none")
            raise NotFound(f"no job with id {job_id!r}")
        return jobs[0]

    def _check_limits(self, tenant: str) -> None:
        ident = current_identity()
        if not self.limits.enabled(ident):
            return
        cap = self.limits.pending_cap(ident)
        if cap is not None:
            pending = sum(1 for j in self.service.state.jobs.unordered("PENDING") if j.tenant == tenant)
            pending += self._inflight.get(tenant, 0)
            if pending >= cap:
                raise ResourceExhausted(
                    f"tenant {tenant!r} has {pending} pending jobs, the most it may have is "
                    f"{cap}; wait for some to start or cancel some"
                )
        wait = self.limits.take(ident)
        if wait > 0:
            raise ResourceExhausted(f"tenant {tenant!r} is submitting faster than its rate limit; retry in {wait:.2f}s")

    @unary
    async def SubmitJob(self, request, context):
        normalize_roles(request.spec)
        validate_spec(request.spec, self.service.settings.fabric.tiers, self.service.settings)
        least = smallest(request.spec)  # (an elastic gang needs only its minimum to fit)
        check_segments_fit(self.service.state.nodes.values(), least, self.service.settings.fabric.tiers)
        check_spares_fit(self.service.state.nodes.values(), least, self.service.settings.fabric.tiers)
        check_text("request_id", request.request_id, 128)
        ident = current_identity()
        tenant = ident.tenant if ident is not None else ""
        self._check_limits(tenant)
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        try:
            result = await self.service.submit(
                Submit(
                    request.spec,
                    scoped_request_id(tenant, request.request_id),
                    tenant=tenant,
                    admin=ident is None or ident.admin,
                )
            )
        except PermissionDenied as exc:
            audit_denied(SCHEDULER_PREFIX + "SubmitJob", f"queue/{request.spec.queue or 'default'}", str(exc))
            raise
        finally:
            left = self._inflight[tenant] - 1
            if left:
                self._inflight[tenant] = left
            else:
                del self._inflight[tenant]
        job = await self._job(result)
        audit_admin(
            SCHEDULER_PREFIX + "SubmitJob", f"job/{job.id}", f"priority {job.spec.priority}, queue {job.spec.queue}"
        )
        return job

    @unary
    async def GetJob(self, request, context):
        job_id = check_job_id(request.job_id)
        # One read transaction (one snapshot, one trip to a reader thread) for the job, its goodput and what its
        # attempt restored from; a job finished past --retain-finished comes from job_archive (retention.py).
        row, archived, listed, restore, claim = await self.service.read_snapshot(
            _job_view, job_id, tenant_scope(), self.service.clock()
        )
        if row is None:
            if archived is None:
                raise NotFound(f"no job with id {request.job_id!r}")
            return archived
        job = job_from_row(*row)
        if listed:
            job.goodput.CopyFrom(accounting.to_proto(listed[0][1]))
        job.restore = restore
        if claim is not None:
            job.claim.CopyFrom(common_pb2.Claim(**claim))
        return job

    @unary
    async def ListJobs(self, request, context):
        """A page of jobs, newest first (paging.py: sizes, byte budget, tokens). The filters are SQL, before paging:
        PREEMPTING is a RUNNING job with a preemptor (ledger.read_jobs)."""
        states = []
        for s in request.states:
            if s == common_pb2.JOB_STATE_PREEMPTING:
                states.append("PREEMPTING")
                continue
            if s not in JOB_STATE_NAMES:
                raise InvalidArgument(f"unknown job state {s}")
            states.append(JOB_STATE_NAMES[s])
        size = paging.job_page_size(request.page_size, request.limit)
        scope = tenant_scope()
        digest = paging.filter_digest(sorted(set(states)), scope)
        after = paging.decode_job_token(request.page_token, digest) if request.page_token else None
        jobs = await self.service.read_jobs(states=states, limit=size + 1, tenant=scope, after=after)
        page, more = paging.fit(jobs, size)
        token = paging.job_token(page[-1], digest) if more else ""
        return scheduler_pb2.ListJobsResponse(jobs=page, next_page_token=token)

    @unary
    async def CheckpointJob(self, request, context):
        job_id = check_job_id(request.job_id)
        reason = request.reason or "user"
        if len(reason) > 1000 or "\x00" in reason:
            raise InvalidArgument("reason must be at most 1000 characters, without NUL")
        await self._own(job_id)
        job, reason, at = await self.service.execute(RequestCheckpoint(job_id, reason))
        audit_admin(SCHEDULER_PREFIX + "CheckpointJob", f"job/{job_id}", reason)
        return scheduler_pb2.CheckpointJobResponse(job=job, reason=reason, requested_at=at)

    @unary
    async def GetGoodput(self, request, context):
        if request.limit < 0:
            raise InvalidArgument(f"limit must not be negative, got {request.limit}")
        if not request.since >= 0:
            raise InvalidArgument(f"since must be a unix time >= 0, got {request.since}")
        # Totals from goodput_totals and the live ledger; a page of jobs by key (accounting.read_goodput_report).
        size, scope = paging.job_page_size(request.page_size, request.limit), tenant_scope()
        digest = accounting.page_digest(request.since, scope)
        after = accounting.page_after(request.page_token, digest)
        got = await self.service.read_snapshot(
            accounting.read_goodput_report,
            self.service.clock(),
            since=request.since,
            limit=size,
            tenant=scope,
            after=after,
        )
        return scheduler_pb2.GetGoodputResponse(
            cluster=accounting.to_proto(got.total),
            job_count=got.job_count,
            jobs=[
                scheduler_pb2.JobGoodput(
                    job_id=j["id"], name=j["name"], state=_state(j), attempts=n, goodput=accounting.to_proto(g)
                )
                for j, g, n in got.listed
            ],
            next_page_token=accounting.page_token(got.after, digest),
            tenants=accounting.group_protos(got.tenants),
            queues=accounting.group_protos(got.queues),
        )

    @unary
    async def CancelJob(self, request, context):
        scope = tenant_scope()
        job_id = check_job_id(request.job_id)
        try:
            # A user's cancel of a job it may not see is refused by a read, before any command: a command, even
            # one that refuses, runs in the writer's cycle, whose transaction commits (the clock's generation, the
            # change log). The command checks the tenant again, for a job that changed hands meanwhile.
            if scope is not None and not await self.service.read_jobs(job_ids=[job_id], tenant=scope):
                raise NotFound(f"no job with id {job_id!r}")
            job = await self._job(await self.service.execute(Cancel(job_id, scope)))
        except NotFound:
            if scope is not None:  # perhaps another tenant's job: NOT_FOUND hides it, the audit trail does not
                audit_denied(
                    SCHEDULER_PREFIX + "CancelJob", f"job/{request.job_id[:40]}", "no job of the caller's tenant"
                )
            raise
        audit_admin(SCHEDULER_PREFIX + "CancelJob", f"job/{job.id}", f"tenant {job.tenant!r}")
        return job

    @stream
    async def WatchJobs(self, request, context):
        ids = frozenset(request.job_ids) if request.job_ids else None
        if ids is not None:
            for job_id in ids:
                check_job_id(job_id)
        scope = tenant_scope()
        ident = current_identity()
        # The caller: its tenant; with authentication off, its connection (there is no one else to tell apart).
        caller = ident.tenant if ident is not None else f"peer {context.peer()}"
        limit = self.service.settings.max_watches
        if self._watches.get(caller, 0) >= limit:
            raise ResourceExhausted(
                f"{caller if ident is None else 'tenant ' + repr(caller)} has {limit} WatchJobs streams open, the "
                "limit (--max-watches): close one, or retry in a few seconds"
            )
        self._watches[caller] = self._watches.get(caller, 0) + 1
        entry = self.service.fanout.subscribe(ids, scope)
        try:
            current = await self.service.read_jobs(job_ids=sorted(ids), tenant=scope) if ids is not None else []
            if ids is not None and len(current) != len(ids):
                missing = sorted(ids - {j.id for j in current})
                if scope is not None:
                    audit_denied(
                        SCHEDULER_PREFIX + "WatchJobs", f"job/{missing[0][:40]}", "no job of the caller's tenant"
                    )
                raise NotFound(f"no job with id {missing[0]!r}")
            for job in current:
                yield scheduler_pb2.JobEvent(job=job, at=job.finished_at or job.started_at or job.submitted_at)
            while True:
                got = await entry.get()
                if got is None:
                    raise ResourceExhausted(
                        f"this watcher fell more than {entry.limit} changes behind (--watch-queue) and was ended; "
                        "watch again: the stream starts with the current state"
                    )
                yield scheduler_pb2.JobEvent(job=got[0], at=got[1])
        finally:
            self.service.fanout.unsubscribe(entry)
            left = self._watches[caller] - 1
            if left:
                self._watches[caller] = left
            else:
                del self._watches[caller]

    @unary
    async def ListNodes(self, request, context):
        """A page of nodes by name: only that page's nodes, allocations and GPUs are read (paging.py)."""
        size = paging.page_size(request.page_size, paging.DEFAULT_NODE_PAGE, paging.MAX_NODE_PAGE)
        after = paging.decode_node_token(request.page_token) if request.page_token else None

        def read(conn):
            rows = ledger.read_nodes(conn, after=after, limit=size + 1)
            ids = [n["id"] for n, _, _ in rows]
            return rows, ledger.read_node_gpus(conn, ids), ledger.read_releasing(conn, ids)

        rows, gpus, releasing = await self.service.read(read)
        nodes = [
            node_from_row(n, used, shared, gpus.get(n["id"], []), releasing.get(n["id"])) for n, used, shared in rows
        ]
        page, more = paging.fit(nodes, size)
        return scheduler_pb2.ListNodesResponse(nodes=page, next_page_token=paging.node_token(page[-1]) if more else "")

    async def _cordon(self, name: str, cordon: bool, reason: str = "") -> common_pb2.Node:
        if not name or len(name) > MAX_NAME:
            raise NotFound(f"no node named {name[:80]!r}")
        if len(reason) > 1000 or "\x00" in reason:
            raise InvalidArgument("reason must be at most 1000 characters, without NUL")
        await self.service.execute(CordonNode(name, cordon, reason))
        audit_admin(SCHEDULER_PREFIX + ("DrainNode" if cordon else "UndrainNode"), f"node/{name}", reason)
        for node in await self.service.read_nodes():
            if node.name == name:
                return node
        raise NotFound(f"no node named {name[:80]!r}")

    @unary
    async def DrainNode(self, request, context):
        return await self._cordon(request.node_name, True, request.reason)

    @unary
    async def UndrainNode(self, request, context):
        return await self._cordon(request.node_name, False)

    @unary
    async def ListQueues(self, request, context):
        if len(request.name) > queues.MAX_QUEUE_NAME:
            raise NotFound(f"no queue {request.name[:64]!r}")
        found = await self.service.read(queues.read_queues, request.name, tenant_scope())
        if request.name and not found:
            raise NotFound(f"no queue {request.name!r}")
        return scheduler_pb2.ListQueuesResponse(queues=found)

    @unary
    async def SetQueue(self, request, context):
        spec = queues.spec_from_proto(request.spec)
        await self.service.execute(SetQueue(spec))
        audit_admin(
            SCHEDULER_PREFIX + "SetQueue",
            f"queue/{spec.name}",
            f"max_priority {spec.max_priority}, cohort {spec.cohort!r}",
        )
        (status,) = await self.service.read(queues.read_queues, spec.name)
        return status

    @unary
    async def GetRankLogs(self, request, context):
        job_id = check_job_id(request.job_id)
        if request.attempt < 0:
            raise InvalidArgument(f"attempt must be 0 (the current one) or more, got {request.attempt}")
        rank = request.rank if request.HasField("rank") else None
        if rank is not None and rank < 0:
            raise InvalidArgument(f"rank must not be negative, got {rank}")
        scope = tenant_scope()
        try:
            live = self.service.state.jobs.get(job_id)
            layout = (
                {live.attempt: {r.rank: r.node for r in list(live.ranks.values())}}
                if live is not None and live.state == "RUNNING"
                else None
            )
            attempt, rows = await self.service.read(
                ledger.rank_log_sources, job_id, request.attempt, rank, scope, layout
            )
        except NotFound:
            if scope is not None:
                audit_denied(SCHEDULER_PREFIX + "GetRankLogs", f"job/{job_id}", "no job of the caller's tenant")
            raise
        key = self.service.state.rank_key
        expires = int(time.time()) + LOG_CREDENTIAL_S
        sources = [
            scheduler_pb2.RankLogSource(
                rank=r,
                node=node,
                address=f"{address}:{port}" if port else "",
                credential=log_credential(node_logs_key(key, node), job_id, attempt, expires) if key else "",
            )
            for r, node, address, port in rows
        ]
        return scheduler_pb2.GetRankLogsResponse(attempt=attempt, sources=sources)

    @unary
    async def DeleteQueue(self, request, context):
        if not request.name or len(request.name) > queues.MAX_QUEUE_NAME:
            raise NotFound(f"no queue {request.name[:64]!r}")
        await self.service.execute(DeleteQueue(request.name))
        audit_admin(SCHEDULER_PREFIX + "DeleteQueue", f"queue/{request.name}")
        return scheduler_pb2.DeleteQueueResponse()


class NodeServicer(agent_pb2_grpc.NodeServiceServicer):
    def __init__(self, service: SchedulerService) -> None:
        self.service = service
        self._ledger_id: str | None = None  # the ledger's cluster id, once read

    @unary
    async def RegisterNode(self, request, context):
        name = request.node_name
        self._caller_is(name, "RegisterNode", context)
        if not name or len(name) > MAX_NAME or not _NODE_NAME.match(name):
            raise InvalidArgument(f"node name {name[:80]!r} must be 1-253 letters, digits, '.', '_' or '-'")
        check_text("address", request.address, 255)
        check_text("agent_instance", request.agent_instance, 64)
        check_text("topology.profile", request.topology.profile, 128)
        gpus = request.topology.gpus
        for g in gpus:
            check_text(f"GPU {g.index} uuid", g.uuid, 64)
            check_text(f"GPU {g.index} name", g.name, 128)
        indices = [g.index for g in gpus]
        if sorted(indices) != list(range(len(indices))):
            raise InvalidArgument(f"GPU indices must be 0..{len(indices) - 1}, got {sorted(indices)}")
        if len(request.live_attempts) > 100_000 or any(len(k) > 200 for k in request.live_attempts):
            raise InvalidArgument("live_attempts: at most 100,000 keys of at most 200 characters")
        low, high = request.rank_port_low, request.rank_port_high
        if (low or high) and not 1024 <= low <= high <= 65535:
            raise InvalidArgument(f"rank port range {low}-{high}: want 1024 <= low <= high <= 65535")
        try:
            host_cpus = cpu_milli(request.cpus)
        except ValueError:
            raise InvalidArgument(
                f"cpus must be a count of CPUs between 0 and {MAX_CPUS}, got {request.cpus}"
            ) from None
        if not 0 <= request.logs_port <= 65535:
            raise InvalidArgument(f"logs_port must be a port (0: none), got {request.logs_port}")
        if not 0 <= request.memory_bytes <= MAX_MEMORY:
            raise InvalidArgument(f"memory_bytes must be between 0 and {MAX_MEMORY}, got {request.memory_bytes}")
        if request.containment not in CONTAINMENT_KINDS:
            raise InvalidArgument(
                f"containment must be one of {', '.join(k for k in CONTAINMENT_KINDS if k)}, "
                f"not {request.containment[:40]!r}"
            )
        topology = MessageToDict(request.topology, preserving_proto_field_name=True)
        cluster_id = await self._cluster_id()
        acked = await self.service.execute(
            Register(
                name,
                request.topology,
                topology,
                request.address or "127.0.0.1",
                request.agent_instance,
                mig_manage=request.mig_manage,
                containment=request.containment,
                confirms_release=request.confirms_release,
                live_attempts=tuple(request.live_attempts),
                rank_ports=(request.rank_port_low, request.rank_port_high),
                cpu_milli=host_cpus,
                memory=request.memory_bytes,
                logs_port=request.logs_port,
            )
        )
        s = self.service.settings
        resp = agent_pb2.RegisterNodeResponse(
            heartbeat_interval_ms=int(s.heartbeat_interval * 1000),
            lease_timeout_ms=int(s.lease_timeout * 1000),
            acked_revision=acked,
            cluster_id=cluster_id,
            logs_key=node_logs_key(self.service.state.rank_key, name) if self.service.state.rank_key else "",
        )
        node = self.service.state.nodes.get(name)
        if node is not None:
            # The node's last assignment revision as Register read it from the ledger (or later): an agent whose
            # saved acked revision is above it holds another ledger's state (or one older than a restore).
            resp.revision = node.revision
        return resp

    async def _cluster_id(self) -> str:
        """The ledger's identity, read once (it never changes); written here if the ledger lost its row."""
        if self._ledger_id is None:
            try:
                found = await self.service.read(ledger.cluster_id)
                if not found:
                    found = await asyncio.get_running_loop().run_in_executor(None, self._ensure_cluster_id)
            except SQLAlchemyError as exc:  # a ledger from before revision 0015: agents treat the id as unknown
                log.warning(
                    "ledger_identity_unreadable",
                    error=(str(exc).splitlines() or [""])[0][:200],
                    hint="run `phalanx db upgrade`",
                )
                return ""  # asked again at the next registration
            self._ledger_id = found
            if found:
                log.info("ledger_identity", cluster_id=found)
        return self._ledger_id

    def _ensure_cluster_id(self) -> str:
        with self.service.engine.begin() as conn:
            return ledger.ensure_cluster_id(conn)

    def _caller_is(self, name: str, method: str, context) -> None:
        """The caller must be node `name` (its node token, its TLS certificate): else PERMISSION_DENIED."""
        cn = peer_common_name(context)
        check_node_caller(name, "/phalanx.v1.NodeService/" + method, cn, self.service.state.nodes if cn else ())

    @unary
    async def Heartbeat(self, request, context):
        self._caller_is(request.node_name, "Heartbeat", context)
        # Health text is stored; a heartbeat must never fail on it (the agent would reconnect in a loop): clean it.
        for e in request.events:
            e.kind, e.reason = _clean(e.kind, 32), _clean(e.reason, 2000)
        if request.HasField("health"):
            request.health.reason = _clean(request.health.reason, 2000)
            for g in request.health.gpus:
                g.reasons[:] = [_clean(r, 2000) for r in g.reasons]
        state, reregister = self.service.intake.heartbeat(
            request.node_name,
            request.health if request.HasField("health") else None,
            request.events,
            draining=request.draining,
            mig_modes=request.mig_modes,
            instance=request.agent_instance,
        )
        return agent_pb2.HeartbeatResponse(
            state=NODE_STATES.get(state, common_pb2.NODE_STATE_UNSPECIFIED), reregister=reregister
        )

    @stream
    async def StreamAssignments(self, request, context):
        name = request.node_name
        self._caller_is(name, "StreamAssignments", context)
        if name not in self.service.state.nodes:
            nodes = {n.name for n in await self.service.read_nodes()}
            if name not in nodes:
                raise FailedPrecondition(f"node {name[:80]!r} is not registered; call RegisterNode first")
        feed = self.service.fanout.open_feed(name)  # before the catch-up read, so nothing falls in between
        last = request.after_revision
        try:
            need_read = True
            while not self.service._stopping:
                # The view knows each node's last assignment revision (this replica's commits, and what other
                # replicas recorded in ledger_changes): the ledger is read only when it holds something newer,
                # so 4,096 idle streams cost no queries.
                if need_read and self.service.intake.revision_of(name) > last:
                    for revision, payload in await self.service.assignments_after(name, last):
                        last = revision
                        yield agent_pb2.Assignment.FromString(payload)
                try:
                    item = await asyncio.wait_for(feed.get(), timeout=30.0)
                except TimeoutError:
                    need_read = True  # a safety net only: commits and notifications push
                    continue
                if item is None or item[0] > last + 1:
                    need_read = True  # another process wrote, or we missed one: read the ledger
                elif item[0] == last + 1:
                    last = item[0]
                    need_read = False
                    yield item[1]  # the message this replica just committed
                else:
                    need_read = False  # already sent
        finally:
            self.service.fanout.close_feed(name, feed)

    @unary
    async def AckAssignments(self, request, context):
        self._caller_is(request.node_name, "AckAssignments", context)
        if request.revision < 0:
            raise InvalidArgument("revision must not be negative")
        if not self.service.intake.ack(request.node_name, request.revision):
            raise NotFound(f"node {request.node_name[:80]!r} is not registered")
        return agent_pb2.AckAssignmentsResponse()

    @unary
    async def ReportAttemptReleased(self, request, context):
        self._caller_is(request.node_name, "ReportAttemptReleased", context)
        check_job_id(request.job_id)
        if request.attempt < 1:
            raise InvalidArgument("attempt must be >= 1")
        node = self.service.state.nodes.get(request.node_name)
        if request.agent_instance and node is not None and node.agent_instance not in ("", request.agent_instance):
            raise FailedPrecondition(
                f"a release from agent instance {request.agent_instance[:16]!r} of node {request.node_name[:80]!r}, "
                "which is not the instance registered now: register again"
            )
        released = await self.service.execute(AttemptReleased(request.node_name, request.job_id, request.attempt))
        return agent_pb2.ReportAttemptReleasedResponse(released=released)

    @unary
    async def ReportRankStatus(self, request, context):
        self._caller_is(request.node_name, "ReportRankStatus", context)
        state = RANK_STATE_NAMES.get(request.state)
        if state is None or state == "ASSIGNED":
            raise InvalidArgument(f"rank state {request.state} cannot be reported")
        if request.rank < 0 or request.attempt < 1:
            raise InvalidArgument("rank must be >= 0 and attempt >= 1")
        check_job_id(request.job_id)
        check_text("message", request.message[:2000], 2000)
        node = self.service.state.nodes.get(request.node_name)
        if request.agent_instance and node is not None and node.agent_instance not in ("", request.agent_instance):
            raise FailedPrecondition(
                f"a report from agent instance {request.agent_instance[:16]!r} of node {request.node_name[:80]!r}, "
                "which is not the instance registered now: register again"
            )
        stale = await self.service.intake.report_rank(
            RankReport(
                request.node_name,
                request.job_id,
                request.attempt,
                request.rank,
                state,
                request.exit_code,
                request.message[:2000],
                request.pid,
                retryable=request.retryable,
            )
        )
        return agent_pb2.ReportRankStatusResponse(stale=stale)

    @unary
    async def ReportReadiness(self, request, context):
        self._caller_is(request.node_name, "ReportReadiness", context)
        if request.attempt < 1:
            raise InvalidArgument("attempt must be >= 1")
        check_job_id(request.job_id)
        node = self.service.state.nodes.get(request.node_name)
        if request.agent_instance and node is not None and node.agent_instance not in ("", request.agent_instance):
            raise FailedPrecondition(
                f"a report from agent instance {request.agent_instance[:16]!r} of node {request.node_name[:80]!r}, "
                "which is not the instance registered now: register again"
            )
        stale = await self.service.execute(
            ReadinessReport(
                request.node_name, request.job_id, request.attempt, request.ready, _clean(request.message, 500)
            )
        )
        return agent_pb2.ReportReadinessResponse(stale=stale)


def _job_view(conn, job_id: str, tenant: str | None, now: float):
    """GetJob's reads in the caller's transaction: (the job's row, allocations and parts; None when it is not
    active or finished in `jobs`), the archived job (only then), its goodput listing, its restore message, its
    standing claim (None: none)."""
    rows = ledger.read_jobs(conn, job_ids=[job_id], tenant=tenant)
    if not rows:
        return None, retention.read_archived_job(conn, job_id, tenant), None, "", None
    _, listed, _ = accounting.read_goodput(conn, now, job_ids=[job_id])
    return rows[0], None, listed, ledger.restore_message(conn, job_id), ledger.claim_detail(conn, job_id, now)
