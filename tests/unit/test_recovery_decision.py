"""The pure recovery decision (phalanx.core.recovery): swap a spare of the same domain, shrink, or requeue, under the
four policies; and the restart-cost model."""

from __future__ import annotations

import pytest

from phalanx.core.recovery import (
    NOTHING,
    POLICIES,
    REQUEUE,
    SHRINK,
    SWAP,
    GangAtFailure,
    RestartCosts,
    checkpointed,
    decide_recovery,
    restart_cost,
)

# Two domains: a0..a3 in A, b0..b3 in B. The gang has 3 ranks in each; a3 and b3 are its spares.
DOMAINS = {**{f"a{i}": "A" for i in range(4)}, **{f"b{i}": "B" for i in range(4)}}
RANKS = ("a0", "a1", "a2", "b0", "b1", "b2")


def gang(min_replicas=6, spares=None, multiple=1, ranks=RANKS):
    held = {"A": ["a3"], "B": ["b3"]} if spares is None else spares
    return GangAtFailure("g", ranks, DOMAINS, min_replicas=min_replicas, spares=held, multiple=multiple)


def test_requeue_policy_always_requeues_the_whole_gang():
    got = decide_recovery(gang(min_replicas=4), {"a1"}, "requeue")
    assert got.action == REQUEUE
    assert set(got.release) == set(RANKS) and got.ranks == ()


def test_spares_swaps_the_spare_of_the_failed_nodes_domain_and_keeps_every_other_rank():
    got = decide_recovery(gang(), {"b1"}, "spares")
    assert got.action == SWAP
    assert got.swaps == (("b1", "b3", False),)
    assert got.ranks == ("a0", "a1", "a2", "b0", "b3", "b2")  # rank 4 moved, the others stay put
    assert got.release == ("b1",)


def test_spares_never_takes_a_spare_of_another_domain():
    # B's spare is gone; A's is there: no swap across domains, and no free node in B -> requeue.
    got = decide_recovery(gang(spares={"A": ["a3"]}), {"b1"}, "spares")
    assert got.action == REQUEUE
    assert "domain B" in got.reason


def test_a_missing_spare_is_replaced_by_a_free_node_of_the_same_domain():
    got = decide_recovery(gang(spares={}), {"a0"}, "spares", free={"A": ["a3"], "B": ["b3"]})
    assert got.action == SWAP and got.swaps == (("a0", "a3", True),)
    # A free node of another domain does not count.
    assert decide_recovery(gang(spares={}), {"a0"}, "spares", free={"B": ["b3"]}).action == REQUEUE


def test_two_failures_in_one_domain_need_two_spares_there():
    two = {"A": ["a3", "x"], "B": ["b3"]}
    domains = {**DOMAINS, "x": "A"}
    g = GangAtFailure("g", RANKS, domains, min_replicas=6, spares=two)
    got = decide_recovery(g, {"a0", "a1"}, "spares")
    assert got.action == SWAP and {new for _, new, _ in got.swaps} == {"a3", "x"}
    # With one spare there, the swap covers both failures or none: requeue.
    assert decide_recovery(gang(), {"a0", "a1"}, "spares").action == REQUEUE


def test_a_failed_spare_is_not_swapped_in():
    got = decide_recovery(gang(), {"a0", "a3"}, "spares")  # a3 (A's spare) died with a0
    assert got.action == REQUEUE


def test_elastic_shrinks_to_the_surviving_ranks_when_at_least_min():
    got = decide_recovery(gang(min_replicas=4), {"a1"}, "elastic")
    assert got.action == SHRINK
    assert got.ranks == ("a0", "a2", "b0", "b1", "b2") and got.replicas == 5
    assert got.release == ("a1",)


def test_elastic_requeues_below_min_and_when_not_elastic():
    assert decide_recovery(gang(min_replicas=6), {"a1"}, "elastic").action == REQUEUE
    below = decide_recovery(gang(min_replicas=5), {"a1", "b1"}, "elastic")
    assert below.action == REQUEUE and "under its minimum 5" in below.reason


def test_shrink_rounds_down_to_the_multiple_and_releases_survivors_left_without_a_rank():
    got = decide_recovery(gang(min_replicas=2, multiple=2), {"a1"}, "elastic")
    assert got.action == SHRINK and got.replicas == 4
    assert got.ranks == ("a0", "a2", "b0", "b1")
    assert set(got.release) == {"a1", "b2"}


def test_shrink_with_several_ranks_per_node():
    ranks = ("a0", "a0", "a1", "a1", "b0", "b0", "b1", "b1")
    got = decide_recovery(gang(min_replicas=6, ranks=ranks), {"b1"}, "elastic")
    assert got.action == SHRINK and got.ranks == ranks[:6] and got.release == ("b1",)


def test_spares_plus_elastic_swaps_first_then_shrinks_then_requeues():
    assert decide_recovery(gang(min_replicas=4), {"a1"}, "spares+elastic").action == SWAP
    shrunk = decide_recovery(gang(min_replicas=4, spares={}), {"a1"}, "spares+elastic")
    assert shrunk.action == SHRINK and "no spare" in decide_recovery(gang(spares={}), {"a1"}, "spares").reason
    requeued = decide_recovery(gang(min_replicas=6, spares={}), {"a1"}, "spares+elastic")
    assert requeued.action == REQUEUE
    assert "no spare" in requeued.reason and "not elastic" in requeued.reason


def test_each_policy_on_the_same_failure():
    actions = {p: decide_recovery(gang(min_replicas=4), {"b2"}, p).action for p in POLICIES}
    assert actions == {"requeue": REQUEUE, "spares": SWAP, "elastic": SHRINK, "spares+elastic": SWAP}


def test_a_failure_off_the_gang_changes_nothing():
    got = decide_recovery(gang(), {"zz"}, "spares")
    assert got.action == NOTHING and got.ranks == RANKS


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown recovery policy"):
        decide_recovery(gang(), {"a0"}, "hope")
    with pytest.raises(ValueError, match="min_replicas"):
        gang(min_replicas=7)
    with pytest.raises(ValueError, match="no domain"):
        GangAtFailure("g", ("a0", "q9"), DOMAINS)
    with pytest.raises(ValueError, match="no ranks"):
        GangAtFailure("g", (), DOMAINS)
    with pytest.raises(ValueError, match="multiple"):
        gang(multiple=0)


def test_restart_cost_loses_the_work_since_the_last_checkpoint():
    costs = RestartCosts(checkpoint_interval_s=1800, warm_restart_s=300, cold_start_s=900)
    assert checkpointed(4000, costs) == 3600
    swap = restart_cost(SWAP, 4000, costs)
    assert swap.lost_work_s == pytest.approx(400) and swap.restart_s == 300 and swap.total_s == pytest.approx(700)
    assert restart_cost(SHRINK, 4000, costs).restart_s == 300
    requeue = restart_cost(REQUEUE, 4000, costs)
    assert requeue.lost_work_s == pytest.approx(400) and requeue.restart_s == 900
    assert restart_cost(SWAP, 0, costs).lost_work_s == 0 and restart_cost(SWAP, 1800, costs).lost_work_s == 0
    assert restart_cost(SWAP, -5, costs).lost_work_s == 0


def test_restart_costs_are_checked():
    with pytest.raises(ValueError, match="checkpoint_interval_s"):
        RestartCosts(checkpoint_interval_s=0)
    with pytest.raises(ValueError, match="warm_restart_s"):
        RestartCosts(warm_restart_s=-1)
    with pytest.raises(ValueError, match="cold_start_s"):
        RestartCosts(cold_start_s=float("nan"))
    with pytest.raises(ValueError, match="unknown recovery action"):
        restart_cost("pray", 10, RestartCosts())
