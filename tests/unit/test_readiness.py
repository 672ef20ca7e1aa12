"""The node agent's readiness probe, without processes or servers: which checks are reported (ReadinessTracker),
the probe's defaults (ProbeSpec), and the report queue keeping only the latest readiness of an attempt."""

from __future__ import annotations

from phalanx.api.v1 import common_pb2
from services.node_agent.readiness import ProbeSpec, ReadinessTracker
from services.node_agent.reports import ReportQueue
from services.node_agent.state import AgentState, RankRecord


def _reports(tracker: ReadinessTracker, checks: str) -> list[bool]:
    """The changes reported over a run of checks ('P' pass, 'F' fail)."""
    out = []
    for c in checks:
        change = tracker.observe(c == "P")
        if change is not None:
            out.append(change)
    return out


def test_ready_on_the_first_pass_and_never_unready_before_it():
    assert _reports(ReadinessTracker(3), "FFFFFP") == [True]
    assert _reports(ReadinessTracker(3), "FFFFFFFF") == []


def test_unready_after_threshold_failures_in_a_row_once_ready_then_ready_again():
    tracker = ReadinessTracker(3)
    assert _reports(tracker, "PPFF") == [True]  # two failures: still ready
    assert tracker.ready is True and tracker.failures == 2
    assert _reports(tracker, "P") == []  # a pass resets the count
    assert _reports(tracker, "FFF") == [False]
    assert _reports(tracker, "FFFF") == []  # not ready already: nothing more
    assert _reports(tracker, "PP") == [True]


def test_a_threshold_of_one_and_a_resumed_tracker():
    assert _reports(ReadinessTracker(1), "PFPF") == [True, False, True, False]
    resumed = ReadinessTracker(2, ready=True)  # an agent restarted after reporting ready
    assert _reports(resumed, "PFF") == [False]


def test_probe_defaults_and_its_round_trip_through_the_state_file():
    spec = ProbeSpec.of(common_pb2.ReadyProbe(http_port=8080))
    assert (spec.period_s, spec.timeout_s, spec.failure_threshold, spec.initial_delay_s) == (2.0, 2.0, 3, 0.0)
    assert spec.http_path == "/" and spec.what == "GET :8080/"
    given = ProbeSpec.of(
        common_pb2.ReadyProbe(command=["true"], period_s=0.5, initial_delay_s=1.5, timeout_s=0.25, failure_threshold=5)
    )
    assert (given.period_s, given.initial_delay_s, given.timeout_s, given.failure_threshold) == (0.5, 1.5, 0.25, 5)
    assert ProbeSpec.from_dict(given.to_dict()) == given
    assert ProbeSpec.of(common_pb2.ReadyProbe(command=["x"], period_s=float("nan"))).period_s == 2.0


def test_the_queue_keeps_the_latest_readiness_of_an_attempt_after_its_other_reports(tmp_path):
    state = AgentState.load(tmp_path / "state.json", node_name="n")
    queue = ReportQueue(state)
    queue.rank(RankRecord(job_id="job-1", attempt=1, rank=0), "running")
    queue.readiness("job-1", 1, True, "HTTP 200")
    queue.readiness("job-2", 1, True, "exit 0")
    queue.readiness("job-1", 1, False, "HTTP 503")
    kinds = [(r.get("kind", "rank"), r["job_id"], r.get("ready")) for r in state.pending_reports]
    assert kinds == [("rank", "job-1", None), ("ready", "job-2", True), ("ready", "job-1", False)]
    assert AgentState.load(tmp_path / "state.json").pending_reports == state.pending_reports  # saved
