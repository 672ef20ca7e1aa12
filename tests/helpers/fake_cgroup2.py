"""A model of a cgroup v2 hierarchy that applies the kernel's rules, for hosts that have no usable v2 (this one's
unified mount has no controllers: they are all bound to v1 hierarchies).

Why a model and not a tree of plain files: a file cannot refuse a write, and the rules under test are refusals.
The containment code reaches the hierarchy only through `containment.CgroupFs` (read, write, mkdir, rmdir, exists,
is_dir, children); production passes the real filesystem, the tests this model. (A FUSE filesystem would let the
rank wrapper's own writes go through the rules too, but needs /dev/fuse, fusepy or pyfuse3 and a mount per test:
more moving parts than the rules need.) What it models, after Documentation/admin-guide/cgroup-v2.rst:

- "No internal processes": writing "+ctrl" into a non-root cgroup's cgroup.subtree_control while it has processes
  is EBUSY; writing a pid into a non-root cgroup's cgroup.procs while its subtree_control is not empty is EBUSY.
- "Top-down": a controller can be enabled in a cgroup's subtree_control only if it is in its cgroup.controllers,
  i.e. enabled in its parent's subtree_control (the root's come from `controllers`): else ENOENT; disabling one a
  child still hands down is EBUSY.
- Interface files exist only where their controller is enabled (memory.max with memory, pids.max with pids,
  cpu.max with cpu); cgroup.kill and cgroup.freeze exist outside the root (unless turned off: an older kernel).
- cgroup.procs holds real pids (the tests spawn real processes and write their pids): a pid that has exited or is a
  zombie is no longer listed, cgroup.events says `populated 1` while a live process is in the cgroup or below it,
  and writing "1" to cgroup.kill SIGKILLs every live process in the subtree (the kernel's kill).
- rmdir of a cgroup with processes or children is EBUSY; writing a pid that does not exist is ESRCH.

The rank wrapper is another process: it cannot call into the model. So each cgroup the model holds is also a real
directory under the mount with a real, empty `cgroup.procs`; a process that writes its pid there (the wrapper's
--join) is taken into the model at the next look (and the file emptied: so one join at a time between looks),
through the same rule as a write by this process: one the kernel would refuse is dropped and listed in `refused`.
Nor can the model see forks, which the kernel puts into the parent's cgroup. With `inherit_by_marker`, a process
that carries the containment marker (PHALANX_CONTAINER=<cgroup path>, which every rank process inherits from its
wrapper, setsid'ed and double-forked daemons included) counts as a member of that cgroup: the model's stand-in for
inheritance at fork (a process that clears its environment would escape the model, never the kernel).
"""

from __future__ import annotations

import errno
import os
import posixpath
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from services.node_agent.containment import CgroupFs, _marked

CANONICAL = ("cpuset", "cpu", "io", "memory", "hugetlb", "pids", "rdma", "misc")
_DEFAULTS = {
    "memory": {"memory.max": "max", "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"},
    "pids": {"pids.max": "max"},
    "cpu": {"cpu.max": "max 100000"},
}


def _locked(method):
    """The agent calls in from worker threads (asyncio.to_thread): one call at a time, as the kernel serialises."""

    def call(self, *args, **kw):
        with self._lock:
            return method(self, *args, **kw)

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


def _err(code: int, path: object) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZXx"


@dataclass
class Node:
    procs: set[int] = field(default_factory=set)
    subtree: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    frozen: bool = False
    kills: int = 0


class FakeCgroup2(CgroupFs):
    def __init__(
        self,
        mount: Path,
        controllers: tuple[str, ...] = ("cpuset", "cpu", "io", "memory", "pids"),
        *,
        kill_file: bool = True,
        freeze_file: bool = True,
        rules: bool = True,
        inherit_by_marker: bool = False,
    ) -> None:
        self.inherit_by_marker = inherit_by_marker
        self._lock = threading.RLock()
        self.mount = Path(mount)
        self.root_controllers = tuple(controllers)
        self.kill_file = kill_file
        self.freeze_file = freeze_file
        self.freeze_completes = True  # False: a freeze that never completes (a task stuck in the kernel)
        self.rules = rules  # False: a permissive tree (no refusals), to show that the rules are what refuse
        self.nodes: dict[str, Node] = {"/": Node()}
        self.writes: list[tuple[str, str]] = []  # (path under the mount, value) of every accepted write
        self.refused: list[tuple[str, int]] = []  # (cgroup, pid) joins through a real file the rules refused
        self.mkdir(self.mount)

    # ------------------------------------------------------------------ test helpers

    def path(self, cgroup: str) -> Path:
        return self.mount if cgroup == "/" else self.mount / cgroup.strip("/")

    @_locked
    def make(self, cgroup: str, enable: tuple[str, ...] = ()) -> None:
        """Set up a cgroup as systemd would (no rules checked): it exists, and hands `enable` to its children."""
        self.mkdir(self.path(cgroup))
        self.nodes[cgroup].subtree = list(enable)

    @_locked
    def place(self, cgroup: str, pid: int) -> None:
        """Put a process into a cgroup as systemd starts a service there (no rules checked)."""
        for node in self.nodes.values():
            node.procs.discard(pid)
        self.nodes[cgroup].procs.add(pid)

    @_locked
    def procs(self, cgroup: str) -> set[int]:
        self._ingest()
        node = self.nodes.get(cgroup)
        if node is None:
            return set()
        node.procs = {p for p in node.procs if _alive(p)}
        return set(node.procs)

    def _ingest(self) -> None:
        """Pids other processes wrote into the real cgroup.procs files, and with inherit_by_marker the processes
        that carry a cgroup's marker (see the module docstring)."""
        if self.inherit_by_marker:
            known = {p for node in self.nodes.values() for p in node.procs}
            for pid, ident in _marked().items():
                if pid not in known and ident in self.nodes and _alive(pid):
                    self.nodes[ident].procs.add(pid)
        for cgroup, node in list(self.nodes.items()):
            real = self.path(cgroup) / "cgroup.procs"
            try:
                with open(real, "r+") as f:
                    text = f.read()
                    if not text:
                        continue
                    f.seek(0)
                    f.truncate()
            except OSError:
                continue
            for pid in (int(p) for p in text.split()):
                if self.rules and cgroup != "/" and node.subtree:
                    self.refused.append((cgroup, pid))
                elif _alive(pid):
                    self.place(cgroup, pid)

    @_locked
    def cgroup_of(self, pid: int) -> str | None:
        return next((cg for cg in self.nodes if pid in self.procs(cg)), None)

    def controllers(self, cgroup: str) -> list[str]:
        if cgroup == "/":
            return list(self.root_controllers)
        parent = self.nodes.get(posixpath.dirname(cgroup))
        return [c for c in CANONICAL if parent is not None and c in parent.subtree]

    def subtree_control(self, cgroup: str) -> list[str]:
        return list(self.nodes[cgroup].subtree)

    # ------------------------------------------------------------------ CgroupFs

    def _split(self, path: Path) -> tuple[str, str]:
        """(cgroup, file name) of a file path."""
        rel = Path(path).relative_to(self.mount)
        parent = "/" + str(rel.parent).strip(".").strip("/")
        return ("/" if parent == "/" else parent.rstrip("/")), rel.name

    def _cgroup(self, path: Path) -> str:
        rel = str(Path(path).relative_to(self.mount)).strip(".").strip("/")
        return "/" + rel if rel else "/"

    def _files(self, cgroup: str) -> dict[str, str]:
        files = {"cgroup.procs": "", "cgroup.controllers": "", "cgroup.subtree_control": "", "cgroup.events": ""}
        if cgroup != "/":
            if self.kill_file:
                files["cgroup.kill"] = ""
            if self.freeze_file:
                files["cgroup.freeze"] = "0"
            for c in self.controllers(cgroup):
                files.update(_DEFAULTS.get(c, {}))
        files.update(self.nodes[cgroup].files)
        return files

    def _populated(self, cgroup: str) -> bool:
        return any(self.procs(cg) for cg in list(self.nodes) if cg == cgroup or cg.startswith(cgroup.rstrip("/") + "/"))

    @_locked
    def read(self, path: Path) -> str | None:
        cgroup, name = self._split(path)
        if cgroup not in self.nodes or name not in self._files(cgroup):
            return None
        if name == "cgroup.procs":
            return "".join(f"{p}\n" for p in sorted(self.procs(cgroup)))
        if name == "cgroup.controllers":
            return " ".join(self.controllers(cgroup)) + "\n"
        if name == "cgroup.subtree_control":
            return " ".join(self.nodes[cgroup].subtree) + "\n"
        if name == "cgroup.events":
            frozen = int(self.nodes[cgroup].frozen)
            return f"populated {int(self._populated(cgroup))}\nfrozen {frozen}\n"
        return self._files(cgroup)[name]

    @_locked
    def write(self, path: Path, value: str) -> None:
        cgroup, name = self._split(path)
        if cgroup not in self.nodes or name not in self._files(cgroup):
            raise _err(errno.ENOENT, path)
        node = self.nodes[cgroup]
        if name == "cgroup.procs":
            pid = int(value.strip())
            if not _alive(pid):
                raise _err(errno.ESRCH, path)
            if self.rules and cgroup != "/" and node.subtree:
                raise _err(errno.EBUSY, path)  # no internal processes: this cgroup hands controllers down
            self.place(cgroup, pid)
        elif name == "cgroup.subtree_control":
            for token in value.split():
                sign, ctrl = token[0], token[1:]
                if sign not in "+-" or ctrl not in CANONICAL:
                    raise _err(errno.EINVAL, path)
                if sign == "+":
                    if ctrl not in self.controllers(cgroup):
                        raise _err(errno.ENOENT, path)  # top-down: not enabled in the parent
                    if self.rules and cgroup != "/" and self.procs(cgroup):
                        raise _err(errno.EBUSY, path)  # no internal processes: this cgroup has processes
            for token in value.split():  # all or nothing, as the kernel checks before it applies
                sign, ctrl = token[0], token[1:]
                if sign == "+" and ctrl not in node.subtree:
                    node.subtree.append(ctrl)
                elif sign == "-" and ctrl in node.subtree:
                    children = [cg for cg in self.nodes if cg != "/" and posixpath.dirname(cg) == cgroup]
                    if any(ctrl in self.nodes[c].subtree for c in children):
                        raise _err(errno.EBUSY, path)
                    node.subtree.remove(ctrl)
        elif name == "cgroup.kill":
            if value.strip() != "1":
                raise _err(errno.EINVAL, path)
            node.kills += 1
            for cg in list(self.nodes):
                if cg == cgroup or cg.startswith(cgroup.rstrip("/") + "/"):
                    for pid in self.procs(cg):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        elif name == "cgroup.freeze":
            if value.strip() not in ("0", "1"):
                raise _err(errno.EINVAL, path)
            node.frozen = value.strip() == "1" and self.freeze_completes
        elif name in ("cgroup.controllers", "cgroup.events", "memory.events"):
            raise _err(errno.EACCES, path)  # read-only
        else:
            text = value.strip()
            if name in ("memory.max", "pids.max") and not (text == "max" or text.isdigit()):
                raise _err(errno.EINVAL, path)
            if name == "cpu.max":
                parts = text.split()
                if len(parts) != 2 or not (parts[0] == "max" or parts[0].isdigit()) or not parts[1].isdigit():
                    raise _err(errno.EINVAL, path)
            node.files[name] = text
        self.writes.append((str(Path(path).relative_to(self.mount)), value))

    @_locked
    def exists(self, path: Path) -> bool:
        if self.is_dir(path):
            return True
        cgroup, name = self._split(path)
        return cgroup in self.nodes and name in self._files(cgroup)

    @_locked
    def is_dir(self, path: Path) -> bool:
        try:
            return self._cgroup(path) in self.nodes
        except ValueError:
            return False

    @_locked
    def mkdir(self, path: Path) -> None:
        cgroup = self._cgroup(path)
        parts = [p for p in cgroup.split("/") if p]
        for i in range(len(parts) + 1):
            name = "/" + "/".join(parts[:i])
            if name not in self.nodes or not self.path(name).is_dir():
                self.nodes.setdefault(name, Node())
                self.path(name).mkdir(parents=True, exist_ok=True)
                (self.path(name) / "cgroup.procs").touch()

    @_locked
    def rmdir(self, path: Path) -> None:
        cgroup = self._cgroup(path)
        if cgroup not in self.nodes:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if cgroup == "/" or self.procs(cgroup) or self.children(path):
            raise _err(errno.EBUSY, path)
        del self.nodes[cgroup]
        (self.path(cgroup) / "cgroup.procs").unlink(missing_ok=True)
        os.rmdir(self.path(cgroup))

    @_locked
    def children(self, path: Path) -> list[str]:
        cgroup = self._cgroup(path)
        return sorted(posixpath.basename(cg) for cg in self.nodes if cg != "/" and posixpath.dirname(cg) == cgroup)
