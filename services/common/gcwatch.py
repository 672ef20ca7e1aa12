"""Python's garbage collector in a long-running service: its pauses measured, and full collections kept short.

A full (generation 2) collection walks every container object of the process with every thread stopped. On a
scheduler holding the view of a 4,096-node cluster and 10,000 jobs that is about 600,000 objects and 0.4-0.6 s,
every few seconds under load (CPython runs one whenever the objects that reached the old generation since the last
one grew by a quarter), and it shows up as a slow cycle anywhere in it: the snapshot, the decision, the writes.

`install(freeze=True)` measures every collection (`phalanx_gc_pause_seconds{generation}`; one longer than 50 ms
logs `gc_pause`) and, with `freeze`, moves what survives each full collection into the permanent generation
(gc.freeze): the next full collection walks only what was allocated since, not the whole long-lived view again.
Acyclic objects are still freed by reference counting when they die frozen; only cyclic garbage made of frozen
objects would wait, so every `complete_every_s` seconds (default 600) the next full collection is let walk the
whole heap again (gc.unfreeze before it), and the freezing goes on after it. `PHALANX_GC_FREEZE=0` turns the
freezing off (measurement stays); `PHALANX_GC_COMPLETE_S` sets the interval.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import structlog

from . import metrics

log = structlog.get_logger()
LOG_PAUSE_S = 0.05  # a collection longer than this is logged (gc_pause)


class _Watch:
    def __init__(self, freeze: bool, complete_every_s: float) -> None:
        self.freeze = freeze
        self.complete_every_s = complete_every_s
        self.started = 0.0
        self.last_complete = time.monotonic()
        self.complete_next = False  # the permanent generation was given back: the next full collection walks all
        self.frozen_full = 0  # full collections followed by a freeze

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        pause = time.perf_counter() - self.started
        generation = int(info.get("generation", -1))
        metrics.GC_PAUSE_SECONDS.labels(str(generation)).observe(pause)
        complete = self.complete_next
        if pause >= LOG_PAUSE_S:
            log.info(
                "gc_pause",
                ms=round(pause * 1000, 1),
                generation=generation,
                collected=info.get("collected", 0),
                frozen=gc.get_freeze_count(),
                complete=complete and generation == 2,
            )
        if generation != 2 or not self.freeze:
            return
        now = time.monotonic()
        if complete:
            self.complete_next = False
            self.last_complete = now
        elif now - self.last_complete >= self.complete_every_s:
            gc.unfreeze()  # the next full collection walks the whole heap (cyclic garbage among frozen objects)
            self.complete_next = True
            return
        gc.freeze()
        self.frozen_full += 1


_watch: list[_Watch] = []


def install(freeze: bool | None = None, complete_every_s: float | None = None) -> None:
    """Measure every collection of this process and, with `freeze` (default: env PHALANX_GC_FREEZE, on), freeze the
    survivors of each full collection (see the module docstring). Idempotent: a second call changes nothing."""
    if _watch:
        return
    if freeze is None:
        freeze = os.environ.get("PHALANX_GC_FREEZE", "1").strip().lower() not in ("0", "false", "no", "off")
    if complete_every_s is None:
        complete_every_s = float(os.environ.get("PHALANX_GC_COMPLETE_S", "600"))
    watch = _Watch(freeze, complete_every_s)
    gc.callbacks.append(watch)
    _watch.append(watch)
    log.info("gc_policy", freeze=freeze, complete_every_s=complete_every_s, thresholds=list(gc.get_threshold()))


def uninstall() -> None:
    """Stop measuring and freezing, and give the permanent generation back (tests)."""
    for watch in _watch:
        if watch in gc.callbacks:
            gc.callbacks.remove(watch)
    _watch.clear()
    gc.unfreeze()
