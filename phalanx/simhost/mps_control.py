"""A stand-in for NVIDIA's `nvidia-cuda-mps-control` on simulated hosts (no GPU, no driver).

    nvidia-cuda-mps-control -d                   # start the control daemon in the background
    echo quit | nvidia-cuda-mps-control          # send it commands (stdin), its answers on stdout
    echo get_server_list | nvidia-cuda-mps-control

Run as `python -m phalanx.simhost.mps_control ARGS` or `python .../mps_control.py ARGS` (standard library only); the
node agent of a simulated host runs it through a wrapper script named `nvidia-cuda-mps-control` in its state
directory (services/node_agent/mps.py, `write_fake_control`).

Like the real one (NVIDIA MPS documentation, "Appendix: Tools and Interface Reference",
https://docs.nvidia.com/deploy/mps/appendix-tools-and-interface-reference.html):
- `-d` starts ONE control daemon per pipe directory, CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps): it
  detaches (double fork, new session), writes its pid to `<pipe dir>/nvidia-cuda-mps-control.pid`, listens on
  `<pipe dir>/control` (a Unix socket here) and logs to `<CUDA_MPS_LOG_DIRECTORY>/control.log` (default
  /var/log/nvidia-mps) in the real log's line format. A second `-d` on a pipe directory whose daemon runs fails.
  Unlike the real one, `-d` returns only once the daemon answers (or has failed), with exit status 0 or 1.
- Without `-d` it reads commands from stdin, one a line, hands each to the daemon of CUDA_MPS_PIPE_DIRECTORY and
  prints the answers; with no daemon there it prints "Cannot find MPS control daemon process" on stderr and
  exits 1. Commands: quit, get_server_list, get_server_status PID, start_server -uid UID, get_client_list PID,
  get_device_client_list [PID], set_default_active_thread_percentage N, get_default_active_thread_percentage,
  set_active_thread_percentage PID N, get_active_thread_percentage PID, set_default_device_pinned_mem_limit DEV
  VALUE (VALUE = an integer and M or G), get_default_device_pinned_mem_limit DEV, set_device_pinned_mem_limit PID
  DEV VALUE, get_device_pinned_mem_limit PID DEV, ps. Defaults (active threads, memory limits) are lost on quit.
  No CUDA client ever connects, so there are no servers: server lists are empty and server PIDs unknown.

For tests, every command is RECORDED as one JSON line appended to `<CUDA_MPS_LOG_DIRECTORY>/commands.jsonl`:
    {"time": T, "command": "start" | "quit" | "get_server_list" | ..., "args": [...], "ok": true|false,
     "reply": "...", "error": "...", "daemon_pid": P, "pipe_dir": "...", "visible_devices": "..."}
"start" is a `-d` (ok false when it failed, e.g. "already running"); a command no daemon could take is recorded
by the client with ok false and daemon_pid 0. `visible_devices` is CUDA_VISIBLE_DEVICES of the daemon.

Failure injection: `-d` fails (exit 1, "nvidia-cuda-mps-control: failed to start ...") when
PHALANX_FAKE_MPS_FAIL is `1`/`all`/`true`, or a comma-separated list of GPU UUIDs (or prefixes) one of which is in
CUDA_VISIBLE_DEVICES; or when the file PHALANX_FAKE_MPS_FAIL_FILE names exists (empty: every GPU; else its
lines are such UUIDs). The daemon exits on its own when its socket or pid file is removed (a deleted state dir).
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import sys
import time

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
DEFAULT_LOG_DIR = "/var/log/nvidia-mps"
NO_DAEMON = "Cannot find MPS control daemon process"
_LIMIT = re.compile(r"^\d+[MG]$")


def _dirs() -> tuple[str, str]:
    return (
        os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR,
        os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIR,
    )


def _record(log_dir: str, entry: dict) -> None:
    """Append one JSON line to commands.jsonl (one write: lines from several processes never interleave)."""
    line = json.dumps({"time": round(time.time(), 6), **entry}, sort_keys=True) + "\n"
    try:
        os.makedirs(log_dir, exist_ok=True)
        fd = os.open(os.path.join(log_dir, "commands.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def _log(log_dir: str, message: str) -> None:
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
    try:
        with open(os.path.join(log_dir, "control.log"), "a", encoding="utf-8") as f:
            f.write(f"[{stamp} Control {os.getpid():>6}] {message}\n")
    except OSError:
        pass


def _read_pid(pipe_dir: str) -> int:
    try:
        return int(open(os.path.join(pipe_dir, PID_FILE), encoding="utf-8").read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            raw = f.read()
    except OSError:
        return False
    return raw[raw.rfind(")") + 2 :][:1] not in ("Z", "X")


def _connect(pipe_dir: str, timeout: float = 5.0) -> socket.socket | None:
    """A connection to the daemon of `pipe_dir`, or None. Connects by relative name (cwd = pipe dir): Unix socket
    paths are limited to 107 bytes, and state directories can be deeper than that."""
    try:
        cwd = os.open(".", os.O_RDONLY)
    except OSError:
        cwd = -1
    try:
        os.chdir(pipe_dir)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(SOCKET)
        except OSError:
            s.close()
            return None
        return s
    except OSError:
        return None
    finally:
        if cwd >= 0:
            os.fchdir(cwd)
            os.close(cwd)


def _injected_failure() -> str:
    """Why `-d` must fail (failure injection for tests), or ''."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    wanted: list[str] = []
    flag = os.environ.get("PHALANX_FAKE_MPS_FAIL", "").strip()
    if flag:
        if flag.lower() in ("1", "all", "true", "yes"):
            return "PHALANX_FAKE_MPS_FAIL is set"
        wanted += [w.strip() for w in flag.split(",") if w.strip()]
    path = os.environ.get("PHALANX_FAKE_MPS_FAIL_FILE", "")
    if path and os.path.exists(path):
        try:
            lines = [w.strip() for w in open(path, encoding="utf-8").read().split() if w.strip()]
        except OSError:
            lines = []
        if not lines:
            return f"{path} exists"
        wanted += lines
    for dev in (d.strip() for d in visible.split(",") if d.strip()):
        if any(dev.startswith(w) for w in wanted):
            return f"injected failure for {dev}"
    return ""


# ------------------------------------------------------------------------------------------------ the daemon


class _Daemon:
    def __init__(self, pipe_dir: str, log_dir: str) -> None:
        self.pipe_dir = os.path.abspath(pipe_dir)
        self.log_dir = os.path.abspath(log_dir)
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.default_threads = 100.0
        self.default_limits: dict[str, str] = {}
        self.pid = os.getpid()

    def record(self, command: str, args: list[str], ok: bool, reply: str = "", error: str = "") -> None:
        _record(
            self.log_dir,
            {
                "command": command,
                "args": args,
                "ok": ok,
                "reply": reply,
                "error": error,
                "daemon_pid": self.pid,
                "pipe_dir": self.pipe_dir,
                "visible_devices": self.visible,
            },
        )

    def answer(self, line: str) -> tuple[bool, str, bool]:
        """(ok, reply, quit) for one command line."""
        words = line.split()
        cmd, args = words[0], words[1:]
        try:
            if cmd == "quit":
                return True, "", True
            if cmd in ("get_server_list", "ps"):
                return True, "", False
            if cmd in (
                "get_server_status",
                "get_client_list",
                "set_active_thread_percentage",
                "get_active_thread_percentage",
                "set_device_pinned_mem_limit",
                "get_device_pinned_mem_limit",
            ):
                if not args:
                    return False, f"{cmd}: a server PID is required", False
                return False, f"Server {args[0]} not found", False
            if cmd == "get_device_client_list":
                return True, "", False
            if cmd == "start_server":
                if len(args) != 2 or args[0] != "-uid" or not args[1].isdigit():
                    return False, "usage: start_server -uid <user id>", False
                return True, "", False
            if cmd == "set_default_active_thread_percentage":
                value = float(args[0]) if len(args) == 1 else -1.0
                if not 0 < value <= 100:
                    return False, "Invalid percentage", False
                self.default_threads = value
                return True, f"{value:.1f}", False
            if cmd == "get_default_active_thread_percentage":
                return True, f"{self.default_threads:.1f}", False
            if cmd == "set_default_device_pinned_mem_limit":
                if len(args) != 2 or not _LIMIT.match(args[1]):
                    return False, "usage: set_default_device_pinned_mem_limit <dev> <value> (e.g. 10G, 500M)", False
                self.default_limits[args[0]] = args[1]
                return True, "", False
            if cmd == "get_default_device_pinned_mem_limit":
                if len(args) != 1:
                    return False, "usage: get_default_device_pinned_mem_limit <dev>", False
                return True, self.default_limits.get(args[0], "0M"), False
        except ValueError:
            return False, f"{cmd}: invalid argument", False
        return False, f"Unknown command: {cmd}", False

    def still_mine(self) -> bool:
        return os.path.exists(os.path.join(self.pipe_dir, SOCKET)) and _read_pid(self.pipe_dir) == self.pid

    def serve(self, sock: socket.socket) -> None:
        sock.settimeout(0.5)
        while True:
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                if not self.still_mine():
                    _log(self.log_dir, "Pipe directory gone: exiting")
                    return
                continue
            except OSError:
                return
            if self.session(conn):
                return

    def session(self, conn: socket.socket) -> bool:
        """One client: answer its lines until it closes; True after a quit."""
        _log(self.log_dir, "Accepting connection...")
        _log(self.log_dir, "NEW UI")
        conn.settimeout(10)
        try:
            with conn, conn.makefile("rb") as rf:
                for raw in rf:
                    line = raw.decode(errors="replace").strip()
                    if not line:
                        continue
                    _log(self.log_dir, f"Cmd:{line}")
                    ok, reply, quit_ = self.answer(line)
                    words = line.split()
                    self.record(words[0], words[1:], ok, reply if ok else "", "" if ok else reply)
                    conn.sendall(json.dumps({"ok": ok, "reply": reply}).encode() + b"\n")
                    if quit_:
                        _log(self.log_dir, "Exit")
                        return True
        except OSError:
            pass
        _log(self.log_dir, "UI closed")
        return False


def _start_daemon() -> int:
    pipe_dir, log_dir = _dirs()
    entry = {
        "command": "start",
        "args": ["-d"],
        "daemon_pid": 0,
        "pipe_dir": os.path.abspath(pipe_dir),
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "reply": "",
    }
    try:
        os.makedirs(pipe_dir, exist_ok=True)
        os.makedirs(log_dir, exist_ok=True)
    except OSError as exc:
        print(f"nvidia-cuda-mps-control: cannot create {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    running = _read_pid(pipe_dir)
    if _alive(running) and (probe := _connect(pipe_dir, 2.0)) is not None:
        probe.close()
        _record(log_dir, {**entry, "ok": False, "error": "already running", "daemon_pid": running})
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    why = _injected_failure()
    if why:
        _record(log_dir, {**entry, "ok": False, "error": why})
        _log(log_dir, f"Failed to start control daemon: {why}")
        print(f"nvidia-cuda-mps-control: failed to start the MPS control daemon ({why})", file=sys.stderr)
        return 1
    r, w = os.pipe()
    child = os.fork()
    if child:
        os.close(w)
        deadline = time.monotonic() + 10
        data = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(r, 4096)
            if not chunk:
                break
            data += chunk
        os.close(r)
        os.waitpid(child, 0)
        if data.startswith(b"ok"):
            return 0
        message = data.decode(errors="replace").strip() or "the daemon did not come up"
        print(f"nvidia-cuda-mps-control: {message}", file=sys.stderr)
        return 1
    # First child: a new session, then fork again so the daemon is no session leader and is reparented.
    os.close(r)
    os.setsid()
    if os.fork():
        os._exit(0)
    try:
        daemon = _Daemon(pipe_dir, log_dir)
        os.chdir(daemon.pipe_dir)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        try:
            os.unlink(SOCKET)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(SOCKET)  # relative to the pipe dir (see _connect)
        sock.listen(16)
        tmp = f"{PID_FILE}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"{daemon.pid}\n")
        os.replace(tmp, PID_FILE)
        _log(daemon.log_dir, f"Starting control daemon using socket {daemon.pipe_dir}/{SOCKET}")
        _log(
            daemon.log_dir,
            f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir}",
        )
        _record(daemon.log_dir, {**entry, "ok": True, "error": "", "daemon_pid": daemon.pid})
    except Exception as exc:  # tell the waiting parent, then go
        os.write(w, f"failed to start: {exc!r}".encode())
        os.close(w)
        os._exit(1)
    os.write(w, b"ok\n")
    os.close(w)
    try:
        daemon.serve(sock)
    finally:
        sock.close()
        for name in (SOCKET, PID_FILE):
            try:
                if name != PID_FILE or _read_pid(daemon.pipe_dir) == daemon.pid:
                    os.unlink(name)
            except OSError:
                pass
    os._exit(0)


# ------------------------------------------------------------------------------------------------ the client


def _client(lines: list[str]) -> int:
    pipe_dir, log_dir = _dirs()
    commands = [ln.strip() for ln in lines if ln.strip()]
    pid = _read_pid(pipe_dir)
    conn = _connect(pipe_dir) if _alive(pid) else None
    if conn is None:
        for line in commands:
            words = line.split()
            _record(
                log_dir,
                {
                    "command": words[0],
                    "args": words[1:],
                    "ok": False,
                    "error": "no daemon",
                    "reply": "",
                    "daemon_pid": 0,
                    "pipe_dir": os.path.abspath(pipe_dir),
                    "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                },
            )
        print(NO_DAEMON, file=sys.stderr)
        return 1
    code = 0
    with conn, conn.makefile("rb") as rf:
        for line in commands:
            try:
                conn.sendall(line.encode() + b"\n")
                raw = rf.readline()
            except OSError:
                raw = b""
            if not raw:
                print(NO_DAEMON, file=sys.stderr)
                return 1
            answer = json.loads(raw)
            if answer["reply"]:
                print(answer["reply"], file=sys.stdout if answer["ok"] else sys.stderr, flush=True)
            if not answer["ok"]:
                code = 1
            if line.split()[0] == "quit":
                break
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv == ["-d"]:
        return _start_daemon()
    if argv:
        print(f"nvidia-cuda-mps-control: unsupported option {' '.join(argv)} (this stand-in knows -d)", file=sys.stderr)
        return 2
    return _client(sys.stdin.read().splitlines())


if __name__ == "__main__":
    sys.exit(main())
