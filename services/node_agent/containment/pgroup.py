"""The process-group fallback (no usable cgroup: not root, no delegation): every rank carries the environment marker
PHALANX_CONTAINER=<group id>, and a group's processes are found by scanning /proc/<pid>/environ. A process that
clears its environment before exec escapes; limits are not enforced.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import _PG_REASON, MARKER_ENV, NO_LIMITS, Containment, Group, Limits, _alive, _check_name


class _ProcessGroup(Group):
    kind = "process-group"

    def pids(self) -> set[int]:
        return {pid for pid, ident in _marked().items() if ident == self.id}


def _marked() -> dict[int, str]:
    """Live processes that carry the marker: pid -> its value (a group's id)."""
    key = f"{MARKER_ENV}=".encode()
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:  # gone, a kernel thread, or not ours to read
            continue
        for var in environ.split(b"\0"):
            if var.startswith(key):
                found[int(entry)] = var[len(key) :].decode(errors="replace")
                break
    return {pid: ident for pid, ident in found.items() if _alive(pid)}


class _ProcessGroupContainment(Containment):
    kind = "process-group"
    limits_enforced = False

    def __init__(self, reason: str, node_name: str) -> None:
        super().__init__(reason, "")
        self._scope = f"phalanx-{node_name or 'agent'}"  # two agents on one host do not see each other's groups

    def create(self, name: str, limits: Limits = NO_LIMITS) -> Group:
        _check_name(name)
        return _ProcessGroup(name, f"{self._scope}/{name}")

    def close(self) -> None:
        return  # a process group leaves no directory behind

    def open(self, name: str) -> Group | None:
        group = self.create(name)
        return group if group.pids() else None

    def names(self) -> list[str]:
        prefix = f"{self._scope}/"
        return sorted({ident[len(prefix) :] for ident in _marked().values() if ident.startswith(prefix)})


def process_group(reason: str = "", *, node_name: str = "") -> Containment:
    """Groups tracked by the environment marker (no cgroup): limits are not enforced."""
    return _ProcessGroupContainment(reason or f"no cgroup is used: {_PG_REASON}", node_name)
