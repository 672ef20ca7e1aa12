"""Retries of UNAVAILABLE are gRPC's retry policy (the channel's service config), not loops in Python: real gRPC
servers on 127.0.0.1 answer UNAVAILABLE a few times, then OK. gRPC marks each retry of a call with the
``grpc-previous-rpc-attempts`` header, which a call made again by Python would not carry."""

from __future__ import annotations

import contextlib
import threading
from concurrent import futures

import grpc
import pytest

from phalanx import train
from phalanx.api.v1 import checkpoint_pb2 as cpb
from phalanx.api.v1 import checkpoint_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.client import AsyncClient, Client, JobState, UnavailableError
from phalanx.client._channel import MAX_RETRIES

pytestmark = pytest.mark.timeout(30)

PREVIOUS_ATTEMPTS = "grpc-previous-rpc-attempts"


class Flaky(scheduler_pb2_grpc.SchedulerServicer):
    """SubmitJob and ListNodes answer the next ``fail`` attempts with UNAVAILABLE, then OK. Every attempt is recorded:
    its request id (SubmitJob) and its grpc-previous-rpc-attempts header (None on a first attempt)."""

    def __init__(self) -> None:
        self.fail = 0
        self.lock = threading.Lock()
        self.attempts: list[tuple[str, str | None]] = []  # (request id or method, previous attempts)

    def _attempt(self, key: str, context) -> None:
        previous = dict(context.invocation_metadata()).get(PREVIOUS_ATTEMPTS)
        with self.lock:
            self.attempts.append((key, previous))
            failing = self.fail > 0
            self.fail -= failing
        if failing:
            context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is restarting")

    def SubmitJob(self, request, context):
        self._attempt(request.request_id, context)
        return common_pb2.Job(id="job-1", spec=request.spec, state=common_pb2.JOB_STATE_PENDING)

    def ListNodes(self, request, context):
        self._attempt("ListNodes", context)
        return scheduler_pb2.ListNodesResponse(nodes=[common_pb2.Node(name="gpu-a")])


@contextlib.contextmanager
def serve(servicer, add=scheduler_pb2_grpc.add_SchedulerServicer_to_server):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture
def flaky():
    servicer = Flaky()
    with serve(servicer) as (_, address):
        yield servicer, address


def test_submit_is_retried_by_the_policy_with_one_request_id(flaky):
    servicer, address = flaky
    servicer.fail = 2
    with Client(address, timeout=5, retries=2) as c:
        job = c.submit("train", 1, 8, ["python", "train.py"])
    assert job.id == "job-1" and job.state is JobState.PENDING
    ids = [key for key, _ in servicer.attempts]
    assert len(ids) == 3 and len(set(ids)) == 1 and len(ids[0]) == 32  # one uuid4 hex key in every attempt
    # The attempts are one call retried by gRPC: the first has no header, the retries count the earlier attempts.
    assert [previous for _, previous in servicer.attempts] == [None, "1", "2"]


def test_no_retries_fails_at_once_and_too_few_fail_after_them(flaky):
    servicer, address = flaky
    servicer.fail = 2
    with Client(address, timeout=5, retries=0) as c, pytest.raises(UnavailableError) as info:
        c.submit("train", 1, 8, ["true"])
    assert info.value.message == "scheduler is restarting"
    assert [previous for _, previous in servicer.attempts] == [None]

    servicer.attempts.clear()
    servicer.fail = 2
    with Client(address, timeout=5, retries=1) as c, pytest.raises(UnavailableError):
        c.nodes()
    assert servicer.attempts == [("ListNodes", None), ("ListNodes", "1")]


def test_retries_above_grpcs_cap_are_clamped_quietly(flaky, capfd):
    servicer, address = flaky
    servicer.fail = 100
    with Client(address, timeout=5, retries=9) as c:
        assert c.retries == MAX_RETRIES == 4
        with pytest.raises(UnavailableError):
            c.nodes()
    assert len(servicer.attempts) == MAX_RETRIES + 1
    assert "clamped" not in capfd.readouterr().err  # gRPC logs an error line when it has to clamp itself


def test_the_retries_fit_in_a_short_deadline(flaky):
    """The backoffs are shortened to half the timeout: the last attempt's UNAVAILABLE comes before the deadline."""
    servicer, address = flaky
    servicer.fail = 100
    with Client(address, timeout=0.5, retries=4) as c, pytest.raises(UnavailableError):
        c.nodes()
    assert len(servicer.attempts) == 5


async def test_async_client_uses_the_policy_too(flaky):
    servicer, address = flaky
    servicer.fail = 2
    async with AsyncClient(address, timeout=5, retries=2) as c:
        await c.submit("train", 1, 8, ["true"])
    assert len({key for key, _ in servicer.attempts}) == 1
    assert [previous for _, previous in servicer.attempts] == [None, "1", "2"]
    servicer.attempts.clear()
    servicer.fail = 1
    async with AsyncClient(address, timeout=5, retries=0) as c:
        with pytest.raises(UnavailableError):
            await c.nodes()
    assert servicer.attempts == [("ListNodes", None)]


def test_a_replica_list_still_fails_over():
    """host1:port,host2:port with the retry policy on the channel: when the replica in use goes away, the next call
    reaches the other (pick_first moves on; a call made while it reconnects waits for it)."""
    first, second = Flaky(), Flaky()
    with serve(first) as (server1, address1), serve(second) as (_, address2):
        with Client(f"{address1},{address2}", timeout=5, retries=4) as c:
            assert [n.name for n in c.nodes()] == ["gpu-a"] and len(first.attempts) == 1
            server1.stop(0).wait()
            assert [n.name for n in c.nodes()] == ["gpu-a"]
    assert len(first.attempts) == 1 and len(second.attempts) == 1


class FlakyCoordinator(checkpoint_pb2_grpc.CheckpointCoordinatorServicer):
    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.attempts: list[str | None] = []

    def GetCheckpointRequest(self, request, context):
        self.attempts.append(dict(context.invocation_metadata()).get(PREVIOUS_ATTEMPTS))
        if self.fail > 0:
            self.fail -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "coordinator is restarting")
        return cpb.CheckpointRequestState(requested=True, requested_at=1.0)


@pytest.mark.parametrize("retries,fail,requested", [(2, 2, True), (0, 1, False)])
def test_checkpointer_calls_are_retried_by_the_policy(tmp_path, monkeypatch, retries, fail, requested):
    from phalanx.train import _checkpointer

    monkeypatch.setattr(_checkpointer, "RETRIES", retries)
    coordinator = FlakyCoordinator(fail)
    with serve(coordinator, checkpoint_pb2_grpc.add_CheckpointCoordinatorServicer_to_server) as (_, address):
        env = {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "PHALANX_JOB_ID": "job-1",
            "PHALANX_ATTEMPT": "0",
            "PHALANX_CHECKPOINT_ADDR": address,
            "PHALANX_CHECKPOINT_DIR": str(tmp_path),
        }
        with train.Checkpointer(env, timeout=5) as c:
            # An older coordinator's request (agreeing unset) is acted on at once: True when the poll got through.
            assert c.should_checkpoint(1) is requested
    assert coordinator.attempts == [None, "1", "2"][: retries + 1]


class BrokenWatch(scheduler_pb2_grpc.SchedulerServicer):
    """WatchJobs: the first stream sends the job PENDING, then breaks with UNAVAILABLE (after headers: gRPC has
    committed to it, so this is not a call to retry but a session to resume); the next sends it SUCCEEDED."""

    def __init__(self) -> None:
        self.streams = 0

    def WatchJobs(self, request, context):
        self.streams += 1
        state = common_pb2.JOB_STATE_PENDING if self.streams == 1 else common_pb2.JOB_STATE_SUCCEEDED
        yield scheduler_pb2.JobEvent(job=common_pb2.Job(id="job-1", state=state))
        if self.streams == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is restarting")


@pytest.mark.parametrize("retries", [2, 0])
def test_watch_resumes_a_broken_stream_unless_retries_is_0(retries):
    servicer = BrokenWatch()
    with serve(servicer) as (_, address), Client(address, timeout=5, retries=retries) as c:
        seen = []
        with pytest.raises(UnavailableError) if retries == 0 else contextlib.nullcontext():
            for job in c.watch("job-1", timeout=5):
                seen.append(job.state)
                if job.terminal:
                    break
    assert seen == ([JobState.PENDING, JobState.SUCCEEDED] if retries else [JobState.PENDING])
    assert servicer.streams == (2 if retries else 1)
