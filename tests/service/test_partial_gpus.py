"""MIG instances and fractional GPU shares: the profile rules, FGD-style packing, the ledger's no-double-booking
of slices, and the path end to end (SDK/CLI -> scheduler -> ledger -> launch assignment -> back).

Core tests need no services. End-to-end tests run the real scheduler in-process on SQLite and on PostgreSQL with
protocol-level LiteAgents (they record the launch assignments they get).
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from db.engine import make_engine
from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.cli.main import main as cli_main
from phalanx.core import mig
from phalanx.core.capacity import CapacityError, ClusterCapacity, shape_key
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import Unplaceable, place_gang
from phalanx.core.shares import fragmentation
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

H100 = ("NVIDIA H100 80GB HBM3", 81559)
A100_40 = ("NVIDIA A100-SXM4-40GB", 40960)
L40S = ("NVIDIA L40S", 46068)


def node(name: str, model=H100, gpus: int = 8, free: set[int] | None = None, path=("leaf0", "spine0"), mig=()):
    """`mig`: the GPUs in MIG mode (only MIG instances go there; the others take whole-GPU jobs and shares)."""
    return NodeCapacity(
        name, gpus, set(range(gpus)) if free is None else free, True, path, None, *model, mig_gpus=frozenset(mig)
    )


def place(cap: ClusterCapacity, job: str, *, mig_profile: str = "", milli: int = 0, replicas: int = 1, model=""):
    p = place_gang(cap, GangRequest(job, replicas, 1, mig_profile=mig_profile, gpu_milli=milli, gpu_model=model))
    if isinstance(p, Placement):
        cap.reserve(p)
    return p


# ---- the profile table ------------------------------------------------------------------------------------------


def test_profiles_follow_nvidias_placement_table():
    h100 = mig.family_profiles("H100-80GB")
    assert list(h100) == ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    assert h100["1g.10gb"].starts == (0, 1, 2, 3, 4, 5, 6) and h100["1g.10gb"].size == 1
    assert h100["1g.20gb"].starts == (0, 2, 4, 6) and h100["1g.20gb"].size == 2
    assert h100["2g.20gb"].starts == (0, 2, 4)
    assert h100["3g.40gb"].starts == (0, 4) and h100["3g.40gb"].size == 4
    assert h100["4g.40gb"].starts == (0,)
    assert h100["7g.80gb"].starts == (0,) and h100["7g.80gb"].size == 8
    assert list(mig.family_profiles("A100-40GB")) == ["1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
    # The same name means a different size on another family: A100 40GB's 1g.10gb is the two-slice 1g.
    assert mig.resolve("1g.10gb", "A100-40GB").size == 2 and mig.resolve("1g.10gb", "A100-80GB").size == 1


@pytest.mark.parametrize(
    "model, memory, family",
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H100 NVL", 95830, "H100-94GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA B200", 183359, "B200-180GB"),
        ("NVIDIA GB200", 189471, "GB200-186GB"),
        ("NVIDIA L40S", 46068, None),
        ("Tesla V100-SXM2-32GB", 32768, None),
    ],
)
def test_mig_family_from_the_nvml_name(model, memory, family):
    assert mig.mig_family(model, memory) == family


def test_geometries_nvidia_allows():
    p = mig.family_profiles("H100-80GB")
    used = p["4g.40gb"].mask(0)
    assert mig.free_starts(used, p["3g.40gb"]) == [4]  # 4g + 3g
    assert mig.free_starts(p["3g.40gb"].mask(0), p["3g.40gb"]) == [4]  # 3g + 3g
    seven = 0
    for start in range(7):
        assert start in mig.free_starts(seven, p["1g.10gb"])
        seven |= p["1g.10gb"].mask(start)
    assert mig.free_starts(seven, p["1g.10gb"]) == []  # slice 7 holds no 1g.10gb
    assert mig.free_starts(p["1g.10gb"].mask(1), p["2g.20gb"]) == [2, 4]
    assert mig.free_starts(p["1g.10gb"].mask(5), p["3g.40gb"]) == [0]


# ---- placement in the core --------------------------------------------------------------------------------------


def test_mig_instances_pack_onto_one_gpu_by_the_rules():
    cap = ClusterCapacity([node("a", mig={6, 7})])
    got = [place(cap, f"j{i}", mig_profile="1g.10gb") for i in range(8)]
    assert all(isinstance(p, Placement) for p in got)
    first_gpu = {p.replicas[0].gpus for p in got[:7]}
    assert len(first_gpu) == 1  # seven 1g.10gb fill one GPU before another is split
    assert sorted(p.replicas[0].mig_start for p in got[:7]) == list(range(7))
    assert got[7].replicas[0].gpus != got[0].replicas[0].gpus
    assert {got[0].replicas[0].gpus[0], got[7].replicas[0].gpus[0]} == {6, 7}  # only the GPUs in MIG mode
    assert cap.nodes["a"].mig[got[0].replicas[0].gpus[0]] == 0x7F
    assert cap.nodes["a"].free == set(range(6))


def test_a_3g_goes_next_to_a_4g_not_onto_a_fresh_gpu():
    cap = ClusterCapacity([node("a", mig={6, 7})])
    four = place(cap, "four", mig_profile="4g.40gb")
    three = place(cap, "three", mig_profile="3g.40gb")
    assert three.replicas[0].gpus == four.replicas[0].gpus
    assert (four.replicas[0].mig_start, three.replicas[0].mig_start) == (0, 4)
    assert cap.nodes["a"].mig[four.replicas[0].gpus[0]] == 0xFF


def test_a_lone_3g_takes_the_upper_half_so_a_4g_still_fits():
    cap = ClusterCapacity([node("a", mig={7})])
    three = place(cap, "three", mig_profile="3g.40gb")
    assert three.replicas[0].mig_start == 4
    four = place(cap, "four", mig_profile="4g.40gb")
    assert four.replicas[0].gpus == three.replicas[0].gpus and four.replicas[0].mig_start == 0


def test_partial_requests_prefer_a_node_already_split_over_an_empty_one():
    busy = node("busy", free={5, 6}, mig={7})
    cap = ClusterCapacity([node("empty", mig={7}), busy])
    p = place(cap, "m", mig_profile="2g.20gb")
    assert p.replicas[0].node == "busy" and p.replicas[0].gpus == (7,)
    s = place(cap, "s", milli=300)
    assert s.replicas[0].node == "busy" and s.replicas[0].gpus != (7,)
    assert cap.nodes["empty"].free == set(range(7)) and cap.nodes["empty"].mig == {7: 0}  # kept whole
    assert "fragmentation" in p.reason


def test_whole_gpu_gangs_never_take_a_split_gpu_and_get_it_back_when_freed():
    cap = ClusterCapacity([node("a", gpus=2)])
    m = place(cap, "m", milli=500)
    split = m.replicas[0].gpus[0]
    assert isinstance(place_gang(cap, GangRequest("whole", 1, 2)), Unplaceable)
    one = place_gang(cap, GangRequest("one", 1, 1))
    assert one.replicas[0].gpus != (split,)
    cap.release_placement(m)
    assert cap.nodes["a"].free == {0, 1} and not cap.nodes["a"].milli
    assert isinstance(place_gang(cap, GangRequest("whole", 1, 2)), Placement)


def test_a_gpu_in_mig_mode_stays_out_of_whole_gpu_placement_when_its_instances_end():
    cap = ClusterCapacity([node("a", gpus=2, mig={1})])
    m = place(cap, "m", mig_profile="1g.10gb")
    assert m.replicas[0].gpus == (1,)
    cap.release_placement(m)
    assert cap.nodes["a"].free == {0} and cap.nodes["a"].mig == {1: 0}  # empty, still in MIG mode
    assert isinstance(place_gang(cap, GangRequest("whole", 1, 2)), Unplaceable)
    assert place_gang(cap, GangRequest("one", 1, 1)).replicas[0].gpus == (0,)


def test_shares_fill_a_gpu_to_1000_and_never_mix_with_mig():
    cap = ClusterCapacity([node("a", gpus=2)])
    quarters = [place(cap, f"q{i}", milli=250) for i in range(4)]
    assert len({p.replicas[0].gpus for p in quarters}) == 1
    gpu = quarters[0].replicas[0].gpus[0]
    assert cap.nodes["a"].milli == {gpu: 1000}
    half = place(cap, "h", milli=600)
    assert half.replicas[0].gpus != (gpu,)
    too_much = place(cap, "t", milli=500)  # 600 used: no GPU has 500 left, and no GPU is whole
    assert isinstance(too_much, Unplaceable) and "no GPU has that share free" in too_much.reason
    assert isinstance(place(cap, "mig", mig_profile="1g.10gb"), Unplaceable)


def test_reserve_refuses_overlaps_and_changes_nothing():
    cap = ClusterCapacity([node("a", gpus=1, mig={0})])
    p = place(cap, "a", mig_profile="3g.40gb")
    before = dict(cap.nodes["a"].mig)
    with pytest.raises(CapacityError):
        cap.reserve(p)  # the same slices again
    with pytest.raises(CapacityError):
        cap.reserve(Placement("x", (p.replicas[0].__class__(0, "a", (0,), gpu_milli=100),), "node", 1, 0, ""))
    assert cap.nodes["a"].mig == before and not cap.nodes["a"].milli


def test_gpu_model_filters_whole_and_partial_requests():
    cap = ClusterCapacity([node("h", H100), node("l", L40S)])
    assert place(cap, "a", milli=500, model="l40s").replicas[0].node == "l"
    whole = place_gang(cap, GangRequest("b", 1, 8, gpu_model="H100"))
    assert {r.node for r in whole.replicas} == {"h"}
    assert "no node has GPU model" in place_gang(cap, GangRequest("c", 1, 1, gpu_model="B200")).reason
    # MIG on a GPU without MIG: the reason names the families that do offer profiles
    cap2 = ClusterCapacity([node("l", L40S)])
    assert "no node here has MIG-capable GPUs" in place(cap2, "m", mig_profile="1g.10gb").reason
    cap3 = ClusterCapacity([node("a", A100_40)])
    r = place(cap3, "m", mig_profile="1g.20gb")
    assert isinstance(r, Unplaceable) and "A100-40GB: 1g.5gb" in r.reason


def test_a_partial_gang_is_all_or_nothing():
    cap = ClusterCapacity([node("a", gpus=1, mig={0})])
    p = place(cap, "two", mig_profile="4g.40gb", replicas=2)
    assert isinstance(p, Unplaceable) and "1 of 2 replicas fit" in p.reason
    assert cap.nodes["a"].mig == {0: 0}  # the first replica was not kept
    ok = place(cap, "pair", mig_profile="3g.40gb", replicas=2)
    assert sorted(r.mig_start for r in ok.replicas) == [0, 4]


def test_nodes_of_one_shape_are_scored_once():
    cap = ClusterCapacity([node(f"n{i:03d}", mig={7}) for i in range(300)])
    assert len(cap.shape_buckets()) == 1
    place(cap, "m", mig_profile="1g.10gb")
    buckets = cap.shape_buckets()
    assert sorted(len(v) for v in buckets.values()) == [1, 299]
    fragmentation.cache_clear()
    place(cap, "m2", mig_profile="1g.10gb")
    # Fragmentation is computed per shape and per outcome (GPU state x start slice), never per node: 2 shapes,
    # at most 2 GPU states x 7 starts each, against 300 nodes.
    assert fragmentation.cache_info().currsize <= 2 * (1 + 2 * 7)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("mig"), st.sampled_from(list(mig.family_profiles("H100-80GB")))),
        st.tuples(st.just("milli"), st.sampled_from([100, 250, 333, 500, 700])),
        st.tuples(st.just("whole"), st.sampled_from([1, 2, 4])),
        st.tuples(st.just("release"), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=40,
)


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_random_mixes_never_double_book_and_keep_the_index_true(ops):
    cap = ClusterCapacity([node("a", gpus=4, mig={3}), node("b", gpus=4, mig={2, 3}), node("c", L40S, gpus=2)])
    held: list[Placement] = []
    for i, (kind, arg) in enumerate(ops):
        if kind == "release":
            if held:
                cap.release_placement(held.pop(arg % len(held)))
        else:
            req = GangRequest(
                f"j{i}",
                1,
                arg if kind == "whole" else 1,
                mig_profile=arg if kind == "mig" else "",
                gpu_milli=arg if kind == "milli" else 0,
            )
            p = place_gang(cap, req)
            if isinstance(p, Placement):
                cap.reserve(p)
                held.append(p)
        # Recount from what is held, independently of the capacity's own bookkeeping.
        for n in cap.nodes.values():
            whole, masks, millis = set(), {}, {}
            for p in held:
                for r in p.replicas:
                    if r.node != n.name:
                        continue
                    if r.mig_profile:
                        assert not masks.get(r.gpus[0], 0) & r.mig_mask
                        masks[r.gpus[0]] = masks.get(r.gpus[0], 0) | r.mig_mask
                    elif r.gpu_milli:
                        millis[r.gpus[0]] = millis.get(r.gpus[0], 0) + r.gpu_milli
                    else:
                        assert not whole & set(r.gpus)
                        whole |= set(r.gpus)
            assert not (whole & set(masks)) and not (whole & set(millis)) and not (set(masks) & set(millis))
            assert set(masks) <= n.mig_gpus and not (whole | set(millis)) & n.mig_gpus  # MIG mode separates them
            assert all(v <= 1000 for v in millis.values())
            assert n.mig == {g: masks.get(g, 0) for g in n.mig_gpus} and n.milli == millis
            assert n.free == set(range(n.total)) - whole - set(masks) - set(millis) - n.mig_gpus
        fresh = {}
        for n in cap.nodes.values():
            key = shape_key(n)
            if key is not None:
                fresh.setdefault(key, []).append(n.name)
        assert cap.shape_buckets() == {k: sorted(v) for k, v in fresh.items()}


# ---- end to end ------------------------------------------------------------------------------------------------


class Cluster(LiteCluster):
    """A scheduler and one LiteAgent of `gpus` GPUs per model in `models` (node-0, node-1, ...); on MIG-capable
    models the GPUs `mig_gpus` are in MIG mode."""

    def __init__(self, db_url: str, models=(H100,), gpus: int = 2, mig_gpus=(1,)) -> None:
        names = [f"node-{i}" for i in range(len(models))]
        super().__init__(
            SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names, nodes_per_leaf=4)),
            lambda address: [
                LiteAgent(
                    address,
                    n,
                    gpus=gpus,
                    model=m[0],
                    memory_mib=m[1],
                    mig_gpus=tuple(mig_gpus) if mig.mig_family(*m) else (),
                )
                for n, m in zip(names, models, strict=True)
            ],
        )


async def test_mig_job_end_to_end_with_slices_in_the_ledger_and_the_launch(db_url):
    async with Cluster(db_url) as c:
        j = await c.submit("mig", mig_profile="3g.40gb")
        j = await c.wait_running(j.id)
        (alloc,) = j.allocations
        (sl,) = alloc.slices
        assert (sl.profile, sl.start, sl.size) == ("3g.40gb", 4, 4) and list(alloc.gpus) == [sl.gpu]
        assert j.spec.mig_profile == "3g.40gb" and "3g.40gb" in j.placement.reason
        rows = c.sql(
            "SELECT kind, unit, profile, gpu_index FROM allocations WHERE released_at IS NULL ORDER BY kind, unit"
        )
        assert rows == [("hold", -1, "mig", sl.gpu), *(("mig", u, "3g.40gb", sl.gpu) for u in range(4, 8))]
        # The agent got the instance in the launch, for CUDA_VISIBLE_DEVICES.
        agent = c.agents[0]

        async def launched():
            return agent.launched

        await eventually(launched, what="the launch assignment")
        (rank,) = agent.launched[0].ranks
        assert [(s.gpu, s.profile, s.start, s.size) for s in rank.slices] == [(sl.gpu, "3g.40gb", 4, 4)]
        # A 4g.40gb fits next to it on the same GPU; a whole 2-GPU gang does not fit while it runs.
        four = await c.wait_running((await c.submit("four", mig_profile="4g.40gb")).id)
        assert four.allocations[0].slices[0].gpu == sl.gpu and four.allocations[0].slices[0].start == 0
        whole = await c.submit("whole", gpus=2)
        await c.settled(four.id)  # the MIG jobs' ranks run, and the passes after: still no room for it
        assert (await c.job(whole.id)).state == common_pb2.JOB_STATE_PENDING
        (n,) = (await c.stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        assert (n.free_gpus, n.shared_gpus) == (1, 1)
        # Both MIG jobs end: the hold goes with the last one. The GPU stays in MIG mode: the 2-GPU gang still
        # waits, and says why; a 1-GPU job takes the other GPU.
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=j.id))
        assert c.sql("SELECT count(*) FROM allocations WHERE kind = 'hold' AND released_at IS NULL") == [(1,)]
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=four.id))
        assert c.sql("SELECT count(*) FROM allocations WHERE released_at IS NULL") == [(0,)]
        (n,) = (await c.stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        assert (n.free_gpus, n.shared_gpus) == (1, 0)
        one = await c.wait_running((await c.submit("one", gpus=1)).id)
        assert list(one.allocations[0].gpus) == [0]
        waiting = await c.job(whole.id)
        assert waiting.state == common_pb2.JOB_STATE_PENDING and "1 GPU(s) in MIG mode" in waiting.message


async def test_shares_end_to_end_pack_one_gpu_and_release_it(db_url):
    async with Cluster(db_url, mig_gpus=()) as c:
        jobs = [await c.submit(f"s{i}", gpu_milli=250) for i in range(4)]
        running = [await c.wait_running(j.id) for j in jobs]
        gpus = {(r.allocations[0].node, r.allocations[0].gpus[0]) for r in running}
        assert len(gpus) == 1 and all(r.allocations[0].gpu_milli == 250 for r in running)
        assert c.sql("SELECT gpu_milli FROM allocations WHERE kind = 'hold' AND released_at IS NULL") == [(1000,)]
        launches = [r for a in c.agents for launch in a.launched for r in launch.ranks]
        assert sorted(r.gpu_milli for r in launches) == [250] * 4
        for j in jobs:
            await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=j.id))
        assert c.sql("SELECT count(*) FROM allocations WHERE released_at IS NULL") == [(0,)]
        (n,) = (await c.stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        assert (n.free_gpus, n.shared_gpus) == (2, 0)


async def test_the_ledger_refuses_overlapping_slices_and_whole_gpus_on_a_split_gpu(db_url):
    async with Cluster(db_url) as c:
        j = await c.wait_running((await c.submit("mig", mig_profile="3g.40gb")).id)
        sl = j.allocations[0].slices[0]
        gpu_id, node_id = c.sql("SELECT gpu_id, node_id FROM allocations WHERE kind = 'hold'")[0]
        engine = make_engine(db_url)
        try:
            for kind, unit in (("mig", 5), ("gpu", -1)):  # a slice the 3g holds; the whole GPU
                with pytest.raises(IntegrityError), engine.begin() as conn:
                    conn.execute(
                        text(
                            "INSERT INTO allocations (job_id, attempt, replica, node_id, gpu_id, gpu_index, reserved_at, "
                            "kind, unit, profile, gpu_milli) VALUES (:job, 1, 0, :node, :gpu, :idx, 0, :kind, :unit, "
                            "'x', 0)"
                        ),
                        dict(job=j.id, node=node_id, gpu=gpu_id, idx=sl.gpu, kind=kind, unit=unit),
                    )
            with engine.begin() as conn:  # a free slice is fine for the index (the scheduler never did this)
                conn.execute(
                    text(
                        "INSERT INTO allocations (job_id, attempt, replica, node_id, gpu_id, gpu_index, reserved_at, "
                        "kind, unit, profile, gpu_milli, released_at) VALUES (:job, 1, 0, :node, :gpu, :idx, 0, 'mig', 0, "
                        "'x', 0, 1)"
                    ),
                    dict(job=j.id, node=node_id, gpu=gpu_id, idx=sl.gpu),
                )
        finally:
            engine.dispose()


@pytest.mark.parametrize(
    "spec, code, text_",
    [
        (dict(mig_profile="3g.40gb", gpu_milli=100), grpc.StatusCode.INVALID_ARGUMENT, "not both"),
        (dict(mig_profile="5g.50gb"), grpc.StatusCode.INVALID_ARGUMENT, "is not a MIG profile"),
        (dict(gpu_milli=1000), grpc.StatusCode.INVALID_ARGUMENT, "gpu_milli must be 1-999"),
        (dict(gpu_milli=-5), grpc.StatusCode.INVALID_ARGUMENT, "gpu_milli must be 1-999"),
        (dict(mig_profile="1g.10gb", gpus=2), grpc.StatusCode.INVALID_ARGUMENT, "gpus_per_replica must be 1"),
        (dict(mig_profile="1g.5gb"), grpc.StatusCode.FAILED_PRECONDITION, "no known node's GPUs offer MIG profile"),
        (dict(gpu_model="B200"), grpc.StatusCode.FAILED_PRECONDITION, "no known node has GPU model 'B200'"),
        (dict(gpu_model="H100", replicas=2, gpus=2), grpc.StatusCode.FAILED_PRECONDITION, "hold at most 1 replicas"),
    ],
)
async def test_bad_partial_requests_are_refused_and_write_nothing(db_url, spec, code, text_):
    async with Cluster(db_url, models=(H100, L40S)) as c:
        spec = dict(spec)
        kw = dict(replicas=spec.pop("replicas", 1), gpus=spec.pop("gpus", 1))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit("bad", **kw, **spec)
        assert err.value.code() == code and text_ in err.value.details()
        assert c.sql("SELECT count(*) FROM jobs") == [(0,)]


async def _cli(capsys, *argv) -> tuple[int, str]:
    """The CLI's client is synchronous and the scheduler lives on this event loop: run it in a thread."""
    code = await asyncio.to_thread(cli_main, list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return code, out


async def test_gpu_model_and_cli_flags_end_to_end(db_url, capsys, service_logs):
    async with Cluster(db_url, models=(H100, L40S)) as c:
        target = c.scheduler.address
        _, out = await _cli(
            capsys,
            "--scheduler",
            target,
            "submit",
            "--name",
            "frac",
            "--replicas",
            "1",
            "--gpu-milli",
            "500",
            "--gpu-model",
            "l40s",
            "--json",
            "--",
            "run",
        )
        job = await c.wait_running(json.loads(out)["id"])
        assert job.allocations[0].node == "node-1" and job.allocations[0].gpu_milli == 500
        _, out = await _cli(
            capsys,
            "--scheduler",
            target,
            "submit",
            "--name",
            "mig",
            "--replicas",
            "1",
            "--mig",
            "1g.10gb",
            "--json",
            "--",
            "run",
        )
        mig_id = json.loads(out)["id"]
        await c.wait_running(mig_id)
        _, out = await _cli(capsys, "--scheduler", target, "job", mig_id, "--json")
        shown = json.loads(out)
        (alloc,) = shown["allocations"]
        assert alloc["node"] == "node-0" and alloc["slices"][0]["profile"] == "1g.10gb"
        assert set(alloc["slices"][0]) == {"gpu", "profile", "start", "size"} and "gpu_milli" not in alloc
        assert shown["mig_profile"] == "1g.10gb" and shown["placement"]["reason"]
        _, human = await _cli(capsys, "--scheduler", target, "job", mig_id)
        assert "1 x MIG 1g.10gb" in human and "fragmentation" in human and ":1g.10gb@" in human


async def test_migration_0003_keeps_whole_gpu_allocations_and_their_guard(empty_db_url):
    """A ledger written before partial GPUs: its allocation rows become whole-GPU rows (kind gpu, unit -1), the
    scheduler reads them back as held GPUs, and the index still refuses a second holder of the same GPU."""
    from db.migrate import current, head_revision, upgrade

    url = empty_db_url
    upgrade(url, "0002")
    engine = make_engine(url)
    with engine.begin() as conn:  # a node with 2 GPUs and a job holding GPU 0, as a 0002 scheduler wrote them
        conn.execute(
            text(
                "INSERT INTO nodes (id, name, state, message, gpus, gpu_model, profile, address, topology, fabric_path, "
                "agent_instance, registered_at, last_heartbeat, revision, acked_revision) VALUES (1, 'node-0', 'READY', "
                "'', 2, :model, 'lite', '127.0.0.1', '{}', '[]', 'x', 1, 1, 0, 0)"
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
                "INSERT INTO jobs (id, request_id, name, state, priority, replicas, gpus_per_replica, procs_per_replica, "
                "command, env, attempt, message, exit_code, placement, submitted_at, started_at, finished_at, version, "
                "required_tier, preferred_tier) VALUES ('0123456789ab', NULL, 'old', 'RUNNING', 0, 1, 1, 0, '[\"run\"]', "
                "'{}', 1, '', 0, '{}', 1.0, 2.0, 0, 1, '', '')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO allocations (job_id, attempt, replica, node_id, gpu_id, gpu_index, "
                "reserved_at) VALUES ('0123456789ab', 1, 0, 1, 1, 0, 2.0)"
            )
        )
    upgrade(url)
    assert current(url) == head_revision()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT kind, unit, profile, gpu_milli FROM allocations")).all() == [
            ("gpu", -1, "", 0)
        ]
        assert conn.execute(text("SELECT gpu_model, mig_profile, gpu_milli FROM jobs")).all() == [("", "", 0)]
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO allocations (job_id, attempt, replica, node_id, gpu_id, gpu_index, "
                "reserved_at) VALUES ('0123456789ab', 1, 0, 1, 1, 0, 3.0)"
            )
        )
    engine.dispose()
    # The scheduler sees GPU 0 held: a share goes to GPU 1.
    async with Cluster(url, mig_gpus=()) as c:
        j = await c.wait_running((await c.submit("share", gpu_milli=250)).id)
        assert j.allocations[0].gpus == [1]
