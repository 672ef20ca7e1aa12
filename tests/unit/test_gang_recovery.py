"""The scheduler-facing adapter of the recovery decision (phalanx.core.gang_recovery): a gang's spares and elastic
range -> the policy, and the scheduler's gang -> decide_recovery's, so that the scheduler's swap and shrink are the
decision the simulator evaluates."""

from __future__ import annotations

import pytest

from phalanx.core.gang_recovery import choose_swap, elastic_gang, recovery_policy, swap_gang
from phalanx.core.recovery import POLICIES, REQUEUE, SHRINK, SWAP, decide_recovery
from phalanx.core.spares import SpareSlot


@pytest.mark.parametrize(
    ("spares", "low", "high", "policy"),
    [
        (0, 0, 8, "requeue"),
        (1, 0, 8, "spares"),
        (0, 4, 8, "elastic"),
        (2, 4, 8, "spares+elastic"),
        (0, 8, 8, "requeue"),  # MIN = MAX: not elastic
        (1, 8, 8, "spares"),
    ],
)
def test_the_policy_follows_the_gang(spares, low, high, policy):
    assert recovery_policy(spares, low, high) == policy
    assert policy in POLICIES


DOMAINS = ["nvl-0", "nvl-1"]
ACTIVES = [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]


def test_the_scheduler_gang_lists_one_spare_entry_per_slot_own_segment_first():
    slots = [SpareSlot(0, 0, "nvl-0", "a2"), SpareSlot(1, 1, "nvl-1", "b2"), SpareSlot(2, 1, "nvl-1", "")]
    gang, usable = swap_gang("j", ACTIVES, slots, 2, DOMAINS, "b0")
    assert gang.ranks == ("a0", "a1", "b0", "b1")
    assert gang.domain_of == {"a0": "nvl-0", "a1": "nvl-0", "b0": "nvl-1", "b1": "nvl-1"}
    assert gang.spares == {"nvl-1": ["b2"], "nvl-0": ["a2"]}  # the missing slot is no entry
    assert gang.per_rank and gang.min_replicas == 4
    assert [s.slot for s in usable] == [1, 0]


def test_a_swap_is_the_decisions_swap():
    slots = [SpareSlot(0, 0, "nvl-0", "a2"), SpareSlot(1, 1, "nvl-1", "b2")]
    gang, _ = swap_gang("j", ACTIVES, slots, 2, DOMAINS, "b0")
    decision = decide_recovery(gang, {"b0"}, "spares")
    assert decision.action == SWAP and decision.ranks == ("a0", "a1", "b2", "b1")
    assert choose_swap(ACTIVES, slots, 2, DOMAINS, "b0") == {2: slots[1]}


def test_spares_plus_elastic_swaps_then_shrinks_then_requeues():
    slots = [SpareSlot(0, 0, "nvl-0", "a2"), SpareSlot(1, 1, "nvl-1", "b2")]
    assert choose_swap(ACTIVES, slots, 2, DOMAINS, "b0", policy="spares+elastic") == {2: slots[1]}
    # No usable spare left in nvl-1: no swap; the gang of 4 (MIN 2) shrinks to 3
    gang, _ = swap_gang("j", ACTIVES, slots, 2, DOMAINS, "b0", unusable={"b2"}, min_replicas=2)
    assert choose_swap(ACTIVES, slots, 2, DOMAINS, "b0", {"b2"}, "spares+elastic") is None
    shrunk = decide_recovery(gang, {"b0"}, "spares+elastic")
    assert shrunk.action == SHRINK and shrunk.replicas == 3
    # Below its minimum: requeued
    gang, _ = swap_gang("j", ACTIVES, slots, 2, DOMAINS, "b0", unusable={"b2"}, min_replicas=4)
    assert decide_recovery(gang, {"b0"}, "spares+elastic").action == REQUEUE


def test_a_node_of_two_replicas_takes_two_slots_of_its_domain():
    actives = [(0, "a0"), (1, "a0"), (2, "b0"), (3, "b0")]
    two = [SpareSlot(0, 0, "nvl-0", "a1"), SpareSlot(1, 0, "nvl-0", "a1")]
    gang, _ = swap_gang("j", actives, two, 2, DOMAINS, "a0")
    decision = decide_recovery(gang, {"a0"}, "spares")
    assert decision.ranks == ("a1", "a1", "b0", "b0") and len(decision.swaps) == 2
    assert choose_swap(actives, two, 2, DOMAINS, "a0") == {0: two[0], 1: two[1]}


def test_the_whole_node_simulator_gang_is_unchanged():
    """Without per_rank (the simulator's spares are whole nodes) one spare node takes every rank of its node."""
    from phalanx.core.recovery import GangAtFailure

    gang = GangAtFailure("j", ("a0", "a0", "b0"), {"a0": "A", "b0": "B", "a1": "A"}, spares={"A": ["a1"]})
    decision = decide_recovery(gang, {"a0"}, "spares")
    assert decision.ranks == ("a1", "a1", "b0") and decision.swaps == (("a0", "a1", False),)


def test_the_elastic_gang_counts_replicas_not_nodes():
    gang, failed = elastic_gang("j", [0, 1, 2, 3], 3, {2})
    assert decide_recovery(gang, failed, "elastic").action == SHRINK
    gang, failed = elastic_gang("j", [0, 1, 2, 3], 3, {2, 3})
    assert decide_recovery(gang, failed, "elastic").action == REQUEUE
    gang, failed = elastic_gang("j", [0, 1, 2], 3, {1})  # already at its minimum
    assert decide_recovery(gang, failed, "elastic").action == REQUEUE
