"""The agent's local state file: the ledger it belongs to (cluster id), acked revision, launched ranks, killed attempts
and unsent reports.

One directory per node name (default `$PHALANX_HOME/agents/<node-name>/`, PHALANX_HOME being `.phalanx` under
the working directory unless set), so several agents on one host never share a file. Written atomically (temp file,
fsync, rename) before the agent acks an assignment, so a rank is never started twice, even across agent restarts.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_VERSION = 1
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


@dataclass
class AgentState:
    path: Path
    node_name: str = ""
    # The ledger this state belongs to (RegisterNodeResponse.cluster_id); "" unknown: state written before agents
    # kept it, or never registered with a scheduler that sends it. `acked_revision` counts in that ledger's revisions.
    cluster_id: str = ""
    acked_revision: int = 0
    ranks: dict[str, RankRecord] = field(default_factory=dict)
    killed_attempts: set[str] = field(default_factory=set)
    pending_reports: list[dict] = field(default_factory=list)
    # The MIG instances this agent created ({gpu, profile, start, size, gi_id, ci_id, uuid}): the only ones it
    # ever destroys (mig_manager.MigManager keeps it).
    mig_created: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path, node_name: str = "") -> AgentState:
        path = Path(path)
        if not path.exists():
            return cls(path=path, node_name=node_name)
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(
            path=path,
            node_name=data.get("node_name", node_name),
            cluster_id=str(data.get("cluster_id") or ""),
            acked_revision=int(data.get("acked_revision", 0)),
            ranks={k: RankRecord(**v) for k, v in data.get("ranks", {}).items()},
            killed_attempts=set(data.get("killed_attempts", [])),
            pending_reports=list(data.get("pending_reports", [])),
            mig_created=list(data.get("mig_created", [])),
        )

    def to_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "node_name": self.node_name,
            "cluster_id": self.cluster_id,
            "acked_revision": self.acked_revision,
            "ranks": {k: asdict(v) for k, v in self.ranks.items()},
            "killed_attempts": sorted(self.killed_attempts),
            "pending_reports": self.pending_reports,
            "mig_created": self.mig_created,
        }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        try:
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass


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
