"""cgroup v1: one directory per hierarchy (freezer, memory, pids, and devices and cpu when mounted), each with its own
parent. The kill freezes the group, SIGKILLs every member and thaws it; limits are memory.limit_in_bytes, pids.max
and the CFS quota (base.limit_writes, V1_LIMITS); device rules in the devices hierarchy (devrules.py).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from pathlib import Path

from .base import (
    CPU_PERIOD_US,
    NO_LIMITS,
    V1_CONTROLLERS,
    V1_REQUIRED,
    Containment,
    ContainmentError,
    Group,
    LimitFiles,
    Limits,
    _CgroupContainment,
    _CgroupGroup,
    _check_name,
    _keyed,
    _read,
    _write,
    cpu_quota_us,
    limit_writes,
    log,
)
from .devrules import _device_rules

# v1's spelling of the limits: -1 is no limit (the CFS period is set with a quota).
V1_LIMITS = LimitFiles(
    memory=lambda b: ("memory.limit_in_bytes", str(b or -1)),
    pids=lambda n: ("pids.max", str(n or "max")),
    cpu=lambda c: (
        [("cpu.cfs_period_us", str(CPU_PERIOD_US)), ("cpu.cfs_quota_us", str(cpu_quota_us(c)))]
        if c
        else [("cpu.cfs_quota_us", "-1")]
    ),
)


class _V1Group(_CgroupGroup):
    kind = "cgroup-v1"

    def kill(self) -> None:
        freezer = self.dirs.get("freezer")
        if freezer is None or not (freezer / "freezer.state").exists():
            self._kill_loop()
            return
        state = freezer / "freezer.state"
        self._freeze_kill_thaw(
            lambda: _write(state, "FROZEN"),
            lambda: (_read(state) or "").strip() == "FROZEN",
            lambda: _write(state, "THAWED"),
        )

    def oom_kills(self) -> int:
        memory = self.dirs.get("memory")
        return _keyed(_read(memory / "memory.oom_control"), "oom_kill") if memory else 0


class _V1Containment(_CgroupContainment):
    kind = "cgroup-v1"

    def __init__(self, reason: str, mounts: Mapping[str, str], parents: Mapping[str, str], proc_devices: str) -> None:
        super().__init__(reason, mounts, parents)
        self.devices_enforced = "devices" in self.mounts
        self._proc_devices = proc_devices

    def create(self, name: str, limits: Limits = NO_LIMITS) -> Group:
        _check_name(name)
        dirs = self._group_dirs(name)
        existed = any(d.is_dir() for d in dirs.values())
        try:
            for d in dict.fromkeys(dirs.values()):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ContainmentError(f"cannot create cgroup {name}: {e}") from e
        self._apply(dirs, limits, existed)
        return _V1Group(name, self._ident(name), dirs, limits.memory_bytes)

    def _apply(self, dirs: dict[str, Path], limits: Limits, existed: bool) -> None:
        for controller, file, value in limit_writes(limits, V1_LIMITS, existed=existed, cpu="cpu" in dirs):
            _write(dirs[controller] / file, value)
        if limits.cpus and "cpu" not in dirs:
            log.warning("containment.cpu_not_enforced", reason="no cpu hierarchy", group=str(dirs["memory"]))
        if "devices" in dirs and limits.gpu_minors is not None:
            _device_rules(dirs["devices"], limits, self._proc_devices)

    def open(self, name: str) -> Group | None:
        _check_name(name)
        dirs = self._group_dirs(name)
        if not any(d.is_dir() for d in dirs.values()):
            return None
        limit = _read(dirs["memory"] / "memory.limit_in_bytes")
        memory = int(limit) if limit and int(limit) < 2**62 else 0  # "unlimited" reads as a huge page-rounded value
        return _V1Group(name, self._ident(name), dirs, memory)


def cgroup_v1(
    mounts: Mapping[str, str], parent: str | Mapping[str, str], *, proc_devices: str = "/proc/devices"
) -> Containment:
    """Groups in the v1 hierarchies `mounts` (controller -> mount directory; memory, pids and freezer required).

    parent: a cgroup path for every hierarchy, or one per controller (the default of detect())."""
    return _cgroup_v1(mounts, parent, proc_devices)


def _cgroup_v1(mounts: Mapping[str, str], parent: str | Mapping[str, str], proc_devices: str) -> _V1Containment:
    missing = [c for c in V1_REQUIRED if c not in mounts]
    if missing:
        raise ContainmentError(f"cgroup v1 needs the {', '.join(missing)} hierarchies")
    used = {c: mounts[c].rstrip("/") or "/" for c in V1_CONTROLLERS if c in mounts}
    given = {c: parent for c in used} if isinstance(parent, str) else dict(parent)
    parents = {c: "/" + given[c].strip("/") for c in used}
    where = sorted(set(parents.values()))
    described = (
        f"parent {where[0]}" if len(where) == 1 else "parents " + ", ".join(f"{c} {p}" for c, p in parents.items())
    )
    roots = {posixpath.dirname(m) for m in used.values()}
    under = f" under {roots.pop()}" if len(roots) == 1 else ""
    reason = f"cgroup v1 hierarchies {', '.join(used)}{under} ({described})"
    return _V1Containment(reason, used, parents, proc_devices)
