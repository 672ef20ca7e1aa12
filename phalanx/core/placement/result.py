"""What a placement that cannot be made says: `Unplaceable` (the gang's id and a reason a person reads)."""

from __future__ import annotations

from dataclasses import dataclass

from ..status import Code, Status


@dataclass(frozen=True, slots=True)
class Unplaceable:
    job_id: str
    reason: str

    @property
    def status(self) -> Status:
        return Status(Code.UNSCHEDULABLE, self.reason)
