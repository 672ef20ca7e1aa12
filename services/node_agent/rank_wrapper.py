"""Runs one rank's command and records its fate in a status file, so even a restarted agent learns exit codes.

    python -m services.node_agent.rank_wrapper --status-file F -- cmd args...

The agent starts this wrapper as a session leader (its own process group) with the rank's environment and log
file; the command inherits both. The status file (JSON, replaced atomically) goes through:
  {"state": "running", "wrapper_pid": P, "child_pid": C}
  {"state": "exited", "exit_code": N, "signal": S}       (N = 128 + S when the command died of signal S)
  {"state": "failed", "error": "..."}                     (the command could not be executed; wrapper exits 127)
Standard library only, imported by nothing else: it starts fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

_terminated: list[int] = []


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _on_signal(signum, _frame) -> None:
    # The whole process group gets the agent's signals, the command included; the wrapper stays to record
    # the command's exit. A signal that arrives before the command exists is passed on once it does.
    _terminated.append(signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "--status-file" or argv[2] != "--":
        print("usage: rank_wrapper --status-file FILE -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    status_file, command = argv[1], argv[3:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    if _terminated:
        _write(status_file, {"state": "exited", "exit_code": 128 + _terminated[0], "signal": _terminated[0]})
        return 128 + _terminated[0]
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        message = f"cannot execute {command[0]!r}: {exc.strerror or exc}"
        print(f"phalanx rank wrapper: {message}", file=sys.stderr, flush=True)
        _write(status_file, {"state": "failed", "error": message, "wrapper_pid": os.getpid()})
        return 127
    _write(status_file, {"state": "running", "wrapper_pid": os.getpid(), "child_pid": child.pid})
    if _terminated:
        child.send_signal(_terminated[0])
    rc = child.wait()
    code, sig = (rc, 0) if rc >= 0 else (128 - rc, -rc)
    _write(status_file, {"state": "exited", "exit_code": code, "signal": sig, "child_pid": child.pid})
    return code


if __name__ == "__main__":
    sys.exit(main())
