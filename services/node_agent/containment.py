"""Process containers for a job attempt's ranks: kill every process they started, enforce limits, see when empty.

The agent creates one `Group` per attempt and starts each rank inside it; when the attempt ends it kills the
group, waits until the group is empty (only then may the GPUs go to the next job) and removes it. Three kinds:

- "cgroup-v2": one directory in the unified hierarchy. The ranks' limits are memory.max, pids.max and cpu.max
  (device rules would need BPF: not enforced). The parent gets "+memory +pids [+cpu]" in its
  cgroup.subtree_control (and each ancestor from the mount root down, where missing); v2 forbids processes in a
  cgroup that hands controllers to its children, so nothing is ever put into the parent itself.
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

import contextlib
import errno
import os
import posixpath
import re
import signal as _signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from phalanx.core.resources import format_size, parse_size  # noqa: F401  (re-exported: the agent's sizes)

log = structlog.get_logger()

KINDS = ("cgroup-v2", "cgroup-v1", "process-group")
MARKER_ENV = "PHALANX_CONTAINER"

# freezer first: join_files() lists the hierarchies in this order (see the module docstring).
V1_CONTROLLERS = ("freezer", "memory", "pids", "devices", "cpu")
V1_REQUIRED = ("memory", "pids", "freezer")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
FREEZE_WAIT_S = 1.0
KILL_WAIT_S = 2.0
REMOVE_WAIT_S = 1.0
_PG_REASON = "ranks are tracked by process group and an environment marker"

# /dev/null, zero, full, random, urandom, tty, ptmx, the pseudo-terminals, nvidiactl and nvidia-modeset.
_V1_ALWAYS_ALLOWED = (
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
    "c 195:255 rwm",
    "c 195:254 rwm",
)
_NAME = re.compile(r"[A-Za-z0-9._-]+")


class ContainmentError(Exception):
    """A group could not be created, given its limits, or removed."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 0  # 0 = no limit
    cpus: float = 0.0  # 0 = no limit; else a CPU quota of this many CPUs per 100 ms period
    pids_max: int = 0  # 0 = no limit
    gpu_minors: tuple[int, ...] | None = None  # None = no device rules; else only these /dev/nvidia<minor> (v1)


# --- small file and /proc helpers ---------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENODEV):  # ENODEV: a cgroup being removed meanwhile
            return None
        raise


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        raise ContainmentError(f"cannot write {value!r} to {path}: {e.strerror or e}") from e


def _keyed(text: str | None, key: str) -> int:
    """The number after `key` in a 'key value' per line file (memory.events, memory.oom_control); 0 if absent."""
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


def _alive(pid: int) -> bool:
    """A process that exists and has not exited (zombies and dead tasks are not alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x", b"")


def _send(pids: set[int], sig: int) -> int:
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def _proc_device_majors(proc_devices: str) -> dict[str, int]:
    majors: dict[str, int] = {}
    for line in (_read(Path(proc_devices)) or "").splitlines():
        if line.startswith("Block devices"):
            break
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"group name {name!r} is not made of [A-Za-z0-9._-]")


# --- groups ----------------------------------------------------------------------------------------------------------


class Group(ABC):
    """One attempt's processes. Subclasses per kind; this base has what all kinds share."""

    kind = ""

    def __init__(self, name: str, ident: str, memory_limit: int = 0) -> None:
        self.name = name
        self.id = ident
        self.memory_limit = memory_limit

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self.id}>"

    def join_files(self) -> list[str]:
        return []

    def env(self) -> dict[str, str]:
        return {MARKER_ENV: self.id}

    @abstractmethod
    def pids(self) -> set[int]: ...

    def empty(self) -> bool:
        return not self.pids()

    def signal(self, sig: int) -> int:
        return _send(self.pids(), sig)

    def kill(self) -> None:
        self._kill_loop()

    def wait_empty(self, timeout: float = 5.0) -> bool:
        """Wait (polling) until no process is left; False if some still are after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.pids():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def oom_kills(self) -> int:
        return 0

    def remove(self) -> None:
        self._require_empty()

    def _require_empty(self) -> None:
        left = self.pids()
        if left:
            raise ContainmentError(f"group {self.id} still has processes {sorted(left)}")

    def _kill_loop(self, timeout: float = KILL_WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return
            _send(pids, _signal.SIGKILL)
            if time.monotonic() >= deadline:
                log.warning("containment.kill_timeout", group=self.id, pids=sorted(pids), waited_s=timeout)
                return
            time.sleep(0.005)


class _CgroupGroup(Group):
    def __init__(self, name: str, ident: str, dirs: Mapping[str, Path], memory_limit: int = 0) -> None:
        super().__init__(name, ident, memory_limit)
        self.dirs = dict(dirs)  # hierarchy (v1 controller, or "unified") -> this group's directory

    def _unique_dirs(self) -> list[Path]:
        return list(dict.fromkeys(self.dirs.values()))

    def join_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self._unique_dirs()]

    def _freeze_kill_thaw(
        self, freeze: Callable[[], None], is_frozen: Callable[[], bool], thaw: Callable[[], None]
    ) -> None:
        """Freeze the group (no process can fork meanwhile), SIGKILL every process, thaw. A freeze that does not
        finish in FREEZE_WAIT_S (a task stuck in the kernel) kills what it can, then loops over what is left."""
        freeze()
        deadline = time.monotonic() + FREEZE_WAIT_S
        frozen = True
        while not is_frozen():
            if time.monotonic() >= deadline:
                log.warning("containment.freeze_timeout", group=self.id, waited_s=FREEZE_WAIT_S)
                frozen = False
                break
            time.sleep(0.002)
        try:
            self.signal(_signal.SIGKILL)
        finally:
            thaw()
        if not frozen:
            self._kill_loop()

    def pids(self) -> set[int]:
        found: set[int] = set()
        for top in self._unique_dirs():
            # Descendant cgroups (a rank may create its own) belong to the group too.
            for here, _subdirs, _files in os.walk(top):
                for line in (_read(Path(here) / "cgroup.procs") or "").split():
                    found.add(int(line))
        return {pid for pid in found if pid != os.getpid() and _alive(pid)}

    def remove(self) -> None:
        self._require_empty()
        for top in self._unique_dirs():
            if not top.is_dir():
                continue
            for here, _subdirs, _files in os.walk(top, topdown=False):
                self._rmdir(Path(here))

    def _rmdir(self, d: Path) -> None:
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            try:
                os.rmdir(d)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                # A task that has just been killed leaves the cgroup a moment after it is reaped.
                if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                    raise ContainmentError(f"cannot remove {d}: {e.strerror or e}") from e
                time.sleep(0.01)


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


class _V2Group(_CgroupGroup):
    kind = "cgroup-v2"

    def __init__(
        self, name: str, ident: str, dirs: Mapping[str, Path], memory_limit: int = 0, fake_fs: bool = False
    ) -> None:
        super().__init__(name, ident, dirs, memory_limit)
        self._fake_fs = fake_fs

    @property
    def _dir(self) -> Path:
        return self.dirs["unified"]

    def kill(self) -> None:
        if (self._dir / "cgroup.kill").exists():
            _write(self._dir / "cgroup.kill", "1")
            return
        if not (self._dir / "cgroup.freeze").exists():
            self._kill_loop()
            return
        self._freeze_kill_thaw(
            lambda: _write(self._dir / "cgroup.freeze", "1"),
            lambda: _keyed(_read(self._dir / "cgroup.events"), "frozen") == 1,
            lambda: _write(self._dir / "cgroup.freeze", "0"),
        )

    def oom_kills(self) -> int:
        return _keyed(_read(self._dir / "memory.events"), "oom_kill")

    def _rmdir(self, d: Path) -> None:
        if self._fake_fs:  # a fake tree of regular files: cgroupfs would have no files to delete
            for f in d.iterdir():
                if f.is_file():
                    f.unlink()
        super()._rmdir(d)


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


# --- containments ----------------------------------------------------------------------------------------------------


class Containment(ABC):
    """Where groups are made: one per agent. `create()` a group per attempt; `names()`/`open()` after a restart."""

    kind = ""
    limits_enforced = True
    devices_enforced = False

    def __init__(self, reason: str, parent: str) -> None:
        self.reason = reason
        self.parent = parent

    def __repr__(self) -> str:
        return f"<Containment {self.kind} parent={self.parent!r}: {self.reason}>"

    @abstractmethod
    def create(self, name: str, limits: Limits = Limits()) -> Group: ...

    @abstractmethod
    def open(self, name: str) -> Group | None: ...

    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def close(self) -> None:
        """The agent stops: remove the parent where no group is left under it (best effort)."""


class _CgroupContainment(Containment):
    def __init__(self, reason: str, mounts: Mapping[str, str], parents: Mapping[str, str]) -> None:
        self.mounts = dict(mounts)  # hierarchy -> mount directory
        self.parents = dict(parents)  # hierarchy -> parent cgroup path ("/a/b")
        main = "memory" if "memory" in self.parents else "unified"
        super().__init__(reason, self.parents[main])

    def parent_dirs(self) -> dict[str, Path]:
        return {h: Path(self.mounts[h] + self.parents[h]) for h in self.parents}

    def _group_dirs(self, name: str) -> dict[str, Path]:
        return {h: d / name for h, d in self.parent_dirs().items()}

    def _ident(self, name: str) -> str:
        return posixpath.join(self.parent, name)

    def names(self) -> list[str]:
        found: set[str] = set()
        for d in dict.fromkeys(self.parent_dirs().values()):
            if d.is_dir():
                found.update(p.name for p in d.iterdir() if p.is_dir())
        return sorted(found)

    def close(self) -> None:
        for d in dict.fromkeys(self.parent_dirs().values()):
            with contextlib.suppress(OSError):  # groups left (live ranks of a crashed agent), or not ours to remove
                os.rmdir(d)

    def prepare(self) -> None:
        """Make the parent directories (and whatever else the kind needs there)."""
        for d in dict.fromkeys(self.parent_dirs().values()):
            d.mkdir(parents=True, exist_ok=True)

    def probe(self) -> None:
        """Raise OSError (or ContainmentError) unless a child cgroup can be made under every parent."""
        self.prepare()
        for d in dict.fromkeys(self.parent_dirs().values()):
            probe = d / f"probe-{os.getpid()}"
            probe.mkdir(exist_ok=True)
            os.rmdir(probe)


class _V1Containment(_CgroupContainment):
    kind = "cgroup-v1"

    def __init__(self, reason: str, mounts: Mapping[str, str], parents: Mapping[str, str], proc_devices: str) -> None:
        super().__init__(reason, mounts, parents)
        self.devices_enforced = "devices" in self.mounts
        self._proc_devices = proc_devices

    def create(self, name: str, limits: Limits = Limits()) -> Group:
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
        if limits.memory_bytes or existed:
            _write(dirs["memory"] / "memory.limit_in_bytes", str(limits.memory_bytes or -1))
        if limits.pids_max or existed:
            _write(dirs["pids"] / "pids.max", str(limits.pids_max or "max"))
        if "cpu" in dirs and (limits.cpus or existed):
            if limits.cpus:
                _write(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(
                dirs["cpu"] / "cpu.cfs_quota_us",
                str(max(1000, int(limits.cpus * CPU_PERIOD_US)) if limits.cpus else -1),
            )
        elif limits.cpus:
            log.warning("containment.cpu_not_enforced", reason="no cpu hierarchy", group=str(dirs["memory"]))
        if "devices" in dirs and limits.gpu_minors is not None:
            majors = _proc_device_majors(self._proc_devices)
            rules = [*_V1_ALWAYS_ALLOWED, *(f"c 195:{minor} rwm" for minor in limits.gpu_minors)]
            rules += [f"c {majors[dev]}:* rwm" for dev in ("nvidia-uvm", "nvidia-caps") if dev in majors]
            # A devices cgroup can only narrow what its parent allows: deny everything, then allow the list.
            _write(dirs["devices"] / "devices.deny", "a")
            for rule in rules:
                _write(dirs["devices"] / "devices.allow", rule)

    def open(self, name: str) -> Group | None:
        _check_name(name)
        dirs = self._group_dirs(name)
        if not any(d.is_dir() for d in dirs.values()):
            return None
        limit = _read(dirs["memory"] / "memory.limit_in_bytes")
        memory = int(limit) if limit and int(limit) < 2**62 else 0  # "unlimited" reads as a huge page-rounded value
        return _V1Group(name, self._ident(name), dirs, memory)


class _V2Containment(_CgroupContainment):
    kind = "cgroup-v2"

    def __init__(self, reason: str, root_mount: str, parent: str, fake_fs: bool) -> None:
        super().__init__(reason, {"unified": root_mount}, {"unified": parent})
        self._fake_fs = fake_fs

    def prepare(self) -> None:
        """Hand memory, pids (and cpu where available) down from the mount root to the parent's children."""
        super().prepare()
        here = Path(self.mounts["unified"])
        for part in [p for p in self.parent.split("/") if p] + [None]:
            available = set((_read(here / "cgroup.controllers") or "").split())
            enabled = {c.lstrip("+") for c in (_read(here / "cgroup.subtree_control") or "").split()}
            missing = [c for c in V2_CONTROLLERS if c in available and c not in enabled]
            if missing:
                _write(here / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
            if part is None:
                break
            here = here / part

    def _child_controllers(self) -> set[str]:
        parent_dir = self.parent_dirs()["unified"]
        return {c.lstrip("+") for c in (_read(parent_dir / "cgroup.subtree_control") or "").split()}

    def create(self, name: str, limits: Limits = Limits()) -> Group:
        _check_name(name)
        d = self._group_dirs(name)["unified"]
        existed = d.is_dir()
        try:
            self.prepare()
            d.mkdir(exist_ok=True)
        except OSError as e:
            raise ContainmentError(f"cannot create cgroup {name}: {e}") from e
        controllers = self._child_controllers()
        if "memory" not in controllers or "pids" not in controllers:
            raise ContainmentError(f"cgroup {d} lacks the memory and pids controllers (has {sorted(controllers)})")
        if limits.memory_bytes or existed:
            _write(d / "memory.max", str(limits.memory_bytes or "max"))
        if limits.pids_max or existed:
            _write(d / "pids.max", str(limits.pids_max or "max"))
        if "cpu" in controllers and (limits.cpus or existed):
            quota = str(max(1000, int(limits.cpus * CPU_PERIOD_US))) if limits.cpus else "max"
            _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
        elif limits.cpus:
            log.warning("containment.cpu_not_enforced", reason="no cpu controller", group=str(d))
        return _V2Group(name, self._ident(name), {"unified": d}, limits.memory_bytes, self._fake_fs)

    def open(self, name: str) -> Group | None:
        _check_name(name)
        d = self._group_dirs(name)["unified"]
        if not d.is_dir():
            return None
        limit = (_read(d / "memory.max") or "max").strip()
        memory = int(limit) if limit.isdigit() else 0
        return _V2Group(name, self._ident(name), {"unified": d}, memory, self._fake_fs)


class _ProcessGroupContainment(Containment):
    kind = "process-group"
    limits_enforced = False

    def __init__(self, reason: str, node_name: str) -> None:
        super().__init__(reason, "")
        self._scope = f"phalanx-{node_name or 'agent'}"  # two agents on one host do not see each other's groups

    def create(self, name: str, limits: Limits = Limits()) -> Group:
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


# --- constructors and detection --------------------------------------------------------------------------------------


def cgroup_v2(root_mount: str, parent: str, *, fake_fs: bool = False) -> Containment:
    """Groups under `parent` (a cgroup path, "/a/b") of the cgroup2 hierarchy mounted at `root_mount`.

    fake_fs: the tree is a plain directory tree (tests): remove() deletes the interface files before rmdir."""
    return _cgroup_v2(root_mount, parent, fake_fs)


def _cgroup_v2(root_mount: str, parent: str, fake_fs: bool) -> _V2Containment:
    parent = "/" + parent.strip("/")
    controllers = (_read(Path(root_mount) / "cgroup.controllers") or "").split()
    used = ", ".join(c for c in V2_CONTROLLERS if c in controllers)
    reason = f"cgroup v2 at {root_mount} with controllers {used} (parent {parent})"
    return _V2Containment(reason, root_mount.rstrip("/") or "/", parent, fake_fs)


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


def process_group(reason: str = "", *, node_name: str = "") -> Containment:
    """Groups tracked by the environment marker (no cgroup): limits are not enforced."""
    return _ProcessGroupContainment(reason or f"no cgroup is used: {_PG_REASON}", node_name)


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
) -> Containment:
    """The best kind this host allows (see the module docstring); `force` picks one (ContainmentError if unusable).

    parent: the cgroup path to create groups under, in every hierarchy; default: the agent's own cgroup (per v1
    hierarchy) + "/phalanx-<node_name or 'agent'>"."""
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
            controllers = set((_read(Path(m) / "cgroup.controllers") or "").split())
            if {"memory", "pids"} <= controllers:
                chosen = _cgroup_v2(m, parent or posixpath.join(own.get("", "/"), leaf), fake_fs=False)
                break
            why_not.append(f"cgroup v2 at {m} lacks {' and '.join(sorted({'memory', 'pids'} - controllers))}")
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
