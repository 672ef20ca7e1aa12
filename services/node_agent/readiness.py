"""Readiness probes: the leader's agent runs its gang's probe and reports each change (ReportReadiness).

The scheduler sets `LaunchReplica.ready_probe` on the leader's replica only (replica 0). Once that launch's ranks
are started here, the agent probes the attempt: after `initial_delay_s`, one check every `period_s` (from the start
of one check to the start of the next), each within `timeout_s`:

- HTTP: `GET http://<--address>:<http_port><http_path>` (the address ranks reach this host at, as MASTER_ADDR);
  a 2xx answer passes, anything else (another status, a refused connection, no answer in time) fails.
- command: run the way ranks run, through the rank wrapper: in the attempt's container (so it counts against its
  limits and dies with it), as the ranks' user, in the attempt's working directory, with the leader rank's
  environment (the job's env and the rank variables). Exit 0 within `timeout_s` passes; on a timeout the probe's
  whole process group is killed. The wrapper switches the user itself: the agent never forks with `user=`
  (identity.argv_as says why), and the probe is an asyncio subprocess, so the event loop never waits on it.

`ReadinessTracker` (pure) turns checks into the changes reported: ready on the first pass; not ready after
`failure_threshold` failures in a row once ready (probing goes on, and a pass makes it ready again); nothing else.
A change goes into the persisted report queue (reports.py, kind `ready`), replacing an unsent one of the same
attempt, so it survives a scheduler outage and an agent restart, and the latest state wins. Probing stops when the
attempt's ranks here end or are being killed, when the scheduler answers a report `stale` (the attempt is no longer
the job's running one), and when the agent stops. What a probe needs (its spec, the ranks' user, the leader rank,
the last state reported) is kept in the state file: a restarted agent that adopts the ranks probes on, a command
probe then with the environment of the leader's rank wrapper (/proc/<pid>/environ).
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import signal
import tempfile
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.api.v1 import common_pb2

from . import identity, launcher
from ._background import Background
from .attempts import AttemptTable
from .reports import ReportQueue
from .state import AgentState, RankRecord, attempt_key, rank_key, safe_name

DEFAULT_PERIOD_S = 2.0
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_FAILURE_THRESHOLD = 3
OUTPUT_KEPT = 2048  # bytes of a command probe's output kept, for the message of a failure
_PATH_SAFE = "/:@!$&'()*+,;=?%-._~"  # what a probe's path keeps as it is in the request line (the rest is quoted)


@dataclass(frozen=True)
class ProbeSpec:
    """A ReadyProbe with its defaults applied (0 period or timeout: 2 s; 0 threshold: 3)."""

    command: tuple[str, ...] = ()
    http_port: int = 0
    http_path: str = "/"
    period_s: float = DEFAULT_PERIOD_S
    initial_delay_s: float = 0.0
    timeout_s: float = DEFAULT_TIMEOUT_S
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD

    @classmethod
    def of(cls, msg: common_pb2.ReadyProbe) -> ProbeSpec:
        def seconds(value: float, default: float) -> float:
            return value if math.isfinite(value) and value > 0 else default

        return cls(
            command=tuple(msg.command),
            http_port=msg.http_port,
            http_path=msg.http_path or "/",
            period_s=seconds(msg.period_s, DEFAULT_PERIOD_S),
            initial_delay_s=seconds(msg.initial_delay_s, 0.0),
            timeout_s=seconds(msg.timeout_s, DEFAULT_TIMEOUT_S),
            failure_threshold=msg.failure_threshold if msg.failure_threshold > 0 else DEFAULT_FAILURE_THRESHOLD,
        )

    def to_dict(self) -> dict:
        return dict(
            command=list(self.command),
            http_port=self.http_port,
            http_path=self.http_path,
            period_s=self.period_s,
            initial_delay_s=self.initial_delay_s,
            timeout_s=self.timeout_s,
            failure_threshold=self.failure_threshold,
        )

    @classmethod
    def from_dict(cls, data: dict) -> ProbeSpec:
        return cls(**{**data, "command": tuple(data.get("command") or ())})

    @property
    def what(self) -> str:
        return f"GET :{self.http_port}{self.http_path}" if self.http_port else "command"


@dataclass
class ReadinessTracker:
    """Which checks are changes to report: ready on the first pass; not ready after `failure_threshold` failures
    in a row once ready; nothing before the first pass, nothing while the state holds."""

    failure_threshold: int
    ready: bool | None = None  # the last state reported (None: none yet)
    failures: int = 0  # failed checks in a row

    def observe(self, passed: bool) -> bool | None:
        """The new state to report after a check, None when there is nothing to report."""
        if passed:
            self.failures = 0
            if self.ready is not True:
                self.ready = True
                return True
            return None
        self.failures += 1
        if self.ready is True and self.failures >= self.failure_threshold:
            self.ready = False
            return False
        return None


async def http_check(host: str, port: int, path: str, timeout: float) -> tuple[bool, str]:
    """GET http://host:port/path within `timeout`: (passed: a 2xx status, what happened)."""
    target = urllib.parse.quote(path or "/", safe=_PATH_SAFE)
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                f"GET {target} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: phalanx-agent-probe\r\n"
                "Accept: */*\r\nConnection: close\r\n\r\n".encode("ascii")
            )
            await writer.drain()
            line = await reader.readline()
    except TimeoutError:
        return False, f"GET {authority}{target}: no answer within {timeout:g}s"
    except (OSError, ValueError) as exc:
        return False, f"GET {authority}{target}: {getattr(exc, 'strerror', None) or exc}"
    finally:
        if writer is not None:
            writer.close()
    parts = line.decode("latin-1").split()
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return False, f"GET {authority}{target}: not an HTTP answer"
    code = int(parts[1])
    return 200 <= code < 300, f"HTTP {code}"


async def command_check(argv: list[str], env: dict[str, str], timeout: float) -> tuple[bool, str]:
    """Run `argv` (its own process group) within `timeout`: (passed: exit 0, what happened). A probe still running
    at the timeout is killed with its whole process group.

    Its output goes to an anonymous temporary file, not a pipe: asyncio's `Process.wait()` (3.11) returns only once
    the process has exited *and* its pipes are closed, so a pipe held open by a process outside the group (a
    daemon it started in a session of its own, a fork of this process taken while the pipe was open) kept the wait,
    and with it the probe, hanging long after the kill."""
    with tempfile.TemporaryFile() as out:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            return False, f"cannot run the probe: {exc.strerror or exc}"
        timed_out = False
        try:
            async with asyncio.timeout(timeout):
                code = await proc.wait()
        except TimeoutError:
            timed_out = True
        finally:
            if timed_out or proc.returncode is None:  # timed out, or cancelled (probing stopped)
                launcher.signal_group(proc.pid, signal.SIGKILL)
                await _reaped(proc, timeout)
        if timed_out:
            return False, f"the probe command did not exit within {timeout:g}s"
        if code == 0:
            return True, "exit 0"
        out.seek(max(0, out.seek(0, os.SEEK_END) - OUTPUT_KEPT))
        tail = out.read()
    lines = tail.decode(errors="replace").strip().splitlines()
    last = f": {lines[-1][:200]}" if lines else ""
    return False, f"exit {launcher.exit_code_from_returncode(code)}{last}"


_UNREAPED: set[asyncio.Future[int]] = set()  # killed probes still exiting (_reaped): referenced until they have


async def _reaped(proc: asyncio.subprocess.Process, within: float) -> None:
    """Wait for a killed probe to exit, at most `within` seconds. A SIGKILL takes effect only once the process
    leaves an uninterruptible wait (such as a write to a cgroup's cgroup.procs, which the kernel can hold for
    seconds on a host busy with cgroups); the probing must not stop meanwhile, so past `within` the exit is left to
    asyncio's child watcher, which reaps the process when it comes."""
    done = asyncio.ensure_future(proc.wait())
    try:
        await asyncio.wait_for(asyncio.shield(done), within)
    except TimeoutError:
        _UNREAPED.add(done)
        done.add_done_callback(_UNREAPED.discard)


@dataclass
class _Probe:
    job_id: str
    attempt: int
    spec: ProbeSpec
    user: identity.RankUser
    leader: int  # the rank whose environment a command probe gets
    env: dict[str, str] | None  # that environment (None: to be read from the leader's wrapper)
    tracker: ReadinessTracker = field(init=False)

    @property
    def key(self) -> str:
        return attempt_key(self.job_id, self.attempt)


class ReadinessProber:
    """The readiness probes of this host's leader ranks, one asyncio task per attempt."""

    def __init__(
        self,
        config: Any,
        state: AgentState,
        state_dir: Path,
        log: Any,
        reports: ReportQueue,
        attempts: AttemptTable,
        background: Background,
        stopping: Callable[[], bool],
    ) -> None:
        self.config = config
        self.state = state
        self.state_dir = state_dir
        self.log = log
        self.reports = reports
        self.attempts = attempts
        self.background = background
        self.stopping = stopping
        self.tasks: dict[str, asyncio.Task] = {}  # attempt key -> its probe's task

    # ---------------------------------------------------------------- starting and stopping

    def start(
        self, leader: RankRecord, message: common_pb2.ReadyProbe, env: dict[str, str], user: identity.RankUser
    ) -> None:
        """Probe the leader's attempt (its ranks here have just been started); once per attempt."""
        key = attempt_key(leader.job_id, leader.attempt)
        if key in self.tasks:
            return
        spec = ProbeSpec.of(message)
        self.state.probes[key] = dict(
            job_id=leader.job_id, attempt=leader.attempt, spec=spec.to_dict(), user=user.name, leader=leader.rank
        )
        self.state.save()
        self._launch(_Probe(leader.job_id, leader.attempt, spec, user, leader.rank, env), ready=None)

    def resume(self) -> None:
        """After an agent restart (the ranks adopted): probe on for the attempts still live here, from the state
        last reported; forget the others."""
        for key, saved in list(self.state.probes.items()):
            try:
                job_id, attempt = str(saved["job_id"]), int(saved["attempt"])
                spec = ProbeSpec.from_dict(saved["spec"])
                leader = int(saved.get("leader", 0))
            except (KeyError, TypeError, ValueError) as exc:
                self.log.warning("readiness_probe_unreadable", attempt=key, error=str(exc))
                del self.state.probes[key]
                continue
            if not self.attempts.ranks_of(job_id, attempt) or key in self.tasks:
                if key not in self.tasks:
                    del self.state.probes[key]
                continue
            try:
                user = identity.resolve_user(str(saved.get("user") or ""))
            except ValueError:
                user = self.attempts.rank_user
            probe = _Probe(job_id, attempt, spec, user, leader, None)
            ready = saved.get("ready")
            self._launch(probe, ready=ready if isinstance(ready, bool) else None)
        self.state.save()

    def _launch(self, probe: _Probe, ready: bool | None) -> None:
        probe.tracker = ReadinessTracker(probe.spec.failure_threshold, ready=ready)
        task = self.background.spawn(self._loop(probe), name=f"probe {probe.key}")
        self.tasks[probe.key] = task
        task.add_done_callback(functools.partial(self._ended, probe.key))
        self.log.info(
            "readiness_probe_started",
            job_id=probe.job_id,
            attempt=probe.attempt,
            probe=probe.spec.what,
            period_s=probe.spec.period_s,
            resumed=ready is not None,
        )

    def _ended(self, key: str, task: asyncio.Task) -> None:
        if self.tasks.get(key) is task:
            del self.tasks[key]

    def stop(self, job_id: str, attempt: int, why: str) -> None:
        """Stop probing the attempt (and forget its probe)."""
        key = attempt_key(job_id, attempt)
        task = self.tasks.pop(key, None)
        if task is not None:
            task.cancel()
            self.log.info("readiness_probe_stopped", job_id=job_id, attempt=attempt, why=why)
        if self.state.probes.pop(key, None) is not None:
            self.state.save()

    def stale(self, job_id: str, attempt: int) -> None:
        """The scheduler answered a readiness report `stale`: the attempt is not the job's running one."""
        self.stop(job_id, attempt, "the scheduler answered stale: the attempt is no longer the job's")

    def stop_all(self) -> None:
        """The agent stops: every probe task ends (their saved probes stay until their attempts are released)."""
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()

    def live(self, probe: _Probe) -> bool:
        """Whether the attempt still runs here and is not being killed."""
        if self.stopping() or probe.key in self.state.killed_attempts:
            return False
        ranks = self.attempts.ranks_of(probe.job_id, probe.attempt)
        return bool(ranks) and not any(r.kill_requested for r in ranks)

    # ---------------------------------------------------------------- probing

    async def _loop(self, probe: _Probe) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(probe.spec.initial_delay_s)
        while self.live(probe):
            began = loop.time()
            passed, detail = await self.check(probe)
            if not self.live(probe):
                break
            self._observe(probe, passed, detail)
            await asyncio.sleep(max(0.0, began + probe.spec.period_s - loop.time()))
        why = "the agent stops" if self.stopping() else "the attempt's ranks here ended or are being killed"
        self.log.info("readiness_probe_ended", job_id=probe.job_id, attempt=probe.attempt, why=why)
        if self.state.probes.pop(probe.key, None) is not None:
            self.state.save()

    def _observe(self, probe: _Probe, passed: bool, detail: str) -> None:
        change = probe.tracker.observe(passed)
        if change is None:
            if not passed:
                self.log.debug(
                    "readiness_check_failed", attempt=probe.key, failures=probe.tracker.failures, detail=detail
                )
            return
        saved = self.state.probes.get(probe.key)
        if saved is not None:
            saved["ready"] = change
        self.reports.readiness(probe.job_id, probe.attempt, change, detail)  # saves the state
        self.log.info("readiness_changed", job_id=probe.job_id, attempt=probe.attempt, ready=change, detail=detail)

    async def check(self, probe: _Probe) -> tuple[bool, str]:
        """One check of the probe: (passed, what happened)."""
        spec = probe.spec
        if spec.http_port:
            return await http_check(self.config.address or "127.0.0.1", spec.http_port, spec.http_path, spec.timeout_s)
        group = self.attempts.groups.get(probe.key)
        work = self.attempts.work_dir(probe.job_id, probe.attempt)
        status = self.state_dir / "probes" / f"{safe_name(probe.job_id)}-a{probe.attempt}.status.json"
        status.parent.mkdir(parents=True, exist_ok=True)
        argv = launcher.wrapper_argv(
            status,
            list(spec.command),
            join=group.join_files() if group is not None else (),
            user=probe.user.wrapper_arg if probe.user.uid != os.geteuid() else None,
            cwd=str(work) if work.is_dir() else None,
        )
        try:
            return await command_check(argv, self._env(probe), spec.timeout_s)
        finally:
            status.unlink(missing_ok=True)

    def _env(self, probe: _Probe) -> dict[str, str]:
        """The leader rank's environment: as it was started, else (after an agent restart) as its wrapper has it,
        else the bare environment of a rank (identity.rank_environment) in the attempt's container."""
        if probe.env is None:
            rec = self.state.ranks.get(rank_key(probe.job_id, probe.attempt, probe.leader))
            probe.env = launcher.read_environ(rec.wrapper_pid) if rec is not None and rec.wrapper_pid else None
        if probe.env is not None:
            return probe.env
        group = self.attempts.groups.get(probe.key)
        tmp = str(self.attempts.work_dir(probe.job_id, probe.attempt) / "tmp")
        return identity.rank_environment(
            probe.user, tmp, group.env() if group is not None else {}, self.config.pass_env
        )
