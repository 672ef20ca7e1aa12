"""The synchronous Phalanx client, plus the settings it shares with :class:`phalanx.client.AsyncClient`."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

import phalanx
from phalanx.api.v1 import scheduler_pb2, scheduler_pb2_grpc

from ._channel import (  # the backoff of re-opened watches lives with the channel's; importable from here too
    BACKOFF_INITIAL,
    BACKOFF_MAX,
    MAX_RETRIES,
    backoff_delay,
    effective_retries,
    open_channel,
    resolve_tls,
    resolve_token,
)
from ._errors import DeadlineExceededError, UnavailableError, from_grpc_error
from ._services import ServiceCalls, service_stub
from ._spares import SparePool
from ._submit import build_submit_request  # importable from here too
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

__all__ = ["Client", "DEFAULT_TARGET", "DEFAULT_TIMEOUT", "DEFAULT_RETRIES", "MAX_RETRIES", "resolve_target"]

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 10.0
DEFAULT_RETRIES = 4
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Keepalive pings only while a call is open (long watches); the scheduler allows one every 5 s.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly, so that the retries of UNAVAILABLE (gRPC's retry policy) meet a restarted scheduler.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.primary_user_agent", f"phalanx-python/{phalanx.__version__}"),
]

T = TypeVar("T")


def resolve_target(target: str | None) -> str:
    """Pick the scheduler address: the argument, else ``$PHALANX_SCHEDULER``, else ``127.0.0.1:50051``.

    Args:
        target: An explicit ``host:port``, or None.

    Returns:
        The address to dial.
    """
    return target or os.environ.get("PHALANX_SCHEDULER") or DEFAULT_TARGET


def list_jobs_request(
    states: Iterable[str | JobState] | str | JobState | None, page_size: int, page_token: str
) -> scheduler_pb2.ListJobsRequest:
    """The ListJobsRequest of one page (Client and AsyncClient)."""
    return scheduler_pb2.ListJobsRequest(
        states=[job_state_to_proto(s) for s in parse_states(states)], page_size=int(page_size), page_token=page_token
    )


def queue_request(
    name: str,
    quotas: Mapping[str, Mapping[str, Any]] | None,
    cohort: str,
    weight: float,
    tenants: Iterable[str],
    max_priority: int = 0,
) -> scheduler_pb2.SetQueueRequest:
    spec = scheduler_pb2.QueueSpec(
        name=name, cohort=cohort, weight=float(weight), tenants=list(tenants), max_priority=int(max_priority)
    )
    for flavor, q in (quotas or {}).items():
        limit = q.get("borrow_limit")
        spec.quotas.add(
            flavor=flavor,
            gpus=float(q.get("gpus", 0)),
            mig_slices=int(q.get("mig_slices", 0)),
            has_borrow_limit=limit is not None,
            borrow_limit=float(limit or 0),
        )
    return scheduler_pb2.SetQueueRequest(spec=spec)


def watch_ids(job_ids: Iterable[str] | str | None) -> list[str]:
    """Normalise the job id argument of watch: one id, several, or None (every job)."""
    if job_ids is None:
        return []
    if isinstance(job_ids, str):
        return [job_ids]
    return [str(j) for j in job_ids]


def scheduler_stub(channel: grpc.Channel | grpc.aio.Channel) -> scheduler_pb2_grpc.SchedulerStub:
    """The generated Scheduler stub over a blocking or an asyncio channel."""
    # grpcio-tools writes no .pyi for *_pb2_grpc.py (tools/genproto.py), so mypy sees an unannotated constructor.
    return scheduler_pb2_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]  # generated, unannotated


def wait_timeout_error(job_id: str, states: Iterable[JobState], timeout: float | None) -> DeadlineExceededError:
    """The error :meth:`Client.wait` raises when the job does not reach the states in time."""
    names = "/".join(sorted(s.value for s in states))
    return DeadlineExceededError(f"job {job_id} did not reach {names} within {timeout:g}s")


class Client(ServiceCalls):
    """A synchronous client for the Phalanx scheduler: jobs, nodes and queues here, serving fleets (services) in the
    methods it gets from ``ServiceCalls`` (:meth:`create_service`, :meth:`apply_service`, :meth:`watch_endpoints`...).

    Every call has a deadline (``timeout`` seconds, retries included). Calls that fail with UNAVAILABLE are
    retried with exponential backoff (0.1 s doubling, at most 2 s, +-20%; shortened so that all the backoffs take
    at most half of ``timeout``) by gRPC itself: the channel carries a ``retryPolicy`` in its service config
    (:func:`phalanx.client._channel.retry_options`). This includes :meth:`submit`, which is idempotent thanks to
    a request id that is generated once per call, is part of the request, and so is the same in every attempt.
    A call still failing after its retries raises :class:`UnavailableError`.

    Example:
        >>> with Client("127.0.0.1:50051") as client:
        ...     job = client.submit("train", 2, 8, ["python", "train.py"])
        ...     done = client.wait(job.id, timeout=3600)

    Args:
        target: Scheduler ``host:port``; defaults to ``$PHALANX_SCHEDULER``, else ``127.0.0.1:50051``.
        timeout: Deadline in seconds of each call, retries included.
        retries: How many times a call failing with UNAVAILABLE is retried (0: never). gRPC makes at most 5
            attempts of a call (``MAX_RETRIES`` = 4 retries; no channel argument of grpcio raises it), so a larger
            value is clamped to 4 (``client.retries`` is the value in effect). For :meth:`watch`, 0 also means a
            stream that breaks is not re-opened.
        token: Bearer token sent with every call; defaults to ``$PHALANX_TOKEN`` (none when unset).
        tls_ca, tls_cert, tls_key: PEM files for TLS (the CA to trust; this client's certificate and key, for
            mutual TLS); default ``$PHALANX_TLS_CA``, ``$PHALANX_TLS_CERT``, ``$PHALANX_TLS_KEY``. Without a CA
            the channel is plaintext.
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
        self._channel = open_channel(
            self.target,
            CHANNEL_OPTIONS,
            token=resolve_token(token),
            tls=resolve_tls(tls_ca, tls_cert, tls_key),
            retries=self.retries,
            retry_budget=self.timeout,
            retry_backoff=(BACKOFF_INITIAL, BACKOFF_MAX),
        )
        self._stub = scheduler_stub(self._channel)
        self._service_stub = service_stub(self._channel)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel. The client cannot be used afterwards."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(target={self.target!r}, timeout={self.timeout}, retries={self.retries})"

    # -- plumbing --------------------------------------------------------------------------------------------

    def _call(self, method: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        """One call; gRPC's retry policy retries UNAVAILABLE within the deadline (the channel's service config)."""
        budget = self.timeout if timeout is None else float(timeout)
        try:
            return method(request, timeout=budget)
        except grpc.RpcError as exc:
            raise from_grpc_error(exc, self.target) from exc

    # -- API -------------------------------------------------------------------------------------------------

    def submit(
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
        """Submit a gang job of ``replicas`` x ``gpus_per_replica`` GPUs.

        Args:
            name: A human-readable name.
            replicas: Number of replicas; each lives on one node.
            gpus_per_replica: GPUs per replica.
            command: The argv to run; a string is split with :func:`shlex.split`.
            priority: Higher wins; may preempt lower priorities.
            procs_per_replica: 0: one process per GPU; 1: one per replica (torchrun style).
            env: Extra environment variables for the job's processes.
            request_id: Idempotency key; generated (uuid4 hex) when omitted. A repeated key returns the first job.
            required_tier: The gang must fit under one domain of this tier ("node", a fabric tier of the
                scheduler such as "leaf" or "spine", or "cluster") or wait; "" for no constraint.
            preferred_tier: Best effort: prefer one domain of this tier; "" for no preference.
            gpu_model: Only nodes whose GPU model contains this text, case-insensitively ("H100").
            mig_profile: Each replica is one MIG instance of this profile ("1g.10gb", "3g.40gb"...);
                gpus_per_replica must be 1.
            gpu_milli: Each replica is this share of one GPU, in thousandths (1-999); gpus_per_replica must be 1.
            max_restarts: A rank exiting non-zero requeues the gang (to resume from its last committed
                checkpoint) up to this many times instead of failing the job; 0: no restarts.
            time_limit: Declared seconds of runtime per attempt (0: none): the gang is stopped at its limit, and
                a limit lets it backfill ahead of a waiting larger gang.
            queue: The queue to submit to ("": default); its quota, cohort and fair share apply.
            keep_checkpoints: The checkpoint coordinator keeps this many of the job's newest committed
                checkpoints and deletes the older ones (0: the coordinator's --keep-checkpoints, default 3).
            cpus_per_replica: CPUs each replica reserves on its node, with its GPUs, and is held to by a CPU quota
                (fractions to a thousandth; 0: none reserved and no limit).
            memory_per_replica: Memory each replica reserves on its node and is limited to (the rank is killed past
                it and the job says "out of memory (limit 512M)"): a size with a binary unit ("512M", "64G") or a
                number of bytes; "" or 0: none reserved and no limit.
            segment: A multi-level gang: replicas / segment segments of this many replicas, each wholly inside one
                domain of ``segment_tier``, spread over as few higher-tier domains as possible, a segment's ranks
                contiguous; it must divide ``replicas`` (0: no segments).
            segment_tier: The tier each segment lies in ("": the NVLink domain where the fabric has one, else the
                leaf).
            spares_per_segment: Spares kept in the domain: this many extra replicas reserved idle (and charged to
                the job's queue) in each segment's domain; when a node of the gang is lost or a GPU fails, a spare of
                that domain takes its replicas and the gang restarts there from its last committed checkpoint, with
                no requeue. Needs ``segment``; 0: none.
            min_replicas: An elastic gang: it starts once this many replicas fit, takes as many as fit up to
                ``replicas`` (its maximum), grows towards it as capacity frees and shrinks (down to this) when a
                node of it is lost, each time restarting from its last committed checkpoint at the new world size.
                0: not elastic.
            after: Jobs this one waits for: job ids ("JOB" or "JOB:ok", "JOB:notok", "JOB:any"), or (job id,
                condition) pairs. "ok" (the default) waits for the job to succeed, "notok" to fail or be cancelled,
                "any" to end; a dependency that can no longer be met fails this job ("dependency_failed: ...").
            array: Submit an array of tasks in Slurm's --array syntax ("0-99%8": indices 0-99, at most 8 at once;
                "1,3,5-7"; "0-99:2"). Each task runs the same gang with PHALANX_ARRAY_TASK_ID set.

        Returns:
            The job as accepted by the scheduler (usually PENDING).

        Raises:
            InvalidArgumentError: The spec was rejected (for instance an unknown tier name).
            FailedPreconditionError: The gang can never fit (for instance under one domain of its required tier).
            UnavailableError: The scheduler could not be reached, even after retries.
            DeadlineExceededError: No answer within the timeout.
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
        return Job.from_proto(self._call(self._stub.SubmitJob, request))

    def logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        attempt: int = 0,
        follow: bool = False,
        tail: int = 0,
    ) -> Generator[tuple[int, str], None, None]:
        """A job's rank logs (stdout and stderr), line by line, as (rank, line) without the newline.

        The scheduler says where each rank's log is and gives a credential for it (GetRankLogs); the lines come
        from the rank's node agent (AgentLogs), for a running or a finished attempt.

        Args:
            job_id: The job.
            rank: One rank; None: every rank of the attempt (each rank's lines in order; ranks interleave as their
                lines arrive when following, else one rank after another).
            attempt: The attempt (0: the current or last one).
            follow: Keep streaming what the ranks write until they have ended.
            tail: Only each rank's last `tail` lines (0: from the start).

        Raises:
            NotFoundError: No such job (or another tenant's), attempt or started rank.
            UnavailableError: A rank's node serves no logs or cannot be reached.
        """
        import queue
        import threading

        from phalanx.api.v1 import agent_pb2, agent_pb2_grpc

        request = scheduler_pb2.GetRankLogsRequest(job_id=job_id, attempt=int(attempt))
        if rank is not None:
            request.rank = int(rank)
        found = self._call(self._stub.GetRankLogs, request)
        for source in found.sources:
            if not source.address:
                raise UnavailableError(f"node {source.node} serves no logs (its agent runs with --logs-listen off)")

        def lines(source: scheduler_pb2.RankLogSource) -> Generator[str, None, None]:
            channel = open_channel(
                source.address, retries=0
            )  # the agents serve logs in plaintext: the credential is per job
            try:
                stub = agent_pb2_grpc.AgentLogsStub(channel)  # type: ignore[no-untyped-call]  # generated
                call = stub.ReadRankLog(
                    agent_pb2.ReadRankLogRequest(
                        credential=source.credential,
                        job_id=job_id,
                        attempt=found.attempt,
                        rank=source.rank,
                        follow=follow,
                        tail_lines=int(tail),
                    )
                )
                pending = b""
                try:
                    for chunk in call:
                        pending += chunk.data
                        *done, pending = pending.split(b"\n")
                        for line in done:
                            yield line.decode(errors="replace")
                    if pending:
                        yield pending.decode(errors="replace")
                except grpc.RpcError as exc:
                    raise from_grpc_error(exc, source.address) from exc
                finally:
                    call.cancel()
            finally:
                channel.close()

        sources = list(found.sources)
        if not follow or len(sources) == 1:
            for source in sources:
                for line in lines(source):
                    yield source.rank, line
            return
        out: queue.Queue[tuple[int, str] | Exception | None] = queue.Queue(maxsize=10_000)
        stop = threading.Event()

        def pump(source: scheduler_pb2.RankLogSource) -> None:
            try:
                for line in lines(source):
                    if stop.is_set():
                        return
                    out.put((source.rank, line))
            except Exception as exc:  # handed to the reader
                out.put(exc)
            finally:
                out.put(None)

        threads = [threading.Thread(target=pump, args=(s,), daemon=True) for s in sources]
        for t in threads:
            t.start()
        left = len(threads)
        try:
            while left:
                item = out.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            stop.set()

    def get_job(self, job_id: str) -> Job:
        """Fetch one job.

        Args:
            job_id: The job's id.

        Returns:
            The job.

        Raises:
            NotFoundError: No such job.
        """
        return Job.from_proto(self._call(self._stub.GetJob, scheduler_pb2.GetJobRequest(job_id=job_id)))

    def list_jobs(
        self, states: Iterable[str | JobState] | str | JobState | None = None, *, limit: int = 0
    ) -> list[Job]:
        """List jobs, finished ones included, newest first: one page (see :meth:`iter_jobs` for every job).

        Args:
            states: Only jobs in these states (names or :class:`JobState`); None: all.
            limit: At most this many jobs; 0: the scheduler's first page (the newest 100).

        Returns:
            The jobs, in the scheduler's order (newest first).
        """
        request = scheduler_pb2.ListJobsRequest(
            states=[job_state_to_proto(s) for s in parse_states(states)], limit=int(limit)
        )
        return [Job.from_proto(j) for j in self._call(self._stub.ListJobs, request).jobs]

    def list_jobs_page(
        self,
        states: Iterable[str | JobState] | str | JobState | None = None,
        *,
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[Job], str]:
        """One page of jobs, newest first (filters apply before paging).

        Args:
            states: Only jobs in these states; None: all.
            page_size: At most this many (0: the scheduler's default, 100; at most 1000). A page may hold fewer
                when the jobs are large (the scheduler's 8 MiB page budget): follow the token, not the count.
            page_token: "" for the first page, else the token a previous page returned (with the same states).

        Returns:
            (the jobs, the next page's token: "" on the last page).

        Raises:
            InvalidArgumentError: A bad page size or page token.
        """
        request = list_jobs_request(states, page_size, page_token)
        response = self._call(self._stub.ListJobs, request)
        return [Job.from_proto(j) for j in response.jobs], response.next_page_token

    def iter_jobs(
        self, states: Iterable[str | JobState] | str | JobState | None = None, *, page_size: int = 100
    ) -> Generator[Job, None, None]:
        """Every job (in these states), newest first, a page at a time: one call per page. A job submitted while
        iterating is not listed (it is newer than the first page) and never makes an older one repeat or go missing.

        Args:
            states: Only jobs in these states; None: all.
            page_size: Jobs per call (at most 1000).

        Yields:
            The jobs, in the scheduler's order.
        """
        token = ""
        while True:
            jobs, token = self.list_jobs_page(states, page_size=page_size, page_token=token)
            yield from jobs
            if not token:
                return

    def cancel(self, job_id: str) -> Job:
        """Cancel a job (idempotent: cancelling a finished job returns it as it is, or the server's error).

        Args:
            job_id: The job's id.

        Returns:
            The job after the cancellation.

        Raises:
            NotFoundError: No such job.
            FailedPreconditionError: The scheduler refuses to cancel it in its current state.
        """
        return Job.from_proto(self._call(self._stub.CancelJob, scheduler_pb2.CancelJobRequest(job_id=job_id)))

    def checkpoint(self, job_id: str, reason: str = "user") -> CheckpointResult:
        """Ask a running job's ranks to checkpoint now (``phalanx.train.should_checkpoint`` turns true).

        Asking again while a request is outstanding keeps the earlier one (and its reason).

        Args:
            job_id: The job's id.
            reason: Why, for the record (at most 1000 characters).

        Returns:
            The job, and the outstanding request's reason and time (unix seconds).

        Raises:
            NotFoundError: No such job.
            FailedPreconditionError: The job is not running.
            InvalidArgumentError: A bad reason.
        """
        request = scheduler_pb2.CheckpointJobRequest(job_id=job_id, reason=reason)
        return CheckpointResult.from_proto(self._call(self._stub.CheckpointJob, request))

    def goodput(self, since: float = 0.0, limit: int = 0, *, page_size: int = 0, page_token: str = "") -> GoodputReport:
        """GPU-time accounting of the cluster and of each job: allocated, productive, rollback, restart and waiting
        GPU-seconds, and the ratio productive / allocated.

        Args:
            since: Only jobs submitted at or after this unix time (0: all). Archived jobs (finished longer than the
                scheduler's --retain-finished ago) count in the totals by the UTC day they were submitted: a
                ``since`` inside a day counts all of that day's archived jobs.
            limit: At most this many jobs listed, newest first (0: the scheduler's default, 100); the cluster total
                counts every job since ``since``.
            page_size: Jobs per page (0: ``limit``, or 100; at most 1000).
            page_token: ``next_page_token`` of the previous page, with the same ``since`` ("" for the first).

        Returns:
            The cluster total, the number of jobs it counts, its parts by tenant and by queue, the listed jobs, and
            the token of the next page ("" on the last).

        Raises:
            InvalidArgumentError: A negative ``since``, ``limit`` or ``page_size``, or a bad page token.
        """
        request = scheduler_pb2.GetGoodputRequest(
            since=float(since), limit=int(limit), page_size=int(page_size), page_token=page_token
        )
        return GoodputReport.from_proto(self._call(self._stub.GetGoodput, request))

    def nodes(self) -> list[Node]:
        """List the cluster's nodes, by name (following every page).

        Returns:
            Every node the scheduler knows, READY, DRAINED or LOST.
        """
        return list(self.iter_nodes())

    def list_nodes_page(self, *, page_size: int = 0, page_token: str = "") -> tuple[list[Node], str]:
        """One page of nodes, by name.

        Args:
            page_size: At most this many (0: the scheduler's default, 1000; at most 5000).
            page_token: "" for the first page, else the token a previous page returned.

        Returns:
            (the nodes, the next page's token: "" on the last page).

        Raises:
            InvalidArgumentError: A bad page size or page token.
        """
        request = scheduler_pb2.ListNodesRequest(page_size=int(page_size), page_token=page_token)
        response = self._call(self._stub.ListNodes, request)
        return [Node.from_proto(n) for n in response.nodes], response.next_page_token

    def iter_nodes(self, *, page_size: int = 0) -> Generator[Node, None, None]:
        """Every node, by name, a page at a time (0: the scheduler's default page, 1000).

        Yields:
            The nodes.
        """
        token = ""
        while True:
            nodes, token = self.list_nodes_page(page_size=page_size, page_token=token)
            yield from nodes
            if not token:
                return

    def drain_node(self, name: str, reason: str = "") -> Node:
        """Drain a node (admin): it takes no new work, and stays DRAINED when its agent registers again, until
        :meth:`undrain_node`. Running gangs are left alone.

        Raises:
            NotFoundError: No such node.
            PermissionDeniedError: The caller is not an admin (authentication on).
        """
        request = scheduler_pb2.DrainNodeRequest(node_name=name, reason=reason)
        return Node.from_proto(self._call(self._stub.DrainNode, request))

    def queues(self, name: str = "") -> list[QueueInfo]:
        """Every queue (or the one named): quotas, usage, fair share and pending jobs with their positions.

        Raises:
            NotFoundError: `name` names no queue.
        """
        response = self._call(self._stub.ListQueues, scheduler_pb2.ListQueuesRequest(name=name))
        return [QueueInfo.from_proto(q) for q in response.queues]

    def set_queue(
        self,
        name: str,
        quotas: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        cohort: str = "",
        weight: float = 1.0,
        tenants: Iterable[str] = (),
        max_priority: int = 0,
    ) -> QueueInfo:
        """Create or replace a queue (admin). `quotas`: flavor ("H100", or "*" for any GPU model) -> {"gpus": N,
        "borrow_limit": N (absent: none), "mig_slices": N}, in preference order; none: unlimited. `max_priority`:
        the highest priority its jobs may ask for unless an admin submits them (0, "default", unless raised).

        Raises:
            InvalidArgumentError: A bad name, weight or quota.
            PermissionDeniedError: The caller is not an admin (authentication on).
        """
        return QueueInfo.from_proto(
            self._call(self._stub.SetQueue, queue_request(name, quotas, cohort, weight, tenants, max_priority))
        )

    def create_pool(self, name: str, *, tier: str, per_domain: int) -> SparePool:
        """Create an operator's spare pool (admin): `per_domain` whole nodes kept idle in each domain of `tier` for any
        gang there that loses a node. InvalidArgumentError for an unknown tier or a bad count; AlreadyExistsError."""
        request = scheduler_pb2.CreatePoolRequest(name=name, tier=tier, per_domain=per_domain)
        return SparePool.from_proto(self._call(self._stub.CreatePool, request))

    def pools(self, name: str = "") -> list[SparePool]:
        """The spare pools (or `name`), per domain: booked, lent and missing nodes."""
        response = self._call(self._stub.ListPools, scheduler_pb2.ListPoolsRequest(name=name))
        return [SparePool.from_proto(p) for p in response.pools]

    def delete_pool(self, name: str) -> None:
        """Delete a spare pool (admin); NotFoundError for an unknown name."""
        self._call(self._stub.DeletePool, scheduler_pb2.DeletePoolRequest(name=name))

    def delete_queue(self, name: str) -> None:
        """Remove a queue (admin); FailedPreconditionError while it has pending or running jobs."""
        self._call(self._stub.DeleteQueue, scheduler_pb2.DeleteQueueRequest(name=name))

    def undrain_node(self, name: str) -> Node:
        """Undo :meth:`drain_node` (admin): the node is READY again if its agent is alive.

        Raises:
            NotFoundError: No such node.
            PermissionDeniedError: The caller is not an admin (authentication on).
        """
        return Node.from_proto(self._call(self._stub.UndrainNode, scheduler_pb2.UndrainNodeRequest(node_name=name)))

    def watch(
        self, job_ids: Iterable[str] | str | None = None, *, timeout: float | None = None
    ) -> Generator[Job, None, None]:
        """Stream the current state of each job, then every change.

        Opening the stream is retried on UNAVAILABLE by gRPC's retry policy, like any call. A stream that breaks
        with UNAVAILABLE after it has delivered (a scheduler restart) is re-opened, unless ``retries`` is 0 (the
        scheduler re-sends current states; repeats of an unchanged job are dropped). Closing the iterator hangs up.

        Args:
            job_ids: Jobs to watch (one id or several); None or empty: every job.
            timeout: Give up after this many seconds (DeadlineExceededError); None: never.

        Yields:
            A :class:`Job` per state the scheduler reports.

        Raises:
            DeadlineExceededError: ``timeout`` passed.
            UnavailableError: The scheduler could not be reached, even after retries.
        """
        request = scheduler_pb2.WatchJobsRequest(job_ids=watch_ids(job_ids))
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        last: dict[str, Job] = {}
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceededError(f"watch did not finish within {timeout:g}s")
            call = self._stub.WatchJobs(request, timeout=remaining)
            delivered = False
            try:
                for event in call:
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
                        time.sleep(delay)
                        continue
                raise from_grpc_error(exc, self.target) from exc
            finally:
                call.cancel()

    def wait(
        self,
        job_id: str,
        states: Iterable[str | JobState] | str | JobState | None = None,
        *,
        timeout: float | None = None,
    ) -> Job:
        """Block until a job reaches one of ``states`` (default: SUCCEEDED, FAILED or CANCELLED).

        Args:
            job_id: The job's id.
            states: Target states; None: the terminal ones.
            timeout: Give up after this many seconds; None: wait forever.

        Returns:
            The job in the first matching state.

        Raises:
            NotFoundError: No such job.
            DeadlineExceededError: The job did not get there within ``timeout``.
        """
        targets = set(parse_states(states)) or set(TERMINAL_STATES)
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        job = self.get_job(job_id)
        while job.state not in targets:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise wait_timeout_error(job_id, targets, timeout)
            stream = self.watch([job_id], timeout=remaining)
            try:
                for job in stream:
                    if job.id == job_id and job.state in targets:
                        return job
            except DeadlineExceededError:
                raise wait_timeout_error(job_id, targets, timeout) from None
            finally:
                stream.close()
            # The server ended the stream: look again, then re-watch.
            job = self.get_job(job_id)
            if job.state not in targets:
                time.sleep(min(BACKOFF_MAX, 0.2))
        return job
