"""Starting, finding and signalling rank processes.

Each rank runs as `python rank_wrapper.py --status-file F [--join ...] [--user ...] [--cwd ...] -- command...` in
its own session (process group = the wrapper's pid), inside its attempt's container, with the environment the
agent built for it (identity.py) and stdout/stderr appended to a per-rank log file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from . import rank_wrapper
from .state import RankRecord, safe_name

WRAPPER = str(Path(rank_wrapper.__file__).resolve())


def rank_paths(state_dir: Path, job_id: str, attempt: int, rank: int) -> tuple[Path, Path]:
    stem = f"{safe_name(job_id)}-a{attempt}-r{rank}"
    return state_dir / "ranks" / f"{stem}.status.json", state_dir / "logs" / f"{stem}.log"


def spawn_rank(
    record: RankRecord,
    command: list[str],
    env: dict[str, str],
    *,
    join: Sequence[str] = (),
    user: str | None = None,
    cwd: str | None = None,
) -> subprocess.Popen:
    """Start the rank wrapper for `record` (status_file and log_file already set). Raises OSError on failure.

    `env` is the rank's whole environment (identity.rank_environment): nothing of the agent's is added. The
    wrapper enters the container through the `join` files before it starts the command, as `user` (the wrapper's
    --user, UID:GID[:G,...]) in `cwd`."""
    status = Path(record.status_file)
    log = Path(record.log_file)
    status.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    status.unlink(missing_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            wrapper_argv(status, command, join=join, user=user, cwd=cwd),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


def wrapper_argv(
    status_file: str | Path,
    command: list[str],
    *,
    join: Sequence[str] = (),
    user: str | None = None,
    cwd: str | None = None,
) -> list[str]:
    """The rank wrapper's command line: `command` in the container of the `join` files, as `user`, in `cwd` (a
    rank's, and a readiness probe command's, readiness.py)."""
    flags = ["--status-file", str(status_file)]
    for path in join:
        flags += ["--join", path]
    if user:
        flags += ["--user", user]
    if cwd:
        flags += ["--cwd", cwd]
    return [sys.executable, "-I", "-S", WRAPPER, *flags, "--", *command]  # -S: the wrapper needs no site


def read_environ(pid: int) -> dict[str, str] | None:
    """A live process's environment from /proc/<pid>/environ (a process of the agent's own user, or any as root);
    None when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def mig_env(env: dict[str, str], mig_uuids: list[str]) -> dict[str, str]:
    """The environment of a rank on MIG instances: CUDA_VISIBLE_DEVICES lists their MIG device UUIDs."""
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(mig_uuids)}


def fractional_env(env: dict[str, str], gpu: int, gpu_milli: int, memory_mib: int) -> dict[str, str]:
    """The environment of a rank on `gpu_milli` thousandths of GPU `gpu` (of `memory_mib` MiB): CUDA_VISIBLE_DEVICES
    stays that GPU; the MPS client limits take the share of its threads (percent, rounded up, at least 1) and of
    its memory (rounded down), the memory limit naming the GPU as the process sees it (device 0). The agent adds
    its GPU's MPS daemon (mps.MpsManager.client_env: pipe and log directories, CUDA_VISIBLE_DEVICES = the UUID)."""
    if not 1 <= gpu_milli <= 999:
        raise ValueError(f"gpu_milli must be 1-999, not {gpu_milli}")
    return {
        **env,
        "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES") or str(gpu),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, -(-gpu_milli // 10))),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={memory_mib * gpu_milli // 1000}M",
        "PHALANX_GPU_MILLI": str(gpu_milli),
    }


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live pid from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def proc_start_time(pid: int) -> int:
    st = proc_stat(pid)
    return st[1] if st else 0


def pid_alive(pid: int, start_time: int = 0) -> bool:
    """The same process (pid and start time) still exists and is not a zombie."""
    if pid <= 0:
        return False
    st = proc_stat(pid)
    if st is None:
        return False
    state, started = st
    if state in ("Z", "X"):
        try:  # reap it if it happens to be our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return False
    return not start_time or started == start_time


def read_status(path: str | Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def signal_group(pgid: int, sig: int) -> bool:
    """Signal the rank's whole process group; False when it is gone."""
    if pgid <= 0:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def exit_code_from_returncode(rc: int) -> int:
    """Popen returncode -> shell-style exit code (a death by signal S is 128 + S)."""
    return rc if rc >= 0 else 128 - rc


__all__ = [
    "exit_code_from_returncode",
    "fractional_env",
    "mig_env",
    "pid_alive",
    "proc_start_time",
    "rank_paths",
    "read_environ",
    "read_status",
    "signal_group",
    "spawn_rank",
    "wrapper_argv",
]
