"""cgroup v2: one directory in the unified hierarchy per attempt, under a parent the agent hands memory, pids and cpu
down to (moving itself into the leaf AGENT_LEAF of its delegated cgroup where the no-internal-processes rule
requires). The kill is cgroup.kill (or a freeze); limits are memory.max, pids.max and cpu.max (base.limit_writes,
V2_LIMITS); device rules only on a hybrid host, in its v1 devices hierarchy (V2_DEVICES_NOT_ENFORCED).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
from collections.abc import Mapping
from pathlib import Path

from .base import (
    AGENT_LEAF,
    CPU_PERIOD_US,
    NO_LIMITS,
    REAL_FS,
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
    _alive,
    _CgroupContainment,
    _CgroupGroup,
    _check_name,
    _controllers,
    _fs_write,
    _keyed,
    _ours,
    _procs,
    _walk,
    cpu_quota_us,
    limit_writes,
    log,
    remove_cgroup_dir,
)
from .devrules import _device_rules

# v2's spelling of the limits: "max" is no limit; cpu.max holds the quota and the period together.
V2_LIMITS = LimitFiles(
    memory=lambda b: ("memory.max", str(b or "max")),
    pids=lambda n: ("pids.max", str(n or "max")),
    cpu=lambda c: [("cpu.max", f"{cpu_quota_us(c) if c else 'max'} {CPU_PERIOD_US}")],
)


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
        remove_cgroup_dir(d, self.fs.rmdir)


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

    def create(self, name: str, limits: Limits = NO_LIMITS) -> Group:
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
        for _controller, file, value in limit_writes(limits, V2_LIMITS, existed=existed, cpu="cpu" in controllers):
            _fs_write(self.fs, d / file, value)
        if limits.cpus and "cpu" not in controllers:
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
