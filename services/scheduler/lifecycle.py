"""The job state machine, as a table: which event may move a job in which state, and to which states.

A job is PENDING (waiting, perhaps out a retry backoff), RUNNING (its gang reserved: launching, running, or being
preempted) or finished: SUCCEEDED, FAILED or CANCELLED (it leaves the view; the ledger keeps it). `None` is a job
not submitted yet. The transitions (transitions.py, commands.py, cycle.py) follow this table; those that could be
asked for something it does not allow (`reserve`, `teardown`) refuse it, changing nothing. Pure: no I/O, so
tests/unit/test_job_lifecycle.py checks the real transitions against it with no database.
"""

from __future__ import annotations

PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
FINAL = (SUCCEEDED, FAILED, CANCELLED)
STATES: tuple[str | None, ...] = (None, PENDING, RUNNING, *FINAL)

# The events, with what drives each in the scheduler:
EVENTS = (
    "submit",  # SubmitJob (commands.submit_all)
    "reserve",  # the plan places the gang (transitions.reserve)
    "rank_running",  # an agent reports a rank RUNNING (commands.RankReport)
    "rank_exit",  # ... or EXITED, with its code (commands.RankReport)
    "node_lost",  # a node's lease runs out (cycle.fire_timers)
    "preempt",  # the plan stops a victim for a preemptor (planning.apply_plan: Stop)
    "checkpoint_committed",  # a victim's checkpoint committed: stopped, its next attempt restores that step
    "time_limit",  # a running attempt reaches the job's time limit (cycle.fire_timers)
    "cancel",  # CancelJob (commands.Cancel)
    "retry",  # a requeued job is placed again once its backoff ended (transitions.reserve, attempt + 1)
    "drain",  # the node's agent drains (commands.Drain); its ranks then report KILLED (rank_exit's path)
    "dependency_failed",  # a job it waits for ended so that its condition can never be met (jobgraph.advance)
    "array_done",  # an array's last task ended: its parent row ends with them (jobgraph.advance)
)

# (state, event) -> the states the job may be in after it; a pair not listed is refused, changing nothing.
TRANSITIONS: dict[tuple[str | None, str], frozenset[str]] = {
    (None, "submit"): frozenset({PENDING}),
    (PENDING, "reserve"): frozenset({RUNNING}),
    (PENDING, "retry"): frozenset({RUNNING}),
    (PENDING, "cancel"): frozenset({CANCELLED}),
    (RUNNING, "rank_running"): frozenset({RUNNING}),
    # a non-zero exit requeues within max_restarts, else fails; all ranks done with 0 succeed; others wait
    (RUNNING, "rank_exit"): frozenset({RUNNING, PENDING, SUCCEEDED, FAILED}),
    # a failure: requeued with a backoff, or FAILED once max_attempts failures were counted
    (RUNNING, "node_lost"): frozenset({PENDING, FAILED}),
    (RUNNING, "preempt"): frozenset({PENDING}),
    (RUNNING, "checkpoint_committed"): frozenset({PENDING}),
    (RUNNING, "time_limit"): frozenset({FAILED}),
    (RUNNING, "cancel"): frozenset({CANCELLED}),
    # the node leaves placement; the gang runs on until its ranks are reported KILLED (then requeued)
    (RUNNING, "drain"): frozenset({RUNNING}),
    (PENDING, "drain"): frozenset({PENDING}),
    # job graphs: a held job never ran; an array's parent sums up its tasks (all succeeded, or not)
    (PENDING, "dependency_failed"): frozenset({FAILED}),
    (PENDING, "array_done"): frozenset({SUCCEEDED, FAILED}),
}


def allowed(state: str | None, event: str) -> bool:
    """Whether `event` may happen to a job in `state`."""
    return (state, event) in TRANSITIONS


def successors(state: str | None, event: str) -> frozenset[str]:
    """The states a job in `state` may be in after `event` (empty: refused)."""
    return TRANSITIONS.get((state, event), frozenset())
