"""Runs one rank's command and records its fate in a status file, so even a restarted agent learns exit codes.

    python -m services.node_agent.rank_wrapper --status-file F [--join FILE]... [--user UID:GID[:G,...]]
        [--cwd DIR] -- cmd args...

The agent starts this wrapper as a session leader (its own process group) with the rank's environment and log
file; the command inherits both. Before it starts the command, the wrapper enters the attempt's container: it
writes its pid into each `--join` file (the cgroup.procs of the attempt's cgroups, containment.py), so the
command and everything it starts, daemons included, are born inside. The command then runs as `--user` (uid, gid
and supplementary groups; the wrapper itself stays with the agent's identity, so the rank cannot signal it) in
`--cwd`. The status file (JSON, replaced atomically) goes through:
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
    # Atomic (a reader sees the old or the new file) but not fsynced: the file outlives an agent's restart, and a
    # host that loses power loses its ranks too (the agent then reports them LOST); 64 ranks starting at once must
    # not queue on the disk.
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


USAGE = "usage: rank_wrapper --status-file FILE [--join FILE]... [--user UID:GID[:G,...]] [--cwd DIR] -- COMMAND..."


def _parse(argv: list[str]) -> tuple[dict, list[str]]:
    if "--" not in argv:
        raise ValueError("no command (after --)")
    cut = argv.index("--")
    flags, command = argv[:cut], argv[cut + 1 :]
    if not command:
        raise ValueError("no command (after --)")
    options: dict = {"status_file": None, "join": [], "user": None, "cwd": None}
    if len(flags) % 2:
        raise ValueError(f"a flag without its value in {flags}")
    for name, value in zip(flags[::2], flags[1::2]):
        if name == "--status-file":
            options["status_file"] = value
        elif name == "--join":
            options["join"].append(value)
        elif name == "--cwd":
            options["cwd"] = value
        elif name == "--user":
            parts = value.split(":")
            if len(parts) not in (2, 3):
                raise ValueError(f"--user takes UID:GID[:G,...], not {value!r}")
            groups = [int(g) for g in parts[2].split(",") if g] if len(parts) == 3 else []
            options["user"] = (int(parts[0]), int(parts[1]), groups)
        else:
            raise ValueError(f"unknown flag {name}")
    if not options["status_file"]:
        raise ValueError("--status-file is required")
    return options, command


def _on_signal(signum, _frame) -> None:
    # The whole process group gets the agent's signals, the command included; the wrapper stays to record
    # the command's exit. A signal that arrives before the command exists is passed on once it does.
    _terminated.append(signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options, command = _parse(argv)
    except ValueError as exc:
        print(f"rank_wrapper: {exc}", file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    status_file = options["status_file"]
    for handled in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(handled, _on_signal)
    for path in options["join"]:
        try:
            with open(path, "w", encoding="ascii") as f:
                f.write(str(os.getpid()))
        except OSError as exc:
            message = f"cannot enter the attempt's container ({path}): {exc.strerror or exc}"
            print(f"phalanx rank wrapper: {message}", file=sys.stderr, flush=True)
            _write(status_file, {"state": "failed", "error": message, "wrapper_pid": os.getpid()})
            return 127
    if _terminated:
        _write(status_file, {"state": "exited", "exit_code": 128 + _terminated[0], "signal": _terminated[0]})
        return 128 + _terminated[0]
    identity: dict = {}
    if options["user"] is not None:
        uid, gid, groups = options["user"]
        identity = {"user": uid, "group": gid, "extra_groups": groups}
    try:
        child = subprocess.Popen(command, cwd=options["cwd"], **identity)
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
