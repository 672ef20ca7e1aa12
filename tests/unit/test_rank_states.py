"""The rank life cycle on the node agent (services/node_agent/rank_states.py and the supervisor's use of it): every
state, every event, every legal and every illegal transition, table-driven. No process, no server, no database."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from services.node_agent import rank_states as rs
from services.node_agent.state import FINAL_STATES, RankRecord

# (state, event) -> the state after it: the whole life cycle, written out once more by hand.
LEGAL = {
    ("starting", "started"): "running",
    ("starting", "adopted"): "running",
    ("running", "adopted"): "running",
    ("starting", "exited"): "exited",
    ("running", "exited"): "exited",
    ("starting", "failed"): "failed",
    ("starting", "killed"): "killed",
    ("running", "killed"): "killed",
    ("starting", "lost"): "lost",
    ("running", "lost"): "lost",
}
ILLEGAL = [pair for pair in itertools.product(rs.STATES, rs.EVENTS) if pair not in LEGAL]


def test_the_table_is_the_life_cycle():
    assert rs.TRANSITIONS == LEGAL
    assert set(rs.STATES) == {"starting", "running", "exited", "failed", "killed", "lost"}
    assert rs.FINAL == FINAL_STATES  # the state file's notion of an ended rank is the same


@pytest.mark.parametrize(("state", "event"), sorted(LEGAL), ids=lambda v: str(v))
def test_legal_transition(state, event):
    assert rs.advance(state, event) == LEGAL[(state, event)]


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda v: str(v))
def test_illegal_transition(state, event):
    with pytest.raises(rs.IllegalRankTransition) as err:
        rs.advance(state, event)
    assert (err.value.state, err.value.event) == (state, event)
    assert state in str(err.value) and event in str(err.value)


@pytest.mark.parametrize("state", sorted(rs.FINAL))
def test_a_final_state_has_no_way_out(state):
    assert rs.is_final(state)
    assert all((state, e) not in rs.TRANSITIONS for e in rs.EVENTS)


def test_a_rank_that_ran_cannot_fail_to_start_nor_start_again():
    for event in ("failed", "started"):
        with pytest.raises(rs.IllegalRankTransition):
            rs.advance("running", event)


def test_every_state_is_reachable_from_starting():
    seen, frontier = {"starting"}, ["starting"]
    while frontier:
        state = frontier.pop()
        for (s, _e), nxt in rs.TRANSITIONS.items():
            if s == state and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(rs.STATES)


# ---- the supervisor moves records through the table (finish and its illegal-move guard) ------------------------


class _Attempts:
    def __init__(self):
        self.ended: list[tuple] = []

    def rank_ended(self, rec, state, exit_code, message, retryable):
        self.ended.append((rec.key, state, exit_code, message, retryable))


def _supervisor():
    import structlog

    from services.node_agent.supervisor import RankSupervisor

    sup = RankSupervisor.__new__(RankSupervisor)
    sup.log = structlog.get_logger()
    sup.attempts = _Attempts()
    sup.monitors, sup.procs = {}, {}
    sup.state = SimpleNamespace(save=lambda: None)
    return sup


@pytest.mark.parametrize(
    ("start", "end", "reported"),
    [(s, e, e) for s in ("starting", "running") for e in ("exited", "killed", "lost")]
    + [("starting", "failed", "failed")],
)
def test_finish_moves_a_live_rank_to_its_end_once(start, end, reported):
    sup = _supervisor()
    rec = RankRecord(job_id="j", attempt=1, rank=0, state=start)
    sup.finish(rec, end, exit_code=3, message="why", retryable=end == "failed")
    assert rec.state == end and rec.final and (rec.exit_code, rec.message) == (3, "why")
    assert sup.attempts.ended == [("j/1/0", reported, 3, "why", end == "failed")]
    sup.finish(rec, "lost", message="again")  # an ended rank is left as it is: no second report
    assert rec.state == end and len(sup.attempts.ended) == 1


@pytest.mark.parametrize("end", sorted(rs.FINAL))
@pytest.mark.parametrize("final", sorted(rs.FINAL))
def test_finish_of_an_ended_rank_changes_nothing(final, end):
    sup = _supervisor()
    rec = RankRecord(job_id="j", attempt=1, rank=0, state=final, message="first")
    sup.finish(rec, end, message="second")
    assert (rec.state, rec.message) == (final, "first") and sup.attempts.ended == []


def test_an_illegal_move_is_logged_and_the_rank_still_settles():
    sup = _supervisor()
    rec = RankRecord(job_id="j", attempt=1, rank=0, state="running")
    with capture_logs() as logs:
        sup.finish(rec, "failed", exit_code=127, message="cannot start")
    assert rec.state == "failed" and sup.attempts.ended[0][1] == "failed"
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["rank_transition_illegal"]


@pytest.mark.parametrize(
    ("start", "event", "after"),
    [("starting", "started", "running"), ("starting", "adopted", "running"), ("running", "adopted", "running")],
)
def test_the_supervisor_moves_a_rank_to_running(start, event, after):
    sup = _supervisor()
    rec = RankRecord(job_id="j", attempt=1, rank=0, state=start)
    with capture_logs() as logs:
        sup._move(rec, event)
    assert rec.state == after and not logs
