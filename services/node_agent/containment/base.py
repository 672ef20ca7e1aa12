"""What every kind of container shares: the limits and their spelling per backend, the errors, the small file and
/proc helpers, the narrow filesystem interface of cgroup v2 (CgroupFs), and the Group and Containment bases with
their cgroup halves. Imports nothing else of the package (v1.py, v2.py, pgroup.py and devrules.py build on it).
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
# Why the agent sets no device rules on cgroup v2 (also in Containment.devices_reason, and docs/operations/node-agent.md):
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


NO_LIMITS = Limits()


# --- the limits, one description for every backend ------------------------------------------------------------------


def cpu_quota_us(cpus: float) -> int:
    """The CPU quota per CPU_PERIOD_US of `cpus` CPUs (at least 1 ms: the kernel's minimum)."""
    return max(1000, int(cpus * CPU_PERIOD_US))


@dataclass(frozen=True)
class LimitFiles:
    """How one backend spells the limits of a Limits: the file (and value) of the memory and pids limits, and the
    writes of a CPU quota (cpus > 0) or of none (0). "No limit" is the backend's own word (-1 or "max")."""

    memory: Callable[[int], tuple[str, str]]
    pids: Callable[[int], tuple[str, str]]
    cpu: Callable[[float], list[tuple[str, str]]]


def limit_writes(limits: Limits, spelling: LimitFiles, *, existed: bool, cpu: bool) -> list[tuple[str, str, str]]:
    """(controller, file, value) for each limit file to write, in order. A limit is written when it is set, or when
    the group existed already (an update: a limit no longer asked for goes back to none). `cpu`: whether the backend
    has a CPU controller here; without one a CPU quota is not enforced (the caller logs it)."""
    writes = []
    if limits.memory_bytes or existed:
        writes.append(("memory", *spelling.memory(limits.memory_bytes)))
    if limits.pids_max or existed:
        writes.append(("pids", *spelling.pids(limits.pids_max)))
    if cpu and (limits.cpus or existed):
        writes += [("cpu", f, v) for f, v in spelling.cpu(limits.cpus)]
    return writes


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
        remove_cgroup_dir(d)


def remove_cgroup_dir(d: Path, rmdir: Callable[[Path], None] = os.rmdir) -> None:
    """Remove an emptied cgroup directory (gone already: fine), through `rmdir` (a CgroupFs's, on v2)."""
    deadline = time.monotonic() + REMOVE_WAIT_S
    while True:
        try:
            rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            # A task that has just been killed leaves the cgroup a moment after it is reaped.
            if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise ContainmentError(f"cannot remove {d}: {e.strerror or e}") from e
            time.sleep(0.01)


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
    def create(self, name: str, limits: Limits = NO_LIMITS) -> Group: ...

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
