"""One typed status for every "not now" of the core: a code a program can branch on, and a reason a person reads.

Placement (`placement.Unplaceable`), admission (`quota.Refusal`) and preemption (`preemption.NoPreemption`) each
answer with their own result type, and each gives its `.status`; the decision core (`decide.Wait`) carries one
per waiting job, with the reason worded for the job's message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Code(enum.Enum):
    """Why a job waits."""

    UNSCHEDULABLE = "unschedulable"  # it does not fit now (a reservation, or preemption, may change that)
    QUOTA = "quota"  # its queue's quota refuses it for now
    PROTECTED = "protected"  # it could preempt lower-priority gangs once their minimum runtime is over
    PREEMPTING = "preempting"  # its victims are checkpointing; it starts at the handover
    EXTENSION = "extension"  # an extension point holds it (MIG mode switches under way)


@dataclass(frozen=True, slots=True)
class Status:
    code: Code
    reason: str
