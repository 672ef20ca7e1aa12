"""The processes of a local cluster (phalanx.cli.local_cluster): one child's command line, log and process, how it
is started (in a session of its own, with a parent-death signal) and stopped (SIGTERM, then SIGKILL), and the free
ports the services take.

Private to phalanx.cli; it imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Sets PR_SET_PDEATHSIG, checks the parent is still the one that forked us, then execs the real command.
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class ClusterError(RuntimeError):
    """The local cluster could not start (a child died, a port is taken, nodes did not become READY)."""


@dataclass
class ManagedProcess:
    """One child of the cluster: its role, command line, log file and current process."""

    name: str  # "scheduler", "checkpointd" or a node name
    kind: str  # "scheduler" | "checkpointd" | "agent"
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exit_code: int | None = None  # of the last process, once it has exited and been noticed
    restart_at: float | None = None
    history: list[int] = field(default_factory=list)  # pids of every process started for this child
    env: dict[str, str] = field(default_factory=dict)  # this child's own environment (its credentials)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def spawn(child: ManagedProcess, env: dict[str, str]) -> None:
    """Start `child` with environment `env`, appending its output to its log; on Linux through a small Python
    program that sets PR_SET_PDEATHSIG, so that it gets SIGTERM when the thread that started it dies."""
    child.log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = child.argv
    if sys.platform.startswith("linux"):
        argv = [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *argv]
        if not os.path.isabs(argv[4]):
            argv[4] = shutil.which(argv[4]) or argv[4]
    with open(child.log_path, "ab") as out:
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(child.argv)}\n".encode())
        out.flush()
        child.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    child.exit_code = None
    child.history.append(child.proc.pid)


def terminate(group: Sequence[ManagedProcess], stop_timeout: float, log: Callable[[str], None]) -> None:
    """SIGTERM every live child of `group`, wait up to `stop_timeout` seconds for them all, SIGKILL the rest."""
    live = [p for p in group if p.alive()]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    deadline = time.monotonic() + stop_timeout
    for p in live:
        try:
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            log(f"{p.name} (pid {p.pid}) did not stop within {stop_timeout:g}s; killing it")
            with contextlib.suppress(ProcessLookupError):
                p.proc.kill()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=5)  # type: ignore[union-attr]
    for p in group:  # reap anything that had already exited
        if p.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=0.1)


def port_free(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P such that P and P+1 are both free right now (the scheduler's and the coordinator's), taken below the
    kernel's ephemeral range: there, no other process's port-0 bind (an agent's log server, a test's server) is
    handed P or P+1 before the scheduler and the coordinator bind them, as the next ephemeral port after a
    port-0 probe often would be."""
    low = _ephemeral_low()
    for _ in range(400):
        # 10000-19998: below the ephemeral range and below the agents' default --rank-port-range (20000-31999)
        port = random.randrange(10_000, min(19_999, low - 1))
        if port_free(host, port) and port_free(host, port + 1):
            return port
    raise ClusterError("could not find two consecutive free ports")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def tail_of(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log file ("" when it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def program(script: str, module: str) -> list[str]:
    """The console script next to this interpreter when installed, else ``python -m module``."""
    candidate = Path(sys.executable).parent / script
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return [str(candidate)]
    return [sys.executable, "-m", module]
