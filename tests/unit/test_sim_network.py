"""The simulator's network model (phalanx.sim.network): ring AllReduce times, bottlenecks, uplink contention."""

from __future__ import annotations

import pytest

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.cost import ring_cost
from phalanx.core.fabric import Fabric, default_fabric, group_nvlink_domains
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import place_gang
from phalanx.sim.network import (
    GB,
    IB,
    NVLINK,
    NVLINK_DOMAIN,
    UPLINK,
    NetJob,
    NetworkSpec,
    NetworkState,
    Uplink,
    allreduce_time,
    bottleneck,
    max_min_fair,
    ring_demand,
    uplink_capacity,
)

S = 1e9  # bytes AllReduced per step (500M bf16 gradients)
COMPUTE = 0.1  # seconds of compute per step


def gang(job_id: str, nodes: list[str], gpus: int = 8) -> Placement:
    """One replica of `gpus` GPUs (0..gpus-1, rail-aligned) per node, in ring order."""
    reps = tuple(ReplicaPlacement(i, node, tuple(range(gpus))) for i, node in enumerate(nodes))
    return Placement(job_id, reps, tier="spine", domains=len(nodes), score=0.0, reason="test")


def two_leaves(oversubscription: float = 4.0) -> tuple[Fabric, NetworkSpec]:
    """8 DGX H100 nodes, 4 per leaf (leaf0: n0-n3, leaf1: n4-n7), one spine. With 4:1, a leaf's uplink carries
    4 nodes x 8 rails x 50 GB/s / 4 = 400 GB/s."""
    return (
        default_fabric([f"n{i}" for i in range(8)], nodes_per_leaf=4),
        NetworkSpec(oversubscription=oversubscription),
    )


def capacity(fabric: Fabric) -> ClusterCapacity:
    return ClusterCapacity(NodeCapacity(n, 8, set(range(8)), True, fabric.path(n)) for n in sorted(fabric.paths))


# ---- the formula ------------------------------------------------------------------------------------------------


def test_allreduce_time_is_nccl_ring_formula():
    # 2(n-1)/n x S / B: 8 ranks, 1 GB at 450 GB/s -> 1.75 GB / 450 GB/s
    assert allreduce_time(1e9, 8, 450 * GB) == pytest.approx(1.75e9 / 450e9, rel=1e-15)
    # 2 ranks: each rank sends S (2 x 1/2 x S)
    assert allreduce_time(4e9, 2, 50 * GB) == pytest.approx(0.08, rel=1e-15)
    # large n tends to 2S/B
    assert allreduce_time(1e9, 1024, 100 * GB) == pytest.approx(2 * 1023 / 1024 * 1e9 / 100e9, rel=1e-15)
    assert allreduce_time(1e9, 1, 1.0) == 0.0
    assert allreduce_time(0, 16, 1.0) == 0.0
    with pytest.raises(ValueError):
        allreduce_time(1e9, 4, 0.0)


def test_busbw_algbw_relation():
    # NCCL tests report busbw = algbw x 2(n-1)/n, algbw = S / t: our t gives busbw back exactly.
    n, B = 16, 400 * GB
    t = allreduce_time(S, n, B)
    assert (S / t) * 2 * (n - 1) / n == pytest.approx(B, rel=1e-12)


def test_spec_defaults_and_uplink_capacity():
    spec = NetworkSpec()
    assert spec.nvlink_bw == 450e9 and spec.ib_rail_bw == 50e9 and spec.nics_per_node == 8
    assert spec.uplink_capacity(0, 4) == 4 * 8 * 50e9  # non-blocking: everything the leaf's nodes can send
    assert NetworkSpec(oversubscription=2.0).uplink_capacity(0, 4) == 800e9
    assert NetworkSpec(oversubscription=2.0, upper_oversubscription=2.0).uplink_capacity(1, 32) == 32 * 400e9 / 4
    with pytest.raises(ValueError):
        NetworkSpec(oversubscription=0.5)


# ---- bottlenecks ------------------------------------------------------------------------------------------------


def test_single_node_gang_uses_nvlink_and_beats_a_two_node_one():
    fabric, spec = two_leaves(oversubscription=1.0)
    cap = capacity(fabric)
    one = place_gang(cap, GangRequest("one", 1, 8), fabric.tiers)
    two = place_gang(cap, GangRequest("two", 2, 8), fabric.tiers)
    assert isinstance(one, Placement) and isinstance(two, Placement)
    assert len(one.nodes) == 1 and len(two.nodes) == 2
    b1, b2 = bottleneck(one, fabric, spec), bottleneck(two, fabric, spec)
    assert (b1.link, b1.bandwidth) == (NVLINK, 450e9)
    # Two full nodes: NCCL's channels spread over the 8 rails, 8 x 50 GB/s per node boundary.
    assert (b2.link, b2.bandwidth) == (IB, 400e9)
    t1, t2 = allreduce_time(S, 8, b1.bandwidth), allreduce_time(S, 16, b2.bandwidth)
    assert t1 == pytest.approx(1.75e9 / 450e9) and t2 == pytest.approx(1.875e9 / 400e9)
    assert t1 < t2
    # A small gang split over two nodes has one NIC per node: 50 GB/s against 450 GB/s on NVLink, 9x slower.
    local = gang("local", ["n0"], gpus=2)
    split = Placement(
        "split", (ReplicaPlacement(0, "n0", (0,)), ReplicaPlacement(1, "n1", (0,))), "leaf", 2, 0.0, "test"
    )
    bl, bs = bottleneck(local, fabric, spec), bottleneck(split, fabric, spec)
    assert (bl.link, bl.bandwidth) == (NVLINK, 450e9) and (bs.link, bs.bandwidth) == (IB, 50e9)
    assert allreduce_time(S, 2, bs.bandwidth) == pytest.approx(9 * allreduce_time(S, 2, bl.bandwidth))


def test_nvlink_domain_gang_uses_domain_nvlink():
    nodes = [f"gb{i:02d}" for i in range(4)]
    fabric = group_nvlink_domains(default_fabric(nodes, nodes_per_leaf=4), nodes_per_domain=2)
    spec = NetworkSpec(nics_per_node=4)
    inside = gang("in", ["gb00", "gb01"], gpus=4)
    across = gang("across", ["gb00", "gb02"], gpus=4)
    b_in, b_across = bottleneck(inside, fabric, spec), bottleneck(across, fabric, spec)
    assert (b_in.link, b_in.bandwidth) == (NVLINK_DOMAIN, 900e9)
    assert (b_across.link, b_across.bandwidth) == (IB, 4 * 50e9)
    assert ring_demand(inside, fabric, spec).uplinks == {}
    # one tray of the domain: its own GPUs also talk through the domain's NVSwitches
    tray = bottleneck(gang("tray", ["gb03"], gpus=4), fabric, spec)
    assert (tray.link, tray.bandwidth) == (NVLINK_DOMAIN, 900e9)


def test_oversubscription_bounds_a_lone_cross_leaf_gang():
    fabric, spec = two_leaves(oversubscription=4.0)
    job = gang("a", ["n0", "n4"])
    demand = ring_demand(job, fabric, spec)
    assert demand.uplinks == {Uplink(0, "leaf", "leaf0"): 1.0, Uplink(0, "leaf", "leaf1"): 1.0}
    assert demand.bandwidth == 400e9
    assert bottleneck(job, fabric, spec).bandwidth == 400e9  # the uplink holds one full-rate ring
    spec8 = NetworkSpec(oversubscription=8.0)
    b = bottleneck(job, fabric, spec8)
    assert (b.link, b.bandwidth) == (UPLINK, 200e9) and b.uplink.tier == "leaf"


def test_uplink_crossings_match_ring_cost():
    fabric = default_fabric([f"n{i}" for i in range(16)], nodes_per_leaf=2, leaves_per_spine=4)
    job = gang("zigzag", ["n0", "n2", "n1", "n3", "n8"])
    demand = ring_demand(job, fabric, NetworkSpec())
    leaf_edges = sum(e for up, e in demand.uplinks.items() if up.level == 0)
    spine_edges = sum(e for up, e in demand.uplinks.items() if up.level == 1)
    cost = ring_cost(job, fabric)
    assert leaf_edges == cost.leaf_crossings == 5
    assert spine_edges == cost.spine_crossings == 2
    # leaf0 (n0, n1) is left twice: its uplink carries two edges' worth, which halves the ring's share.
    assert demand.uplinks[Uplink(0, "leaf", "leaf0")] == 2.0


def test_rail_changes_go_up_on_rail_optimized_fabrics():
    fabric = default_fabric([f"n{i}" for i in range(4)], nodes_per_leaf=4, rails=8)
    aligned = Placement("a", (ReplicaPlacement(0, "n0", (0, 1)), ReplicaPlacement(1, "n1", (0, 1))), "leaf", 2, 0, "")
    crossed = Placement("c", (ReplicaPlacement(0, "n0", (0, 1)), ReplicaPlacement(1, "n1", (2, 3))), "leaf", 2, 0, "")
    spec = NetworkSpec()
    assert ring_demand(aligned, fabric, spec).uplinks == {}
    # every channel changes rail, both ways: two edges up to the spine
    assert ring_demand(crossed, fabric, spec).uplinks == {Uplink(0, "leaf", "leaf0"): 2.0}


# ---- contention -------------------------------------------------------------------------------------------------


def test_two_jobs_share_an_oversubscribed_uplink():
    fabric, spec = two_leaves(oversubscription=4.0)
    up = Uplink(0, "leaf", "leaf0")
    assert uplink_capacity(fabric, spec, up) == 400e9
    net = NetworkState(fabric, spec)
    a = NetJob(gang("a", ["n0", "n4"]), S, COMPUTE)
    b = NetJob(gang("b", ["n1", "n5"]), S, COMPUTE)
    alone = COMPUTE + 1.875e9 / 400e9  # 2(16-1)/16 x 1 GB at the full 8 x 50 GB/s
    shared = COMPUTE + 1.875e9 / 200e9  # half of the 400 GB/s uplink each

    assert net.add(a) == {"a": 400e9}
    assert net.step_time("a") == pytest.approx(alone, rel=1e-12)
    assert net.add(b) == {"a": 200e9, "b": 200e9}
    for job in ("a", "b"):
        assert net.bandwidth(job) == pytest.approx(200e9, rel=1e-12)
        assert net.step_time(job) == pytest.approx(shared, rel=1e-12)
        assert net.step_time(job) == pytest.approx(0.109375, rel=1e-12)
        assert net.bottleneck(job).link == UPLINK
    load, cap = net.uplink_load()[up]
    assert load == pytest.approx(cap, rel=1e-12)

    assert net.remove("b") == {"a": 400e9}
    assert net.step_time("a") == pytest.approx(alone, rel=1e-12)
    assert net.step_time("a") == pytest.approx(0.1046875, rel=1e-12)
    assert net.bottleneck("a").link == IB


def test_max_min_fairness_three_jobs():
    fabric, spec = two_leaves(oversubscription=4.0)
    net = NetworkState(fabric, spec)
    # "small" has one GPU (one rail, 50 GB/s) per node; the others eight.
    small = NetJob(gang("small", ["n2", "n6"], gpus=1), S, COMPUTE)
    a = NetJob(gang("a", ["n0", "n4"]), S, COMPUTE)
    b = NetJob(gang("b", ["n1", "n5"]), S, COMPUTE)
    for job in (small, a, b):
        net.add(job)
    # the small demand is met in full; a and b split the rest of the 400 GB/s equally
    assert net.bandwidth("small") == pytest.approx(50e9, rel=1e-12)
    assert net.bottleneck("small").link == IB
    assert net.bandwidth("a") == pytest.approx(175e9, rel=1e-12)
    assert net.bandwidth("b") == pytest.approx(175e9, rel=1e-12)
    assert net.step_time("small") == pytest.approx(COMPUTE + 1e9 / 50e9, rel=1e-12)
    assert net.step_time("a") == pytest.approx(COMPUTE + 1.875e9 / 175e9, rel=1e-12)
    net.remove("a")
    assert net.bandwidth("b") == pytest.approx(350e9, rel=1e-12)
    assert net.bandwidth("small") == pytest.approx(50e9, rel=1e-12)


def test_max_min_fair_progressive_filling_on_two_links():
    # x crosses both links, y only L1, z only L2: L1 = 10 fills first (x = y = 5); z takes the rest of L2.
    alloc = max_min_fair(
        {"L1": 10.0, "L2": 30.0},
        {"x": {"L1": 1, "L2": 1}, "y": {"L1": 1}, "z": {"L2": 1}},
        {"x": 100.0, "y": 100.0, "z": 100.0},
    )
    assert alloc.rates == pytest.approx({"x": 5.0, "y": 5.0, "z": 25.0})
    assert alloc.limits == {"x": "L1", "y": "L1", "z": "L2"}
    # a flow that crosses a link twice gets half of what a single crossing would
    alloc = max_min_fair({"L": 30.0}, {"twice": {"L": 2}, "once": {"L": 1}}, {"twice": 100.0, "once": 100.0})
    assert alloc.rates == pytest.approx({"twice": 10.0, "once": 10.0})


def test_gang_inside_one_leaf_is_not_affected_by_uplink_contention():
    fabric, spec = two_leaves(oversubscription=4.0)
    net = NetworkState(fabric, spec)
    inside = NetJob(gang("inside", ["n2", "n3"]), S, COMPUTE)
    net.add(inside)
    before = net.step_time("inside")
    assert before == pytest.approx(COMPUTE + 1.875e9 / 400e9, rel=1e-12)
    changed = net.add(NetJob(gang("a", ["n0", "n4"]), S, COMPUTE))
    changed |= net.add(NetJob(gang("b", ["n1", "n5"]), S, COMPUTE))
    assert "inside" not in changed
    assert net.step_time("inside") == before
    assert net.bottleneck("inside").link == IB
    assert net.cross_spine_bytes("inside") == 0.0


def test_cross_spine_bytes():
    fabric, spec = two_leaves(oversubscription=4.0)
    net = NetworkState(fabric, spec)
    net.add(NetJob(gang("a", ["n0", "n4"]), S, COMPUTE))
    net.add(NetJob(gang("inside", ["n2", "n3"]), S, COMPUTE))
    # two ring edges leave a leaf (n0 -> n4, n4 -> n0), each 2(16-1)/16 x S per step
    assert net.cross_spine_bytes("a") == pytest.approx(2 * 1.875e9)
    assert net.uplink_bytes("a") == {"leaf": pytest.approx(2 * 1.875e9)}
    assert net.total_cross_spine_bytes() == pytest.approx(2 * 1.875e9)


def test_add_twice_and_remove_unknown():
    fabric, spec = two_leaves()
    net = NetworkState(fabric, spec)
    job = NetJob(gang("a", ["n0"]), S, COMPUTE)
    net.add(job)
    with pytest.raises(ValueError):
        net.add(job)
    with pytest.raises(KeyError):
        net.remove("nope")
    assert net.jobs() == ["a"]
    assert net.step_time("a") == pytest.approx(COMPUTE + 1.75e9 / 450e9)
