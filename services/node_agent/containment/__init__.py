"""Process containers for a job attempt's ranks: kill every process they started, enforce limits, see when empty.

The agent creates one `Group` per attempt and starts each rank inside it; when the attempt ends it kills the
group, waits until the group is empty (only then may the GPUs go to the next job) and removes it. Three kinds:

- "cgroup-v2": one directory in the unified hierarchy. The ranks' limits are memory.max, pids.max and cpu.max;
  the parent gets "+memory +pids [+cpu ...]" in its cgroup.subtree_control (and each ancestor down from the top
  the agent may touch, where missing). v2 forbids processes in a (non-root) cgroup that hands controllers to its
  children (the "no internal processes" rule: enabling a controller in a populated cgroup's subtree_control is
  EBUSY, and so is adding a process to a cgroup whose subtree_control is not empty). Under systemd's
  `Delegate=yes` the agent is itself a process of its delegated cgroup D, so before enabling controllers in D it
  moves every process of D (itself and whatever it started there) into the leaf D/agent (AGENT_LEAF), via
  D/agent/cgroup.procs; the attempts' parent (D/phalanx-<node>-<tag> by default) is then a sibling of D/agent and
  each attempt's cgroup is made under it. Devices: see V2_DEVICES_NOT_ENFORCED.
  Every access goes through a `CgroupFs` (the real filesystem; tests pass a model of the kernel's rules).
- "cgroup-v1": one directory per hierarchy (freezer, memory, pids, and devices and cpu when mounted), each with its
  own parent: by default the agent's own cgroup in that hierarchy + "/phalanx-<node>".
- "process-group": no usable cgroup (not root, no delegation). Every rank carries the environment marker
  PHALANX_CONTAINER=<group id>; the group's processes are found by scanning /proc/<pid>/environ. A process that
  clears its environment before exec escapes; limits are not enforced.

A process enters a cgroup group by writing its own pid into each of `join_files()` (freezer first, so a process in
any of the group's hierarchies is already freezable), before exec'ing the rank; its descendants inherit the group,
including those that call setsid or double-fork, which process groups and sessions cannot follow.

Kill sequence (`Group.kill()`): v2 writes "1" to cgroup.kill (the kernel kills every member, forks in flight
included); v1 freezes the group (freezer.state FROZEN, waiting until it reads FROZEN), SIGKILLs every member (a
frozen process cannot fork) and thaws it so the signals are delivered. Without cgroup.kill/freezer, and for
process groups, SIGKILL is sent to every member again and again until a scan finds none (a fork that lands between
a scan and the kills is caught by the next scan), within a bound. Killed processes leave the group when they
exit; `wait_empty()` waits for that. Zombies (exited, not yet reaped) never count as members.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
from pathlib import Path

from phalanx.core.resources import format_size, parse_size  # noqa: F401  (re-exported: the agent's sizes)

from .base import (  # noqa: F401  (re-exported: the package's interface)
    _PG_REASON,
    AGENT_LEAF,
    CPU_PERIOD_US,
    FREEZE_WAIT_S,
    KILL_WAIT_S,
    KINDS,
    MARKER_ENV,
    NO_LIMITS,
    REAL_FS,
    REMOVE_WAIT_S,
    V1_CONTROLLERS,
    V1_REQUIRED,
    V2_CONTROLLERS,
    V2_DEVICES_NOT_ENFORCED,
    V2_MOVE_TRIES,
    V2_REQUIRED,
    CgroupFs,
    Containment,
    ContainmentError,
    Group,
    LimitFiles,
    Limits,
    _CgroupContainment,
    _read,
    cpu_quota_us,
    limit_writes,
)
from .devrules import device_rules, nvidia_cap_minors  # noqa: F401
from .pgroup import _marked, process_group  # noqa: F401
from .v1 import V1_LIMITS, _cgroup_v1, cgroup_v1  # noqa: F401
from .v2 import V2_LIMITS, _cgroup_v2, cgroup_v2  # noqa: F401


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_mounts(mounts: str, root: str) -> tuple[list[str], dict[str, str]]:
    """(cgroup2 mount dirs, v1 controller -> mount dir) under `root`, from a /proc/self/mounts file."""
    v2: list[str] = []
    v1: dict[str, str] = {}
    top = root.rstrip("/") or "/"
    for line in (_read(Path(mounts)) or "").splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        where, fstype, options = _unescape(fields[1]), fields[2], fields[3].split(",")
        if not (where == top or where.startswith(top.rstrip("/") + "/")):
            continue
        if fstype == "cgroup2":
            v2.append(where)
        elif fstype == "cgroup":
            for c in V1_CONTROLLERS:
                if c in options:
                    v1.setdefault(c, where)
    return v2, v1


def _own_cgroups(self_cgroup: str) -> dict[str, str]:
    """Controller -> this process's cgroup path, from /proc/self/cgroup ("" -> the cgroup2 path)."""
    own: dict[str, str] = {}
    for line in (_read(Path(self_cgroup)) or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) == 3:
            for c in parts[1].split(",") if parts[1] else [""]:
                own[c] = parts[2]
    return own


def detect(
    parent: str | None = None,
    *,
    node_name: str = "",
    root: str = "/sys/fs/cgroup",
    mounts: str = "/proc/self/mounts",
    self_cgroup: str = "/proc/self/cgroup",
    force: str | None = None,
    proc_devices: str = "/proc/devices",
    fs: CgroupFs = REAL_FS,
    delegate: bool = True,
) -> Containment:
    """The best kind this host allows (see the module docstring); `force` picks one (ContainmentError if unusable).

    parent: the cgroup path to create groups under, in every hierarchy; default: the agent's own cgroup (per v1
    hierarchy) + "/phalanx-<node_name or 'agent'>"; on v2 the agent's delegated cgroup D (its own, or the one
    above its leaf AGENT_LEAF) + "/phalanx-<...>", a sibling of D/agent once the agent has moved there.
    fs, delegate: see cgroup_v2()."""
    if force is not None and force not in KINDS:
        raise ValueError(f"containment kind {force!r} is not one of {', '.join(KINDS)}")
    if force == "process-group":
        return process_group(f"process-group was asked for: {_PG_REASON}", node_name=node_name)
    if force is None and os.geteuid() != 0:
        return process_group(f"not running as root: no cgroup can be created; {_PG_REASON}", node_name=node_name)
    leaf = f"phalanx-{node_name or 'agent'}"
    own = _own_cgroups(self_cgroup)
    v2_mounts, v1_mounts = _cgroup_mounts(mounts, root)
    chosen: _CgroupContainment | None = None
    why_not: list[str] = []
    if force in (None, "cgroup-v2"):
        if not v2_mounts:
            why_not.append(f"no cgroup v2 mount under {root}")
        for m in v2_mounts:
            # The agent's delegated cgroup: its own, or the one above its leaf when it has moved there already.
            mine = own.get("", "/")
            delegated = posixpath.dirname(mine) if posixpath.basename(mine) == AGENT_LEAF else mine
            controllers = set(
                (fs.read(Path(m.rstrip("/") + delegated.rstrip("/")) / "cgroup.controllers") or "").split()
            )
            if set(V2_REQUIRED) <= controllers:
                wanted = "/" + (parent or posixpath.join(delegated, leaf)).strip("/")
                devices = None
                if "devices" in v1_mounts:  # a hybrid host: device rules in the v1 devices hierarchy
                    devices = (v1_mounts["devices"], posixpath.join(own.get("devices", "/"), leaf), proc_devices)
                chosen = _cgroup_v2(
                    m,
                    wanted,
                    fs,
                    top=delegated if wanted.startswith(delegated.rstrip("/") + "/") else "/",
                    delegate=delegate,
                    devices=devices,
                )
                break
            lacks = " and ".join(sorted(set(V2_REQUIRED) - controllers))
            why_not.append(f"cgroup v2 at {m} lacks {lacks} (in {delegated})")
    if chosen is None and force in (None, "cgroup-v1"):
        missing = [c for c in V1_REQUIRED if c not in v1_mounts]
        if missing:
            why_not.append(f"no cgroup v1 {', '.join(missing)} hierarchy under {root}")
        else:
            parents: str | dict[str, str] = parent or {
                c: posixpath.join(own.get(c, "/"), leaf) for c in V1_CONTROLLERS if c in v1_mounts
            }
            chosen = _cgroup_v1(v1_mounts, parents, proc_devices)
    if chosen is None:
        if force is not None:
            raise ContainmentError(f"{force} is not usable: {'; '.join(why_not)}")
        return process_group(f"no usable cgroup ({'; '.join(why_not)}): {_PG_REASON}", node_name=node_name)
    try:
        chosen.probe()
    except (OSError, ContainmentError) as e:
        failed = f"{chosen.kind} parent is not usable ({e})"
        if force is not None:
            raise ContainmentError(failed) from e
        hint = ""
        cause = e.__cause__ if isinstance(e, ContainmentError) else e
        if chosen.kind == "cgroup-v2" and getattr(cause, "errno", None) == errno.EBUSY:
            hint = " (v2 gives controllers only to cgroups without processes: use a delegated parent of its own)"
        return process_group(f"{failed}{hint}: {_PG_REASON}", node_name=node_name)
    return chosen
