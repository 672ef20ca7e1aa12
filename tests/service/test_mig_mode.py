"""Each GPU's MIG mode, foreign MIG instances and host-side launch failures.

The rule: a GPU in MIG mode (the agent reports MIG_MODE_ENABLED) serves only MIG requests; a GPU out of it (DISABLED
or UNSUPPORTED, which is what agents from before MIG mode was reported send) serves only whole-GPU and gpu_milli
requests. MIG instances that Phalanx's agent did not make (managed false) keep their slices out of placement. A
rank whose host could not set it up (a retryable FAILED_TO_START) requeues the gang with the failure backoff and
strikes the node, which the gang then avoids while it fits elsewhere.

Core tests need no services; the end-to-end ones run the real scheduler in-process on SQLite and on PostgreSQL with
protocol-level LiteAgents (phalanx.testing.lite_agent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually
from sqlalchemy import text

from db.engine import make_engine
from phalanx.api.v1 import agent_pb2, common_pb2, scheduler_pb2
from phalanx.cli.cluster import LocalCluster
from phalanx.cli.main import main as cli_main
from phalanx.core.capacity import CapacityError, ClusterCapacity, shape_key
from phalanx.core.fabric import default_fabric
from phalanx.core.mig import MEDIA_BIT
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import Unplaceable, place_gang
from phalanx.core.quota import FlavorQuota, QueueSpec, QuotaBook, cluster_totals, mig_compute_slices
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.ledger import foreign_mask
from services.scheduler.planning import quota_totals
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import NodeRecord, SchedulerState

H100 = ("NVIDIA H100 80GB HBM3", 81559)
A100_40 = ("NVIDIA A100-SXM4-40GB", 40960)
L40S = ("NVIDIA L40S", 46068)
PENDING, RUNNING, FAILED = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_FAILED


def node(name="a", gpus=8, mig=(), foreign=None, model=H100, free=None, path=("leaf0", "spine0")) -> NodeCapacity:
    return NodeCapacity(
        name,
        gpus,
        set(range(gpus)) if free is None else set(free),
        True,
        path,
        None,
        *model,
        mig_gpus=frozenset(mig),
        foreign=dict(foreign or {}),
    )


def request(kind: str, arg, replicas: int = 1, **kw) -> GangRequest:
    if kind == "whole":
        return GangRequest("j", replicas, arg, **kw)
    if kind == "milli":
        return GangRequest("j", replicas, 1, gpu_milli=arg, **kw)
    return GangRequest("j", replicas, 1, mig_profile=arg, **kw)


def slices(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


# ---- mode separation in the core --------------------------------------------------------------------------------

# (GPUs in MIG mode, request, replicas, GPUs the replicas may use (None: not placed), words in the reason)
SEPARATION = [
    ({7}, ("whole", 8), 1, None, "1 GPU(s) in MIG mode take only MIG instances"),
    ({7}, ("whole", 7), 1, set(range(7)), ""),
    ({7}, ("whole", 1), 1, set(range(7)), ""),
    ({7}, ("milli", 500), 1, set(range(7)), ""),
    ({7}, ("milli", 500), 2, set(range(7)), ""),
    ({7}, ("mig", "3g.40gb"), 1, {7}, "fragmentation"),
    ({7}, ("mig", "3g.40gb"), 2, {7}, ""),  # two 3g fill the one GPU in MIG mode
    ({7}, ("mig", "3g.40gb"), 3, None, "2 of 3 replicas fit"),
    ({6, 7}, ("mig", "7g.80gb"), 2, {6, 7}, ""),
    ({6, 7}, ("mig", "7g.80gb"), 3, None, "the 2 H100-80GB GPU(s) in MIG mode"),
    ((), ("mig", "1g.10gb"), 1, None, "no GPU is in MIG mode"),
    ((), ("whole", 8), 1, set(range(8)), ""),
    (set(range(8)), ("whole", 1), 1, None, "8 GPU(s) in MIG mode take only MIG instances"),
    (set(range(8)), ("milli", 250), 1, None, "GPU(s) in MIG mode take only MIG instances"),
    (set(range(8)), ("mig", "1g.10gb"), 8, set(range(8)), ""),
]


@pytest.mark.parametrize("mig_gpus, req, replicas, allowed, words", SEPARATION)
def test_mig_mode_separates_mig_from_whole_gpus_and_shares(mig_gpus, req, replicas, allowed, words):
    cap = ClusterCapacity([node(mig=mig_gpus)])
    got = place_gang(cap, request(*req, replicas=replicas))
    if allowed is None:
        assert isinstance(got, Unplaceable), got
    else:
        assert isinstance(got, Placement), got
        used = {g for r in got.replicas for g in r.gpus}
        assert used <= allowed, (used, allowed)
        cap.reserve(got)  # the capacity view agrees
    assert words in got.reason


def test_a_mig_request_says_no_gpu_is_in_mig_mode_even_on_mig_capable_gpus():
    cap = ClusterCapacity([node("a"), node("b", model=A100_40)])
    got = place_gang(cap, request("mig", "3g.40gb"))
    assert isinstance(got, Unplaceable)
    assert "no GPU is in MIG mode" in got.reason and "H100-80GB" in got.reason
    # GPUs in MIG mode of a family without that profile do not help, and the reason says which GPUs it tried
    cap = ClusterCapacity([node("a"), node("b", model=A100_40, mig={0})])
    assert "no GPU is in MIG mode" in place_gang(cap, request("mig", "3g.40gb")).reason
    assert isinstance(place_gang(cap, request("mig", "3g.20gb")), Placement)
    # a family without MIG keeps its own reason
    assert (
        "no node here has MIG-capable GPUs"
        in place_gang(ClusterCapacity([node(model=L40S)]), request("mig", "1g.10gb")).reason
    )


@pytest.mark.parametrize(
    "mig_gpus, rep, words",
    [
        ({7}, ReplicaPlacement(0, "a", (0,), mig_profile="1g.10gb", mig_start=0, mig_size=1), "not in MIG mode"),
        ({7}, ReplicaPlacement(0, "a", (7,), gpu_milli=250), "no 250/1000 share free"),
        ({7}, ReplicaPlacement(0, "a", (6, 7)), "not free"),
        ((), ReplicaPlacement(0, "a", (3,), mig_profile="3g.40gb", mig_start=4, mig_size=4), "not in MIG mode"),
    ],
)
def test_reserve_refuses_a_replica_on_a_gpu_of_the_other_mode_and_changes_nothing(mig_gpus, rep, words):
    cap = ClusterCapacity([node(mig=mig_gpus)])
    before = (set(cap.nodes["a"].free), dict(cap.nodes["a"].mig), dict(cap.nodes["a"].milli))
    with pytest.raises(CapacityError, match=words):
        cap.reserve(Placement("x", (rep,), "node", 1, 0.0, ""))
    assert (cap.nodes["a"].free, cap.nodes["a"].mig, cap.nodes["a"].milli) == before


def test_a_gpu_in_mig_mode_is_never_free_and_stays_in_mig_mode_after_its_instances():
    cap = ClusterCapacity([node(gpus=2, mig={1})])
    assert cap.nodes["a"].free == {0} and cap.nodes["a"].mig == {1: 0}
    assert cap.free_gpus() == 1 and cap.most_free_on_a_node() == 1
    p = place_gang(cap, request("mig", "4g.40gb"))
    cap.reserve(p)
    assert cap.nodes["a"].mig == {1: slices(0, 4)}
    cap.release_placement(p)
    assert cap.nodes["a"].free == {0} and cap.nodes["a"].mig == {1: 0}
    # copies (the backfill planner's, the preemption search's) keep the mode
    copy = cap.copy()
    assert copy.nodes["a"].mig_gpus == {1} and copy.nodes["a"].free == {0}
    empty = dataclasses.replace(cap.nodes["a"], free=set(range(2)), mig={}, milli={})  # plan_reservation's "empty"
    assert empty.free == {0} and empty.mig == {1: 0}


def test_only_gpus_in_mig_mode_offer_mig_capacity():
    # a MIG instance placed before its GPU's mode was known (mode DISABLED now) offers nothing more
    n = node(gpus=2, mig=(), free={1}, model=H100)
    n.mig[0] = slices(4, 4)
    assert shape_key(n)[4] == ()
    cap = ClusterCapacity([n])
    assert isinstance(place_gang(cap, request("mig", "3g.40gb")), Unplaceable)
    cap.release_placement(
        Placement(
            "old", (ReplicaPlacement(0, "a", (0,), mig_profile="3g.40gb", mig_start=4, mig_size=4),), "node", 1, 0.0, ""
        )
    )
    assert cap.nodes["a"].free == {0, 1} and not cap.nodes["a"].mig  # back to a whole GPU


# ---- foreign instances ------------------------------------------------------------------------------------------


def test_foreign_instances_keep_their_slices_and_their_gpu_out_of_placement():
    cap = ClusterCapacity([node(gpus=4, mig={2, 3}, foreign={3: slices(4, 4), 0: slices(0, 1)})])
    n = cap.nodes["a"]
    assert n.free == {1}  # GPU 0 holds a foreign instance outside MIG mode: the whole GPU is someone else's
    assert n.mig == {0: 0xFF, 2: 0, 3: slices(4, 4)}
    assert isinstance(place_gang(cap, request("whole", 2)), Unplaceable)
    # a 3g next to the foreign 3g (slices 0-3 of GPU 3): the only 3g placement on GPU 3 does not overlap it
    three = place_gang(cap, request("mig", "3g.40gb"))
    assert (three.replicas[0].gpus, three.replicas[0].mig_start) == ((3,), 0)
    cap.reserve(three)
    assert n.mig[3] == 0xFF
    four = place_gang(cap, request("mig", "7g.80gb"))
    assert four.replicas[0].gpus == (2,)
    cap.reserve(four)
    assert isinstance(place_gang(cap, request("mig", "1g.10gb")), Unplaceable)
    with pytest.raises(CapacityError):  # the foreign slices cannot be reserved
        cap.reserve(
            Placement(
                "x",
                (ReplicaPlacement(0, "a", (3,), mig_profile="1g.10gb", mig_start=5, mig_size=1),),
                "node",
                1,
                0.0,
                "",
            )
        )
    cap.release_placement(three)
    cap.release_placement(four)
    assert n.mig == {0: 0xFF, 2: 0, 3: slices(4, 4)} and n.free == {1}  # foreign slices stay used
    cap.release("a", [0])  # a whole-GPU release of the foreign GPU does not free it
    assert n.free == {1}


def test_foreign_mask_of_registered_instances():
    assert foreign_mask([]) == 0
    assert foreign_mask([{"profile": "3g.40gb", "start": 4, "size": 4, "managed": False}]) == slices(4, 4)
    # managed instances are Phalanx's own allocations: not counted twice
    assert foreign_mask([{"profile": "4g.40gb", "start": 0, "size": 4, "managed": True}]) == 0
    assert (
        foreign_mask(
            [
                {"profile": "1g.10gb", "start": 0, "size": 1, "managed": False},
                {"profile": "2g.20gb", "start": 2, "size": 2, "managed": False},
            ]
        )
        == 0b1101
    )
    # a +me instance also holds the GPU's one set of media engines
    me = {"profile": "1g.10gb+me", "start": 3, "size": 1, "managed": False}
    assert foreign_mask([me]) == slices(3, 1) | MEDIA_BIT
    # an instance whose geometry cannot be read holds the whole GPU
    for bad in ({"start": -1, "size": 1}, {"start": 6, "size": 4}, {"start": 0, "size": 0}, {"start": "x"}):
        assert foreign_mask([{**bad, "managed": False}]) == 0xFF, bad


# ---- strikes in the core ----------------------------------------------------------------------------------------


def test_a_gang_avoids_the_nodes_that_struck_it_while_it_fits_elsewhere():
    cap = ClusterCapacity([node("a", gpus=2), node("b", gpus=4)])
    plain = place_gang(cap, request("whole", 2))
    assert plain.nodes == ("a",)  # best fit
    avoid = place_gang(cap, request("whole", 2, avoid=frozenset({"a"})))
    assert avoid.nodes == ("b",) and "struck" not in avoid.reason
    assert cap.nodes["a"].schedulable and cap.effective_free("a") == 2  # nothing stays hidden
    cap.reserve(place_gang(cap, request("whole", 4)))  # b is full now: a is all that is left
    back = place_gang(cap, request("whole", 2, avoid=frozenset({"a"})))
    assert back.nodes == ("a",) and "that struck it before" in back.reason
    assert isinstance(place_gang(cap, request("whole", 4, avoid=frozenset({"a"}))), Unplaceable)
    # partial requests too
    cap = ClusterCapacity([node("a", gpus=2, mig={1}), node("b", gpus=2, mig={1})])
    assert place_gang(cap, request("mig", "1g.10gb", avoid=frozenset({"a"}))).nodes == ("b",)


# ---- the scheduler's view: FATAL GPUs in MIG mode, quotas -------------------------------------------------------


def _record(name, gpus=2, mig=(), health=None, model=H100) -> NodeRecord:
    return NodeRecord(
        id=1,
        name=name,
        state="READY",
        gpus=gpus,
        gpu_ids={i: i + 1 for i in range(gpus)},
        gpu_model=model[0],
        memory_mib=model[1],
        mig_gpus=frozenset(mig),
        gpu_health=health or {},
    )


def test_a_fatal_gpu_in_mig_mode_takes_no_instance():
    state = SchedulerState()
    state.nodes = {"a": _record("a", mig={0, 1}, health={1: ("FATAL", ("XID 79",))})}
    state.rebuild_capacity()
    assert state.capacity.nodes["a"].mig == {0: 0, 1: 0xFF}
    first = place_gang(state.capacity, request("mig", "7g.80gb"))
    assert first.replicas[0].gpus == (0,)
    state.capacity.reserve(first)
    assert isinstance(place_gang(state.capacity, request("mig", "1g.10gb")), Unplaceable)


@pytest.mark.parametrize(
    "gpus, totals",
    [
        ([(H100[0], H100[1], False)] * 8, {"gpus": 8.0, "mig_slices": 0.0}),
        ([(H100[0], H100[1], False)] * 7 + [(H100[0], H100[1], True)], {"gpus": 7.0, "mig_slices": 7.0}),
        ([(A100_40[0], A100_40[1], True)] * 2, {"gpus": 0.0, "mig_slices": 14.0}),
        ([(L40S[0], L40S[1], True), (L40S[0], L40S[1], False)], {"gpus": 1.0, "mig_slices": 0.0}),
    ],
)
def test_quota_denominators_count_mig_slices_only_on_gpus_in_mig_mode(gpus, totals):
    assert cluster_totals(gpus) == totals


def test_quota_book_of_the_scheduler_counts_slices_of_mig_mode_gpus_only():
    assert (mig_compute_slices(*H100), mig_compute_slices(*L40S)) == (7, 0)
    state = SchedulerState()
    state.nodes = {"a": _record("a", gpus=8, mig={7}), "b": _record("b", gpus=8)}
    state.queues = {"q": QueueSpec("q", {"*": FlavorQuota(gpus=16, mig_slices=7)})}
    book = QuotaBook(state.queues, {}, quota_totals(state))  # the denominators a scheduling pass uses
    assert book.capacity == {"gpus": 15.0, "mig_slices": 7.0}
    book.charge("q", "*", request("mig", "3g.40gb"))
    assert book.share("q") == pytest.approx(3 / 7)  # 3 of the 7 slices that exist, not of 16 x 7
    plain = QuotaBook(state.queues, {}, cluster_totals([(H100[0], H100[1], False)] * 16))
    plain.charge("q", "*", request("mig", "3g.40gb"))
    assert plain.share("q") == 3.0  # no GPU in MIG mode: a missing total counts as 1


# ---- end to end --------------------------------------------------------------------------------------------------


class Cluster(LiteCluster):
    """A scheduler and LiteAgents node-0, node-1, ... from (gpus, mig_gpus, model, extra LiteAgent fields) each."""

    def __init__(self, db_url: str, agents, **settings) -> None:
        names = [f"node-{i}" for i in range(len(agents))]
        self.specs = agents
        super().__init__(
            SchedulerSettings(
                db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names, nodes_per_leaf=4), **settings
            ),
            lambda address: [
                LiteAgent(address, n, gpus=gpus, model=model[0], memory_mib=model[1], mig_gpus=tuple(mig), **extra)
                for n, (gpus, mig, model, extra) in zip(names, agents, strict=True)
            ],
        )

    async def nodes(self) -> dict[str, common_pb2.Node]:
        return {n.name: n for n in (await self.stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes}

    async def until(self, job_id: str, check, what: str):
        async def probe():
            job = await self.job(job_id)
            return job if check(job) else None

        return await eventually(probe, what=what, timeout=30)


async def _cli_json(capsys, address: str, *argv: str):
    code = await asyncio.to_thread(cli_main, ["--scheduler", address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _instance(profile, start, size, managed, uuid="", gi=-1, ci=-1):
    return agent_pb2.GpuInfo.MigInstance(
        profile=profile, start=start, size=size, uuid=uuid, managed=managed, gpu_instance_id=gi, compute_instance_id=ci
    )


async def test_mig_mode_is_stored_shown_and_followed_and_reregistering_changes_it(db_url, capsys, service_logs):
    async with Cluster(db_url, [(2, (1,), H100, {}), (2, (), L40S, {})]) as c:
        rows = c.sql(
            'SELECT n.name, g."index", g.mig_mode FROM gpus g JOIN nodes n ON n.id = g.node_id '
            'ORDER BY n.name, g."index"'
        )
        assert rows == [
            ("node-0", 0, "DISABLED"),
            ("node-0", 1, "ENABLED"),
            ("node-1", 0, "UNSUPPORTED"),
            ("node-1", 1, "UNSUPPORTED"),
        ]
        nodes = await _cli_json(capsys, c.scheduler.address, "nodes", "--json")
        assert [n["name"] for n in nodes] == ["node-0", "node-1"]
        # every field of before is still there; gpu_details and strikes are new (mig_manage: --mig-manage)
        assert {
            "name",
            "gpus",
            "free_gpus",
            "state",
            "profile",
            "gpu_model",
            "fabric_path",
            "message",
            "last_heartbeat",
            "address",
            "shared_gpus",
            "health",
            "health_reason",
            "unhealthy_gpus",
            "gpu_details",
            "strikes",
            "mig_manage",
            "containment",
            "releasing_gpus",
            "cpus",
            "memory_bytes",
            "free_cpus",
            "free_memory_bytes",
        } == set(nodes[0])
        assert [[(g["index"], g["mig_mode"]) for g in n["gpu_details"]] for n in nodes] == [
            [(0, "disabled"), (1, "enabled")],
            [(0, "unsupported"), (1, "unsupported")],
        ]
        assert (nodes[0]["free_gpus"], nodes[0]["shared_gpus"], nodes[0]["strikes"]) == (1, 0, 0)
        assert nodes[1]["free_gpus"] == 2

        # MIG goes to the GPU in MIG mode; whole GPUs and shares never do
        m = await c.wait_running((await c.submit("mig", mig_profile="3g.40gb")).id)
        assert (m.allocations[0].node, list(m.allocations[0].gpus)) == ("node-0", [1])
        s = await c.wait_running((await c.submit("share", gpu_milli=500, gpu_model="H100")).id)
        assert (s.allocations[0].node, list(s.allocations[0].gpus)) == ("node-0", [0])
        whole = await c.submit("whole", gpus=2, gpu_model="H100")
        waiting = await c.until(whole.id, lambda j: "MIG mode" in j.message, "the whole gang's reason")
        assert waiting.state == PENDING and "1 GPU(s) in MIG mode take only MIG instances" in waiting.message
        for job in (m, s, whole):
            await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))

        # The agent comes back with GPU 1 out of MIG mode and GPU 0 in it: the ledger, the view and placement follow
        agent = c.agents[0]
        await agent.stop()
        agent.mig_gpus = (0,)
        await agent.start()
        rows = c.sql(
            'SELECT g."index", g.mig_mode FROM gpus g JOIN nodes n ON n.id = g.node_id '
            "WHERE n.name = 'node-0' ORDER BY g.\"index\""
        )
        assert rows == [(0, "ENABLED"), (1, "DISABLED")]
        nodes = await c.nodes()
        assert [g.mig_mode for g in nodes["node-0"].gpu_details] == ["enabled", "disabled"]
        m = await c.wait_running((await c.submit("mig2", mig_profile="3g.40gb")).id)
        assert list(m.allocations[0].gpus) == [0]
        w = await c.wait_running((await c.submit("whole1", gpus=1, gpu_model="H100")).id)
        assert list(w.allocations[0].gpus) == [1]


async def test_a_mig_job_waits_when_no_gpu_is_in_mig_mode_and_is_refused_when_no_gpu_has_the_profile(db_url):
    async with Cluster(db_url, [(2, (), H100, {}), (2, (), L40S, {})]) as c:
        job = await c.submit("mig", mig_profile="3g.40gb")
        waiting = await c.until(job.id, lambda j: "MIG mode" in j.message, "the MIG job's reason")
        assert waiting.state == PENDING and "no GPU is in MIG mode" in waiting.message
        assert c.sql("SELECT count(*) FROM allocations") == [(0,)]
        with pytest.raises(grpc.aio.AioRpcError) as err:  # no known GPU offers it at all: as before
            await c.submit("a100-profile", mig_profile="1g.5gb")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no known node's GPUs offer MIG profile" in err.value.details()
        # MIG mode turns on at the node's next registration: the waiting job runs
        agent = c.agents[0]
        await agent.stop()
        agent.mig_gpus = (1,)
        await agent.start()
        running = await c.wait_running(job.id)
        assert (running.allocations[0].node, list(running.allocations[0].gpus)) == ("node-0", [1])


async def test_foreign_instances_are_occupied_and_listed_and_managed_ones_are_not_counted_twice(
    db_url, capsys, service_logs
):
    instances = {
        2: [
            _instance("3g.40gb", 4, 4, False, "MIG-foreign", 2, 0),  # someone else's
            _instance("4g.40gb", 0, 4, True, "MIG-ours", 1, 0),
        ],  # the agent's own, with no allocation now
        0: [_instance("1g.10gb", 0, 1, False, "MIG-stray", 9, 0)],  # outside MIG mode: the GPU is taken
    }
    async with Cluster(db_url, [(3, (2,), H100, {"mig_instances": instances})]) as c:
        (n,) = (await c.nodes()).values()
        assert (n.free_gpus, n.shared_gpus) == (1, 2)
        shown = await _cli_json(capsys, c.scheduler.address, "nodes", "--json")
        gpus = shown[0]["gpu_details"]
        assert [g["mig_mode"] for g in gpus] == ["disabled", "disabled", "enabled"]
        assert gpus[2]["mig_instances"] == [
            {
                "profile": "3g.40gb",
                "start": 4,
                "size": 4,
                "uuid": "MIG-foreign",
                "managed": False,
                "gpu_instance_id": 2,
                "compute_instance_id": 0,
            },
            {
                "profile": "4g.40gb",
                "start": 0,
                "size": 4,
                "uuid": "MIG-ours",
                "managed": True,
                "gpu_instance_id": 1,
                "compute_instance_id": 0,
            },
        ]
        assert [(i["uuid"], i["managed"]) for i in gpus[0]["mig_instances"]] == [("MIG-stray", False)]
        # The managed 4g (slices 0-3) is no allocation of Phalanx now: those slices are free. The foreign 3g keeps 4-7.
        three = await c.wait_running((await c.submit("three", mig_profile="3g.40gb")).id)
        sl = three.allocations[0].slices[0]
        assert (sl.gpu, sl.start, sl.size) == (2, 0, 4)
        more = await c.submit("more", mig_profile="1g.10gb")
        waiting = await c.until(more.id, lambda j: "no free placement" in j.message, "the second MIG job's reason")
        assert waiting.state == PENDING
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=more.id))  # (it would reserve the node)
        # GPU 0 carries a stray instance: only GPU 1 takes whole-GPU work
        two = await c.submit("two", gpus=2)
        one = await c.wait_running((await c.submit("one", gpus=1)).id)
        assert list(one.allocations[0].gpus) == [1]
        assert (await c.job(two.id)).state == PENDING


async def test_a_retryable_launch_failure_requeues_with_backoff_and_strikes_the_node(db_url, capsys, service_logs):
    failure = "could not create MIG instance 3g.40gb on GPU 1: NVML_ERROR_INSUFFICIENT_RESOURCES"
    async with Cluster(
        db_url,
        [(2, (), H100, {"setup_failure": failure}), (4, (), H100, {})],
        retry_backoff_s=1.0,
        retry_backoff_max_s=1.0,
    ) as c:
        changes = c.changes()  # the requeue is seen from the change that made it, however short its backoff
        job = await c.submit("gang", gpus=2)
        requeued = await changes.until(job.id, lambda j: j.state == PENDING and j.failures == 1, "the gang requeued")
        assert "could not be set up on node node-0" in requeued.message and failure in requeued.message
        assert "requeued (failure 1 of at most 5), retried after a 1s backoff" in requeued.message
        assert list(requeued.struck_nodes) == ["node-0"] and not requeued.allocations  # it waits holding nothing
        done = await c.until(job.id, lambda j: j.state == RUNNING and j.attempt == 2, "the second attempt running")
        # the first attempt went to node-0 (best fit), which could not set its ranks up: struck, requeued
        first = c.sql(
            "SELECT a.attempt, n.name, a.outcome, a.reason FROM job_attempts a "
            "JOIN allocations al ON al.job_id = a.job_id AND al.attempt = a.attempt "
            "JOIN nodes n ON n.id = al.node_id WHERE a.job_id = :j ORDER BY a.attempt",
            j=job.id,
        )
        assert {(r[0], r[1], r[2]) for r in first} == {(1, "node-0", "SETUP_FAILED"), (2, "node-1", "")}
        reason = next(r[3] for r in first if r[0] == 1)
        assert failure in reason and "could not be set up on node node-0" in reason and "struck" in reason
        assert {a.node for a in done.allocations} == {"node-1"}  # the struck node is avoided: it fits elsewhere
        assert list(done.struck_nodes) == ["node-0"] and done.failures == 1
        assert done.not_before > 0 and done.started_at >= done.not_before  # it waited out the backoff
        assert c.sql("SELECT struck_nodes FROM jobs WHERE id = :j", j=job.id)[0][0] in (["node-0"], '["node-0"]')
        nodes = await _cli_json(capsys, c.scheduler.address, "nodes", "--json")
        assert {n["name"]: n["strikes"] for n in nodes} == {"node-0": 1, "node-1": 0}
        events = c.sql(
            "SELECT e.kind, e.code, e.reason FROM node_events e JOIN nodes n ON n.id = e.node_id "
            "WHERE n.name = 'node-0'"
        )
        assert [(k, code) for k, code, _ in events] == [("setup_failed", 1)] and failure in events[0][2]
        shown = await _cli_json(capsys, c.scheduler.address, "job", job.id, "--json")
        assert shown["struck_nodes"] == ["node-0"]


async def test_a_struck_node_is_used_when_nothing_else_fits_and_failures_count_against_max_attempts(db_url):
    failure = "MPS control daemon did not start"
    async with Cluster(
        db_url,
        [(2, (), H100, {"setup_failure": failure}), (4, (), H100, {})],
        retry_backoff_s=0.2,
        retry_backoff_max_s=0.2,
        max_attempts=2,
    ) as c:
        parked = await c.wait_running((await c.submit("parked", gpus=4)).id)  # node-1 is full: only node-0 is left
        assert {a.node for a in parked.allocations} == {"node-1"}
        job = await c.submit("gang", gpus=2)
        done = await c.until(job.id, lambda j: j.state == FAILED, "the gang to fail for good")
        assert done.attempt == 2 and done.failures == 2 and list(done.struck_nodes) == ["node-0"]
        assert "gave up after 2 failed attempts" in done.message and failure in done.message
        assert "that struck it before" in done.placement.reason  # the second attempt went back to node-0
        assert (await c.nodes())["node-0"].strikes == 2
        assert c.sql("SELECT attempt, outcome FROM job_attempts WHERE job_id = :j ORDER BY attempt", j=job.id) == [
            (1, "SETUP_FAILED"),
            (2, "SETUP_FAILED"),
        ]


async def test_a_launch_failure_that_is_not_retryable_still_fails_the_job(db_url):
    async with Cluster(db_url, [(2, (), H100, {"start_failure": "exec: python9: not found"}), (4, (), H100, {})]) as c:
        job = await c.submit("gang", gpus=2)
        done = await c.until(job.id, lambda j: j.state == FAILED, "the job to fail")
        assert done.attempt == 1 and done.exit_code == 127 and done.failures == 0
        assert "failed to start: exec: python9: not found" in done.message
        assert list(done.struck_nodes) == [] and (await c.nodes())["node-0"].strikes == 0


async def test_queue_shares_count_the_slices_of_gpus_in_mig_mode(db_url):
    async with Cluster(db_url, [(2, (1,), H100, {})]) as c:
        spec = scheduler_pb2.QueueSpec(name="q")
        spec.quotas.add(flavor="*", gpus=2, mig_slices=7)
        await c.stub.SetQueue(scheduler_pb2.SetQueueRequest(spec=spec))
        await c.wait_running((await c.submit("mig", mig_profile="3g.40gb", queue="q")).id)
        (status,) = (await c.stub.ListQueues(scheduler_pb2.ListQueuesRequest(name="q"))).queues
        assert status.share == pytest.approx(3 / 7)  # the one GPU in MIG mode has 7 slices (not 2 GPUs x 7)
        await c.wait_running((await c.submit("whole", gpus=1, queue="q")).id)
        (status,) = (await c.stub.ListQueues(scheduler_pb2.ListQueuesRequest(name="q"))).queues
        assert status.share == pytest.approx(1.0)  # the one GPU out of MIG mode is all the cluster's whole GPUs


# ---- the migration -----------------------------------------------------------------------------------------------


def _downgrade(url: str, revision: str) -> None:
    from alembic import command

    from db.migrate import alembic_config

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, revision)
            conn.commit()
    finally:
        engine.dispose()


async def test_migration_0010_reads_old_gpus_as_unsupported_and_downgrades(empty_db_url):
    from db.migrate import current, head_revision, upgrade

    url = empty_db_url
    upgrade(url, "0009")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:  # a node with 2 GPUs and a pending job, as a 0009 scheduler wrote them
            conn.execute(
                text(
                    "INSERT INTO nodes (id, name, state, message, gpus, gpu_model, profile, address, topology, "
                    "fabric_path, agent_instance, registered_at, last_heartbeat, revision, acked_revision) VALUES "
                    "(1, 'node-0', 'READY', '', 2, :model, 'lite', '127.0.0.1', '{}', '[]', 'x', 1, 1, 0, 0)"
                ),
                {"model": H100[0]},
            )
            for i in range(2):
                conn.execute(
                    text(
                        'INSERT INTO gpus (id, node_id, "index", uuid, name, memory_mib) '
                        "VALUES (:i, 1, :idx, :u, :m, 81559)"
                    ),
                    {"i": i + 1, "idx": i, "u": f"GPU-{i}", "m": H100[0]},
                )
            conn.execute(
                text(
                    "INSERT INTO jobs (id, request_id, name, state, priority, replicas, gpus_per_replica, "
                    "procs_per_replica, command, env, attempt, message, exit_code, placement, submitted_at, started_at, "
                    "finished_at, version) VALUES ('0123456789ab', NULL, 'old', 'PENDING', 0, 1, 1, 0, '[\"run\"]', '{}', "
                    "0, '', 0, '{}', 1.0, 0, 0, 0)"
                )
            )
        upgrade(url)
        assert current(url) == head_revision()
        with engine.connect() as conn:
            assert conn.execute(text('SELECT "index", mig_mode FROM gpus ORDER BY "index"')).all() == [
                (0, "UNSUPPORTED"),
                (1, "UNSUPPORTED"),
            ]
            assert conn.execute(text("SELECT strikes FROM nodes")).all() == [(0,)]
            ((instances,),) = conn.execute(text('SELECT mig_instances FROM gpus WHERE "index" = 0')).all()
            ((struck,),) = conn.execute(text("SELECT struck_nodes FROM jobs")).all()
            assert instances in ([], "[]") and struck in ([], "[]")
        # The scheduler reads the old ledger: no GPU in MIG mode, nothing struck
        from services.scheduler import ledger

        state = SchedulerState()
        with engine.connect() as conn:
            ledger.load_state(conn, state, lambda name: ())
        assert state.nodes["node-0"].mig_gpus == frozenset() and state.nodes["node-0"].foreign == {}
        assert state.jobs["0123456789ab"].struck_nodes == []
        assert state.capacity.nodes["node-0"].free == {0, 1}
        engine.dispose()
        _downgrade(url, "0009")
        assert current(url) == "0009"
        engine = make_engine(url)
        with engine.connect() as conn:
            columns = {
                r[0]
                for r in conn.execute(
                    text(
                        "SELECT name FROM pragma_table_info('gpus')"
                        if url.startswith("sqlite")
                        else "SELECT column_name FROM information_schema.columns WHERE table_name = 'gpus'"
                    )
                )
            }
        assert "mig_mode" not in columns and "memory_mib" in columns
        upgrade(url)
        assert current(url) == head_revision()
    finally:
        engine.dispose()


# ---- local clusters ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "profile, mig_gpus, expected",
    [
        ("dgx-h100", None, [7]),
        ("dgx-h100", 2, [6, 7]),
        ("dgx-h100", 0, []),
        ("dgx-h100", 8, list(range(8))),
        ("gb200-nvl72-tray", None, [3]),
        ("pcie-2numa", None, []),
        ("pcie-2numa", 0, []),
        ("pcie-2numa", 1, "have no MIG"),
        ("dgx-h100", 9, "has 8 GPUs"),
    ],
)
def test_local_cluster_puts_the_last_gpus_of_the_last_node_in_mig_mode(tmp_path, profile, mig_gpus, expected):
    cluster = LocalCluster(nodes=2, profile=profile, state_dir=tmp_path, mig_gpus=mig_gpus)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            cluster.mig_gpu_indexes()
    else:
        assert cluster.mig_gpu_indexes() == expected


def _agent_has_simulate_mig() -> bool:
    proc = subprocess.run(
        [sys.executable, "-m", "services.node_agent.main", "--help"], capture_output=True, text=True, timeout=60
    )
    return "--simulate-mig" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cluster_up_mig_gpus_reach_the_last_agent_and_mig_jobs_run_there(tmp_path, monkeypatch):
    if not _agent_has_simulate_mig():
        pytest.skip("phalanx-agent has no --simulate-mig yet")
    from phalanx.client import Client, JobState

    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    with LocalCluster(
        nodes=2, state_dir=tmp_path / "c", port=0, log=lambda m: None, mig_gpus=2, ready_timeout=90
    ) as cluster:
        with Client(cluster.address, timeout=10) as client:
            modes = {n.name: [g["mig_mode"] for g in n.gpu_details] for n in client.nodes()}
            assert modes == {"node-01": ["disabled"] * 8, "node-02": ["disabled"] * 6 + ["enabled"] * 2}
            job = client.submit("mig", 1, 1, [sys.executable, "-c", "pass"], mig_profile="3g.40gb")
            done = client.wait(job.id, timeout=60)
            assert done.state is JobState.SUCCEEDED, done
            import sqlite3  # a finished job shows no allocations: where it ran is in the ledger's history

            with sqlite3.connect(tmp_path / "c" / "phalanx.db") as conn:
                ((node, gpu),) = conn.execute(
                    "SELECT DISTINCT n.name, a.gpu_index FROM allocations a JOIN nodes n "
                    "ON n.id = a.node_id WHERE a.job_id = ? AND a.kind = 'mig'",
                    (job.id,),
                ).fetchall()
            assert not done.allocations and node == "node-02" and gpu in (6, 7)
        info = json.loads((tmp_path / "c" / "cluster.json").read_text())
        assert info["mig_gpus"] == {"node-02": [6, 7]}
