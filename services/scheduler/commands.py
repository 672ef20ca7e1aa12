"""The commands a scheduling cycle applies: submissions, cancels, checkpoint requests, node registrations, rank and
health reports, drains and cordons, queue changes. Each validates before it writes, so a refused command changes
nothing (services/scheduler/cycle.py runs them, one transaction per cycle)."""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from typing import Any

import structlog

from phalanx.api.v1 import common_pb2
from phalanx.core.quota import DEFAULT_QUEUE, QueueSpec
from phalanx.core.resources import cpu_milli, parse_size
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

from . import ledger
from .admission import (
    check_fits_ever,
    check_fits_host_resources,
    check_fits_model,
    check_fits_required_tier,
    check_priority,
    check_queue,
)
from .convert import job_from_record, serving_of_spec
from .elastic_fields import shape_of_spec as elastic_shape
from .elastic_fields import smallest
from .graph_fields import SubmitGraph
from .jobgraph import cancel_tasks
from .segment_fields import shape_of_spec
from .settings import SchedulerSettings
from .spare_fields import spare_shape
from .spares import drop_spares_on, leave_drained_node, still_booked, swap_or_teardown
from .state import TERMINAL_RANK_STATES, JobRecord, NodeRecord, RankRecord, SchedulerState, attempt_key
from .transitions import (
    Command,
    Cycle,
    CycleCommand,
    change_job,
    release_held,
    set_job,
    teardown,
)
from .vanished import tear_down_on_vanished
from .work import job_row

log = structlog.get_logger()


@dataclass
class Submit(Command):
    spec: common_pb2.JobSpec
    request_id: str
    tenant: str = ""  # the caller's tenant (authentication on), stamped on the job
    admin: bool = True  # an admin submits it (always so with authentication off): no priority cap applies
    # A service's replica (services/scheduler/serving): the service's name, and its index, revision, spread tier
    # and surge flag, kept in the job's `serving` JSON with what the spec asks for serving
    service: str = ""
    replica_of: dict[str, Any] | None = None


def register_all(cycle: Cycle, registers: list[Register]) -> dict[int, Any]:
    """Registrations of one cycle: every node's rows written at once (ledger.upsert_nodes), then each applied to
    the view in order. A node registering twice in the cycle takes the second one by itself."""
    first: dict[str, int] = {}
    for i, reg in enumerate(registers):
        first.setdefault(reg.name, i)
    batch = [registers[i] for i in first.values()]
    written = cycle.work.ask(ledger.upsert_nodes, [r.ledger_row(cycle) for r in batch])
    results: dict[int, Any] = {}
    for i, reg in enumerate(registers):
        results[i] = reg.execute(cycle, written[reg.name] if first[reg.name] == i else None)
    return results


def submit_all(cycle: Cycle, submits: list[Submit]) -> dict[int, Any]:
    """Accept every valid submission into the view; `write_new_jobs` inserts them all in one statement.

    Repeated request ids return the first job.
    """
    results: dict[int, Any] = {}
    existing = cycle.work.read(ledger.find_by_request_ids, [s.request_id for s in submits if s.request_id])
    new: list[JobRecord] = []
    by_request: dict[str, JobRecord] = {}
    graph = SubmitGraph(cycle, [s.spec for s in submits if s.spec.after])  # job graphs: dependencies checked
    for i, sub in enumerate(submits):
        if sub.request_id and sub.request_id in existing:
            try:  # a repeated request may not make its job wait for itself (graph_fields)
                graph.check(sub.spec, sub.tenant, sub.admin, existing[sub.request_id])
            except InvalidArgument as exc:
                results[i] = exc
                continue
            results[i] = ("existing", existing[sub.request_id])
            continue
        if sub.request_id and sub.request_id in by_request:
            results[i] = by_request[sub.request_id]
            continue
        try:
            check_submission(cycle.state, cycle.settings, sub)
            after = graph.check(sub.spec, sub.tenant, sub.admin)
        except (FailedPrecondition, PermissionDenied, InvalidArgument) as exc:
            results[i] = exc
            continue
        spec = sub.spec
        job = new_job(sub, cycle.now)
        graph.apply(job, spec, after)
        new.append(job)
        results[i] = job
        if sub.request_id:
            by_request[sub.request_id] = job
    for job in new:
        job.version = -1  # not in the ledger yet
        cycle.state.jobs[job.id] = job
        cycle.work.new_jobs.append(job)
    if new:
        cycle.state.pass_due = True
    for i, value in list(results.items()):
        if isinstance(value, tuple):
            known = cycle.state.jobs.get(value[1])
            results[i] = known if known else ("read", value[1])
    return results


def check_submission(state: SchedulerState, settings: SchedulerSettings, sub: Submit) -> None:
    """The checks of a submission against the view (read only: the accept lane runs them on the event loop):
    whether it could ever fit, its queue, its priority cap. Raises the caller's error."""
    fits = smallest(sub.spec)  # an elastic gang needs only its minimum to fit
    check_fits_ever(state, fits)
    check_fits_model(state, fits)
    check_fits_host_resources(state, fits)
    check_fits_required_tier(state, fits, settings.fabric.tiers)
    check_queue(state, sub.spec, sub.tenant)
    if not sub.admin:
        check_priority(state, sub.spec)


def new_job(sub: Submit, now: float) -> JobRecord:
    """The PENDING job a valid submission makes (its graph fields, if any, are the caller's: SubmitGraph.apply)."""
    spec = sub.spec
    return JobRecord(
        id=uuid.uuid4().hex[:12],
        name=spec.name,
        state="PENDING",
        priority=spec.priority,
        replicas=spec.replicas,
        gpus_per_replica=spec.gpus_per_replica,
        procs_per_replica=spec.procs_per_replica,
        command=list(spec.command),
        env=dict(spec.env),
        submitted_at=now,
        request_id=sub.request_id or None,
        required_tier=spec.required_tier,
        preferred_tier=spec.preferred_tier,
        message="queued",
        gpu_model=spec.gpu_model,
        mig_profile=spec.mig_profile.lower(),
        gpu_milli=spec.gpu_milli,
        max_restarts=spec.max_restarts,
        tenant=sub.tenant,
        time_limit=spec.time_limit_s,
        queue=spec.queue or DEFAULT_QUEUE,
        keep_checkpoints=spec.keep_checkpoints,
        by_admin=sub.admin,
        cpu_milli=cpu_milli(spec.cpus_per_replica),
        memory=parse_size(spec.memory_per_replica) if spec.memory_per_replica else 0,
        service=sub.service,
        serving={**serving_of_spec(spec), **(sub.replica_of or {})},
        shape={**shape_of_spec(spec), **spare_shape(spec), **elastic_shape(spec)},  # each part's keys, merged
    )


@dataclass
class Adopt(CycleCommand):
    """A job the accept lane wrote PENDING (accept_lane in status_lane.py), taken into the view: the pass decides
    it from now on, the other replicas re-read it (the change log), its watchers hear of it. A view reloaded from
    the ledger meanwhile has it already."""

    job: JobRecord

    def execute(self, cycle: Cycle) -> None:
        job = self.job
        if job.id in cycle.state.jobs or job.id in cycle.state.ended:
            return
        cycle.state.jobs[job.id] = job
        cycle.state.pass_due = True
        if cycle.work.changes is not None:
            cycle.work.changes.jobs.add(job.id)
            cycle.work.changes.sched = True
        cycle.touched(job)


def write_new_jobs(cycle: Cycle) -> None:
    """Insert this cycle's new jobs as they are now, then every reservation's allocations, in bulk."""
    if cycle.work.new_jobs:
        for job in cycle.work.new_jobs:
            job.version = 0
        cycle.work.write(ledger.insert_jobs, cycle.work.new_jobs)
        for job in cycle.work.new_jobs:
            cycle.touched(job)
    if cycle.work.new_allocations:
        cycle.work.write(ledger.insert_allocations, cycle.work.new_allocations, cycle.state.nodes, cycle.now)
        cycle.work.write(ledger.insert_attempts, cycle.work.new_allocations, cycle.now)
    if cycle.work.new_spares:  # after the cycle's releases (deferred), as the reservations
        cycle.work.write(ledger.insert_allocations, still_booked(cycle), cycle.state.nodes, cycle.now)
        cycle.work.new_spares = []


@dataclass
class Cancel(CycleCommand):
    job_id: str
    tenant: str | None = None  # a user's tenant: another tenant's job is NOT_FOUND (None: any job)

    def execute(self, cycle: Cycle) -> Any:
        job = lookup_job(cycle, self.job_id)
        if job is None:
            return ("read", self.job_id)  # already finished: cancelling again is a no-op (the servicer scopes it)
        if self.tenant is not None and job.tenant != self.tenant:
            raise NotFound(f"no job with id {self.job_id!r}")
        if job.state == "PENDING":
            if job.array:  # an array's parent: its started tasks go with it (jobgraph)
                cancel_tasks(cycle, job)
            change_job(cycle, job, state="CANCELLED", finished_at=cycle.now, message="cancelled before it started")
            del cycle.state.jobs[job.id]
            cycle.finished.append(job.id)
            if cycle.state.claims.pop(job.id, None) is not None:  # a preemptor that no longer waits keeps nothing
                cycle.work.claim(ledger.end_claim, job.id, "cancelled", cycle.now)
                cycle.state.pass_due = True  # its victims are called off, what it claimed is free for others
            cycle.touched(job)
        else:
            teardown(cycle, job, final_state="CANCELLED", message="cancelled while running")
        return job_from_record(job)


@dataclass
class RequestCheckpoint(CycleCommand):
    """A user asks a running job to checkpoint now (`phalanx checkpoint JOB`)."""

    job_id: str
    reason: str

    def execute(self, cycle: Cycle) -> Any:
        job = lookup_job(cycle, self.job_id)
        if job is None or job.state != "RUNNING":
            state = "PENDING" if job is not None else "finished"
            raise FailedPrecondition(f"job {self.job_id} is {state}, not running: only a running job can checkpoint")
        reason, at = cycle.work.ask(ledger.request_checkpoint, job.id, self.reason, cycle.now)
        log.info("checkpoint_requested", job=job.id, reason=reason)
        return job, reason, at


def lookup_job(cycle: Cycle, job_id: str) -> JobRecord | None:
    """The active job `job_id`; None when it exists but has finished; NotFound when the ledger has no such job."""
    job = cycle.state.jobs.get(job_id)
    if job is not None:
        return job
    row = cycle.work.ask(job_row, job_id)  # a job this cycle finished reads as finished
    if row is None:
        raise NotFound(f"no job with id {job_id!r}")
    if row.state in ("PENDING", "RUNNING"):
        cycle.reload()  # another replica created or changed it since our last look
        return cycle.state.jobs.get(job_id)
    return None


@dataclass
class Register(CycleCommand):
    name: str
    topology: Any  # agent_pb2.HostTopology
    topology_json: dict[str, Any]
    address: str
    agent_instance: str
    mig_manage: bool = False  # started with --mig-manage: the scheduler may switch idle GPUs' MIG mode (migmode.py)
    containment: str = ""  # how the agent contains its ranks (cgroup-v2, cgroup-v1, process-group)
    # The agent confirms when an ended attempt's processes are gone (AttemptReleased); `live_attempts`: the
    # attempts ("job/attempt") it still has processes of. Any other attempt's GPUs held here are free now.
    confirms_release: bool = False
    live_attempts: tuple[str, ...] = ()
    rank_ports: tuple[int, int] = (0, 0)
    cpu_milli: int = 0  # host CPUs (thousandths) and memory (bytes) the agent reported; 0: not reported
    memory: int = 0
    logs_port: int = 0  # where its agent serves its ranks' logs (AgentLogs); 0: none

    def ledger_row(self, cycle: Cycle) -> dict[str, Any]:
        """The node's row as ledger.upsert_nodes takes it."""
        gpus = [
            dict(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                memory_mib=g.memory_mib,
                mig_mode=MIG_MODES.get(g.mig_mode, "UNSUPPORTED"),
                mig_instances=mig_instances(g),
            )
            for g in self.topology.gpus
        ]
        path = cycle.settings.fabric.node_path(
            self.name, self.topology.fabric_cluster_uuid, self.topology.fabric_clique
        )
        return dict(
            name=self.name,
            gpus=gpus,
            topology=self.topology_json,
            address=self.address,
            agent_instance=self.agent_instance,
            profile=self.topology.profile,
            gpu_model=gpus[0]["name"] if gpus else "",
            fabric_path=path,
            now=cycle.now,
            mig_manage=self.mig_manage,
            containment=self.containment,
            confirms_release=self.confirms_release,
            rank_ports=self.rank_ports,
            cpu_milli=self.cpu_milli,
            memory=self.memory,
            logs_port=self.logs_port,
        )

    def execute(self, cycle: Cycle, rows: ledger.Registered | None = None) -> int:
        """`rows`: what register_all already wrote for this node (else it is written here)."""
        from .migmode import registered

        row = self.ledger_row(cycle)
        gpus, path = row["gpus"], row["fabric_path"]
        if rows is None:
            rows = cycle.work.ask(ledger.upsert_nodes, [row])[self.name]
        node_id, acked, revision, cordoned, gpu_ids = rows
        state = cycle.state
        old = state.nodes.get(self.name)
        # An admin drained it (`phalanx node drain`): it stays DRAINED, out of placement, until undrained.
        if cordoned:
            cycle.work.write(ledger.set_node_state, node_id, "DRAINED", CORDON_MESSAGE)
        node = NodeRecord(
            id=node_id,
            name=self.name,
            state="DRAINED" if cordoned else "READY",
            gpus=len(gpus),
            gpu_ids=gpu_ids,
            gpu_model=gpus[0]["name"] if gpus else "",
            memory_mib=max((g["memory_mib"] for g in gpus), default=0),
            path=path,
            address=self.address,
            last_heartbeat=cycle.now,
            persisted_heartbeat=cycle.now,
            agent_instance=self.agent_instance,
            revision=revision,
            closeness=ledger.node_closeness(self.topology_json),
            mig_gpus=frozenset(g["index"] for g in gpus if g["mig_mode"] == "ENABLED"),
            foreign={g["index"]: m for g in gpus if (m := ledger.foreign_mask(g["mig_instances"]))},
            acked_revision=acked,
        )
        node.confirms_release = self.confirms_release
        node.rank_ports = self.rank_ports
        node.cpu_milli, node.memory = self.cpu_milli, self.memory
        if old is not None and old.releasing:
            live = set(self.live_attempts)
            for key, gpus in old.releasing.items():
                if key in live:
                    node.releasing[key] = gpus
                    if key in old.releasing_use:
                        node.releasing_use[key] = old.releasing_use[key]
                else:  # the agent has no process of it left (or lost its state): its GPUs are free
                    job_id, _, attempt = key.rpartition("/")
                    cycle.work.write(ledger.release_attempt_on_node, node.id, job_id, int(attempt), cycle.now)
                    log.info("gpus_released", node=self.name, attempt=key, gpus=list(gpus), by="registration")
        switch_ended = registered(cycle, old, node, self.mig_manage)
        if old is not None and old.gpus == node.gpus:  # health stays until the new agent's heartbeats say otherwise
            node.health, node.health_reason, node.gpu_health = old.health, old.health_reason, old.gpu_health
        if old is not None and old.state == "LOST":
            # Back after it was lost: not used again until a heartbeat of this agent reports it healthy.
            node.health, node.health_reason = "UNKNOWN", "back after it was lost; waiting for a health report"
            cycle.work.write(ledger.set_node_health, node.id, node.health, node.health_reason, node.gpu_health)
        state.nodes[self.name] = node
        if (
            old is None
            or old.gpus != node.gpus
            or old.closeness != node.closeness
            or old.path != node.path
            or node.gpu_health
            or old.mig_gpus != node.mig_gpus
            or old.foreign != node.foreign
            or old.releasing != node.releasing
            or (old.cpu_milli, old.memory) != (node.cpu_milli, node.memory)
            or switch_ended
        ):
            state.rebuild_capacity()  # a new path (another NVLink clique), or a GPU's MIG mode or instances changed
            if old is not None and old.mig_gpus != node.mig_gpus:
                log.info(
                    "node_mig_mode_changed", node=self.name, mig_gpus=sorted(node.mig_gpus), was=sorted(old.mig_gpus)
                )
        else:
            state.set_node_schedulable(self.name)
        if old is not None and old.state != "READY" and not cordoned:
            log.info("node_ready_again", node=self.name, was=old.state)
        if old is not None and node.gpus < old.gpus:
            tear_down_on_vanished(cycle, node, old.gpus, frozenset(self.live_attempts))
        return acked


MIG_MODES = {0: "UNSUPPORTED", 1: "DISABLED", 2: "ENABLED"}  # phalanx.v1.GpuInfo.MigMode; unknown: UNSUPPORTED
MAX_MIG_INSTANCES = 64  # per GPU, as stored (a GPU has at most 7 instances, plus a compute-less one or two)


def mig_instances(gpu: Any) -> list[dict[str, Any]]:
    """A registered GPU's MIG instances (phalanx.v1.GpuInfo.MigInstance) as the ledger stores them."""

    def clean(text: str, limit: int) -> str:
        return text.replace("\x00", "")[:limit]

    return [
        dict(
            profile=clean(i.profile, 32),
            start=i.start,
            size=i.size,
            uuid=clean(i.uuid, 64),
            managed=bool(i.managed),
            gpu_instance_id=i.gpu_instance_id,
            compute_instance_id=i.compute_instance_id,
        )
        for i in list(gpu.mig_instances)[:MAX_MIG_INSTANCES]
    ]


@dataclass
class AttemptReleased(CycleCommand):
    """A node's agent says every process of an ended attempt on it is gone: the GPUs it held there are free."""

    node: str
    job_id: str
    attempt: int

    def execute(self, cycle: Cycle) -> bool:
        """True when GPUs were freed (False: nothing was held for it, e.g. a repeat)."""
        node = cycle.state.nodes.get(self.node)
        if node is None:
            raise NotFound(f"node {self.node!r} is not registered")
        gpus = node.releasing.pop(attempt_key(self.job_id, self.attempt), None)
        if gpus is None:
            return False
        cycle.work.write(ledger.release_attempt_on_node, node.id, self.job_id, self.attempt, cycle.now)
        cycle.state.capacity.release(node.name, set(gpus) - node.held_gpus)
        use = node.releasing_use.pop(attempt_key(self.job_id, self.attempt), None)
        if use is not None:
            cycle.state.capacity.release_use(node.name, *use)
        cycle.state.pass_due = True
        log.info("gpus_released", node=self.node, job=self.job_id, attempt=self.attempt, gpus=list(gpus))
        return True


@dataclass
class ReadinessReport(CycleCommand):
    """The leader's agent says the gang's readiness probe passes now, or no longer does."""

    node: str
    job_id: str
    attempt: int
    ready: bool
    message: str = ""

    def execute(self, cycle: Cycle) -> bool:
        """Returns True when the attempt is not the job's running one (the agent stops probing it)."""
        if self.node not in cycle.state.nodes:
            raise NotFound(f"node {self.node!r} is not registered")
        job = cycle.state.jobs.get(self.job_id)
        if job is None or job.state != "RUNNING" or job.attempt != self.attempt:
            return True
        if not job.allocations or job.allocations[0][1] != self.node:
            raise InvalidArgument(f"job {job.id} attempt {job.attempt} has no leader on node {self.node}")
        if job.ready == self.ready:
            return False
        why = f": {self.message[:200]}" if self.message else ""
        message = "ready: its readiness probe passes" if self.ready else f"not ready: its readiness probe fails{why}"
        change_job(cycle, job, ready=self.ready, ready_at=cycle.now if self.ready else 0.0, message=message)
        cycle.touched(job)  # its watchers, the endpoints' streams and the service controller hear of it
        log.info("readiness_changed", job=job.id, attempt=job.attempt, ready=self.ready, message=self.message)
        return False


@dataclass
class RankReport(CycleCommand):
    node: str
    job_id: str
    attempt: int
    rank: int
    state: str
    exit_code: int
    message: str
    pid: int
    # With FAILED_TO_START: the host could not set the rank up (a MIG instance, the MPS daemon), not the job's
    # fault: the gang is requeued with the failure backoff and the node struck instead of the job failing.
    retryable: bool = False
    # Its row is in the ledger already (the status lane wrote it, status_lane.py): the cycle applies its effects on
    # the view, idempotently (the view may have read that row already), and writes no row.
    recorded: bool = False

    def row(self, rank: RankRecord, node_id: int, at: float) -> dict[str, Any]:
        """Its `ranks` row (the cycle writes it, or the status lane)."""
        return dict(
            job_id=self.job_id,
            attempt=self.attempt,
            rank=rank.rank,
            replica=rank.replica,
            local_rank=rank.local_rank,
            node_id=node_id,
            state=self.state,
            exit_code=self.exit_code,
            pid=self.pid,
            message=self.message,
            updated_at=at,
        )

    def execute(self, cycle: Cycle) -> bool:
        """Apply a rank's status. Returns True when the report is stale and the agent must kill the rank."""
        node = cycle.state.nodes.get(self.node)
        if node is None:
            raise NotFound(f"node {self.node!r} is not registered")
        job = cycle.state.jobs.get(self.job_id)
        if job is None and self.job_id in cycle.state.ended:
            return self.state == "RUNNING"  # it ended for good: no read of the ledger per report
        if self.recorded and (job is None or job.attempt != self.attempt):
            return False  # the attempt ended before the cycle applied the report the lane recorded
        if job is None or job.attempt != self.attempt:
            exists = cycle.work.ask(job_row, self.job_id)  # a job this cycle finished or requeued reads so
            if exists is not None and exists.state == "RUNNING" and exists.attempt == self.attempt:
                cycle.reload()
                job = cycle.state.jobs.get(self.job_id)
        if job is None or job.state != "RUNNING" or job.attempt != self.attempt:
            return self.state == "RUNNING"  # a superseded attempt: the agent must stop it; history keeps the rest
        rank = job.ranks.get(self.rank)
        if rank is None or rank.node != self.node:
            raise InvalidArgument(f"job {job.id} attempt {job.attempt} has no rank {self.rank} on node {self.node}")
        if rank.state in TERMINAL_RANK_STATES and not (self.recorded and rank.state == self.state):
            return False  # the rank ended already: a late report changes nothing
        if rank.state == self.state and not self.recorded:
            return False
        if self.recorded and cycle.work.changes is not None:
            # The lane's row is not in the change log (it writes outside every cycle): announce the job now, so
            # that another replica taking a report for the same gang reads this rank's state first
            cycle.work.changes.jobs.add(job.id)
        if not self.recorded:
            cycle.work.rank_rows.append(self.row(rank, node.id, cycle.now))
        rank.state, rank.exit_code = self.state, self.exit_code
        where = f"rank {self.rank} on {self.node}"
        # What the agent knows beyond the exit code ("out of memory (limit 512M)"), for the job's reason
        why = f": {self.message}" if self.message and not self.message.startswith("exited with code") else ""
        if self.state == "RUNNING":
            release_held(cycle, job)
            if all(r.state != "ASSIGNED" for r in job.ranks.values()):
                job.launch_deadline = None
                if not job.running_at:
                    job.running_at = cycle.now
                    cycle.work.later(ledger.mark_attempt_running, copy.copy(job), cycle.now)
                if job.service and not job.serving.get("ready_probe") and not job.ready:
                    # no probe: a replica serves once every rank runs
                    change_job(cycle, job, ready=True, ready_at=cycle.now)
                cycle.touched(job)
        elif self.state == "EXITED" and job.serving.get("restart") == "always":
            teardown(
                cycle,
                job,
                cause="RANK_FAILED",
                message=f"{where} exited with code {self.exit_code}{why}: a server restarts whole",
            )
        elif self.state == "EXITED" and self.exit_code != 0 and job.failures < job.max_restarts:
            teardown(
                cycle,
                job,
                cause="RANK_FAILED",
                message=f"{where} exited with code {self.exit_code}{why} "
                f"(restart {job.failures + 1} of {job.max_restarts})",
            )
        elif self.state == "EXITED" and self.exit_code != 0:
            teardown(
                cycle,
                job,
                final_state="FAILED",
                exit_code=self.exit_code,
                message=f"{where} exited with code {self.exit_code}{why}"
                + (f" after {job.max_restarts} restart(s)" if job.max_restarts else ""),
            )
        elif self.state == "EXITED":
            if all(r.state == "EXITED" and r.exit_code == 0 for r in job.ranks.values()):
                teardown(cycle, job, final_state="SUCCEEDED", message="all ranks exited with code 0", kill=False)
        elif self.state == "FAILED_TO_START" and self.retryable:
            strike(cycle, job, node, f"rank {self.rank}", self.message)
        elif self.state == "FAILED_TO_START":
            teardown(
                cycle,
                job,
                final_state="FAILED",
                exit_code=127,
                message=f"{where} failed to start: {self.message or 'unknown error'}",
            )
        elif self.state in ("KILLED", "LOST"):
            lost = why if self.state == "LOST" else ""  # e.g. gone without an exit status: out of memory
            teardown(cycle, job, cause="RANK_LOST", message=f"{where} was {self.state.lower()} by its agent{lost}")
        return False


def strike(cycle: Cycle, job: JobRecord, node: NodeRecord, where: str, message: str) -> None:
    """A rank's host could not set it up (a retryable FAILED_TO_START): strike the node (counted on the node, and
    kept on the job, whose next placements avoid it while it fits elsewhere), and tear the gang down to requeue it
    with the failure backoff (SETUP_FAILED counts against max_attempts like any failure)."""
    struck = sorted({*job.struck_nodes, node.name})
    set_job(cycle, job, struck_nodes=struck)
    strikes = cycle.work.ask(ledger.strike_node, node.id)
    what = message or "unknown error"
    cycle.work.write(
        ledger.add_node_events,
        node.id,
        [
            dict(
                at=cycle.now,
                gpu=-1,
                severity="DEGRADED",
                kind="setup_failed",
                code=strikes,
                reason=f"job {job.id} attempt {job.attempt}: {where} could not be set up: {what}"[:2000],
            )
        ],
    )
    log.warning("node_struck", node=node.name, job=job.id, attempt=job.attempt, strikes=strikes, reason=what)
    teardown(
        cycle,
        job,
        cause="SETUP_FAILED",
        message=f"{where} could not be set up on node {node.name} (a host-side failure, not the job's): {what}; "
        f"node {node.name} struck (strike {strikes} there), the gang avoids it while it fits elsewhere",
    )


HEALTH_NAMES = {1: "HEALTHY", 2: "DEGRADED", 3: "FATAL"}


@dataclass
class HealthReport(CycleCommand):
    """A node's health changed, or it reported health events (from a heartbeat; see SchedulerService.heartbeat).

    FATAL GPUs leave the capacity view at once (the next placement in this very cycle cannot use them) and a FATAL
    node becomes unschedulable; DEGRADED is recorded and shown only. Running gangs are left alone (tearing them
    down is the fault-tolerance work). Recovery is the same path: a HEALTHY report puts the GPUs back."""

    name: str
    health: Any  # common_pb2.NodeHealth, or None when the heartbeat carried only events
    events: list[Any]
    # A heartbeat without health (the agent runs no monitor) from a node back after it was lost: take it as healthy.
    alive: bool = False

    def execute(self, cycle: Cycle) -> bool:
        node = cycle.state.nodes.get(self.name)
        if node is None:
            return False
        changed = False
        if self.alive and self.health is None and node.health == "UNKNOWN":
            cycle.work.write(ledger.set_node_health, node.id, "HEALTHY", "", {})
            held = node.fatal_gpus
            node.health, node.health_reason, node.gpu_health = "HEALTHY", "", {}
            if held:  # FATAL GPUs it kept out of the index come back
                cycle.state.rebuild_capacity()
            else:  # only whether it takes work changed: no rebuild (a cluster coming up has thousands of these)
                cycle.state.set_node_schedulable(node.name)
            log.info("node_healthy_again", node=node.name)
            changed = True
        if self.health is not None and self.health.state in HEALTH_NAMES:
            health = HEALTH_NAMES[self.health.state]
            gpus = {
                g.index: (HEALTH_NAMES.get(g.state, "DEGRADED"), tuple(g.reasons))
                for g in self.health.gpus
                if g.state in (2, 3)
            }
            reason = self.health.reason
            if (health, reason, gpus) != (node.health, node.health_reason, node.gpu_health):
                cycle.work.write(ledger.set_node_health, node.id, health, reason, gpus)
                log.warning(
                    "node_health_changed",
                    node=node.name,
                    health=health,
                    was=node.health,
                    reason=reason,
                    fatal_gpus=sorted(i for i, (h, _) in gpus.items() if h == "FATAL"),
                )
                was_fatal = node.fatal_gpus
                node.health, node.health_reason, node.gpu_health = health, reason, gpus
                if node.fatal_gpus != was_fatal:  # GPUs enter or leave the index
                    cycle.state.rebuild_capacity()
                else:  # whether it takes work (an UNKNOWN node's first report included)
                    cycle.state.set_node_schedulable(node.name)
                changed = True
                tear_down_on_fatal(cycle, node)
        events = [
            dict(
                at=e.at or cycle.now,
                gpu=e.gpu,
                severity=HEALTH_NAMES.get(e.severity, "HEALTHY"),
                kind=e.kind[:32],
                code=e.code,
                reason=e.reason,
            )
            for e in self.events
        ]
        cycle.work.write(ledger.add_node_events, node.id, events)
        return changed


def tear_down_on_fatal(cycle: Cycle, node: NodeRecord) -> None:
    """Tear down, whole, every gang with a rank on a FATAL GPU of `node` (or anywhere on it, when the node is
    FATAL); each requeues and restarts elsewhere from its last committed checkpoint."""
    fatal = node.fatal_gpus
    for job in cycle.state.running_on(node.name):
        hit = sorted(
            {g for _, n, gpus in job.allocations if n == node.name for g in gpus}
            & (set(range(node.gpus)) if node.health == "FATAL" else fatal)
        )
        if hit:
            what = (
                f"node {node.name} is FATAL ({node.health_reason})"
                if node.health == "FATAL"
                else f"GPU(s) {hit} of {node.name} failed ({'; '.join(node.gpu_health[hit[0]][1]) or 'FATAL'})"
            )
            swap_or_teardown(cycle, job, node.name, cause="GPU_FAILED", message=what)
    drop_spares_on(cycle, node.name, None if node.health == "FATAL" else frozenset(fatal))


@dataclass
class Drain(CycleCommand):
    """The node's agent is stopping (SIGTERM): DRAINED, out of placement at once. Its ranks are killed and
    reported by the agent (and requeued here as usual); registering again makes the node READY. If the agent never
    comes back, the lease still expires and the node becomes LOST."""

    name: str
    message: str

    def execute(self, cycle: Cycle) -> bool:
        node = cycle.state.nodes.get(self.name)
        if node is None or node.state != "READY":
            return False
        cycle.work.write(ledger.set_node_state, node.id, "DRAINED", self.message)
        node.state = "DRAINED"
        cycle.state.set_node_schedulable(node.name)
        log.info("node_drained", node=node.name, reason=self.message)
        leave_drained_node(cycle, node.name, f"node {node.name} is draining ({self.message})")
        return True


CORDON_MESSAGE = "drained by an admin (phalanx node undrain puts it back)"


@dataclass
class CordonNode(CycleCommand):
    """An admin drains a node (`phalanx node drain`): DRAINED and cordoned, so registering again keeps it DRAINED;
    running gangs are left alone. `cordon=False` undoes it (`phalanx node undrain`): READY again when its agent is
    alive (heartbeats within the lease), else it stays as it is until the agent registers. NotFound: no such node."""

    name: str
    cordon: bool
    reason: str = ""

    def execute(self, cycle: Cycle) -> str:
        node = cycle.state.nodes.get(self.name)
        if node is None:
            raise NotFound(f"no node named {self.name[:80]!r}")
        cycle.work.write(ledger.set_node_cordoned, node.id, self.cordon)
        if self.cordon:
            if node.state in ("READY", "DRAINED"):
                message = f"drained by an admin: {self.reason}" if self.reason else CORDON_MESSAGE
                cycle.work.write(ledger.set_node_state, node.id, "DRAINED", message)
                node.state = "DRAINED"
                cycle.state.set_node_schedulable(node.name)
            log.info("node_cordoned", node=node.name, reason=self.reason, state=node.state)
        elif node.state == "DRAINED" and cycle.now - node.last_heartbeat <= cycle.settings.lease_timeout:
            cycle.work.write(ledger.set_node_state, node.id, "READY", "")
            node.state = "READY"
            cycle.state.set_node_schedulable(node.name)
            log.info("node_uncordoned", node=node.name)
        cycle.woken_nodes.add(node.name)  # other replicas reload (the generation moves) and see the change
        return node.state


@dataclass
class SetQueue(CycleCommand):
    """An admin creates or replaces a queue (`phalanx quota set`); it applies from this very cycle's pass."""

    spec: QueueSpec

    def execute(self, cycle: Cycle) -> str:
        cycle.work.write(ledger.upsert_queue, self.spec, cycle.now)
        cycle.state.queues[self.spec.name] = self.spec
        cycle.state.no_preemption = None
        log.info(
            "queue_set",
            queue=self.spec.name,
            cohort=self.spec.cohort,
            weight=self.spec.weight,
            quotas={f: (q.gpus, q.borrow_limit, q.mig_slices) for f, q in self.spec.quotas.items()},
        )
        return self.spec.name


@dataclass
class DeleteQueue(CycleCommand):
    name: str

    def execute(self, cycle: Cycle) -> str:
        if self.name not in cycle.state.queues:
            raise NotFound(f"no queue {self.name[:64]!r}")
        users = [j.id for j in cycle.state.jobs.values() if j.queue == self.name]
        if users:
            raise FailedPrecondition(
                f"queue {self.name!r} still has {len(users)} pending or running job(s) "
                f"({', '.join(users[:5])}); cancel them or let them finish first"
            )
        cycle.work.write(ledger.delete_queue, self.name)
        del cycle.state.queues[self.name]
        return self.name
