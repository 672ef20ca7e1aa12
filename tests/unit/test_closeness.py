"""Intra-node GPU choice from the node's per-pair topo matrix (core.closeness, placement.pick_gpus)."""

from __future__ import annotations

import itertools
import json
import random
import time

import pytest
from google.protobuf.json_format import MessageToDict
from sqlalchemy import create_engine

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.closeness import GpuCloseness
from phalanx.core.model import GangRequest, NodeCapacity
from phalanx.core.placement import Unplaceable, pick_gpus, place_gang
from phalanx.core.topo_dump import TopoDump, link_rank, matrix_from_pairs
from phalanx.profiles import list_profiles, load_profile
from services.node_agent.simulated import simulated_topology
from services.scheduler import ledger
from services.scheduler.state import SchedulerState


def _closeness(profile: str) -> GpuCloseness:
    return GpuCloseness.from_dump(load_profile(profile).dump)


def _numa(profile: str) -> dict[int, int]:
    dump = load_profile(profile).dump
    return {int(g[3:]): dump.numa_node(g) for g in dump.gpus}


def _place_on_one_node(free: set[int], count: int, closeness: GpuCloseness | None, total: int = 8):
    cap = ClusterCapacity([NodeCapacity("n0", total, set(free), True, (), closeness)])
    result = place_gang(cap, GangRequest("j", 1, count))
    assert not isinstance(result, Unplaceable), result
    return result.replicas[0].gpus


def _nvlink_down_dump(down: int = 2) -> TopoDump:
    """A DGX H100 matrix whose GPU `down` has lost its NVLinks: SYS to every peer, NV18 between the others."""
    gpus = [f"GPU{i}" for i in range(8)]

    def cell(a: str, b: str) -> str:
        return "SYS" if f"GPU{down}" in (a, b) else "NV18"

    return TopoDump(devices=gpus, matrix=matrix_from_pairs(gpus, cell))


# -- the rank matrix ---------------------------------------------------------------------------------------------


def test_rank_matrix_is_symmetric_and_from_link_rank():
    c = _closeness("pcie-2numa")
    assert c.size == 8 and not c.uniform
    for a, b in itertools.permutations(range(8), 2):
        assert c.rank(a, b) == c.rank(b, a)
    assert c.rank(0, 1) == link_rank("PIX")
    assert c.rank(0, 2) == link_rank("NODE")
    assert c.rank(0, 4) == link_rank("SYS")
    assert c.rank(3, 3) == 0 and c.rank(0, 99) == 0
    assert _closeness("dgx-h100").uniform
    assert c.score((0, 1, 2, 3)) == (link_rank("NODE"), 2 * link_rank("PIX") + 4 * link_rank("NODE"))


def test_every_shipped_profile_builds_a_closeness():
    for name in list_profiles():
        c = _closeness(name)
        assert c.size == load_profile(name).gpu_count


def test_from_topology_matches_the_dump_and_tolerates_missing_matrices():
    for name in ("pcie-2numa", "dgx-a100", "dgx-h100"):
        topo = MessageToDict(simulated_topology("n1", name), preserving_proto_field_name=True)
        assert GpuCloseness.from_topology(topo) == _closeness(name)
        # through JSON and back, as the ledger stores it
        assert GpuCloseness.from_topology(json.loads(json.dumps(topo))) == _closeness(name)
    assert GpuCloseness.from_topology(None) is None
    assert GpuCloseness.from_topology({}) is None
    assert GpuCloseness.from_topology({"gpus": [{"index": 1}], "profile": "lite"}) is None
    assert GpuCloseness.from_topology({"matrix": {"NIC0": {"cells": {"NIC1": "SYS"}}}}) is None
    assert ledger.node_closeness("not json") is None
    assert ledger.node_closeness(json.dumps({"matrix": {"GPU0": {"cells": {"GPU1": "NV4"}}}})).rank(0, 1) == link_rank(
        "NV4"
    )


def test_more_bonded_nvlinks_are_closer_then_pcie_order():
    order = ["NV18", "NV12", "NV4", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS"]
    ranks = [link_rank(c) for c in order]
    assert ranks == sorted(ranks, reverse=True) and len(set(ranks)) == len(ranks)


# -- pick_gpus ---------------------------------------------------------------------------------------------------


def test_pcie_4_gpu_job_on_an_empty_node_stays_in_one_numa_node():
    c, numa = _closeness("pcie-2numa"), _numa("pcie-2numa")
    gpus = _place_on_one_node(set(range(8)), 4, c)
    assert len({numa[g] for g in gpus}) == 1
    assert gpus == (0, 1, 2, 3)


@pytest.mark.parametrize("used", [{1}, {0}, {2}, {1, 2}, {5}, {6, 7}])
def test_pcie_4_gpu_job_with_one_numa_half_partly_used_takes_the_other_half(used):
    c, numa = _closeness("pcie-2numa"), _numa("pcie-2numa")
    gpus = _place_on_one_node(set(range(8)) - used, 4, c)
    assert len({numa[g] for g in gpus}) == 1
    assert not set(gpus) & used


def test_pcie_2_and_4_gpu_jobs_stay_numa_local_whenever_a_local_set_is_free():
    c, numa = _closeness("pcie-2numa"), _numa("pcie-2numa")
    rng = random.Random(7)
    for _ in range(400):
        free = {g for g in range(8) if rng.random() < 0.6}
        for k in (2, 4):
            if len(free) <= k:
                continue
            gpus = pick_gpus(free, k, c)
            assert len(gpus) == k and set(gpus) <= free and list(gpus) == sorted(gpus)
            local_possible = any(sum(1 for g in free if numa[g] == n) >= k for n in (0, 1))
            if local_possible:
                assert len({numa[g] for g in gpus}) == 1, (free, k, gpus)
            if k == 2 and any({a, a + 1} <= free for a in (0, 2, 4, 6)):
                assert c.rank(*gpus) == link_rank("PIX"), (free, gpus)


def test_pcie_pair_never_crosses_numa_where_index_order_would():
    c = _closeness("pcie-2numa")
    assert pick_gpus({3, 4, 6}, 2) == (3, 4)  # by index: contiguous, but GPU3-GPU4 is SYS
    assert pick_gpus({3, 4, 6}, 2, c) == (4, 6)  # NODE, inside NUMA 1


def test_uniform_nvlink_box_keeps_todays_choice():
    c = _closeness("dgx-h100")
    rng = random.Random(3)
    for _ in range(300):
        free = {g for g in range(8) if rng.random() < 0.6}
        for k in range(1, 9):
            assert pick_gpus(free, k, c) == pick_gpus(free, k)
    assert _place_on_one_node(set(range(1, 8)), 4, c) == (4, 5, 6, 7)


def test_tie_breaks_follow_the_index_order_among_equally_close_sets():
    # Non-uniform (pcie), but several sets equally close: the aligned block, then contiguous, then lowest.
    c = _closeness("pcie-2numa")
    assert pick_gpus(set(range(8)), 2, c) == (0, 1)
    assert pick_gpus(set(range(1, 8)), 2, c) == (2, 3)


def test_a_gpu_with_its_nvlinks_down_is_not_paired_while_an_nvlinked_pair_is_free():
    dump = _nvlink_down_dump(2)
    c = GpuCloseness.from_dump(dump)
    assert not c.uniform and c.rank(2, 3) == link_rank("SYS") and c.rank(0, 1) == link_rank("NV18")
    assert pick_gpus({2, 3, 4, 5}, 2) == (2, 3)  # by index it would take the broken GPU
    assert pick_gpus({2, 3, 4, 5}, 2, c) == (4, 5)
    for free in map(set, itertools.chain.from_iterable(itertools.combinations(range(8), n) for n in range(3, 8))):
        nvlinked = free - {2}
        for k in (2, 3, 4):
            if len(nvlinked) >= k and len(free) > k:
                gpus = pick_gpus(free, k, c)
                assert 2 not in gpus, (free, k, gpus)
    assert _place_on_one_node({2, 3, 6}, 2, c) == (3, 6)


def test_more_bonded_links_win():
    gpus = [f"GPU{i}" for i in range(4)]
    links = {frozenset({0, 1}): "NV4", frozenset({2, 3}): "NV12"}

    def cell(a: str, b: str) -> str:
        return links.get(frozenset({int(a[3:]), int(b[3:])}), "NV1")

    c = GpuCloseness.from_matrix(gpus, cell)
    assert pick_gpus({0, 1, 2, 3}, 2, c) == (2, 3)
    assert pick_gpus({0, 1, 2}, 2, c) == (0, 1)


def test_without_closeness_the_choice_is_unchanged():
    rng = random.Random(11)
    for _ in range(200):
        free = {g for g in range(8) if rng.random() < 0.6}
        for k in range(1, 9):
            assert pick_gpus(free, k, None) == pick_gpus(free, k)


def test_pick_is_fast_enough_for_a_scheduling_cycle():
    c = _closeness("pcie-2numa")
    start = time.perf_counter()
    for _ in range(200):
        pick_gpus({0, 2, 3, 4, 5, 6, 7}, 4, c)
    assert time.perf_counter() - start < 1.0


def test_large_nodes_fall_back_to_the_index_order():
    gpus = [f"GPU{i}" for i in range(32)]
    c = GpuCloseness.from_matrix(gpus, lambda a, b: "NV18" if (int(a[3:]) // 4) == (int(b[3:]) // 4) else "SYS")
    free = set(range(1, 32))
    assert pick_gpus(free, 8, c) == pick_gpus(free, 8)


# -- gangs -------------------------------------------------------------------------------------------------------


def test_replicas_on_one_node_each_get_a_close_slice():
    c = _closeness("pcie-2numa")
    cap = ClusterCapacity([NodeCapacity("n0", 8, {1, 2, 3, 4, 5, 6}, True, (), c)])
    result = place_gang(cap, GangRequest("j", 2, 2))
    assert not isinstance(result, Unplaceable)
    for rep in result.replicas:
        assert c.rank(*rep.gpus) == link_rank("PIX"), result.replicas


def test_multi_node_gangs_keep_rail_aligned_indices():
    c = _closeness("pcie-2numa")
    nodes = [
        NodeCapacity("a", 8, {3, 4, 6, 7}, True, ("leaf0",), c),
        NodeCapacity("b", 8, {3, 4, 6, 7}, True, ("leaf0",), c),
    ]
    result = place_gang(ClusterCapacity(nodes), GangRequest("j", 2, 3))
    assert not isinstance(result, Unplaceable)
    assert {r.gpus for r in result.replicas} == {pick_gpus({3, 4, 6, 7}, 3)}


# -- the scheduler's view and the place CLI ------------------------------------------------------------------------


def test_scheduler_state_built_from_the_ledger_carries_closeness(sqlite_url):
    engine = create_engine(sqlite_url)
    topo = MessageToDict(simulated_topology("n1", "pcie-2numa"), preserving_proto_field_name=True)
    gpus = [dict(index=i, uuid=f"GPU-{i}", name="NVIDIA L40S", memory_mib=46068) for i in range(8)]
    with engine.begin() as conn:
        ledger.upsert_node(
            conn,
            name="n1",
            gpus=gpus,
            topology=topo,
            address="127.0.0.1",
            agent_instance="x",
            profile="pcie-2numa",
            gpu_model="NVIDIA L40S",
            fabric_path=["leaf0"],
            now=1.0,
        )
        ledger.upsert_node(
            conn,
            name="lite",
            gpus=gpus,
            topology={"profile": "lite"},
            address="127.0.0.1",
            agent_instance="y",
            profile="lite",
            gpu_model="x",
            fabric_path=["leaf0"],
            now=1.0,
        )
    state = SchedulerState()
    with engine.connect() as conn:
        ledger.load_state(conn, state, lambda name: ())
    engine.dispose()
    assert state.nodes["n1"].closeness == _closeness("pcie-2numa")
    assert state.nodes["lite"].closeness is None
    node = state.capacity.nodes["n1"]
    assert node.closeness == _closeness("pcie-2numa")
    assert state.capacity.nodes["lite"].closeness is None
    state.capacity.take("n1", (0, 1, 2, 5, 7))
    state.capacity.set_schedulable("lite", False)
    result = place_gang(state.capacity, GangRequest("j", 1, 2))
    assert not isinstance(result, Unplaceable)
    assert result.replicas[0].node == "n1"
    assert result.replicas[0].gpus == (4, 6)  # by index alone: 3-4, across the NUMA nodes


def test_place_cli_with_the_pcie_profile_chooses_numa_local_gpus(capsys, tmp_path):
    from phalanx.cli.main import main

    fabric = tmp_path / "topology.conf"
    fabric.write_text("SwitchName=leaf0 Nodes=n01\n")
    lines = [{"name": "four", "replicas": 1, "gpus_per_replica": 4}, {"release": "four"}]
    lines += [{"name": f"s{i}", "replicas": 1, "gpus_per_replica": 1} for i in range(8)]
    lines += [{"release": "s3"}, {"release": "s4"}, {"release": "s6"}]
    lines += [{"name": "pair", "replicas": 1, "gpus_per_replica": 2}]
    requests = tmp_path / "jobs.jsonl"
    requests.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    args = ["place", "--fabric", str(fabric), "--profile", "pcie-2numa", "--requests", str(requests)]
    assert main([*args, "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    got = {line["name"]: line["allocations"][0]["gpus"] for line in out if line.get("placed")}
    assert got["four"] == [0, 1, 2, 3]  # one NUMA node
    assert got["pair"] == [4, 6]  # GPU3 + GPU4 would be contiguous by index but cross NUMA (SYS)
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "pair  PLACED  1 x 2 GPUs  n01:[4,6]" in text


async def test_a_node_registering_with_a_running_scheduler_brings_its_closeness(sqlite_url):
    """Live registration (not only a reload from the ledger) gives placement the node's topology matrix."""
    import grpc

    from phalanx.api.v1 import agent_pb2, agent_pb2_grpc
    from services.node_agent.simulated import simulated_topology
    from services.scheduler.main import serve
    from services.scheduler.settings import SchedulerSettings

    running = await serve(SchedulerSettings(db_url=sqlite_url, listen="127.0.0.1:0"))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = agent_pb2_grpc.NodeServiceStub(channel)
            await stub.RegisterNode(
                agent_pb2.RegisterNodeRequest(
                    node_name="pcie-1", topology=simulated_topology("pcie-1", "pcie-2numa"), agent_instance="a"
                )
            )
        node = running.service.state.capacity.nodes["pcie-1"]
        assert node.closeness is not None and not node.closeness.uniform
    finally:
        await running.stop()
