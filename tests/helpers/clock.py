"""A clock a test moves itself, for code that reads time through the `time` module (monkeypatch the module's `time`
with it): a timer then passes when the test says so, not when a loaded machine happens to get there."""

from __future__ import annotations

import time as _time
from typing import Any


class FakeClock:
    """monotonic() and time() stand still until advance(); every other attribute is the real `time` module's."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._wall = _time.time() - start  # time() reads like the wall clock, moved only by advance()

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self._wall + self.t

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a clock does not go back"
        self.t += seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)
