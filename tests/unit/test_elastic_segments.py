"""Elastic gangs with segments and spares kept in the domain (phalanx.core.elastic_units): such a gang is placed,
grown, shrunk and preempted by whole segments, each with its spares in its domain, and the invariants judge it so."""

from __future__ import annotations

from dataclasses import replace

from phalanx.core import invariants as inv
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.decide import (
    AskCheckpoint,
    DecideConfig,
    PendingJob,
    Reserve,
    RunningJob,
    SetClaim,
    Snapshot,
    Stop,
    decide,
)
from phalanx.core.elastic_units import round_up, running_size, segment_of, split_at_minimum
from phalanx.core.fabric import default_fabric, group_nvlink_domains
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import Unplaceable, domain_of, place_gang
from phalanx.core.preemption import CORE, SHRINK, PreemptionPolicy, RunningGang, elastic_parts
from phalanx.core.snapshot import ElasticPolicy
from phalanx.core.spares import inflated, inflated_min, split_spares

NOW = 10_000.0
GROW = ElasticPolicy(grow_interval_s=60.0, min_step=1, min_fraction=0.0, grace_period_s=30.0)


def nvl_cluster(domains: int = 3, per_domain: int = 3, used: frozenset[str] = frozenset()):
    """`domains` NVLink domains of `per_domain` 4-GPU nodes; the `used` nodes have no GPU free."""
    names = [f"n{i:03d}" for i in range(domains * per_domain)]
    fabric = group_nvlink_domains(default_fabric(names, nodes_per_leaf=per_domain * domains), per_domain)
    cap = ClusterCapacity(
        NodeCapacity(n, 4, set() if n in used else set(range(4)), True, fabric.path(n)) for n in fabric.paths
    )
    return cap, fabric.tiers


def request(lo: int, hi: int, segment: int, spares: int = 0, job: str = "e", priority: int = 0) -> GangRequest:
    """The gang as the scheduler hands it to the core: counted with its spares (core.spares.inflated)."""
    r, s = inflated(hi, segment, spares)
    return GangRequest(
        job, r, 4, priority, 1.0, segment=s, min_replicas=inflated_min(lo, segment, spares), spares=spares
    )


def with_spares(p: Placement, segment: int, spares: int) -> Placement:
    """A placement as a running gang holds it: its ranks, then its spares under negative replica indexes."""
    gang, slots = split_spares(p, segment, spares)
    return replace(gang, replicas=gang.replicas + tuple(ReplicaPlacement(s.replica, s.node, s.gpus) for s in slots))


def test_placement_takes_the_most_whole_segments_that_fit():
    # 3 domains of 3 nodes; one node of the third domain is taken: that domain holds no segment of 2 + 1 spare.
    cap, tiers = nvl_cluster(used=frozenset({"n006"}))
    got = place_gang(cap, request(2, 6, 2, 1), tiers)
    assert isinstance(got, Placement)
    assert len(got.replicas) == 6 and len(got.segments) == 2  # 2 of 3 segments, each with its spare
    assert "elastic: 2 of at most 3 segments fit now" in got.reason
    gang, slots = split_spares(got, 2, 1)
    assert [r.replica for r in gang.replicas] == [0, 1, 2, 3]
    for s in slots:
        assert domain_of(cap.nodes[s.node], 1) == s.domain == got.segments[s.segment]


def test_placement_without_spares_takes_whole_segments_only():
    # 5 free nodes in 3 domains of 3 (one domain has 2 taken): a plain elastic gang would take 5, one of segments of
    # 2 takes 4, in two domains.
    cap, tiers = nvl_cluster(used=frozenset({"n007", "n008"}))
    got = place_gang(cap, request(2, 6, 2), tiers)
    assert isinstance(got, Placement) and len(got.replicas) == 4
    for i in (0, 2):
        assert len({domain_of(cap.nodes[r.node], 1) for r in got.replicas[i : i + 2]}) == 1


def test_placement_refuses_below_the_minimum_in_segments():
    cap, tiers = nvl_cluster(used=frozenset({"n002", "n005", "n008"}))  # 2 free nodes a domain: no segment of 2 + 1
    got = place_gang(cap, request(2, 6, 2, 1), tiers)
    assert isinstance(got, Unplaceable) and "minimum of 1 of 3 segments" in got.reason


def test_units_count_segments_with_their_spares_booked_or_not():
    req = request(2, 6, 2, 1)  # core units: 9 replicas, segments of 3, minimum 3
    assert (req.replicas, req.segment, req.min_replicas, req.spares) == (9, 3, 3, 1)
    reps = [ReplicaPlacement(i, f"a{i}", (0,)) for i in range(4)] + [ReplicaPlacement(-1, "s0", (0,))]
    assert running_size(req, reps) == 6  # 2 segments, one spare missing: still 2 segments' worth
    assert round_up(req, 7) == 9 and round_up(req, 6) == 6 and round_up(req, 12) == 9
    assert [segment_of(req, r) for r in (0, 1, 2, 3, -1, -2)] == [0, 0, 1, 1, 0, 1]
    keep, rest = split_at_minimum(req, [*reps, ReplicaPlacement(-2, "s1", (0,))])
    assert sorted(r.replica for r in keep) == [-1, 0, 1] and sorted(r.replica for r in rest) == [-2, 2, 3]


def running(req: GangRequest, placement: Placement, cap: ClusterCapacity, started: float = 0.0) -> RunningJob:
    cap.reserve(placement)
    return RunningJob(req, placement, started, progress_since=started)


def test_grows_by_whole_segments_with_their_spares():
    cap, tiers = nvl_cluster()
    req = request(2, 6, 2, 1)
    small = place_gang(cap, replace(req, replicas=3, min_replicas=0), tiers)  # one segment and its spare
    assert isinstance(small, Placement)
    gang = running(req, with_spares(small, 2, 1), cap)
    config = DecideConfig(elastic=GROW, tiers=tiers)
    plan = decide(Snapshot(capacity=cap, pending=[], running={"e": gang}, config=config), NOW)
    (ask,) = plan.of(AskCheckpoint)
    assert ask.request == "elastic grow: from 1 to 3 segments"  # (core units 3 to 9: segments of 2 ranks + 1 spare)
    asked = replace(gang, preempted_by="e", deadline=NOW + 30.0, checkpoint_pending=False)
    plan = decide(Snapshot(capacity=cap, pending=[], running={"e": asked}, config=config), NOW + 5)
    (stop,) = plan.of(Stop)
    assert stop.resize
    (reserve,) = plan.of(Reserve)
    assert len(reserve.placement.replicas) == 9 and len(reserve.placement.segments) == 3
    assert small.segments[0] in reserve.placement.segments  # its own domain kept


def test_a_grow_targets_a_whole_segment():
    # 2 segments of 2 running in 4 domains of 2 nodes; one more domain is free and half of another: it grows to 3
    # segments (6 replicas), never to the 7 a plain elastic gang would take.
    cap, tiers = nvl_cluster(domains=4, per_domain=2, used=frozenset({"n007"}))
    req = request(2, 8, 2)
    first = place_gang(cap, replace(req, replicas=4, min_replicas=0), tiers)
    assert isinstance(first, Placement)
    gang = running(req, first, cap)
    config = DecideConfig(elastic=GROW, tiers=tiers)
    (ask,) = decide(Snapshot(capacity=cap, pending=[], running={"e": gang}, config=config), NOW).of(AskCheckpoint)
    assert ask.request == "elastic grow: from 2 to 3 segments"


def test_preemption_shrinks_a_segmented_victim_by_whole_segments_and_their_spares():
    cap, tiers = nvl_cluster(domains=2, per_domain=3)
    req = request(2, 4, 2, 1)
    whole = place_gang(cap, req, tiers)
    assert isinstance(whole, Placement) and len(whole.replicas) == 6
    held = with_spares(whole, 2, 1)
    victim = running(req, held, cap)
    parts = elastic_parts(RunningGang("e", 0, held, 0.0), req)
    assert [p.part for p in parts] == [SHRINK, CORE]
    shrink, core = (sorted(r.replica for r in p.placement.replicas) for p in parts)
    assert shrink == [-2, 2, 3] and core == [-1, 0, 1]  # segment 1 with its spare; segment 0 with its own
    urgent = GangRequest("urgent", 3, 4, 100, 5.0)  # one domain's worth
    policy = PreemptionPolicy(min_runtime_s=0.0, grace_period_s=0.0)
    snap = Snapshot(
        capacity=cap,
        pending=[PendingJob(urgent)],
        running={"e": victim},
        config=DecideConfig(preemption=policy, tiers=tiers),
    )
    plan = decide(snap, NOW)
    (claim,) = plan.of(SetClaim)
    second = {r.node for r in held.replicas if segment_of(req, r.replica) == 1}
    assert {r.node for r in claim.claim.replicas} == second  # what it gives up: its second segment and that spare
    placed = {r.job: r.placement for r in plan.of(Reserve)}
    assert len(placed["urgent"].replicas) == 3  # (no grace period: both placed again in this decision)
    assert len(placed["e"].replicas) == 3 and len(placed["e"].segments) == 1  # at its minimum: a segment, a spare
    (ask,) = plan.of(AskCheckpoint)
    assert "restarts at its minimum of 1 segment" in ask.message


def test_invariants_count_an_elastic_gangs_ranks_without_its_spares():
    cluster = inv.Cluster(0.0, {f"n{i}": 4 for i in range(6)})
    submit = inv.Submitted(0.0, "e", 0, replicas=4, gpus_per_replica=4, segment=2, spares=1, min_replicas=2)

    def start(nodes: list[str], spares: list[str]) -> inv.Started:
        holds = tuple(inv.Hold(n, g) for n in nodes + spares for g in range(4))
        spare_holds = tuple(inv.Hold(n, g) for n in spares for g in range(4))
        booked = tuple((i, n) for i, n in enumerate(spares))
        return inv.Started(1.0, "e", 1, holds, len(holds), "", tuple(nodes), booked, spare_holds)

    assert not inv.check([cluster, submit, start(["n0", "n1"], ["n2"])])  # one segment of 2 and its spare
    bad = inv.check([cluster, submit, start(["n0"], ["n2"])])  # half a segment, below its minimum
    assert {v.invariant for v in bad} == {"h", "i", "j"}  # (a spare without a whole segment: i)
