"""The asyncio Phalanx client: the same API as :class:`phalanx.client.Client`, with coroutines."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from phalanx.api.v1 import scheduler_pb2, scheduler_pb2_grpc

from ._async_services import AsyncServiceCalls
from ._channel import effective_retries, open_aio_channel, resolve_tls, resolve_token
from ._client import (
    BACKOFF_INITIAL,
    BACKOFF_MAX,
    CHANNEL_OPTIONS,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    backoff_delay,
    build_submit_request,
    list_jobs_request,
    queue_request,
    resolve_target,
    scheduler_stub,
    wait_timeout_error,
    watch_ids,
)
from ._errors import DeadlineExceededError, from_grpc_error
from ._spares import SparePool
from ._types import (
    TERMINAL_STATES,
    CheckpointResult,
    GoodputReport,
    Job,
    JobState,
    Node,
    QueueInfo,
    job_state_to_proto,
    parse_states,
)

__all__ = ["AsyncClient"]


class AsyncClient(AsyncServiceCalls):
    """An asyncio client for the Phalanx scheduler, with the same behaviour as :class:`Client` (its service calls
    included: :meth:`create_service`, ..., and ``async for endpoints in client.watch_endpoints(name)``).

    The gRPC channel is opened on first use, in the running event loop.

    Example:
        >>> async with AsyncClient() as client:
        ...     job = await client.submit("train", 2, 8, ["python", "train.py"])
        ...     async for update in client.watch([job.id]):
        ...         print(update.state)

    Args:
        target: Scheduler ``host:port``; defaults to ``$PHALANX_SCHEDULER``, else ``127.0.0.1:50051``.
        timeout: Deadline in seconds of each call, retries included.
        retries: How many times a call failing with UNAVAILABLE is retried (0: never), by gRPC's retry policy
            on the channel; clamped to 4 (gRPC's cap of 5 attempts), as for :class:`Client`.
        token, tls_ca, tls_cert, tls_key: As for :class:`Client` (defaults from ``$PHALANX_TOKEN`` and
            ``$PHALANX_TLS_*``).
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        self.target = resolve_target(target)
        self.timeout = float(timeout)
        self.retries = effective_retries(retries)
        self._token = resolve_token(token)
        self._tls = resolve_tls(tls_ca, tls_cert, tls_key)
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        """The generated stub over this client's channel (opened on first access)."""
        if self._stub is None:
            self._channel = open_aio_channel(
                self.target,
                CHANNEL_OPTIONS,
                token=self._token,
                tls=self._tls,
                retries=self.retries,
                retry_budget=self.timeout,
                retry_backoff=(BACKOFF_INITIAL, BACKOFF_MAX),
            )
            self._stub = scheduler_stub(self._channel)
        return self._stub

    def _aio_channel(self) -> grpc.aio.Channel:
        """The channel (opened on first use), for the service calls."""
        _ = self.stub
        assert self._channel is not None  # opened by the stub property
        return self._channel

    async def close(self) -> None:
        """Close the channel; open calls are cancelled."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient(target={self.target!r}, timeout={self.timeout}, retries={self.retries})"

    # -- plumbing --------------------------------------------------------------------------------------------

    async def _call(self, method_name: str, request: Any, timeout: float | None = None) -> Any:
        """One call; gRPC's retry policy retries UNAVAILABLE within the deadline (the channel's service config)."""
        method: Callable[..., Any] = getattr(self.stub, method_name)
        budget = self.timeout if timeout is None else float(timeout)
        try:
            return await method(request, timeout=budget)
        except grpc.RpcError as exc:
            raise from_grpc_error(exc, self.target) from exc

    # -- API -------------------------------------------------------------------------------------------------

    async def submit(
        self,
        name: str,
        replicas: int,
        gpus_per_replica: int,
        command: Sequence[str] | str,
        *,
        priority: int = 0,
        procs_per_replica: int = 0,
        env: Mapping[str, str] | None = None,
        request_id: str | None = None,
        required_tier: str = "",
        preferred_tier: str = "",
        gpu_model: str = "",
        mig_profile: str = "",
        gpu_milli: int = 0,
        max_restarts: int = 0,
        time_limit: float = 0.0,
        queue: str = "",
        keep_checkpoints: int = 0,
        cpus_per_replica: float = 0,
        memory_per_replica: str | int = "",
        segment: int = 0,
        segment_tier: str = "",
        spares_per_segment: int = 0,
        min_replicas: int = 0,
        after: Iterable[str | tuple[str, str]] | str | None = None,
        array: str = "",
    ) -> Job:
        """Submit a gang job; see :meth:`Client.submit`.

        Args:
            name: A human-readable name.
            replicas: Number of replicas; each lives on one node.
            gpus_per_replica: GPUs per replica.
            command: The argv to run; a string is split with :func:`shlex.split`.
            priority: Higher wins.
            procs_per_replica: 0: one process per GPU; 1: one per replica.
            env: Extra environment variables.
            request_id: Idempotency key; generated (uuid4 hex) when omitted, reused across retries.
            required_tier: The gang must fit under one domain of this tier, or wait; "" for none.
            preferred_tier: Best effort: prefer one domain of this tier; "" for none.
            gpu_model: Only nodes whose GPU model contains this text, case-insensitively.
            mig_profile: Each replica is one MIG instance of this profile; gpus_per_replica must be 1.
            gpu_milli: Each replica is this share of one GPU, in thousandths (1-999).
            max_restarts: A rank exiting non-zero requeues the gang up to this many times; 0: none.
            time_limit: Declared seconds of runtime per attempt (0: none).
            queue: The queue to submit to ("": default).
            keep_checkpoints: Newest committed checkpoints the coordinator keeps (0: its default).
            cpus_per_replica: CPUs each replica reserves on its node and is limited to (0: no limit).
            memory_per_replica: Memory each replica reserves and is limited to: a size ("512M", "64G") or bytes.
            segment: Replicas per segment of a multi-level gang (it must divide ``replicas``; 0: none).
            segment_tier: The tier each segment lies in ("": the NVLink domain, else the leaf).
            spares_per_segment: Spare replicas kept idle in each segment's domain and swapped in for a lost node.
            min_replicas: An elastic gang's minimum (``replicas`` is its maximum); 0: not elastic.
            after: Jobs this one waits for ("JOB", "JOB:notok", "JOB:any", or (job id, condition) pairs).
            array: An array of tasks in Slurm's --array syntax ("0-99%8").

        Returns:
            The job as accepted by the scheduler.
        """
        request = build_submit_request(
            name,
            replicas,
            gpus_per_replica,
            command,
            priority=priority,
            procs_per_replica=procs_per_replica,
            env=env,
            request_id=request_id,
            required_tier=required_tier,
            preferred_tier=preferred_tier,
            gpu_model=gpu_model,
            mig_profile=mig_profile,
            gpu_milli=gpu_milli,
            max_restarts=max_restarts,
            time_limit=time_limit,
            queue=queue,
            keep_checkpoints=keep_checkpoints,
            cpus_per_replica=cpus_per_replica,
            memory_per_replica=memory_per_replica,
            segment=segment,
            segment_tier=segment_tier,
            spares_per_segment=spares_per_segment,
            min_replicas=min_replicas,
            after=after,
            array=array,
        )
        return Job.from_proto(await self._call("SubmitJob", request))

    async def get_job(self, job_id: str) -> Job:
        """Fetch one job.

        Args:
            job_id: The job's id.

        Returns:
            The job.

        Raises:
            NotFoundError: No such job.
        """
        return Job.from_proto(await self._call("GetJob", scheduler_pb2.GetJobRequest(job_id=job_id)))

    async def list_jobs(
        self, states: Iterable[str | JobState] | str | JobState | None = None, *, limit: int = 0
    ) -> list[Job]:
        """List jobs, finished ones included, newest first: one page (see :meth:`iter_jobs` for every job).

        Args:
            states: Only jobs in these states; None: all.
            limit: At most this many; 0: the scheduler's first page (the newest 100).

        Returns:
            The jobs in the scheduler's order.
        """
        request = scheduler_pb2.ListJobsRequest(
            states=[job_state_to_proto(s) for s in parse_states(states)], limit=int(limit)
        )
        return [Job.from_proto(j) for j in (await self._call("ListJobs", request)).jobs]

    async def list_jobs_page(
        self,
        states: Iterable[str | JobState] | str | JobState | None = None,
        *,
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[Job], str]:
        """One page of jobs, newest first; see :meth:`Client.list_jobs_page`.

        Returns:
            (the jobs, the next page's token: "" on the last page).
        """
        response = await self._call("ListJobs", list_jobs_request(states, page_size, page_token))
        return [Job.from_proto(j) for j in response.jobs], response.next_page_token

    async def iter_jobs(
        self, states: Iterable[str | JobState] | str | JobState | None = None, *, page_size: int = 100
    ) -> AsyncGenerator[Job, None]:
        """Every job (in these states), newest first, a page at a time; see :meth:`Client.iter_jobs`.

        Yields:
            The jobs, in the scheduler's order.
        """
        token = ""
        while True:
            jobs, token = await self.list_jobs_page(states, page_size=page_size, page_token=token)
            for job in jobs:
                yield job
            if not token:
                return

    async def cancel(self, job_id: str) -> Job:
        """Cancel a job.

        Args:
            job_id: The job's id.

        Returns:
            The job after the cancellation.

        Raises:
            NotFoundError: No such job.
        """
        return Job.from_proto(await self._call("CancelJob", scheduler_pb2.CancelJobRequest(job_id=job_id)))

    async def checkpoint(self, job_id: str, reason: str = "user") -> CheckpointResult:
        """Ask a running job's ranks to checkpoint now; see :meth:`Client.checkpoint`.

        Args:
            job_id: The job's id.
            reason: Why, for the record.

        Returns:
            The job, and the outstanding request's reason and time.

        Raises:
            NotFoundError: No such job.
            FailedPreconditionError: The job is not running.
        """
        request = scheduler_pb2.CheckpointJobRequest(job_id=job_id, reason=reason)
        return CheckpointResult.from_proto(await self._call("CheckpointJob", request))

    async def goodput(
        self, since: float = 0.0, limit: int = 0, *, page_size: int = 0, page_token: str = ""
    ) -> GoodputReport:
        """GPU-time accounting of the cluster and of each job; see :meth:`Client.goodput`.

        Args:
            since: Only jobs submitted at or after this unix time (0: all).
            limit: At most this many jobs listed, newest first (0: the scheduler's default).
            page_size: Jobs per page (0: ``limit``, or 100; at most 1000).
            page_token: ``next_page_token`` of the previous page ("" for the first).

        Returns:
            The cluster total, the number of jobs it counts, its parts by tenant and by queue, the listed jobs, and
            the token of the next page.
        """
        request = scheduler_pb2.GetGoodputRequest(
            since=float(since), limit=int(limit), page_size=int(page_size), page_token=page_token
        )
        return GoodputReport.from_proto(await self._call("GetGoodput", request))

    async def nodes(self) -> list[Node]:
        """List the cluster's nodes, by name (following every page).

        Returns:
            Every node the scheduler knows.
        """
        return [n async for n in self.iter_nodes()]

    async def list_nodes_page(self, *, page_size: int = 0, page_token: str = "") -> tuple[list[Node], str]:
        """One page of nodes, by name; see :meth:`Client.list_nodes_page`.

        Returns:
            (the nodes, the next page's token: "" on the last page).
        """
        request = scheduler_pb2.ListNodesRequest(page_size=int(page_size), page_token=page_token)
        response = await self._call("ListNodes", request)
        return [Node.from_proto(n) for n in response.nodes], response.next_page_token

    async def iter_nodes(self, *, page_size: int = 0) -> AsyncGenerator[Node, None]:
        """Every node, by name, a page at a time (0: the scheduler's default page, 1000).

        Yields:
            The nodes.
        """
        token = ""
        while True:
            nodes, token = await self.list_nodes_page(page_size=page_size, page_token=token)
            for node in nodes:
                yield node
            if not token:
                return

    async def drain_node(self, name: str, reason: str = "") -> Node:
        """Drain a node (admin); see :meth:`Client.drain_node`."""
        return Node.from_proto(
            await self._call("DrainNode", scheduler_pb2.DrainNodeRequest(node_name=name, reason=reason))
        )

    async def queues(self, name: str = "") -> list[QueueInfo]:
        """Every queue (or the one named); see :meth:`Client.queues`."""
        response = await self._call("ListQueues", scheduler_pb2.ListQueuesRequest(name=name))
        return [QueueInfo.from_proto(q) for q in response.queues]

    async def set_queue(
        self,
        name: str,
        quotas: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        cohort: str = "",
        weight: float = 1.0,
        tenants: Iterable[str] = (),
        max_priority: int = 0,
    ) -> QueueInfo:
        """Create or replace a queue (admin); see :meth:`Client.set_queue`."""
        return QueueInfo.from_proto(
            await self._call("SetQueue", queue_request(name, quotas, cohort, weight, tenants, max_priority))
        )

    async def create_pool(self, name: str, *, tier: str, per_domain: int) -> SparePool:
        """Create a spare pool (admin); see :meth:`Client.create_pool`."""
        request = scheduler_pb2.CreatePoolRequest(name=name, tier=tier, per_domain=per_domain)
        return SparePool.from_proto(await self._call("CreatePool", request))

    async def pools(self, name: str = "") -> list[SparePool]:
        """The spare pools; see :meth:`Client.pools`."""
        response = await self._call("ListPools", scheduler_pb2.ListPoolsRequest(name=name))
        return [SparePool.from_proto(p) for p in response.pools]

    async def delete_pool(self, name: str) -> None:
        """Delete a spare pool (admin); see :meth:`Client.delete_pool`."""
        await self._call("DeletePool", scheduler_pb2.DeletePoolRequest(name=name))

    async def delete_queue(self, name: str) -> None:
        """Remove a queue (admin); see :meth:`Client.delete_queue`."""
        await self._call("DeleteQueue", scheduler_pb2.DeleteQueueRequest(name=name))

    async def undrain_node(self, name: str) -> Node:
        """Undo :meth:`drain_node` (admin); see :meth:`Client.undrain_node`."""
        return Node.from_proto(await self._call("UndrainNode", scheduler_pb2.UndrainNodeRequest(node_name=name)))

    async def watch(
        self, job_ids: Iterable[str] | str | None = None, *, timeout: float | None = None
    ) -> AsyncGenerator[Job, None]:
        """Stream the current state of each job, then every change; see :meth:`Client.watch`.

        Args:
            job_ids: Jobs to watch; None or empty: every job.
            timeout: Give up after this many seconds (DeadlineExceededError); None: never.

        Yields:
            A :class:`Job` per state the scheduler reports.
        """
        request = scheduler_pb2.WatchJobsRequest(job_ids=watch_ids(job_ids))
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        last: dict[str, Job] = {}
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceededError(f"watch did not finish within {timeout:g}s")
            call = self.stub.WatchJobs(request, timeout=remaining)
            delivered = False
            try:
                async for event in call:
                    delivered = True
                    job = dataclasses.replace(Job.from_proto(event.job), changed_at=float(event.at))
                    if last.get(job.id) == job:
                        continue
                    last[job.id] = job
                    yield job
                return
            except grpc.RpcError as exc:
                # A failed open was retried by gRPC already; a live stream that broke is a session to resume.
                if exc.code() is grpc.StatusCode.UNAVAILABLE and delivered and self.retries:
                    delay = backoff_delay(0)
                    if deadline is None or time.monotonic() + delay < deadline:
                        await asyncio.sleep(delay)
                        continue
                raise from_grpc_error(exc, self.target) from exc
            finally:
                call.cancel()

    async def wait(
        self,
        job_id: str,
        states: Iterable[str | JobState] | str | JobState | None = None,
        *,
        timeout: float | None = None,
    ) -> Job:
        """Wait until a job reaches one of ``states`` (default: terminal); see :meth:`Client.wait`.

        Args:
            job_id: The job's id.
            states: Target states; None: SUCCEEDED, FAILED or CANCELLED.
            timeout: Give up after this many seconds; None: wait forever.

        Returns:
            The job in the first matching state.

        Raises:
            NotFoundError: No such job.
            DeadlineExceededError: The job did not get there within ``timeout``.
        """
        targets = set(parse_states(states)) or set(TERMINAL_STATES)
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        job = await self.get_job(job_id)
        while job.state not in targets:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise wait_timeout_error(job_id, targets, timeout)
            stream = self.watch([job_id], timeout=remaining)
            try:
                async for job in stream:
                    if job.id == job_id and job.state in targets:
                        return job
            except DeadlineExceededError:
                raise wait_timeout_error(job_id, targets, timeout) from None
            finally:
                await stream.aclose()
            job = await self.get_job(job_id)
            if job.state not in targets:
                await asyncio.sleep(min(BACKOFF_MAX, 0.2))
        return job
