"""The rank supervisor: the rank processes of this host, from launch to their end.

It prepares a launch's records (keyed by (job, attempt, rank), so a launch is applied once), starts each rank in
its attempt's container (attempts.py) with its environment (partial GPUs through devices.py, the ranks' user
through identity.py) under the rank wrapper (launcher.py), watches it, kills it, adopts the ranks an earlier agent
process left, and serves and rotates their logs (logs.py). A rank's state moves through the table of
rank_states.py; every change is reported through the persisted queue (reports.py), never to the scheduler session
directly. A launch with a readiness probe starts it (readiness.py) once its ranks are started. The session drives
this class through its `RankControl` protocol (session.py).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc

from . import containment as cgroups
from . import identity, launcher, rank_states
from ._background import Background
from .attempts import AttemptTable
from .devices import DeviceGlue
from .mig_manager import MigError
from .mps import MpsError
from .readiness import ReadinessProber
from .reports import ReportQueue
from .state import AgentState, RankRecord, attempt_key, rank_key


class RankSupervisor:
    def __init__(
        self,
        config: Any,
        state: AgentState,
        state_dir: Path,
        log: Any,
        reports: ReportQueue,
        attempts: AttemptTable,
        devices: DeviceGlue,
        background: Background,
        stopping: Callable[[], bool],
        logs_key: Callable[[], str],
        probes: ReadinessProber | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.state_dir = state_dir
        self.log = log
        self.reports = reports
        self.attempts = attempts
        self.devices = devices
        self.background = background
        self.stopping = stopping
        self.logs_key = logs_key
        self.probes = probes  # the leader's readiness probe (readiness.py), started once its ranks are
        self.procs: dict[str, subprocess.Popen] = {}
        self.monitors: dict[str, asyncio.Task] = {}
        self.logs_port = 0
        self.logs_server: Any = None  # services.common.server.AioServer, once serving

    # ---------------------------------------------------------------- RankControl (session.py)

    def live_attempts(self) -> list[str]:
        return sorted(self.attempts.live())

    def prepare_launch(self, launch: agent_pb2.LaunchReplica) -> list[RankRecord]:
        """The launch's new rank records (none of an attempt the scheduler killed, none launched already)."""
        new: list[RankRecord] = []
        if attempt_key(launch.job_id, launch.attempt) in self.state.killed_attempts:
            self.log.info("launch_of_killed_attempt_ignored", job_id=launch.job_id, attempt=launch.attempt)
            return new
        cpus = launch.cpus if math.isfinite(launch.cpus) and launch.cpus > 0 else 0.0
        memory = max(0, launch.memory_bytes)
        for r in launch.ranks:
            key = rank_key(launch.job_id, launch.attempt, r.rank)
            if key in self.state.ranks:
                self.log.info("rank_already_launched", job_id=launch.job_id, attempt=launch.attempt, rank=r.rank)
                continue
            status, log_file = launcher.rank_paths(self.state_dir, launch.job_id, launch.attempt, r.rank)
            rec = RankRecord(
                job_id=launch.job_id,
                attempt=launch.attempt,
                rank=r.rank,
                local_rank=r.local_rank,
                gpus=list(r.gpus),
                replica=launch.replica,
                status_file=str(status),
                log_file=str(log_file),
                slices=[{"gpu": s.gpu, "profile": s.profile, "start": s.start, "size": s.size} for s in r.slices],
                gpu_milli=r.gpu_milli,
                cpus=cpus,
                memory_bytes=memory,
            )
            self.state.ranks[key] = rec
            new.append(rec)
        return new

    def prepare_kill(self, kill: agent_pb2.KillJob) -> None:
        self.state.killed_attempts.add(attempt_key(kill.job_id, kill.attempt))
        if self.probes is not None:
            self.probes.stop(kill.job_id, kill.attempt, kill.reason or "killed by the scheduler")
        for rec in self.attempts.ranks_of(kill.job_id, kill.attempt):
            rec.kill_requested = True

    async def start(self, records: list[RankRecord], command, launch) -> None:
        """Start the launch's new ranks; a rank that cannot start ends FAILED (retryable where the host is at
        fault)."""
        if not records:
            return
        user = self.attempts.launch_user(records, launch)
        problem = user if isinstance(user, str) else self.attempts.master_port_problem(records, launch)
        if problem is not None:
            self.log.warning("rank_port_unavailable", job_id=records[0].job_id, why=problem)
            for rec in records:
                self.finish(rec, "failed", exit_code=127, message=f"cannot start: {problem}", retryable=True)
            return
        shared = dict(launch.env)
        envs = {r.rank: {**shared, **r.env} for r in launch.ranks}
        leader: tuple[RankRecord, dict[str, str]] | None = None  # the first rank started, and its environment
        for rec in records:
            if rec.final:
                continue
            if not command:
                self.finish(rec, "failed", exit_code=127, message="empty command")
                continue
            env = await self._partial_env(rec, records, envs.get(rec.rank, {}))
            if env is None:
                continue
            if rec.final:  # killed while its MIG instances were being made: give them back
                self.devices.release_partial(rec)
                continue
            if self.stopping():
                self.finish(rec, "killed", message="node agent shutting down")  # releases its instances
                continue
            started = self._spawn(rec, list(command), env)
            if started is not None and leader is None:
                leader = (rec, started)
        if leader is not None and launch is not None and launch.HasField("ready_probe") and self.probes is not None:
            self.probes.start(leader[0], launch.ready_probe, leader[1], self.attempts.user_of(leader[0]))
        self.state.save()

    async def _partial_env(self, rec: RankRecord, records: list[RankRecord], env: dict) -> dict[str, str] | None:
        """The rank's environment with its partial GPU set up; None when that failed (the rank has ended)."""
        try:
            return await self.rank_env(rec, env)
        except MpsError as exc:  # the host's fault: the scheduler requeues the gang elsewhere or later
            self.log.warning("rank_mps_failed", rank=rec.key, error=str(exc))
            self.finish(
                rec, "failed", exit_code=127, message=f"cannot start its GPU's MPS daemon: {exc}", retryable=True
            )
        except MigError as exc:  # the host's fault: requeued with backoff, this node struck
            self.log.warning("rank_mig_failed", rank=rec.key, error=str(exc))
            self.finish(rec, "failed", exit_code=127, message=f"cannot set up its MIG instance: {exc}", retryable=True)
            self.roll_back(rec, records, f"rank {rec.rank}'s MIG instance could not be set up")
        except ValueError as exc:
            self.log.warning("rank_partial_gpu_failed", rank=rec.key, error=str(exc))
            self.finish(rec, "failed", exit_code=127, message=f"cannot set up its GPU: {exc}")
        except Exception as exc:  # e.g. an NVML binding without a MIG call: fail the rank only
            self.log.exception("rank_partial_gpu_error", rank=rec.key)
            self.finish(rec, "failed", exit_code=127, message=f"cannot set up its GPU: {exc!r}")
        return None

    async def rank_env(self, rec: RankRecord, env: dict[str, str]) -> dict[str, str]:
        """The rank's environment, for a partial GPU once its MIG instances exist or its GPU's MPS daemon runs."""
        return await self.devices.rank_env(rec, env, self.attempts.user_of(rec))

    def _spawn(self, rec: RankRecord, command: list[str], env: dict[str, str]) -> dict[str, str] | None:
        """The rank's wrapper, in its attempt's container, as its user; a monitor watches it. Its whole environment
        once started, None when it could not be (the rank has ended FAILED)."""
        try:
            group = self.attempts.container(rec)
            work = self.attempts.work_dir(rec.job_id, rec.attempt)
            env = {**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            uuids = self.devices.gpu_uuids
            if rec.gpus and not rec.slices and not rec.gpu_milli and all(g in uuids for g in rec.gpus):
                # Whole GPUs by UUID: the same devices whatever order CUDA would enumerate them in.
                env["CUDA_VISIBLE_DEVICES"] = ",".join(uuids[g] for g in rec.gpus)
            user = self.attempts.user_of(rec)
            env = identity.rank_environment(user, str(work / "tmp"), {**env, **group.env()}, self.config.pass_env)
            if user.uid != os.geteuid():
                self.attempts.checkpoint_dir_for(env, rec.job_id, user)
            proc = launcher.spawn_rank(
                rec,
                command,
                env,
                join=group.join_files(),
                user=user.wrapper_arg if user.uid != os.geteuid() else None,
                cwd=str(work),
            )
        except (OSError, cgroups.ContainmentError) as exc:
            self.finish(rec, "failed", exit_code=127, message=f"cannot start rank wrapper: {exc}")
            return None
        rec.wrapper_pid = proc.pid
        rec.wrapper_start = launcher.proc_start_time(proc.pid)
        self.procs[rec.key] = proc
        self.log.info("rank_spawned", job_id=rec.job_id, attempt=rec.attempt, rank=rec.rank, pid=proc.pid)
        self.monitors[rec.key] = asyncio.create_task(self.monitor(rec, proc), name=f"rank {rec.key}")
        return env

    def roll_back(self, failed: RankRecord, records: list[RankRecord], why: str) -> None:
        """A rank of this attempt could not be set up: its other ranks here give their MIG instances back at once
        (those not started yet are not started; those started are killed), so the attempt holds nothing."""
        for rec in records:
            if rec is failed or rec.final or (rec.job_id, rec.attempt) != (failed.job_id, failed.attempt):
                continue
            if rec.key in self.procs:
                self.background.spawn(self.kill_rank(rec, f"rolled back: {why}"))
            else:
                self.finish(rec, "failed", exit_code=127, message=f"not started: {why}", retryable=True)

    async def stop_attempt(self, job_id: str, attempt: int, reason: str) -> None:
        """A kill of the whole attempt: every process of its container (daemons of its ranks included) gets
        SIGTERM, what outlives --kill-grace SIGKILL; its ranks end KILLED."""
        ranks = self.attempts.ranks_of(job_id, attempt)
        for rec in ranks:
            rec.kill_requested = True
        if self.probes is not None:
            self.probes.stop(job_id, attempt, reason)
        self.state.save()
        group = self.attempts.groups.get(attempt_key(job_id, attempt))
        if group is None:
            for rec in ranks:
                self.background.spawn(self.kill_rank(rec, reason))
            return
        self.log.info("killing_attempt", job_id=job_id, attempt=attempt, reason=reason, ranks=len(ranks))
        await self.attempts.empty_and_remove(group, reason)
        for rec in ranks:  # a rank with no monitor (never started) is settled here
            if not rec.final and rec.key not in self.monitors:
                self.finish(rec, "killed", message=reason)

    async def kill_rank(self, rec: RankRecord, reason: str) -> None:
        if rec.final:
            return
        rec.kill_requested = True
        self.state.save()
        self.log.info("killing_rank", rank=rec.key, reason=reason, pid=rec.wrapper_pid)
        if rec.wrapper_pid and self.alive(rec):
            launcher.signal_group(rec.wrapper_pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.kill_grace_s
        while not rec.final and self.alive(rec) and time.monotonic() < deadline:
            await asyncio.sleep(self.config.poll_interval_s)
        if not rec.final and rec.wrapper_pid and self.alive(rec):
            self.log.warning("rank_sigkill", rank=rec.key)
            launcher.signal_group(rec.wrapper_pid, signal.SIGKILL)
        monitor = self.monitors.get(rec.key)
        if monitor is None and not rec.final:
            # Nothing watches it (e.g. still "starting" with no process): settle it here.
            while rec.wrapper_pid and self.alive(rec):
                await asyncio.sleep(self.config.poll_interval_s)
            self.finish(rec, "killed", message=reason)

    async def discard(self, why: str) -> None:
        """Another ledger's ranks: killed (adopted processes included) and settled LOST without a report (that
        ledger is not this scheduler's); the MIG instances and MPS daemons they used are released as usual."""
        live = [r for r in self.state.ranks.values() if not r.final]
        if not live:
            return
        self.log.warning("killing_ranks_of_another_ledger", ranks=[r.key for r in live], reason=why)
        await asyncio.gather(*(self.kill_rank(r, why) for r in live), return_exceptions=True)
        monitors = [m for r in live if (m := self.monitors.get(r.key)) is not None]
        if monitors:
            await asyncio.wait(monitors, timeout=self.config.kill_grace_s + 2)
        for rec in live:
            if rec.final:
                continue
            monitor = self.monitors.pop(rec.key, None)
            if monitor is not None:
                monitor.cancel()
            self.procs.pop(rec.key, None)
            if self.alive(rec):
                self.log.error("rank_of_another_ledger_survives", rank=rec.key, pid=rec.wrapper_pid)
            self._move(rec, rank_states.LOST)
            rec.message = why
            self.devices.release_partial(rec)

    # ---------------------------------------------------------------- a rank's states

    def _move(self, rec: RankRecord, event: str) -> None:
        """Move the record through the life cycle table (rank_states.py). A move the table does not have is a
        bug: logged, and the rank still settles as asked, so that it never stays unsettled."""
        try:
            rec.state = rank_states.advance(rec.state, event)
        except rank_states.IllegalRankTransition as exc:
            self.log.error("rank_transition_illegal", rank=rec.key, error=str(exc))
            rec.state = event if event in rank_states.STATES else rank_states.RUNNING

    def alive(self, rec: RankRecord) -> bool:
        proc = self.procs.get(rec.key)
        if proc is not None:
            return proc.poll() is None
        return launcher.pid_alive(rec.wrapper_pid, rec.wrapper_start)

    async def monitor(self, rec: RankRecord, proc: subprocess.Popen | None, adopted: bool = False) -> None:
        poll = self.config.poll_interval_s
        if not adopted and not await self._until_started(rec, proc):
            return
        while self.alive(rec):
            await asyncio.sleep(poll)
        self.procs.pop(rec.key, None)
        st = launcher.read_status(rec.status_file) or {}
        if st.get("state") == "exited":
            code = int(st.get("exit_code", 0))
        elif proc is not None and proc.returncode is not None:
            code = launcher.exit_code_from_returncode(proc.returncode)
        else:
            code = None
        if rec.kill_requested:
            self.finish(rec, "killed", exit_code=code or 0, message="killed")
        elif code is not None:
            oom = self.attempts.out_of_memory(rec) if code else ""
            self.finish(rec, "exited", exit_code=code, message=oom or f"exited with code {code}")
        else:
            self.finish(
                rec,
                "lost",
                message=self.attempts.out_of_memory(rec) or "the rank process is gone and left no exit status",
            )

    async def _until_started(self, rec: RankRecord, proc: subprocess.Popen | None) -> bool:
        """Wait for the wrapper to say the command started (True: RUNNING, reported), or end the rank (False)."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            st = launcher.read_status(rec.status_file)
            if st and st.get("state") in ("running", "exited"):
                rec.child_pid = int(st.get("child_pid", 0))
                self._move(rec, rank_states.STARTED)
                self.state.save()
                self.reports.rank(rec, "running", message="started")
                return True
            if st and st.get("state") == "failed":
                self._wait_gone(rec)
                self.finish(rec, "failed", exit_code=127, message=st.get("error", "could not start"))
                return False
            if not self.alive(rec):
                if launcher.read_status(rec.status_file):
                    continue
                rc = proc.returncode if proc is not None else -1
                if rec.kill_requested:
                    self.finish(
                        rec,
                        "killed",
                        exit_code=launcher.exit_code_from_returncode(rc),
                        message="killed before it started",
                    )
                else:
                    self.finish(
                        rec,
                        "failed",
                        exit_code=launcher.exit_code_from_returncode(rc),
                        message=f"rank wrapper exited with {rc} before starting the command",
                    )
                return False
            if time.monotonic() > deadline:
                self.log.warning("rank_start_slow", rank=rec.key)
                deadline = float("inf")
            await asyncio.sleep(self.config.poll_interval_s)

    def _wait_gone(self, rec: RankRecord) -> None:
        proc = self.procs.pop(rec.key, None)
        if proc is not None:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass

    def finish(
        self, rec: RankRecord, state: str, exit_code: int = 0, message: str = "", retryable: bool = False
    ) -> None:
        """The rank ended (`state`: exited, failed, killed or lost): settle its record, stop watching it, and hand
        its end to the attempt table (which reports it and gives its GPUs back, at once or once its container is
        empty). A rank that has ended already is left as it is."""
        if rec.final:
            return
        self._move(rec, state)
        rec.exit_code, rec.message, rec.retryable = exit_code, message, retryable
        self.monitors.pop(rec.key, None)
        self.procs.pop(rec.key, None)
        self.log.info("rank_finished", rank=rec.key, state=state, exit_code=exit_code, message=message)
        self.attempts.rank_ended(rec, state, exit_code, message, retryable)

    # ---------------------------------------------------------------- after an agent restart

    def adopt(self) -> None:
        """Take over ranks left by a previous agent process: adopt live ones, settle the dead ones."""
        # First the MIG instances live ranks use, so settling a dead rank never destroys an instance in use.
        for rec in self.state.ranks.values():
            if not rec.final and (rec.slices or rec.gpu_milli) and self.wrapper_survived(rec):
                self.devices.adopt(rec)
        for rec in list(self.state.ranks.values()):
            if not rec.final:
                self._adopt_one(rec)
        self.state.save()
        self.devices.stop_unused_mps()

    def _adopt_one(self, rec: RankRecord) -> None:
        st = launcher.read_status(rec.status_file) or {}
        if not rec.wrapper_pid and st.get("wrapper_pid"):
            rec.wrapper_pid = int(st["wrapper_pid"])
            rec.wrapper_start = launcher.proc_start_time(rec.wrapper_pid)
        if rec.wrapper_pid and launcher.pid_alive(rec.wrapper_pid, rec.wrapper_start):
            rec.child_pid = rec.child_pid or int(st.get("child_pid", 0))
            was_running = rec.state == "running"
            self._move(rec, rank_states.ADOPTED)
            self.log.info("rank_adopted", rank=rec.key, pid=rec.wrapper_pid)
            if not was_running:
                self.reports.rank(rec, "running", message="adopted by a restarted agent")
            self.monitors[rec.key] = asyncio.create_task(self.monitor(rec, None, adopted=True))
            if rec.kill_requested or attempt_key(rec.job_id, rec.attempt) in self.state.killed_attempts:
                self.background.spawn(self.kill_rank(rec, "kill requested before the agent restarted"))
        elif st.get("state") == "exited":
            code = int(st.get("exit_code", 0))
            if rec.kill_requested:
                self.finish(rec, "killed", exit_code=code, message="killed")
            else:
                oom = self.attempts.out_of_memory(rec) if code else ""
                self.finish(
                    rec, "exited", exit_code=code, message=oom or f"exited with code {code} while the agent was down"
                )
        elif st.get("state") == "failed":
            self.finish(rec, "failed", exit_code=127, message=st.get("error", "could not start"))
        elif rec.kill_requested:
            self.finish(rec, "killed", message="killed")
        else:
            self.finish(rec, "lost", message="rank process gone after an agent restart, no exit status")

    @staticmethod
    def wrapper_survived(rec: RankRecord) -> bool:
        """Whether a rank's wrapper from a previous agent process still runs (the test adopt makes)."""
        if rec.wrapper_pid:
            return launcher.pid_alive(rec.wrapper_pid, rec.wrapper_start)
        pid = int((launcher.read_status(rec.status_file) or {}).get("wrapper_pid", 0))
        return bool(pid) and launcher.pid_alive(pid, launcher.proc_start_time(pid))

    # ---------------------------------------------------------------- logs

    async def open_logs(self) -> None:
        """Serve the ranks' logs (AgentLogs) and keep them bounded (logs.py)."""
        from services.common.server import AioServer

        from . import logs

        listen = self.config.logs_listen
        if listen != "off":
            listen = listen or f"{self.config.address}:0"
            servicer = logs.AgentLogsServicer(self.logs_key, self.state_dir, self.rank_live)
            try:
                server = AioServer(
                    listen,
                    [lambda s: agent_pb2_grpc.add_AgentLogsServicer_to_server(servicer, s)],
                    [logs.SERVICE_NAME],
                )
                await server.start()
            except Exception as exc:  # a port in use: the node serves no logs, and says so
                self.log.warning("logs_not_served", listen=listen, error=str(exc)[:300])
            else:
                self.logs_server, self.logs_port = server, server.port
                self.log.info("logs_served", address=server.address)
        if self.config.log_max_bytes > 0:
            self.background.spawn(self._rotate_logs())

    async def close_logs(self) -> None:
        if self.logs_server is not None:
            await self.logs_server.stop(0.5)

    def rank_live(self, job_id: str, attempt: int, rank: int) -> bool:
        return any(
            r.job_id == job_id and r.attempt == attempt and r.rank == rank and not r.final
            for r in list(self.state.ranks.values())
        )

    async def _rotate_logs(self) -> None:
        from . import logs

        while not self.stopping():
            paths = [Path(r.log_file) for r in list(self.state.ranks.values()) if not r.final and r.log_file]
            for path in paths:
                if await asyncio.to_thread(logs.rotate, path, self.config.log_max_bytes):
                    self.log.info("rank_log_rotated", path=str(path), max_bytes=self.config.log_max_bytes)
            await asyncio.sleep(1.0)
