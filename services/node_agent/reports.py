"""The persisted report queue: what the scheduler must hear about this host's ranks and attempts.

Ranks and attempts never call the scheduler session. A rank's state change (`rank`), an attempt's release
(`released`) or a change of the leader's readiness (`ready`, readiness.py) is appended to the state file's
`pending_reports` and saved, and `changed` is set; the session's reporter (session.py) sends the queue in order,
taking an item off only once the scheduler answered it. So nothing is lost while the scheduler is down, and after an
agent restart the queue is sent by the next process.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Gauge

from .state import AgentState, RankRecord

RANKS_RUNNING = Gauge("phalanx_agent_ranks_running", "Rank processes this node agent is running")
REPORTS_PENDING = Gauge(
    "phalanx_agent_reports_pending", "Rank status, release and readiness reports not yet taken by the scheduler"
)


class ReportQueue:
    """The state file's queue of unsent reports, plus the event that wakes the reporter when it grows."""

    def __init__(self, state: AgentState) -> None:
        self.state = state
        self.changed = asyncio.Event()

    @property
    def pending(self) -> list[dict]:
        return self.state.pending_reports

    def rank(self, rec: RankRecord, state: str, exit_code: int = 0, message: str = "", retryable: bool = False) -> None:
        """Queue a rank's state change (saved before the reporter can send it)."""
        self.state.pending_reports.append(
            {
                "job_id": rec.job_id,
                "attempt": rec.attempt,
                "rank": rec.rank,
                "state": state,
                "exit_code": exit_code,
                "message": message,
                "pid": rec.child_pid or rec.wrapper_pid,
                "retryable": retryable,
            }
        )
        self.state.save()
        REPORTS_PENDING.set(len(self.state.pending_reports))
        RANKS_RUNNING.set(sum(1 for r in self.state.ranks.values() if r.state == "running"))
        self.changed.set()

    def released(self, job_id: str, attempt: int) -> None:
        """Queue that no process of the attempt is left here (after every report queued before it)."""
        self.state.pending_reports.append({"kind": "released", "job_id": job_id, "attempt": attempt})
        self.state.save()
        self.changed.set()

    def readiness(self, job_id: str, attempt: int, ready: bool, message: str = "") -> None:
        """Queue a change of the attempt's readiness. It replaces an unsent one of the same attempt: only the latest
        state matters (one the reporter has in flight is still sent, then this one)."""
        pending = self.state.pending_reports
        pending[:] = [
            r for r in pending if not (r.get("kind") == "ready" and r["job_id"] == job_id and r["attempt"] == attempt)
        ]
        pending.append({"kind": "ready", "job_id": job_id, "attempt": attempt, "ready": ready, "message": message})
        self.state.save()
        REPORTS_PENDING.set(len(pending))
        self.changed.set()

    def clear(self) -> int:
        """Drop every unsent report (another ledger's state); how many there were."""
        dropped = len(self.state.pending_reports)
        self.state.pending_reports.clear()
        REPORTS_PENDING.set(0)
        RANKS_RUNNING.set(0)
        return dropped
