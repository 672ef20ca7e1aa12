"""Decide at submit (issue 35): when a batch of arrivals may be decided alone, and the decision's input for it.

A pass (`phalanx.core.decide`) serves the pending queue in priority order first, in plain order and in the quotas'
fair order alike. So arrivals whose priority is strictly higher than every other pending job's are served first by
any pass, and nothing of the rest of the queue can change what they get: a decision over the arrivals alone, with
preemption and backfill off, gives the same reservations as the pass would for the arrivals it reserves (the prefix
property, tested in tests/unit/test_admission_prefix.py). An arrival that does not fit, or that its quota refuses,
is left pending for the pass, and so is every arrival that is not strictly ahead of the queue.

Alone only on a settled view: nothing the pass acts on before it places gangs is due. No claim or preemption under
way (a claimant keeps what its victims free; a victim's GPUs are counted as coming free), no timer due (a lease, a
time limit, a launch deadline, a backoff ending), and no pass owed (`pass_due`: something changed that the pass has
not decided on yet). The caller checks these on its state (`unsettled`), holding the ledger's lock.

Pure: the scheduler's admission lane and the tests share it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from .snapshot import Memo, PendingJob, Snapshot


def unsettled(
    *,
    pass_due: bool,
    now: float,
    wake_at: float,
    claims: int,
    preempting: int,
    timers_due: bool,
) -> str:
    """Why the view is not settled enough to decide arrivals alone ("" when it is): the batch then goes to a cycle."""
    if pass_due:
        return "a pass is due"
    if now >= wake_at:
        return "a wake-up is due"
    if claims:
        return "a claim is held"
    if preempting:
        return "a preemption is under way"
    if timers_due:
        return "a timer is due"
    return ""


def ahead_of_queue(arrivals: Sequence[PendingJob], others: Iterable[int]) -> list[PendingJob]:
    """The arrivals strictly ahead of every other pending job (`others`: their priorities, a job held by a backoff
    or a dependency counted too: conservative), in the order given. An arrival of equal priority is not: a pending
    job of its priority was there first, and a blocked head of its priority keeps its backfill reservation against
    it."""
    top = max(others, default=None)
    return [a for a in arrivals if top is None or a.request.priority > top]


def arrivals_snapshot(snapshot: Snapshot, arrivals: Sequence[PendingJob]) -> Snapshot:
    """`snapshot` with the arrivals as its whole pending queue, and neither preemption, backfill nor elastic grows:
    a blocked arrival is the cycle's to decide (it may preempt there, or wait with a backfill reservation), and
    grows come after the pass. A memo of its own: the pass's head reservation is not this decision's."""
    config = dataclasses.replace(snapshot.config, preemption=None, backfill=False, elastic=None)
    return dataclasses.replace(snapshot, pending=list(arrivals), config=config, memo=Memo(), elastic=[])
