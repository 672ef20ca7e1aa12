"""Multi-level gangs (placement.segments): each segment of S replicas inside one domain of its tier, the segments on
as few higher-tier domains as possible, a segment's ranks contiguous, one placement or none."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric, group_nvlink_domains
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import Unplaceable, domain_of, place_gang
from phalanx.core.placement.segments import default_segment_tier


def nvl_cluster(
    domains: int = 4, per_domain: int = 4, gpus: int = 4, per_leaf: int = 2, used: dict[str, int] | None = None
):
    """`domains` NVLink domains of `per_domain` nodes, `per_leaf` domains under each leaf, leaves under one spine."""
    names = [f"n{i:03d}" for i in range(domains * per_domain)]
    fabric = group_nvlink_domains(default_fabric(names, nodes_per_leaf=per_domain * per_leaf), per_domain)
    used = used or {}
    cap = ClusterCapacity(
        NodeCapacity(n, gpus, set(range(used.get(n, 0), gpus)), True, fabric.path(n)) for n in fabric.paths
    )
    return cap, fabric.tiers


def free_of(cap: ClusterCapacity) -> dict[str, frozenset[int]]:
    return {n: frozenset(node.free) for n, node in cap.nodes.items()}


def check_segments(cap: ClusterCapacity, p: Placement, s: int, level: int = 1) -> None:
    assert [r.replica for r in p.replicas] == list(range(len(p.replicas)))
    assert len(p.segments) == len(p.replicas) // s
    for i, domain in enumerate(p.segments):
        block = p.replicas[i * s : (i + 1) * s]
        assert {domain_of(cap.nodes[r.node], level) for r in block} == {domain}
    taken = [(r.node, gpu) for r in p.replicas for gpu in r.gpus]
    assert len(taken) == len(set(taken))  # no GPU twice, even with two segments in one domain


def test_default_tier_is_nvlink_else_leaf():
    assert default_segment_tier(("nvlink", "leaf", "spine")) == "nvlink"
    assert default_segment_tier(("leaf", "spine")) == "leaf"
    assert default_segment_tier(()) == "cluster"


def test_each_segment_lies_in_one_nvlink_domain_and_its_ranks_are_contiguous():
    cap, tiers = nvl_cluster()
    before = free_of(cap)
    p = place_gang(cap, GangRequest("j", 8, 4, segment=4), tiers)
    assert isinstance(p, Placement)
    check_segments(cap, p, 4)
    assert len(set(p.segments)) == 2
    assert free_of(cap) == before  # placing reserves nothing: the caller does, all at once


def test_segments_spread_over_the_fewest_higher_tier_domains():
    # leaf0 holds nvl-0 (4 free nodes) and nvl-1 (2 free); leaf1 holds nvl-2 and nvl-3, all free. Two segments of 4
    # nodes fit on leaf1 alone: that beats nvl-0 plus a domain of leaf1 (two leaves), although nvl-0 is "tighter".
    cap, tiers = nvl_cluster(used={"n004": 4, "n005": 4})
    p = place_gang(cap, GangRequest("j", 8, 4, segment=4), tiers)
    assert isinstance(p, Placement)
    check_segments(cap, p, 4)
    assert {domain_of(cap.nodes[r.node], 2) for r in p.replicas} == {"leaf1"}
    assert p.tier == "leaf" and p.domains == 2


def test_a_segment_too_big_for_any_free_domain_waits_naming_it_although_the_gpus_are_free():
    # Every domain has 3 of its 4 nodes free: 12 free nodes hold 8 replicas, but no domain holds a segment of 4.
    cap, tiers = nvl_cluster(used={f"n{i:03d}": 4 for i in (0, 4, 8, 12)})
    before = free_of(cap)
    got = place_gang(cap, GangRequest("j", 8, 4, segment=4), tiers)
    assert isinstance(got, Unplaceable)
    assert "segment 1 of 2 (4 x 4 GPUs) fits in no free nvlink domain now" in got.reason
    assert free_of(cap) == before
    plain = place_gang(cap, GangRequest("j", 8, 4), tiers)
    assert isinstance(plain, Placement)  # the same gang unsegmented fits


def test_all_or_nothing_when_only_some_segments_fit():
    cap, tiers = nvl_cluster(used={f"n{i:03d}": 4 for i in (0, 4, 8)})  # only nvl-3 is whole
    before = free_of(cap)
    got = place_gang(cap, GangRequest("j", 8, 4, segment=4), tiers)
    assert isinstance(got, Unplaceable) and "segment 2 of 2" in got.reason
    assert free_of(cap) == before


def test_two_segments_share_a_domain_without_sharing_a_gpu():
    cap, tiers = nvl_cluster(domains=2, per_domain=2, gpus=8)
    p = place_gang(cap, GangRequest("j", 4, 4, segment=2), tiers)  # 2 segments of 2 x 4 GPUs: one domain holds both
    assert isinstance(p, Placement)
    check_segments(cap, p, 2)
    assert len(set(p.segments)) == 1 and p.tier == "nvlink"


def test_leaf_tier_without_nvlink_and_an_unknown_tier():
    names = [f"n{i}" for i in range(8)]
    fabric = default_fabric(names, nodes_per_leaf=4)
    cap = ClusterCapacity(NodeCapacity(n, 8, set(range(8)), True, fabric.path(n)) for n in names)
    p = place_gang(cap, GangRequest("j", 6, 8, segment=3), fabric.tiers)
    assert isinstance(p, Placement)
    check_segments(cap, p, 3)
    assert sorted(p.segments) == ["leaf0", "leaf1"]
    got = place_gang(cap, GangRequest("j", 6, 8, segment=3, segment_tier="rack"), fabric.tiers)
    assert isinstance(got, Unplaceable) and "unknown segment_tier 'rack'" in got.reason


def test_required_tier_bounds_the_segments_and_node_tier_segments():
    cap, tiers = nvl_cluster()
    p = place_gang(cap, GangRequest("j", 8, 4, segment=4, required_tier="leaf"), tiers)
    assert isinstance(p, Placement)
    assert len({domain_of(cap.nodes[r.node], 2) for r in p.replicas}) == 1
    got = place_gang(cap, GangRequest("j", 12, 4, segment=4, required_tier="leaf"), tiers)
    assert isinstance(got, Unplaceable)
    assert (
        "3 segments of 4 x 4 GPUs, each in one nvlink, must lie under one leaf (required_tier); the best leaf holds 2"
        in got.reason
    )
    p = place_gang(cap, GangRequest("j", 4, 2, segment=2, segment_tier="node"), tiers)
    assert isinstance(p, Placement)
    check_segments(cap, p, 2, level=0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=16, max_size=16),
    st.sampled_from([(4, 1), (4, 2), (8, 2), (8, 4), (6, 3), (12, 4), (2, 1)]),
    st.sampled_from([1, 2, 4]),
)
def test_random_segmented_gangs_keep_every_segment_in_one_domain(used, shape, g):
    cap, tiers = nvl_cluster(used={f"n{i:03d}": u for i, u in enumerate(used)})
    replicas, s = shape
    before = free_of(cap)
    got = place_gang(cap, GangRequest("j", replicas, g, segment=s), tiers)
    assert free_of(cap) == before
    if isinstance(got, Placement):
        check_segments(cap, got, s)
        assert all(len(r.gpus) == g and set(r.gpus) <= before[r.node] for r in got.replicas)
        cap.reserve(got)  # the placement is one valid reservation
    else:
        # It waits only when the free domains really hold fewer segments than asked.
        holds = sum(
            sum(len(n.free) // g for n in cap.members(1, d)) // s for d in {domain_of(n, 1) for n in cap.nodes.values()}
        )
        assert holds < replicas // s


@pytest.mark.parametrize("segment", [0, 5])
def test_a_segment_that_does_not_divide_the_gang_is_placed_as_a_plain_gang(segment):
    # The servicer refuses it at submit; the core never crashes on one.
    cap, tiers = nvl_cluster()
    p = place_gang(cap, GangRequest("j", 8, 4, segment=segment), tiers)
    assert isinstance(p, Placement) and p.segments == ()
