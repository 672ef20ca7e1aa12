"""The invariant checks themselves (phalanx/core/invariants.py): each one catches the history that breaks it and
passes the one that keeps it, with the violating event named."""

from __future__ import annotations

import math

import pytest

from phalanx.core import invariants as inv
from phalanx.core.invariants import (
    Asked,
    CalledOff,
    ClaimEnded,
    ClaimMade,
    Cluster,
    Ended,
    Finished,
    Hold,
    MigMode,
    NodeDown,
    Quiet,
    Released,
    Reserved,
    Started,
    Submitted,
    check,
)
from phalanx.core.quota import FlavorQuota, QueueSpec

pytestmark = pytest.mark.unit

CLUSTER = Cluster(0.0, {"n1": 8, "n2": 8, "n3": 8})
MIG_CLUSTER = Cluster(0.0, {"n1": 8, "n2": 8, "n3": 8}, frozenset({("n3", 7)}))


def whole(node: str, *gpus: int) -> tuple[Hold, ...]:
    return tuple(Hold(node, g) for g in gpus)


def eight(node: str) -> tuple[Hold, ...]:
    return whole(node, *range(8))


def submit(t: float, job: str, priority: int = 0, replicas: int = 1, per: int = 8, queue: str = "default"):
    return Submitted(t, job, priority, queue, replicas, per, (float(replicas * per), 0.0))


def letters(violations: list[inv.Violation]) -> list[str]:
    return [v.invariant for v in violations]


# ---- (a) exclusive, whole gangs -------------------------------------------------------------------------------------


def test_a_gpu_held_by_two_attempts_is_caught_releasing_ones_included():
    base = [CLUSTER, submit(0, "x"), Started(0, "x", 1, eight("n1"), 8), submit(0, "y")]
    clash = [*base, Started(1, "y", 1, eight("n1"), 8)]
    v = check(clash)[0]
    assert v.invariant == "a" and v.index == 4 and "job x attempt 1 (running)" in v.what

    # Ended, but n1 still holds its GPUs until it confirms: still a clash ...
    releasing = [*base, Ended(1, "x", 1, "PREEMPTED", ("n1",)), Started(2, "y", 1, eight("n1"), 8)]
    assert set(letters(check(releasing))) == {"a"} and "releasing" in check(releasing)[0].what
    # ... and none once it confirmed.
    released = [
        *base,
        Ended(1, "x", 1, "PREEMPTED", ("n1",)),
        Released(2, "x", 1, "n1"),
        Started(3, "y", 1, eight("n1"), 8),
    ]
    assert check(released) == []


def test_a_partial_gang_is_caught():
    (v,) = check([CLUSTER, submit(0, "x", replicas=2), Started(0, "x", 1, eight("n1"), 16)])
    assert v.invariant == "a" and "8 of its 16 GPUs" in v.what


# ---- (b) no priority inversion ----------------------------------------------------------------------------------------


def _preempted(claim: bool) -> list[inv.Event]:
    events: list[inv.Event] = [
        CLUSTER,
        submit(0, "batch", -100, replicas=2),
        Started(0, "batch", 1, eight("n1") + eight("n2"), 16),
        submit(5, "critical", 200, replicas=3),
    ]
    if claim:
        events.append(ClaimMade(6, "critical", eight("n1") + eight("n2") + eight("n3"), ("batch",)))
    events += [
        Asked(6, "batch", 1, "critical"),
        Ended(9, "batch", 1, "PREEMPTED", ("n1", "n2")),
        Released(10, "batch", 1, "n2"),
    ]
    return events


def test_b_a_lower_gang_on_claimed_gpus_is_caught_and_on_unclaimed_ones_is_not():
    events = [*_preempted(claim=True), Started(10, "batch", 2, eight("n2"), 8)]
    (v, *_) = check(events)
    assert v.invariant == "b" and "claimed by preemptor critical" in v.what and "whose victim it was" in v.what
    other = [*_preempted(claim=True), submit(10, "small", 0, per=1), Started(10, "small", 1, whole("n3", 6), 1)]
    assert "b" in letters(check(other))  # n3's GPUs are claimed too
    outside = [*_preempted(claim=True)[:4], ClaimMade(6, "critical", eight("n1"), ("batch",))]
    outside += [*_preempted(claim=True)[5:], submit(10, "small", 0, per=1), Started(10, "small", 1, whole("n3", 6), 1)]
    assert "b" not in letters(check(outside))


def test_b_without_claims_the_mechanism_free_check_sees_the_inversion_once_the_preemptor_runs():
    events = [
        *_preempted(claim=False),
        Started(10, "batch", 2, eight("n2"), 8),  # the victim took back the node freed first
        Ended(20, "batch", 2, "SUCCEEDED"),
        Released(20, "batch", 1, "n1"),
        Started(21, "critical", 1, eight("n1") + eight("n2") + eight("n3"), 24),
    ]
    found = [v for v in check(events) if v.invariant == "b"]
    assert found and "job batch (priority -100) started at t=10" in found[0].what


# ---- (c) no thrash ----------------------------------------------------------------------------------------------------


def test_c_a_second_ask_by_the_same_waiting_preemptor_is_caught():
    events = [
        *_preempted(claim=False),
        Started(10, "batch", 2, eight("n2"), 8),
        Asked(15, "batch", 2, "critical"),
    ]
    assert "preempted again by critical (time 2)" in " ".join(v.what for v in check(events) if v.invariant == "c")


def test_c_a_preemption_cycle_across_waits_is_caught_and_a_cascade_is_not():
    base = [
        CLUSTER,
        submit(0, "v"),
        submit(0, "p", 100),
        Started(0, "v", 1, eight("n1"), 8),
        Asked(1, "v", 1, "p"),
        Ended(1, "v", 1, "PREEMPTED"),
        Started(1, "p", 1, eight("n1"), 8),
    ]
    # The victim takes it back by a reclaim, then the preemptor preempts it again: a cycle.
    cycle = [
        *base,
        Asked(2, "p", 1, "v", reclaim=True),
        Ended(2, "p", 1, "PREEMPTED"),
        Started(2, "v", 2, eight("n1"), 8),
        Asked(3, "v", 2, "p"),
    ]
    assert any("a preemption cycle" in v.what for v in check(cycle))
    # A third gang of higher priority preempted it in between: a cascade, not a cycle.
    cascade = [
        *base,
        submit(2, "top", 200),
        Asked(2, "p", 1, "top"),
        Ended(2, "p", 1, "PREEMPTED"),
        Started(2, "top", 1, eight("n1"), 8),
        Ended(3, "top", 1, "SUCCEEDED"),
        Finished(3, "top", "SUCCEEDED"),
        Started(3, "v", 2, eight("n1"), 8),
        Asked(4, "v", 2, "p"),
    ]
    assert not [v for v in check(cascade) if v.invariant == "c"]


def test_c_victims_asked_where_even_their_gpus_cannot_make_the_preemptor_fit_are_caught():
    events = [
        CLUSTER,
        submit(0, "small"),
        Started(0, "small", 1, eight("n1"), 8),
        submit(0, "big", 100, replicas=4),
        Asked(1, "small", 1, "big"),
        Quiet(2),  # (any next event: the decision's asks are judged together)
    ]
    found = [v for v in check(events) if v.invariant == "c"]
    assert found and "would fit 3 of its 4 replicas" in found[0].what


def test_c_a_preemptor_that_waits_past_its_victims_release_is_caught_unless_capacity_was_lost():
    events = [
        *_preempted(claim=True),
        Released(11, "batch", 1, "n1"),
        Started(15, "critical", 1, eight("n1") + eight("n2") + eight("n3"), 24),
    ]
    (v,) = [v for v in check(events) if v.invariant == "c"]
    assert "started 4s after its victims were stopped and released (at t=11)" in v.what
    lost = events[:-1] + [NodeDown(12, "n3"), events[-1]]
    assert not [v for v in check(lost) if v.invariant == "c"]
    # Stopped later than its grace period allows
    late = [*_preempted(claim=True)]
    late[6] = Ended(30, "batch", 1, "PREEMPTED", ("n1", "n2"))
    assert any("grace period 3s" in v.what for v in check(late, grace_s=3.0))


# ---- (d) liveness -----------------------------------------------------------------------------------------------------


def test_d_after_the_quiet_point_every_gang_that_fits_ends():
    events = [CLUSTER, submit(0, "x"), submit(0, "never", replicas=9), Quiet(1)]
    found = check(events)
    assert letters(found) == ["d", "d"]  # "never" does not fit the cluster, but was submitted as if it did
    events = [CLUSTER, submit(0, "x"), Quiet(1, owed=frozenset({"x"})), Started(2, "x", 1, eight("n1"), 8)]
    events += [Ended(3, "x", 1, "SUCCEEDED"), Finished(3, "x", "SUCCEEDED")]
    assert check(events) == []


def test_d_a_reservation_pushed_back_by_a_gang_behind_the_head_is_caught():
    events = [
        CLUSTER,
        submit(0, "head", 100, replicas=3),
        Reserved(1, "head", 60.0),
        submit(1, "late", 0),
        Started(2, "late", 1, eight("n1"), 8),
        Reserved(2, "head", 90.0),
    ]
    (v,) = check(events)
    assert v.invariant == "d" and "after job late, behind it in the queue" in v.what
    # A gang ahead of it in the queue may push it; so may capacity lost; and a new head resets it.
    ahead = [*events[:3], submit(1, "top", 200), Started(2, "top", 1, eight("n1"), 8), events[5]]
    assert check(ahead) == []
    other_head = [*events[:5], Reserved(2, "", math.nan), events[5]]
    assert check(other_head) == []
    # A victim's preemption called off: the deadline the reservation counted as its end no longer holds.
    called_off = [*events[:5], CalledOff(2, "victim", 1), events[5]]
    assert check(called_off) == []


# ---- (e) quotas -------------------------------------------------------------------------------------------------------

QUEUES = {
    "a": QueueSpec("a", {"*": FlavorQuota(gpus=8.0, borrow_limit=8.0)}, cohort="lab"),
    "b": QueueSpec("b", {"*": FlavorQuota(gpus=8.0)}, cohort="lab"),
}


def test_e_a_queue_above_nominal_plus_what_it_may_borrow_is_caught():
    events = [
        CLUSTER,
        submit(0, "y", queue="b"),
        Started(0, "y", 1, eight("n2"), 8, "*"),
        submit(0, "x", replicas=2, queue="a"),
        Started(1, "x", 1, eight("n1") + eight("n3"), 16, "*"),  # would borrow 8 that b uses itself
    ]
    (v,) = check(events, queues=QUEUES)
    assert v.invariant == "e" and "queue 'a' runs 16 GPU(s)" in v.what
    # With b idle, a may borrow its 8.
    idle = [CLUSTER, submit(0, "x", replicas=2, queue="a"), Started(1, "x", 1, eight("n1") + eight("n2"), 16, "*")]
    assert check(idle, queues=QUEUES) == []


def test_e_a_reclaim_of_a_queue_that_is_not_borrowing_or_beyond_what_it_borrowed_is_caught():
    events = [
        CLUSTER,
        submit(0, "x", queue="a"),
        Started(0, "x", 1, eight("n1"), 8, "*"),
        submit(0, "r", queue="b"),
        Asked(1, "x", 1, "r", reclaim=True),
        Quiet(2),
    ]
    assert any("not borrowing" in v.what for v in check(events, queues=QUEUES) if v.invariant == "e")


# ---- (f) MIG and shares -----------------------------------------------------------------------------------------------


def test_f_mig_instances_only_in_mig_mode_shares_within_one_gpu():
    events = [MIG_CLUSTER, submit(0, "m", per=1), Started(0, "m", 1, (Hold("n1", 0, mig_mask=0b111),), 1)]
    assert "f" in letters(check(events))
    events = [MIG_CLUSTER, submit(0, "m", per=1), Started(0, "m", 1, (Hold("n3", 7, mig_mask=0b111),), 1)]
    assert check(events) == []
    shares = [
        CLUSTER,
        submit(0, "s1", per=1),
        submit(0, "s2", per=1),
        Started(0, "s1", 1, (Hold("n1", 0, milli=600),), 1),
        Started(0, "s2", 1, (Hold("n1", 0, milli=500),), 1),
    ]
    assert "f" in letters(check(shares))
    switched = [CLUSTER, submit(0, "x"), Started(0, "x", 1, eight("n1"), 8), MigMode(1, "n1", 0, True)]
    assert "f" in letters(check(switched))


def test_claim_events_end():
    events = [*_preempted(claim=True), ClaimEnded(10, "critical", "it runs"), Started(10, "batch", 2, eight("n2"), 8)]
    assert "b" not in letters(check(events)[:1])


# ---- (j) segments -----------------------------------------------------------------------------------------------------

SEG_CLUSTER = Cluster(
    0.0,
    {"n1": 8, "n2": 8, "n3": 8, "n4": 8},
    tiers=("nvlink", "leaf"),
    domains={
        "nvlink": {"n1": "nvl-0", "n2": "nvl-0", "n3": "nvl-1", "n4": "nvl-1"},
        "leaf": dict.fromkeys("n1 n2 n3 n4".split(), "leaf0"),
    },
)


def test_j_a_segment_across_two_domains_or_with_ranks_interleaved_is_caught():
    def run(nodes: tuple[str, ...], tier: str = ""):
        holds = tuple(h for n in dict.fromkeys(nodes) for h in eight(n))
        seg = Submitted(0, "g", 0, "default", 4, 8, (32.0, 0.0), segment=2, segment_tier=tier)
        return check([SEG_CLUSTER, seg, Started(0, "g", 1, holds, 32, replica_nodes=nodes)])

    assert run(("n1", "n2", "n3", "n4")) == []
    first, second = run(("n1", "n3", "n2", "n4"))  # both domains used, but each segment's ranks span both
    assert first.invariant == second.invariant == "j"
    assert "segment 0 (ranks 0-1) spans nvlink domains ['nvl-0', 'nvl-1']" in first.what
    assert "segment 1 (ranks 2-3)" in second.what
    assert letters(run(("n1", "n3", "n2", "n4"), tier="leaf")) == []  # one leaf holds every segment
    plain = [
        SEG_CLUSTER,
        submit(0, "p", replicas=4),
        Started(
            0, "p", 1, eight("n1") + eight("n3") + eight("n2") + eight("n4"), 32, replica_nodes=("n1", "n3", "n2", "n4")
        ),
    ]
    assert check(plain) == []  # a plain gang has no segments to keep


# ---- (h) elastic gangs -------------------------------------------------------------------------------------------


def test_h_an_elastic_gang_runs_between_its_minimum_and_maximum_of_whole_replicas():
    elastic = Submitted(0, "e", 0, "default", 3, 8, (24.0, 0.0), min_replicas=2)
    grown = [CLUSTER, elastic, Started(0, "e", 1, eight("n1") + eight("n2"), 16)]
    grown += [Ended(1, "e", 1, "RESIZED", ()), Started(1, "e", 2, eight("n1") + eight("n2") + eight("n3"), 24)]
    assert check(grown) == []
    (v,) = check([CLUSTER, elastic, Started(0, "e", 1, eight("n1"), 8)])  # below its minimum
    assert v.invariant == "h" and "not 2 to 3 whole replicas" in v.what
    (v,) = check([CLUSTER, elastic, Started(0, "e", 1, eight("n1") + whole("n2", 0, 1, 2, 3), 12)])  # half a replica
    assert v.invariant == "h"
