"""A whole Phalanx cluster as local processes, without Docker: the process supervision behind ``phalanx cluster up``
and ``phalanx demo`` (their commands: phalanx.cli.cluster and phalanx.cli.demo).

:class:`LocalCluster` migrates the ledger, then starts the scheduler, the checkpoint coordinator and one simulated
node agent per node, each as its own OS process, and waits until every node is READY::

    from phalanx.cli.cluster import LocalCluster

    with LocalCluster(nodes=4, state_dir="/tmp/c1", port=0) as cluster:   # port 0: two free ports
        client = Client(cluster.address)
        ...

Layout of the state directory (default ``.phalanx/cluster``)::

    phalanx.db                 the SQLite ledger (unless --db names another database)
    topology.conf              the generated fabric (Slurm tree syntax), unless --fabric is given
    topology.yaml              instead, for a profile with multi-node NVLink domains (gb200-nvl72): Phalanx YAML with
                               the NVLink tier (`nvlink_domains: auto`; each 18 consecutive agents report one clique)
    cluster.json               addresses and pids of the running cluster (removed at a clean stop)
    logs/scheduler.log, logs/checkpointd.log, logs/agent-node-01.log, ...
    agents/node-01/            each agent's own state directory (rank logs under logs/)

Children run in their own sessions (a terminal's Ctrl-C reaches only the supervisor, which then stops them in
order: agents first, so they can report their ranks, then the coordinator and the scheduler). Each child also
gets SIGTERM if the thread that started it dies (Linux PR_SET_PDEATHSIG), so a killed supervisor leaves no
orphans: start the cluster from a thread that lives as long as it does (the main thread, normally). How one child
is started and stopped is in phalanx.cli._processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypedDict

from phalanx.core.preemption import LOCAL_POLICY

from ._processes import (
    ClusterError,
    ManagedProcess,
    free_port_pair,
    port_free,
    program,
    spawn,
    tail_of,
    terminate,
)

if TYPE_CHECKING:
    from .certs import LocalPKI

__all__ = [
    "ClusterError",
    "LocalCluster",
    "ManagedProcess",
    "DEFAULT_STATE_DIR",
    "DEFAULT_DEMO_STATE_DIR",
    "DEFAULT_PORT",
    "DEFAULT_PROFILE",
    "MARKER",
    "free_port_pair",
    "node_names",
    "tail_of",
]

DEFAULT_STATE_DIR = Path(".phalanx") / "cluster"
DEFAULT_DEMO_STATE_DIR = Path(".phalanx") / "demo"
DEFAULT_PORT = 50051
DEFAULT_PROFILE = "dgx-h100"
MARKER = ".phalanx-local-cluster"  # marks a state directory LocalCluster created (the demo may wipe those)


def node_names(count: int, prefix: str = "node-") -> list[str]:
    """``node-01`` ... ``node-NN`` (at least two digits)."""
    width = max(2, len(str(count)))
    return [f"{prefix}{i:0{width}d}" for i in range(1, count + 1)]


def _stderr_log(message: str) -> None:
    sys.stderr.write(f"[cluster] {message}\n")
    sys.stderr.flush()


class ClientOptions(TypedDict, total=False):
    """The credential keyword arguments of a :class:`phalanx.client.Client` (`LocalCluster.client_options`)."""

    token: str
    tls_ca: str
    tls_cert: str
    tls_key: str


class LocalCluster:
    """A scheduler, a checkpoint coordinator and N simulated node agents as local processes.

    Args:
        nodes: How many node agents (named node-01 ... node-NN).
        profile: Simulated host profile of every agent (``phalanx-agent --simulate``).
        state_dir: Where the ledger (SQLite by default), the generated fabric, logs and agent state live.
        db_url: Ledger URL; default ``sqlite:///<state_dir>/phalanx.db``.
        host: Address the services bind and are reached at.
        port: Scheduler port; the coordinator takes ``port + 1`` unless ``checkpoint_port`` is given.
            0 picks two free consecutive ports.
        checkpoint_port: Coordinator port (default ``port + 1``).
        fabric: A fabric file for the scheduler; default: a generated fat-tree, 4 nodes per leaf (for a profile
            with multi-node NVLink domains, e.g. gb200-nvl72: 2 racks of 18 per leaf, with the NVLink tier).
        metrics_port_base: Serve Prometheus metrics: scheduler on N, coordinator on N+1, agent i on N+2+i.
        lease_timeout, heartbeat_interval, launch_timeout: The scheduler's timers (short local defaults).
        min_runtime, preemption_grace: Preemption's minimum runtime and grace period (local defaults: a few
            seconds, so preemption shows in a demo; production: 600 s and 120 s). elastic_grow_interval: likewise.
        retry_backoff, retry_backoff_max: The backoff before a gang torn down by a failure is retried.
        kill_grace: Seconds an agent waits between SIGTERM and SIGKILL of a rank.
        restart_agents: Restart an agent that died, after ``restart_delay`` seconds.
        mig_gpus: How many GPUs of the LAST node start in MIG mode: its last N (passed to that agent as
            ``--simulate-mig i,j``); they take only MIG instances, every other GPU only whole-GPU jobs and shares.
            None (default): 1 when the profile's GPUs have MIG (so a MIG job runs out of the box), else 0.
        mig_manage: Start every agent with ``--mig-manage``: the scheduler may then switch idle GPUs into and out of
            MIG mode as its queue needs (a MIG job with no GPU in MIG mode, a whole-GPU job that MIG-mode GPUs are
            in the way of). ``mig_switch_hold`` and ``mig_switch_backoff`` are the scheduler's
            ``--mig-switch-hold`` and ``--mig-switch-backoff`` then (short local defaults).
        run_as: The Unix user every agent runs ranks as (``phalanx-agent --run-as``); None: the user who started the
            cluster (an agent started alone defaults to ``nobody`` when it runs as root).
        ready_timeout: Seconds for the scheduler to answer and every node to be READY.
        stop_timeout: Seconds each group of children gets between SIGTERM and SIGKILL at stop().
        log: Where progress lines go (default: ``[cluster] ...`` on stderr).
        monitor: Run a background thread that notices dead children (and restarts agents) every 0.5 s.
            Without it, call :meth:`poll` yourself.
        env: Extra environment for every child.
        tokens: Authentication on: the operator's tokens file (`phalanx token new` makes entries). The cluster adds
            its own credentials in STATE_DIR/cluster-tokens.yaml: a `node` token for the agents, a `service` token
            the agents hand their ranks (PHALANX_TOKEN, for the checkpoint coordinator) and an `admin` token for
            the supervisor's own calls (:attr:`admin_token`).
        tls: Mutual TLS between every process: a CA and certificates are generated under STATE_DIR/tls
            (:attr:`pki`); clients use the CA and the client certificate.
    """

    def __init__(
        self,
        nodes: int = 4,
        *,
        profile: str = DEFAULT_PROFILE,
        state_dir: str | Path = DEFAULT_STATE_DIR,
        db_url: str | None = None,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        checkpoint_port: int | None = None,
        fabric: str | Path | None = None,
        metrics_port_base: int | None = None,
        lease_timeout: float = 6.0,
        heartbeat_interval: float = 1.0,
        launch_timeout: float = 30.0,
        min_runtime: float = LOCAL_POLICY.min_runtime_s,
        preemption_grace: float = LOCAL_POLICY.grace_period_s,
        elastic_grow_interval: float = 10.0,
        retry_backoff: float = 1.0,
        retry_backoff_max: float = 10.0,
        kill_grace: float = 3.0,
        restart_agents: bool = False,
        restart_delay: float = 2.0,
        ready_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        log: Callable[[str], None] | None = None,
        monitor: bool = True,
        env: dict[str, str] | None = None,
        tokens: str | Path | None = None,
        tls: bool = False,
        mig_gpus: int | None = None,
        mig_manage: bool = False,
        mig_switch_hold: float = 10.0,
        mig_switch_backoff: float = 10.0,
        run_as: str | None = None,
        web_port: int | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        if mig_gpus is not None and mig_gpus < 0:
            raise ValueError("mig_gpus must be 0 or more")
        self.mig_gpus = mig_gpus
        self.mig_manage = mig_manage
        self.run_as = run_as
        self.web_port = web_port  # serve the dashboard (phalanx web) from this process on this port; None: not
        self.web: Any = None
        self.mig_switch_hold = mig_switch_hold
        self.mig_switch_backoff = mig_switch_backoff
        self.node_count = nodes
        self.node_names = node_names(nodes)
        self.profile = profile
        self.state_dir = Path(state_dir).resolve()
        self.db_url = db_url or f"sqlite:///{self.state_dir / 'phalanx.db'}"
        self.host = host
        self.port = port
        self.checkpoint_port = checkpoint_port
        self.fabric = Path(fabric).resolve() if fabric else None
        self.metrics_port_base = metrics_port_base
        self.lease_timeout = lease_timeout
        self.heartbeat_interval = heartbeat_interval
        self.launch_timeout = launch_timeout
        self.min_runtime = min_runtime
        self.preemption_grace, self.elastic_grow_interval = preemption_grace, elastic_grow_interval
        self.retry_backoff = retry_backoff
        self.retry_backoff_max = retry_backoff_max
        self.kill_grace = kill_grace
        self.restart_agents = restart_agents
        self.restart_delay = restart_delay
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.log = log or _stderr_log
        self.monitor = monitor
        self.env = dict(env or {})
        self.tokens = Path(tokens).resolve() if tokens else None
        self.tls = tls
        self.pki: LocalPKI | None = None  # once started with tls
        self.admin_token = ""  # the supervisor's own credential when authentication is on
        self._service_token = ""
        self._node_tokens: dict[str, str] = {}
        self.scheduler: ManagedProcess | None = None
        self.checkpointd: ManagedProcess | None = None
        self.agents: dict[str, ManagedProcess] = {}
        self.failed_service: ManagedProcess | None = None  # a scheduler/coordinator that died while running
        self._lock = threading.RLock()
        self._lock_file: TextIO | None = None
        self._started = False
        self._stopping = False
        self._monitor_stop = threading.Event()
        self._monitor_thread: threading.Thread | None = None

    # -- addresses -------------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The scheduler's ``host:port`` (what ``--scheduler`` / ``PHALANX_SCHEDULER`` take)."""
        return f"{self.host}:{self.port}"

    @property
    def checkpoint_address(self) -> str:
        return f"{self.host}:{self.checkpoint_port}"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    def client_options(self) -> ClientOptions:
        """Keyword arguments for a :class:`phalanx.client.Client` of this cluster (the supervisor's credential)."""
        out: ClientOptions = {}
        if self.tokens is not None:
            out["token"] = self.admin_token
        if self.pki is not None:
            out["tls_ca"] = str(self.pki.ca)
            out["tls_cert"] = str(self.pki.client_cert)
            out["tls_key"] = str(self.pki.client_key)
        return out

    def _security(self) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """Credentials and certificates: the services' extra flags, the agents' environment, the ranks' share."""
        flags: list[str] = []
        agent_env: dict[str, str] = {}
        if self.tokens is not None:
            from phalanx.common.tokens import TokenStore, entry_line, new_token, token_entry

            TokenStore(self.tokens)  # a file that does not load fails here, readably
            self.admin_token, self._service_token = new_token(), new_token()
            # Each agent its own node token, naming its node: it can act as no other.
            self._node_tokens = {node: new_token() for node in self.node_names}
            entries = [
                token_entry(self.admin_token, "cluster-admin", "admin"),
                *(token_entry(t, "cluster-agents", "node", node) for node, t in self._node_tokens.items()),
                token_entry(self._service_token, "cluster", "service"),
            ]
            own = self.state_dir / "cluster-tokens.yaml"
            own.write_text(
                "# generated by phalanx cluster up: the cluster's own credentials (rewritten at each "
                "start)\n" + "".join(entry_line(e) + "\n" for e in entries)
            )
            os.chmod(own, 0o600)
            flags += ["--tokens", str(self.tokens), "--tokens", str(own)]
            # The agent keeps PHALANX_AGENT_TOKEN to itself; its ranks get their attempt's own credential with each
            # launch (PHALANX_JOB_TOKEN, for the checkpoint coordinator), never a token of the cluster's.
        if self.tls:
            from .certs import generate_local_pki

            self.pki = generate_local_pki(self.state_dir / "tls", hosts=("127.0.0.1", "localhost", self.host))
            flags += [
                "--tls-cert",
                str(self.pki.server_cert),
                "--tls-key",
                str(self.pki.server_key),
                "--tls-ca",
                str(self.pki.ca),
            ]
            agent_env.update(
                PHALANX_TLS_CA=str(self.pki.ca),
                PHALANX_TLS_CERT=str(self.pki.client_cert),
                PHALANX_TLS_KEY=str(self.pki.client_key),
            )
        return flags, agent_env, {}

    @staticmethod
    def rank_variables(agent_env: dict[str, str]) -> list[str]:
        """The agents' variables their ranks need, passed on explicitly (phalanx-agent --pass-env): the service
        token and the TLS client files, for the checkpoint coordinator."""
        return [n for n in ("PHALANX_TLS_CA", "PHALANX_TLS_CERT", "PHALANX_TLS_KEY") if n in agent_env]

    def agent_state_dir(self, node: str) -> Path:
        return self.state_dir / "agents" / node

    def children(self) -> list[ManagedProcess]:
        """Every child, agents first."""
        out = list(self.agents.values())
        out += [p for p in (self.checkpointd, self.scheduler) if p is not None]
        return out

    def all_pids(self) -> list[int]:
        """Every pid ever started by this cluster (for tests that check nothing is left behind)."""
        return [pid for p in self.children() for pid in p.history]

    # -- lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        """Migrate the ledger, start every process and wait until every node is READY.

        Raises:
            ClusterError: Something did not start; whatever had started is stopped again.
        """
        if self._started:
            raise ClusterError("cluster already started")
        self._started = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)
        self._take_lock()
        (self.state_dir / MARKER).write_text("created by phalanx cluster up / phalanx demo\n")
        if self.port == 0:
            self.port = free_port_pair(self.host)
        if self.checkpoint_port is None:
            self.checkpoint_port = self.port + 1
        for what, port in (("scheduler", self.port), ("checkpoint coordinator", self.checkpoint_port)):
            if not port_free(self.host, port):
                raise ClusterError(f"port {port} on {self.host} ({what}) is in use; pick another with --port")

        self.log(f"state directory {self.state_dir}")
        self._upgrade_db()
        fabric = self._fabric_file()
        security, agent_env, _ = self._security()
        self.scheduler, self.checkpointd = self._service_processes(fabric, security)
        per_domain = self._nvlink_domain_nodes()
        mig_gpus = self.mig_gpu_indexes()
        for i, node in enumerate(self.node_names):
            self.agents[node] = self._agent_process(i, node, agent_env, per_domain, mig_gpus)

        self._spawn(self.scheduler)
        self._wait_for_scheduler()
        self.log(f"scheduler at {self.address} (log {self.scheduler.log_path})")
        self._spawn(self.checkpointd)
        for agent in self.agents.values():
            self._spawn(agent)
        self._wait_for_port(self.checkpointd, self.checkpoint_port)
        self.log(f"checkpoint coordinator at {self.checkpoint_address}")
        self._wait_for_nodes()
        if self.web_port is not None:
            from phalanx.web.server import WebServer

            # The cluster's own dashboard, on loopback; it holds no credential: visitors sign in with their own tokens
            # (with authentication off, with an empty one).
            self.web = WebServer(self.address, port=self.web_port, checkpoint=self.checkpoint_address).start()
            self.log(f"dashboard at {self.web.url}")
        self.log(
            f"{self.node_count} nodes READY ({self.profile})"
            + (
                f"; GPU(s) {','.join(map(str, mig_gpus))} of {self.node_names[-1]} in MIG mode (MIG jobs only)"
                if mig_gpus
                else ""
            )
            + ("; --mig-manage: the scheduler switches idle GPUs' MIG mode as jobs need" if self.mig_manage else "")
        )
        self._write_info()
        if self.monitor:
            self._monitor_thread = threading.Thread(target=self._monitor, name="phalanx-cluster-monitor", daemon=True)
            self._monitor_thread.start()

    def _service_processes(self, fabric: Path, security: list[str]) -> tuple[ManagedProcess, ManagedProcess]:
        """The scheduler's and the checkpoint coordinator's command lines (`security`: their extra flags)."""
        sched = [
            *program("phalanx-scheduler", "services.scheduler.main"),
            "--db",
            self.db_url,
            "--listen",
            self.address,
            "--fabric",
            str(fabric),
            "--lease-timeout",
            f"{self.lease_timeout:g}",
            "--heartbeat-interval",
            f"{self.heartbeat_interval:g}",
            "--launch-timeout",
            f"{self.launch_timeout:g}",
            "--min-runtime",
            f"{self.min_runtime:g}",
            "--preemption-grace",
            f"{self.preemption_grace:g}",
            "--elastic-grow-interval",
            f"{self.elastic_grow_interval:g}",
            "--retry-backoff",
            f"{self.retry_backoff:g}",
            "--retry-backoff-max",
            f"{self.retry_backoff_max:g}",
            "--checkpoint-coordinator",
            self.checkpoint_address,
            "--checkpoint-dir",
            str(self.state_dir / "checkpoints"),
            *security,
        ]
        if self.mig_manage:
            sched += [
                "--mig-switch-hold",
                f"{self.mig_switch_hold:g}",
                "--mig-switch-backoff",
                f"{self.mig_switch_backoff:g}",
            ]
        ckpt = [
            *program("phalanx-checkpointd", "services.checkpoint_coordinator.main"),
            "--db",
            self.db_url,
            "--listen",
            self.checkpoint_address,
            "--checkpoint-dir",
            str(self.state_dir / "checkpoints"),
            *security,
        ]
        if self.metrics_port_base is not None:
            sched += ["--metrics-port", str(self.metrics_port_base)]
            ckpt += ["--metrics-port", str(self.metrics_port_base + 1)]
        scheduler = ManagedProcess("scheduler", "scheduler", sched, self.logs_dir / "scheduler.log")
        checkpointd = ManagedProcess("checkpointd", "checkpointd", ckpt, self.logs_dir / "checkpointd.log")
        return scheduler, checkpointd

    def _agent_process(
        self, i: int, node: str, agent_env: dict[str, str], per_domain: int, mig_gpus: list[int]
    ) -> ManagedProcess:
        """The agent of node `node` (the `i`th): its command line and environment (`agent_env` and its own token)."""
        argv = [
            *program("phalanx-agent", "services.node_agent.main"),
            "--scheduler",
            self.address,
            "--node-name",
            node,
            "--simulate",
            self.profile,
            "--state-dir",
            str(self.agent_state_dir(node)),
            "--address",
            self.host,
            "--kill-grace",
            f"{self.kill_grace:g}",
        ]
        if mig_gpus and node == self.node_names[-1]:
            argv += ["--simulate-mig", ",".join(map(str, mig_gpus))]
        if self.mig_manage:
            argv += ["--mig-manage"]
        # A local cluster runs its ranks as whoever started it (it is their machine and their code), unless told.
        argv += ["--run-as", self.run_as or pwd.getpwuid(os.geteuid()).pw_name]
        for name in self.rank_variables(agent_env):
            argv += ["--pass-env", name]
        if per_domain > 1:  # a GB200 NVL72 rack: each consecutive 18 trays report one fabric clique
            argv += ["--fabric-clique", str(i // per_domain)]
        if self.metrics_port_base is not None:
            argv += ["--metrics-port", str(self.metrics_port_base + 2 + i)]
        env = dict(agent_env)
        if node in self._node_tokens:
            env["PHALANX_AGENT_TOKEN"] = self._node_tokens[node]
        return ManagedProcess(node, "agent", argv, self.logs_dir / f"agent-{node}.log", env=env)

    def stop(self) -> None:
        """Stop every child: agents first (SIGTERM, wait, SIGKILL), then the coordinator and the scheduler.

        Safe to call twice, and from a signal handler's aftermath; never raises for a child that is already gone.
        """
        if self.web is not None:
            web, self.web = self.web, None
            web.stop()
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._monitor_stop.set()
        if self._monitor_thread is not None and self._monitor_thread is not threading.current_thread():
            self._monitor_thread.join(timeout=5)
        groups = [list(self.agents.values()), [p for p in (self.checkpointd, self.scheduler) if p is not None]]
        if any(p.alive() for g in groups for p in g):
            self.log("stopping the cluster")
        for group in groups:
            self._terminate(group)
        with contextlib.suppress(OSError):
            (self.state_dir / "cluster.json").unlink()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    @property
    def running(self) -> bool:
        return self._started and not self._stopping

    # -- supervision -----------------------------------------------------------------------------------------

    def poll(self) -> list[ManagedProcess]:
        """Notice children that exited since the last call (and restart agents when asked). Returns them.

        An agent that dies is a node failure: it is logged (the scheduler marks the node LOST once its lease
        runs out) and the cluster keeps running. A scheduler or coordinator that dies is recorded in
        :attr:`failed_service`; ``cluster up`` then stops the whole cluster.
        """
        died: list[ManagedProcess] = []
        with self._lock:
            if self._stopping:
                return died
            now = time.monotonic()
            for child in self.children():
                if child.proc is not None and child.exit_code is None:
                    rc = child.proc.poll()
                    if rc is None:
                        continue
                    child.exit_code = rc
                    died.append(child)
                    if child.kind == "agent":
                        what = f"signal {-rc}" if rc < 0 else f"code {rc}"
                        more = (
                            f"; restarting it in {self.restart_delay:g}s"
                            if self.restart_agents
                            else "; the node will show LOST"
                        )
                        self.log(f"agent of {child.name} (pid {child.pid}) exited with {what}: node failure{more}")
                        if self.restart_agents:
                            child.restart_at = now + self.restart_delay
                    else:
                        self.log(f"{child.name} (pid {child.pid}) exited with code {rc}; see {child.log_path}")
                        self.failed_service = self.failed_service or child
                if child.kind == "agent" and child.restart_at is not None and now >= child.restart_at:
                    child.restart_at = None
                    child.restarts += 1
                    self._spawn(child)
                    self.log(f"restarted the agent of {child.name} (pid {child.pid}, restart #{child.restarts})")
        return died

    def _monitor(self) -> None:
        while not self._monitor_stop.wait(0.5):
            try:
                self.poll()
            except Exception as exc:  # keep supervising
                self.log(f"monitor error: {type(exc).__name__}: {exc}")

    def kill_agent(self, node: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to a node's agent (a simulated node failure). Returns the pid signalled."""
        child = self.agents[node]
        if child.proc is None:
            raise ClusterError(f"agent of {node} is not running")
        child.proc.send_signal(sig)
        return child.proc.pid

    def wait(self, stop_event: threading.Event | None = None) -> int:
        """Supervise until ``stop_event`` is set (0) or the scheduler or coordinator dies (1)."""
        stop_event = stop_event or threading.Event()
        while not stop_event.wait(0.5):
            if not self.monitor:
                self.poll()
            if self.failed_service is not None:
                return 1
        return 0

    # -- internals -------------------------------------------------------------------------------------------

    def _take_lock(self) -> None:
        f = open(self.state_dir / "cluster.lock", "a+")  # held for the cluster's lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise ClusterError(
                f"another local cluster is running with state directory {self.state_dir}; "
                "stop it or pass another --state-dir"
            ) from None
        self._lock_file = f

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        env.setdefault("PHALANX_HOME", str(self.state_dir))
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("PHALANX_SCHEDULER_LISTEN", None)
        env.pop("PHALANX_CHECKPOINTD_LISTEN", None)
        return env

    def _spawn(self, child: ManagedProcess) -> None:
        spawn(child, {**self._child_env(), **child.env})

    def _terminate(self, group: Sequence[ManagedProcess]) -> None:
        terminate(group, self.stop_timeout, self.log)

    def _upgrade_db(self) -> None:
        shown = self.db_url.split("@")[-1]
        self.log(f"phalanx db upgrade --db {shown}")
        argv = [*program("phalanx", "phalanx.cli.main"), "db", "upgrade", "--db", self.db_url]
        log_path = self.logs_dir / "db-upgrade.log"
        with open(log_path, "ab") as out:
            rc = subprocess.run(
                argv, env=self._child_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=120
            ).returncode
        if rc != 0:
            raise ClusterError(f"`phalanx db upgrade` failed (exit {rc}):\n{tail_of(log_path)}")

    def mig_gpu_indexes(self) -> list[int]:
        """The GPUs of the last node that start in MIG mode (its last `mig_gpus`, see the class); [] for none.

        Raises:
            ValueError: More GPUs than a node has, or MIG GPUs asked of a profile whose GPUs have no MIG.
        """
        from phalanx.core import mig
        from phalanx.profiles import UnknownProfile, load_profile

        try:
            prof = load_profile(self.profile)
        except (UnknownProfile, ValueError):
            if self.mig_gpus:
                raise ValueError(f"--mig-gpus needs a known profile, not {self.profile!r}") from None
            return []  # the agents will say what is wrong with the profile
        capable = mig.mig_family(prof.gpu_model, prof.memory_mib) is not None
        count = (1 if capable else 0) if self.mig_gpus is None else self.mig_gpus
        if count > prof.gpu_count:
            raise ValueError(f"--mig-gpus {count}: a {self.profile} node has {prof.gpu_count} GPUs")
        if count and not capable:
            raise ValueError(f"--mig-gpus {count}: the GPUs of profile {self.profile} ({prof.gpu_model}) have no MIG")
        return list(range(prof.gpu_count - count, prof.gpu_count))

    def _nvlink_domain_nodes(self) -> int:
        """Nodes per multi-node NVLink domain of the profile (18 for gb200-nvl72), 1 for other profiles."""
        from phalanx.profiles import UnknownProfile, load_profile

        try:
            return load_profile(self.profile).nvlink_domain_nodes
        except (UnknownProfile, ValueError):
            return 1  # the agents will say what is wrong with the profile

    def _fabric_file(self) -> Path:
        if self.fabric is not None:
            from phalanx.core.fabric import load_fabric

            fabric = load_fabric(self.fabric)  # fail here, readably, rather than in the scheduler's log
            if self._nvlink_domain_nodes() > 1 and not fabric.has_nvlink:
                self.log(
                    f"{self.fabric} has no NVLink tier (`nvlink_domains: auto` in YAML adds one): the agents' "
                    "fabric cliques are not used for placement"
                )
            return self.fabric
        from phalanx.core.fabric import default_fabric, to_slurm_tree, with_nvlink_domains

        per_domain = self._nvlink_domain_nodes()
        if per_domain > 1:
            # Two racks (NVLink domains) per leaf switch; the domains come from the agents' cliques.
            path = self.state_dir / "topology.yaml"
            fabric = with_nvlink_domains(default_fabric(self.node_names, nodes_per_leaf=2 * per_domain), {})
            path.write_text(
                f"# generated by phalanx cluster up: NVLink domains of {per_domain} nodes (from the "
                f"agents' fabric cliques), {2 * per_domain} nodes per leaf switch\n" + fabric.to_yaml()
            )
            return path
        path = self.state_dir / "topology.conf"
        text = to_slurm_tree(default_fabric(self.node_names, nodes_per_leaf=4))
        path.write_text("# generated by phalanx cluster up: 4 nodes per leaf switch\n" + text)
        return path

    def _check_alive(self, child: ManagedProcess) -> None:
        if child.proc is not None and child.proc.poll() is not None:
            raise ClusterError(
                f"{child.name} exited with code {child.proc.returncode} while starting; "
                f"last lines of {child.log_path}:\n{tail_of(child.log_path)}"
            )

    def _wait_for_scheduler(self) -> None:
        from phalanx.client import Client, PhalanxError

        assert self.scheduler is not None
        deadline = time.monotonic() + self.ready_timeout
        with Client(self.address, timeout=2.0, retries=0, **self.client_options()) as client:
            while True:
                self._check_alive(self.scheduler)
                try:
                    client.nodes()
                    return
                except PhalanxError:
                    pass
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"the scheduler did not answer at {self.address} within "
                        f"{self.ready_timeout:g}s; see {self.scheduler.log_path}"
                    )
                time.sleep(0.1)

    def _wait_for_port(self, child: ManagedProcess, port: int) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            self._check_alive(child)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                if s.connect_ex((self.host, port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{child.name} did not listen on {self.host}:{port} within "
                    f"{self.ready_timeout:g}s; see {child.log_path}"
                )
            time.sleep(0.1)

    def _wait_for_nodes(self) -> None:
        from phalanx.client import Client, NodeState, PhalanxError

        deadline = time.monotonic() + self.ready_timeout
        wanted = set(self.node_names)
        # Bring-up progress: a bar on a terminal (rich), else a line each time the count moves.
        bar = None
        if self.log is _stderr_log and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(TextColumn("nodes registered"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            task = bar.add_task("nodes", total=len(wanted))
            bar.start()
        shown = -1
        try:
            with Client(self.address, timeout=5.0, **self.client_options()) as client:
                while True:
                    for child in self.children():
                        self._check_alive(child)
                    try:
                        ready = {n.name for n in client.nodes() if n.state is NodeState.READY}
                    except PhalanxError:
                        ready = set()
                    count = len(wanted & ready)
                    if count != shown:
                        shown = count
                        if bar is not None:
                            bar.update(task, completed=count)
                        else:
                            self.log(f"nodes registered: {count}/{len(wanted)}")
                    if wanted <= ready:
                        return
                    if time.monotonic() > deadline:
                        missing = ", ".join(sorted(wanted - ready))
                        raise ClusterError(
                            f"nodes not READY after {self.ready_timeout:g}s: {missing} (agent logs under "
                            f"{self.logs_dir})"
                        )
                    time.sleep(0.2)
        finally:
            if bar is not None:
                bar.stop()

    def _write_info(self) -> None:
        info = {
            "scheduler": self.address,
            "checkpoint_coordinator": self.checkpoint_address,
            "db": self.db_url.split("@")[-1],
            "supervisor_pid": os.getpid(),
            "pids": {p.name: p.pid for p in self.children()},
            "nodes": self.node_names,
            "profile": self.profile,
            "mig_gpus": {self.node_names[-1]: self.mig_gpu_indexes()} if self.mig_gpu_indexes() else {},
            "mig_manage": self.mig_manage,
            "authentication": self.tokens is not None,
            "tls": {"ca": str(self.pki.ca), "cert": str(self.pki.client_cert), "key": str(self.pki.client_key)}
            if self.pki is not None
            else None,
        }
        (self.state_dir / "cluster.json").write_text(json.dumps(info, indent=2) + "\n")
