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
- Health (health.py): before every heartbeat the HealthMonitor checks its source (NVML on a discovered host; the
  simulated source, fed by `<state_dir>/health.json` or `health_source.inject()`, on a simulated one); the
  heartbeat carries the node's health and the events since the last answered heartbeat (kept until one is).
- Host resources (host_resources.py): the registration says what ranks may use of the host, `cpus` and
  `memory_bytes` (the CPU affinity and MemTotal, capped by the agent's own cgroup; a simulated host's profile;
  `--host-cpus` / `--host-memory` override). A launch's `cpus` / `memory_bytes` are its replica's reservation: the
  attempt's container here gets a CPU quota and a memory limit of their sum over the attempt's replicas on this
  host (none when every replica asks 0). A rank that ends in failure after the container's OOM-kill count rose is
  reported `out of memory (limit <size>)`, its exit code kept (137 for the SIGKILL); each kill is told once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
from prometheus_client import Gauge

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2

from . import containment as cgroups
from . import host_resources, identity, launcher
from .health import HealthMonitor, NodeHealth, NvmlHealthSource, SimulatedHealthSource, event_to_proto, health_to_proto
from .mig_manager import MigBackend, MigError, MigManager, backend_for
from .mps import CONTROL as MPS_CONTROL
from .mps import MpsError, MpsManager, strip_mps, write_fake_control
from .state import AgentState, RankRecord, StateLock, attempt_key, default_state_dir, rank_key, safe_name

RANKS_RUNNING = Gauge("phalanx_agent_ranks_running", "Rank processes this node agent is running")
REPORTS_PENDING = Gauge("phalanx_agent_reports_pending", "Rank status reports not yet taken by the scheduler")

CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.enable_retries", 0),
]

# Report errors that retrying cannot fix; anything else (UNAVAILABLE, NOT_FOUND while the scheduler forgot the
# node, DEADLINE_EXCEEDED, ...) is retried with backoff.
_PERMANENT = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)

_STATE_ENUM = {
    "running": common_pb2.RANK_STATE_RUNNING,
    "exited": common_pb2.RANK_STATE_EXITED,
    "failed": common_pb2.RANK_STATE_FAILED_TO_START,
    "killed": common_pb2.RANK_STATE_KILLED,
    "lost": common_pb2.RANK_STATE_LOST,
}


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
    # its simulated library (phalanx.simhost.nvml), made from the topology when not given.
    nvml: Any = None
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


class _Reregister(Exception):
    """Register again at once (heartbeat said `reregister`)."""


class _StreamEnded(Exception):
    """The scheduler closed the assignment stream: reconnect after a backoff."""


def backoff_delay(attempt: int, initial: float, cap: float) -> float:
    """Exponential backoff with full jitter in [base/2, base], base = min(cap, initial * 2**attempt)."""
    base = min(cap, initial * (2 ** min(attempt, 30)))
    return random.uniform(base / 2, base)


class NodeAgent:
    def _open_channel(self) -> grpc.aio.Channel:
        from phalanx.client import open_aio_channel

        return open_aio_channel(self.scheduler, CHANNEL_OPTIONS, token=self.config.token, tls=self.config.tls)  # type: ignore[arg-type]

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.node_name = config.node_name
        # `--scheduler host1:port,host2:port`: the replicas, tried in turn (any replica takes an agent; see
        # docs/design.md, "Leadership"). A failed session moves on to the next address.
        self.schedulers = [t.strip() for t in config.scheduler.split(",") if t.strip()] or [config.scheduler]
        self._scheduler_index = 0
        self.instance = uuid.uuid4().hex
        self.state_dir = config.resolved_state_dir().resolve()
        self.state = AgentState.load(self.state_dir / "state.json", node_name=self.node_name)
        self.state.node_name = self.node_name
        self.log = structlog.get_logger(service="node-agent").bind(node=self.node_name, instance=self.instance[:8])
        self._lock = StateLock(self.state_dir)
        self._stop = asyncio.Event()
        self._connected = asyncio.Event()
        self._reports_changed = asyncio.Event()
        self._stub: agent_pb2_grpc.NodeServiceStub | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        self._monitors: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._reporter: asyncio.Task | None = None
        self._run_task: asyncio.Task | None = None
        self._releases: set[asyncio.Future] = set()  # MIG instance releases in worker threads
        self.nvml = config.nvml
        if self.nvml is None and config.topology.profile != "nvml" and config.mig_backend is None:
            # A simulated host (--simulate, tests): only then are the simulated libraries loaded.
            from phalanx.simhost.nvml import bind

            from .simulated import STATE_FILE, host_for_topology

            self.nvml = bind(host_for_topology(config.topology, self.state_dir / STATE_FILE))
        self.mig = MigManager(
            config.mig_backend or backend_for(config.topology, self.nvml),
            config.topology,
            created=self.state.mig_created,
            on_change=lambda records: setattr(self.state, "mig_created", records),
        )
        self._gpu_memory = {g.index: g.memory_mib for g in config.topology.gpus}
        self.host_resources = host_resources.resolve(
            _shipped_profile(config.topology.profile), config.host_cpus, config.host_memory
        )
        self._mig_switching: set[int] = set()  # GPUs whose MIG mode switch is under way
        self._mig_switch_errors: dict[int, str] = {}  # GPU -> why its last switch failed
        # Fractional shares: one MPS control daemon per GPU that has shares (mps.py).
        mps_control = config.mps_control or (
            MPS_CONTROL if config.topology.profile == "nvml" else write_fake_control(self.state_dir / "mps")
        )
        self.mps = MpsManager(
            self.state_dir / "mps", mps_control, {g.index: g.uuid for g in config.topology.gpus}, log=self.log
        )
        self._attempt = 0
        self.registrations = 0  # successful RegisterNode calls (for tests / introspection)
        self.logs_key = ""  # from the registration: the key log credentials are checked with (logs.py)
        self.logs_port = 0
        self._logs_server: Any = None  # services.common.server.AioServer, once serving
        self.heartbeat_interval_ms = config.default_heartbeat_ms
        # Health: the simulated source exists at once (tests inject into it); NVML's is opened in run().
        self.health_source = config.health_source
        if self.health_source is None and config.topology.profile != "nvml":
            self.health_source = SimulatedHealthSource(self.state_dir / "health.json")
        self.rank_user = identity.resolve_user(config.run_as) if config.run_as else identity.agent_user()
        if self.rank_user.uid != os.geteuid() and os.geteuid() != 0:
            raise ValueError(f"ranks can run as {self.rank_user.name!r} only when the agent runs as root")
        self.containment: cgroups.Containment | None = config.containment
        self._groups: dict[str, cgroups.Group] = {}  # attempt key -> its container on this host
        self._group_limits: dict[str, cgroups.Limits] = {}  # attempt key -> its container's limits (GPU devices,
        # CPU quota, memory), as last applied by this process
        # GPU index -> device minor (/dev/nvidia<minor>), the index where discovery did not say
        self._minors = {
            g.index: (g.minor_number if g.HasField("minor_number") else g.index) for g in config.topology.gpus
        }
        self._gpu_uuids = {g.index: g.uuid for g in config.topology.gpus}
        self._closing: dict[str, asyncio.Task] = {}  # attempt key -> the task that empties and removes it
        self._held_reports: dict[str, list[tuple[tuple, dict]]] = {}  # attempt key -> its last ranks' end reports
        # attempt key -> its ended ranks whose MIG instances / MPS shares wait for the container to be empty
        self._held_partials: dict[str, list[RankRecord]] = {}
        self._ports: dict[int, str] = {}  # MASTER_PORT -> the live attempt whose rank 0 here holds it
        self._attempt_users: dict[str, identity.RankUser] = {}  # attempt key -> its launch's user (run_as)
        # Self-fencing: when the last heartbeat the scheduler answered was sent (monotonic), the node lease it gave,
        # whether this agent fenced itself since (until it registers again), and after how long a silence it did.
        self._renewed_at: float | None = None
        self._lease_s = 0.0
        self.fenced = False
        self.fenced_after = 0.0
        self.health_monitor: HealthMonitor | None = None
        self.health = NodeHealth()
        self._health_events: list = []  # events not yet carried by an answered heartbeat

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
            await self._open_health()
            await self._open_logs()
            self._open_containment()
            self._adopt()
            self._clean_up_containers()
            if self.mig.mig_gpus():
                await asyncio.to_thread(self._clean_up_mig)
            self._reporter = asyncio.create_task(self._report_loop(), name="reporter")
            if self.mig.mig_gpus():
                self._spawn_task(self._log_mig_instances())
            fence = asyncio.create_task(self._fence_watch(), name="self-fence")
            try:
                await self._supervise()
            finally:
                fence.cancel()
            await self._announce_drain()
            await self._shutdown()
        finally:
            if self._logs_server is not None:
                await self._logs_server.stop(0.5)
            if self.health_monitor is not None:
                await asyncio.to_thread(self.health_monitor.close)
            await asyncio.to_thread(self.state.stop_writer)
            if self.containment is not None and not any(not r.final for r in self.state.ranks.values()):
                self.containment.close()
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
        tasks = [t for t in [self._run_task, self._reporter, *self._monitors.values(), *self._tasks] if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lock.release()

    # ---------------------------------------------------------------- connection

    @property
    def scheduler(self) -> str:
        """The scheduler address this agent uses now (one of `--scheduler`'s comma-separated list)."""
        return self.schedulers[self._scheduler_index]

    def _next_scheduler(self) -> bool:
        """Move on to the next scheduler address; True when that starts a new round through the list."""
        self._scheduler_index = (self._scheduler_index + 1) % len(self.schedulers)
        if len(self.schedulers) > 1:
            self.log.info("scheduler_failover", next=self.scheduler)
        return self._scheduler_index == 0

    async def _supervise(self) -> None:
        self._attempt = 0
        while not self._stop.is_set():
            try:
                await self._session()
                continue
            except _Reregister:
                self.log.info("reregistering")
                continue
            except _StreamEnded:
                self.log.warning("assignment_stream_ended", attempt=self._attempt)
            except grpc.aio.AioRpcError as exc:
                self.log.warning(
                    "scheduler_unreachable", code=exc.code().name, detail=exc.details(), attempt=self._attempt
                )
            except (OSError, grpc.RpcError) as exc:
                self.log.warning("scheduler_connection_error", error=str(exc), attempt=self._attempt)
            except Exception:  # a bug must not end the daemon; log it and reconnect
                self.log.exception("agent_session_error", attempt=self._attempt)
            if self._stop.is_set():
                break
            if self._next_scheduler() or len(self.schedulers) == 1:
                delay = backoff_delay(self._attempt, self.config.backoff_initial_s, self.config.backoff_cap_s)
                self._attempt += 1
            else:  # another replica not yet tried in this round: at once (after the shortest backoff)
                delay = backoff_delay(0, self.config.backoff_initial_s, self.config.backoff_cap_s)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=delay)
            except TimeoutError:
                pass

    async def _session(self) -> None:
        channel = self._open_channel()
        stub = agent_pb2_grpc.NodeServiceStub(channel)
        tasks: list[asyncio.Task] = []
        try:
            topology = await asyncio.to_thread(self._current_topology)
            sent = time.monotonic()
            resp = await stub.RegisterNode(
                agent_pb2.RegisterNodeRequest(
                    node_name=self.node_name,
                    topology=topology,
                    address=self.config.address,
                    agent_instance=self.instance,
                    mig_manage=self.config.mig_manage,
                    containment=self.containment.kind if self.containment else "",
                    confirms_release=True,
                    rank_port_low=self.config.rank_ports[0],
                    rank_port_high=self.config.rank_ports[1],
                    cpus=self.host_resources.cpus,
                    memory_bytes=self.host_resources.memory_bytes,
                    logs_port=self.logs_port,
                    live_attempts=sorted(
                        {attempt_key(r.job_id, r.attempt) for r in self.state.ranks.values() if not r.final}
                        | set(self._groups)
                        | set(self._closing)
                    ),
                ),
                timeout=self.config.rpc_timeout_s,
            )
            self.registrations += 1
            self.logs_key = resp.logs_key
            self._attempt = 0
            self._renewed_at, self._lease_s = sent, resp.lease_timeout_ms / 1000
            if self.fenced:
                self.log.info("fence_lifted", note="registered again; the scheduler has requeued the fenced gangs")
                self.fenced = False
            self.heartbeat_interval_ms = resp.heartbeat_interval_ms or self.config.default_heartbeat_ms
            self.log.info(
                "registered",
                scheduler=self.scheduler,
                heartbeat_ms=self.heartbeat_interval_ms,
                scheduler_acked=resp.acked_revision,
                local_acked=self.state.acked_revision,
                cluster_id=resp.cluster_id or "unknown",
            )
            # Heartbeats from now on: killing another ledger's ranks (_check_ledger) may take a kill grace period.
            tasks = [asyncio.create_task(self._heartbeat_loop(stub), name="heartbeat")]
            await self._check_ledger(resp)
            if resp.acked_revision < self.state.acked_revision:
                await stub.AckAssignments(
                    agent_pb2.AckAssignmentsRequest(node_name=self.node_name, revision=self.state.acked_revision),
                    timeout=self.config.rpc_timeout_s,
                )
            self._stub = stub
            self._connected.set()
            self._reports_changed.set()
            tasks += [
                asyncio.create_task(self._consume(stub), name="assignments"),
                asyncio.create_task(self._stop.wait(), name="stop"),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.get_name() != "stop" and t.exception() is not None:
                    raise t.exception()
            if not self._stop.is_set():
                raise _StreamEnded()
        finally:
            self._connected.clear()
            self._stub = None
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await channel.close(grace=None)

    # ---------------------------------------------------------------- ledger identity

    async def _check_ledger(self, resp: agent_pb2.RegisterNodeResponse) -> None:
        """Is the saved state this ledger's? Its revisions count in one ledger only: state of another one (a new
        database, the same node name) would make the agent skip every assignment of this one as already taken.

        Another ledger: the saved cluster id differs from the one the scheduler returned; or, whatever the ids, the
        saved acked revision is above the node's last revision in the ledger (the agent cannot have taken a revision
        the ledger never wrote), which also covers state that has no cluster id (written by an older agent).
        Either way the agent kills that state's ranks, forgets it and starts from revision 0. Then it keeps the
        ledger's id. A scheduler that sends no id (an older one) leaves everything as it was."""
        ledger_id, saved = resp.cluster_id, self.state.cluster_id
        ledger_revision = resp.revision if resp.HasField("revision") else None
        if ledger_id and saved and ledger_id != saved:
            self.log.warning(
                "agent_state_from_another_ledger",
                saved_cluster_id=saved,
                ledger_cluster_id=ledger_id,
                saved_acked_revision=self.state.acked_revision,
                ledger_revision=ledger_revision,
                ranks=len(self.state.ranks),
                state_file=str(self.state.path),
                action="killing its ranks and starting clean",
            )
            await self._start_clean(f"the node's state belongs to another ledger (cluster {saved}, now {ledger_id})")
        elif ledger_revision is not None and self.state.acked_revision > ledger_revision:
            self.log.warning(
                "agent_state_ahead_of_ledger",
                saved_cluster_id=saved or "unknown",
                ledger_cluster_id=ledger_id or "unknown",
                saved_acked_revision=self.state.acked_revision,
                ledger_revision=ledger_revision,
                ranks=len(self.state.ranks),
                state_file=str(self.state.path),
                action="killing its ranks and starting clean",
            )
            await self._start_clean(
                f"the node's saved state (revision {self.state.acked_revision}) is ahead of the "
                f"ledger (revision {ledger_revision}): stale"
            )
        if ledger_id and self.state.cluster_id != ledger_id:
            if not saved:
                self.log.info("ledger_identity_saved", cluster_id=ledger_id)
            self.state.cluster_id = ledger_id
            self.state.save()

    async def _start_clean(self, why: str) -> None:
        """Forget another ledger's state: its ranks are killed (adopted processes included) and settled without a
        report (that ledger is not this scheduler's), their status files removed, and the revision reset to 0. The
        rank logs stay. MIG instances and MPS daemons the killed ranks used are released as usual."""
        live = [r for r in self.state.ranks.values() if not r.final]
        if live:
            self.log.warning("killing_ranks_of_another_ledger", ranks=[r.key for r in live], reason=why)
            await asyncio.gather(*(self._kill_rank(r, why) for r in live), return_exceptions=True)
            monitors = [m for r in live if (m := self._monitors.get(r.key)) is not None]
            if monitors:
                await asyncio.wait(monitors, timeout=self.config.kill_grace_s + 2)
            for rec in live:
                if rec.final:
                    continue
                monitor = self._monitors.pop(rec.key, None)
                if monitor is not None:
                    monitor.cancel()
                self._procs.pop(rec.key, None)
                if self._alive(rec):
                    self.log.error("rank_of_another_ledger_survives", rank=rec.key, pid=rec.wrapper_pid)
                rec.state, rec.message = "lost", why
                self._release_partial(rec)
        for rec in self.state.ranks.values():
            if rec.status_file:
                Path(rec.status_file).unlink(missing_ok=True)
        dropped = len(self.state.pending_reports)
        forgotten = len(self.state.ranks)
        self.state.ranks.clear()
        self.state.killed_attempts.clear()
        self.state.pending_reports.clear()
        self.state.oom_seen.clear()
        self.state.acked_revision = 0
        self.state.save()
        REPORTS_PENDING.set(0)
        RANKS_RUNNING.set(0)
        self.log.warning(
            "agent_state_reset", reason=why, ranks_forgotten=forgotten, reports_dropped=dropped, acked_revision=0
        )

    # ---------------------------------------------------------------- MIG mode (--mig-manage)

    _MODES = {0: agent_pb2.GpuInfo.MIG_MODE_DISABLED, 1: agent_pb2.GpuInfo.MIG_MODE_ENABLED}

    def _mig_mode_status(self) -> list[agent_pb2.MigModeStatus]:
        """In a worker thread: every MIG-capable GPU's mode as NVML has it now, and the last switch's outcome."""
        out = []
        for gpu in self.mig.mig_gpus():
            status = agent_pb2.MigModeStatus(
                gpu=gpu, error=self._mig_switch_errors.get(gpu, ""), switching=gpu in self._mig_switching
            )
            try:
                current, pending = self.mig.backend.mode(gpu)
            except MigError as exc:
                status.error = status.error or str(exc)
                out.append(status)
                continue
            status.current, status.pending = self._MODES.get(current, 0), self._MODES.get(pending, 0)
            if current != pending:
                status.switching = True  # waits for a GPU reset
            self._note_mode(gpu, current)
            out.append(status)
        return out

    def _note_mode(self, gpu: int, current: int) -> None:
        """Keep the registered topology's mode of `gpu` what NVML says (a re-registration sends it)."""
        for g in self.config.topology.gpus:
            if g.index == gpu and current in self._MODES:
                g.mig_mode = self._MODES[current]

    async def _switch_mig_mode(self, req: agent_pb2.SetMigMode) -> None:
        """Switch a GPU's MIG mode when the scheduler asks (only under --mig-manage): reported in the next
        heartbeats as switching, then as the new current mode, or with the error."""
        gpu, enable = req.gpu, req.enable
        if not self.config.mig_manage:
            self._mig_switch_errors[gpu] = "this agent was not started with --mig-manage"
            self.log.warning("mig_mode_switch_refused", gpu=gpu, reason=self._mig_switch_errors[gpu])
            return
        busy = {g: r.key for r in self.state.ranks.values() if not r.final for g in r.gpus}
        self._mig_switching.add(gpu)
        self._mig_switch_errors.pop(gpu, None)
        self.log.info("mig_mode_switch", gpu=gpu, enable=enable, reason=req.reason)
        try:
            current, _ = await asyncio.to_thread(self.mig.switch_mode, gpu, enable, busy)
            self._note_mode(gpu, current)
        except MigError as exc:
            self._mig_switch_errors[gpu] = str(exc)
            self.log.warning("mig_mode_switch_failed", gpu=gpu, enable=enable, error=str(exc))
        finally:
            self._mig_switching.discard(gpu)

    def _clean_up_mig(self) -> None:
        """At start: destroy the MIG instances this agent made that no adopted rank uses (never anyone else's)."""
        destroyed = self.mig.clean_up()
        if destroyed:
            self.log.info("mig_leftovers_destroyed", instances=[f"GPU{g}:{s}+{n}" for g, s, n in destroyed])

    def _current_topology(self) -> agent_pb2.HostTopology:
        """The topology to register: the discovered one, with each MIG-mode GPU's instances as they are now, each
        marked `managed` when this agent made it for a rank (anything else is occupied by someone else)."""
        topo = agent_pb2.HostTopology()
        topo.CopyFrom(self.config.topology)
        if not self.mig.mig_gpus():
            return topo
        found = self.mig.describe()
        for g in topo.gpus:
            if g.mig_mode != agent_pb2.GpuInfo.MIG_MODE_ENABLED or g.index not in found:
                continue
            del g.mig_instances[:]
            for inst, managed in found[g.index]:
                g.mig_instances.add(
                    profile=inst.profile,
                    start=inst.start,
                    size=inst.size,
                    uuid=inst.uuid,
                    managed=managed,
                    gpu_instance_id=inst.gi_id,
                    compute_instance_id=inst.ci_id,
                )
        return topo

    async def _open_health(self) -> None:
        if not self.config.health_enabled:
            return
        if self.health_source is None:
            self.health_source = await asyncio.to_thread(NvmlHealthSource)
        self.health_monitor = HealthMonitor(
            self.health_source, len(self.config.topology.gpus), sbe_threshold=self.config.ecc_sbe_threshold
        )

    async def check_health(self) -> None:
        """Poll the health source once; new events queue for the next heartbeat."""
        if self.health_monitor is None:
            return
        try:
            health, events = await asyncio.to_thread(self.health_monitor.check)
        except Exception as exc:  # a broken monitor must not stop heartbeats
            self.log.warning("health_check_failed", error=repr(exc))
            return
        if health.signature() != self.health.signature():
            self.log.warning("health_changed", state=health.state, reason=health.reason, was=self.health.state)
        for e in events:
            self.log.info("health_event", gpu=e.gpu, severity=e.severity, kind=e.kind, code=e.code, reason=e.reason)
        self.health = health
        self._health_events += events

    async def _heartbeat_loop(self, stub) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_ms / 1000)
            await self.check_health()
            req = agent_pb2.HeartbeatRequest(node_name=self.node_name, agent_instance=self.instance)
            if self.config.mig_manage and self.mig.mig_gpus():
                req.mig_modes.extend(await asyncio.to_thread(self._mig_mode_status))
            sent = list(self._health_events)
            if self.health_monitor is not None:
                req.health.CopyFrom(health_to_proto(self.health))
                req.events.extend(event_to_proto(e) for e in sent)
            at = time.monotonic()
            resp = await stub.Heartbeat(req, timeout=self.config.rpc_timeout_s)
            if not resp.reregister:
                self._renewed_at = at
            del self._health_events[: len(sent)]
            if resp.reregister:
                raise _Reregister()

    async def _consume(self, stub) -> None:
        call = stub.StreamAssignments(
            agent_pb2.StreamAssignmentsRequest(node_name=self.node_name, after_revision=self.state.acked_revision)
        )
        async for assignment in call:
            if self._stop.is_set():
                return
            await self._take(stub, assignment)

    # ---------------------------------------------------------------- assignments

    async def _take(self, stub, a: agent_pb2.Assignment) -> None:
        kind = a.WhichOneof("action")
        if a.revision and a.revision <= self.state.acked_revision:
            # Applied already (revisions are applied in order and acked once on disk): a finished rank's record
            # may be gone, so a re-sent launch must not start it again.
            self.log.info("assignment_already_applied", revision=a.revision, action=kind)
            return
        started: list[RankRecord] = []
        if kind == "launch":
            started = self._prepare_launch(a.launch)
        elif kind == "kill":
            self._prepare_kill(a.kill)
        elif kind == "set_mig_mode":
            self._spawn_task(self._switch_mig_mode(a.set_mig_mode))
        else:
            self.log.warning("unknown_assignment", revision=a.revision)
        self.state.acked_revision = max(self.state.acked_revision, a.revision)
        self.state.save()  # durable before the ack
        await self._start(started, a.launch.command if kind == "launch" else [], a.launch if kind == "launch" else None)
        await self.state.durable()  # the launch's records and the revision are on disk before the ack
        if kind == "kill":
            self._spawn_task(
                self._stop_attempt(a.kill.job_id, a.kill.attempt, a.kill.reason or "killed by the scheduler")
            )
        await stub.AckAssignments(
            agent_pb2.AckAssignmentsRequest(node_name=self.node_name, revision=self.state.acked_revision),
            timeout=self.config.rpc_timeout_s,
        )
        self.log.info("assignment_acked", revision=a.revision, action=kind)

    def _prepare_launch(self, launch: agent_pb2.LaunchReplica) -> list[RankRecord]:
        new: list[RankRecord] = []
        if attempt_key(launch.job_id, launch.attempt) in self.state.killed_attempts:
            self.log.info("launch_of_killed_attempt_ignored", job_id=launch.job_id, attempt=launch.attempt)
            return new
        cpus = launch.cpus if math.isfinite(launch.cpus) and launch.cpus > 0 else 0.0
        memory = max(0, launch.memory_bytes)
        for r in launch.ranks:
            key = rank_key(launch.job_id, launch.attempt, r.rank)
            if key in self.state.ranks:
                self.log.info("rank_already_launched", job_id=launch.job_id, attempt=launch.attempt, rank=r.rank)
                continue
            status, log_file = launcher.rank_paths(self.state_dir, launch.job_id, launch.attempt, r.rank)
            rec = RankRecord(
                job_id=launch.job_id,
                attempt=launch.attempt,
                rank=r.rank,
                local_rank=r.local_rank,
                gpus=list(r.gpus),
                replica=launch.replica,
                status_file=str(status),
                log_file=str(log_file),
                slices=[{"gpu": s.gpu, "profile": s.profile, "start": s.start, "size": s.size} for s in r.slices],
                gpu_milli=r.gpu_milli,
                cpus=cpus,
                memory_bytes=memory,
            )
            self.state.ranks[key] = rec
            new.append(rec)
        return new

    def _master_port_problem(self, records: list[RankRecord], launch) -> str | None:
        """A launch with rank 0 here holds its MASTER_PORT for the attempt: None when it is free (now held), else
        why not (the ranks then fail to start, retryably: another host or later)."""
        rank0 = next((r for r in launch.ranks if r.rank == 0), None)
        if rank0 is None or not any(r.rank == 0 for r in records):
            return None
        value = rank0.env.get("MASTER_PORT") or launch.env.get("MASTER_PORT", "")
        if not value.isdigit():
            return None
        port, key = int(value), attempt_key(records[0].job_id, records[0].attempt)
        holder = self._ports.get(port)
        if holder not in (None, key):
            return f"MASTER_PORT {port} is held by attempt {holder} on this host"
        if holder is None:
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("", port))
                except OSError as exc:
                    return f"MASTER_PORT {port} is in use on this host ({exc.strerror or exc})"
            self._ports[port] = key
        return None

    async def _start(self, records: list[RankRecord], command, launch) -> None:
        if not records:
            return
        user = self._launch_user(records, launch)
        problem = user if isinstance(user, str) else self._master_port_problem(records, launch)
        if problem is not None:
            self.log.warning("rank_port_unavailable", job_id=records[0].job_id, why=problem)
            for rec in records:
                self._finish(rec, "failed", exit_code=127, message=f"cannot start: {problem}", retryable=True)
            return
        shared = dict(launch.env)
        envs = {r.rank: {**shared, **r.env} for r in launch.ranks}
        for rec in records:
            if rec.final:
                continue
            if not command:
                self._finish(rec, "failed", exit_code=127, message="empty command")
                continue
            try:
                env = await self._rank_env(rec, envs.get(rec.rank, {}))
            except MpsError as exc:  # the host's fault: the scheduler requeues the gang elsewhere or later
                self.log.warning("rank_mps_failed", rank=rec.key, error=str(exc))
                self._finish(
                    rec, "failed", exit_code=127, message=f"cannot start its GPU's MPS daemon: {exc}", retryable=True
                )
                continue
            except MigError as exc:  # the host's fault: requeued with backoff, this node struck
                self.log.warning("rank_mig_failed", rank=rec.key, error=str(exc))
                self._finish(
                    rec, "failed", exit_code=127, message=f"cannot set up its MIG instance: {exc}", retryable=True
                )
                self._roll_back_attempt(rec, records, f"rank {rec.rank}'s MIG instance could not be set up")
                continue
            except ValueError as exc:
                self.log.warning("rank_partial_gpu_failed", rank=rec.key, error=str(exc))
                self._finish(rec, "failed", exit_code=127, message=f"cannot set up its GPU: {exc}")
                continue
            except Exception as exc:  # e.g. an NVML binding without a MIG call: fail the rank only
                self.log.exception("rank_partial_gpu_error", rank=rec.key)
                self._finish(rec, "failed", exit_code=127, message=f"cannot set up its GPU: {exc!r}")
                continue
            if rec.final:  # killed while its MIG instances were being made: give them back
                self._release_partial(rec)
                continue
            if self._stop.is_set():
                self._finish(rec, "killed", message="node agent shutting down")  # releases its instances
                continue
            try:
                group = self._container(rec)
                work = self._work_dir(rec.job_id, rec.attempt)
                env = {**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
                if rec.gpus and not rec.slices and not rec.gpu_milli and all(g in self._gpu_uuids for g in rec.gpus):
                    # Whole GPUs by UUID: the same devices whatever order CUDA would enumerate them in.
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(self._gpu_uuids[g] for g in rec.gpus)
                user = self._user_of(rec)
                env = identity.rank_environment(user, str(work / "tmp"), {**env, **group.env()}, self.config.pass_env)
                if user.uid != os.geteuid():
                    self._checkpoint_dir_for(env, rec.job_id, user)
                proc = launcher.spawn_rank(
                    rec,
                    list(command),
                    env,
                    join=group.join_files(),
                    user=user.wrapper_arg if user.uid != os.geteuid() else None,
                    cwd=str(work),
                )
            except (OSError, cgroups.ContainmentError) as exc:
                self._finish(rec, "failed", exit_code=127, message=f"cannot start rank wrapper: {exc}")
                continue
            rec.wrapper_pid = proc.pid
            rec.wrapper_start = launcher.proc_start_time(proc.pid)
            self._procs[rec.key] = proc
            self.log.info("rank_spawned", job_id=rec.job_id, attempt=rec.attempt, rank=rec.rank, pid=proc.pid)
            self._monitors[rec.key] = asyncio.create_task(self._monitor(rec, proc), name=f"rank {rec.key}")
        self.state.save()

    async def _rank_env(self, rec: RankRecord, env: dict[str, str]) -> dict[str, str]:
        """The rank's environment, for a partial GPU once its MIG instances exist or its GPU's MPS daemon runs.
        Raises MigError/MpsError/ValueError. Only a share gets CUDA_MPS_* variables, the agent's own."""
        env = strip_mps(env)
        if rec.slices and rec.gpu_milli:
            raise ValueError("a rank gets MIG slices or a share of a GPU, not both")
        if rec.slices:
            busy = {
                g: r.key
                for r in self.state.ranks.values()
                if not r.final and not r.slices and r.key != rec.key
                for g in r.gpus
            }
            wanted = [{k: s[k] for k in ("gpu", "profile", "start", "size")} for s in rec.slices]
            fut = asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self.mig.acquire, rec.key, wanted, busy, wait_s=self.config.mig_wait_s)
            )
            self._releases.add(fut)
            fut.add_done_callback(self._releases.discard)
            try:
                acquired = await asyncio.shield(fut)
            except asyncio.CancelledError:
                # The agent is going away mid-acquisition: give the instances back once they are there.
                fut.add_done_callback(
                    lambda f: f.cancelled() or f.exception() is not None or self._release_slices(rec.key, f.result())
                )
                raise
            rec.slices = acquired
            self.state.save()
            self.log.info(
                "rank_mig_instances",
                rank=rec.key,
                instances=[f"GPU{s['gpu']}:{s['profile']}@{s['start']}={s['uuid']}" for s in acquired],
            )
            return launcher.mig_env(env, [s["uuid"] for s in acquired])
        if rec.gpu_milli:
            if len(rec.gpus) != 1:
                raise ValueError(f"a fractional rank needs exactly one GPU, got {list(rec.gpus)}")
            gpu = rec.gpus[0]
            if gpu not in self._gpu_memory:
                raise ValueError(f"GPU {gpu} does not exist on this host")
            share = launcher.fractional_env(env, gpu, rec.gpu_milli, self._gpu_memory[gpu])
            acquire = functools.partial(self.mps.acquire, rec.key, gpu, self._user_of(rec))
            mps_fut = asyncio.get_running_loop().run_in_executor(None, acquire)
            self._releases.add(mps_fut)
            mps_fut.add_done_callback(self._releases.discard)
            try:
                client = await asyncio.shield(mps_fut)
            except asyncio.CancelledError:
                mps_fut.add_done_callback(
                    lambda f: f.cancelled() or f.exception() is not None or self._release_mps(rec.key)
                )
                raise
            return {**share, **client}
        return env

    def _roll_back_attempt(self, failed: RankRecord, records: list[RankRecord], why: str) -> None:
        """A rank of this attempt could not be set up: its other ranks here give their MIG instances back at once
        (those not started yet are not started; those started are killed), so the attempt holds nothing."""
        for rec in records:
            if rec is failed or rec.final or (rec.job_id, rec.attempt) != (failed.job_id, failed.attempt):
                continue
            if rec.key in self._procs:
                self._spawn_task(self._kill_rank(rec, f"rolled back: {why}"))
            else:
                self._finish(rec, "failed", exit_code=127, message=f"not started: {why}", retryable=True)

    def _release_partial(self, rec: RankRecord) -> None:
        """Release the MIG instances of a rank that ended, or its share of its GPU's MPS daemon."""
        self._release_slices(rec.key, [dict(s) for s in rec.slices if s.get("uuid")])
        if rec.gpu_milli:
            self._release_mps(rec.key)

    def _release_mps(self, key: str) -> None:
        """In a worker thread: the GPU's MPS daemon is told to quit when this was its last share."""
        if not self.mps.holds(key):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.mps.release(key)
            return
        fut = loop.run_in_executor(None, self.mps.release, key)
        self._releases.add(fut)

        def done(f: asyncio.Future) -> None:
            self._releases.discard(f)
            if not f.cancelled() and f.exception() is not None:
                self.log.error("mps_release_error", rank=key, error=repr(f.exception()))

        fut.add_done_callback(done)

    def _release_slices(self, key: str, slices: list[dict]) -> None:
        """In a worker thread (NVML calls take a while); the instances no other rank uses are destroyed."""
        if not slices:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.mig.release(key, slices)
            return
        fut = loop.run_in_executor(None, self.mig.release, key, slices)
        self._releases.add(fut)

        def done(f: asyncio.Future) -> None:
            self._releases.discard(f)
            if not f.cancelled() and f.exception() is not None:
                self.log.error("mig_release_error", rank=key, error=repr(f.exception()))
            elif not f.cancelled() and f.result():
                self.state.save()  # the record of the instances this agent made (mig_created) shrank

        fut.add_done_callback(done)

    async def _log_mig_instances(self) -> None:
        try:
            found = await asyncio.to_thread(self.mig.describe)
        except Exception as exc:  # only a log line
            self.log.warning("mig_instances_unreadable", backend=self.mig.backend.kind, error=repr(exc))
            return
        self.log.info(
            "mig_instances",
            backend=self.mig.backend.kind,
            instances={
                f"GPU{g}": [
                    f"{i.profile}@{i.start}" + (f"={i.uuid}" if i.uuid else "") + ("" if ours else " (not ours)")
                    for i, ours in items
                ]
                for g, items in found.items()
            },
        )

    def _prepare_kill(self, kill: agent_pb2.KillJob) -> None:
        self.state.killed_attempts.add(attempt_key(kill.job_id, kill.attempt))
        for rec in self._ranks_of(kill.job_id, kill.attempt):
            rec.kill_requested = True

    def _ranks_of(self, job_id: str, attempt: int) -> list[RankRecord]:
        return [r for r in self.state.ranks.values() if r.job_id == job_id and r.attempt == attempt and not r.final]

    async def _open_logs(self) -> None:
        """Serve the ranks' logs (AgentLogs) and keep them bounded (logs.py)."""
        from services.common.server import AioServer

        from . import logs

        listen = self.config.logs_listen
        if listen != "off":
            listen = listen or f"{self.config.address}:0"
            servicer = logs.AgentLogsServicer(lambda: self.logs_key, self.state_dir, self._rank_live)
            try:
                server = AioServer(
                    listen,
                    [lambda s: agent_pb2_grpc.add_AgentLogsServicer_to_server(servicer, s)],
                    [logs.SERVICE_NAME],
                )
                await server.start()
            except Exception as exc:  # a port in use: the node serves no logs, and says so
                self.log.warning("logs_not_served", listen=listen, error=str(exc)[:300])
            else:
                self._logs_server, self.logs_port = server, server.port
                self.log.info("logs_served", address=server.address)
        if self.config.log_max_bytes > 0:
            self._spawn_task(self._rotate_logs())

    def _rank_live(self, job_id: str, attempt: int, rank: int) -> bool:
        return any(
            r.job_id == job_id and r.attempt == attempt and r.rank == rank and not r.final
            for r in list(self.state.ranks.values())
        )

    async def _rotate_logs(self) -> None:
        from . import logs

        while not self.stopping:
            paths = [Path(r.log_file) for r in list(self.state.ranks.values()) if not r.final and r.log_file]
            for path in paths:
                if await asyncio.to_thread(logs.rotate, path, self.config.log_max_bytes):
                    self.log.info("rank_log_rotated", path=str(path), max_bytes=self.config.log_max_bytes)
            await asyncio.sleep(1.0)

    def _spawn_task(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- self-fencing

    def fence_after_s(self) -> float:
        """How long without a renewal before the agent stops its ranks: early enough that they are gone (after
        --kill-grace) by the time the scheduler's lease on this node runs out and it requeues their gangs."""
        lease = self._lease_s
        return max(lease / 2, lease - self.config.kill_grace_s - 1.0)

    async def _fence_watch(self) -> None:
        """A node cut off from the scheduler stops its ranks before their gangs can run anywhere else: a
        partitioned node never runs a gang twice. --no-self-fence turns it off."""
        while True:
            await asyncio.sleep(max(0.05, min(0.5, self._lease_s / 20)))
            if not self.config.self_fence or self.fenced or self._renewed_at is None or self._lease_s <= 0:
                continue
            silent = time.monotonic() - self._renewed_at
            if silent <= self.fence_after_s():
                continue
            live = sorted({(r.job_id, r.attempt) for r in self.state.ranks.values() if not r.final})
            self.fenced, self.fenced_after = True, silent
            self.log.warning(
                "self_fenced",
                why=f"no heartbeat renewed for {silent:.1f}s of a {self._lease_s:g}s node lease: the scheduler "
                "will requeue this node's gangs, so their ranks here are stopped",
                attempts=[attempt_key(j, a) for j, a in live],
            )
            for job_id, attempt in live:
                self._spawn_task(self._stop_attempt(job_id, attempt, "the node fenced itself (scheduler unreachable)"))

    # ---------------------------------------------------------------- containment

    def _open_containment(self) -> None:
        if self.containment is None:
            # The default parent is named after the node and its state directory: agents of the same node name
            # with other state (tests, a host running several simulated nodes) never share containers.
            tag = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:8]
            self.containment = cgroups.detect(
                self.config.cgroup_parent,
                node_name=f"{safe_name(self.node_name)}-{tag}",
                force=self.config.containment_kind,
            )
        kind, reason = self.containment.kind, self.containment.reason
        if kind == "process-group":
            self.log.warning("containment", kind=kind, reason=reason, run_as=self.rank_user.name)
        else:
            self.log.info("containment", kind=kind, reason=reason, run_as=self.rank_user.name)

    def _clean_up_containers(self) -> None:
        """Containers a previous agent process left with no live rank of its own: emptied and removed."""
        assert self.containment is not None
        live = {self._group_name(r.job_id, r.attempt) for r in self.state.ranks.values() if not r.final}
        for name in self.containment.names():
            group = self.containment.open(name)
            if group is None:
                continue
            if name in live:
                key = self._attempt_of_group(name)
                job_id, _, attempt = key.rpartition("/")
                memory = self._attempt_limits(job_id, int(attempt))[1]
                if memory:  # what the scheduler reserved (the cgroup reads it back rounded to pages)
                    group.memory_limit = memory
                self._groups[key] = group
                continue
            self.log.info("container_left_over", container=name, processes=len(group.pids()))
            self._spawn_task(self._empty_and_remove(group, "left by an earlier agent process"))

    @staticmethod
    def _group_name(job_id: str, attempt: int) -> str:
        return f"{safe_name(job_id)}-a{attempt}"

    def _attempt_of_group(self, name: str) -> str:
        for r in self.state.ranks.values():
            if self._group_name(r.job_id, r.attempt) == name:
                return attempt_key(r.job_id, r.attempt)
        return name

    def _work_dir(self, job_id: str, attempt: int) -> Path:
        return self.state_dir / "work" / self._group_name(job_id, attempt)

    def _container(self, rec: RankRecord) -> cgroups.Group:
        """The container of the rank's attempt (created with its working and temporary directories). Its device
        rules let it open the GPUs of the attempt's ranks on this host (and the control devices), and of the
        nvidia-caps only its own MIG instances' capabilities, no other; its CPU
        quota and memory limit are the sums of the reservations of the attempt's replicas here (_attempt_limits).
        Updated in place when another replica of the attempt lands here."""
        key = attempt_key(rec.job_id, rec.attempt)
        minors = tuple(
            sorted(
                {
                    self._minors.get(g, g)
                    for r in self.state.ranks.values()
                    if r.attempt == rec.attempt and r.job_id == rec.job_id
                    for g in r.gpus
                }
            )
        )
        instances = sorted(
            {
                (int(sl["gpu"]), int(sl.get("gi_id", -1)), int(sl.get("ci_id", -1)))
                for r in self.state.ranks.values()
                if r.attempt == rec.attempt and r.job_id == rec.job_id
                for sl in r.slices
                if sl.get("uuid")
            }
        )
        caps = cgroups.nvidia_cap_minors(instances, self.config.mig_minors_file) if instances else ()
        cpus, memory = self._attempt_limits(rec.job_id, rec.attempt)
        limits = cgroups.Limits(
            memory_bytes=memory, cpus=cpus, pids_max=self.config.pids_max, gpu_minors=minors, cap_minors=caps
        )
        group = self._groups.get(key)
        if group is None or self._group_limits.get(key) != limits:
            assert self.containment is not None
            group = self.containment.create(self._group_name(rec.job_id, rec.attempt), limits)
            if (cpus or memory) and not self.containment.limits_enforced:
                self.log.warning(
                    "container_limits_not_enforced",
                    container=group.name,
                    kind=self.containment.kind,
                    cpus=cpus,
                    memory=cgroups.format_size(memory) if memory else "no limit",
                )
            elif cpus or memory:
                self.log.info(
                    "container_limits",
                    container=group.name,
                    cpus=cpus or "no limit",
                    memory=cgroups.format_size(memory) if memory else "no limit",
                )
            self._group_limits[key] = limits
        fresh = key not in self._groups
        self._groups[key] = group  # a new group object after an update: it knows the new memory limit
        if fresh:
            root = self.state_dir / "work"
            root.mkdir(exist_ok=True)
            root.chmod(0o711)  # the ranks' users reach their own directories, and list nobody else's
            user = self._user_of(rec)
            work = identity.make_owned_dir(self._work_dir(rec.job_id, rec.attempt), user)
            identity.make_owned_dir(work / "tmp", user)
        return group

    def _attempt_limits(self, job_id: str, attempt: int) -> tuple[float, int]:
        """(CPUs, memory bytes) the attempt's container here is limited to: the sum of its replicas' reservations on
        this host (each replica counted once, whatever its number of ranks); 0 where none asks."""
        replicas: dict[int, tuple[float, int]] = {}
        for r in self.state.ranks.values():
            if r.job_id == job_id and r.attempt == attempt:
                replicas.setdefault(r.replica, (r.cpus, r.memory_bytes))
        cpus = round(sum(c for c, _ in replicas.values()), 3)
        return cpus, sum(m for _, m in replicas.values())

    def _out_of_memory(self, rec: RankRecord) -> str:
        """`out of memory (limit 512M)` when the attempt's container here has a memory limit and its OOM killer
        killed a process that no earlier report told (each kill is told once), else ""."""
        key = attempt_key(rec.job_id, rec.attempt)
        group = self._groups.get(key)
        if group is None and self.containment is not None:
            try:
                group = self.containment.open(self._group_name(rec.job_id, rec.attempt))
            except (OSError, ValueError, cgroups.ContainmentError):
                group = None
        if group is None or not group.memory_limit:
            return ""
        try:
            kills = group.oom_kills()
        except (OSError, ValueError):
            return ""
        seen = self.state.oom_seen.get(key, 0)
        if kills <= seen:
            return ""
        self.state.oom_seen[key] = seen + 1
        limit = self._attempt_limits(rec.job_id, rec.attempt)[1] or group.memory_limit
        return f"out of memory (limit {cgroups.format_size(limit)})"

    @staticmethod
    def _checkpoint_dir_for(env: dict[str, str], job_id: str, user: identity.RankUser) -> None:
        """The job's checkpoint directory (PHALANX_CHECKPOINT_DIR/<job>) exists and is the ranks' user's."""
        root = env.get("PHALANX_CHECKPOINT_DIR")
        if root and not os.path.isdir(root) and os.path.isdir(os.path.dirname(root.rstrip("/"))):
            with contextlib.suppress(OSError):  # a tenant's directory under the store's root (<root>/<tenant>)
                os.mkdir(root, 0o711)
        if root and os.path.isdir(root):
            identity.make_owned_dir(Path(root) / job_id, user, 0o750)

    def _user_of(self, rec: RankRecord) -> identity.RankUser:
        return self._attempt_users.get(attempt_key(rec.job_id, rec.attempt), self.rank_user)

    def _launch_user(self, records: list[RankRecord], launch) -> identity.RankUser | str:
        """The ranks' user: the launch's (its tenant's unix_user), else --run-as; a string says why not."""
        if launch is None or not launch.run_as:
            return self.rank_user
        try:
            user = identity.resolve_user(launch.run_as)
        except ValueError as exc:
            return str(exc)
        if user.uid != os.geteuid() and os.geteuid() != 0:
            return f"this agent does not run as root, so it cannot run ranks as {user.name!r}"
        self._attempt_users[attempt_key(records[0].job_id, records[0].attempt)] = user
        return user

    def _attempt_ended(self, rec: RankRecord) -> None:
        """Once every rank of an attempt on this host has ended, its container is emptied and removed; then the
        scheduler hears that the attempt's GPUs here are free (AttemptReleased)."""
        key = attempt_key(rec.job_id, rec.attempt)
        if key in self._closing or self._ranks_of(rec.job_id, rec.attempt):
            return
        if key not in self._groups:  # it never had a process here (nothing started)
            self._queue_release(rec.job_id, rec.attempt)
            return
        task = asyncio.create_task(self._close_attempt(rec.job_id, rec.attempt), name=f"close {key}")
        self._closing[key] = task
        task.add_done_callback(functools.partial(self._closed, key))

    def _closed(self, key: str, _task: asyncio.Task) -> None:
        self._closing.pop(key, None)

    async def _close_attempt(self, job_id: str, attempt: int) -> None:
        """Empty and remove the attempt's container; only once it is empty (the kernel's `populated 0` on cgroup
        v2) do its MIG instances and MPS shares go back and does the scheduler hear AttemptReleased. A container
        that will not empty (a process stuck in the kernel) is tried again and again: its GPUs stay releasing."""
        key = attempt_key(job_id, attempt)
        group = self._groups.get(key)
        if group is not None:
            tries = 0
            while not await self._empty_and_remove(group, "its attempt ended" if not tries else "still not empty"):
                tries += 1
                self.log.warning("container_not_empty", container=group.name, tries=tries, held="gpus, instances")
                await asyncio.sleep(min(30.0, self.config.kill_grace_s * tries + 1.0))
            self._groups.pop(key, None)
            self._group_limits.pop(key, None)
        for rec in self._held_partials.pop(key, []):
            self._release_partial(rec)
        await asyncio.to_thread(shutil.rmtree, self._work_dir(job_id, attempt), True)
        for args in self._held_reports.pop(key, []):  # the last ranks' ends, held until the container was empty
            self._report(*args[0], **args[1])
        self._queue_release(job_id, attempt)

    def _forget_attempt(self, key: str) -> None:
        self._attempt_users.pop(key, None)
        self.state.oom_seen.pop(key, None)
        for port in [p for p, holder in self._ports.items() if holder == key]:
            del self._ports[port]

    def _queue_release(self, job_id: str, attempt: int) -> None:
        """Tell the scheduler (after every report queued before it) that no process of the attempt is left here."""
        self._forget_attempt(attempt_key(job_id, attempt))
        self.state.pending_reports.append({"kind": "released", "job_id": job_id, "attempt": attempt})
        self.state.save()
        self._reports_changed.set()

    async def _empty_and_remove(self, group: cgroups.Group, why: str) -> bool:
        """SIGTERM everything left in the container, SIGKILL what outlives --kill-grace, then remove it. True when
        it is empty (and removed, or left as an empty directory that could not be removed)."""
        poll = self.config.poll_interval_s
        if not group.empty():
            self.log.info("container_stopping", container=group.name, why=why, processes=len(group.pids()))
            group.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.config.kill_grace_s
            while not group.empty() and time.monotonic() < deadline:
                await asyncio.sleep(poll)
        if not group.empty():
            self.log.warning("container_sigkill", container=group.name, processes=len(group.pids()))
            await asyncio.to_thread(group.kill)
            deadline = time.monotonic() + 10.0
            while not group.empty() and time.monotonic() < deadline:
                await asyncio.sleep(poll)
        if not group.empty():
            self.log.error("container_not_emptied", container=group.name, processes=sorted(group.pids()))
            return False
        try:
            await asyncio.to_thread(group.remove)
        except cgroups.ContainmentError as exc:
            self.log.error("container_not_removed", container=group.name, error=str(exc))
            return group.empty()
        return True

    async def _stop_attempt(self, job_id: str, attempt: int, reason: str) -> None:
        """A kill of the whole attempt: every process of its container (daemons of its ranks included) gets
        SIGTERM, what outlives --kill-grace SIGKILL; its ranks end KILLED."""
        ranks = self._ranks_of(job_id, attempt)
        for rec in ranks:
            rec.kill_requested = True
        self.state.save()
        group = self._groups.get(attempt_key(job_id, attempt))
        if group is None:
            for rec in ranks:
                self._spawn_task(self._kill_rank(rec, reason))
            return
        self.log.info("killing_attempt", job_id=job_id, attempt=attempt, reason=reason, ranks=len(ranks))
        await self._empty_and_remove(group, reason)
        for rec in ranks:  # a rank with no monitor (never started) is settled here
            if not rec.final and rec.key not in self._monitors:
                self._finish(rec, "killed", message=reason)

    # ---------------------------------------------------------------- ranks

    def _alive(self, rec: RankRecord) -> bool:
        proc = self._procs.get(rec.key)
        if proc is not None:
            return proc.poll() is None
        return launcher.pid_alive(rec.wrapper_pid, rec.wrapper_start)

    async def _monitor(self, rec: RankRecord, proc: subprocess.Popen | None, adopted: bool = False) -> None:
        poll = self.config.poll_interval_s
        if not adopted:
            deadline = time.monotonic() + self.config.start_timeout_s
            while True:
                st = launcher.read_status(rec.status_file)
                if st and st.get("state") in ("running", "exited"):
                    rec.child_pid = int(st.get("child_pid", 0))
                    rec.state = "running"
                    self.state.save()
                    self._report(rec, "running", message="started")
                    break
                if st and st.get("state") == "failed":
                    self._wait_gone(rec)
                    self._finish(rec, "failed", exit_code=127, message=st.get("error", "could not start"))
                    return
                if not self._alive(rec):
                    st = launcher.read_status(rec.status_file)
                    if st:
                        continue
                    rc = proc.returncode if proc is not None else -1
                    if rec.kill_requested:
                        self._finish(
                            rec,
                            "killed",
                            exit_code=launcher.exit_code_from_returncode(rc),
                            message="killed before it started",
                        )
                    else:
                        self._finish(
                            rec,
                            "failed",
                            exit_code=launcher.exit_code_from_returncode(rc),
                            message=f"rank wrapper exited with {rc} before starting the command",
                        )
                    return
                if time.monotonic() > deadline:
                    self.log.warning("rank_start_slow", rank=rec.key)
                    deadline = float("inf")
                await asyncio.sleep(poll)
        while self._alive(rec):
            await asyncio.sleep(poll)
        self._procs.pop(rec.key, None)
        st = launcher.read_status(rec.status_file) or {}
        if st.get("state") == "exited":
            code = int(st.get("exit_code", 0))
        elif proc is not None and proc.returncode is not None:
            code = launcher.exit_code_from_returncode(proc.returncode)
        else:
            code = None
        if rec.kill_requested:
            self._finish(rec, "killed", exit_code=code or 0, message="killed")
        elif code is not None:
            oom = self._out_of_memory(rec) if code else ""
            self._finish(rec, "exited", exit_code=code, message=oom or f"exited with code {code}")
        else:
            self._finish(
                rec, "lost", message=self._out_of_memory(rec) or "the rank process is gone and left no exit status"
            )

    def _wait_gone(self, rec: RankRecord) -> None:
        proc = self._procs.pop(rec.key, None)
        if proc is not None:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass

    async def _kill_rank(self, rec: RankRecord, reason: str) -> None:
        if rec.final:
            return
        rec.kill_requested = True
        self.state.save()
        self.log.info("killing_rank", rank=rec.key, reason=reason, pid=rec.wrapper_pid)
        if rec.wrapper_pid and self._alive(rec):
            launcher.signal_group(rec.wrapper_pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.kill_grace_s
        while not rec.final and self._alive(rec) and time.monotonic() < deadline:
            await asyncio.sleep(self.config.poll_interval_s)
        if not rec.final and rec.wrapper_pid and self._alive(rec):
            self.log.warning("rank_sigkill", rank=rec.key)
            launcher.signal_group(rec.wrapper_pid, signal.SIGKILL)
        monitor = self._monitors.get(rec.key)
        if monitor is None and not rec.final:
            # Nothing watches it (e.g. still "starting" with no process): settle it here.
            while rec.wrapper_pid and self._alive(rec):
                await asyncio.sleep(self.config.poll_interval_s)
            self._finish(rec, "killed", message=reason)

    def _finish(
        self, rec: RankRecord, state: str, exit_code: int = 0, message: str = "", retryable: bool = False
    ) -> None:
        if rec.final:
            return
        rec.state, rec.exit_code, rec.message, rec.retryable = state, exit_code, message, retryable
        self._monitors.pop(rec.key, None)
        self._procs.pop(rec.key, None)
        self.log.info("rank_finished", rank=rec.key, state=state, exit_code=exit_code, message=message)
        key = attempt_key(rec.job_id, rec.attempt)
        if key in self._groups and not self._ranks_of(rec.job_id, rec.attempt):
            # The attempt's last rank here: its end is reported once the container is empty, so that when the
            # scheduler sees every rank of the attempt ended here, nothing of it runs here any more.
            self._held_reports.setdefault(key, []).append(
                ((rec, state), dict(exit_code=exit_code, message=message, retryable=retryable))
            )
        else:
            self._report(rec, state, exit_code=exit_code, message=message, retryable=retryable)
        if key in self._groups or key in self._closing:
            # Its MIG instances / MPS share go back once the attempt's container is empty (_close_attempt): a
            # process the rank left may still use them, and the next attempt must not get them meanwhile.
            self._held_partials.setdefault(key, []).append(rec)
            if rec.slices:
                self.mig.mark_ending(rec.key)
        else:
            self._release_partial(rec)
        self._attempt_ended(rec)

    def _report(
        self, rec: RankRecord, state: str, exit_code: int = 0, message: str = "", retryable: bool = False
    ) -> None:
        self.state.pending_reports.append(
            {
                "job_id": rec.job_id,
                "attempt": rec.attempt,
                "rank": rec.rank,
                "state": state,
                "exit_code": exit_code,
                "message": message,
                "pid": rec.child_pid or rec.wrapper_pid,
                "retryable": retryable,
            }
        )
        self.state.save()
        REPORTS_PENDING.set(len(self.state.pending_reports))
        RANKS_RUNNING.set(sum(1 for r in self.state.ranks.values() if r.state == "running"))
        self._reports_changed.set()

    def _adopt(self) -> None:
        """Take over ranks left by a previous agent process: adopt live ones, settle the dead ones."""
        # First the MIG instances live ranks use, so settling a dead rank never destroys an instance in use.
        for rec in self.state.ranks.values():
            if not rec.final and rec.slices and self._wrapper_survived(rec):
                self.mig.adopt(rec.key, [s for s in rec.slices if s.get("uuid")])
            if not rec.final and rec.gpu_milli and len(rec.gpus) == 1 and self._wrapper_survived(rec):
                self.mps.adopt(rec.key, rec.gpus[0])  # its GPU's MPS daemon: kept, not started again
        for rec in list(self.state.ranks.values()):
            if rec.final:
                continue
            st = launcher.read_status(rec.status_file) or {}
            if not rec.wrapper_pid and st.get("wrapper_pid"):
                rec.wrapper_pid = int(st["wrapper_pid"])
                rec.wrapper_start = launcher.proc_start_time(rec.wrapper_pid)
            if rec.wrapper_pid and launcher.pid_alive(rec.wrapper_pid, rec.wrapper_start):
                rec.child_pid = rec.child_pid or int(st.get("child_pid", 0))
                was_running = rec.state == "running"
                rec.state = "running"
                self.log.info("rank_adopted", rank=rec.key, pid=rec.wrapper_pid)
                if not was_running:
                    self._report(rec, "running", message="adopted by a restarted agent")
                self._monitors[rec.key] = asyncio.create_task(self._monitor(rec, None, adopted=True))
                if rec.kill_requested or attempt_key(rec.job_id, rec.attempt) in self.state.killed_attempts:
                    self._spawn_task(self._kill_rank(rec, "kill requested before the agent restarted"))
            elif st.get("state") == "exited":
                code = int(st.get("exit_code", 0))
                if rec.kill_requested:
                    self._finish(rec, "killed", exit_code=code, message="killed")
                else:
                    oom = self._out_of_memory(rec) if code else ""
                    self._finish(
                        rec,
                        "exited",
                        exit_code=code,
                        message=oom or f"exited with code {code} while the agent was down",
                    )
            elif st.get("state") == "failed":
                self._finish(rec, "failed", exit_code=127, message=st.get("error", "could not start"))
            elif rec.kill_requested:
                self._finish(rec, "killed", message="killed")
            else:
                self._finish(rec, "lost", message="rank process gone after an agent restart, no exit status")
        self.state.save()
        # MPS daemons the previous agent left on GPUs that no live share uses any more: stopped (a worker thread).
        fut = asyncio.get_running_loop().run_in_executor(None, self.mps.stop_unused)
        self._releases.add(fut)

        def stopped(f: asyncio.Future) -> None:
            self._releases.discard(f)
            if not f.cancelled() and f.exception() is not None:
                self.log.error("mps_cleanup_error", error=repr(f.exception()))

        fut.add_done_callback(stopped)

    @staticmethod
    def _wrapper_survived(rec: RankRecord) -> bool:
        """Whether a rank's wrapper from a previous agent process still runs (the test _adopt makes)."""
        if rec.wrapper_pid:
            return launcher.pid_alive(rec.wrapper_pid, rec.wrapper_start)
        pid = int((launcher.read_status(rec.status_file) or {}).get("wrapper_pid", 0))
        return bool(pid) and launcher.pid_alive(pid, launcher.proc_start_time(pid))

    # ---------------------------------------------------------------- reports

    async def _report_loop(self) -> None:
        attempt = 0
        while True:
            if not self.state.pending_reports:
                self._reports_changed.clear()
                await self._reports_changed.wait()
                continue
            stub = self._stub
            if stub is None:
                await self._connected.wait()
                continue
            item = self.state.pending_reports[0]
            released = item.get("kind") == "released"
            what = (
                f"{item['job_id']}/{item['attempt']} released"
                if released
                else rank_key(item["job_id"], item["attempt"], item["rank"])
            )
            try:
                if released:
                    resp = await stub.ReportAttemptReleased(
                        agent_pb2.ReportAttemptReleasedRequest(
                            node_name=self.node_name,
                            agent_instance=self.instance,
                            job_id=item["job_id"],
                            attempt=item["attempt"],
                        ),
                        timeout=self.config.rpc_timeout_s,
                    )
                else:
                    resp = await stub.ReportRankStatus(
                        agent_pb2.ReportRankStatusRequest(
                            node_name=self.node_name,
                            job_id=item["job_id"],
                            attempt=item["attempt"],
                            rank=item["rank"],
                            state=_STATE_ENUM[item["state"]],
                            exit_code=item["exit_code"],
                            message=item["message"],
                            pid=item["pid"],
                            retryable=bool(item.get("retryable", False)),
                            agent_instance=self.instance,
                        ),
                        timeout=self.config.rpc_timeout_s,
                    )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _PERMANENT:
                    # Retrying cannot help (e.g. the scheduler has no such rank on this node): drop it, say so.
                    self.log.warning(
                        "report_rejected",
                        rank=what,
                        state=item.get("state", "released"),
                        code=exc.code().name,
                        detail=exc.details(),
                    )
                    if self.state.pending_reports and self.state.pending_reports[0] is item:
                        self.state.pending_reports.pop(0)
                        self.state.save()
                    continue
                self.log.info("report_retry", rank=what, error=exc.code().name, attempt=attempt)
                await asyncio.sleep(backoff_delay(attempt, self.config.backoff_initial_s, self.config.backoff_cap_s))
                attempt += 1
                continue
            except Exception as exc:  # any other failure: keep the report and retry
                self.log.info("report_retry", rank=what, error=repr(exc), attempt=attempt)
                await asyncio.sleep(backoff_delay(attempt, self.config.backoff_initial_s, self.config.backoff_cap_s))
                attempt += 1
                continue
            attempt = 0
            if self.state.pending_reports and self.state.pending_reports[0] is item:
                self.state.pending_reports.pop(0)
                if not released and item["state"] != "running":  # its last report: the scheduler has its end
                    self.state.forget(rank_key(item["job_id"], item["attempt"], item["rank"]))
                self.state.save()
                REPORTS_PENDING.set(len(self.state.pending_reports))
            if not released and resp.stale:
                rec = self.state.ranks.get(rank_key(item["job_id"], item["attempt"], item["rank"]))
                if rec is not None and not rec.final:
                    self.log.info("stale_rank", rank=rec.key)
                    self.state.killed_attempts.add(attempt_key(rec.job_id, rec.attempt))
                    self._spawn_task(self._kill_rank(rec, "attempt superseded (stale)"))

    # ---------------------------------------------------------------- shutdown

    async def _announce_drain(self) -> None:
        """Tell the scheduler this node takes no more work (a heartbeat with `draining`), best effort."""
        if self.registrations == 0:
            return
        channel = self._open_channel()
        try:
            req = agent_pb2.HeartbeatRequest(node_name=self.node_name, agent_instance=self.instance, draining=True)
            if self.health_monitor is not None:
                req.health.CopyFrom(health_to_proto(self.health))
            await agent_pb2_grpc.NodeServiceStub(channel).Heartbeat(req, timeout=min(2.0, self.config.rpc_timeout_s))
            self.log.info("drain_announced")
        except Exception as exc:  # the lease covers a scheduler we cannot reach
            self.log.warning("drain_not_announced", error=repr(exc)[:200])
        finally:
            await channel.close(grace=None)

    async def _shutdown(self) -> None:
        live = [r for r in self.state.ranks.values() if not r.final]
        self.log.info("agent_shutting_down", live_ranks=len(live), pending_reports=len(self.state.pending_reports))
        attempts = sorted({(r.job_id, r.attempt) for r in live})
        kills = [asyncio.create_task(self._stop_attempt(j, a, "node agent shutting down")) for j, a in attempts]
        if kills:
            await asyncio.gather(*kills, return_exceptions=True)
        monitors = list(self._monitors.values())
        if monitors:
            await asyncio.wait(monitors, timeout=self.config.kill_grace_s + 2)
        await asyncio.sleep(0)  # the last monitors' _finish queue their attempts' closing
        closing = list(self._closing.values())
        if closing:
            await asyncio.wait(closing, timeout=self.config.kill_grace_s + 12)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # MIG acquisitions and releases in flight
            await asyncio.sleep(0)  # done-callbacks first: a finished acquisition may queue its release
            pending = [f for f in self._releases if not f.done()]
            if not pending:
                break
            await asyncio.wait(pending, timeout=max(0.01, deadline - time.monotonic()))
        for t in list(self._tasks):
            t.cancel()
        if self.state.pending_reports:
            channel = self._open_channel()
            self._stub = agent_pb2_grpc.NodeServiceStub(channel)
            self._connected.set()
            # A fresh reporter on the new channel: the old one may sit in a call on the old channel (until its RPC
            # timeout) or in a retry backoff, either as long as the whole flush. A report it had in flight stays
            # pending until answered, so at worst it is sent twice (the scheduler takes a repeat as a no-op).
            if self._reporter is not None:
                self._reporter.cancel()
                await asyncio.gather(self._reporter, return_exceptions=True)
            self._reporter = asyncio.create_task(self._report_loop(), name="reporter")
            self._reports_changed.set()
            deadline = time.monotonic() + self.config.flush_timeout_s
            while self.state.pending_reports and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            self._stub = None
            await channel.close(grace=None)
            if self.state.pending_reports:
                self.log.warning(
                    "reports_unsent",
                    count=len(self.state.pending_reports),
                    note="kept in the state file; sent by the next agent start",
                )
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.gather(self._reporter, return_exceptions=True)
        self.state.save()


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
