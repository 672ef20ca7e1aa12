"""Slurm as a peer of bench/peers.py (issue 35, item 4): a throwaway Slurm cluster on this one host, and its figures.

`SlurmCluster(nodes, gpus_per_node)` writes a slurm.conf and a gres.conf into a temporary directory, starts a munged
with a key of its own (or, without munged, runs with AuthType=auth/none), one slurmctld and one slurmd per node, all
as child processes in the foreground, waits until `sinfo` shows every node idle, and on exit cancels what is left,
stops every daemon it started and removes the directory. It needs root (slurmd runs jobs as their user) and the
tools of Debian's slurm-wlm (22.05).

Several slurmd on one host: Debian's 22.05 slurmd accepts it (the multiple-slurmd form): each daemon is
`slurmd -D -N <node>`, each node on a port of its own (`NodeName=nK NodeHostname=localhost NodeAddr=127.0.0.1
Port=<free port>`, one line per node), its spool, pid and log files named with %n. No network namespaces needed.
The GPUs are fake: gres.conf names empty files (`File=<dir>/dev/nvidia[0-7]`), and
`SlurmdParameters=config_overrides` lets each slurmd claim CPUs and memory the host does not have (2 x the GPUs in
CPUs, so a node holds one 1-CPU job per GPU). Scheduling: sched/backfill, select/cons_tres with CR_Core, Slurm's
default SchedulerParameters unless given; no accounting, proctrack/linuxproc, task/none.

What is timed (each figure on an otherwise idle cluster, the next sample once every node is idle again):
- `allocation_latency`: from launching `salloc -N<n> --gres=gpu:<g> --immediate=30 /bin/true` to salloc printing
  "Granted job allocation" on its stderr (read as it is written). Slurm's client is its command line, so this
  includes starting salloc (reading slurm.conf, loading its plugins, a munge credential) as a user's submit does;
  Phalanx's and Ray's clients are already connected. Also returned: the time until salloc exits, having run
  /bin/true on this host and given the allocation back.
- `sbatch_throughput`: jobs of a mix (GPU counts with their (nodes, GPUs per node)) submitted with
  `sbatch --parsable ... --wrap "exec sleep 600"` by `clients` threads, each running one sbatch after another off a
  shared queue. A job is allocated at the time slurmctld's log gives for it ("sched: Allocate JobId=..." or
  "backfill: Started JobId=...", millisecond timestamps, the same clock as time.time()); the rate is jobs from the
  first submit to the last allocation (found by polling squeue until none of them is pending; a job the log does
  not name counts at the poll that first saw it allocated). Slurm 22.05 does not try batch jobs at submit: its
  controller's background pass picks them up, at most once a second and, by default, not within
  batch_sched_delay (3 s) of its previous batch pass; that, not the submits, bounds the rate of a small burst (here
  17 jobs in about 0.5 to 1 s with batch_sched_delay=0, about 2.7 s with the default). Also returned: the sbatch
  acceptance rate (first submit to the last sbatch's return).
- `salloc_throughput`: the same mix with `salloc --no-shell` (an allocation request, which Slurm decides at
  submit): jobs from the first submit to the last salloc's return (each returns once its job is granted).
Every job is cancelled and the nodes idle again between rounds.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

CLIENT_TOOLS = ("salloc", "sbatch", "squeue", "sinfo", "scancel")
DAEMONS = ("slurmctld", "slurmd")
GRANTED = re.compile(r"Granted job allocation (\d+)")
# slurmctld's log: "[2026-12-07T14:33:27.222] sched: Allocate JobId=3 NodeList=n1 #CPUs=1 Partition=main", and
# the same for an salloc ("sched: _slurm_rpc_allocate_resources JobId=1 NodeList=n1 usec=479") or a backfilled job.
ALLOCATED = re.compile(
    r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)\] "
    r"(?:sched: Allocate JobId=|sched: _slurm_rpc_allocate_resources JobId=|backfill: Started JobId=)(\d+)\b"
)
ALLOCATED_STATES = frozenset({"R", "CF"})  # squeue %t: running, configuring (the nodes are allocated either way)


class SlurmError(RuntimeError):
    """Slurm could not be started or did not do what was asked; the message is the concrete reason."""


def missing_tools() -> list[str]:
    """The Slurm tools this bench runs that are not on PATH (empty when all are)."""
    return [tool for tool in (*CLIENT_TOOLS, *DAEMONS) if shutil.which(tool) is None]


def node_names(nodes: int) -> list[str]:
    return [f"n{i}" for i in range(1, nodes + 1)]


def slurm_conf(
    workdir: Path,
    nodes: int,
    gpus_per_node: int,
    ctld_port: int,
    node_ports: list[int],
    munge_socket: Path | None,
    scheduler_parameters: str = "",
    user: str = "root",
) -> str:
    """slurm.conf for one slurmctld and `nodes` slurmd daemons on this host, each slurmd on its own port
    (`scheduler_parameters`: a SchedulerParameters= value; Slurm's defaults when empty)."""
    assert len(node_ports) == nodes
    auth = (
        ["AuthType=auth/munge", f"AuthInfo=socket={munge_socket}", "CredType=cred/munge"]
        if munge_socket
        else ["AuthType=auth/none", "CredType=cred/none"]
    )
    cpus = 2 * gpus_per_node
    lines = [
        "ClusterName=phalanxpeers",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        f"SlurmUser={user}",
        "SlurmdUser=root",
        *auth,
        f"StateSaveLocation={workdir / 'state'}",
        f"SlurmdSpoolDir={workdir / 'spool' / '%n'}",
        f"SlurmctldPidFile={workdir / 'slurmctld.pid'}",
        f"SlurmdPidFile={workdir / 'slurmd.%n.pid'}",
        f"SlurmctldLogFile={workdir / 'slurmctld.log'}",
        f"SlurmdLogFile={workdir / 'slurmd.%n.log'}",
        "MailProg=/bin/true",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/backfill",
        *([f"SchedulerParameters={scheduler_parameters}"] if scheduler_parameters else []),
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",  # the fake CPUs, memory and GPUs this host does not have
        "ReturnToService=2",
        "KillWait=2",
        "GresTypes=gpu",
    ]
    for name, port in zip(node_names(nodes), node_ports, strict=True):
        lines.append(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
            f"RealMemory=1000 Gres=gpu:{gpus_per_node} State=UNKNOWN"
        )
    lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def gres_conf(devdir: Path, nodes: int, gpus_per_node: int) -> str:
    """gres.conf: every node's GPUs are the same fake device files, devdir/nvidia0 ... nvidia<gpus_per_node - 1>."""
    return f"NodeName=n[1-{nodes}] Name=gpu File={devdir}/nvidia[0-{gpus_per_node - 1}]\n"


def parse_sinfo(text: str) -> dict[str, str]:
    """`sinfo -h -N -o "%N %t"` -> {node: compact state} ("idle", "mix", "alloc", "comp", "idle*", "drain", ...)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out[parts[0]] = parts[1]
    return out


def parse_squeue(text: str) -> dict[int, str]:
    """`squeue -h -o "%i %t"` -> {job id: compact state} ("PD", "R", "CF", "CG", ...)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].isdigit():
            out[int(parts[0])] = parts[1]
    return out


def parse_job_id(sbatch_out: str) -> int:
    """`sbatch --parsable` prints "<id>" or "<id>;<cluster>"."""
    first = sbatch_out.strip().splitlines()[0] if sbatch_out.strip() else ""
    job = first.split(";")[0]
    if not job.isdigit():
        raise SlurmError(f"sbatch printed no job id: {sbatch_out.strip()!r}")
    return int(job)


def parse_allocations(log_text: str) -> dict[int, float]:
    """slurmctld's log -> {job id: when it was allocated, seconds since the epoch} (its timestamps are local time,
    as datetime.timestamp() reads a naive one; the first allocation line of a job wins)."""
    out: dict[int, float] = {}
    for line in log_text.splitlines():
        m = ALLOCATED.match(line)
        if m:
            out.setdefault(int(m.group(2)), datetime.datetime.fromisoformat(m.group(1)).timestamp())
    return out


def free_ports(n: int) -> list[int]:
    """n ports free on the loopback now (held together while they are picked, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def log_tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no {path.name})"
    return " | ".join(text[-lines:])


class SlurmCluster:
    """A Slurm cluster of `nodes` slurmd daemons x `gpus_per_node` fake GPUs on this host (see the module's doc)."""

    def __init__(
        self,
        nodes: int,
        gpus_per_node: int,
        auth: str | None = None,
        scheduler_parameters: str = "",
        start_timeout: float = 60.0,
    ) -> None:
        self.nodes = nodes
        self.scheduler_parameters = scheduler_parameters
        self.gpus_per_node = gpus_per_node
        self.auth = auth or ("munge" if shutil.which("munged") else "none")
        self.start_timeout = start_timeout
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.dir: Path | None = None
        self.version = ""

    # --- start and stop -------------------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        if os.geteuid() != 0:
            raise SlurmError("slurmd must run as root (it starts jobs as their user)")
        if missing := missing_tools():
            raise SlurmError(f"{', '.join(missing)} not on PATH (Debian: apt-get install slurm-wlm)")
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        t0 = time.perf_counter()
        self.dir = Path(tempfile.mkdtemp(prefix="phalanx-slurm-"))
        self.dir.chmod(0o755)  # munged wants its socket's directories searchable by all
        for sub in ("state", "spool", "dev", "munge"):
            (self.dir / sub).mkdir()
        for i in range(self.gpus_per_node):
            (self.dir / "dev" / f"nvidia{i}").touch()
        self.conf = self.dir / "slurm.conf"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"SLURM_CONF": str(self.conf)}
        munge_socket = None
        if self.auth == "munge":
            munge_socket = self._start_munged()
        ctld_port, *node_ports = free_ports(self.nodes + 1)
        self.conf.write_text(
            slurm_conf(
                self.dir, self.nodes, self.gpus_per_node, ctld_port, node_ports, munge_socket, self.scheduler_parameters
            )
        )
        (self.dir / "gres.conf").write_text(gres_conf(self.dir / "dev", self.nodes, self.gpus_per_node))
        self.version = self.client("sinfo", "--version").strip()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.client("sinfo", "-h", check=False) is not None, "slurmctld to answer sinfo")
        for name in node_names(self.nodes):
            self._spawn(f"slurmd -N {name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self._wait(self._registered, f"{self.nodes} nodes idle in sinfo", show=self.node_states)
        self.started_s = time.perf_counter() - t0

    def _start_munged(self) -> Path:
        mdir = self.dir / "munge"
        mdir.chmod(0o711)
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = mdir / "munge.socket"
        self._spawn(
            "munged",
            [
                "munged", "-F", "-f", f"--key-file={key}", f"--socket={sock}", f"--pid-file={mdir / 'munged.pid'}",
                f"--log-file={mdir / 'munged.log'}", f"--seed-file={mdir / 'munged.seed'}",
            ],
        )  # fmt: skip
        self._wait(sock.exists, "munged's socket")
        return sock

    def _spawn(self, what: str, argv: list[str]) -> None:
        with open(self.dir / f"{argv[0]}.{len(self.procs)}.out", "wb") as out:  # the child keeps its own copy
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append((what, proc))

    def _wait(self, ready: Callable[[], bool], what: str, show: Callable[[], object] | None = None) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited with {proc.returncode} while waiting for {what}: {self._logs()}")
            if ready():
                return
            time.sleep(0.05)
        seen = f"; sinfo: {show()!r}" if show else ""
        raise SlurmError(f"no {what} after {self.start_timeout:.0f} s{seen}: {self._logs()}")

    def _logs(self) -> str:
        files = [self.dir / "slurmctld.log", *(self.dir / f"slurmd.{n}.log" for n in node_names(self.nodes))]
        files += sorted(self.dir.glob("*.out"))
        return " || ".join(f"{f.name}: {log_tail(f, 3)}" for f in files if f.exists())

    def __exit__(self, *exc) -> None:
        try:
            if any(name == "slurmctld" for name, _ in self.procs) and all(p.poll() is None for _, p in self.procs):
                self.client("scancel", "--user", str(os.geteuid()), check=False)
                self._until(lambda: not self.jobs(), 15.0)
        except (SlurmError, OSError, subprocess.SubprocessError):
            pass  # stopping anyway
        for _, proc in reversed(self.procs):  # the slurmd daemons, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # --- the clients ----------------------------------------------------------------------------------------------

    def client(self, *argv: str, check: bool = True, timeout: float = 60.0) -> str | None:
        """Run a Slurm command against this cluster; its stdout (None when it fails and check is False)."""
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if proc.returncode != 0:
            if check:
                raise SlurmError(f"{' '.join(argv)} exited with {proc.returncode}: {proc.stderr.strip()[-500:]}")
            return None
        return proc.stdout

    def node_states(self) -> dict[str, str]:
        return parse_sinfo(self.client("sinfo", "-h", "-N", "-o", "%N %t", check=False) or "")

    def jobs(self) -> dict[int, str]:
        return parse_squeue(self.client("squeue", "-h", "-o", "%i %t") or "")

    def _registered(self) -> bool:
        """Every node idle; a SlurmError at once when slurmctld refused a node (invalid, drained: no use waiting)."""
        states = self.node_states()
        if refused := {node: s for node, s in states.items() if s.startswith(("inval", "drain"))}:
            reasons = self.client("sinfo", "-h", "-R", "-o", "%N: %E", check=False) or ""
            raise SlurmError(f"slurmctld refused nodes {refused}: {reasons.strip()} ({self._logs()})")
        return len(states) == self.nodes and all(s == "idle" for s in states.values())

    def idle(self) -> bool:
        states = self.node_states()
        return len(states) == self.nodes and all(s == "idle" for s in states.values())

    def _until(self, cond: Callable[[], bool], timeout: float, what: str = "") -> float:
        """Poll `cond` until true; the perf_counter time of the poll that saw it."""
        deadline = time.monotonic() + timeout
        while True:
            if cond():
                return time.perf_counter()
            if time.monotonic() > deadline:
                raise SlurmError(f"slurm: {what or 'condition'} not reached in {timeout} s: {self.jobs()}")
            time.sleep(0.005)

    def wait_free(self, timeout: float = 60.0) -> None:
        """Until no job is left (pending, running or completing) and every node is idle (outside the timed part)."""
        self._until(lambda: not self.jobs() and self.idle(), timeout, "an idle cluster")

    def log_allocations(self) -> dict[int, float]:
        return parse_allocations((self.dir / "slurmctld.log").read_text(errors="replace"))

    # --- the figures ----------------------------------------------------------------------------------------------

    def allocation_latency(self, nodes: int, gpus: int, samples: int, warmup: int = 0) -> tuple[list, list]:
        """(launch to "Granted job allocation", launch to salloc's exit), seconds, per sample after `warmup`."""
        granted, done = [], []
        argv = ["salloc", f"-N{nodes}", f"--gres=gpu:{gpus}", "--immediate=30", "-J", "peers", "/bin/true"]
        for i in range(samples + warmup):
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env
            )
            t_granted, err = None, []
            for raw in proc.stderr:
                if t_granted is None and GRANTED.search(raw.decode(errors="replace")):
                    t_granted = time.perf_counter()
                err.append(raw.decode(errors="replace").strip())
            rc = proc.wait(timeout=60)
            t_done = time.perf_counter()
            if t_granted is None or rc != 0:
                raise SlurmError(f"salloc -N{nodes} --gres=gpu:{gpus} exited with {rc}: {' | '.join(err)[-500:]}")
            self.wait_free()
            if i >= warmup:
                granted.append(t_granted - t0)
                done.append(t_done - t0)
        return granted, done

    def _run_clients(self, mix: list[int], shapes: dict, clients: int, submit: Callable) -> tuple[float, float, list]:
        """`clients` threads take GPU counts off the end of a copy of `mix` and call submit(nodes, gpus) -> job id.
        Returns the start (time.time(), perf_counter()) and [(job id, perf_counter when its submit returned)]."""
        queue, lock = list(mix), threading.Lock()
        done: list[tuple[int, float]] = []
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                while True:
                    with lock:
                        if not queue:
                            return
                        gpus = queue.pop()
                    nodes, per = shapes[gpus]
                    job = submit(nodes, per)
                    with lock:
                        done.append((job, time.perf_counter()))
            except BaseException as exc:  # raised again below
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(clients)]
        t0_wall, t0 = time.time(), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return t0_wall, t0, done

    def sbatch_throughput(self, mix: list[int], shapes: dict, clients: int, rounds: int) -> list[dict]:
        """Per round: {"jobs", "allocated_s" (first submit to last allocation), "submitted_s" (to the last sbatch's
        return), "from_poll" (jobs the log did not name)}."""
        out = []

        def submit(nodes: int, per: int) -> int:
            return parse_job_id(
                self.client(
                    "sbatch",
                    "--parsable",
                    f"-N{nodes}",
                    f"--gres=gpu:{per}",
                    "--ntasks-per-node=1",
                    "-J",
                    "tp",
                    "-o",
                    "/dev/null",
                    "-D",
                    str(self.dir),
                    "--wrap",
                    "exec sleep 600",
                )  # fmt: skip
            )

        for _ in range(rounds):
            t0_wall, p0, done = self._run_clients(mix, shapes, clients, submit)
            ids = {job for job, _ in done}
            t_seen = self._until(lambda ids=ids: self._all_allocated(ids), 60.0, f"{len(ids)} sbatch jobs allocated")
            logged = self.log_allocations()
            seen_wall = t0_wall + (t_seen - p0)
            last = max(logged.get(job, seen_wall) for job in ids)
            out.append(
                {
                    "jobs": len(ids),
                    "allocated_s": last - t0_wall,
                    "submitted_s": max(t for _, t in done) - p0,
                    "from_poll": sum(job not in logged for job in ids),
                }
            )
            self.client("scancel", *map(str, ids))
            self.wait_free()
        return out

    def _all_allocated(self, ids: Iterable[int]) -> bool:
        jobs = self.jobs()
        return all(jobs.get(job) in ALLOCATED_STATES for job in ids)

    def salloc_throughput(self, mix: list[int], shapes: dict, clients: int, rounds: int) -> list[dict]:
        """Per round: {"jobs", "allocated_s"}: first submit to the last `salloc --no-shell`'s return (granted)."""
        out = []

        def submit(nodes: int, per: int) -> int:
            proc = subprocess.run(
                ["salloc", "--no-shell", f"-N{nodes}", f"--gres=gpu:{per}", "-J", "tp"],
                stdin=subprocess.DEVNULL, capture_output=True, text=True, env=self.env, timeout=60,
            )  # fmt: skip
            m = GRANTED.search(proc.stderr)
            if proc.returncode != 0 or not m:
                raise SlurmError(f"salloc --no-shell exited with {proc.returncode}: {proc.stderr.strip()[-500:]}")
            return int(m.group(1))

        for _ in range(rounds):
            _, p0, done = self._run_clients(mix, shapes, clients, submit)
            out.append({"jobs": len(done), "allocated_s": max(t for _, t in done) - p0})
            self.client("scancel", *(str(job) for job, _ in done))
            self.wait_free()
        return out
