"""The agent's local state file: the ledger it belongs to (cluster id), acked revision, launched ranks, killed attempts,
unsent reports and the readiness probes it runs.

One directory per node name (default `$PHALANX_HOME/agents/<node-name>/`, PHALANX_HOME being `.phalanx` under
the working directory unless set), so several agents on one host never share a file. Written atomically (temp file,
fsync, rename) before the agent acks an assignment, so a rank is never started twice, even across agent restarts.

Bounded: a finished rank is dropped once the scheduler has taken its last report (and at load, from a state file of
an older agent), and only the latest KILLED_KEPT killed attempts are kept, so the file and the time to write it grow
with the live ranks only. With a writer thread (`start_writer`, the agent's), `save()` only serializes, in the
caller's thread, and the thread writes the newest version; `await durable()` waits for it to be on disk.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_VERSION = 1
KILLED_KEPT = 10_000  # killed attempts remembered (a launch of one is ignored); the oldest are forgotten
FINAL_STATES = frozenset({"exited", "failed", "killed", "lost"})


def default_state_dir(node_name: str) -> Path:
    """$PHALANX_HOME/agents/<node-name>, PHALANX_HOME defaulting to .phalanx under the working directory."""
    return Path(os.environ.get("PHALANX_HOME", ".phalanx")) / "agents" / node_name


def rank_key(job_id: str, attempt: int, rank: int) -> str:
    return f"{job_id}/{attempt}/{rank}"


def attempt_key(job_id: str, attempt: int) -> str:
    return f"{job_id}/{attempt}"


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


@dataclass
class RankRecord:
    job_id: str
    attempt: int
    rank: int
    local_rank: int = 0
    gpus: list[int] = field(default_factory=list)
    replica: int = 0
    # Partial GPUs. MIG: {gpu, profile, start, size} per instance, plus `uuid` and `created` (by this agent) once
    # the instance is there. Fractional: the share of its one GPU in thousandths.
    slices: list[dict] = field(default_factory=list)
    gpu_milli: int = 0
    # Its replica's reserved host resources (LaunchReplica.cpus / memory_bytes; 0: none). The attempt's container
    # here is limited to their sum over the attempt's replicas on this host.
    cpus: float = 0.0
    memory_bytes: int = 0
    state: str = "starting"  # starting | running | exited | failed | killed | lost
    wrapper_pid: int = 0  # process-group leader (the rank wrapper)
    wrapper_start: int = 0  # its /proc start time, to recognise it after an agent restart
    child_pid: int = 0  # the rank command itself
    exit_code: int = 0
    message: str = ""
    retryable: bool = False  # failed: the host kept it from starting (e.g. its MPS daemon), not the job
    kill_requested: bool = False
    status_file: str = ""
    log_file: str = ""

    @property
    def key(self) -> str:
        return rank_key(self.job_id, self.attempt, self.rank)

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


class KilledAttempts:
    """The attempts the scheduler killed on this node, newest last, at most KILLED_KEPT (a set's interface)."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys: dict[str, None] = {}
        for key in keys:
            self.add(key)

    def add(self, key: str) -> None:
        self._keys.pop(key, None)
        self._keys[key] = None
        while len(self._keys) > KILLED_KEPT:
            del self._keys[next(iter(self._keys))]

    def clear(self) -> None:
        self._keys.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass
class AgentState:
    path: Path
    node_name: str = ""
    # The ledger this state belongs to (RegisterNodeResponse.cluster_id); "" unknown: state written before agents
    # kept it, or never registered with a scheduler that sends it. `acked_revision` counts in that ledger's revisions.
    cluster_id: str = ""
    acked_revision: int = 0
    ranks: dict[str, RankRecord] = field(default_factory=dict)
    killed_attempts: KilledAttempts = field(default_factory=KilledAttempts)
    pending_reports: list[dict] = field(default_factory=list)
    # The MIG instances this agent created ({gpu, profile, start, size, gi_id, ci_id, uuid}): the only ones it
    # ever destroys (mig_manager.MigManager keeps it).
    mig_created: list[dict] = field(default_factory=list)
    # Attempt key -> the OOM kills in its container already told in a rank's report ("out of memory (limit ...)"),
    # so that one kill is told once, across agent restarts too. Dropped once the attempt is released.
    oom_seen: dict[str, int] = field(default_factory=dict)
    # Attempt key -> the readiness probe this agent runs for it (readiness.py: its spec, the ranks' user, the leader
    # rank, the last state reported), so that a restarted agent that adopts the ranks probes on. Dropped when
    # probing ends or the attempt is released.
    probes: dict[str, dict] = field(default_factory=dict)
    _writer: _Writer | None = field(default=None, repr=False, compare=False)
    _dirty: bool = field(default=False, repr=False, compare=False)  # a save() not serialized yet (writer mode)

    @classmethod
    def load(cls, path: Path, node_name: str = "") -> AgentState:
        path = Path(path)
        if not path.exists():
            return cls(path=path, node_name=node_name)
        data = json.loads(path.read_text(encoding="utf-8"))
        state = cls(
            path=path,
            node_name=data.get("node_name", node_name),
            cluster_id=str(data.get("cluster_id") or ""),
            acked_revision=int(data.get("acked_revision", 0)),
            ranks={k: RankRecord(**v) for k, v in data.get("ranks", {}).items()},
            killed_attempts=KilledAttempts(data.get("killed_attempts", [])),
            pending_reports=list(data.get("pending_reports", [])),
            mig_created=list(data.get("mig_created", [])),
            oom_seen={str(k): int(v) for k, v in (data.get("oom_seen") or {}).items()},
            probes={str(k): dict(v) for k, v in (data.get("probes") or {}).items()},
        )
        unsent = {rank_key(r["job_id"], r["attempt"], r["rank"]) for r in state.pending_reports if "rank" in r}
        for key in [k for k, r in state.ranks.items() if r.final and k not in unsent]:
            del state.ranks[key]  # history an older agent kept: the scheduler has these ranks' ends
        return state

    def forget(self, key: str) -> None:
        """Drop a finished rank whose last report the scheduler took (nothing is left to tell it)."""
        rec = self.ranks.get(key)
        if rec is not None and rec.final:
            del self.ranks[key]

    def to_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "node_name": self.node_name,
            "cluster_id": self.cluster_id,
            "acked_revision": self.acked_revision,
            "ranks": {k: asdict(v) for k, v in self.ranks.items()},
            "killed_attempts": list(self.killed_attempts),
            "pending_reports": self.pending_reports,
            "mig_created": self.mig_created,
            "oom_seen": self.oom_seen,
            "probes": self.probes,
        }

    def save(self) -> None:
        """Write the state. With the writer thread in an event loop, the saves of one loop iteration are one
        serialization, at its end (a 64-rank launch saves hundreds of times); `durable()` forces it."""
        if self._writer is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                if not self._dirty:
                    self._dirty = True
                    loop.call_soon(self._serialize)
                return
            self._writer.put(self._bytes())
        else:
            _write_file(self.path, self._bytes())

    def _bytes(self) -> bytes:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True).encode()

    def _serialize(self) -> None:
        if self._dirty and self._writer is not None:
            self._dirty = False
            self._writer.put(self._bytes())

    def start_writer(self) -> None:
        """From now on save() hands the bytes to a writer thread (the agent's event loop never waits on a disk)."""
        if self._writer is None:
            self._writer = _Writer(self.path)

    async def durable(self) -> None:
        """Wait until what the last save() recorded is on disk (before an ack)."""
        self._serialize()
        if self._writer is not None:
            await self._writer.flushed()

    def stop_writer(self) -> None:
        """Write what is queued and go back to synchronous saves."""
        self._serialize()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


class _Writer:
    """One thread writing the newest serialized state (versions queued meanwhile are skipped: the newest holds
    them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cond = threading.Condition()
        self._data: bytes | None = None
        self._queued = 0  # version of the newest put()
        self._written = 0  # version on disk
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="agent-state-writer", daemon=True)
        self._thread.start()

    def put(self, data: bytes) -> None:
        with self._cond:
            self._data = data
            self._queued += 1
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._data is None and not self._closed:
                    self._cond.wait()
                if self._data is None:
                    return
                data, version, self._data = self._data, self._queued, None
            try:
                _write_file(self.path, data)
                error = None
            except OSError as exc:
                error = exc
            with self._cond:
                self._written, self._error = version, error
                self._cond.notify_all()

    async def flushed(self) -> None:
        with self._cond:
            target = self._queued
        if self._written < target:
            await asyncio.to_thread(self._wait, target)
        if self._error is not None:
            raise self._error

    def _wait(self, target: int) -> None:
        with self._cond:
            while self._written < target and self._thread.is_alive():
                self._cond.wait(1.0)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(30)


class StateDirLocked(RuntimeError):
    pass


class StateLock:
    """An exclusive flock on <state_dir>/agent.lock: one agent per node name and state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / "agent.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise StateDirLocked(f"another node agent is running with state dir {self.path.parent}") from exc
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
