"""The pure preemption decision (phalanx/core/preemption.py): who is evicted for a higher-priority gang, and why not."""

from __future__ import annotations

import random
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core import preemption
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import Unplaceable, place_gang, tier_level
from phalanx.core.preemption import (
    LOCAL_POLICY,
    PRIORITY_CLASSES,
    PRODUCTION_POLICY,
    NoPreemption,
    Preemption,
    PreemptionPolicy,
    RunningGang,
    choose_victims,
    parse_priority,
)

NOW = 1000.0
POLICY = PreemptionPolicy(min_runtime_s=10.0, grace_period_s=3.0)


def cluster(nodes: int = 4, gpus: int = 8, per_leaf: int = 2, per_spine: int = 8):
    fabric = default_fabric([f"n{i}" for i in range(nodes)], nodes_per_leaf=per_leaf, leaves_per_spine=per_spine)
    cap = ClusterCapacity(NodeCapacity(n, gpus, set(range(gpus)), True, fabric.path(n)) for n in fabric.paths)
    return cap, fabric.tiers


def run(cap, job, replicas, g, priority, started=0.0, work=0.0, tiers=(), **kw) -> RunningGang:
    """Place and reserve a gang, as the scheduler would have started it."""
    p = place_gang(cap, GangRequest(job, replicas, g, priority=priority, **kw), tiers)
    assert isinstance(p, Placement), p
    cap.reserve(p)
    return RunningGang(job, priority, p, started, work)


def on(cap, job, node, gpus, priority, started=0.0, work=0.0) -> RunningGang:
    """A gang of one replica on given GPUs of a given node."""
    p = Placement(job, (ReplicaPlacement(0, node, tuple(gpus)),), "node", 1, 0.0, "")
    cap.reserve(p)
    return RunningGang(job, priority, p, started, work)


def snapshot(cap: ClusterCapacity):
    return (
        {n.name: (frozenset(n.free), dict(n.mig), dict(n.milli), n.schedulable) for n in cap.nodes.values()},
        [cap.domain_stats(lv, 1) for lv in range(1, cap.levels() + 1)],
        cap.free_gpus(),
        cap.most_free_on_a_node(),
    )


def released(cap: ClusterCapacity, running, victims) -> ClusterCapacity:
    """A copy of `cap` with the given victims' GPUs released."""
    copy = cap.copy()
    by_id = {g.job_id: g for g in running}
    for v in victims:
        copy.release_placement(by_id[v].placement)
    return copy


# ---- priorities and settings -------------------------------------------------------------------------------------


def test_priorities_are_integers_or_class_names():
    assert parse_priority(7) == 7
    assert parse_priority("-5") == -5 and parse_priority(" +10 ") == 10
    assert parse_priority("default") == 0
    assert parse_priority("HIGH") == PRIORITY_CLASSES["high"]
    ordered = [parse_priority(n) for n in ("best-effort", "batch", "default", "high", "critical")]
    assert ordered == sorted(ordered) and len(set(ordered)) == 5


@pytest.mark.parametrize("bad", ["urgent", "", "1.5", True, None, 2.0])
def test_an_unknown_priority_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="priority"):
        parse_priority(bad)
    if bad == "urgent":
        with pytest.raises(ValueError, match="best-effort"):
            parse_priority(bad)


def test_the_local_defaults_are_seconds_and_production_defaults_minutes():
    assert LOCAL_POLICY.min_runtime_s <= 10 and LOCAL_POLICY.grace_period_s <= 10
    assert PRODUCTION_POLICY.min_runtime_s >= 300 and PRODUCTION_POLICY.grace_period_s >= 60
    assert PreemptionPolicy() == PRODUCTION_POLICY
    with pytest.raises(ValueError):
        PreemptionPolicy(min_runtime_s=-1)


# ---- the choice --------------------------------------------------------------------------------------------------


def test_least_work_lost_goes_first_among_equal_priorities():
    cap, tiers = cluster(nodes=3, per_leaf=3)
    running = [
        run(cap, "much", 1, 8, -100, work=500.0, tiers=tiers),
        run(cap, "little", 1, 8, -100, work=20.0, tiers=tiers),
        run(cap, "some", 1, 8, -100, work=100.0, tiers=tiers),
    ]
    got = choose_victims(cap, GangRequest("p", 1, 8, priority=0), running, NOW, POLICY, tiers)
    assert isinstance(got, Preemption)
    assert got.victims == ("little",) and got.work_lost == 20.0
    assert got.placement.nodes == running[1].placement.nodes
    assert "little" in got.reason


def test_lowest_priority_goes_first_whatever_the_work_lost():
    cap, tiers = cluster(nodes=2, per_leaf=2)
    running = [
        run(cap, "batch", 1, 8, -100, work=0.0, tiers=tiers),
        run(cap, "scavenger", 1, 8, -200, work=10_000.0, tiers=tiers),
    ]
    got = choose_victims(cap, GangRequest("p", 1, 8, priority=0), running, NOW, POLICY, tiers)
    assert got.victims == ("scavenger",)


def test_victims_not_needed_are_spared_and_none_is_taken_off_the_preemptors_leaf():
    """leaf0: n0 held by a (-200), n1 by d (-100, much work); leaf1: n2 by b (-200), n3 by c (-100).
    Greedy order a, b, c first fits at a+b+c (leaf1 empty); pruning keeps c and b, and a (leaf0, which the
    preemptor does not use) is spared."""
    cap, tiers = cluster(nodes=4, per_leaf=2)
    running = [
        on(cap, "a", "n0", range(8), -200, work=0),
        on(cap, "d", "n1", range(8), -100, work=5),
        on(cap, "b", "n2", range(8), -200, work=1),
        on(cap, "c", "n3", range(8), -100, work=0),
    ]
    got = choose_victims(cap, GangRequest("p", 2, 8, priority=0, required_tier="leaf"), running, NOW, POLICY, tiers)
    assert isinstance(got, Preemption)
    assert got.victims == ("b", "c")
    assert set(got.placement.nodes) == {"n2", "n3"} and got.placement.tier == "leaf"


def test_a_gang_is_evicted_whole():
    cap, tiers = cluster(nodes=2, per_leaf=2)
    rest = [on(cap, "high0", "n0", range(4), 50), on(cap, "high1", "n1", range(4), 50)]
    wide = run(cap, "wide", 2, 4, -100, tiers=tiers)  # GPUs 4-7 of both nodes
    assert set(wide.placement.nodes) == {"n0", "n1"}
    got = choose_victims(cap, GangRequest("p", 1, 4, priority=0), [wide, *rest], NOW, POLICY, tiers)
    assert got.victims == ("wide",) and len(got.placement.nodes) == 1  # all of it goes, though one node would do
    after = released(cap, [wide], ["wide"])
    after.reserve(got.placement)


def test_caller_capacity_is_unchanged():
    cap, tiers = cluster(nodes=4, per_leaf=2)
    running = [run(cap, f"r{i}", 1, 8, -1, tiers=tiers) for i in range(4)]
    before = snapshot(cap)
    got = choose_victims(cap, GangRequest("p", 2, 8, priority=5, required_tier="leaf"), running, NOW, POLICY, tiers)
    assert isinstance(got, Preemption) and len(got.victims) == 2
    assert snapshot(cap) == before
    for g in running:
        cap.release_placement(g.placement)  # still held in the caller's view: releasing frees them
    assert cap.free_gpus() == 32


def test_fatal_gpus_stay_out_when_a_victim_releases_them():
    cap, tiers = cluster(nodes=1, per_leaf=1)
    victim = run(cap, "v", 1, 8, -1, tiers=tiers)
    fatal = {"n0": {7}}
    got = choose_victims(cap, GangRequest("p", 1, 8, priority=0), [victim], NOW, POLICY, tiers, unusable=fatal)
    assert isinstance(got, NoPreemption) and "even evicting" in got.reason
    got = choose_victims(cap, GangRequest("p", 1, 4, priority=0), [victim], NOW, POLICY, tiers, unusable=fatal)
    assert got.victims == ("v",) and 7 not in got.placement.replicas[0].gpus


def test_partial_gpu_gangs_can_be_victims():
    cap, tiers = cluster(nodes=1, per_leaf=1)
    whole = run(cap, "whole", 1, 7, -1, tiers=tiers)  # GPUs 0-6 whole... the remaining one is shared
    halves = [run(cap, f"half{i}", 1, 1, -5, gpu_milli=500, tiers=tiers) for i in range(2)]
    assert cap.free_gpus() == 0
    got = choose_victims(cap, GangRequest("p", 1, 1, priority=0), [whole, *halves], NOW, POLICY, tiers)
    assert isinstance(got, Preemption) and sorted(got.victims) == ["half0", "half1"]
    got = choose_victims(cap, GangRequest("p", 1, 1, priority=0, gpu_milli=500), [whole, *halves], NOW, POLICY, tiers)
    assert got.victims == ("half0",)


def test_duplicate_running_ids_are_refused():
    cap, tiers = cluster(nodes=1, per_leaf=1)
    g = run(cap, "g", 1, 8, -1, tiers=tiers)
    with pytest.raises(ValueError, match="twice"):
        choose_victims(cap, GangRequest("p", 1, 8), [g, g], NOW, POLICY, tiers)


# ---- every reason not to preempt ---------------------------------------------------------------------------------


def test_no_preemption_when_it_fits_now():
    cap, tiers = cluster()
    running = [run(cap, "low", 1, 8, -100, tiers=tiers)]
    got = choose_victims(cap, GangRequest("p", 1, 8, priority=0), running, NOW, POLICY, tiers)
    assert isinstance(got, NoPreemption) and "fits without preemption" in got.reason


def test_equal_priorities_never_preempt_each_other():
    cap, tiers = cluster(nodes=1, per_leaf=1)
    running = [run(cap, "peer", 1, 8, 0, tiers=tiers)]
    got = choose_victims(cap, GangRequest("p", 1, 8, priority=0), running, NOW, POLICY, tiers)
    assert isinstance(got, NoPreemption) and got.retry_in is None
    assert "equal" in got.reason and "never preempt" in got.reason


def test_higher_priorities_are_never_victims():
    cap, tiers = cluster(nodes=1, per_leaf=1)
    running = [run(cap, "boss", 1, 8, 100, tiers=tiers)]
    got = choose_victims(cap, GangRequest("p", 1, 8, priority=0), running, NOW, POLICY, tiers)
    assert isinstance(got, NoPreemption) and "higher priority" in got.reason
    got = choose_victims(cap, GangRequest("p", 1, 8, priority=0), [], NOW, POLICY, tiers)
    assert isinstance(got, NoPreemption) and "no running gang" in got.reason


def test_a_gang_is_protected_for_its_minimum_runtime():
    cap, tiers = cluster(nodes=1, per_leaf=1)
    running = [run(cap, "young", 1, 8, -100, started=NOW - 7, tiers=tiers)]
    got = choose_victims(cap, GangRequest("p", 1, 8, priority=0), running, NOW, POLICY, tiers)
    assert isinstance(got, NoPreemption)
    assert "protected for their minimum runtime (3 s left" in got.reason and got.retry_in == 3.0
    got = choose_victims(cap, GangRequest("p", 1, 8, priority=0), running, NOW + 3, POLICY, tiers)
    assert isinstance(got, Preemption) and got.victims == ("young",)


def test_retry_in_is_when_enough_protected_gangs_are_free_to_take():
    cap, tiers = cluster(nodes=2, per_leaf=2)
    running = [
        run(cap, "old", 1, 8, -100, tiers=tiers),  # unprotected, but not enough alone
        on(cap, "young", "n1", range(4), -100, started=NOW - 9),
        on(cap, "younger", "n1", range(4, 8), -100, started=NOW - 2),
    ]
    got = choose_victims(cap, GangRequest("p", 2, 8, priority=0), running, NOW, POLICY, tiers)
    assert isinstance(got, NoPreemption) and got.retry_in == 8.0
    assert "evicting the 1 unprotected" in got.reason and "2 more are protected" in got.reason


def test_no_preemption_when_even_every_lower_gang_would_not_make_it_fit_under_one_leaf():
    cap, tiers = cluster(nodes=4, per_leaf=2)
    running = [run(cap, "low0", 2, 8, -100, tiers=tiers), run(cap, "low1", 2, 8, -100, tiers=tiers)]
    got = choose_victims(cap, GangRequest("p", 3, 8, priority=0, required_tier="leaf"), running, NOW, POLICY, tiers)
    assert isinstance(got, NoPreemption) and got.retry_in is None
    assert "even evicting every lower-priority gang (2)" in got.reason and "under one leaf" in got.reason
    # Without the requirement it fits across the two leaves.
    got = choose_victims(cap, GangRequest("p", 3, 8, priority=0), running, NOW, POLICY, tiers)
    assert isinstance(got, Preemption) and sorted(got.victims) == ["low0", "low1"]


# ---- scale -------------------------------------------------------------------------------------------------------


def test_hundreds_of_running_gangs_need_few_placements():
    cap, tiers = cluster(nodes=256, per_leaf=16, per_spine=4)
    rng = random.Random(7)
    running = []
    i = 0
    while cap.free_gpus() >= 8:
        g = rng.choice((1, 2, 4, 8))
        p = place_gang(cap, GangRequest(f"r{i}", rng.randint(1, 2), g), tiers)
        if isinstance(p, Unplaceable):
            break
        cap.reserve(p)
        running.append(RunningGang(f"r{i}", rng.randint(-3, 0), p, 0.0, rng.random() * 100))
        i += 1
    assert len(running) >= 200
    calls = []
    real = preemption.place_gang

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    with patch.object(preemption, "place_gang", counting):
        got = choose_victims(cap, GangRequest("p", 8, 8, priority=1, required_tier="leaf"), running, NOW, POLICY, tiers)
    assert isinstance(got, Preemption)
    assert len(calls) <= 2 + 12 + len(got.victims) * 8 + 40


# ---- properties --------------------------------------------------------------------------------------------------

gang = st.tuples(
    st.integers(1, 2),
    st.sampled_from((1, 2, 4)),
    st.integers(-2, 1),
    st.sampled_from((0.0, 500.0, 995.0)),
    st.integers(0, 3),
)


@settings(max_examples=250, deadline=None)
@given(
    nodes=st.integers(1, 8),
    per_leaf=st.integers(1, 4),
    gangs=st.lists(gang, max_size=20),
    pending=st.tuples(
        st.integers(1, 4),
        st.sampled_from((2, 4, 8)),
        st.integers(-1, 2),
        st.sampled_from(("", "node", "leaf", "spine")),
    ),
    seed=st.integers(0, 3),
    fill=st.lists(st.tuples(st.integers(-2, 1), st.sampled_from((0.0, 995.0))), max_size=8),
)
def test_preemption_properties(nodes, per_leaf, gangs, pending, seed, fill):
    cap, tiers = cluster(nodes=nodes, per_leaf=per_leaf, per_spine=2)
    running = []
    for i, (r, g, prio, started, work) in enumerate(gangs):
        p = place_gang(cap, GangRequest(f"r{i}", r, g), tiers)
        if isinstance(p, Placement):
            cap.reserve(p)
            running.append(RunningGang(f"r{i}", prio, p, started, float(work)))
    # Fillers: what is left on a node, as one gang each (so the cluster is often full).
    for name, (prio, started) in zip(sorted(cap.nodes, key=lambda n: int(n[1:])), fill):
        if cap.nodes[name].free:
            running.append(on(cap, f"f{name}", name, sorted(cap.nodes[name].free), prio, started, 1.0))
    r, g, prio, required = pending
    check(cap, tiers, running, GangRequest("p", r, g, priority=prio, required_tier=required), seed)


@settings(max_examples=150, deadline=None)
@given(
    nodes=st.integers(2, 6),
    per_leaf=st.integers(1, 3),
    chunks=st.lists(
        st.tuples(st.sampled_from((1, 2, 3)), st.integers(-3, 0), st.sampled_from((0.0, 995.0)), st.integers(0, 9)),
        min_size=4,
        max_size=40,
    ),
    pending=st.tuples(
        st.integers(1, 4), st.sampled_from((4, 8)), st.integers(0, 2), st.sampled_from(("", "node", "leaf", "spine"))
    ),
    seed=st.integers(0, 3),
)
def test_preemption_properties_on_a_full_cluster_of_small_gangs(nodes, per_leaf, chunks, pending, seed):
    """Every node cut into small gangs, so a preemptor needs several victims."""
    cap, tiers = cluster(nodes=nodes, per_leaf=per_leaf, per_spine=2)
    running, i = [], 0
    for name in sorted(cap.nodes, key=lambda n: int(n[1:])):
        while cap.nodes[name].free:
            size, prio, started, work = chunks[i % len(chunks)]
            free = sorted(cap.nodes[name].free)[:size]
            running.append(on(cap, f"r{i}", name, free, prio, started, float(work)))
            i += 1
    r, g, prio, required = pending
    check(cap, tiers, running, GangRequest("p", r, g, priority=prio, required_tier=required), seed)


def check(cap, tiers, running, request, seed):
    prio = request.priority
    r, g, required = request.replicas, request.gpus_per_replica, request.required_tier
    before = snapshot(cap)
    got = choose_victims(cap, request, running, NOW, POLICY, tiers)
    assert snapshot(cap) == before

    # Deterministic, whatever the order the running gangs are given in.
    shuffled = list(running)
    random.Random(seed).shuffle(shuffled)
    assert choose_victims(cap, request, shuffled, NOW, POLICY, tiers) == got

    admissible = sorted(
        (x for x in running if x.priority < prio and NOW - x.started_at >= POLICY.min_runtime_s),
        key=lambda x: (x.priority, x.work_since_checkpoint, x.job_id),
    )
    ids = [x.job_id for x in admissible]
    if isinstance(got, NoPreemption):
        if "fits without" in got.reason:
            assert isinstance(place_gang(cap, request, tiers), Placement)
        else:  # the search is complete: no admissible set would do
            assert isinstance(place_gang(released(cap, running, ids), request, tiers), Unplaceable)
        if got.retry_in is not None:  # once enough protected gangs are past their minimum runtime, it preempts
            assert got.retry_in > 0
            assert isinstance(choose_victims(cap, request, running, NOW + got.retry_in, POLICY, tiers), Preemption)
            if got.retry_in > 0.5:
                sooner = choose_victims(cap, request, running, NOW + got.retry_in - 0.5, POLICY, tiers)
                assert isinstance(sooner, NoPreemption) and sooner.retry_in == pytest.approx(0.5)
        return

    by_id = {x.job_id: x for x in running}
    assert got.victims and len(set(got.victims)) == len(got.victims)
    for v in got.victims:
        assert by_id[v].priority < prio  # never equal or higher
        assert NOW - by_id[v].started_at >= POLICY.min_runtime_s  # never protected
        assert set(by_id[v].placement.nodes) & set(got.placement.nodes)  # never off the preemptor's nodes
    assert got.work_lost == sum(by_id[v].work_since_checkpoint for v in got.victims)

    # The placement is valid after releasing exactly the victims, and within required_tier.
    after = released(cap, running, got.victims)
    after.reserve(got.placement)
    assert len(got.placement.replicas) == r and all(len(x.gpus) == g for x in got.placement.replicas)
    if required:
        names = ["node", *tiers]
        assert tier_level(cap, got.placement.tier, tiers) <= tier_level(cap, required, tiers) or names.index(
            got.placement.tier
        ) <= names.index(required)
    # Minimal: no victim can be spared.
    for v in got.victims:
        rest = [x for x in got.victims if x != v]
        assert isinstance(place_gang(released(cap, running, rest), request, tiers), Unplaceable)
    # Victims come from the shortest prefix of the order that makes the gang fit (lowest priority, least work first).
    k = next(
        k
        for k in range(1, len(ids) + 1)
        if isinstance(place_gang(released(cap, running, ids[:k]), request, tiers), Placement)
    )
    assert set(got.victims) <= set(ids[:k])
    assert list(got.victims) == [i for i in ids if i in got.victims]


def test_gpus_being_released_are_waited_for_not_evicted_and_may_share_a_running_gangs_id():
    """A releasing candidate (`RunningGang.releasing`) is not a victim: the preemption lists it in `waits_for`, it
    comes first among candidates of equal cost, and its job id may repeat (one per node) or be a running gang's (the
    job restarted while its old attempt's processes exit)."""
    cap, tiers = cluster(nodes=2, per_leaf=2)
    low = on(cap, "job", "n0", range(4), priority=0)  # the restarted job, running
    old_a = on(cap, "job", "n0", range(4, 8), priority=0)  # its old attempt, releasing on both nodes
    old_b = on(cap, "job", "n1", range(8), priority=0)
    releasing = [RunningGang(g.job_id, -(2**62), g.placement, -float("inf"), releasing=True) for g in (old_a, old_b)]
    got = choose_victims(cap, GangRequest("hi", 1, 8, priority=5), [*releasing, low], NOW, POLICY, tiers)
    assert isinstance(got, Preemption), got
    assert got.victims == ()
    assert got.waits_for == (releasing[1],)  # all of n1 comes free: nothing else is needed, the running gang stays
    # Two gangs under one id are refused only when neither is releasing.
    with pytest.raises(ValueError):
        choose_victims(cap, GangRequest("hi", 1, 8, priority=5), [low, old_a], NOW, POLICY, tiers)
