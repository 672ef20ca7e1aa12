"""The cycle's view (`Cycle`) and the state transitions every command and the plan share: reserve a gang,
tear it down, change a job; the launch assignments a reservation sends.

They change the in-memory records and hand their writes to the cycle's unit of work (work.py), which alone holds
the connection and applies them in the cycle's transaction. What they may do to a job in which state is the table
of lifecycle.py; tests/unit/test_job_lifecycle.py runs them with no database.
"""

from __future__ import annotations

import copy
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import structlog

from phalanx.api.v1 import agent_pb2, common_pb2
from phalanx.common.tokens import rank_token
from phalanx.core.model import Placement

from . import ledger, lifecycle
from .convert import job_from_record, probe_message
from .elastic import elastic_env, shrink_changes
from .settings import SchedulerSettings
from .spare_fields import take_spares
from .state import (
    TERMINAL_RANK_STATES,
    JobRecord,
    NodeRecord,
    Partial,
    RankRecord,
    SchedulerState,
    attempt_key,
    layout_ranks,
    touch,
)
from .work import UnitOfWork

log = structlog.get_logger()


@dataclass
class CycleMetrics:
    """What a cycle measured, for the service's metrics and its slow-cycle log line after the commit."""

    # The gangs it reserved, each with how long it waited since its submission
    reserved: list[tuple[JobRecord, float]] = field(default_factory=list)
    # Preemptions applied in this cycle, (victim, preemptor), and the claims whose gangs it placed, (job, how many
    # gangs were asked to stop for it)
    preempted: list[tuple[str, str]] = field(default_factory=list)
    claims_run: list[tuple[str, int]] = field(default_factory=list)
    # Where the cycle's time went, by part (ms; the service logs them with a slow cycle)
    timings: dict[str, float] = field(default_factory=dict)
    # Gangs the admission lane decided and reserved at their submission (admission_lane.py), and why a batch of
    # submits went to the pass instead; `admission_path`: "lane" or "pass" for a batch of submits the lane was
    # offered ("" otherwise)
    admitted_at_submit: int = 0
    lane_skipped: str = ""
    admission_path: str = ""


@dataclass
class Cycle:
    """A cycle's view: the in-memory state the transitions read and change and what the cycle changed (for the
    watchers and the fan-out); its SQL goes through `work` (work.py), which alone holds the connection, and what it
    measured is in `metrics`."""

    work: UnitOfWork
    state: SchedulerState
    settings: SchedulerSettings
    now: float
    changed: dict[str, common_pb2.Job] = field(default_factory=dict)
    woken_nodes: set[str] = field(default_factory=set)
    resync_after: bool = False
    # The view was reloaded whole on the leader: apply the rank reports the status lane recorded that no cycle
    # applied (status_lane.settle_recorded_ranks)
    settle_ranks: bool = False
    settle_jobs: list[str] = field(default_factory=list)  # (or only these, read again after another replica's write)
    foreign_writes: bool = False
    handover: bool = False  # preempted gangs were stopped in this cycle (a fault-injection point)
    epoch: int = 0  # the leadership epoch this cycle schedules under (0: not leading, or leadership not in use)
    # Jobs that reached a final state in this cycle: the leader's upkeep adds their goodput to goodput_totals soon
    # after its commit (SchedulerService._account_soon), off the cycle
    finished: list[str] = field(default_factory=list)
    # Nodes other replicas gave assignments since this replica's last cycle (None: unknown, after a full reload)
    foreign_assigned: set[str] | None = field(default_factory=set)
    # node -> MASTER_PORTs of the running attempts whose rank 0 is there (ports_taken: built on first use)
    master_ports: dict[str, set[int]] | None = None
    metrics: CycleMetrics = field(default_factory=CycleMetrics)

    def send(self, node: NodeRecord, job_id: str, attempt: int, kind: str, build) -> None:
        """Queue an assignment for `node` (the unit of work writes it) and wake its stream after the commit."""
        self.work.send(node, job_id, attempt, kind, build)
        self.woken_nodes.add(node.name)

    def flush(self) -> None:
        """Write the queued assignments now (their revisions are on the view's nodes)."""
        self.work.flush(self.state.nodes, self.now)

    def touched(self, job: JobRecord) -> None:
        self.changed[job.id] = job_from_record(job)

    def wake_at(self, when: float) -> None:
        """Have the service run a cycle at `when` (a backoff ending, a grace period, a protection running out)."""
        if when > self.now:
            self.state.wake_at = min(self.state.wake_at, when)

    def reload(self) -> None:
        """Reload the view inside this transaction (it sees this cycle's own writes, not its unwritten jobs)."""
        work = self.work
        work.write_deferred()
        work.flush_ranks()
        from .viewsync import reload_state

        work.ask(reload_state, self.state, self.settings, self.now, initial=False)
        for job in work.new_jobs:
            self.state.jobs[job.id] = job
        for write, args in work.claim_writes:  # not written yet: the view keeps them
            if write is ledger.set_claim:
                self.state.claims[args[0].job] = args[0]
            else:
                self.state.claims.pop(args[0], None)


class Command:
    """A request to the cycle: a CycleCommand, executed on its own, or a submission, taken with the others of its
    cycle by `submit_all`."""


class CycleCommand(Command, ABC):
    @abstractmethod
    def execute(self, cycle: Cycle) -> Any:
        """Raise ServiceError before writing anything, or return the command's result."""


FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


def teardown(
    cycle: Cycle,
    job: JobRecord,
    *,
    final_state: str | None = None,
    message: str,
    exit_code: int = 0,
    kill: bool = True,
    cause: str = "",
    released: bool = False,
) -> None:
    """Release every GPU of the gang at once and stop its ranks; finish the job or requeue it.

    `final_state` ends the job. Otherwise it requeues, to restart from its last committed checkpoint: a preemption
    (`cause` PREEMPTED) and an elastic gang's grow (RESIZED) at once and without counting; an elastic gang that
    still has its minimum of replicas after a NODE_LOST or GPU_FAILED likewise, to shrink (elastic.py); a failure
    (NODE_LOST, GPU_FAILED, RANK_LOST, LAUNCH_TIMEOUT, SETUP_FAILED, and RANK_FAILED within the job's max_restarts)
    counts against `max_attempts` and waits out an exponential backoff first. `released`: the decision gave its GPUs
    back in the capacity view already (a preemption's `Stop`, see phalanx.core.decide).
    """
    if job.state != lifecycle.RUNNING:  # only a reserved gang can be torn down (lifecycle.TRANSITIONS)
        refused(job, cause or final_state or "teardown")
        return
    s, now = cycle.settings, cycle.now
    changes: dict[str, Any] = dict(preempted_by="", preempt_deadline=0.0)
    if job.ready:  # a torn-down gang serves nothing: out of its service's endpoints at once
        changes.update(ready=False, ready_at=0.0)
    restart = job.serving.get("restart", "")
    shrink = shrink_changes(cycle.state, job, cause, message) if final_state is None else None
    if shrink is not None:  # an elastic gang restarts smaller at once (elastic.py)
        changes.update(shrink)
    elif final_state is None and cause == "RESIZED":  # an elastic gang's grow (phalanx.core.elastic): not counted
        changes.update(state="PENDING", message=message)
    elif final_state is None and cause == "PREEMPTED":
        changes.update(state="PENDING", preemptions=job.preemptions + 1, message=f"{message}; requeued")
    elif final_state is None and restart == "never":
        final_state, message = "FAILED", f"{message}; its restart policy is never: it stays down"
    elif final_state is None:
        failures = job.failures + 1
        changes.update(failures=failures)
        if failures >= s.max_attempts and restart != "always":
            final_state, message = "FAILED", f"{message}; gave up after {failures} failed attempts"
        else:
            delay = retry_backoff(s.retry_backoff_s, s.retry_backoff_max_s, failures)
            limit = "; a server restarts always" if restart == "always" else f" of at most {s.max_attempts}"
            changes.update(
                state="PENDING",
                not_before=now + delay,
                message=f"{message}; requeued (failure {failures}{limit}), retried after a {delay:g}s backoff",
            )
    if final_state:
        changes.update(state=final_state, finished_at=now, exit_code=exit_code, message=message)
    attempt = job.attempt
    change_job(cycle, job, **changes)
    # Neither needs an answer: written with the cycle's deferred writes (copies: a requeued job may be reserved
    # again in this very cycle, with a new attempt and allocations).
    ended = copy.copy(job)
    cycle.work.later(ledger.end_attempt, ended, cause or final_state or "", message, now, False)
    # Clean handover: on a node whose agent confirms releases and where a rank of the attempt may still run, the
    # attempt's whole GPUs stay held (releasing) until the agent says every process of it there is gone
    # (AttemptReleased). A node whose ranks all reported their end has nothing left of it: such an agent reports a
    # host's last rank only once the attempt's container there is empty. Elsewhere the GPUs are free at once.
    live = {r.node for r in job.ranks.values() if r.state not in TERMINAL_RANK_STATES}
    held: dict[str, list[int]] = {}
    for rep in job.replica_placements():
        node = cycle.state.nodes.get(rep.node)
        if node is not None and node.confirms_release and rep.node in live and not (rep.mig_profile or rep.gpu_milli):
            held.setdefault(rep.node, []).extend(rep.gpus)
    cycle.work.later(ledger.release_allocations, ended, now, frozenset(cycle.state.nodes[n].id for n in held))
    for name, gpus in held.items():
        node = cycle.state.nodes[name]
        node.releasing[attempt_key(job.id, attempt)] = tuple(sorted(gpus))
        if job.cpu_milli or job.memory:  # its replicas' host resources there stay held with the GPUs
            count = sum(1 for rep in job.replica_placements() if rep.node == name)
            node.releasing_use[attempt_key(job.id, attempt)] = (count * job.cpu_milli, count * job.memory)
    if not released:
        for rep in job.replica_placements():
            if rep.node not in held or rep.mig_profile or rep.gpu_milli:
                cycle.state.capacity.release_replica(rep)
        cycle.state.hold_fatal_gpus(job.nodes)
    else:  # the decision kept a stopped gang's GPUs on confirming nodes (hold_on_stop): free those not held here
        for rep in job.replica_placements():
            node = cycle.state.nodes.get(rep.node)
            whole = not (rep.mig_profile or rep.gpu_milli)
            if node is not None and node.confirms_release and whole and rep.node not in held:
                cycle.state.capacity.release(rep.node, set(rep.gpus) - node.held_gpus)
                if rep.cpu_milli or rep.memory:
                    cycle.state.capacity.release_use(rep.node, rep.cpu_milli, rep.memory)
    if kill:
        for node_name in {r.node for r in job.ranks.values() if r.state not in TERMINAL_RANK_STATES}:
            node = cycle.state.nodes.get(node_name)
            if node is None:
                continue
            kill_msg = agent_pb2.KillJob(job_id=job.id, attempt=attempt, reason=job.message)
            cycle.send(
                node, job.id, attempt, "kill", lambda rev, k=kill_msg: agent_pb2.Assignment(revision=rev, kill=k)
            )
    job.launch_deadline = None
    job.running_at = 0.0
    if final_state:
        cycle.state.jobs.pop(job.id, None)
        cycle.finished.append(job.id)
    else:
        cycle.wake_at(job.not_before)
    log.info(
        "gang_torn_down",
        job=job.id,
        attempt=attempt,
        cause=cause or final_state,
        state=job.state,
        message=job.message,
    )
    cycle.touched(job)


def refused(job: JobRecord, event: str) -> None:
    """A transition the job's state does not allow (lifecycle.TRANSITIONS): nothing changes, the error is logged."""
    log.error("job_transition_refused", job=job.id, state=job.state, attempt=job.attempt, transition=event)


def retry_backoff(base: float, cap: float, failures: int) -> float:
    """base, 2 x base, 4 x base ... after the 1st, 2nd, 3rd failure, at most `cap`."""
    if base <= 0:
        return 0.0
    return min(cap, base * 2 ** min(failures - 1, 30))


def set_job(cycle: Cycle, job: JobRecord, **changes: Any) -> None:
    """Change a job: in memory only when it is new in this cycle (written later), else compare-and-set (a job
    changed by another writer fails the cycle's commit: change_job)."""
    if job.version < 0:
        for key, value in changes.items():
            setattr(job, key, value)
        touch(job)  # its version does not move until it is written: the pending view must hear of the change
        return
    change_job(cycle, job, **changes)


def change_job(cycle: Cycle, job: JobRecord, **changes: Any) -> None:
    """Change a job that is in the ledger: its record now, its row by a compare-and-set on the version the view
    read, queued with the unit of work (ledger.queue_job_update; a job changed by another writer fails the cycle's
    commit). What ledger.update_job does, with the record's change here and the write there."""
    cycle.work.write(ledger.queue_job_update, job.id, job.version, changes)
    job.version += 1
    for key, value in changes.items():
        setattr(job, key, value)
    touch(job)


def reserve(cycle: Cycle, job: JobRecord, placement: Placement) -> None:
    """Write the whole gang's reservation (job state, allocations, ranks, launch assignments) in this transaction.

    Cycles take turns on a fresh view (ledger.begin_cycle), so the ledger refusing a GPU here means a bug or a
    writer outside the scheduler; the partial unique index then fails the whole transaction, nothing of it
    commits, and the service reloads its view.
    """
    if not lifecycle.allowed(job.state, "reserve"):
        refused(job, "reserve")
        return
    placement, spare_info = take_spares(job, placement)  # spares kept in the domain: held, never launched
    master = placement.replicas[0].node
    taken = ports_taken(cycle, master)
    port = master_port(job.id, job.attempt + 1, port_range(cycle.state.nodes.get(master)), taken)
    taken.add(port)
    placement_info: dict[str, Any] = dict(
        tier=placement.tier,
        domains=placement.domains,
        score=placement.score,
        reason=placement.reason,
        scheduler=cycle.settings.replica_id,
        epoch=cycle.epoch,
        master_port=port,
    )
    if placement.segments:  # a multi-level gang: each segment's domain, segment i holding replicas i*S..
        placement_info["segments"] = list(placement.segments)
    placement_info.update(spare_info)
    held = held_replicas(job)
    if held:  # --start-order: these replicas' launches wait until the first group's ranks run (release_held)
        placement_info["held"] = held
    set_job(
        cycle,
        job,
        state="RUNNING",
        attempt=job.attempt + 1,
        started_at=cycle.now,
        finished_at=0.0,
        exit_code=0,
        placement=placement_info,
        message=f"reserved: {placement.reason}",
        flavor=job.flavor,
    )
    job.allocations = [(r.replica, r.node, r.gpus) for r in placement.replicas]
    job.partials = {
        r.replica: Partial(profile=r.mig_profile, start=r.mig_start, size=r.mig_size, milli=r.gpu_milli)
        for r in placement.replicas
        if r.mig_profile or r.gpu_milli
    }
    job.ranks = layout_ranks(job)
    job.running_at = 0.0
    job.restored_step = -1
    if job.attempt > 1:
        job.restored_step = cycle.work.read(ledger.latest_commits, [job.id]).get(job.id, (-1,))[0]
    cycle.work.new_allocations.append(job)
    send_launches(cycle, job, exclude=set(held))
    job.launch_deadline = cycle.now + cycle.settings.launch_timeout
    cycle.metrics.reserved.append((job, cycle.now - job.submitted_at))
    cycle.touched(job)


def send_launches(
    cycle: Cycle, job: JobRecord, *, only: Collection[int] | None = None, exclude: Collection[int] = ()
) -> None:
    """Queue the launch assignments of the attempt's replicas (`only` these, or all but `exclude`)."""
    run_as = cycle.state.unix_user(job.tenant) if cycle.state.unix_user is not None and job.tenant else ""
    credential = rank_token(cycle.state.rank_key, job.id, job.attempt) if cycle.state.rank_key else ""
    for launch in launches(job, cycle.state.nodes, cycle.settings, checkpoint_endpoint(cycle)):
        if launch.replica in exclude or (only is not None and launch.replica not in only):
            continue
        launch.run_as = run_as
        if credential:  # the ranks' own credential, scoped to this job and attempt (never the job's --env)
            launch.env["PHALANX_JOB_TOKEN"] = credential
        node = cycle.state.nodes[launch_node(job, launch.replica)]
        cycle.send(
            node, job.id, job.attempt, "launch", lambda rev, one=launch: agent_pb2.Assignment(revision=rev, launch=one)
        )


def held_replicas(job: JobRecord) -> list[int]:
    """The replicas whose launch waits for the others' ranks to run: the workers with --start-order leader-first,
    the leader (replica 0) with workers-first; none otherwise."""
    order = job.serving.get("start_order", "")
    if order == "leader-first":
        return list(range(1, job.replicas))
    if order == "workers-first" and job.replicas > 1:
        return [0]
    return []


def release_held(cycle: Cycle, job: JobRecord) -> None:
    """--start-order: once every rank of the replicas launched first runs, launch the held ones."""
    held = set(job.placement.get("held") or ())
    if not held:
        return
    first = [r for r in job.ranks.values() if r.replica not in held]
    if first and all(r.state == "RUNNING" for r in first):
        send_launches(cycle, job, only=held)
        placement = {k: v for k, v in job.placement.items() if k != "held"}
        change_job(cycle, job, placement=placement)
        log.info("held_replicas_launched", job=job.id, attempt=job.attempt, replicas=sorted(held))


ENDPOINT_TTL_S = 10.0


def checkpoint_endpoint(cycle: Cycle) -> tuple[str, str]:
    """The checkpoint coordinator's address and directory for ranks: the scheduler's flags, else what the
    coordinator recorded in the ledger at its start (looked up at most every ENDPOINT_TTL_S)."""
    s, state = cycle.settings, cycle.state
    if s.checkpoint_addr:
        return s.checkpoint_addr, s.checkpoint_dir
    if state.endpoint_expires <= cycle.now:
        found = cycle.work.read(ledger.service_endpoint, "checkpoint-coordinator")
        state.endpoint = (found[0], str(found[1].get("checkpoint_dir", ""))) if found else ("", "")
        state.endpoint_expires = cycle.now + ENDPOINT_TTL_S
    addr, directory = state.endpoint
    return addr, s.checkpoint_dir or directory


def launch_node(job: JobRecord, replica: int) -> str:
    return job.allocations[replica][1]


# Rank 0's rendezvous port: below Linux's ephemeral range (32768-60999 by default), so that no outgoing connection
# on the master's host already holds it (seen: EADDRINUSE from torch.distributed's TCPStore at 44224).
MASTER_PORTS = range(20000, 32000)


def master_port(job_id: str, attempt: int, ports: range = MASTER_PORTS, taken: Collection[int] = ()) -> int:
    """The attempt's MASTER_PORT: from a hash of it within `ports` (the rank-0 host's --rank-port-range), moved on
    past the ports `taken` by other live attempts whose rank 0 is on that host."""
    digest = hashlib.sha1(f"{job_id}:{attempt}".encode()).digest()
    start = int.from_bytes(digest[:4], "big") % len(ports)
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        if port not in taken:
            return port
    raise ValueError(f"every port of {ports.start}-{ports.stop - 1} is taken by live attempts on the host")


def port_range(node: NodeRecord | None) -> range:
    low, high = node.rank_ports if node is not None else (0, 0)
    return range(low, high + 1) if low and high else MASTER_PORTS


def ports_taken(cycle: Cycle, node: str) -> set[int]:
    """MASTER_PORTs of the running attempts whose rank 0 is on `node` (built once a cycle, kept up by reserve)."""
    if cycle.master_ports is None:
        cycle.master_ports = {}
        for j in cycle.state.running():
            port = j.placement.get("master_port")
            if port and j.allocations:
                cycle.master_ports.setdefault(j.allocations[0][1], set()).add(int(port))
    return cycle.master_ports.setdefault(node, set())


def launches(
    job: JobRecord,
    nodes: dict[str, NodeRecord],
    settings: SchedulerSettings | None = None,
    checkpoint: tuple[str, str] | None = None,
) -> list[agent_pb2.LaunchReplica]:
    """The torchrun-style environment: shared per replica, and RANK, LOCAL_RANK, CUDA_VISIBLE_DEVICES per rank."""
    master = nodes[job.allocations[0][1]].address or "127.0.0.1"
    per_replica = 1 if job.procs_per_replica == 1 else job.gpus_per_replica
    base = dict(job.env)
    base.update(
        WORLD_SIZE=str(len(job.ranks)),
        LOCAL_WORLD_SIZE=str(per_replica),
        MASTER_ADDR=master,
        MASTER_PORT=str(job.placement.get("master_port") or master_port(job.id, job.attempt)),
        PHALANX_JOB_ID=job.id,
        PHALANX_ATTEMPT=str(job.attempt),
        PHALANX_GPUS_PER_REPLICA=str(job.gpus_per_replica),
        **elastic_env(job),
    )
    # The checkpoint coordinator and store for phalanx.train, unless the job names its own.
    addr, directory = checkpoint or ((settings.checkpoint_addr, settings.checkpoint_dir) if settings else ("", ""))
    if addr:
        base.setdefault("PHALANX_CHECKPOINT_ADDR", addr)
    if directory:
        # Each job writes under <dir>/<tenant>/<job>/ (<dir>/<job>/ without a tenant): the coordinator refuses
        # shards outside that prefix (services/checkpoint_coordinator/confine.py).
        tenant_dir = f"{directory.rstrip('/')}/{job.tenant}" if job.tenant else directory
        base.setdefault("PHALANX_CHECKPOINT_DIR", tenant_dir)
    by_replica: dict[int, list[RankRecord]] = {}
    for r in job.ranks.values():
        by_replica.setdefault(r.replica, []).append(r)
    roles = role_layout(job)
    if job.service or job.serving:  # LeaderWorkerSet's variables: a distributed server starts without discovery
        base.update(
            LWS_LEADER_ADDRESS=master,
            LWS_GROUP_SIZE=str(job.replicas),
            LWS_GROUP_INDEX=str(job.serving.get("replica", 0)),
        )
        if job.service:
            base.update(
                PHALANX_SERVICE=job.service,
                PHALANX_SERVICE_REPLICA=str(job.serving.get("replica", 0)),
                PHALANX_SERVICE_REVISION=str(job.serving.get("revision", 0)),
            )
    probe = job.serving.get("ready_probe")
    out = []
    for replica, node, gpus in job.allocations:
        ranks = []
        for r in sorted(by_replica[replica], key=lambda r: r.rank):
            rank_gpus = list(gpus) if job.procs_per_replica == 1 else [gpus[r.local_rank]]
            launch = agent_pb2.RankLaunch(
                rank=r.rank,
                local_rank=r.local_rank,
                gpus=rank_gpus,
                env={
                    "RANK": str(r.rank),
                    "LOCAL_RANK": str(r.local_rank),
                    "CUDA_VISIBLE_DEVICES": ",".join(map(str, rank_gpus)),
                },
            )
            part = job.partials.get(replica)
            if part is not None and part.profile:
                launch.slices.add(gpu=gpus[0], profile=part.profile, start=part.start, size=part.size)
            elif part is not None:
                launch.gpu_milli = part.milli
            ranks.append(launch)
        env = dict(base, NODE_RANK=str(replica), PHALANX_REPLICA=str(replica), PHALANX_NODE=node)
        command = job.command
        if job.service or job.serving:
            env["LWS_WORKER_INDEX"] = str(replica)
        if roles:
            role, index = roles[replica]
            env.update({str(k): str(v) for k, v in (role.get("env") or {}).items()})
            env.update(PHALANX_ROLE=str(role["name"]), PHALANX_ROLE_INDEX=str(index))
            command = list(role.get("command") or ()) or job.command
        launch = agent_pb2.LaunchReplica(
            job_id=job.id,
            attempt=job.attempt,
            replica=replica,
            command=command,
            ranks=ranks,
            env=env,
            cpus=job.cpu_milli / 1000,
            memory_bytes=job.memory,
        )
        if probe and replica == 0:  # the leader's agent runs the readiness probe
            launch.ready_probe.CopyFrom(probe_message(probe))
        out.append(launch)
    return out


def role_layout(job: JobRecord) -> list[tuple[dict[str, Any], int]]:
    """Each replica's role and its index within the role, in the roles' order ([] without roles)."""
    out: list[tuple[dict[str, Any], int]] = []
    for role in job.serving.get("roles") or ():
        out.extend((role, i) for i in range(int(role.get("replicas", 0))))
    return out if len(out) == job.replicas else []
