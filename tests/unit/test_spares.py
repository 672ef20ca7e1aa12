"""Spares kept in the domain (phalanx.core.spares): a segmented gang placed with K extra replicas per segment, split
into the gang (ranks contiguous per segment) and its spares (in their segment's domain), and the swap decision."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric, group_nvlink_domains
from phalanx.core.gang_recovery import choose_swap
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import domain_of, place_gang
from phalanx.core.spares import (
    SpareSlot,
    inflated,
    slot_of,
    spare_replica,
    split_spares,
    swapped_allocations,
)


def nvl_cluster(domains: int = 2, per_domain: int = 3, gpus: int = 4):
    names = [f"n{i:03d}" for i in range(domains * per_domain)]
    fabric = group_nvlink_domains(default_fabric(names, nodes_per_leaf=per_domain * 2), per_domain)
    cap = ClusterCapacity(NodeCapacity(n, gpus, set(range(gpus)), True, fabric.path(n)) for n in fabric.paths)
    return cap, fabric.tiers


def place_with_spares(cap, tiers, replicas: int, gpus: int, segment: int, spares: int) -> tuple[Placement, list]:
    r, s = inflated(replicas, segment, spares)
    p = place_gang(cap, GangRequest("j", r, gpus, segment=s), tiers)
    assert isinstance(p, Placement), p
    return split_spares(p, segment, spares)


def test_inflated_counts_the_spares_per_segment():
    assert inflated(4, 2, 1) == (6, 3)
    assert inflated(8, 4, 2) == (12, 6)
    assert inflated(4, 2, 0) == (4, 2)
    assert inflated(4, 0, 1) == (4, 0)  # no segments: nothing to keep spares in (refused at submit)
    assert [spare_replica(k) for k in range(3)] == [-1, -2, -3]
    assert all(slot_of(spare_replica(k)) == k for k in range(5))


def test_two_segments_with_one_spare_each_fill_two_domains_and_keep_ranks_contiguous():
    cap, tiers = nvl_cluster()
    gang, slots = place_with_spares(cap, tiers, 4, 4, 2, 1)
    assert [r.replica for r in gang.replicas] == [0, 1, 2, 3]
    assert len(gang.segments) == 2 and len(set(gang.segments)) == 2
    for i, domain in enumerate(gang.segments):
        assert {domain_of(cap.nodes[r.node], 1) for r in gang.replicas[2 * i : 2 * i + 2]} == {domain}
    assert [(s.slot, s.segment, s.replica) for s in slots] == [(0, 0, -1), (1, 1, -2)]
    for s in slots:
        assert domain_of(cap.nodes[s.node], 1) == s.domain == gang.segments[s.segment]
        assert s.booked and len(s.gpus) == 4
    used = {r.node for r in gang.replicas} | {s.node for s in slots}
    assert len(used) == 6  # whole-node replicas: every spare is a node of its own


def test_a_segment_that_cannot_hold_its_spares_does_not_fit():
    cap, tiers = nvl_cluster(per_domain=3)
    r, s = inflated(4, 2, 2)  # 4 nodes per segment, the domains hold 3
    assert not isinstance(place_gang(cap, GangRequest("j", r, 4, segment=s), tiers), Placement)


def test_swap_takes_the_spare_of_the_dead_nodes_segment_and_keeps_the_rest():
    allocations = [(0, "a0", (0,)), (1, "a1", (0,)), (2, "b0", (0,)), (3, "b1", (0,))]
    slots = [SpareSlot(0, 0, "nvl-0", "a2", (0,)), SpareSlot(1, 1, "nvl-1", "b2", (0,))]
    chosen = choose_swap([(r, n) for r, n, _ in allocations], slots, 2, ["nvl-0", "nvl-1"], "b0")
    assert chosen == {2: slots[1]}
    after = swapped_allocations(allocations, chosen)
    assert after == [(0, "a0", (0,)), (1, "a1", (0,)), (2, "b2", (0,)), (3, "b1", (0,))]


def test_no_swap_without_a_usable_spare_in_the_domain():
    actives = [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    other_domain = [SpareSlot(0, 0, "nvl-0", "a2")]
    assert choose_swap(actives, other_domain, 2, ["nvl-0", "nvl-1"], "b0") is None
    missing = [SpareSlot(0, 0, "nvl-0"), SpareSlot(1, 1, "nvl-1")]  # not booked
    assert choose_swap(actives, missing, 2, ["nvl-0", "nvl-1"], "b0") is None
    lost = [SpareSlot(1, 1, "nvl-1", "b2")]
    assert choose_swap(actives, lost, 2, ["nvl-0", "nvl-1"], "b0", unusable={"b2"}) is None
    assert choose_swap(actives, lost, 2, ["nvl-0", "nvl-1"], "zz") is None  # the gang has nothing there


def test_a_spare_of_another_segment_in_the_same_domain_serves():
    actives = [(0, "a0"), (1, "a1"), (2, "a2"), (3, "a3")]  # both segments in nvl-0
    slots = [SpareSlot(0, 0, "nvl-0", "a4"), SpareSlot(1, 1, "nvl-0", "")]
    assert choose_swap(actives, slots, 2, ["nvl-0", "nvl-0"], "a3") == {3: slots[0]}


def test_a_node_of_two_replicas_needs_two_spares():
    actives = [(0, "a0"), (1, "a0"), (2, "b0"), (3, "b0")]  # two replicas per node
    one = [SpareSlot(0, 0, "nvl-0", "a1"), SpareSlot(1, 1, "nvl-1", "b1")]
    assert choose_swap(actives, one, 2, ["nvl-0", "nvl-1"], "a0") is None
    two = [SpareSlot(0, 0, "nvl-0", "a1"), SpareSlot(1, 0, "nvl-0", "a1")]
    assert choose_swap(actives, two, 2, ["nvl-0", "nvl-1"], "a0") == {0: two[0], 1: two[1]}


@settings(max_examples=40, deadline=None)
@given(
    segments=st.integers(1, 3),
    segment=st.integers(1, 3),
    spares=st.integers(1, 2),
    dead_pick=st.integers(0, 100),
)
def test_swaps_keep_spares_in_their_domain_and_ranks_off_spares(segments, segment, spares, dead_pick):
    cap, tiers = nvl_cluster(domains=3, per_domain=5)
    r, s = inflated(segments * segment, segment, spares)
    p = place_gang(cap, GangRequest("j", r, 4, segment=s), tiers)
    if not isinstance(p, Placement):
        return
    gang, slots = split_spares(p, segment, spares)
    assert len(slots) == segments * spares
    for slot in slots:
        assert domain_of(cap.nodes[slot.node], 1) == gang.segments[slot.segment]
    allocations = [(x.replica, x.node, tuple(x.gpus)) for x in gang.replicas]
    dead = allocations[dead_pick % len(allocations)][1]
    chosen = choose_swap([(x, n) for x, n, _ in allocations], slots, segment, gang.segments, dead)
    assert chosen is not None  # one spare per segment at least, on a node of its own
    after = swapped_allocations(allocations, chosen)
    assert [x for x, _, _ in after] == [x for x, _, _ in allocations]  # the same rank order
    for (rep, node, _), (_, before, _) in zip(after, allocations, strict=True):
        assert node != dead
        if before != dead:
            assert node == before  # only the dead node's replicas move
        assert domain_of(cap.nodes[node], 1) == gang.segments[rep // segment]


# ---- invariant (i) and the model world ------------------------------------------------------------------------------


def test_the_model_world_swaps_a_spare_in_and_keeps_every_invariant():
    from phalanx.core import invariants as inv
    from phalanx.testing.world import ClusterSpec, Scenario, parse_actions, run

    scenario = Scenario(
        ClusterSpec(nodes=6, gpus=4, per_leaf=6, nvlink=3),
        parse_actions(
            """
            submit train 4x4 seg=2 sp=1 work=300
            submit waiter 1x4 work=5
            advance 1
            down 0
            advance 1
            down 0
            advance 5
            """
        ),
    )
    world = run(scenario)
    assert not world.violations, world.violations
    starts = [e for e in world.history if isinstance(e, inv.Started) and e.job == "train"]
    swaps = [e for e in starts if e.swap_of]
    assert swaps and swaps[0].swap_of == 1 and len(swaps[0].spares) == 1  # one spare used, one left
    assert all(e.job != "waiter" for e in world.history[: world.history.index(swaps[0])] if isinstance(e, inv.Started))


def test_invariant_i_catches_a_spare_outside_its_domain_a_rank_on_a_spare_and_a_gap_in_a_swap():
    from phalanx.core import invariants as inv

    domains = {"nvlink": {"a0": "d0", "a1": "d0", "a2": "d0", "b0": "d1", "b1": "d1", "b2": "d1"}}
    nodes = {n: 1 for n in domains["nvlink"]}

    def checker():
        c = inv.Checker()
        c.feed(inv.Cluster(0.0, nodes, tiers=("nvlink",), domains=domains))
        c.feed(inv.Submitted(0.0, "j", 0, replicas=2, gpus_per_replica=1, segment=1, spares=1))
        return c

    def started(spares, spare_nodes, attempt=1, swap_of=0, ranks=("a0", "b0")):
        holds = tuple(inv.Hold(n, 0) for n in (*ranks, *spare_nodes))
        return inv.Started(
            1.0, "j", attempt, holds, len(holds), "", ranks, spares, tuple(inv.Hold(n, 0) for n in spare_nodes), swap_of
        )

    ok = started(((0, "a1"), (1, "b1")), ("a1", "b1"))
    assert not checker().feed(ok)
    outside = checker().feed(started(((0, "b1"), (1, "b2")), ("b1", "b2")))
    assert [v.invariant for v in outside] == ["i"] and "outside its domain" in outside[0].what
    on_rank = checker().feed(started(((0, "a0"), (1, "b1")), ("a0", "b1")))
    assert any(v.invariant == "i" and "rank on a spare" in v.what for v in on_rank)

    c = checker()
    c.feed(ok)
    c.feed(inv.NodeDown(2.0, "b0"))
    c.feed(inv.Ended(2.0, "j", 1, "NODE_LOST"))
    c.feed(inv.Reserved(2.0, "", float("nan")))  # anything between the end and the restart: the slot was open
    gap = c.feed(started(((0, "a1"),), ("a1",), attempt=2, swap_of=1, ranks=("a0", "b1")))
    assert [v.invariant for v in gap] == ["i"] and "not right after it ended" in gap[0].what


def test_a_spare_booked_again_is_not_written_for_a_gang_torn_down_later_in_the_cycle():
    import copy
    from types import SimpleNamespace

    from services.scheduler.spares import still_booked
    from services.scheduler.state import JobRecord

    def gang(job_id: str) -> JobRecord:
        job = JobRecord(job_id, job_id, "RUNNING", 0, 2, 4, 0, ["run"], {}, 0.0, attempt=3)
        job.spares = [(-1, "n1", (0, 1, 2, 3))]
        return job

    kept, torn, swapped = gang("kept"), gang("torn"), gang("swapped")
    stubs = []
    for job in (kept, torn, swapped):
        stub = copy.copy(job)
        stub.allocations, stub.spares = [], list(job.spares)
        stubs.append(stub)
    torn.state = "PENDING"  # torn down (or preempted) after the spare was booked again
    swapped.attempt = 4
    cycle = SimpleNamespace(
        work=SimpleNamespace(new_spares=stubs), state=SimpleNamespace(jobs={j.id: j for j in (kept, torn, swapped)})
    )
    assert [s.id for s in still_booked(cycle)] == ["kept"]
