"""Contract 7 (issue 17): the simulator is the scheduler. A short trace is replayed twice, through the live scheduler
(a real in-process scheduler on a real database, with lightweight protocol agents) and through the trace simulator
(phalanx.sim.engine.simulate) on the same cluster and fabric; every job must start in the same order, in the same
decisions, on the same nodes and GPUs per replica.

The live run keeps the simulator's time: the scheduler's clock (SchedulerSettings.clock) is the trace's, in trace
seconds, and only the test moves it, one event at a time, as the simulator does. It moves the clock to the next
event (an arrival, the end of a running gang at its start plus its duration, a victim's preemption deadline), acts
on it (submits the job; lets the gang end: its ranks wait on a gate; or has the scheduler run a cycle), and waits
until the scheduler has acted on it (SubmitJob answered: the cycle that decided on it has committed; the gang
SUCCEEDED; the victim stopped) and every gang it started has its ranks running, before it looks for the next. So a
loaded machine makes the run slower, never different: every start happens at the trace time of the event it
answered, and the live start times must equal the simulator's.

- The burst trace starts with a blocker gang of the top priority holding the whole cluster while the burst arrives,
  so the first decision that places anything sees the whole burst at once, in both runs. The ends are at least
  MIN_GAP_S apart and the simulator's answer does not move when every duration is jittered by JITTER_S (checked on
  the simulator alone: the trace does not hinge on a coincidence of times).
- Priorities are mixed (not FIFO); heads of the queue wait for gangs to end while others backfill around their
  reservations (checked on the simulator's answer).

Settings: the scheduler's defaults (EASY backfill on, preemption by the production policy), which is the
simulator's `topo-preempt` (topology-aware, backfill, preemption), given the same minimum runtime and grace. Two
settings differ, both outside the policy: no time budget for a placement or a backfill pass (the simulator has
none: a budget cut short by a loaded machine would decide differently), and node leases longer than the trace (the
simulator has no node loss; the agents heartbeat on the wall clock, not on the trace's). The simulator declares
twice a job's duration as its time limit; the live jobs declare the same. With the production minimum runtime
(600 s) nothing is preempted in the burst (no gang runs that long), so a second, smaller trace runs with a short
preemption policy (the same in both): a high-priority gang preempts the one lower-priority gang whose eviction makes
it fit (not the lowest-priority one, which would not), takes its GPUs after the grace, and the victim starts again
(attempt 2) when the preemptor ends.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually, next_cycle

from phalanx.api.v1 import agent_pb2, common_pb2, scheduler_pb2
from phalanx.core.preemption import PRODUCTION_POLICY, PreemptionPolicy
from phalanx.sim import engine
from phalanx.sim.engine import ClusterSpec, simulate
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

CLUSTER = ClusterSpec(nodes=8, gpus=8, per_leaf=4)  # 8 nodes of 8 GPUs, 2 leaves of 4 under one spine
MIN_GAP_S = 20.0  # trace seconds between two ends the burst's order depends on
JITTER_S = 8.0  # trace seconds: the simulator's answer must not move when every duration is jittered this much
PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    submit_s: float
    replicas: int
    gpus_per_replica: int
    duration_s: float
    priority: int = 0
    gpu_milli: int = 0


def _trace(blocker: tuple | None, *jobs: tuple) -> list[TraceJob]:
    """(name, replicas, GPUs per replica, priority, duration) each; the blocker at 0, the rest one second apart."""
    out = [TraceJob(n, 0.0, r, g, d, p) for n, r, g, p, d in [blocker]] if blocker else []
    return out + [TraceJob(n, float(len(out) + i), r, g, d, p) for i, (n, r, g, p, d) in enumerate(jobs)]


BURST = _trace(
    ("blocker", 8, 8, 100, 40.0),  # the whole cluster, the top priority, while the burst arrives
    ("big-a", 4, 8, 5, 120.0),
    ("pair-b", 2, 8, 5, 240.0),
    ("quad-c", 1, 4, 5, 20.0),
    ("big-d", 4, 8, 3, 80.0),
    ("one-e", 1, 8, 3, 160.0),
    ("tiny-f", 1, 1, 2, 280.0),
    ("pair-g", 2, 8, 2, 220.0),
    ("quad-h", 1, 4, 1, 240.0),
    ("tiny-i", 1, 1, 4, 300.0),
    ("one-j", 1, 8, 0, 300.0),
    ("pair-k", 2, 8, 1, 80.0),
    ("tiny-l", 1, 1, 0, 40.0),
    ("quad-m", 1, 4, 2, 140.0),
    ("one-o", 1, 8, 4, 220.0),
    ("tiny-p", 1, 1, 3, 60.0),
    ("quad-q", 1, 4, 0, 280.0),
    ("pair-r", 2, 8, 0, 180.0),
)
# Three long gangs fill the cluster one after the other; at 60 a 4-node gang of priority 10 arrives.
PREEMPTION = _trace(
    None,
    ("low-a", 4, 8, 1, 1000.0),  # a whole leaf: the one victim that makes room
    ("low-b", 2, 8, 0, 1100.0),  # the lowest priority, but evicting it alone would not make room: spared
    ("low-c", 2, 8, 2, 1200.0),
) + [TraceJob("urgent", 60.0, 4, 8, 40.0, 10)]
PREEMPTION_POLICY = PreemptionPolicy(min_runtime_s=40.0, grace_period_s=20.0)  # trace seconds

# (job name, attempt) -> its replicas as (replica, node, GPUs); and the starts, one set of (job, attempt) per decision.
Placements = dict[tuple[str, int], tuple[tuple[int, str, tuple[int, ...]], ...]]
Starts = list[frozenset[tuple[str, int]]]


def normalized(starts: list[tuple[float, str, int, tuple]]) -> tuple[Starts, Placements]:
    """Starts grouped by decision (the same start time), in time order, and each start's placement."""
    by_time: dict[float, set[tuple[str, int]]] = defaultdict(set)
    placements: Placements = {}
    for t, job, attempt, replicas in starts:
        by_time[t].add((job, attempt))
        placements[(job, attempt)] = tuple(sorted(replicas))
    return [frozenset(by_time[t]) for t in sorted(by_time)], placements


# ---- the simulator ------------------------------------------------------------------------------------------------


@dataclass
class Replayed:
    starts: list[tuple[float, str, int, tuple]]  # (time, job, attempt, replicas), in order
    ends: list[tuple[float, str]]  # (time, job) of the gangs that ended (not preempted), in order
    preemptions: int


def replay(jobs: list[TraceJob], policy: PreemptionPolicy = PRODUCTION_POLICY) -> Replayed:
    """The trace through the simulator, with the scheduler's settings: `topo-preempt` (topology-aware placement, EASY
    backfill, preemption) with `policy`'s minimum runtime and grace (trace seconds). SimResult carries no per-job
    starts, so they are read where the replay makes them (`_Replay.start` and `stop`), for this replay only."""
    out = Replayed([], [], 0)
    start, stop = engine._Replay.start, engine._Replay.stop

    def recording_start(self, st, placement):
        replicas = tuple((r.replica, r.node, tuple(sorted(r.gpus))) for r in placement.replicas)
        out.starts.append((self.now, st.job.job_id, len(st.attempts) + 1, replicas))
        return start(self, st, placement)

    def recording_stop(self, st, *args, **kw):
        if not st.evict_by:
            out.ends.append((self.now, st.job.job_id))
        return stop(self, st, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine._Replay, "start", recording_start)
        mp.setattr(engine._Replay, "stop", recording_stop)
        result = simulate(
            jobs,
            CLUSTER,
            "topo-preempt",
            min_runtime_s=policy.min_runtime_s,
            checkpoint_cost_s=policy.grace_period_s,
        )
    assert result.metrics["completed"] == len(jobs)
    out.preemptions = result.metrics["preemptions"]
    return out


def jittered(jobs: list[TraceJob], seed: int) -> list[TraceJob]:
    rng = random.Random(seed)
    return [
        TraceJob(
            j.job_id,
            j.submit_s,
            j.replicas,
            j.gpus_per_replica,
            j.duration_s + rng.uniform(-JITTER_S, JITTER_S),
            j.priority,
        )
        for j in jobs
    ]


# ---- the live scheduler -------------------------------------------------------------------------------------------


@dataclass
class GatedAgent(LiteAgent):
    """A LiteAgent whose ranks of the command `gated` report RUNNING, then exit 0 once the test opens their job's
    gate (shared by all agents: every rank of the gang ends together); killed, they report KILLED as usual.
    `started` counts, per (job, attempt), the ranks whose RUNNING the scheduler has taken (the report answered)."""

    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    started: dict[tuple[str, int], int] = field(default_factory=dict)

    async def _rank(self, launch: agent_pb2.LaunchReplica, rank: agent_pb2.RankLaunch) -> None:
        if list(launch.command) != ["gated"]:
            return await super()._rank(launch, rank)
        await self._report(launch.job_id, launch.attempt, rank.rank, common_pb2.RANK_STATE_RUNNING, 0)
        key = (launch.job_id, launch.attempt)
        self.started[key] = self.started.get(key, 0) + 1
        await self.gates.setdefault(launch.job_id, asyncio.Event()).wait()
        await self._report(launch.job_id, launch.attempt, rank.rank, common_pb2.RANK_STATE_EXITED, 0)


class TraceClock:
    """The live scheduler's clock: EPOCH plus the trace time the test has moved it to, and nothing in between."""

    EPOCH = 1_750_000_000.0  # a plausible unix time (whole seconds: trace times come back exactly)

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.EPOCH + self.t

    def move_to(self, t: float) -> None:
        assert t >= self.t, f"the trace's clock would go back from {self.t} to {t}"
        self.t = t


@dataclass
class LiveRun:
    starts: list[tuple[float, str, int, tuple]]  # as Replayed.starts, in trace seconds
    ended: list[str]  # the gangs the test let end, in order


async def live_run(db_url: str, jobs: list[TraceJob], policy: PreemptionPolicy = PRODUCTION_POLICY) -> LiveRun:
    """The trace through the scheduler (its default settings but `policy`, in trace seconds), on the trace's clock,
    event by event, until every job has arrived and none is pending."""
    gates: dict[str, asyncio.Event] = {}
    clock = TraceClock()
    fabric = CLUSTER.fabric()  # the simulator's own fabric and node names: nothing to map
    settings = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=fabric,
        preemption=policy,
        clock=clock,
        placement_budget_ms=0.0,  # as the simulator: no time budget (see the module's docstring)
        backfill_budget_ms=0.0,
        lease_timeout=1e9,  # the agents heartbeat on the wall clock; no node is lost in the trace
    )
    agents: list[GatedAgent] = []

    def make_agents(addr: str) -> list[GatedAgent]:
        agents.extend(GatedAgent(addr, n, gpus=CLUSTER.gpus, gates=gates) for n in fabric.paths)
        return agents

    spec = {j.job_id: j for j in jobs}
    arrivals = sorted(jobs, key=lambda j: j.submit_s)
    ids: dict[str, str] = {}
    ended: list[str] = []
    async with LiteCluster(settings, make_agents) as c:

        async def jobs_now() -> dict[str, common_pb2.Job]:
            listed = await c.stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000))
            return {j.spec.name: j for j in listed.jobs}

        async def ranks_running():
            """[the jobs], once every running gang's ranks have all reported RUNNING (else None): the scheduler's view
            is settled, and no launch deadline can pass while the clock moves on."""
            live = await jobs_now()
            for n, j in live.items():
                if j.state == RUNNING:
                    ranks = spec[n].replicas * spec[n].gpus_per_replica
                    if sum(a.started.get((j.id, j.attempt), 0) for a in agents) < ranks:
                        return None
            return [live]

        while True:
            (live,) = await eventually(ranks_running, timeout=30, what="every running gang's ranks RUNNING")
            if not arrivals and not any(j.state == PENDING for j in live.values()):
                break
            # The next event: an arrival, a gang's end (its start plus its duration), or a victim's preemption
            # deadline; at a tie, arrivals first, then ends.
            events = [(arrivals[0].submit_s, 0, arrivals[0].job_id)] if arrivals else []
            for n, j in live.items():
                if j.state == RUNNING:
                    events.append((j.started_at - clock.EPOCH + spec[n].duration_s, 1, n))
                if j.preempt_deadline:
                    events.append((j.preempt_deadline - clock.EPOCH, 2, n))
            t, kind, name = min(events)
            clock.move_to(t)
            if kind == 0:
                j = arrivals.pop(0)
                submitted = await c.submit(
                    j.job_id,
                    j.replicas,
                    j.gpus_per_replica,
                    ("gated",),
                    priority=j.priority,
                    time_limit_s=2 * max(j.duration_s, 1.0),
                )
                ids[j.job_id] = submitted.id
            elif kind == 1:
                gates.setdefault(ids[name], asyncio.Event()).set()
                await eventually(lambda n=name: _in_state(c, ids[n], SUCCEEDED), timeout=20, what=f"{name} SUCCEEDED")
                ended.append(name)
            else:
                victim = live[name]
                await next_cycle(c.scheduler.service)  # its pass at the deadline stops the victim

                async def stopped(v=victim):
                    now = await c.job(v.id)
                    return now.attempt != v.attempt or now.state != RUNNING

                await eventually(stopped, timeout=20, what=f"{name} stopped at its preemption deadline")
        rows = c.sql(
            "SELECT j.name, a.attempt, a.replica, n.name, a.gpu_index, a.reserved_at FROM allocations a "
            "JOIN jobs j ON j.id = a.job_id JOIN nodes n ON n.id = a.node_id"
        )
    gpus: dict[tuple[str, int], dict[tuple[int, str], list[int]]] = defaultdict(lambda: defaultdict(list))
    at: dict[tuple[str, int], float] = {}
    for job, attempt, replica, node, gpu, reserved_at in rows:
        gpus[(job, attempt)][(replica, node)].append(gpu)
        at[(job, attempt)] = reserved_at - clock.EPOCH
    starts = [
        (at[key], *key, tuple((r, n, tuple(sorted(g))) for (r, n), g in reps.items())) for key, reps in gpus.items()
    ]
    return LiveRun(sorted(starts), ended)


async def _in_state(c: LiteCluster, job_id: str, state: int):
    job = await c.job(job_id)
    return job if job.state == state else None


def assert_same_starts(live: LiveRun, sim: Replayed, jobs: list[TraceJob]) -> None:
    last = sim.starts[-1][0]
    # The live run let the gangs end in the simulator's order (those that ended before the last start).
    assert live.ended == [job for t, job in sim.ends if t <= last]
    live_order, live_placements = normalized(live.starts)
    sim_order, sim_placements = normalized(sim.starts)
    first = {(j.job_id, 1) for j in jobs}
    assert first <= set(sim_placements) and first <= set(live_placements)  # every job started in both
    sim_at = {(job, attempt): t for t, job, attempt, _ in sim.starts}
    live_at = {(job, attempt): t for t, job, attempt, _ in live.starts}
    when = {key: (sim_at.get(key), live_at.get(key)) for key in sim_at | live_at}  # in trace seconds, for the message
    assert live_order == sim_order, f"start order differs; (simulated, live) start times: {when}"
    assert live_placements == sim_placements
    assert live_at == sim_at, f"start times differ; (simulated, live): {when}"  # the same clock: the same times


# ---- the contract -------------------------------------------------------------------------------------------------


def test_the_burst_is_decided_by_the_policy_not_by_the_clock():
    """The simulator's answer on the burst, checked before the live comparison leans on it: the ends the live run
    must order are far apart, jittered durations change nothing, and it exercises priorities, waiting and backfill."""
    sim = replay(BURST)
    order, placements = normalized(sim.starts)
    last = sim.starts[-1][0]
    times = [t for t, _ in sim.ends if t <= last]
    assert min(b - a for a, b in zip(times, times[1:])) >= MIN_GAP_S
    for seed in range(20):
        assert normalized(replay(jittered(BURST, seed)).starts) == (order, placements), seed
    first = {job: t for t, job, _, _ in reversed(sim.starts)}
    assert set(first) == {j.job_id for j in BURST} and sim.preemptions == 0
    assert len(order) >= 8  # many decisions, not one
    burst = BURST[1:]
    rank = {j.job_id: (-j.priority, j.submit_s) for j in burst}
    waited = [j.job_id for j in burst if first[j.job_id] > first["blocker"] + BURST[0].duration_s]
    backfilled = [j for j in rank if any(rank[o] < rank[j] and first[o] > first[j] for o in rank)]
    assert len(waited) >= 8 and len(backfilled) >= 5  # heads waited while lower-ranked gangs went around them
    assert sorted(rank, key=lambda n: (first[n], rank[n])) != [j.job_id for j in burst]  # not FIFO


@pytest.mark.slow
async def test_the_simulator_starts_every_job_where_and_when_the_scheduler_does(db_url):
    assert_same_starts(await live_run(db_url, BURST), replay(BURST), BURST)


@pytest.mark.slow
async def test_the_simulator_preempts_what_the_scheduler_preempts(db_url):
    sim = replay(PREEMPTION, PREEMPTION_POLICY)
    assert sim.preemptions == 1  # low-a only: the preemptor takes its leaf after the grace, and low-a goes back there
    assert [(t, job, attempt) for t, job, attempt, _ in sim.starts] == [
        (0.0, "low-a", 1),
        (1.0, "low-b", 1),
        (2.0, "low-c", 1),
        (80.0, "urgent", 1),
        (120.0, "low-a", 2),
    ]
    assert_same_starts(await live_run(db_url, PREEMPTION, PREEMPTION_POLICY), sim, PREEMPTION)
