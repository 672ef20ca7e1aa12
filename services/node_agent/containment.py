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
V2_REQUIRED = ("memory", "pids")
AGENT_LEAF = "agent"  # under delegation: the leaf of the delegated cgroup the agent's own processes move into
V2_MOVE_TRIES = 20  # a process the agent forks while it empties its cgroup lands there: move again, this often
# Why the agent sets no device rules on cgroup v2 (also in Containment.devices_reason, and the README):
V2_DEVICES_NOT_ENFORCED = (
    "cgroup v2 has no devices files: device rules are a BPF_PROG_TYPE_CGROUP_DEVICE program attached to the cgroup "
    "(bpf(2) BPF_PROG_LOAD + BPF_PROG_ATTACH), and no maintained PyPI library loads one: BCC's Python module ships "
    "with the distribution (python3-bpfcc), not PyPI, and compiles C with LLVM and kernel headers at run time; "
    "pylibbpf (0.0.x) needs a BPF ELF object built by clang -target bpf; pythonbpf targets tracing programs. "
    "So on cgroup v2 the agent does not restrict which device nodes a rank may open, unless a v1 devices "
    "hierarchy is mounted too (a hybrid host), where the attempt also gets a v1 devices cgroup with the rules; "
    "otherwise only CUDA_VISIBLE_DEVICES (not a security boundary) narrows what the rank uses"
)
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
    # With gpu_minors: the /dev/nvidia-caps/nvidia-cap<minor> the ranks may open (their MIG instances' access
    # capabilities, nvidia_cap_minors()); none for whole GPUs. Never all of them: a cap opens another job's MIG.
    cap_minors: tuple[int, ...] = ()


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


def _ours(pid: int) -> bool:
    """`pid` is this process or one of its descendants (by the parent pids in /proc)."""
    me, seen = os.getpid(), 0
    while pid > 1 and seen < 4096:
        if pid == me:
            return True
        stat = _read(Path(f"/proc/{pid}/stat"))
        if stat is None:
            return False
        pid, seen = int(stat[stat.rfind(")") + 2 :].split()[1]), seen + 1
    return False


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"group name {name!r} is not made of [A-Za-z0-9._-]")


def nvidia_cap_minors(
    instances: list[tuple[int, int, int]], mig_minors: str = "/proc/driver/nvidia-caps/mig-minors"
) -> tuple[int, ...]:
    """The nvidia-caps minors of MIG instances (gpu, GPU instance id, compute instance id): the driver's
    mig-minors file maps "gpu<G>/gi<I>/access" and "gpu<G>/gi<I>/ci<C>/access" to the minor of
    /dev/nvidia-caps/nvidia-cap<minor>; a CUDA process on a MIG device opens both. Missing entries are skipped."""
    table: dict[str, int] = {}
    for line in (_read(Path(mig_minors)) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            table[parts[0]] = int(parts[1])
    found: set[int] = set()
    for gpu, gi, ci in instances:
        for name in (f"gpu{gpu}/gi{gi}/access", f"gpu{gpu}/gi{gi}/ci{ci}/access"):
            if name in table:
                found.add(table[name])
    return tuple(sorted(found))


class CgroupFs:
    """The narrow interface cgroup v2 code uses to reach the hierarchy: the real filesystem here; tests pass a model
    that applies the kernel's rules (tests/helpers/fake_cgroup2.py). Paths are absolute Paths under the mount."""

    def read(self, path: Path) -> str | None:
        """The file's text, None when it (or its cgroup) does not exist."""
        return _read(path)

    def write(self, path: Path, value: str) -> None:
        """Raises OSError as the kernel answers (EBUSY, EINVAL, ENOENT...)."""
        with open(path, "w") as f:
            f.write(value)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def mkdir(self, path: Path) -> None:
        """Make the cgroup (and missing parents); no error when it exists."""
        path.mkdir(parents=True, exist_ok=True)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)

    def children(self, path: Path) -> list[str]:
        """Names of the child cgroups ([] when the cgroup does not exist)."""
        try:
            return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []


REAL_FS = CgroupFs()


def _walk(fs: CgroupFs, top: Path, topdown: bool = True) -> list[Path]:
    """`top` and every cgroup below it (parents before children, or after when not topdown)."""
    out = [top] if topdown else []
    for name in fs.children(top):
        out += _walk(fs, top / name, topdown)
    return out if topdown else [*out, top]


def _fs_write(fs: CgroupFs, path: Path, value: str) -> None:
    try:
        fs.write(path, value)
    except OSError as e:
        raise ContainmentError(f"cannot write {value!r} to {path}: {e.strerror or e}") from e


def _procs(fs: CgroupFs, d: Path) -> list[int]:
    return [int(p) for p in (fs.read(d / "cgroup.procs") or "").split()]


def _controllers(fs: CgroupFs, d: Path, name: str) -> set[str]:
    return {c.lstrip("+") for c in (fs.read(d / name) or "").split()}


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
        while not self.empty():
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
    """dirs: "unified" -> the attempt's v2 cgroup; on a hybrid host also "devices" -> its v1 devices cgroup."""

    kind = "cgroup-v2"

    def __init__(
        self, name: str, ident: str, dirs: Mapping[str, Path], memory_limit: int = 0, fs: CgroupFs = REAL_FS
    ) -> None:
        super().__init__(name, ident, dirs, memory_limit)
        self.fs = fs

    @property
    def _dir(self) -> Path:
        return self.dirs["unified"]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for here in _walk(self.fs, self._dir) if self.fs.is_dir(self._dir) else []:
            found.update(_procs(self.fs, here))  # descendant cgroups (a rank may make its own) count too
        return {pid for pid in found if pid != os.getpid() and _alive(pid)}

    def empty(self) -> bool:
        """cgroup.events says `populated 0` (no process in the cgroup or below it; the kernel's own answer, which
        counts a process on its way out until it has left), else no live member is found."""
        events = self.fs.read(self._dir / "cgroup.events")
        if events is not None and any(line.split()[:1] == ["populated"] for line in events.splitlines()):
            return _keyed(events, "populated") == 0
        return not self.pids()

    def kill(self) -> None:
        if self.fs.exists(self._dir / "cgroup.kill"):  # Linux 5.14+: the kernel kills every member, forks included
            _fs_write(self.fs, self._dir / "cgroup.kill", "1")
            return
        if not self.fs.exists(self._dir / "cgroup.freeze"):
            self._kill_loop()
            return
        self._freeze_kill_thaw(
            lambda: _fs_write(self.fs, self._dir / "cgroup.freeze", "1"),
            lambda: _keyed(self.fs.read(self._dir / "cgroup.events"), "frozen") == 1,
            lambda: _fs_write(self.fs, self._dir / "cgroup.freeze", "0"),
        )

    def oom_kills(self) -> int:
        return _keyed(self.fs.read(self._dir / "memory.events"), "oom_kill")

    def _require_empty(self) -> None:
        if not self.empty():
            raise ContainmentError(f"group {self.id} still has processes {sorted(self.pids())}")

    def remove(self) -> None:
        self._require_empty()
        if self.fs.is_dir(self._dir):
            for here in _walk(self.fs, self._dir, topdown=False):
                self._rmdir_fs(here)
        devices = self.dirs.get("devices")
        if devices is not None and devices.is_dir():
            for below, _subdirs, _files in os.walk(devices, topdown=False):
                self._rmdir(Path(below))

    def _rmdir_fs(self, d: Path) -> None:
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            try:
                self.fs.rmdir(d)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                    raise ContainmentError(f"cannot remove {d}: {e.strerror or e}") from e
                time.sleep(0.01)


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


def device_rules(limits: Limits, proc_devices: str = "/proc/devices") -> list[str]:
    """The v1 devices.allow rules of a group: the usual /dev/null-like devices, nvidiactl and nvidia-modeset, the
    group's /dev/nvidia<minor>, nvidia-uvm (and uvm-tools), and only its own /dev/nvidia-caps/nvidia-cap<minor>."""
    majors = _proc_device_majors(proc_devices)
    rules = [*_V1_ALWAYS_ALLOWED, *(f"c 195:{minor} rwm" for minor in limits.gpu_minors or ())]
    if "nvidia-uvm" in majors:
        rules.append(f"c {majors['nvidia-uvm']}:* rwm")
    if "nvidia-caps" in majors:
        rules += [f"c {majors['nvidia-caps']}:{minor} rwm" for minor in limits.cap_minors]
    return rules


def _device_rules(d: Path, limits: Limits, proc_devices: str) -> None:
    # A devices cgroup can only narrow what its parent allows: deny everything, then allow the list.
    _write(d / "devices.deny", "a")
    for rule in device_rules(limits, proc_devices):
        _write(d / "devices.allow", rule)


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
            _device_rules(dirs["devices"], limits, self._proc_devices)

    def open(self, name: str) -> Group | None:
        _check_name(name)
        dirs = self._group_dirs(name)
        if not any(d.is_dir() for d in dirs.values()):
            return None
        limit = _read(dirs["memory"] / "memory.limit_in_bytes")
        memory = int(limit) if limit and int(limit) < 2**62 else 0  # "unlimited" reads as a huge page-rounded value
        return _V1Group(name, self._ident(name), dirs, memory)


class _V2Containment(_CgroupContainment):
    """Groups under `parent` in the unified hierarchy. `top`: the highest cgroup whose cgroup.subtree_control the
    agent may change (its delegated cgroup; the mount root when not delegated). `delegate`: move the agent's own
    processes out of a cgroup on the way (from `top` down to the parent) that must hand controllers down."""

    kind = "cgroup-v2"

    def __init__(
        self,
        reason: str,
        root_mount: str,
        parent: str,
        fs: CgroupFs,
        *,
        top: str = "/",
        delegate: bool = True,
        devices: tuple[str, str, str] | None = None,
    ) -> None:
        super().__init__(reason, {"unified": root_mount}, {"unified": parent})
        self.fs = fs
        self.top = "/" + top.strip("/")
        self.delegate = delegate
        self.agent_cgroup = ""  # the leaf the agent moved into ("" when it did not have to)
        # (v1 devices mount, parent, /proc/devices) on a hybrid host: device rules there (V2_DEVICES_NOT_ENFORCED)
        self._devices = devices
        self.devices_enforced = devices is not None
        self.devices_reason = "v1 devices hierarchy (hybrid host)" if devices else V2_DEVICES_NOT_ENFORCED

    def parent_dirs(self) -> dict[str, Path]:
        return {"unified": Path(self.mounts["unified"] + self.parent)}

    def _path(self, cgroup: str) -> Path:
        return Path(self.mounts["unified"] + ("" if cgroup == "/" else cgroup))

    def names(self) -> list[str]:
        names = self.fs.children(self.parent_dirs()["unified"])
        if self.agent_cgroup and posixpath.dirname(self.agent_cgroup) == self.parent:
            names = [n for n in names if n != AGENT_LEAF]  # the agent's own leaf, when the parent is D itself
        return names

    def close(self) -> None:
        with contextlib.suppress(OSError):  # groups left (live ranks of a crashed agent), or not ours to remove
            self.fs.rmdir(self.parent_dirs()["unified"])
        if self._devices is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._devices[0] + self._devices[1])

    def probe(self) -> None:
        self.prepare()
        d = self.parent_dirs()["unified"] / f"probe-{os.getpid()}"
        self.fs.mkdir(d)
        self.fs.rmdir(d)

    def prepare(self) -> None:
        """Make the parent, and hand memory, pids (cpu and the others where available) down from `top` to the
        parent's children, moving the agent out of the way where the no-internal-processes rule requires."""
        under_top = self.top == "/" or self.parent == self.top or self.parent.startswith(self.top + "/")
        start = self.top if under_top else "/"
        chain = [start]
        for part in (self.parent[len(start) :] if start != "/" else self.parent).split("/"):
            if part:
                chain.append(posixpath.join(chain[-1], part))
        for cgroup in chain:
            here = self._path(cgroup)
            if not self.fs.is_dir(here):
                try:
                    self.fs.mkdir(here)
                except OSError as e:
                    raise ContainmentError(f"cannot create cgroup {here}: {e.strerror or e}") from e
            if cgroup == self.parent and self._devices is not None:
                Path(self._devices[0] + self._devices[1]).mkdir(parents=True, exist_ok=True)
            available = _controllers(self.fs, here, "cgroup.controllers")
            enabled = _controllers(self.fs, here, "cgroup.subtree_control")
            missing = [c for c in self._wanted(available) if c not in enabled]
            if missing:
                self._enable(cgroup, here, missing)

    @staticmethod
    def _wanted(available: set[str]) -> list[str]:
        # memory, pids, cpu first; then what else the kernel offers (io, cpuset, hugetlb...): sub-cgroups a rank
        # makes, and future limits, find them on. rdma and misc are left alone (nothing here sets them).
        return [c for c in V2_CONTROLLERS if c in available] + sorted(
            c for c in available if c not in V2_CONTROLLERS and c not in ("rdma", "misc")
        )

    def _enable(self, cgroup: str, here: Path, missing: list[str]) -> None:
        value = " ".join(f"+{c}" for c in missing)
        for _ in range(V2_MOVE_TRIES):
            try:
                self.fs.write(here / "cgroup.subtree_control", value)
                return
            except OSError as e:
                if e.errno != errno.EBUSY or cgroup == "/":
                    raise ContainmentError(f"cannot write {value!r} to {here / 'cgroup.subtree_control'}: {e}") from e
                members = _procs(self.fs, here)
                strangers = [p for p in members if not _ours(p)]
                if not self.delegate or os.getpid() not in members or strangers:
                    raise ContainmentError(
                        f"cannot write {value!r} to {here / 'cgroup.subtree_control'}: {e.strerror or e} "
                        f"(processes {members[:5]} are in {cgroup}"
                        + (
                            "; v2 gives controllers only to cgroups without processes: use a delegated parent of "
                            "its own)"
                            if os.getpid() not in members
                            else f"; processes {strangers[:5]} there are not the agent's, so it is not delegated "
                            "to the agent: give the agent a cgroup of its own (systemd Delegate=yes))"
                            if strangers
                            else "; the agent is one of them and moving it is turned off)"
                        )
                    ) from e
                self._move_out(cgroup, here, members)
        raise ContainmentError(f"cannot empty {here} to enable {value}: processes keep arriving")

    def _move_out(self, cgroup: str, here: Path, members: list[int]) -> None:
        """The agent's delegated cgroup must hand controllers down: every process in it (the agent first, whatever
        it started there after) goes into its leaf AGENT_LEAF. Writing a pid moves all the threads of its
        process."""
        leaf = here / AGENT_LEAF
        if not self.fs.is_dir(leaf):
            self.fs.mkdir(leaf)
        for pid in sorted(members, key=lambda p: p != os.getpid()):
            try:
                self.fs.write(leaf / "cgroup.procs", str(pid))
            except OSError as e:
                if e.errno != errno.ESRCH:  # gone meanwhile
                    raise ContainmentError(f"cannot move process {pid} into {leaf}: {e.strerror or e}") from e
        self.agent_cgroup = posixpath.join(cgroup, AGENT_LEAF)
        log.info("containment.agent_moved", cgroup=self.agent_cgroup, processes=len(members))

    def _child_controllers(self) -> set[str]:
        return _controllers(self.fs, self.parent_dirs()["unified"], "cgroup.subtree_control")

    def _dirs(self, name: str) -> dict[str, Path]:
        dirs = {"unified": self.parent_dirs()["unified"] / name}
        if self._devices is not None:
            dirs["devices"] = Path(self._devices[0] + self._devices[1]) / name
        return dirs

    def create(self, name: str, limits: Limits = Limits()) -> Group:
        _check_name(name)
        dirs = self._dirs(name)
        d = dirs["unified"]
        existed = self.fs.is_dir(d)
        try:
            self.prepare()
            self.fs.mkdir(d)
            if "devices" in dirs:
                dirs["devices"].mkdir(exist_ok=True)
        except OSError as e:
            raise ContainmentError(f"cannot create cgroup {name}: {e}") from e
        controllers = self._child_controllers()
        if not set(V2_REQUIRED) <= controllers:
            raise ContainmentError(f"cgroup {d} lacks the memory and pids controllers (has {sorted(controllers)})")
        if limits.memory_bytes or existed:
            _fs_write(self.fs, d / "memory.max", str(limits.memory_bytes or "max"))
        if limits.pids_max or existed:
            _fs_write(self.fs, d / "pids.max", str(limits.pids_max or "max"))
        if "cpu" in controllers and (limits.cpus or existed):
            quota = str(max(1000, int(limits.cpus * CPU_PERIOD_US))) if limits.cpus else "max"
            _fs_write(self.fs, d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
        elif limits.cpus:
            log.warning("containment.cpu_not_enforced", reason="no cpu controller", group=str(d))
        if "devices" in dirs and limits.gpu_minors is not None and self._devices is not None:
            _device_rules(dirs["devices"], limits, self._devices[2])
        return _V2Group(name, self._ident(name), dirs, limits.memory_bytes, self.fs)

    def open(self, name: str) -> Group | None:
        _check_name(name)
        dirs = self._dirs(name)
        if not self.fs.is_dir(dirs["unified"]):
            return None
        limit = (self.fs.read(dirs["unified"] / "memory.max") or "max").strip()
        memory = int(limit) if limit.isdigit() else 0
        return _V2Group(name, self._ident(name), dirs, memory, self.fs)


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


def cgroup_v2(
    root_mount: str,
    parent: str,
    *,
    fs: CgroupFs = REAL_FS,
    top: str = "/",
    delegate: bool = True,
    devices: tuple[str, str, str] | None = None,
) -> Containment:
    """Groups under `parent` (a cgroup path, "/a/b") of the cgroup2 hierarchy mounted at `root_mount`.

    fs: how the hierarchy is reached (tests: a model of the kernel's rules). top: the highest cgroup the agent may
    change (its delegated cgroup). delegate: move the agent's processes into a leaf where the no-internal-processes
    rule requires (False: fail there, as the agent did before). devices: (v1 devices mount, parent cgroup,
    /proc/devices) on a hybrid host."""
    return _cgroup_v2(root_mount, parent, fs, top=top, delegate=delegate, devices=devices)


def _cgroup_v2(
    root_mount: str,
    parent: str,
    fs: CgroupFs,
    *,
    top: str = "/",
    delegate: bool = True,
    devices: tuple[str, str, str] | None = None,
) -> _V2Containment:
    parent = "/" + parent.strip("/")
    top = "/" + top.strip("/")
    root_mount = root_mount.rstrip("/") or "/"
    controllers = (fs.read(Path(root_mount + ("" if top == "/" else top)) / "cgroup.controllers") or "").split()
    used = ", ".join(c for c in V2_CONTROLLERS if c in controllers)
    where = f"delegated {top}" if top != "/" else "no delegation"
    devs = "devices by the v1 devices hierarchy" if devices else "device rules not enforced (no BPF loader)"
    reason = f"cgroup v2 at {root_mount} with controllers {used} (parent {parent}, {where}; {devs})"
    return _V2Containment(reason, root_mount, parent, fs, top=top, delegate=delegate, devices=devices)


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
