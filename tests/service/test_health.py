"""Node and GPU health: the classifier, the NVML source against a fake pynvml, and end to end with the real
scheduler (SQLite and PostgreSQL) and an in-process NodeAgent whose simulated source gets the faults."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
import time

import grpc
import pytest
from helpers.lite_cluster import run_sql
from helpers.waits import eventually, next_cycle

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.health import (
    DEGRADED,
    FATAL,
    HEALTHY,
    Fault,
    HealthMonitor,
    NvmlHealthSource,
    SimulatedHealthSource,
    classify,
    classify_fault,
)
from services.node_agent.simulated import nvml_for_topology, simulated_topology
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

RUNNING, PENDING = common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_PENDING

# The services' logs go to a buffer of the test's own (an earlier test may have left structlog writing to a closed
# capture file).
pytestmark = pytest.mark.usefixtures("service_logs")


# ---- the classifier ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault, severity, text",
    [
        (Fault(0, "xid", 79), FATAL, "XID 79: GPU has fallen off the bus"),
        (Fault(0, "xid", 48), FATAL, "XID 48: double-bit"),
        (Fault(0, "xid", 64), FATAL, "XID 64"),
        (Fault(0, "xid", 74), FATAL, "NVLink error"),
        (Fault(0, "xid", 95), FATAL, "uncontained"),
        (Fault(0, "xid", 119), FATAL, "GSP"),
        (Fault(0, "xid", 92), DEGRADED, "single-bit"),
        (Fault(0, "xid", 62), DEGRADED, "micro-controller"),
        (Fault(0, "xid", 13), "INFO", "application"),
        (Fault(0, "xid", 43), "INFO", "application"),
        (Fault(0, "xid", 9999), DEGRADED, "unclassified XID"),
        (Fault(0, "ecc_dbe", 1), FATAL, "1 uncorrectable"),
        (Fault(0, "ecc_dbe", 0), HEALTHY, ""),
        (Fault(0, "ecc_sbe", 100), HEALTHY, ""),
        (Fault(0, "ecc_sbe", 101), DEGRADED, "101 corrected"),
        (Fault(0, "gpu_lost"), FATAL, "NVML_ERROR_GPU_IS_LOST"),
        (Fault(0, "nvlink_down", 5), DEGRADED, "NVLink 5 is down"),
        (Fault(0, "throttle", 0x40), DEGRADED, "HW thermal slowdown"),
        (Fault(0, "throttle", 0x1), HEALTHY, ""),  # GPU idle: not a fault
    ],
)
def test_fault_table(fault, severity, text):
    sev, reason = classify_fault(fault)
    assert sev == severity and text in reason


def test_node_health_from_faults():
    h = classify([Fault(3, "xid", 79), Fault(3, "throttle", 0x40), Fault(1, "xid", 13)], 8)
    assert h.state == DEGRADED and h.fatal_gpus() == {3}  # seven GPUs left: the node still takes work
    assert h.gpus[3].reasons[0].startswith("XID 79") and 1 not in h.gpus  # application XID: informational
    assert h.reason.startswith("GPU 3: XID 79: GPU has fallen off the bus")
    assert classify([], 8).state == HEALTHY and classify([], 8).reason == ""
    assert classify([Fault(i, "gpu_lost") for i in range(2)], 2).state == FATAL  # every GPU fatal
    assert classify([Fault(-1, "nvml", detail="driver gone")], 8).state == FATAL  # node-level
    assert classify([Fault(0, "throttle", 0x8)], 8).state == DEGRADED


def test_monitor_reports_new_events_once_and_recoveries():
    src = SimulatedHealthSource()
    mon = HealthMonitor(src, 8)
    assert mon.check(now=1.0) == (mon.health, []) and mon.health.state == HEALTHY
    src.inject(Fault(3, "xid", 79))
    health, events = mon.check(now=2.0)
    assert health.fatal_gpus() == {3} and [(e.gpu, e.severity, e.code) for e in events] == [(3, FATAL, 79)]
    assert mon.check(now=3.0)[1] == []  # still there: no new event
    src.clear()
    health, events = mon.check(now=4.0)
    assert health.state == HEALTHY and [(e.gpu, e.kind) for e in events] == [(3, "recovered")]


def test_simulated_source_file(tmp_path):
    path = tmp_path / "health.json"
    src = SimulatedHealthSource(path)
    assert src.poll() == []
    path.write_text(json.dumps([{"gpu": 3, "xid": 79}, {"gpu": 1, "kind": "throttle", "code": 64}]))
    assert src.poll() == [Fault(3, "xid", 79), Fault(1, "throttle", 64)]
    path.write_text("[{not json")
    assert src.poll() == []


# ---- the NVML source through the real pynvml over the simulated NVML library ----------------------------------


def simulated_nvml(profile: str = "dgx-h100"):
    from phalanx.profiles import load_profile
    from phalanx.simhost.nvml import SimulatedHost, bind

    prof = load_profile(profile)
    host = SimulatedHost.from_dump(prof.dump, gpu_model=prof.gpu_model, memory_mib=prof.memory_mib)
    return host, bind(host)


def test_nvml_source_xid_ecc_throttle_lost_nvlink():
    host, nv = simulated_nvml()
    g3 = host.gpus[3]
    g3.links[17] = (0, *g3.links[17][1:])  # a link that was never up: not watched
    src = NvmlHealthSource(nv, event_timeout_ms=20)
    mon = HealthMonitor(src, 8)
    try:
        assert mon.check()[0].state == HEALTHY
        host.inject_xid(2, 79)  # an XID event, through nvmlEventSetWait
        health = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            health, _ = mon.check()
            if health.fatal_gpus():
                break
            time.sleep(0.02)
        assert health.fatal_gpus() == {2} and "XID 79" in health.gpus[2].reasons[0]
        host.gpus[0].ecc[(1, 0)] = 2  # double-bit (uncorrected, volatile) ECC -> fatal
        host.gpus[1].clocks_event_reasons = 0x40  # HW thermal slowdown -> degraded
        g3.links[1] = (0, *g3.links[1][1:])  # an NVLink that was up goes down -> degraded
        g3.links[17] = (1, *g3.links[17][1:])  # one that was never up: not watched
        health, events = mon.check()
        assert health.fatal_gpus() == {0, 2}
        assert health.gpus[1].state == DEGRADED and "HW thermal slowdown" in health.gpus[1].reasons[0]
        assert health.gpus[3].state == DEGRADED and health.gpus[3].reasons == ["NVLink 1 is down"]
        assert {(e.gpu, e.kind) for e in events} == {(0, "ecc_dbe"), (1, "throttle"), (3, "nvlink_down")}
        host.gpus[1].lost = True  # NVML_ERROR_GPU_IS_LOST -> fatal
        health, _ = mon.check()
        assert health.fatal_gpus() == {0, 1, 2} and "GPU is lost" in health.gpus[1].reasons[0]
        assert health.state == DEGRADED  # GPU 3 still works
        host.gpus[1].lost = False
        host.gpus[0].ecc[(1, 0)] = 0
        health, events = mon.check()  # polled conditions clear; the XID stays
        assert health.fatal_gpus() == {2} and any(e.kind == "recovered" and e.gpu == 0 for e in events)
    finally:
        mon.close()
    assert host.errors == []
    assert not getattr(host, "_sets", {})  # the event set was freed


def test_nvml_source_that_cannot_start_makes_the_node_fatal():
    host, nv = simulated_nvml()
    host.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    src = NvmlHealthSource(nv)
    health = classify(src.poll(), 8)
    assert health.state == FATAL and "NVML failed" in health.reason and "Driver Not Loaded" in health.reason


# ---- end to end: scheduler + NodeAgent -------------------------------------------------------------------------

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


class HealthCluster:
    """An in-process scheduler, one in-process NodeAgent (simulated DGX H100, 8 GPUs) and a scheduler stub."""

    def __init__(self, db_url: str, tmp_path, heartbeat: float = 0.2) -> None:
        self.db_url = db_url
        self.settings = SchedulerSettings(
            db_url=db_url,
            listen="127.0.0.1:0",
            fabric=default_fabric(["node-a"]),
            heartbeat_interval=heartbeat,
            lease_timeout=5.0,
            poll_interval=0.2,
        )
        self.source = SimulatedHealthSource()
        self.tmp_path = tmp_path
        self.heartbeat = heartbeat

    async def __aenter__(self):
        self.scheduler = await serve(self.settings)
        # The health each heartbeat carried, in the order the scheduler received them (None: none reported).
        self.beats: list[common_pb2.NodeHealth | None] = []
        intake, received = self.scheduler.service.intake, self.scheduler.service.intake.heartbeat

        def recording(name, health=None, events=(), **kw):
            self.beats.append(None if health is None else common_pb2.NodeHealth.FromString(health.SerializeToString()))
            return received(name, health, events, **kw)

        intake.heartbeat = recording
        self.agent = NodeAgent(
            AgentConfig(
                scheduler=self.scheduler.address,
                node_name="node-a",
                topology=simulated_topology("node-a", "dgx-h100"),
                state_dir=self.tmp_path / "agent",
                kill_grace_s=0.5,
                backoff_initial_s=0.05,
                backoff_cap_s=0.3,
                poll_interval_s=0.02,
                rpc_timeout_s=2.0,
                flush_timeout_s=2.0,
                health_source=self.source,
                simulated_nvml=nvml_for_topology,
            )
        )
        self.task = asyncio.create_task(self.agent.run())
        self.channel = grpc.aio.insecure_channel(self.scheduler.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        await eventually(self.node, what="node registered")
        return self

    async def __aexit__(self, *exc):
        await self.agent.stop()
        await self.channel.close()
        await self.scheduler.stop()

    async def heartbeats(self, more: int) -> None:
        """Wait until the scheduler has received `more` heartbeats from now on and run a cycle after them (what they
        reported is applied: a test asserting that nothing changed asserts it then)."""
        target = len(self.beats) + more
        await eventually(lambda: _at_least(self.beats, target), what=f"{more} more heartbeats")
        await next_cycle(self.scheduler.service)

    async def node(self, name: str = "node-a") -> common_pb2.Node | None:
        resp = await self.stub.ListNodes(scheduler_pb2.ListNodesRequest())
        return next((n for n in resp.nodes if n.name == name), None)

    async def submit(self, name: str, gpus: int) -> common_pb2.Job:
        spec = common_pb2.JobSpec(name=name, replicas=1, gpus_per_replica=gpus, command=SLEEP)
        return await self.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))

    async def job(self, job_id: str) -> common_pb2.Job:
        return await self.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))

    async def wait_job(self, job_id: str, state: int) -> common_pb2.Job:
        async def check():
            job = await self.job(job_id)
            return job if job.state == state else None

        return await eventually(check, what=f"job {job_id} {common_pb2.JobState.Name(state)}")

    async def cli_nodes_json(self) -> list[dict]:
        from phalanx.cli.main import main

        def run():
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main(["--scheduler", self.scheduler.address, "--timeout", "5", "nodes", "--json"])
            assert code == 0
            return json.loads(out.getvalue())

        return await asyncio.to_thread(run)  # the scheduler runs on this event loop


@pytest.mark.slow
async def test_fatal_gpu_leaves_placement_within_a_heartbeat_degraded_stays_and_recovery(db_url, tmp_path):
    async with HealthCluster(db_url, tmp_path) as c:
        # A thermally throttled GPU is DEGRADED: shown, still schedulable.
        c.source.inject(Fault(1, "throttle", 0x40))
        node = await eventually(lambda: _health_is(c, common_pb2.HEALTH_STATE_DEGRADED), what="DEGRADED")
        assert node.free_gpus == 8 and [g.index for g in node.health.gpus] == [1]

        # XID 79 on GPU 3: FATAL for that GPU with the next heartbeat (the first the agent checks after the fault:
        # the one it may have checked just before, in flight, cannot carry it).
        mark = len(c.beats)
        c.source.inject(Fault(3, "xid", 79))
        node = await eventually(lambda: _fatal_gpus(c, [3]), what="GPU 3 FATAL", interval=0.02)
        carried = [i for i, h in enumerate(c.beats[mark:]) if h is not None and _gpu_state(h, 3) == FATAL_STATE]
        assert carried and carried[0] <= 1, carried
        assert node.state == common_pb2.NODE_STATE_READY and node.free_gpus == 7
        assert node.health.state == common_pb2.HEALTH_STATE_DEGRADED  # 7 GPUs still good
        assert "GPU 3: XID 79: GPU has fallen off the bus" in node.health.reason

        (shown,) = await c.cli_nodes_json()
        assert shown["health"] == "DEGRADED" and shown["unhealthy_gpus"]["3"]["state"] == "FATAL"
        assert "GPU 3: XID 79" in shown["health_reason"] and shown["unhealthy_gpus"]["1"]["state"] == "DEGRADED"

        # A 7-GPU job fits, not on GPU 3 (the degraded GPU 1 is used).
        seven = await c.submit("seven", 7)
        job = await c.wait_job(seven.id, RUNNING)
        (alloc,) = job.allocations
        assert 3 not in alloc.gpus and 1 in alloc.gpus and len(alloc.gpus) == 7
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=seven.id))
        await eventually(lambda: _free(c, 7), what="GPUs released")  # GPU 3 stays out after the release

        # An 8-GPU job cannot start on this node.
        eight = await c.submit("eight", 8)
        await c.heartbeats(2)  # the unchanged health reported again changes nothing
        job = await c.job(eight.id)
        assert job.state == PENDING and "waiting" in job.message

        # The event is persisted.
        rows = run_sql(db_url, "SELECT gpu, severity, kind, code FROM node_events ORDER BY id")
        assert (3, "FATAL", "xid", 79) in [tuple(r) for r in rows] and (1, "DEGRADED", "throttle", 64) in rows
        assert run_sql(db_url, "SELECT health FROM nodes") == [("DEGRADED",)]

        # The fault clears (GPU reset): the GPU comes back and the 8-GPU job starts.
        c.source.clear()
        await c.wait_job(eight.id, RUNNING)
        node = await c.node()
        assert node.health.state == common_pb2.HEALTH_STATE_HEALTHY and not node.health.gpus


@pytest.mark.slow
async def test_fatal_node_is_unschedulable_and_healthy_beats_write_nothing(db_url, tmp_path):
    async with HealthCluster(db_url, tmp_path) as c:
        await c.heartbeats(3)
        assert run_sql(db_url, "SELECT count(*) FROM node_events") == [(0,)]
        c.source.inject(Fault(-1, "nvml", detail="driver unloaded"))
        node = await eventually(lambda: _health_is(c, common_pb2.HEALTH_STATE_FATAL), what="node FATAL")
        assert node.free_gpus == 0 and "NVML failed: driver unloaded" in node.health.reason
        one = await c.submit("one", 1)
        await c.heartbeats(2)
        assert (await c.job(one.id)).state == PENDING
        c.source.clear()
        await c.wait_job(one.id, RUNNING)


@pytest.mark.slow
async def test_health_survives_a_scheduler_reload(db_url, tmp_path):
    """The health is in the ledger: a view reloaded from it (a restart, another replica) keeps GPU 3 out."""
    async with HealthCluster(db_url, tmp_path) as c:
        c.source.inject(Fault(3, "ecc_dbe", 2))
        await eventually(lambda: _fatal_gpus(c, [3]), what="GPU 3 FATAL")
        c.scheduler.service._resync = True  # the next cycle reloads its view from the ledger
        c.scheduler.service._wake.set()
        eight = await c.submit("eight", 8)
        await c.heartbeats(2)
        assert (await c.job(eight.id)).state == PENDING
        assert 3 not in c.scheduler.service.state.capacity.nodes["node-a"].free


async def test_lost_node_shows_why(db_url, capsys):
    settings = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(["n1"]),
        heartbeat_interval=0.2,
        lease_timeout=1.0,
        poll_interval=0.2,
    )
    scheduler = await serve(settings)
    agent = LiteAgent(scheduler.address, "n1")
    try:
        await agent.start()
        await agent.stop()  # the agent dies: no more heartbeats
        channel = grpc.aio.insecure_channel(scheduler.address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        async def lost():
            nodes = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
            return nodes[0] if nodes and nodes[0].state == common_pb2.NODE_STATE_LOST else None

        node = await eventually(lost, what="node LOST", timeout=10)
        assert "no heartbeat for" in node.message and "lease 1s" in node.message
        from phalanx.cli.render import nodes_table
        from phalanx.client import Node

        table = nodes_table([Node.from_proto(node)])
        assert "LOST" in table and "no heartbeat for" in table
        await channel.close()
    finally:
        await scheduler.stop()


FATAL_STATE = common_pb2.HEALTH_STATE_FATAL


def _gpu_state(health: common_pb2.NodeHealth, gpu: int) -> int:
    return next((g.state for g in health.gpus if g.index == gpu), common_pb2.HEALTH_STATE_HEALTHY)


async def _at_least(items: list, n: int) -> bool:
    return len(items) >= n


async def _health_is(c: HealthCluster, state: int):
    node = await c.node()
    return node if node is not None and node.health.state == state else None


async def _fatal_gpus(c: HealthCluster, gpus: list[int]):
    node = await c.node()
    fatal = sorted(g.index for g in node.health.gpus if g.state == common_pb2.HEALTH_STATE_FATAL) if node else []
    return node if fatal == gpus else None


async def _free(c: HealthCluster, free: int):
    node = await c.node()
    return node if node is not None and node.free_gpus == free else None


@pytest.mark.slow
async def test_sigterm_drain_reports_and_the_node_takes_no_work(db_url, tmp_path):
    """request_stop() (what SIGTERM calls in phalanx-agent): the node becomes DRAINED at once, its ranks are killed
    and reported (the gang is requeued), and the agent returns; registering again makes the node READY."""
    async with HealthCluster(db_url, tmp_path) as c:
        job = await c.submit("victim", 2)
        await c.wait_job(job.id, RUNNING)
        await eventually(lambda: _ranks_running(c, job.id), what="ranks running")
        await asyncio.wait_for(c.agent.stop(), 20)
        node = await c.node()
        assert node.state == common_pb2.NODE_STATE_DRAINED and "draining" in node.message
        assert node.free_gpus == 0
        requeued = await c.wait_job(job.id, PENDING)
        assert requeued.attempt == 1

        async def killed():  # the agent's report of its killed ranks may land just after the requeue
            return ("KILLED",) in run_sql(db_url, "SELECT state FROM ranks WHERE job_id = :j", j=job.id)

        await eventually(killed, what="the killed ranks reported")
        # A new agent process for the node: READY again, and the requeued gang runs.
        c.agent = NodeAgent(
            AgentConfig(
                scheduler=c.scheduler.address,
                node_name="node-a",
                topology=simulated_topology("node-a", "dgx-h100"),
                state_dir=tmp_path / "agent",
                kill_grace_s=0.5,
                backoff_initial_s=0.05,
                poll_interval_s=0.02,
                rpc_timeout_s=2.0,
                flush_timeout_s=2.0,
                health_source=c.source,
                simulated_nvml=nvml_for_topology,
            )
        )
        c.task = asyncio.create_task(c.agent.run())
        await c.wait_job(job.id, RUNNING)
        assert (await c.node()).state == common_pb2.NODE_STATE_READY


async def _ranks_running(c: HealthCluster, job_id: str):
    rows = run_sql(c.db_url, "SELECT count(*) FROM ranks WHERE job_id = :j AND state = 'RUNNING'", j=job_id)
    return rows[0][0] == 2


# ---- phalanx-agent configuration: flags > environment > file > defaults --------------------------------------


def test_agent_config_file_env_and_flags(tmp_path, monkeypatch):
    from services.node_agent.main import parse_args

    for var in (
        "PHALANX_SCHEDULER",
        "PHALANX_NODE_NAME",
        "PHALANX_AGENT_ADDRESS",
        "PHALANX_STATE_DIR",
        "PHALANX_AGENT_CONFIG",
        "PHALANX_ECC_SBE_THRESHOLD",
        "PHALANX_FABRIC_CLIQUE",
    ):
        monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        "scheduler: from-file:1\nnode_name: file-node\nkill-grace: 9\nhealth: false\n"
        "simulate: dgx-a100\necc-sbe-threshold: 7\n"
    )
    args = parse_args(["--config", str(cfg)])
    assert (
        args.scheduler,
        args.node_name,
        args.kill_grace,
        args.health,
        args.simulate,
        args.ecc_sbe_threshold,
        args.address,
    ) == ("from-file:1", "file-node", 9, False, "dgx-a100", 7, None)  # None: found from the route at start
    monkeypatch.setenv("PHALANX_SCHEDULER", "from-env:2")
    monkeypatch.setenv("PHALANX_AGENT_CONFIG", str(cfg))
    args = parse_args(["--kill-grace", "3", "--health", "--simulate-from", "x.txt"])
    assert (args.scheduler, args.kill_grace, args.health, args.simulate, args.simulate_from) == (
        "from-env:2",
        3.0,
        True,
        None,
        "x.txt",
    )
    assert parse_args(["--scheduler", "flag:3"]).scheduler == "flag:3"
    monkeypatch.delenv("PHALANX_AGENT_CONFIG")
    assert parse_args([]).kill_grace == 5.0 and parse_args([]).health is True
    cfg.write_text("no-such-key: 1\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)])
