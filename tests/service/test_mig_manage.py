"""--mig-manage, the scheduler's side: it switches idle GPUs into and out of MIG mode when its queue needs it.

The pure decision (phalanx.core.mig_switch.plan_switches: which GPUs, the fewest, preferring nodes already partly
in MIG mode or partly used) and the reading of the agents' heartbeats (services.scheduler.migmode.report_changes)
are scenario tables. The end-to-end tests run the real scheduler in-process (SQLite and PostgreSQL) with real
NodeAgents on simulated DGX H100 hosts (the production NVML code over phalanx.simhost.nvml).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys

import grpc
import pytest
from helpers.clock import FakeClock
from helpers.lite_cluster import run_sql
from helpers.waits import eventually, next_cycle

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.mig_switch import plan_switches, switch_order
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.simulated import simulated_node
from services.scheduler.main import build_parser, serve
from services.scheduler.migmode import Change, MigStatus, report_changes
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import MigSwitch, NodeRecord, SchedulerState

H100 = ("NVIDIA H100 80GB HBM3", 81559)
A100_40 = ("NVIDIA A100-SXM4-40GB", 40960)
L40S = ("NVIDIA L40S", 46068)
PENDING, RUNNING, SUCCEEDED = (
    common_pb2.JOB_STATE_PENDING,
    common_pb2.JOB_STATE_RUNNING,
    common_pb2.JOB_STATE_SUCCEEDED,
)


# ---- the decision: which GPUs ------------------------------------------------------------------------------------


def node(name, gpus=8, mig=(), free=None, model=H100, mig_used=None) -> NodeCapacity:
    """A node: `mig` GPUs in MIG mode, `free` whole free GPUs (default: all not in MIG mode), `mig_used` slice
    masks used on MIG-mode GPUs."""
    free = set(range(gpus)) - set(mig) if free is None else set(free)
    n = NodeCapacity(name, gpus, free, True, ("leaf0", "spine0"), None, *model, mig_gpus=frozenset(mig))
    n.mig.update(mig_used or {})
    return n


def req(kind, arg, replicas=1, **kw) -> GangRequest:
    if kind == "whole":
        return GangRequest("j", replicas, arg, **kw)
    if kind == "milli":
        return GangRequest("j", replicas, 1, gpu_milli=arg, **kw)
    return GangRequest("j", replicas, 1, mig_profile=arg, **kw)


def idle(nodes, enable: bool):
    """Every GPU a scheduler could switch the given way: free whole GPUs, or MIG-mode GPUs with nothing on them."""
    out = []
    for n in nodes:
        for g in range(n.total):
            if enable and g in n.free or not enable and g in n.mig_gpus and not n.mig.get(g):
                out.append((n.name, g))
    return out


FULL = 0xFF
# (nodes, request, candidates (None: every idle GPU the needed way), switching, GPUs to switch (None: no plan),
#  GPUs waited for)
PLANS = [
    # no GPU in MIG mode: one idle GPU for a 1g, the highest index of the node
    ([node("a")], req("mig", "1g.10gb"), None, {}, [("a", 7)], []),
    # a partly used node before a whole free one (whole nodes stay free for big gangs)
    ([node("a"), node("b", free={0, 1, 2, 3})], req("mig", "1g.10gb"), None, {}, [("b", 3)], []),
    # a node already partly in MIG mode (its MIG GPU full) before a partly used one
    ([node("a", mig={7}, mig_used={7: FULL}), node("b", free={0, 1})], req("mig", "3g.40gb"), None, {}, [("a", 6)], []),
    # just enough: 8 x 3g fill four GPUs (two each), 3 x 7g three
    ([node("a")], req("mig", "3g.40gb", 8), None, {}, [("a", 7), ("a", 6), ("a", 5), ("a", 4)], []),
    ([node("a")], req("mig", "7g.80gb", 3), None, {}, [("a", 7), ("a", 6), ("a", 5)], []),
    # room on a GPU in MIG mode already: nothing to switch (it fits as things are)
    ([node("a", mig={7})], req("mig", "1g.10gb"), None, {}, [], []),
    # one more 3g than the MIG GPU holds: one more GPU
    ([node("a", mig={7}, mig_used={7: 0x0F})], req("mig", "3g.40gb", 2), None, {}, [("a", 6)], []),
    # too few candidates: no plan (something else is in the way)
    ([node("a", gpus=2)], req("mig", "7g.80gb", 3), None, {}, None, None),
    ([node("a", free={0})], req("mig", "7g.80gb", 2), None, {}, None, None),
    # a family without that profile is never switched for it; without MIG at all neither
    ([node("a", model=A100_40)], req("mig", "3g.40gb"), None, {}, None, None),
    ([node("a", model=L40S)], req("mig", "1g.10gb"), [("a", 7)], {}, None, None),
    # only the allowed candidates
    ([node("a")], req("mig", "1g.10gb"), [("a", 2)], {}, [("a", 2)], []),
    ([node("a")], req("mig", "1g.10gb"), [], {}, None, None),
    # a switch under way that the gang can use: it waits for it, nothing new is asked
    ([node("a", free=set(range(7)))], req("mig", "1g.10gb"), None, {("a", 7): True}, [], [("a", 7)]),
    # ... and asks only what that one does not cover
    ([node("a", free=set(range(7)))], req("mig", "7g.80gb", 2), None, {("a", 7): True}, [("a", 6)], [("a", 7)]),
    # a switch the other way is out of placement: it does not help
    ([node("a", mig={6, 7}, mig_used={7: FULL})], req("mig", "7g.80gb", 2), [], {("a", 6): False}, None, None),
    # out of MIG mode: an 8-GPU gang and one idle MIG GPU in the way
    ([node("a", mig={7})], req("whole", 8), None, {}, [("a", 7)], []),
    # the node closest to a whole free one: 1 switch on x, not 8 on y
    ([node("x", mig={7}), node("y", mig=range(8))], req("whole", 8), None, {}, [("x", 7)], []),
    ([node("y", mig=range(8)), node("x", mig={7})], req("whole", 8), None, {}, [("x", 7)], []),
    # a MIG GPU with an instance on it is not idle: the gang does not wait for a mode
    ([node("a", mig={7}, mig_used={7: 0x01})], req("whole", 8), None, {}, None, None),
    # a running whole-GPU job in the way: not only the mode
    ([node("a", mig={7}, free={0, 1, 2})], req("whole", 8), None, {}, None, None),
    # shares too
    ([node("a", mig=range(8))], req("milli", 500, 3), None, {}, [("a", 0), ("a", 1)], []),
    # a switch out of MIG mode under way: the whole gang waits for it
    ([node("a", free=set(range(7)))], req("whole", 8), [], {("a", 7): False}, [], [("a", 7)]),
    # two replicas of 8 on two nodes
    (
        [node("a", mig={7}), node("b", mig={0, 1}), node("c", free={0})],
        req("whole", 8, 2),
        None,
        {},
        [("a", 7), ("b", 0), ("b", 1)],
        [],
    ),
]


@pytest.mark.parametrize("nodes, request_, cands, switching, switch, waiting", PLANS)
def test_plan_switches_asks_the_fewest_gpus_of_the_preferred_nodes(nodes, request_, cands, switching, switch, waiting):
    cap = ClusterCapacity(nodes)
    before = {n.name: (set(n.free), dict(n.mig), n.mig_gpus) for n in cap.nodes.values()}
    enable = bool(request_.mig_profile)
    plan = plan_switches(cap, request_, idle(nodes, enable) if cands is None else cands, switching)
    assert {n.name: (n.free, n.mig, n.mig_gpus) for n in cap.nodes.values()} == before  # not changed
    if switch is None:
        assert plan is None
        return
    assert plan is not None and plan.enable is enable
    assert list(plan.switch) == switch and list(plan.waiting) == waiting
    used = {(r.node, g) for r in plan.placement.replicas for g in r.gpus}
    assert set(switch) | set(waiting) <= used  # every GPU asked for is one the gang's placement needs


def test_plan_switches_keeps_off_hidden_nodes_and_what_gangs_ahead_take():
    cap = ClusterCapacity([node("a"), node("b", free={0, 1, 2, 3})])
    cands = idle(cap.nodes.values(), True)
    assert plan_switches(cap, req("mig", "1g.10gb"), cands, hidden={"b"}).switch == (("a", 7),)
    # a gang ahead will take GPU 3 of b (a switch under way): this one is planned around it
    ahead = Placement(
        "ahead", (ReplicaPlacement(0, "b", (3,), mig_profile="7g.80gb", mig_start=0, mig_size=8),), "node", 1, 0.0, ""
    )
    plan = plan_switches(cap, req("mig", "1g.10gb"), cands, {("b", 3): True}, taken=[ahead])
    assert plan.switch == (("b", 2),) and plan.waiting == ()
    assert plan_switches(cap, req("mig", "1g.10gb"), [("b", 3)], {("b", 3): True}, taken=[ahead]) is None


def test_switch_order_prefers_partly_mig_then_partly_used_nodes():
    cap = ClusterCapacity([node("empty"), node("used", free={0, 1, 2}), node("mig", mig={7})])
    order = switch_order(cap, idle(cap.nodes.values(), True), True)
    assert order[:7] == [("mig", g) for g in range(6, -1, -1)]
    assert order[7:10] == [("used", 2), ("used", 1), ("used", 0)] and order[10] == ("empty", 7)
    out = switch_order(cap, [("mig", 7), ("empty", 0)], False)  # out of MIG mode: the most free GPUs first
    assert out == [("empty", 0), ("mig", 7)]


# ---- the heartbeats: what a report changes -----------------------------------------------------------------------

E, D = "ENABLED", "DISABLED"


def record(mig=(), switches=None, pending=None) -> NodeRecord:
    return NodeRecord(
        id=1,
        name="n",
        state="READY",
        gpus=8,
        gpu_ids={i: i + 1 for i in range(8)},
        gpu_model=H100[0],
        memory_mib=H100[1],
        mig_gpus=frozenset(mig),
        mig_manage=True,
        mig_switches=dict(switches or {}),
        mig_pending=dict(pending or {}),
    )


ASKED = MigSwitch(True, 100.0, revision=5)
# (GPUs in MIG mode, switches, pending, reported {gpu: (current, pending, switching, error)}, acked, changes)
REPORTS = [
    ((), {}, {}, {7: (D, D, False, "")}, 0, []),  # nothing new
    ((), {7: ASKED}, {}, {7: (E, E, False, "")}, 0, [Change("mode", 7, True)]),  # done (no ack needed)
    ((), {}, {}, {7: (E, E, False, "")}, 0, [Change("mode", 7, True)]),  # changed by someone else
    ((7,), {}, {}, {7: (D, D, False, "")}, 0, [Change("mode", 7, False)]),
    ((), {7: ASKED}, {}, {7: (D, D, False, "")}, 4, []),  # not taken yet
    ((), {7: ASKED}, {}, {7: (D, D, False, "old error")}, 4, []),  # a stale error
    ((), {7: ASKED}, {}, {7: (D, D, True, "")}, 5, []),  # under way
    ((), {7: ASKED}, {}, {7: (D, D, False, "in use")}, 5, [Change("failed", 7, "in use")]),
    (
        (),
        {7: ASKED},
        {},
        {7: (D, D, False, "")},
        5,
        [Change("failed", 7, "the agent reports no switch under way (it may have restarted before switching)")],
    ),
    ((), {7: ASKED}, {}, {}, 5, [Change("failed", 7, "the agent reports no MIG mode for this GPU")]),
    # waits for a GPU reset: shown pending, still under way
    ((), {7: ASKED}, {}, {7: (D, E, True, "")}, 5, [Change("pending", 7, True)]),
    ((), {7: ASKED}, {7: True}, {7: (D, E, True, "")}, 5, []),
    ((), {7: ASKED}, {7: True}, {7: (E, E, False, "")}, 5, [Change("mode", 7, True), Change("pending", 7, None)]),
    # a failed switch is not reported again
    ((), {7: MigSwitch(True, 100.0, 5, error="in use", retry_after=200.0)}, {}, {7: (D, D, False, "in use")}, 9, []),
    # the view has the target already (a registration): the switch ends
    ((7,), {7: ASKED}, {}, {7: (E, E, False, "")}, 0, [Change("done", 7)]),
    # an unknown mode (NVML could not read it) changes nothing but may fail a switch
    ((), {}, {}, {7: ("", "", False, "NVML_ERROR_UNKNOWN")}, 0, []),
]


@pytest.mark.parametrize("mig, switches, pending, reported, acked, changes", REPORTS)
def test_report_changes(mig, switches, pending, reported, acked, changes):
    statuses = {g: MigStatus(*s) for g, s in reported.items()}
    assert report_changes(record(mig, switches, pending), statuses, acked) == changes


def test_switching_gpus_are_held_out_of_the_capacity_view():
    state = SchedulerState()
    state.nodes = {
        "n": record(
            mig=(6,),
            switches={7: ASKED, 6: MigSwitch(False, 100.0, 6), 5: MigSwitch(True, 1.0, 1, error="x", retry_after=9.0)},
        )
    }
    state.rebuild_capacity()
    cap = state.capacity.nodes["n"]
    assert cap.free == set(range(6)) and cap.mig == {6: FULL}  # 7 and 6 are held; 5 (failed) is back


def test_nodes_table_shows_switching_and_pending_gpus():
    from phalanx.cli.render import nodes_table
    from phalanx.client import Node

    gpus = [common_pb2.NodeGpu(index=i, mig_mode="disabled") for i in range(8)]
    gpus[6].mig_switching = True
    gpus[7].mig_switching, gpus[7].mig_mode_pending = True, "enabled"
    table = nodes_table([Node.from_proto(common_pb2.Node(name="n", gpus=8, mig_manage=True, gpu_details=gpus))])
    assert "MIG switching: GPU 6,7" in table and "MIG mode after a GPU reset: GPU 7->enabled" in table
    assert "MIG switching" not in nodes_table([Node.from_proto(common_pb2.Node(name="n", gpus=8))])


def test_scheduler_flags():
    args = build_parser().parse_args([])
    assert (args.mig_switch_hold, args.mig_switch_backoff) == (60.0, 60.0)
    args = build_parser().parse_args(["--mig-switch-hold", "5", "--mig-switch-backoff", "7.5"])
    assert (args.mig_switch_hold, args.mig_switch_backoff) == (5.0, 7.5)


# ---- end to end: a real scheduler and real NodeAgents on simulated hosts -----------------------------------------

pytestmark_e2e = pytest.mark.usefixtures("service_logs")
SHORT = [sys.executable, "-c", "import time; time.sleep(0.5)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


class Cluster:
    """An in-process scheduler, simulated DGX H100 NodeAgents (name -> (GPUs in MIG mode, --mig-manage)) and a
    stub. Short heartbeats (0.1 s)."""

    def __init__(self, db_url: str, tmp_path, nodes: dict[str, tuple[str, bool]], **settings) -> None:
        self.db_url, self.tmp_path, self.specs = db_url, tmp_path, nodes
        self.settings = SchedulerSettings(
            db_url=db_url,
            listen="127.0.0.1:0",
            fabric=default_fabric(sorted(nodes)),
            heartbeat_interval=0.1,
            lease_timeout=5.0,
            poll_interval=0.2,
            **settings,
        )
        self.agents: dict[str, NodeAgent] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.watches: list[asyncio.Task] = []

    async def __aenter__(self):
        self.scheduler = await serve(self.settings)
        self.channel = grpc.aio.insecure_channel(self.scheduler.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        for name in sorted(self.specs):
            await self.start_agent(name)
        return self

    async def start_agent(self, name: str) -> NodeAgent:
        mig, manage = self.specs[name]
        state = self.tmp_path / name
        sim = simulated_node(name, "dgx-h100", mig_gpus=mig, state_dir=state)
        agent = NodeAgent(
            AgentConfig(
                scheduler=self.scheduler.address,
                node_name=name,
                topology=sim.topology,
                nvml=sim.nvml,
                state_dir=state,
                kill_grace_s=0.5,
                backoff_initial_s=0.05,
                backoff_cap_s=0.3,
                poll_interval_s=0.02,
                rpc_timeout_s=2.0,
                flush_timeout_s=2.0,
                mig_manage=manage,
            )
        )
        agent.sim = sim
        self.agents[name] = agent
        self.tasks[name] = asyncio.create_task(agent.run())
        await eventually(lambda: self._ready(name), what=f"{name} READY")
        return agent

    async def _ready(self, name):
        n = (await self.nodes()).get(name)
        return n is not None and n.state == common_pb2.NODE_STATE_READY

    async def __aexit__(self, *exc):
        for task in self.watches:
            task.cancel()
        for agent in self.agents.values():
            agent.request_stop()
        for task in self.tasks.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
        await self.channel.close()
        await self.scheduler.stop()

    def host(self, name: str):
        return self.agents[name].sim.host

    async def nodes(self) -> dict[str, common_pb2.Node]:
        return {n.name: n for n in (await self.stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes}

    async def gpu(self, name: str, index: int) -> common_pb2.NodeGpu:
        return (await self.nodes())[name].gpu_details[index]

    async def submit(self, name: str, gpus: int = 1, command=SHORT, **kw) -> common_pb2.Job:
        spec = common_pb2.JobSpec(name=name, replicas=1, gpus_per_replica=gpus, command=command, **kw)
        return await self.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))

    async def job(self, job_id: str) -> common_pb2.Job:
        return await self.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))

    async def until(self, job_id: str, check, what: str, timeout: float = 20) -> common_pb2.Job:
        async def probe():
            job = await self.job(job_id)
            return job if check(job) else None

        return await eventually(probe, what=what, timeout=timeout)

    def watch(self, job_id: str) -> list[str]:
        """Every message the job shows, in order (from WatchJobs, in the background)."""
        seen: list[str] = []

        async def run():
            async for event in self.stub.WatchJobs(scheduler_pb2.WatchJobsRequest(job_ids=[job_id])):
                if not seen or seen[-1] != event.job.message:
                    seen.append(event.job.message)

        self.watches.append(asyncio.create_task(run()))
        return seen

    def switches(self, node: str) -> list[tuple[int, float]]:
        """The SetMigMode assignments sent to `node`: (revision, created_at)."""
        return [
            tuple(r)
            for r in run_sql(
                self.db_url,
                "SELECT a.revision, a.created_at FROM assignments a JOIN nodes n ON n.id = a.node_id "
                "WHERE n.name = :n AND a.kind = 'set_mig_mode' ORDER BY a.revision",
                n=node,
            )
        ]

    async def cli_json(self, *argv: str):
        from phalanx.cli.main import main

        def run():
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main(["--scheduler", self.scheduler.address, "--timeout", "5", *argv])
            assert code == 0
            return json.loads(out.getvalue())

        return await asyncio.to_thread(run)  # the scheduler runs on this event loop


def _gpu_is(c: Cluster, node: str, index: int, **want):
    async def check():
        g = await c.gpu(node, index)
        return g if all(getattr(g, k) == v for k, v in want.items()) else None

    return check


@pytestmark_e2e
@pytest.mark.slow
async def test_a_mig_job_gets_an_idle_gpu_switched_and_a_whole_node_job_gets_it_back(db_url, tmp_path):
    # The scheduler's clock is the test's: the hold outlasts the MIG job's run and the submission after it however
    # long they take, and ends when the test moves the clock past it.
    hold = 3.0
    clock = FakeClock()
    async with Cluster(db_url, tmp_path, {"node-a": ("none", True)}, mig_switch_hold_s=hold, clock=clock.time) as c:
        (shown,) = await c.cli_json("nodes", "--json")
        assert shown["mig_manage"] is True
        assert [(g["mig_mode"], g["mig_mode_pending"], g["mig_switching"]) for g in shown["gpu_details"]] == [
            ("disabled", "", False)
        ] * 8
        mig = await c.submit("mig", mig_profile="1g.10gb", command=[sys.executable, "-c", "import time; time.sleep(1)"])
        # the cycle that took it asked for the switch: its first answer says what it waits for
        assert mig.state == PENDING and mig.message == (
            "waiting for GPU 7 of node-a to switch to MIG mode (asked 0 s ago), holding no GPUs"
        )
        running = await c.until(mig.id, lambda j: j.state == RUNNING, "the MIG job RUNNING")
        # one GPU, the last, was switched for it, and it runs there
        assert ("set_mig_mode", 7, 1) in c.host("node-a").calls
        assert [call for call in c.host("node-a").calls if call[0] == "set_mig_mode"] == [("set_mig_mode", 7, 1)]
        assert (list(running.allocations[0].gpus), running.allocations[0].slices[0].profile) == ([7], "1g.10gb")
        g7 = await c.gpu("node-a", 7)
        assert (g7.mig_mode, g7.mig_mode_pending, g7.mig_switching) == ("enabled", "", False)
        assert [g.mig_mode for g in (await c.nodes())["node-a"].gpu_details[:7]] == ["disabled"] * 7
        assert len(c.switches("node-a")) == 1
        done = await c.until(mig.id, lambda j: j.state == SUCCEEDED, "the MIG job SUCCEEDED")
        assert done.exit_code == 0
        rows = run_sql(
            db_url, 'SELECT g.mig_mode, g.mig_switch_to, g.mig_switched_at > 0 FROM gpus g WHERE g."index" = 7'
        )
        assert rows == [("ENABLED", "", True)]

        # A whole-node job: GPU 7 holds no instance now, but it switched less than the hold ago
        whole = await c.submit("whole", gpus=8)
        held = await c.until(whole.id, lambda j: "--mig-switch-hold" in j.message, "the hold in the reason")
        assert held.state == PENDING and "GPU 7 of node-a changed its MIG mode at" in held.message
        assert len(c.switches("node-a")) == 1  # not asked back yet
        messages = c.watch(whole.id)
        clock.advance(hold)  # the hold ends
        running = await c.until(whole.id, lambda j: j.state == RUNNING, "the whole-node job RUNNING")
        assert sorted(running.allocations[0].gpus) == list(range(8))
        assert [call for call in c.host("node-a").calls if call[0] == "set_mig_mode"] == [
            ("set_mig_mode", 7, 1),
            ("set_mig_mode", 7, 0),
        ]
        (_, _), (_, asked_back) = c.switches("node-a")
        switched = run_sql(db_url, "SELECT at FROM node_events WHERE kind = 'mig_mode' ORDER BY at")
        assert len(switched) == 2 and asked_back >= switched[0][0] + hold  # the hold was kept
        assert (await c.gpu("node-a", 7)).mig_mode == "disabled"
        assert any(m.startswith("waiting for GPU 7 of node-a to switch out of MIG mode") for m in messages)


@pytestmark_e2e
@pytest.mark.slow
async def test_a_switch_that_waits_for_a_gpu_reset_shows_pending_then_done(db_url, tmp_path):
    async with Cluster(db_url, tmp_path, {"node-a": ("none", True)}) as c:
        c.host("node-a").mig_reset_required = True  # a pass-through VM: NVML cannot reset the GPU itself
        mig = await c.submit("mig", mig_profile="3g.40gb", command=SLEEP)
        g7 = await eventually(_gpu_is(c, "node-a", 7, mig_mode_pending="enabled"), what="the pending mode shown")
        assert (g7.mig_mode, g7.mig_switching) == ("disabled", True)
        job = await c.until(mig.id, lambda j: "GPU reset" in j.message, "the reset in the reason")
        assert job.state == PENDING and job.message.startswith(
            "waiting for GPU 7 of node-a to switch to MIG mode (asked "
        )
        shown = await c.cli_json("job", mig.id, "--json")
        assert shown["message"].startswith("waiting for GPU 7 of node-a to switch to MIG mode")
        (listed,) = [j for j in (await c.cli_json("jobs", "--json"))["jobs"] if j["id"] == mig.id]
        assert "GPU reset" in listed["message"]
        (node,) = await c.cli_json("nodes", "--json")
        assert (node["gpu_details"][7]["mig_mode_pending"], node["gpu_details"][7]["mig_switching"]) == (
            "enabled",
            True,
        )
        assert node["free_gpus"] == 7  # the switching GPU takes no work
        # a switching GPU is out of placement for every request: an 8-GPU job (behind the MIG job) cannot start
        whole = await c.submit("whole", gpus=8, priority=-1)
        await next_cycle(c.scheduler.service)  # a pass after the one its submission ran
        assert (await c.job(whole.id)).state == PENDING
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=whole.id))
        assert (await c.job(mig.id)).state == PENDING and len(c.switches("node-a")) == 1

        # a MIG gang behind it that GPU 7 cannot also hold gets a GPU of its own switched (GPU 7 counts as the first
        # gang's: planned around it)
        big = await c.submit("big", mig_profile="7g.80gb", command=SLEEP)
        assert big.message == "waiting for GPU 6 of node-a to switch to MIG mode (asked 0 s ago), holding no GPUs"
        assert len(c.switches("node-a")) == 2
        assert (await c.job(mig.id)).message.startswith("waiting for GPU 7 of node-a")

        c.host("node-a").reset_gpu(7)  # the operator's `nvidia-smi -r -i 7`
        running = await c.until(mig.id, lambda j: j.state == RUNNING, "the MIG job RUNNING after the reset")
        assert list(running.allocations[0].gpus) == [7]
        g7 = await c.gpu("node-a", 7)
        assert (g7.mig_mode, g7.mig_mode_pending, g7.mig_switching) == ("enabled", "", False)
        assert (await c.job(big.id)).state == PENDING and (await c.gpu("node-a", 6)).mig_switching
        c.host("node-a").reset_gpu(6)
        running = await c.until(big.id, lambda j: j.state == RUNNING, "the 7g job RUNNING after its reset")
        assert list(running.allocations[0].gpus) == [6] and len(c.switches("node-a")) == 2


@pytestmark_e2e
@pytest.mark.slow
async def test_an_agent_error_ends_the_switch_with_the_backoff_and_the_reason(db_url, tmp_path):
    async with Cluster(db_url, tmp_path, {"node-a": ("7", True)}, mig_switch_backoff_s=1.5) as c:
        # An administrator's MIG instance, made after the agent registered: the scheduler does not know it
        c.host("node-a").add_mig_instance(7, "1g.10gb", 0)
        whole = await c.submit("whole", gpus=8, command=SLEEP)
        job = await c.until(whole.id, lambda j: "could not switch out of MIG mode" in j.message, "the failure")
        assert job.state == PENDING and "did not create" in job.message and "--mig-switch-backoff" in job.message
        g7 = await c.gpu("node-a", 7)
        assert (g7.mig_mode, g7.mig_switching) == ("enabled", False) and "did not create" in g7.mig_switch_error
        events = run_sql(db_url, "SELECT gpu, severity, reason FROM node_events WHERE kind = 'mig_switch_failed'")
        assert events and events[0][:2] == (7, "DEGRADED") and "not asked again for 1.5s" in events[0][2]
        assert not [call for call in c.host("node-a").calls if call[0] == "set_mig_mode"]  # never switched
        assert len(c.switches("node-a")) == 1
        # after the backoff it is asked once more (and fails the same way)
        await eventually(lambda: asyncio.sleep(0, len(c.switches("node-a")) >= 2), what="the second ask", timeout=10)
        (_, first_at), (_, second_at) = c.switches("node-a")[:2]
        assert second_at - first_at >= 1.5
        assert (await c.job(whole.id)).state == PENDING


@pytestmark_e2e
@pytest.mark.slow
async def test_an_agent_without_mig_manage_is_never_asked(db_url, tmp_path):
    async with Cluster(db_url, tmp_path, {"node-a": ("none", False), "node-b": ("none", True)}) as c:
        await c.agents["node-b"].stop()  # only node-a for now (node-b DRAINED: its agent stopped)
        await eventually(lambda: asyncio.sleep(0, c.tasks["node-b"].done()), what="node-b stopped")
        mig = await c.submit("mig", mig_profile="1g.10gb")
        job = await c.until(mig.id, lambda j: "no GPU is in MIG mode" in j.message, "the MIG job's reason")
        await next_cycle(c.scheduler.service)  # a pass after the one that gave the reason: still no switch asked
        assert (await c.job(mig.id)).state == PENDING and c.switches("node-a") == []
        shown = {n["name"]: n["mig_manage"] for n in await c.cli_json("nodes", "--json")}
        assert shown == {"node-a": False, "node-b": True}
        # node-b comes back: its GPU is switched, never node-a's
        await c.start_agent("node-b")
        running = await c.until(mig.id, lambda j: j.state in (RUNNING, SUCCEEDED), "the MIG job placed")
        assert (running.allocations[0].node, list(running.allocations[0].gpus)) == ("node-b", [7])
        assert c.switches("node-a") == [] and len(c.switches("node-b")) == 1
        assert not [call for call in c.host("node-a").calls if call[0] == "set_mig_mode"]
        assert job.state == PENDING


# ---- phalanx cluster up --mig-manage -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cluster_up_mig_manage_switches_a_gpu_for_a_mig_job(tmp_path, monkeypatch):
    from phalanx.cli.cluster import LocalCluster
    from phalanx.client import Client, JobState

    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    with LocalCluster(
        nodes=1, state_dir=tmp_path / "c", port=0, log=lambda m: None, mig_gpus=0, mig_manage=True, ready_timeout=90
    ) as cluster:
        with Client(cluster.address, timeout=10) as client:
            (n,) = client.nodes()
            assert n.mig_manage and n.mig_gpus == []
            job = client.submit("mig", 1, 1, [sys.executable, "-c", "pass"], mig_profile="1g.10gb")
            done = client.wait(job.id, timeout=60)
            assert done.state is JobState.SUCCEEDED, done
            import sqlite3  # a finished job shows no allocations: where it ran is in the ledger's history

            with sqlite3.connect(tmp_path / "c" / "phalanx.db") as conn:
                ran = conn.execute(
                    "SELECT DISTINCT n.name, a.gpu_index FROM allocations a JOIN nodes n "
                    "ON n.id = a.node_id WHERE a.job_id = ? AND a.kind = 'mig'",
                    (job.id,),
                ).fetchall()
            assert not done.allocations and ran == [("node-01", 7)]
            (n,) = client.nodes()
            assert n.mig_gpus == [7]
        info = json.loads((tmp_path / "c" / "cluster.json").read_text())
        assert info["mig_manage"] is True
        log = (tmp_path / "c" / "logs" / "agent-node-01.log").read_text()
        assert "mig_mode_switch" in log


# ---- the migration -----------------------------------------------------------------------------------------------


def test_migration_0011_adds_the_switch_columns_keeps_the_gpus_and_downgrades(empty_db_url):
    from alembic import command
    from sqlalchemy import text

    from db.engine import make_engine
    from db.migrate import alembic_config, current, upgrade

    url = empty_db_url
    upgrade(url, "0010")
    engine = make_engine(url)
    with engine.begin() as conn:  # a node with a GPU, as a 0010 scheduler wrote them
        conn.execute(
            text(
                "INSERT INTO nodes (id, name, state, message, gpus, gpu_model, profile, address, topology, fabric_path, "
                "agent_instance, registered_at, last_heartbeat, revision, acked_revision) VALUES (1, 'node-0', 'READY', "
                "'', 1, :m, 'x', '127.0.0.1', '{}', '[]', 'x', 1, 1, 0, 0)"
            ),
            {"m": H100[0]},
        )
        conn.execute(
            text(
                'INSERT INTO gpus (id, node_id, "index", uuid, name, memory_mib, mig_mode) '
                "VALUES (1, 1, 0, 'GPU-0', :m, 81559, 'ENABLED')"
            ),
            {"m": H100[0]},
        )
    engine.dispose()
    upgrade(url, "0011")
    rows = run_sql(
        url,
        "SELECT n.mig_manage, g.mig_mode, g.mig_mode_pending, g.mig_switch_to, g.mig_switch_at, "
        "g.mig_switch_revision, g.mig_switch_error, g.mig_retry_after, g.mig_switched_at "
        "FROM gpus g JOIN nodes n ON n.id = g.node_id",
    )
    assert [tuple(r) for r in rows] == [(False, "ENABLED", "", "", 0.0, 0, "", 0.0, 0.0)]
    upgrade(url)  # a scheduler runs at the head revision
    state = SchedulerState()  # the scheduler reads it: no --mig-manage, no switch
    from services.scheduler import ledger

    engine = make_engine(url)
    with engine.connect() as conn:
        ledger.load_state(conn, state, lambda name: ())
    engine.dispose()
    assert (state.nodes["node-0"].mig_manage, state.nodes["node-0"].mig_switches) == (False, {})
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0010")
            conn.commit()
    finally:
        engine.dispose()
    assert current(url) == "0010"
    assert run_sql(url, 'SELECT "index", mig_mode FROM gpus') == [(0, "ENABLED")]  # the GPU row survived
    upgrade(url)
