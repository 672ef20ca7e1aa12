"""The one-line account of a checkpoint restore, shared by the coordinator (what GetRestore and `phalanx job` show)
and phalanx.train (what a rank logs when the coordinator's own answer is not available)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Skipped(Protocol):  # read-only: frozen dataclasses (phalanx.train's SkippedCheckpoint) satisfy it
    @property
    def step(self) -> int: ...

    @property
    def reason(self) -> str: ...


def restore_message(step: int, skipped: Iterable[Skipped]) -> str:
    """ "restored from step S (step T was damaged: REASON)", "started from step 0: no intact checkpoint (step T was
    damaged: REASON)", or "started from step 0: no checkpoint" (`step` -1: none restored)."""
    skipped = list(skipped)
    why = "; ".join(f"step {s.step} was damaged: {s.reason}" for s in skipped)
    if step >= 0:
        return f"restored from step {step}" + (f" ({why})" if why else "")
    if skipped:
        return f"started from step 0: no intact checkpoint ({why})"
    return "started from step 0: no checkpoint"
