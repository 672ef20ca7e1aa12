"""MPS control daemons for fractional GPU shares (`phalanx submit --gpu-milli N`): one per GPU that has shares.

    mps = MpsManager(state_dir / "mps", "nvidia-cuda-mps-control", {0: "GPU-1c2d...", 1: "GPU-9f0e..."})
    env = mps.acquire("job/1/0", gpu=1)   # starts GPU 1's daemon if it has none: the rank's CUDA_* for it
    mps.release("job/1/0")                # the GPU's last share gone: its daemon is told to quit

Follows NVIDIA's Multi-Process Service documentation (https://docs.nvidia.com/deploy/mps/ : "Appendix: Tools and
Interface Reference", https://docs.nvidia.com/deploy/mps/appendix-tools-and-interface-reference.html, and
"Appendix: Environment Variables", https://docs.nvidia.com/deploy/mps/latest/appendix-environment-variables.html):

- Start: `nvidia-cuda-mps-control -d` ("Start daemon in background process") with CUDA_VISIBLE_DEVICES = the GPU's
  UUID, CUDA_MPS_PIPE_DIRECTORY = `<state_dir>/mps/gpu<N>/pipe` and CUDA_MPS_LOG_DIRECTORY = `<state_dir>/mps/
  gpu<N>/log`, so every GPU's daemon has its own pipes, pid file (`nvidia-cuda-mps-control.pid` in the pipe
  directory) and logs (control.log, server.log). The documentation targets one daemon instance through its pipe
  directory, and recommends UUIDs over indices for CUDA_VISIBLE_DEVICES because the MPS server remaps the devices
  it sees (a client keeping CUDA_VISIBLE_DEVICES=3 would fail against a server that shows that GPU as device 0).
  `-d` returns before the daemon may answer, and a CUDA client that finds no daemon silently runs WITHOUT MPS; so
  the start waits until the daemon answers `get_server_list` (a harmless query) before the rank may start.
- Stop: `echo quit | nvidia-cuda-mps-control` with the same CUDA_MPS_PIPE_DIRECTORY, once the GPU's last share
  has ended (SIGTERM, then SIGKILL, to a daemon that does not go).
- Per-client limits, in each rank's (client's) environment: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the share's
  percent of the GPU's threads, rounded up) and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=<MiB>M" (the share of its
  memory). The documentation says these "further constrain" what the control daemon sets, per client; the
  daemon's defaults (`set_default_active_thread_percentage`, `set_default_device_pinned_mem_limit`) instead
  apply to a whole MPS server (all clients of one user on the GPU, "only the next server" once one runs) and are
  lost on quit, so they cannot give shares of different sizes on one GPU their own limits: the agent leaves them
  at their defaults (100%, unlimited). The memory limit names devices as CUDA_VISIBLE_DEVICES does, as the
  client sees them: the client sees exactly its one GPU, so it is device 0.
- The rank also gets CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY of its GPU's daemon ("Set to the same
  location as the MPS control daemon") and CUDA_VISIBLE_DEVICES = the GPU's UUID (see above: valid through the
  remapping, and a client that cannot reach the daemon still sees no other GPU).

What is enforced: the thread share (SM limit) and the memory limit, by the MPS server, for a rank that keeps the
environment it was given; a rank's own code could drop them from its environment before creating its CUDA
context (MPS limits are the client's own).

Identity: the daemon runs as the ranks' user (`acquire(..., user=)`: `nobody`, `--run-as`, or the tenant's
`unix_user`), not as the agent's root: its pipe and log directories are made owned by that user (mode 700, so no
other user's process can reach the daemon through them), `-d` and every later command run as that user, and
`daemon.json` records its uid. MPS runs one server per user on a GPU and queues another user's clients until
that server ends, so a GPU's daemon serves one user at a time: a share of another user while it runs fails
(MpsError, retryable) instead of waiting behind it. Before a rank joins a running daemon, `get_server_list` is sent to the
daemon AS THE RANK'S USER through the rank's pipe directory: a rank that could not reach its daemon (and would
silently run without MPS, unlimited) fails to start with the reason instead (the first share's start already
waits for that answer, as its user). Unix socket paths are limited to 107 bytes: keep state directories short on
real hosts (the real daemon puts its sockets in the pipe directory).

The manager keeps, per GPU, the ranks using its daemon (reference counts) and, in `<gpu dir>/daemon.json`, the
daemon's pid and /proc start time, so a restarted agent recognises the daemons it left: `adopt(key, gpu)` for
each surviving share rank, then `stop_unused()` stops every daemon no live share uses. Thread-safe (the agent
calls it from worker threads); each call blocks on the control program.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .identity import RankUser, argv_as
from .launcher import pid_alive, proc_start_time

CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
MPS_PREFIX = "CUDA_MPS_"


class MpsError(RuntimeError):
    """The GPU's MPS control daemon could not be started (or does not answer): a fault of the host, not the job."""


def strip_mps(env: dict[str, str]) -> dict[str, str]:
    """`env` without CUDA_MPS_* variables (the agent alone sets them, for shares only)."""
    return {k: v for k, v in env.items() if not k.startswith(MPS_PREFIX)}


def _reachable_by_others(path: Path) -> bool:
    """Whether a user other than the owner can execute `path`: it and every directory above it are o+x."""
    try:
        return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])
    except OSError:
        return False


def python_for_others() -> str:
    """A Python a rank's user (nobody, a tenant's Unix user) can run, for the stand-in daemon that runs as that user.

    This Python when others can reach it; otherwise the host's own (`/usr/bin/python3`...). An agent installed
    under a private home (pyenv in /root, mode 0700) would else start a daemon for `nobody` that cannot exec its
    interpreter. The stand-in needs the standard library only (it runs with -I)."""
    if _reachable_by_others(Path(sys.executable).resolve()):
        return sys.executable
    for candidate in ("/usr/local/bin/python3", "/usr/bin/python3", "/bin/python3"):
        if Path(candidate).exists() and _reachable_by_others(Path(candidate).resolve()):
            return candidate
    return sys.executable  # the daemon's start fails, and says so (MpsError): nothing better to run


def write_fake_control(directory: Path) -> str:
    """Write `<directory>/nvidia-cuda-mps-control`, a script that runs phalanx.simhost.mps_control (the simulated
    host's stand-in) with a Python the ranks' user can run (python_for_others); return its path. Found by path,
    never through the user's PATH."""
    from phalanx.simhost import mps_control

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CONTROL
    fail_file = directory / "fake-fail"
    text = (
        "#!/bin/sh\n"
        "# Written by phalanx-agent (simulated host): the stand-in for NVIDIA's nvidia-cuda-mps-control.\n"
        f"# `touch {fail_file}` makes the next `-d` fail (see phalanx/simhost/mps_control.py).\n"
        f"PHALANX_FAKE_MPS_FAIL_FILE=${{PHALANX_FAKE_MPS_FAIL_FILE:-{shlex.quote(str(fail_file))}}}\n"
        "export PHALANX_FAKE_MPS_FAIL_FILE\n"
        f'exec {shlex.quote(python_for_others())} -I {shlex.quote(str(Path(mps_control.__file__).resolve()))} "$@"\n'
    )
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, path)
    return str(path)


class MpsManager:
    def __init__(
        self,
        root: Path,
        control: str,
        gpus: dict[int, str],
        *,
        start_timeout_s: float = 10.0,
        command_timeout_s: float = 10.0,
        log=None,
    ) -> None:
        self.root = Path(root)
        self.control = control
        self.gpus = dict(gpus)  # GPU index -> UUID
        self.start_timeout_s = start_timeout_s
        self.command_timeout_s = command_timeout_s
        self.log = log
        self._meta = threading.Lock()
        self._gpu_locks: dict[int, threading.Lock] = {}
        self._users: dict[int, set[str]] = {}  # GPU -> keys of the ranks using its daemon
        self._gpu_of: dict[str, int] = {}  # rank key -> GPU
        self._owner: dict[int, RankUser | None] = {}  # GPU -> the user its daemon runs as (None: the agent's)

    # ---------------------------------------------------------------- paths and environments

    def gpu_dir(self, gpu: int) -> Path:
        return self.root / f"gpu{gpu}"

    def pipe_dir(self, gpu: int) -> Path:
        return self.gpu_dir(gpu) / "pipe"

    def log_dir(self, gpu: int) -> Path:
        return self.gpu_dir(gpu) / "log"

    def client_env(self, gpu: int) -> dict[str, str]:
        """What a rank on a share of `gpu` gets on top of the share's limits (launcher.fractional_env)."""
        return {
            "CUDA_VISIBLE_DEVICES": self.gpus[gpu],
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir(gpu)),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir(gpu)),
        }

    def _control_env(self, gpu: int) -> dict[str, str]:
        env = {k: v for k, v in strip_mps(dict(os.environ)).items() if k != "CUDA_VISIBLE_DEVICES"}
        return {**env, **self.client_env(gpu)}

    # ---------------------------------------------------------------- introspection

    def users(self, gpu: int) -> set[str]:
        with self._meta:
            return set(self._users.get(gpu, ()))

    def holds(self, key: str) -> bool:
        with self._meta:
            return key in self._gpu_of

    def daemon_pid(self, gpu: int) -> int:
        """The pid of `gpu`'s running control daemon, 0 when none runs."""
        pid = self._read_pid(gpu)
        if not pid:
            return 0
        info = self._read_info(gpu)
        start = int(info.get("start_time", 0)) if int(info.get("pid", 0)) == pid else 0
        return pid if pid_alive(pid, start) else 0

    def _read_pid(self, gpu: int) -> int:
        try:
            return int((self.pipe_dir(gpu) / PID_FILE).read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _read_info(self, gpu: int) -> dict:
        try:
            return json.loads((self.gpu_dir(gpu) / "daemon.json").read_text())
        except (OSError, ValueError):
            return {}

    def _lock(self, gpu: int) -> threading.Lock:
        with self._meta:
            return self._gpu_locks.setdefault(gpu, threading.Lock())

    def _say(self, event: str, **kw) -> None:
        if self.log is not None:
            getattr(self.log, "warning" if kw.pop("warn", False) else "info")(event, **kw)

    # ---------------------------------------------------------------- the lifecycle

    def acquire(self, key: str, gpu: int, user: RankUser | None = None) -> dict[str, str]:
        """Count rank `key` (run as `user`; None: the agent's own user) as a user of `gpu`'s daemon, starting the
        daemon as that user first if none runs; return the rank's MPS environment (client_env). Raises MpsError
        when the daemon cannot be started, serves another user, or does not answer `user` (see the module doc)."""
        if gpu not in self.gpus or not self.gpus[gpu]:
            raise MpsError(f"GPU {gpu} has no UUID on this host")
        user = user if user is not None and user.uid != os.geteuid() else None
        with self._lock(gpu):
            if not self.daemon_pid(gpu):
                self._start(gpu, user)  # it waits until the daemon answers `user` (the same probe as below)
            else:
                owner = self._owner_of(gpu)
                if owner != (user.uid if user else os.geteuid()):
                    raise MpsError(
                        f"GPU {gpu}'s MPS daemon runs as uid {owner} for its current shares; a share of "
                        f"{user.name if user else 'the agent user'} cannot use it until they end"
                    )
                probe = self._run(gpu, [], stdin="get_server_list\n", user=user)
                if probe.returncode != 0:
                    who = user.name if user else "the agent's user"
                    raise MpsError(
                        f"the rank's user ({who}) cannot reach GPU {gpu}'s MPS daemon through {self.pipe_dir(gpu)}: "
                        + ((probe.stderr or probe.stdout).strip() or f"exit status {probe.returncode}")
                    )
            with self._meta:
                self._users.setdefault(gpu, set()).add(key)
                self._gpu_of[key] = gpu
        return self.client_env(gpu)

    def _owner_of(self, gpu: int) -> int:
        """The uid the GPU's running daemon serves (daemon.json; the agent's when unrecorded)."""
        return int(self._read_info(gpu).get("uid", os.geteuid()))

    def _user_for(self, gpu: int) -> RankUser | None:
        """The user to run commands to `gpu`'s daemon as: the one it was started for (a restarted agent: from
        daemon.json's uid)."""
        if gpu in self._owner:
            return self._owner[gpu]
        uid = self._owner_of(gpu)
        if uid == os.geteuid():
            return None
        info = self._read_info(gpu)
        return RankUser(str(uid), uid, int(info.get("gid", uid)), tuple(info.get("groups", ())), "/", "")

    def release(self, key: str) -> bool:
        """Rank `key` has ended; True when that stopped its GPU's daemon (its last share)."""
        with self._meta:
            gpu = self._gpu_of.pop(key, None)
        if gpu is None:
            return False
        with self._lock(gpu):
            with self._meta:
                users = self._users.get(gpu, set())
                users.discard(key)
                if users:
                    return False
            return self._stop(gpu, reason=f"its last share ({key}) ended")

    def adopt(self, key: str, gpu: int) -> int:
        """A restarted agent: count surviving rank `key` as a user of `gpu`'s running daemon (never starting or
        stopping one). Returns the daemon's pid, 0 when it is gone (the next share on the GPU starts a new one)."""
        with self._meta:
            self._users.setdefault(gpu, set()).add(key)
            self._gpu_of[key] = gpu
        pid = self.daemon_pid(gpu)
        if pid:
            self._say("mps_daemon_adopted", gpu=gpu, pid=pid, rank=key)
        else:
            self._say(
                "mps_daemon_missing",
                gpu=gpu,
                rank=key,
                warn=True,
                note="an adopted share rank's MPS control daemon is gone",
            )
        return pid

    def stop_unused(self) -> list[int]:
        """Stop the daemons (found in the state dir) of GPUs no counted rank uses; the GPUs whose daemon stopped."""
        stopped = []
        for d in sorted(self.root.glob("gpu*")):
            try:
                gpu = int(d.name[3:])
            except ValueError:
                continue
            with self._lock(gpu):
                with self._meta:
                    if self._users.get(gpu):
                        continue
                if self.daemon_pid(gpu) and self._stop(gpu, reason="no live share uses it"):
                    stopped.append(gpu)
        return stopped

    # ---------------------------------------------------------------- control program

    def _run(
        self, gpu: int, args: list[str], stdin: str | None = None, user: RankUser | None = None
    ) -> subprocess.CompletedProcess:
        """Run the control program (as `user` when given). `-d`'s output goes to `<log dir>/start.out`, not to
        pipes: a daemon that kept its parent's stdout would hold a pipe open (and this call) for as long as it
        runs."""
        # As `user` through identity.argv_as, not subprocess's user=: see there why (a forked agent can crash).
        # The switch execs a path: a bare name is looked up here, in the agent's PATH, as subprocess would.
        program = self.control if os.sep in self.control else (shutil.which(self.control) or self.control)
        command = argv_as(user, [program, *args])
        try:
            if not os.path.exists(program):
                raise FileNotFoundError(program)
            if args == ["-d"]:
                out_path = self.log_dir(gpu) / "start.out"
                with open(out_path, "w+", encoding="utf-8") as out:
                    rc = subprocess.run(
                        command,
                        env=self._control_env(gpu),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        timeout=self.command_timeout_s,
                        start_new_session=True,
                    ).returncode
                    out.seek(0)
                    return subprocess.CompletedProcess([self.control, "-d"], rc, "", out.read()[-2000:])
            return subprocess.run(
                command,
                input=stdin,
                env=self._control_env(gpu),
                capture_output=True,
                text=True,
                timeout=self.command_timeout_s,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except FileNotFoundError as exc:
            raise MpsError(
                f"the MPS control program {self.control!r} was not found (phalanx-agent --mps-control PATH)"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise MpsError(
                f"{self.control} {' '.join(args) or stdin!r} did not return within {self.command_timeout_s:g}s"
            ) from exc
        except OSError as exc:
            raise MpsError(f"cannot run {self.control}: {exc}") from exc

    def _log_tail(self, gpu: int, lines: int = 3) -> str:
        try:
            text = (self.log_dir(gpu) / "control.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def _start(self, gpu: int, user: RankUser | None = None) -> int:
        pipe, logs = self.pipe_dir(gpu), self.log_dir(gpu)
        try:
            pipe.mkdir(parents=True, exist_ok=True)
            logs.mkdir(parents=True, exist_ok=True)
            if user is not None or os.geteuid() == 0:
                # The root and GPU directories: traversable, not listable, by the daemon's user; pipe and log: its
                # own (a previous user's daemon may have left them), closed to everyone else.
                for d in (self.root, self.gpu_dir(gpu)):
                    d.chmod(0o711)
                uid, gid = (user.uid, user.gid) if user else (os.geteuid(), os.getegid())
                for d in (pipe, logs):
                    for f in d.iterdir():  # left by a daemon of another user: the new one's now
                        os.chown(f, uid, gid, follow_symlinks=False)
                    os.chown(d, uid, gid)
                    d.chmod(0o700)
        except OSError as exc:
            raise MpsError(f"cannot create the MPS directories of GPU {gpu}: {exc}") from exc
        self._owner[gpu] = user
        # No daemon runs here (acquire checked): a pid file left (a crash, a reboot) would name another process.
        (pipe / PID_FILE).unlink(missing_ok=True)
        (self.gpu_dir(gpu) / "daemon.json").unlink(missing_ok=True)
        t0 = time.monotonic()
        r = self._run(gpu, ["-d"], user=user)
        if r.returncode != 0:
            detail = (r.stderr or r.stdout).strip() or f"exit status {r.returncode}"
            tail = self._log_tail(gpu)
            raise MpsError(
                f"{self.control} -d failed for GPU {gpu} ({self.gpus[gpu]}): {detail}"
                + (f"; control.log: {tail}" if tail else "")
            )
        deadline = t0 + self.start_timeout_s
        pid, answered, last = 0, False, ""
        while time.monotonic() < deadline:
            pid = pid or self._read_pid(gpu)
            if pid and not pid_alive(pid):
                last = f"the daemon (pid {pid}) exited"
                break
            if pid:
                probe = self._run(gpu, [], stdin="get_server_list\n", user=user)
                if probe.returncode == 0:
                    answered = True
                    break
                last = (probe.stderr or probe.stdout).strip()
            time.sleep(0.05)
        if not answered:
            if pid and pid_alive(pid):
                _signal(pid, signal.SIGKILL)
            tail = self._log_tail(gpu)
            raise MpsError(
                f"the MPS control daemon of GPU {gpu} did not answer within {self.start_timeout_s:g}s"
                + (f" ({last})" if last else "")
                + (f"; control.log: {tail}" if tail else "")
            )
        info = {
            "pid": pid,
            "start_time": proc_start_time(pid),
            "gpu": gpu,
            "uuid": self.gpus[gpu],
            "pipe_dir": str(pipe),
            "log_dir": str(logs),
            "control": self.control,
            "started_at": time.time(),
            "uid": user.uid if user else os.geteuid(),
            "gid": user.gid if user else os.getegid(),
            "groups": list(user.groups) if user else [],
            "user": user.name if user else "",
        }
        tmp = self.gpu_dir(gpu) / "daemon.json.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, self.gpu_dir(gpu) / "daemon.json")
        self._say(
            "mps_daemon_started",
            gpu=gpu,
            uuid=self.gpus[gpu],
            pid=pid,
            pipe_dir=str(pipe),
            user=user.name if user else "(agent)",
            seconds=round(time.monotonic() - t0, 3),
        )
        return pid

    def _stop(self, gpu: int, reason: str) -> bool:
        pid = self.daemon_pid(gpu)
        if not pid:
            self._say("mps_daemon_already_gone", gpu=gpu, reason=reason)
            (self.gpu_dir(gpu) / "daemon.json").unlink(missing_ok=True)
            return False
        try:
            r = self._run(gpu, [], stdin="quit\n", user=self._user_for(gpu))
            problem = "" if r.returncode == 0 else ((r.stderr or r.stdout).strip() or f"exit {r.returncode}")
        except MpsError as exc:
            problem = str(exc)
        if not _wait_gone(pid, 5.0 if not problem else 0.5):
            self._say("mps_daemon_quit_failed", gpu=gpu, pid=pid, error=problem or "still running", warn=True)
            _signal(pid, signal.SIGTERM)
            if not _wait_gone(pid, 2.0):
                _signal(pid, signal.SIGKILL)
                _wait_gone(pid, 2.0)
        (self.gpu_dir(gpu) / "daemon.json").unlink(missing_ok=True)
        self._owner.pop(gpu, None)
        self._say("mps_daemon_stopped", gpu=gpu, pid=pid, reason=reason)
        return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(pid: int, timeout: float, alive: Callable[[int], bool] = pid_alive) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


__all__ = ["CONTROL", "MpsError", "MpsManager", "strip_mps", "write_fake_control"]
