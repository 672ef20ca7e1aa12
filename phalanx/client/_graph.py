"""Job graphs in the SDK: the dependencies `submit(after=...)` takes, and what a job says of its graph (its
dependencies, an array's progress)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from phalanx.api.v1 import common_pb2


def dependency_messages(after: Iterable[str | tuple[str, str]] | str | None) -> list[common_pb2.Dependency]:
    """Dependencies as `submit(after=...)` takes them: job ids ("JOB" or "JOB:ok|notok|any", also one string of
    them separated by commas) or (job id, condition) pairs; a condition left out is "ok"."""
    if after is None:
        return []
    items = after.split(",") if isinstance(after, str) else list(after)
    out = []
    for item in items:
        if isinstance(item, str):
            job_id, _, condition = item.strip().partition(":")
        else:
            job_id, condition = item
        if job_id:
            out.append(common_pb2.Dependency(job_id=str(job_id), condition=str(condition or "")))
    return out


@dataclass(frozen=True, eq=True)
class Dependency:
    """A job this one waits for, and for what: "ok" (it succeeds), "notok" (it fails or is cancelled), "any"."""

    job_id: str
    condition: str = "ok"

    @classmethod
    def from_proto(cls, msg: common_pb2.Dependency) -> Dependency:
        return cls(msg.job_id, msg.condition or "ok")

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "condition": self.condition}


@dataclass(frozen=True, eq=True)
class ArrayProgress:
    """An array's tasks (on its parent job): in all, the most at once (0: no limit), not started yet, started
    and not ended, succeeded, and failed (or cancelled)."""

    tasks: int
    limit: int = 0
    waiting: int = 0
    active: int = 0
    succeeded: int = 0
    failed: int = 0

    @classmethod
    def from_proto(cls, msg: common_pb2.ArrayProgress) -> ArrayProgress:
        return cls(
            int(msg.tasks), int(msg.limit), int(msg.waiting), int(msg.active), int(msg.succeeded), int(msg.failed)
        )

    @property
    def done(self) -> int:
        return self.succeeded + self.failed

    def summary(self) -> str:
        """ "20 tasks: 3 running, 10 done (1 failed), 7 waiting" (running: started and not ended)."""
        text = f"{self.tasks} tasks: {self.active} running, {self.done} done"
        if self.failed:
            text += f" ({self.failed} failed)"
        if self.waiting:
            text += f", {self.waiting} waiting"
        if self.limit:
            text += f", at most {self.limit} at once"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "limit": self.limit,
            "waiting": self.waiting,
            "active": self.active,
            "succeeded": self.succeeded,
            "failed": self.failed,
        }
