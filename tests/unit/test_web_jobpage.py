"""The job page's later parts (phalanx.web.jobpage): rank 0's log tail, within its bound, and the checkpoints part
without a coordinator."""

from __future__ import annotations

import threading

from phalanx.client import NotFoundError
from phalanx.web import jobpage


class _LogClient:
    def __init__(self, lines=(), error: Exception | None = None, hold: threading.Event | None = None) -> None:
        self.lines, self.error, self.hold = list(lines), error, hold

    def logs(self, job_id: str, *, rank: int, tail: int):
        assert rank == 0 and tail == jobpage.LOG_LINES
        if self.hold is not None:
            self.hold.wait(10)
        if self.error is not None:
            raise self.error
        yield from self.lines


def test_the_log_tail_is_rank_0s_last_lines_or_says_why_not():
    got = jobpage.log_tail(_LogClient([(0, "step 1"), (0, "step 2")]), "aaaaaaaaaaaa")  # type: ignore[arg-type]
    assert got == ["[rank 0] step 1", "[rank 0] step 2"]
    refused = _LogClient(error=NotFoundError("job aaaaaaaaaaaa has no started rank 0"))
    assert jobpage.log_tail(refused, "aaaaaaaaaaaa") == [  # type: ignore[arg-type]
        "(no log: NOT_FOUND: job aaaaaaaaaaaa has no started rank 0)"
    ]


def test_a_log_tail_that_does_not_come_is_given_up_at_its_bound():
    hold = threading.Event()
    try:
        got = jobpage.log_tail(_LogClient([(0, "late")], hold=hold), "aaaaaaaaaaaa", within_s=0.05)  # type: ignore[arg-type]
        assert got == ["(no log within 0.05 s: the rank's node agent did not answer)"]
    finally:
        hold.set()


def test_the_checkpoints_part_says_why_none_without_a_coordinator():
    assert "--checkpoint-coordinator" in jobpage.checkpoints(None, "tok", "aaaaaaaaaaaa")


def test_the_job_part_is_the_jobs_list_entry_with_spec_counts_and_goodput():
    from phalanx.client import Job, JobState

    j = Job(
        id="aaaaaaaaaaaa",
        name="train",
        state=JobState.RUNNING,
        replicas=2,
        gpus_per_replica=8,
        command=["python", "train.py"],
        required_tier="leaf",
        time_limit=3600.0,
        failures=1,
        preemptions=2,
        restore="step 200 (attempt 1)",
    )
    view = {"id": j.id, "name": j.name, "service": None}
    out = jobpage.job_detail(j, view)
    assert out == {
        "id": "aaaaaaaaaaaa",
        "name": "train",
        "service": None,
        "spec": {
            "replicas": 2,
            "gpus_per_replica": 8,
            "command": ["python", "train.py"],
            "required_tier": "leaf",
            "time_limit": 3600.0,
        },
        "failures": 1,
        "preemptions": 2,
        "restore": "step 200 (attempt 1)",
        "goodput": None,
        "placement": {},
    }
    assert "checkpoints" not in out and "logs" not in out  # the later parts: their own requests
    assert view == {"id": j.id, "name": j.name, "service": None}  # the list's entry is not changed
