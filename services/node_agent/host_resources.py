"""What ranks may use of this host besides its GPUs: CPUs and memory, as the agent registers them
(RegisterNodeRequest.cpus / memory_bytes; the scheduler reserves each replica's share from them).

- A real host (NVML discovery): the CPUs the agent may run on (`os.sched_getaffinity(0)`), capped by the CPU quota
  of the agent's own cgroup (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us; the lowest along its path), and
  MemTotal from /proc/meminfo, capped by the agent's own cgroup memory limit (v2 memory.max, v1
  memory.limit_in_bytes) when one is set and lower. `real_host_resources()`.
- A simulated host: its profile's `host_cpus` and `host_memory` (phalanx.profiles), `profile_host_resources()`;
  what the profile does not say (a bare `nvidia-smi topo -m` dump) is the real host's.
- `phalanx-agent --host-cpus N --host-memory SIZE` overrides either (operators, tests).
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

from phalanx.profiles import HostProfile

from .containment import _cgroup_mounts, _own_cgroups, _read

_UNLIMITED = 2**62  # a v1 "no limit" reads as a huge page-rounded number


@dataclass(frozen=True)
class HostResources:
    cpus: float  # logical CPUs (a cgroup quota may make it fractional)
    memory_bytes: int


def affinity_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 0


def meminfo_total(path: str | Path = "/proc/meminfo") -> int:
    """MemTotal in bytes (0 when unreadable)."""
    for line in (_read(Path(path)) or "").splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            unit = parts[2].lower() if len(parts) > 2 else "b"
            return int(parts[1]) * (1024 if unit == "kb" else 1)
    return 0


def _ancestors(mount: str, path: str) -> list[Path]:
    """The cgroup directories from `path` up to the hierarchy's root (the mount), deepest first."""
    out = []
    here = "/" + path.strip("/")
    while True:
        out.append(Path(mount + (here if here != "/" else "")))
        if here == "/":
            return out
        here = posixpath.dirname(here)


def _v2_file(mount: str, path: str, name: str) -> list[str]:
    return [text.strip() for d in _ancestors(mount, path) if (text := _read(d / name)) is not None]


def cgroup_cpu_limit(
    root: str = "/sys/fs/cgroup", mounts: str = "/proc/self/mounts", self_cgroup: str = "/proc/self/cgroup"
) -> float | None:
    """The CPU quota of this process's cgroup (the lowest along its path), in CPUs; None when there is none."""
    v2, v1 = _cgroup_mounts(mounts, root)
    own = _own_cgroups(self_cgroup)
    quotas: list[float] = []
    try:
        if "cpu" in v1 and "cpu" in own:
            for d in _ancestors(v1["cpu"], own["cpu"]):
                quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                if quota and period and int(quota) > 0 and int(period) > 0:
                    quotas.append(int(quota) / int(period))
        elif v2 and "" in own:
            for value in _v2_file(v2[0], own[""], "cpu.max"):
                quota, _, period = value.partition(" ")
                if quota.isdigit() and period.strip().isdigit() and int(period) > 0:
                    quotas.append(int(quota) / int(period))
    except (OSError, ValueError):
        return None
    return min(quotas) if quotas else None


def cgroup_memory_limit(
    root: str = "/sys/fs/cgroup", mounts: str = "/proc/self/mounts", self_cgroup: str = "/proc/self/cgroup"
) -> int | None:
    """The memory limit of this process's cgroup (the lowest along its path) in bytes; None when there is none."""
    v2, v1 = _cgroup_mounts(mounts, root)
    own = _own_cgroups(self_cgroup)
    limits: list[int] = []
    try:
        if "memory" in v1 and "memory" in own:
            for d in _ancestors(v1["memory"], own["memory"]):
                value = (_read(d / "memory.limit_in_bytes") or "").strip()
                if value.isdigit() and 0 < int(value) < _UNLIMITED:
                    limits.append(int(value))
        elif v2 and "" in own:
            limits = [int(v) for v in _v2_file(v2[0], own[""], "memory.max") if v.isdigit() and int(v) > 0]
    except (OSError, ValueError):
        return None
    return min(limits) if limits else None


def real_host_resources(
    *,
    meminfo: str | Path = "/proc/meminfo",
    root: str = "/sys/fs/cgroup",
    mounts: str = "/proc/self/mounts",
    self_cgroup: str = "/proc/self/cgroup",
) -> HostResources:
    """This host's CPUs and memory as the agent's own process may use them (see the module docstring)."""
    cpus: float = affinity_cpus()
    quota = cgroup_cpu_limit(root, mounts, self_cgroup)
    if quota is not None and quota < cpus:
        cpus = round(quota, 3)
    memory = meminfo_total(meminfo)
    limit = cgroup_memory_limit(root, mounts, self_cgroup)
    if limit is not None and (not memory or limit < memory):
        memory = limit
    return HostResources(float(cpus), memory)


def profile_host_resources(profile: HostProfile, real: HostResources | None = None) -> HostResources:
    """A simulated host's CPUs and memory: its profile's; what the profile does not say, the real host's."""
    cpus: float = profile.host_cpus
    memory = profile.host_memory
    if not cpus or not memory:
        real = real or real_host_resources()
        cpus, memory = cpus or real.cpus, memory or real.memory_bytes
    return HostResources(float(cpus), int(memory))


def resolve(simulated: HostProfile | None, cpus: float | None = None, memory_bytes: int | None = None) -> HostResources:
    """What the agent registers: the overrides (--host-cpus / --host-memory) where given, else the simulated
    profile's (`simulated`), else the real host's."""
    if cpus is not None and memory_bytes is not None:
        return HostResources(float(cpus), int(memory_bytes))
    found = profile_host_resources(simulated) if simulated is not None else real_host_resources()
    return HostResources(
        float(cpus) if cpus is not None else found.cpus,
        int(memory_bytes) if memory_bytes is not None else found.memory_bytes,
    )


__all__ = [
    "HostResources",
    "affinity_cpus",
    "cgroup_cpu_limit",
    "cgroup_memory_limit",
    "meminfo_total",
    "profile_host_resources",
    "real_host_resources",
    "resolve",
]
