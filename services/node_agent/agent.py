"""The node agent daemon: registers its host, heartbeats, takes assignments, runs and reports ranks.

    agent = NodeAgent(AgentConfig(scheduler="127.0.0.1:7070", node_name="n1", topology=topo))
    await agent.run()            # until agent.request_stop() (SIGTERM/SIGINT in the CLI)

Protocol (proto/phalanx/api/v1/agent.proto, NodeService):
- RegisterNode with a fresh agent_instance per process; Heartbeat every heartbeat_interval_ms; a heartbeat
  answered `reregister` (or any RPC failure) ends the session and the agent registers again.
- StreamAssignments from the last revision acked in the local state file. Each assignment is applied
  idempotently (launches keyed by (job_id, attempt, rank); a killed attempt is never launched), the state file is
  written, and only then AckAssignments(revision).
- Every rank state change is queued in the state file and sent with ReportRankStatus until the scheduler takes
  it, so nothing is lost while the scheduler is down. A report answered `stale` kills the rank.
- The connection is retried with exponential backoff and jitter (capped at backoff_cap_s).
- After a restart the agent adopts ranks whose wrapper process is still alive (same pid and start time) and
  reports the others EXITED (exit code from the wrapper's status file) or LOST.
- Ledger identity: RegisterNode returns the ledger's cluster id (and the node's last revision there), kept in the
  state file. Saved state of another cluster id, or whose acked revision is above the ledger's (state of an older
  agent has no id: the ledger's revision decides), is another ledger's: the agent logs a warning naming both ids,
  kills that state's ranks (adopted ones included), forgets them, and streams from revision 0 (_check_ledger).
- request_stop() (SIGTERM/SIGINT in the CLI) drains: stop taking work, tell the scheduler (a heartbeat with
  `draining`: the node becomes DRAINED, out of placement), kill running ranks (KILLED), flush reports, return.
- Partial GPUs: a rank with MIG `slices` starts once its MIG instances exist (found or created through the
  MigManager, mig_manager.py: NVML on a discovered host, a fake with the real profile rules on a simulated one),
  with CUDA_VISIBLE_DEVICES = their MIG device UUIDs; an instance this agent created is destroyed when the last rank
  using it ends (an adopted rank's instances are kept while it runs). A MIG failure fails that rank's start
  (FAILED_TO_START).
- Fractional shares (`gpu_milli`, mps.py): one MPS control daemon per GPU that has shares (`nvidia-cuda-mps-control
  -d` with CUDA_VISIBLE_DEVICES = the GPU's UUID and pipe/log directories `<state_dir>/mps/gpu<N>/{pipe,log}`;
  `--mps-control PATH`, a stand-in from phalanx.simhost on a simulated host), started before the GPU's first share
  starts and told to `quit` when its last share ends. The rank gets its daemon's CUDA_MPS_PIPE_DIRECTORY and
  CUDA_MPS_LOG_DIRECTORY, CUDA_VISIBLE_DEVICES = the GPU's UUID and the per-client limits of its share
  (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M; launcher.fractional_env). Other
  ranks never get a CUDA_MPS_* variable (neither the agent's own nor the launch's). A daemon that cannot be started
  fails the rank's start (FAILED_TO_START, `retryable`: the host's fault). A restarted agent adopts the daemons of
  the share ranks it adopts and stops those no live share uses.
- Readiness (readiness.py): a launch with `ready_probe` (the leader's replica of a gang with a probe) is probed
  once its ranks start (an HTTP GET of `--address`:port/path, or a command run like a rank: in the attempt's
  container, as its user, with the leader's environment), after initial_delay_s and every period_s; ready on the
  first pass, not ready after failure_threshold failures in a row, each change queued for ReportReadiness. It stops
  with the attempt, when a report is answered `stale`, and with the agent; a restarted agent probes on.
- Health (health.py): before every heartbeat the HealthMonitor checks its source (NVML on a discovered host; the
  simulated source, fed by `<state_dir>/health.json` or `health_source.inject()`, on a simulated one); the
  heartbeat carries the node's health and the events since the last answered heartbeat (kept until one is).
- Host resources (host_resources.py): the registration says what ranks may use of the host, `cpus` and
  `memory_bytes` (the CPU affinity and MemTotal, capped by the agent's own cgroup; a simulated host's profile;
  `--host-cpus` / `--host-memory` override). A launch's `cpus` / `memory_bytes` are its replica's reservation: the
  attempt's container here gets a CPU quota and a memory limit of their sum over the attempt's replicas on this
  host (none when every replica asks 0). A rank that ends in failure after the container's OOM-kill count rose is
  reported `out of memory (limit <size>)`, its exit code kept (137 for the SIGKILL); each kill is told once.

The agent is a composition (this module wires it):
- session.py, the scheduler session: registration, heartbeats, the assignment stream, acks, the reporter of the
  persisted report queue, ledger identity and self-fencing. It drives the ranks through `RankControl`.
- supervisor.py, the rank supervisor: launch, environment, monitor, kill, adopt, logs; rank_states.py its table.
- attempts.py, the attempt table: containers, closing an attempt, releasing it, MASTER_PORT and users.
- devices.py, the device glue: MIG, MPS, health.
- reports.py, the persisted report queue: ranks and attempts report there (plus an event), never to the session.
- readiness.py, the readiness prober: the leader's probe per attempt, its changes reported through the queue.
The simulated host (--simulate, tests) is injected: AgentConfig.nvml or AgentConfig.simulated_nvml.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from phalanx.api.v1 import agent_pb2

from . import containment as cgroups
from . import host_resources, identity
from ._background import Background
from .attempts import AttemptTable
from .devices import DeviceGlue
from .mig_manager import MigBackend
from .readiness import ReadinessProber
from .reports import RANKS_RUNNING, REPORTS_PENDING, ReportQueue
from .session import CHANNEL_OPTIONS, SchedulerSession, backoff_delay
from .state import AgentState, RankRecord, StateLock, default_state_dir
from .supervisor import RankSupervisor

__all__ = [
    "CHANNEL_OPTIONS",
    "RANKS_RUNNING",
    "REPORTS_PENDING",
    "AgentConfig",
    "NodeAgent",
    "SimulatedHostError",
    "backoff_delay",
]


@dataclass
class AgentConfig:
    scheduler: str
    node_name: str
    topology: agent_pb2.HostTopology
    state_dir: Path | None = None  # default $PHALANX_HOME/agents/<node_name> (.phalanx/...)
    address: str = "127.0.0.1"  # where ranks reach this host (MASTER_ADDR when it hosts rank 0)
    kill_grace_s: float = 5.0  # SIGTERM -> SIGKILL
    backoff_initial_s: float = 0.1
    backoff_cap_s: float = 5.0
    rpc_timeout_s: float = 5.0
    poll_interval_s: float = 0.05  # how often rank processes are checked
    start_timeout_s: float = 15.0  # for the wrapper to say the command started
    flush_timeout_s: float = 5.0  # at shutdown, for queued reports
    default_heartbeat_ms: int = 1000
    mig_backend: MigBackend | None = None  # default: NVML through `nvml`
    # The NVML bindings: None for the real pynvml (a discovered host); on a simulated host a private pynvml bound to
    # its simulated library (phalanx.simhost.nvml), given here or made by `simulated_nvml`.
    nvml: Any = None
    # A simulated host (a topology whose profile is not "nvml") given no `nvml` nor `mig_backend`: the function
    # that makes its bindings from the topology and the agent's state directory (its MIG state is kept there).
    # main.py injects services.node_agent.simulated.nvml_for_topology under --simulate; this module never imports
    # the simulated host itself.
    simulated_nvml: Callable[[agent_pb2.HostTopology, Path], Any] | None = None
    mig_manage: bool = False  # the scheduler may ask to switch idle GPUs' MIG mode (SetMigMode)
    mps_control: str | None = None  # MPS control program; default nvidia-cuda-mps-control on PATH for a
    # discovered host, the fake (phalanx.simhost.mps_control) when simulated
    health_source: object | None = None  # default: NVML for a discovered host, SimulatedHealthSource otherwise
    health_enabled: bool = True  # False: heartbeats carry no health (the scheduler keeps what it has)
    ecc_sbe_threshold: int = 100  # corrected ECC errors above which a GPU is DEGRADED
    token: str = ""  # the agent's own credential (role `node`), sent on every call
    # Containment (containment.py): a Containment, or None to detect one (under `cgroup_parent`, of kind
    # `containment_kind` when given); `pids_max` limits each attempt's processes on this host (0: no limit).
    containment: Any = None
    cgroup_parent: str | None = None
    containment_kind: str | None = None
    pids_max: int = 0
    # The driver's table of MIG capability minors (/dev/nvidia-caps/nvidia-cap<minor>): an attempt's device rules
    # allow only the capabilities of its own MIG instances (containment.nvidia_cap_minors).
    mig_minors_file: str = "/proc/driver/nvidia-caps/mig-minors"
    # How long a rank waits for a MIG instance another attempt still holds (its processes exiting) before it fails
    # to start, retryably.
    mig_wait_s: float = 30.0
    run_as: str | None = None  # the ranks' Unix user (None: the agent's own identity)
    pass_env: tuple[str, ...] = ()  # names of the agent's variables its ranks get (identity.rank_environment)
    self_fence: bool = True  # stop every rank when the registration cannot be renewed within the lease
    rank_ports: tuple[int, int] = (20000, 31999)  # --rank-port-range: where MASTER_PORT comes from for rank 0 here
    tls: object | None = None  # phalanx.client.TLSConfig: TLS to the scheduler
    # What the registration says ranks may use of the host (--host-cpus / --host-memory); None: found
    # (host_resources.resolve: a simulated host's shipped profile, else this host's affinity and MemTotal).
    host_cpus: float | None = None
    host_memory: int | None = None
    # The ranks' logs (logs.py): AgentLogs served on `logs_listen` ("": on `address`, any free port; "off": none),
    # and each rank's log kept under `log_max_bytes` by rotation (0: no bound).
    logs_listen: str = ""
    log_max_bytes: int = 64 * 1024 * 1024
    extra: dict = field(default_factory=dict)

    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir) if self.state_dir is not None else default_state_dir(self.node_name)


class SimulatedHostError(ValueError):
    """A simulated topology given to an agent with no way to make its NVML bindings."""


class NodeAgent:
    """The collaborators of one agent process, composed: the scheduler session drives the rank supervisor, which
    runs ranks in the attempt table's containers with the device glue's partial GPUs; every report goes through
    the persisted queue."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.node_name = config.node_name
        self.instance = uuid.uuid4().hex
        self.state_dir = config.resolved_state_dir().resolve()
        self.state = AgentState.load(self.state_dir / "state.json", node_name=self.node_name)
        self.state.node_name = self.node_name
        self.log = structlog.get_logger(service="node-agent").bind(node=self.node_name, instance=self.instance[:8])
        self._lock = StateLock(self.state_dir)
        self._stop = asyncio.Event()
        self._run_task: asyncio.Task | None = None
        self.background = Background()
        self.nvml = config.nvml
        if self.nvml is None and config.topology.profile != "nvml" and config.mig_backend is None:
            # A simulated host (--simulate, tests): its bindings come from the caller.
            if config.simulated_nvml is None:
                raise SimulatedHostError(
                    f"the topology is a simulated host's (profile {config.topology.profile!r}): give the agent its "
                    "NVML bindings (AgentConfig.nvml, or simulated_nvml=services.node_agent.simulated."
                    "nvml_for_topology)"
                )
            self.nvml = config.simulated_nvml(config.topology, self.state_dir)
        self.host_resources = host_resources.resolve(
            _shipped_profile(config.topology.profile), config.host_cpus, config.host_memory
        )
        self.rank_user = identity.resolve_user(config.run_as) if config.run_as else identity.agent_user()
        if self.rank_user.uid != os.geteuid() and os.geteuid() != 0:
            raise ValueError(f"ranks can run as {self.rank_user.name!r} only when the agent runs as root")
        self.reports = ReportQueue(self.state)
        self.devices = DeviceGlue(
            config.topology,
            self.state,
            self.state_dir,
            self.log,
            self.background,
            nvml=self.nvml,
            mig_backend=config.mig_backend,
            mig_manage=config.mig_manage,
            mig_wait_s=config.mig_wait_s,
            mps_control=config.mps_control,
            health_source=config.health_source,
            health_enabled=config.health_enabled,
            ecc_sbe_threshold=config.ecc_sbe_threshold,
        )
        self.attempts = AttemptTable(
            config, self.state, self.state_dir, self.log, self.reports, self.devices, self.background, self.rank_user
        )
        self.probes = ReadinessProber(
            config,
            self.state,
            self.state_dir,
            self.log,
            self.reports,
            self.attempts,
            self.background,
            stopping=self._stop.is_set,
        )
        self.ranks = RankSupervisor(
            config,
            self.state,
            self.state_dir,
            self.log,
            self.reports,
            self.attempts,
            self.devices,
            self.background,
            stopping=self._stop.is_set,
            logs_key=lambda: self.session.logs_key,
            probes=self.probes,
        )
        self.session = SchedulerSession(
            config,
            self.state,
            self.log,
            self.instance,
            self.reports,
            self.ranks,
            self.devices,
            self.background,
            self._stop,
            registration=self._registration,
            readiness_stale=self.probes.stale,
        )

    def _registration(self) -> dict:
        """The host's own fields of RegisterNodeRequest."""
        containment = self.attempts.containment
        return dict(
            containment=containment.kind if containment else "",
            cpus=self.host_resources.cpus,
            memory_bytes=self.host_resources.memory_bytes,
            logs_port=self.ranks.logs_port,
        )

    # ---------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        """Run until request_stop(); then kill ranks, flush reports and return."""
        self._run_task = asyncio.current_task()
        self._lock.acquire()
        self.state.start_writer()
        self.log.info(
            "agent_starting",
            scheduler=self.config.scheduler,
            state_dir=str(self.state_dir),
            acked_revision=self.state.acked_revision,
            cluster_id=self.state.cluster_id or "unknown",
            gpus=len(self.config.topology.gpus),
            host_cpus=self.host_resources.cpus,
            host_memory=cgroups.format_size(self.host_resources.memory_bytes)
            if self.host_resources.memory_bytes
            else "unknown",
        )
        try:
            await self.devices.open_health()
            await self.ranks.open_logs()
            self.attempts.open_containment()
            self.ranks.adopt()
            self.attempts.clean_up_containers()
            self.probes.resume()  # the readiness probes of the attempts adopted
            if self.mig.mig_gpus():
                await asyncio.to_thread(self.devices.clean_up_mig)
            self.session.start_reporter()
            if self.mig.mig_gpus():
                self.background.spawn(self.devices.log_mig_instances())
            fence = asyncio.create_task(self.session.fence_watch(), name="self-fence")
            try:
                await self.session.supervise()
            finally:
                fence.cancel()
            await self.session.announce_drain()
            await self._shutdown()
        finally:
            await self.ranks.close_logs()
            if self.devices.health_monitor is not None:
                await asyncio.to_thread(self.devices.close_health)
            await asyncio.to_thread(self.state.stop_writer)
            containment = self.attempts.containment
            if containment is not None and not any(not r.final for r in self.state.ranks.values()):
                containment.close()
            self._lock.release()
        self.log.info("agent_stopped")

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def stop(self) -> None:
        """Request a graceful stop and wait for run() to return (when it runs as a task)."""
        self.request_stop()
        if self._run_task is not None and self._run_task is not asyncio.current_task():
            await asyncio.shield(self._run_task)

    async def abort(self) -> None:
        """Simulate a crash: drop everything at once, leaving rank processes and the state file as they are."""
        tasks = [
            t
            for t in [self._run_task, self.session.reporter, *self.ranks.monitors.values(), *self.background.tasks]
            if t
        ]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lock.release()

    async def _shutdown(self) -> None:
        """Drain: stop every live attempt (KILLED), wait for their containers to close and for MIG/MPS work in
        worker threads, then flush the queued reports."""
        self.probes.stop_all()
        live = [r for r in self.state.ranks.values() if not r.final]
        self.log.info("agent_shutting_down", live_ranks=len(live), pending_reports=len(self.state.pending_reports))
        attempts = sorted({(r.job_id, r.attempt) for r in live})
        kills = [asyncio.create_task(self.ranks.stop_attempt(j, a, "node agent shutting down")) for j, a in attempts]
        if kills:
            await asyncio.gather(*kills, return_exceptions=True)
        monitors = list(self.ranks.monitors.values())
        if monitors:
            await asyncio.wait(monitors, timeout=self.config.kill_grace_s + 2)
        await asyncio.sleep(0)  # the last monitors' finish queue their attempts' closing
        closing = list(self.attempts.closing.values())
        if closing:
            await asyncio.wait(closing, timeout=self.config.kill_grace_s + 12)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # MIG acquisitions and releases in flight
            await asyncio.sleep(0)  # done-callbacks first: a finished acquisition may queue its release
            pending = [f for f in self.background.releases if not f.done()]
            if not pending:
                break
            await asyncio.wait(pending, timeout=max(0.01, deadline - time.monotonic()))
        for t in list(self.background.tasks):
            t.cancel()
        await self.session.flush()
        await self.session.stop_reporter()
        self.state.save()

    # ---------------------------------------------------------------- what tests and tools look at

    @property
    def scheduler(self) -> str:
        return self.session.scheduler

    @property
    def schedulers(self) -> list[str]:
        return self.session.schedulers

    @property
    def registrations(self) -> int:
        return self.session.registrations

    @property
    def logs_key(self) -> str:
        return self.session.logs_key

    @property
    def logs_port(self) -> int:
        return self.ranks.logs_port

    @property
    def heartbeat_interval_ms(self) -> int:
        return self.session.heartbeat_interval_ms

    @property
    def fenced(self) -> bool:
        return self.session.fenced

    @property
    def fenced_after(self) -> float:
        return self.session.fenced_after

    def fence_after_s(self) -> float:
        return self.session.fence_after_s()

    @property
    def mig(self):
        return self.devices.mig

    @property
    def mps(self):
        return self.devices.mps

    @property
    def containment(self) -> cgroups.Containment | None:
        return self.attempts.containment

    @property
    def health_source(self):
        return self.devices.health_source

    @property
    def health_monitor(self):
        return self.devices.health_monitor

    @property
    def health(self):
        return self.devices.health

    async def check_health(self) -> None:
        await self.devices.check_health()

    # Internals some service tests reach for.
    @property
    def _stub(self):
        return self.session.stub

    @property
    def _attempt(self) -> int:
        return self.session.attempt

    @property
    def _take(self):
        return self.session._take

    @_take.setter
    def _take(self, take) -> None:  # a test records the assignments the session takes
        self.session._take = take  # type: ignore[method-assign]

    @property
    def _procs(self):
        return self.ranks.procs

    @property
    def _releases(self):
        return self.background.releases

    @property
    def _groups(self):
        return self.attempts.groups

    @property
    def _mig_switch_errors(self):
        return self.devices.mig_switch_errors

    def _current_topology(self) -> agent_pb2.HostTopology:
        return self.devices.current_topology()

    async def _rank_env(self, rec: RankRecord, env: dict[str, str]) -> dict[str, str]:
        return await self.ranks.rank_env(rec, env)


def _shipped_profile(name: str):
    """The shipped profile a simulated topology was made from (its host CPUs and memory), None for a real host or
    a topology of no shipped profile (a dump file's)."""
    if not name or name == "nvml":
        return None
    from phalanx.profiles import UnknownProfile, load_profile

    try:
        return load_profile(name)
    except (UnknownProfile, ValueError, OSError):
        return None
