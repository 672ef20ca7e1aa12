"""A job's page on the dashboard, in three parts fetched apart so that the page draws at once.

`/api/job/ID` is the job itself (one GetJob); the page draws it as soon as it comes. Its committed checkpoints
(`/api/job/ID/checkpoints`, from the checkpoint coordinator) and its rank 0's last log lines (`/api/job/ID/logs`, from
the rank's node agent) come after, each with a bounded wait, and fill their places on the page: a slow coordinator
or an agent that does not answer delays only its own part, never the page.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import grpc

from phalanx.client import Client, Job, PhalanxError, open_channel

CHECKPOINTS_TIMEOUT_S = 5.0  # the coordinator's ListCheckpoints deadline
LOG_TAIL_S = 5.0  # how long the log part waits for the rank's node agent
LOG_LINES = 50


def job_detail(j: Job, view: dict[str, Any]) -> dict[str, Any]:
    """The job page's first part: `view` (the jobs list's entry) with the job's spec, counts and goodput."""
    return dict(
        view,
        spec={
            "replicas": j.replicas,
            "gpus_per_replica": j.gpus_per_replica,
            "command": j.command,
            "required_tier": j.required_tier,
            "time_limit": j.time_limit,
        },
        failures=j.failures,
        preemptions=j.preemptions,
        restore=j.restore,
        goodput=j.goodput.to_dict() if j.goodput else None,
        placement=j.placement,
    )


def checkpoints(coordinator: str | None, token: str, job_id: str) -> list[dict[str, Any]] | str:
    """The job's newest committed checkpoints from the coordinator (a string says why there are none). The call
    carries the visitor's token: the coordinator answers for that tenant's jobs only."""
    if not coordinator:
        return "not shown: phalanx web --checkpoint-coordinator ADDR shows them"
    from phalanx.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc

    channel = open_channel(coordinator, token=token, retries=0)
    try:
        stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(channel)  # type: ignore[no-untyped-call]
        got = stub.ListCheckpoints(
            checkpoint_pb2.ListCheckpointsRequest(job_id=job_id, page_size=20), timeout=CHECKPOINTS_TIMEOUT_S
        )
    except grpc.RpcError as exc:
        return f"the coordinator did not answer: {exc.code().name}"
    finally:
        channel.close()
    return [
        {"step": c.step, "attempt": c.attempt, "committed_at": c.committed_at, "shards": len(c.shards)}
        for c in got.checkpoints
    ]


def log_tail(client: Client, job_id: str, lines: int = LOG_LINES, within_s: float = LOG_TAIL_S) -> list[str]:
    """Rank 0's last `lines` log lines, or one line saying why there are none, within `within_s` seconds.

    The read runs in a thread of its own: the agent's log stream has no deadline of its own (Client.logs), so an
    agent that accepts and then says nothing would hold the request. Past the bound the answer says so; the
    thread ends with the stream (the agent's answer, or gRPC's connection timeout), or at once when the caller
    closes `client` (its calls then fail)."""
    answer: queue.Queue[list[str]] = queue.Queue(maxsize=1)

    def read() -> None:
        try:
            answer.put([f"[rank {r}] {line}" for r, line in client.logs(job_id, rank=0, tail=lines)])
        except (PhalanxError, grpc.RpcError, ValueError) as exc:  # ValueError: the client was closed meanwhile
            answer.put([f"(no log: {exc})"])

    threading.Thread(target=read, name="web-log-tail", daemon=True).start()
    try:
        return answer.get(timeout=within_s)
    except queue.Empty:
        return [f"(no log within {within_s:g} s: the rank's node agent did not answer)"]
