"""The scheduler replica's in-memory view of the ledger: active jobs, nodes, and free capacity.

It is a cache. The ledger is the truth: a cycle that fails to commit triggers a full reload (`ledger.load_state`);
what another replica changed is read back row by row (`transitions.apply_changes`, from ledger_changes). Only the
scheduling cycle (one thread at a time) touches it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from phalanx.core import mig
from phalanx.core.backfill import RunningSet
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.claims import Claim
from phalanx.core.closeness import GpuCloseness
from phalanx.core.model import FULL_MIG_MASK, GangRequest, NodeCapacity, ReplicaPlacement
from phalanx.core.pools import SparePool
from phalanx.core.quota import QueueSpec
from phalanx.core.spares import inflated, inflated_min

TERMINAL_RANK_STATES = frozenset({"EXITED", "FAILED_TO_START", "KILLED", "LOST"})
ENDED_KEPT = 50_000  # SchedulerState.ended: the reports for a job's ranks come within seconds of its end


@dataclass
class RankRecord:
    rank: int
    replica: int
    local_rank: int
    node: str
    state: str = "ASSIGNED"
    exit_code: int = 0


@dataclass(frozen=True)
class Partial:
    """A replica's part of its one GPU: a MIG instance (`profile`, `size` memory slices from `start`) or a share of
    `milli` thousandths."""

    profile: str = ""
    start: int = -1
    size: int = 0
    milli: int = 0


@dataclass
class JobRecord:
    id: str
    name: str
    state: str
    priority: int
    replicas: int
    gpus_per_replica: int
    procs_per_replica: int
    command: list[str]
    env: dict[str, str]
    submitted_at: float
    request_id: str | None = None
    required_tier: str = ""  # "" none; else "node", a fabric tier or "cluster" (checked at submit)
    preferred_tier: str = ""
    gpu_model: str = ""
    mig_profile: str = ""
    gpu_milli: int = 0
    attempt: int = 0
    message: str = ""
    exit_code: int = 0
    placement: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0
    finished_at: float = 0.0
    version: int = 0
    # (replica, node, gpu indices) of the current (or last) attempt
    allocations: list[tuple[int, str, tuple[int, ...]]] = field(default_factory=list)
    ranks: dict[int, RankRecord] = field(default_factory=dict)
    launch_deadline: float | None = None
    # replica -> its part of its GPU, for replicas on MIG instances or shares (same attempt as `allocations`)
    partials: dict[int, Partial] = field(default_factory=dict)
    failures: int = 0  # attempts torn down by a failure; the retry limit counts these
    max_restarts: int = 0  # a rank exiting non-zero requeues the gang while failures < max_restarts
    keep_checkpoints: int = 0  # the checkpoint coordinator keeps this many newest checkpoints (0: its default)
    tenant: str = ""  # who submitted it ("" with authentication off)
    time_limit: float = 0.0  # declared seconds per attempt (0: none)
    queue: str = "default"
    flavor: str = ""  # the quota flavor the current attempt was admitted under
    preemptions: int = 0
    not_before: float = 0.0  # a requeued job is not placed before this (retry backoff)
    preempted_by: str = ""  # a victim being preempted: the preemptor's id (the job stays RUNNING meanwhile)
    preempt_deadline: float = 0.0  # ... and when it is stopped at the latest
    running_at: float = 0.0  # when every rank of the current attempt ran (0: not yet)
    restored_step: int = -1  # the committed step the current attempt restarts from (-1: none)
    # Nodes whose host could not set up one of its ranks (a retryable FAILED_TO_START): avoided while it fits elsewhere
    struck_nodes: list[str] = field(default_factory=list)
    # Host resources of each replica (thousandths of CPUs, bytes; 0 none), reserved with its GPUs on its node
    cpu_milli: int = 0
    memory: int = 0
    # Submitted by an admin (always, with authentication off): may preempt other queues' jobs by priority
    by_admin: bool = True
    # Serving (services/scheduler/serving): the service it is a replica of ("" none); what the gang asked for
    # serving (roles, start_order, ready_probe, restart; a replica's index, revision, spread_tier, surge); whether
    # its leader's readiness probe passes now, and since when.
    service: str = ""
    serving: dict[str, Any] = field(default_factory=dict)
    # Spares kept in the domain (shape "spares_per_segment", services/scheduler/spares.py): the booked spares of the
    # current attempt as (negative replica, node, GPUs), held by allocation rows like `allocations`, never launched
    spares: list[tuple[int, str, tuple[int, ...]]] = field(default_factory=list)
    ready: bool = False
    ready_at: float = 0.0
    # How the gang is cut and kept (jobs.shape, revision 0024): {"segment": S, "segment_tier": T} for a multi-level
    # gang, "spares_per_segment" for its spares, {"min_replicas": M} for an elastic gang; {} plain (each part's keys
    # live beside the others': merge, never replace the dict).
    shape: dict[str, Any] = field(default_factory=dict)
    # Job graphs (services/scheduler/jobgraph.py): the jobs it waits for ([{"job_id", "condition", "met"}]); on an
    # array's parent row, its spec and progress; on a task, its array's id and its index ("" and -1 otherwise).
    after: list[dict[str, Any]] = field(default_factory=list)
    array: dict[str, Any] = field(default_factory=dict)
    array_parent: str = ""
    array_task: int = -1
    # The decision's inputs built from this record last time, with the fields they were built from
    # (planning.running_job; the pending ones are kept by JobTable.pending_view).
    snapshot_cache: dict[str, tuple[Any, Any]] = field(default_factory=dict, repr=False, compare=False)
    # The JobTable holding this record (it indexes the record by state); set by the table, kept by copies (which the
    # table tells apart by identity).
    table: JobTable | None = field(default=None, repr=False, compare=False)

    @property
    def preempting(self) -> bool:
        return self.state == "RUNNING" and bool(self.preempted_by)

    @property
    def gpu_equivalents(self) -> float:
        held = self.size + len(self.spares)  # booked spares are charged to the job's queue too
        return gpu_equivalents(held, self.gpus_per_replica, self.mig_profile, self.gpu_milli)

    @property
    def min_replicas(self) -> int:
        """An elastic gang's minimum (0: not elastic; `replicas` is then its maximum)."""
        return int(self.shape.get("min_replicas") or 0)

    @property
    def size(self) -> int:
        """The replicas its current (or last) attempt runs with: `replicas`, or fewer for an elastic gang."""
        return len(self.allocations) if self.min_replicas and self.allocations else self.replicas

    def request(self) -> GangRequest:
        # With spares per segment, placement sees segments of S + K replicas (core.spares.inflated)
        s, k = int(self.shape.get("segment") or 0), int(self.shape.get("spares_per_segment") or 0)
        replicas, segment = inflated(self.replicas, s, k)
        return GangRequest(
            self.id,
            replicas,
            self.gpus_per_replica,
            self.priority,
            self.submitted_at,
            required_tier=self.required_tier,
            preferred_tier=self.preferred_tier,
            gpu_model=self.gpu_model,
            mig_profile=self.mig_profile,
            gpu_milli=self.gpu_milli,
            time_limit=self.time_limit,
            avoid=frozenset(self.struck_nodes),
            cpu_milli=self.cpu_milli,
            memory=self.memory,
            segment=segment,
            segment_tier=str(self.shape.get("segment_tier") or ""),
            min_replicas=inflated_min(self.min_replicas, s, k),
            spares=k if s else 0,
        )

    def replica_placements(self) -> list[ReplicaPlacement]:
        """The allocations as placement replicas (whole GPUs, MIG instances, shares), to take or give back; the
        booked spares (negative replicas, whole GPUs) after the gang's own."""
        out = []
        cpu, memory = self.cpu_milli, self.memory
        for replica, node, gpus in (*self.allocations, *self.spares) if self.spares else self.allocations:
            part = self.partials.get(replica)
            if part is None:
                out.append(ReplicaPlacement(replica, node, gpus, cpu_milli=cpu, memory=memory))
            else:
                out.append(
                    ReplicaPlacement(
                        replica,
                        node,
                        gpus,
                        mig_profile=part.profile,
                        mig_start=part.start,
                        mig_size=part.size,
                        gpu_milli=part.milli,
                        cpu_milli=cpu,
                        memory=memory,
                    )
                )
        return out

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(node for _, node, _ in self.allocations))


def mig_compute_slices(profile: str) -> int:
    """Compute slices of the GPUs that have MIG profile `profile` (4 for A30's, else 7)."""
    families = [f for f in mig.FAMILIES if profile.lower() in mig.family_table(f)]
    return mig.family_slices(families[0])[0] if families else mig.COMPUTE_SLICES


def gpu_equivalents(replicas: int, gpus_per_replica: int, mig_profile: str = "", gpu_milli: int = 0) -> float:
    """GPUs a gang holds when running, a MIG instance or a share counted as its fraction of a GPU."""
    if gpu_milli:
        return replicas * gpu_milli / 1000
    if mig_profile:  # its compute slices out of its GPU's ("3g.40gb": 3/7; A30's "2g.12gb": 2/4)
        compute = mig_profile.split("g.", 1)[0]
        return replicas * (int(compute) / mig_compute_slices(mig_profile) if compute.isdigit() else 1.0)
    return float(replicas * gpus_per_replica)


@dataclass(frozen=True)
class MigSwitch:
    """A MIG mode switch the scheduler asked a --mig-manage agent for (SetMigMode, assignment `revision`): into MIG
    mode (`enable`) or out of it, asked at `asked_at`. Under way while `error` is empty; a failed one keeps the
    agent's error and is not asked again before `retry_after` (--mig-switch-backoff)."""

    enable: bool
    asked_at: float
    revision: int = 0
    error: str = ""
    retry_after: float = 0.0

    @property
    def active(self) -> bool:
        return not self.error


def _job_state(job: JobRecord) -> str:
    return job.__dict__["state"]  # type: ignore[no-any-return]


def _set_job_state(job: JobRecord, value: str) -> None:
    old = job.__dict__.get("state")
    job.__dict__["state"] = value
    table = job.__dict__.get("table")
    if table is not None and old != value:
        table._moved(job, old, value)


def touch(job: JobRecord) -> None:
    """Tell the job's table that the job changed (what the decision's pending queue holds of it may differ)."""
    table = job.__dict__.get("table")
    if table is not None:
        table.touch(job)


# `state` is a property over the dataclass field (its generated __init__ assigns through it), so that every change
# of a job's state, wherever it is made, keeps its table's index by state right. The value stays in the instance's
# __dict__ under its own name (a property wins over it on lookup), so copies and readers of __dict__ see it as before.
JobRecord.state = property(_job_state, _set_job_state)  # type: ignore[assignment,method-assign]


class JobTable(dict[str, JobRecord]):
    """The active jobs by id, with the PENDING and RUNNING ones indexed by state, in the table's order (a job's
    position is where it was first inserted, as in a plain dict). A cycle then visits the few hundred running gangs
    for its timers and a preemption, not the 10,000 waiting behind them, and lists the pending queue without a scan
    of everything."""

    INDEXED = ("PENDING", "RUNNING")

    def __init__(self, jobs: dict[str, JobRecord] | None = None) -> None:
        super().__init__()
        self._seq = 0
        self._order: dict[str, int] = {}  # job id -> its position in the table
        self._by_state: dict[str, dict[str, JobRecord]] = {s: {} for s in self.INDEXED}
        self._sorted: dict[str, bool] = dict.fromkeys(self.INDEXED, True)
        self._last: dict[str, int] = dict.fromkeys(self.INDEXED, -1)
        # The pending queue as the decision's input (pending_view): one entry per PENDING job in the index's order,
        # None until built; `_dirty`: the jobs whose entry must be (re)built (new in the queue, or changed: touch)
        self._view: dict[str, Any] = {}
        self._dirty: set[str] = set()
        # How many PENDING jobs have each priority (a priority never changes after submission): the admission lane
        # asks whether an arrival is ahead of the whole queue in O(priorities), not O(pending).
        self._pending_priorities: Counter[int] = Counter()
        for key, job in (jobs or {}).items():
            self[key] = job

    # -- the dict's writes, each keeping the index

    def __setitem__(self, key: str, job: JobRecord) -> None:
        old = dict.get(self, key)
        if old is not None and old is not job:
            self._unindex(old)
            if old.__dict__.get("table") is self:
                old.table = None
        if key not in self._order:
            self._order[key] = self._seq
            self._seq += 1
        dict.__setitem__(self, key, job)
        job.table = self
        self._index(job, job.state)

    def __delitem__(self, key: str) -> None:
        job = dict.pop(self, key)
        self._forget(key, job)

    def pop(self, key: str, *default: Any) -> Any:  # type: ignore[override]
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        job = dict.pop(self, key)
        self._forget(key, job)
        return job

    def clear(self) -> None:
        for key in list(self):
            del self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, job in dict(*args, **kwargs).items():
            self[key] = job

    def setdefault(self, key: str, default: Any = None) -> JobRecord:  # type: ignore[override]
        if key not in self:
            self[key] = default
        return self[key]

    def popitem(self) -> tuple[str, JobRecord]:
        key = next(reversed(self))
        return key, self.pop(key)

    # -- the index

    def _forget(self, key: str, job: JobRecord) -> None:
        self._order.pop(key, None)
        self._unindex(job)
        if job.__dict__.get("table") is self:
            job.table = None

    def _index(self, job: JobRecord, state: str) -> None:
        index = self._by_state.get(state)
        if index is None:
            return
        pos = self._order[job.id]
        if job.id not in index:
            if pos < self._last[state]:
                self._sorted[state] = False
            else:
                self._last[state] = pos
        if state == "PENDING" and index.get(job.id) is not job:
            self._pending_priorities[job.priority] += 1
        index[job.id] = job
        if state == "PENDING":
            self._view[job.id] = None
            self._dirty.add(job.id)

    def _unindex(self, job: JobRecord) -> None:
        for state, index in self._by_state.items():
            if index.get(job.id) is job:
                del index[job.id]
                if state == "PENDING":
                    self._left_pending(job)

    def _moved(self, job: JobRecord, old: str | None, new: str) -> None:
        if dict.get(self, job.id) is not job:
            return  # a copy, or a record the table no longer holds
        if old in self._by_state and self._by_state[old].get(job.id) is job:
            del self._by_state[old][job.id]
            if old == "PENDING":
                self._left_pending(job)
        self._index(job, new)

    def _left_pending(self, job: JobRecord) -> None:
        self._view.pop(job.id, None)
        self._dirty.discard(job.id)
        left = self._pending_priorities[job.priority] - 1
        if left:
            self._pending_priorities[job.priority] = left
        else:
            del self._pending_priorities[job.priority]

    def pending_at_or_above(self, priority: int) -> bool:
        """Whether a PENDING job has this priority or a higher one. Safe from the event loop while the writer
        thread changes the table (the keys are copied in one call; a priority's key exists only while counted)."""
        return any(p >= priority for p in list(self._pending_priorities))

    def pending_priorities(self) -> Counter[int]:
        """How many PENDING jobs have each priority (a copy)."""
        return Counter(self._pending_priorities)

    def touch(self, job: JobRecord) -> None:
        """`job` changed (ledger.update_job, transitions.set_job): its pending_view entry is built again."""
        if job.id in self._view and dict.get(self, job.id) is job:
            self._view[job.id] = None
            self._dirty.add(job.id)

    def pending_view(self, build: Callable[[JobRecord], Any]) -> list[Any]:
        """`build(job)` of every PENDING job, in the index's order, rebuilding only the entries of jobs that entered
        the queue or changed since the last call: a cycle pays for what changed, plus one copy of the list."""
        index = self.in_state("PENDING")
        view = self._view
        for job_id in self._dirty:
            if job_id in view:
                view[job_id] = build(index[job_id])
        self._dirty.clear()
        return list(view.values())

    def count(self, state: str) -> int:
        return len(self._by_state[state])

    def unordered(self, state: str) -> list[JobRecord]:
        """The jobs in `state` in no particular order: for readers on another thread than the cycle's. The copy is
        made in one C call, which holds the GIL throughout (the cycle cannot change the index half way), and the
        index is never reordered here."""
        return list(self._by_state[state].values())

    def in_state(self, state: str) -> dict[str, JobRecord]:
        """The jobs in `state` (PENDING or RUNNING) by id, in the table's order. Read it, do not change it."""
        index = self._by_state[state]
        if not self._sorted[state]:
            ordered = sorted(index.values(), key=lambda j: self._order[j.id])
            index.clear()
            index.update((j.id, j) for j in ordered)
            if state == "PENDING":
                self._view = {job_id: self._view.get(job_id) for job_id in index}
            self._sorted[state] = True
            self._last[state] = self._order[ordered[-1].id] if ordered else -1
        return index


@dataclass
class NodeRecord:
    id: int
    name: str
    state: str
    gpus: int
    gpu_ids: dict[int, int]  # GPU index -> gpus.id
    path: tuple[str, ...] = ()
    gpu_model: str = ""
    memory_mib: int = 0
    address: str = ""
    last_heartbeat: float = 0.0
    persisted_heartbeat: float = 0.0
    agent_instance: str = ""
    revision: int = 0  # last assignment revision; exact while this replica holds the cycle lock on a fresh view
    closeness: GpuCloseness | None = None  # from the registered topology's GPU matrix; None when it has none
    # Health from the agent's heartbeats: HEALTHY, DEGRADED, FATAL (or UNKNOWN, back from LOST), a summary, and the
    # GPUs that are not HEALTHY (index -> (state, reasons)). FATAL GPUs are kept out of the capacity view; a FATAL
    # node is unschedulable.
    health: str = "HEALTHY"
    health_reason: str = ""
    gpu_health: dict[int, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    # MIG mode as the agent registered it: the GPUs in MIG mode (they take only MIG instances; the others only
    # whole-GPU jobs and shares), and per GPU the memory slices of MIG instances Phalanx did not make.
    mig_gpus: frozenset[int] = frozenset()
    foreign: dict[int, int] = field(default_factory=dict)
    # --mig-manage (services/scheduler/migmode.py): the agent lets the scheduler switch idle GPUs' MIG mode; the
    # last revision it acked; per GPU the switch asked (under way or failed), the mode the agent reports pending
    # (True: MIG mode) where a GPU reset has still to apply it, and when the mode last changed (--mig-switch-hold).
    mig_manage: bool = False
    acked_revision: int = 0
    mig_switches: dict[int, MigSwitch] = field(default_factory=dict)
    mig_pending: dict[int, bool] = field(default_factory=dict)
    mig_switched_at: dict[int, float] = field(default_factory=dict)
    # Clean GPU handover: the agent confirms when an ended attempt's processes here are gone; until then its whole
    # GPUs are held ("job/attempt" -> GPU indexes), out of placement (ledger.read_releasing).
    confirms_release: bool = False
    releasing: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # ... and the host resources (thousandths of CPUs, bytes) those attempts' replicas there hold meanwhile
    releasing_use: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Host resources its agent reported (thousandths of CPUs, bytes; 0: not reported)
    cpu_milli: int = 0
    memory: int = 0
    rank_ports: tuple[int, int] = (0, 0)  # --rank-port-range of its agent ((0, 0): the default range)

    @property
    def fatal_gpus(self) -> set[int]:
        return {i for i, (h, _) in self.gpu_health.items() if h == "FATAL" and 0 <= i < self.gpus}

    @property
    def switching_gpus(self) -> set[int]:
        """GPUs whose MIG mode switch is under way: out of placement for every request until it ends."""
        return {i for i, s in self.mig_switches.items() if s.active and 0 <= i < self.gpus}

    @property
    def held_gpus(self) -> set[int]:
        """GPUs kept out of the capacity view: FATAL ones and those switching MIG mode."""
        return self.fatal_gpus | self.switching_gpus if self.mig_switches else self.fatal_gpus

    @property
    def schedulable(self) -> bool:
        # UNKNOWN: back after it was lost, not yet reported healthy (its first heartbeat settles it).
        return self.state == "READY" and self.health not in ("FATAL", "UNKNOWN")

    def health_signature(self) -> tuple:
        return (
            self.health,
            tuple(sorted((i, h, tuple(r)) for i, (h, r) in self.gpu_health.items())),
            self.health_reason,
        )


class SchedulerState:
    def __init__(self) -> None:
        self._jobs = JobTable()  # PENDING and RUNNING jobs only
        self.nodes: dict[str, NodeRecord] = {}
        self._capacity = ClusterCapacity()
        self._capacity_stale = False
        # A scheduling pass is due although this cycle's writes changed nothing it decides on: the view was
        # (re)loaded, jobs were submitted, capacity changed in memory. Cleared by the pass (cycle.schedule).
        self.pass_due = True
        self.wake_at = float("inf")  # the next time a cycle must run although nothing happened (cycle.wake_at)
        self.endpoint: tuple[str, str] = ("", "")  # the checkpoint coordinator found in the ledger (address, dir)
        self.endpoint_expires = 0.0
        self.no_preemption: tuple | None = None  # (signature, valid until, message) of the last "no victims" answer
        self.reservation_memo: dict = {}  # the blocked head's last reservation and what it was planned on
        self.mig_plans: dict = {}  # job id -> (signature, valid until, plan) of its last MIG mode switch plan
        self.queues: dict[str, QueueSpec] = {}  # configured queues (none: no quotas, one unlimited queue)
        self.pools: dict[
            str, SparePool
        ] = {}  # the operator's spare pools (phalanx.core.pools; services.scheduler.pools)
        # The running gangs in end order for backfill (planning.running_ends), kept in step with the running jobs
        # cycle after cycle, with the fields each entry was built from
        self.ends = RunningSet()
        self.ends_built: dict[str, tuple[Any, ...]] = {}
        # tenant -> the Unix user its ranks run as (the tokens file's unix_user); None: authentication is off
        self.unix_user: Callable[[str], str] | None = None
        # The ledger's key for the ranks' credentials (db.migrate.ensure_rank_key): each launch carries its
        # attempt's PHALANX_JOB_TOKEN signed with it ("": none is given)
        self.rank_key = ""
        # The preemptors' standing claims by job (phalanx.core.claims; the ledger's `claims` rows not ended)
        self.claims: dict[str, Claim] = {}
        # The jobs this replica's committed cycles ended (a final state: no attempt of theirs runs again), the
        # newest ENDED_KEPT: the agents' reports for their ranks (a cancelled 128-node gang's kills, 128 reports) are
        # answered stale from memory, not by a read of the ledger each (commands.RankReport)
        self.ended: OrderedDict[str, None] = OrderedDict()

    def note_ended(self, job_ids: Iterable[str]) -> None:
        """Remember jobs that ended in a committed cycle (service._transaction_on, after its commit)."""
        ended = self.ended
        for job_id in job_ids:
            ended[job_id] = None
            ended.move_to_end(job_id)
        while len(ended) > ENDED_KEPT:
            ended.popitem(last=False)

    @property
    def jobs(self) -> JobTable:
        return self._jobs

    @jobs.setter
    def jobs(self, jobs: dict[str, JobRecord]) -> None:
        for job in self._jobs.values():
            if job.__dict__.get("table") is self._jobs:
                job.table = None
        self._jobs = jobs if isinstance(jobs, JobTable) else JobTable(jobs)
        self.ends, self.ends_built = RunningSet(), {}

    @property
    def capacity(self) -> ClusterCapacity:
        """The free-capacity index, rebuilt on first use after `rebuild_capacity` (so a cycle that registers a
        thousand nodes builds it once, not a thousand times)."""
        if self._capacity_stale:
            self._build_capacity()
        return self._capacity

    def rebuild_capacity(self) -> None:
        """Rebuild the index from the nodes and the running jobs, when it is next used."""
        self._capacity_stale = True
        self.pass_due = True

    def _build_capacity(self) -> None:
        self._capacity_stale = False
        self._capacity = ClusterCapacity(
            NodeCapacity(
                n.name,
                n.gpus,
                set(range(n.gpus)) - held,
                n.schedulable,
                n.path,
                n.closeness,
                n.gpu_model,
                n.memory_mib,
                mig={g: FULL_MIG_MASK for g in held & n.mig_gpus},
                mig_gpus=n.mig_gpus,
                foreign=dict(n.foreign),
                cpu_milli=n.cpu_milli,
                memory=n.memory,
            )
            for n in self.nodes.values()
            for held in (n.held_gpus,)
        )
        capacity = self._capacity
        capacity.lending = frozenset(n for p in self.pools.values() for n in p.nodes())
        for job in self.running():
            for rep in job.replica_placements():
                if rep.mig_profile or rep.gpu_milli:
                    capacity.take_partial(rep)
                else:
                    capacity.take(rep.node, rep.gpus)
                if rep.cpu_milli or rep.memory:
                    capacity.take_use(rep.node, rep.cpu_milli, rep.memory)
        for n in self.nodes.values():
            for gpus in n.releasing.values():
                capacity.take(n.name, set(gpus) - n.held_gpus)
            for cpu, memory in n.releasing_use.values():
                capacity.take_use(n.name, cpu, memory)

    def set_node_schedulable(self, name: str) -> None:
        self.capacity.set_schedulable(name, self.nodes[name].schedulable)
        self.pass_due = True

    def hold_fatal_gpus(self, names) -> None:
        """Keep FATAL GPUs out of the free view after a release gave them back (a job on them ended)."""
        for name in names:
            node = self.nodes.get(name)
            if node is not None and node.gpu_health:
                fatal = node.fatal_gpus
                if fatal:
                    self.capacity.take(name, fatal)

    def pending(self) -> list[JobRecord]:
        """The PENDING jobs, in the view's order."""
        return list(self._jobs.in_state("PENDING").values())

    def running(self) -> list[JobRecord]:
        """The RUNNING jobs (victims being preempted included), in the view's order."""
        return list(self._jobs.in_state("RUNNING").values())

    def running_on(self, node: str) -> list[JobRecord]:
        return [j for j in self.running() if node in j.nodes]


def attempt_key(job_id: str, attempt: int) -> str:
    """An attempt's key in NodeRecord.releasing (as ledger.read_releasing writes it)."""
    return f"{job_id}/{attempt}"


def layout_ranks(job: JobRecord) -> dict[int, RankRecord]:
    """Ranks follow from the allocations: one per GPU in replica order, or one per replica (torchrun)."""
    ranks: dict[int, RankRecord] = {}
    for replica, node, gpus in job.allocations:
        if job.procs_per_replica == 1:
            ranks[replica] = RankRecord(replica, replica, 0, node)
        else:
            for local in range(len(gpus)):
                r = replica * job.gpus_per_replica + local
                ranks[r] = RankRecord(r, replica, local, node)
    return ranks
