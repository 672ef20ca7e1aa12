"""Who a rank runs as, and the environment it gets: built from scratch, never inherited from the agent.

A rank's environment holds only:
- PATH, LANG, LC_* and TZ as the agent has them (the operator sets them in the agent's unit);
- HOME, USER, LOGNAME and SHELL of the rank's user (from the password database);
- TMPDIR, the attempt's own temporary directory;
- the variables the operator lists with `phalanx-agent --pass-env NAME`;
- the launch's variables: the job's `--env` and the rank variables (RANK, WORLD_SIZE, MASTER_ADDR, ...);
- the container marker (containment.MARKER_ENV).
Nothing else: the agent's token, its TLS paths and whatever else it happened to have stay with the agent.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

INHERITED = ("PATH", "LANG", "TZ")  # and every LC_*
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class RankUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str

    @property
    def wrapper_arg(self) -> str:
        """The rank wrapper's --user value."""
        return f"{self.uid}:{self.gid}:{','.join(str(g) for g in self.groups)}"


# Switches identity, then execs: run by the agent's own Python (-I -S: nothing from the environment, no site).
_SWITCH = (
    "import os, sys\n"
    "uid, gid, groups = sys.argv[1].split(':')\n"
    "os.setgroups([int(g) for g in groups.split(',') if g])\n"
    "os.setgid(int(gid))\n"
    "os.setuid(int(uid))\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def argv_as(user: RankUser | None, argv: list[str]) -> list[str]:
    """`argv` run as `user` (unchanged when None or the agent's own uid): the switch happens in a fresh process.

    Why not subprocess's `user=`/`group=`/`extra_groups=`: with them CPython cannot use vfork and forks the whole
    agent. The fork handlers of the libraries loaded there run in that child (gRPC's restart threads in it), and
    the child's setgroups/setuid is broadcast by glibc to every thread: the child was seen to die of SIGSEGV before
    its exec. The rank wrapper may use them: it is a small single-threaded process."""
    if user is None or (user.uid == os.geteuid() and user.gid == os.getegid()):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _SWITCH, user.wrapper_arg, *argv]


def resolve_user(name: str) -> RankUser:
    """A user by name (or numeric uid) from the password database; ValueError when there is none."""
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, ValueError):
        raise ValueError(f"no user {name!r} on this host (see /etc/passwd)") from None
    return RankUser(
        name=entry.pw_name,
        uid=entry.pw_uid,
        gid=entry.pw_gid,
        groups=tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid)))),
        home=entry.pw_dir,
        shell=entry.pw_shell,
    )


def agent_user() -> RankUser:
    """The agent's own identity (ranks of an agent that cannot switch users run as it)."""
    return resolve_user(str(os.geteuid()))


def rank_environment(
    user: RankUser,
    tmpdir: str,
    launch_env: Mapping[str, str],
    pass_env: Iterable[str] = (),
    agent_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of a rank (see the module docstring); the launch's variables win."""
    source = os.environ if agent_env is None else agent_env
    env = {k: v for k, v in source.items() if k in INHERITED or k.startswith("LC_")}
    env.setdefault("PATH", DEFAULT_PATH)
    env.update(HOME=user.home, USER=user.name, LOGNAME=user.name, SHELL=user.shell or "/bin/sh", TMPDIR=tmpdir)
    for name in pass_env:
        if name in source:
            env[name] = source[name]
    env.update(launch_env)
    return env


def private_file_problem(path: str | Path, what: str) -> str | None:
    """Why a secret file may not be used: missing, or readable by its group or others (as ssh refuses a key);
    None when it is fine."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"cannot read {what} {path}: {exc.strerror or exc}"
    if mode & (stat.S_IRGRP | stat.S_IROTH | stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{what} {path} is accessible by other users (mode {stat.S_IMODE(mode):04o}); "
            f"it must be readable by the agent alone: chmod 600 {path}"
        )
    return None


def make_owned_dir(path: Path, user: RankUser, mode: int = 0o700) -> Path:
    """Create `path` (parents as the agent) owned by `user`, with `mode`."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, user.uid, user.gid)
    os.chmod(path, mode)
    return path
