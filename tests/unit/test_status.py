"""One typed status: placement, admission and preemption each say "not now" with the same (code, reason) type that
the decision core's Wait steps carry."""

from __future__ import annotations

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.decide import Wait
from phalanx.core.model import GangRequest, NodeCapacity
from phalanx.core.placement import Unplaceable, place_gang
from phalanx.core.preemption import NoPreemption, PreemptionPolicy, RunningGang, choose_victims
from phalanx.core.quota import FlavorQuota, QueueSpec, QuotaBook, Refusal
from phalanx.core.status import Code, Status


def _cluster() -> ClusterCapacity:
    return ClusterCapacity([NodeCapacity("n1", 8, set(range(8)), True)])


def test_placement_admission_and_preemption_answer_with_one_status_type():
    cap = _cluster()
    too_big = place_gang(cap, GangRequest("big", 2, 8, 0, 0.0))
    assert isinstance(too_big, Unplaceable)
    assert too_big.status == Status(Code.UNSCHEDULABLE, too_big.reason) and too_big.reason

    book = QuotaBook({"q": QueueSpec("q", {"*": FlavorQuota(gpus=4, borrow_limit=0)})}, {}, {"gpus": 8.0})
    refused = book.admit("q", GangRequest("j", 1, 8, 0, 0.0))
    assert isinstance(refused, Refusal)
    assert refused.status.code is Code.QUOTA and refused.status.reason == refused.reason

    placed = place_gang(cap, GangRequest("low", 1, 8, 0, 0.0))
    cap.reserve(placed)
    young = RunningGang("low", 0, placed, started_at=100.0)
    blocked = choose_victims(
        cap,
        GangRequest("high", 1, 8, 10, 0.0),
        [young],
        now=101.0,
        policy=PreemptionPolicy(min_runtime_s=600.0, grace_period_s=0.0),
    )
    assert isinstance(blocked, NoPreemption) and blocked.retry_in is not None
    assert blocked.status.code is Code.PROTECTED  # the minimum runtime protects the only candidate

    assert Wait("j", refused.status).status.code is Code.QUOTA
