"""Fail points for fault-injection tests: crash the process at a named point, as a power cut would.

`PHALANX_FAILPOINTS=name[,name...]` in a service's environment makes `fail_point(name)` end the process at once
(`os._exit`, no cleanup, no commit), the first time that point is reached. Unset, a fail point costs one set
lookup. Points: `scheduler.handover` (a cycle that stops preempted gangs, after its writes, before its commit),
`checkpoint.commit` (the shard report that completes a checkpoint, after its writes, before its commit).
"""

from __future__ import annotations

import os
import sys

EXIT_CODE = 137  # what a SIGKILL looks like to a supervisor
_ARMED = frozenset(p.strip() for p in os.environ.get("PHALANX_FAILPOINTS", "").split(",") if p.strip())


def fail_point(name: str) -> None:
    if name in _ARMED:
        sys.stderr.write(f"fail point {name!r} reached: exiting {EXIT_CODE}\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)
