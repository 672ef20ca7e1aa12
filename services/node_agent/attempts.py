"""The attempt table: an attempt's life on this host, apart from its rank processes.

An attempt here has a container (containment.py) with its CPU quota, memory limit and device rules, a working
directory, the user its ranks run as, and possibly the MASTER_PORT its rank 0 holds. When its last rank here ends
(`rank_ended`), the container is emptied and removed (`close`); only then do its MIG instances and MPS shares go
back, are the last ranks' end reports queued, and is the scheduler told AttemptReleased (`release`). So when the
scheduler sees an attempt end on this host, nothing of it runs here any more.

Reports go through the persisted queue (reports.py); the table never calls the scheduler session.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any

from . import containment as cgroups
from . import identity
from ._background import Background
from .devices import DeviceGlue
from .reports import ReportQueue
from .state import AgentState, RankRecord, attempt_key, safe_name


def group_name(job_id: str, attempt: int) -> str:
    """The attempt's container name on this host."""
    return f"{safe_name(job_id)}-a{attempt}"


class AttemptTable:
    def __init__(
        self,
        config: Any,
        state: AgentState,
        state_dir: Path,
        log: Any,
        reports: ReportQueue,
        devices: DeviceGlue,
        background: Background,
        rank_user: identity.RankUser,
    ) -> None:
        self.config = config
        self.state = state
        self.state_dir = state_dir
        self.log = log
        self.reports = reports
        self.devices = devices
        self.background = background
        self.rank_user = rank_user
        self.containment: cgroups.Containment | None = config.containment
        self.groups: dict[str, cgroups.Group] = {}  # attempt key -> its container on this host
        self.group_limits: dict[str, cgroups.Limits] = {}  # attempt key -> its container's limits (GPU devices,
        # CPU quota, memory), as last applied by this process
        self.closing: dict[str, asyncio.Task] = {}  # attempt key -> the task that empties and removes it
        self.held_reports: dict[str, list[tuple[tuple, dict]]] = {}  # attempt key -> its last ranks' end reports
        # attempt key -> its ended ranks whose MIG instances / MPS shares wait for the container to be empty
        self.held_partials: dict[str, list[RankRecord]] = {}
        self.ports: dict[int, str] = {}  # MASTER_PORT -> the live attempt whose rank 0 here holds it
        self.users: dict[str, identity.RankUser] = {}  # attempt key -> its launch's user (run_as)

    # ---------------------------------------------------------------- lookups

    def ranks_of(self, job_id: str, attempt: int) -> list[RankRecord]:
        """The attempt's ranks here that have not ended."""
        return [r for r in self.state.ranks.values() if r.job_id == job_id and r.attempt == attempt and not r.final]

    def live(self) -> set[str]:
        """Attempt keys with a live rank, a container or a close under way (the registration's live_attempts)."""
        return (
            {attempt_key(r.job_id, r.attempt) for r in self.state.ranks.values() if not r.final}
            | set(self.groups)
            | set(self.closing)
        )

    def work_dir(self, job_id: str, attempt: int) -> Path:
        return self.state_dir / "work" / group_name(job_id, attempt)

    def user_of(self, rec: RankRecord) -> identity.RankUser:
        return self.users.get(attempt_key(rec.job_id, rec.attempt), self.rank_user)

    def launch_user(self, records: list[RankRecord], launch) -> identity.RankUser | str:
        """The ranks' user: the launch's (its tenant's unix_user), else --run-as; a string says why not."""
        if launch is None or not launch.run_as:
            return self.rank_user
        try:
            user = identity.resolve_user(launch.run_as)
        except ValueError as exc:
            return str(exc)
        if user.uid != os.geteuid() and os.geteuid() != 0:
            return f"this agent does not run as root, so it cannot run ranks as {user.name!r}"
        self.users[attempt_key(records[0].job_id, records[0].attempt)] = user
        return user

    def master_port_problem(self, records: list[RankRecord], launch) -> str | None:
        """A launch with rank 0 here holds its MASTER_PORT for the attempt: None when it is free (now held), else
        why not (the ranks then fail to start, retryably: another host or later)."""
        rank0 = next((r for r in launch.ranks if r.rank == 0), None)
        if rank0 is None or not any(r.rank == 0 for r in records):
            return None
        value = rank0.env.get("MASTER_PORT") or launch.env.get("MASTER_PORT", "")
        if not value.isdigit():
            return None
        port, key = int(value), attempt_key(records[0].job_id, records[0].attempt)
        holder = self.ports.get(port)
        if holder not in (None, key):
            return f"MASTER_PORT {port} is held by attempt {holder} on this host"
        if holder is None:
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("", port))
                except OSError as exc:
                    return f"MASTER_PORT {port} is in use on this host ({exc.strerror or exc})"
            self.ports[port] = key
        return None

    @staticmethod
    def checkpoint_dir_for(env: dict[str, str], job_id: str, user: identity.RankUser) -> None:
        """The job's checkpoint directory (PHALANX_CHECKPOINT_DIR/<job>) exists and is the ranks' user's."""
        root = env.get("PHALANX_CHECKPOINT_DIR")
        if root and not os.path.isdir(root) and os.path.isdir(os.path.dirname(root.rstrip("/"))):
            with contextlib.suppress(OSError):  # a tenant's directory under the store's root (<root>/<tenant>)
                os.mkdir(root, 0o711)
        if root and os.path.isdir(root):
            identity.make_owned_dir(Path(root) / job_id, user, 0o750)

    # ---------------------------------------------------------------- containers

    def open_containment(self) -> None:
        if self.containment is None:
            # The default parent is named after the node and its state directory: agents of the same node name
            # with other state (tests, a host running several simulated nodes) never share containers.
            tag = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:8]
            self.containment = cgroups.detect(
                self.config.cgroup_parent,
                node_name=f"{safe_name(self.config.node_name)}-{tag}",
                force=self.config.containment_kind,
            )
        kind, reason = self.containment.kind, self.containment.reason
        if kind == "process-group":
            self.log.warning("containment", kind=kind, reason=reason, run_as=self.rank_user.name)
        else:
            self.log.info("containment", kind=kind, reason=reason, run_as=self.rank_user.name)

    def clean_up_containers(self) -> None:
        """Containers a previous agent process left with no live rank of its own: emptied and removed."""
        assert self.containment is not None
        live = {group_name(r.job_id, r.attempt) for r in self.state.ranks.values() if not r.final}
        for name in self.containment.names():
            group = self.containment.open(name)
            if group is None:
                continue
            if name in live:
                key = self._attempt_of_group(name)
                job_id, _, attempt = key.rpartition("/")
                memory = self.limits_of(job_id, int(attempt))[1]
                if memory:  # what the scheduler reserved (the cgroup reads it back rounded to pages)
                    group.memory_limit = memory
                self.groups[key] = group
                continue
            self.log.info("container_left_over", container=name, processes=len(group.pids()))
            self.background.spawn(self.empty_and_remove(group, "left by an earlier agent process"))

    def _attempt_of_group(self, name: str) -> str:
        for r in self.state.ranks.values():
            if group_name(r.job_id, r.attempt) == name:
                return attempt_key(r.job_id, r.attempt)
        return name

    def container(self, rec: RankRecord) -> cgroups.Group:
        """The container of the rank's attempt (created with its working and temporary directories). Its device
        rules let it open the GPUs of the attempt's ranks on this host (and the control devices), and of the
        nvidia-caps only its own MIG instances' capabilities, no other; its CPU
        quota and memory limit are the sums of the reservations of the attempt's replicas here (limits_of).
        Updated in place when another replica of the attempt lands here."""
        key = attempt_key(rec.job_id, rec.attempt)
        mine = [r for r in self.state.ranks.values() if r.attempt == rec.attempt and r.job_id == rec.job_id]
        minors = tuple(sorted({self.devices.minors.get(g, g) for r in mine for g in r.gpus}))
        instances = sorted(
            {
                (int(sl["gpu"]), int(sl.get("gi_id", -1)), int(sl.get("ci_id", -1)))
                for r in mine
                for sl in r.slices
                if sl.get("uuid")
            }
        )
        caps = cgroups.nvidia_cap_minors(instances, self.config.mig_minors_file) if instances else ()
        cpus, memory = self.limits_of(rec.job_id, rec.attempt)
        limits = cgroups.Limits(
            memory_bytes=memory, cpus=cpus, pids_max=self.config.pids_max, gpu_minors=minors, cap_minors=caps
        )
        group = self.groups.get(key)
        if group is None or self.group_limits.get(key) != limits:
            assert self.containment is not None
            group = self.containment.create(group_name(rec.job_id, rec.attempt), limits)
            self._log_limits(group, cpus, memory)
            self.group_limits[key] = limits
        fresh = key not in self.groups
        self.groups[key] = group  # a new group object after an update: it knows the new memory limit
        if fresh:
            root = self.state_dir / "work"
            root.mkdir(exist_ok=True)
            root.chmod(0o711)  # the ranks' users reach their own directories, and list nobody else's
            user = self.user_of(rec)
            work = identity.make_owned_dir(self.work_dir(rec.job_id, rec.attempt), user)
            identity.make_owned_dir(work / "tmp", user)
        return group

    def _log_limits(self, group: cgroups.Group, cpus: float, memory: int) -> None:
        assert self.containment is not None
        if (cpus or memory) and not self.containment.limits_enforced:
            self.log.warning(
                "container_limits_not_enforced",
                container=group.name,
                kind=self.containment.kind,
                cpus=cpus,
                memory=cgroups.format_size(memory) if memory else "no limit",
            )
        elif cpus or memory:
            self.log.info(
                "container_limits",
                container=group.name,
                cpus=cpus or "no limit",
                memory=cgroups.format_size(memory) if memory else "no limit",
            )

    def limits_of(self, job_id: str, attempt: int) -> tuple[float, int]:
        """(CPUs, memory bytes) the attempt's container here is limited to: the sum of its replicas' reservations on
        this host (each replica counted once, whatever its number of ranks); 0 where none asks."""
        replicas: dict[int, tuple[float, int]] = {}
        for r in self.state.ranks.values():
            if r.job_id == job_id and r.attempt == attempt:
                replicas.setdefault(r.replica, (r.cpus, r.memory_bytes))
        cpus = round(sum(c for c, _ in replicas.values()), 3)
        return cpus, sum(m for _, m in replicas.values())

    def out_of_memory(self, rec: RankRecord) -> str:
        """`out of memory (limit 512M)` when the attempt's container here has a memory limit and its OOM killer
        killed a process that no earlier report told (each kill is told once), else ""."""
        key = attempt_key(rec.job_id, rec.attempt)
        group = self.groups.get(key)
        if group is None and self.containment is not None:
            try:
                group = self.containment.open(group_name(rec.job_id, rec.attempt))
            except (OSError, ValueError, cgroups.ContainmentError):
                group = None
        if group is None or not group.memory_limit:
            return ""
        try:
            kills = group.oom_kills()
        except (OSError, ValueError):
            return ""
        seen = self.state.oom_seen.get(key, 0)
        if kills <= seen:
            return ""
        self.state.oom_seen[key] = seen + 1
        limit = self.limits_of(rec.job_id, rec.attempt)[1] or group.memory_limit
        return f"out of memory (limit {cgroups.format_size(limit)})"

    async def empty_and_remove(self, group: cgroups.Group, why: str) -> bool:
        """SIGTERM everything left in the container, SIGKILL what outlives --kill-grace, then remove it. True when
        it is empty (and removed, or left as an empty directory that could not be removed)."""
        poll = self.config.poll_interval_s
        if not group.empty():
            self.log.info("container_stopping", container=group.name, why=why, processes=len(group.pids()))
            group.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.config.kill_grace_s
            while not group.empty() and time.monotonic() < deadline:
                await asyncio.sleep(poll)
        if not group.empty():
            self.log.warning("container_sigkill", container=group.name, processes=len(group.pids()))
            await asyncio.to_thread(group.kill)
            deadline = time.monotonic() + 10.0
            while not group.empty() and time.monotonic() < deadline:
                await asyncio.sleep(poll)
        if not group.empty():
            self.log.error("container_not_emptied", container=group.name, processes=sorted(group.pids()))
            return False
        try:
            await asyncio.to_thread(group.remove)
        except cgroups.ContainmentError as exc:
            self.log.error("container_not_removed", container=group.name, error=str(exc))
            return group.empty()
        return True

    # ---------------------------------------------------------------- an attempt's end: close, release

    def rank_ended(self, rec: RankRecord, state: str, exit_code: int, message: str, retryable: bool) -> None:
        """A rank of the attempt ended (its record already final): report it, or hold the report when it was the
        attempt's last rank here with a container; give its partial GPUs back, or hold them until the container is
        empty; close the attempt once none of its ranks is left."""
        key = attempt_key(rec.job_id, rec.attempt)
        if key in self.groups and not self.ranks_of(rec.job_id, rec.attempt):
            # The attempt's last rank here: its end is reported once the container is empty, so that when the
            # scheduler sees every rank of the attempt ended here, nothing of it runs here any more.
            self.held_reports.setdefault(key, []).append(
                ((rec, state), dict(exit_code=exit_code, message=message, retryable=retryable))
            )
        else:
            self.reports.rank(rec, state, exit_code=exit_code, message=message, retryable=retryable)
        if key in self.groups or key in self.closing:
            # Its MIG instances / MPS share go back once the attempt's container is empty (close): a process the
            # rank left may still use them, and the next attempt must not get them meanwhile.
            self.held_partials.setdefault(key, []).append(rec)
            self.devices.rank_ending(rec)
        else:
            self.devices.release_partial(rec)
        self.attempt_ended(rec)

    def attempt_ended(self, rec: RankRecord) -> None:
        """Once every rank of an attempt on this host has ended, its container is emptied and removed; then the
        scheduler hears that the attempt's GPUs here are free (AttemptReleased)."""
        key = attempt_key(rec.job_id, rec.attempt)
        if key in self.closing or self.ranks_of(rec.job_id, rec.attempt):
            return
        if key not in self.groups:  # it never had a process here (nothing started)
            self.release(rec.job_id, rec.attempt)
            return
        task = asyncio.create_task(self.close(rec.job_id, rec.attempt), name=f"close {key}")
        self.closing[key] = task
        task.add_done_callback(functools.partial(self._closed, key))

    def _closed(self, key: str, _task: asyncio.Task) -> None:
        self.closing.pop(key, None)

    async def close(self, job_id: str, attempt: int) -> None:
        """Empty and remove the attempt's container; only once it is empty (the kernel's `populated 0` on cgroup
        v2) do its MIG instances and MPS shares go back and does the scheduler hear AttemptReleased. A container
        that will not empty (a process stuck in the kernel) is tried again and again: its GPUs stay releasing."""
        key = attempt_key(job_id, attempt)
        group = self.groups.get(key)
        if group is not None:
            tries = 0
            while not await self.empty_and_remove(group, "its attempt ended" if not tries else "still not empty"):
                tries += 1
                self.log.warning("container_not_empty", container=group.name, tries=tries, held="gpus, instances")
                await asyncio.sleep(min(30.0, self.config.kill_grace_s * tries + 1.0))
            self.groups.pop(key, None)
            self.group_limits.pop(key, None)
        for rec in self.held_partials.pop(key, []):
            self.devices.release_partial(rec)
        await asyncio.to_thread(shutil.rmtree, self.work_dir(job_id, attempt), True)
        for args in self.held_reports.pop(key, []):  # the last ranks' ends, held until the container was empty
            self.reports.rank(*args[0], **args[1])
        self.release(job_id, attempt)

    def release(self, job_id: str, attempt: int) -> None:
        """Tell the scheduler (after every report queued before it) that no process of the attempt is left here."""
        key = attempt_key(job_id, attempt)
        self.users.pop(key, None)
        self.state.oom_seen.pop(key, None)
        self.state.probes.pop(key, None)  # its readiness probe, if this host ran it (readiness.py)
        for port in [p for p, holder in self.ports.items() if holder == key]:
            del self.ports[port]
        self.reports.released(job_id, attempt)
