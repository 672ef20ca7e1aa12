"""A lightweight node agent that speaks the real node protocol but runs no processes.

Benchmarks and scheduler tests use it to stand in for hundreds of hosts in one process. The rank "program" is
read from the job's command:
- `sleep S`   : ranks report RUNNING, then EXITED 0 after S seconds;
- `exit C`    : ranks report RUNNING, then EXITED with code C;
- `hang`      : ranks never start (the launch deadline must catch it);
- anything else: ranks run until killed.

`mig_gpus` are the GPUs it registers in MIG mode (MIG_MODE_ENABLED; the others DISABLED on a MIG-capable model),
`mig_instances` the MIG instances it reports per GPU. `setup_failure` (a message) makes every rank it is given report
FAILED_TO_START with `retryable` set, as a real agent does when it cannot create a MIG instance or start MPS;
`start_failure` the same without `retryable` (the job's own fault, e.g. a missing binary).

It runs no readiness probe: a test says when the leader is ready with `report_readiness(job_id, attempt, ready)`
(ReportReadiness, as the leader's real agent reports each change of its probe).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import grpc

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from phalanx.core import mig


def simple_topology(
    gpus: int,
    model: str = "NVIDIA H100 80GB HBM3",
    memory_mib: int = 81559,
    mig_gpus: Iterable[int] = (),
    mig_instances: Mapping[int, Iterable[agent_pb2.GpuInfo.MigInstance]] | None = None,
) -> agent_pb2.HostTopology:
    """`mig_gpus`: GPUs in MIG mode (MIG_MODE_ENABLED); the others report DISABLED when the model has MIG, else
    UNSUPPORTED. `mig_instances`: per GPU, the MIG instances present."""
    enabled = set(mig_gpus)
    capable = mig.mig_family(model, memory_mib) is not None
    topo = agent_pb2.HostTopology(
        profile="lite",
        gpus=[
            agent_pb2.GpuInfo(
                index=i,
                uuid=f"GPU-lite-{uuid.uuid4().hex[:12]}",
                name=model,
                memory_mib=memory_mib,
                numa_node=i // 4,
                nic=f"NIC{i}",
                mig_mode=(
                    agent_pb2.GpuInfo.MIG_MODE_ENABLED
                    if i in enabled
                    else agent_pb2.GpuInfo.MIG_MODE_DISABLED
                    if capable
                    else agent_pb2.GpuInfo.MIG_MODE_UNSUPPORTED
                ),
            )
            for i in range(gpus)
        ],
    )
    for i, instances in (mig_instances or {}).items():
        topo.gpus[i].mig_instances.extend(instances)
    return topo


@dataclass
class LiteAgent:
    target: str
    name: str
    gpus: int = 8
    address: str = "127.0.0.1"
    model: str = "NVIDIA H100 80GB HBM3"
    memory_mib: int = 81559
    # NVML fabric info of a multi-node NVLink domain (GB200 NVL72): the agent reports it at registration.
    fabric_cluster_uuid: str = ""
    fabric_clique: str = ""
    launched: list[agent_pb2.LaunchReplica] = field(default_factory=list)
    killed: list[agent_pb2.KillJob] = field(default_factory=list)
    running: dict[tuple[str, int, int], asyncio.Task] = field(default_factory=dict)
    by_attempt: dict[tuple[str, int], dict[int, asyncio.Task]] = field(default_factory=dict)
    acked: int = 0
    # Acks only tell the scheduler where to resume a stream after a reconnect (this agent resumes from its own
    # record), so a burst of assignments is acknowledged once, after this delay.
    ack_delay: float = 0.2
    token: str = ""  # its credential (role `node`) when the scheduler runs with authentication
    mig_gpus: tuple[int, ...] = ()  # GPUs registered in MIG mode
    mig_instances: dict[int, list[agent_pb2.GpuInfo.MigInstance]] = field(default_factory=dict)
    setup_failure: str = ""  # non-empty: every rank reports FAILED_TO_START, retryable, with this message
    start_failure: str = ""  # non-empty: every rank reports FAILED_TO_START, not retryable
    # A channel shared with other agents (benchmarks run thousands in one process); None: one of its own
    shared_channel: grpc.aio.Channel | None = None
    rank_ports: tuple[int, int] = (0, 0)  # its --rank-port-range ((0, 0): the scheduler's default)
    cpus: float = 0.0  # host CPUs and memory (bytes) it reports (0: not reported)
    confirms_release: bool = False  # registers with confirms_release (the test then sends ReportAttemptReleased)
    memory_bytes: int = 0
    hold_heartbeats: bool = False  # True: registered and streaming, but sends no heartbeat until set back to False
    registrations: int = 0  # RegisterNode calls made: the first, and one each time a heartbeat said `reregister`
    # When set: (wall time, seconds) of each rank report answered, appended (benchmarks share one list)
    report_latency: list[tuple[float, float]] | None = None

    async def start(self) -> None:
        from phalanx.client import open_aio_channel

        self.channel = self.shared_channel or open_aio_channel(self.target, token=self.token)
        self.stub = agent_pb2_grpc.NodeServiceStub(self.channel)
        self.instance = uuid.uuid4().hex
        resp = await self._register()
        self._ack_due = asyncio.Event()
        self._stream_task = asyncio.create_task(self._stream())
        self._ack_task = asyncio.create_task(self._acker())
        self._beat_task = asyncio.create_task(self._beat(resp.heartbeat_interval_ms / 1000))

    async def _register(self) -> agent_pb2.RegisterNodeResponse:
        resp = await self.stub.RegisterNode(
            agent_pb2.RegisterNodeRequest(
                node_name=self.name,
                topology=self.topology(),
                address=self.address,
                agent_instance=self.instance,
                rank_port_low=self.rank_ports[0],
                rank_port_high=self.rank_ports[1],
                cpus=self.cpus,
                memory_bytes=self.memory_bytes,
                confirms_release=self.confirms_release,
            )
        )
        self.acked = max(self.acked, resp.acked_revision)
        self.registrations += 1
        return resp

    def topology(self) -> agent_pb2.HostTopology:
        topo = simple_topology(self.gpus, self.model, self.memory_mib, self.mig_gpus, self.mig_instances)
        topo.fabric_cluster_uuid, topo.fabric_clique = self.fabric_cluster_uuid, self.fabric_clique
        return topo

    async def stop(self) -> None:
        tasks = [self._stream_task, self._beat_task, self._ack_task, *self.running.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.shared_channel is None:
            await self.channel.close()

    async def partition(self) -> None:
        """Go silent as a cut network would: no heartbeats, no stream; the "ranks" keep running."""
        for task in (self._stream_task, self._beat_task, self._ack_task):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self.channel.close()

    async def drain(self) -> None:
        """What the real agent does on SIGTERM: a last heartbeat saying `draining`, its ranks killed and reported
        KILLED, then it goes (stop)."""
        await self.stub.Heartbeat(
            agent_pb2.HeartbeatRequest(node_name=self.name, agent_instance=self.instance, draining=True)
        )
        for (job_id, attempt), ranks in list(self.by_attempt.items()):
            for rank, task in ranks.items():
                if not task.done():
                    task.cancel()
                    await self._report(job_id, attempt, rank, common_pb2.RANK_STATE_KILLED, -15)
        self.by_attempt.clear()
        await self.stop()

    async def heal(self) -> None:
        """Come back after partition(): register again and resume the stream from the last revision taken, so the
        kills queued meanwhile (for attempts the scheduler gave up on) arrive and stop the stale ranks."""
        await self.start()

    async def _beat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if self.hold_heartbeats:
                continue
            try:
                resp = await self.stub.Heartbeat(
                    agent_pb2.HeartbeatRequest(node_name=self.name, agent_instance=self.instance)
                )
                if resp.reregister:
                    # As the real agent does (session.py): a scheduler that declared this node lost, while it was
                    # alive and beating (the scheduler stalled past its lease), gets it back by a registration.
                    await self._register()
            except grpc.aio.AioRpcError:
                _unless_stopping()

    async def _stream(self) -> None:
        while True:
            try:
                call = self.stub.StreamAssignments(
                    agent_pb2.StreamAssignmentsRequest(node_name=self.name, after_revision=self.acked)
                )
                async for assignment in call:
                    await self._take(assignment)
            except grpc.aio.AioRpcError:
                _unless_stopping()
                await asyncio.sleep(0.2)

    async def _take(self, a: agent_pb2.Assignment) -> None:
        if a.revision <= self.acked:
            return
        if a.HasField("launch"):
            self.launched.append(a.launch)
            ranks = self.by_attempt.setdefault((a.launch.job_id, a.launch.attempt), {})
            for r in a.launch.ranks:
                key = (a.launch.job_id, a.launch.attempt, r.rank)
                if key not in self.running:
                    self.running[key] = ranks[r.rank] = asyncio.create_task(self._rank(a.launch, r))
        else:
            self.killed.append(a.kill)
            for rank, task in self.by_attempt.pop((a.kill.job_id, a.kill.attempt), {}).items():
                if not task.done():
                    task.cancel()
                    asyncio.create_task(
                        self._report(a.kill.job_id, a.kill.attempt, rank, common_pb2.RANK_STATE_KILLED, -15)
                    )
        self.acked = a.revision
        self._ack_due.set()

    async def _acker(self) -> None:
        """Acknowledge the latest revision taken, coalescing a burst of assignments into one call."""
        sent = 0
        while True:
            await self._ack_due.wait()
            self._ack_due.clear()
            await asyncio.sleep(self.ack_delay)
            if self.acked > sent:
                revision = self.acked
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.stub.AckAssignments(
                        agent_pb2.AckAssignmentsRequest(node_name=self.name, revision=revision)
                    )
                    sent = revision

    async def _rank(self, launch: agent_pb2.LaunchReplica, rank: agent_pb2.RankLaunch) -> None:
        cmd = list(launch.command)
        if self.setup_failure or self.start_failure:
            await self._report(
                launch.job_id,
                launch.attempt,
                rank.rank,
                common_pb2.RANK_STATE_FAILED_TO_START,
                0,
                message=self.setup_failure or self.start_failure,
                retryable=bool(self.setup_failure),
            )
            return
        if cmd[:1] == ["hang"]:
            return
        await self._report(launch.job_id, launch.attempt, rank.rank, common_pb2.RANK_STATE_RUNNING, 0)
        if cmd[:1] == ["sleep"]:
            await asyncio.sleep(float(cmd[1]))
            await self._report(launch.job_id, launch.attempt, rank.rank, common_pb2.RANK_STATE_EXITED, 0)
        elif cmd[:1] == ["exit"]:
            await self._report(launch.job_id, launch.attempt, rank.rank, common_pb2.RANK_STATE_EXITED, int(cmd[1]))

    async def report_readiness(self, job_id: str, attempt: int, ready: bool, message: str = "") -> bool:
        """Report the leader's readiness as a real agent's probe would (ReportReadiness); True when the scheduler
        answers `stale` (the attempt is not the job's running one: a real agent stops probing it). Retried while the
        scheduler is unavailable; any other error is raised."""
        for _ in range(50):
            try:
                resp = await self.stub.ReportReadiness(
                    agent_pb2.ReportReadinessRequest(
                        node_name=self.name,
                        agent_instance=self.instance,
                        job_id=job_id,
                        attempt=attempt,
                        ready=ready,
                        message=message,
                    )
                )
                return resp.stale
            except grpc.aio.AioRpcError as exc:
                # Retried as the real agent retries its queued reports; CANCELLED: seen on a channel shared by
                # thousands of agents (bench/live_scale.py) when a burst of kills sends a report per rank at once.
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise
                _unless_stopping()
                await asyncio.sleep(0.1)
        raise TimeoutError(f"the scheduler stayed unavailable for readiness of {job_id}/{attempt}")

    async def _report(
        self,
        job_id: str,
        attempt: int,
        rank: int,
        state: common_pb2.RankState,
        code: int,
        *,
        message: str = "",
        retryable: bool = False,
    ) -> bool:
        for _ in range(50):
            t0 = time.perf_counter()
            try:
                resp = await self.stub.ReportRankStatus(
                    agent_pb2.ReportRankStatusRequest(
                        node_name=self.name,
                        job_id=job_id,
                        attempt=attempt,
                        rank=rank,
                        state=state,
                        exit_code=code,
                        message=message,
                        retryable=retryable,
                        agent_instance=self.instance,
                    )
                )
                if self.report_latency is not None:
                    self.report_latency.append((time.time(), time.perf_counter() - t0))
                return resp.stale
            except grpc.aio.AioRpcError as exc:
                # Retried as the real agent retries its queued reports; CANCELLED: seen on a channel shared by
                # thousands of agents (bench/live_scale.py) when a burst of kills sends a report per rank at once.
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise
                _unless_stopping()
                await asyncio.sleep(0.1)
        return False


def _unless_stopping() -> None:
    """Called where a failed call is retried: a task being cancelled (stop(), partition()) whose call ended in an
    error rather than CancelledError must still end, or the loop that retries would outlive its cancellation and
    stop() would wait for it for good."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
