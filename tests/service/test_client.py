"""The SDK against a real gRPC server on 127.0.0.1 (an in-test fake scheduler): typed results, error mapping,
retries of UNAVAILABLE (submit keeps its request id), deadlines, watch/wait, and AsyncClient parity."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from concurrent import futures
from dataclasses import FrozenInstanceError

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.ports import closed_address

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.client import (
    Allocation,
    AsyncClient,
    CheckpointResult,
    Client,
    DeadlineExceededError,
    FailedPreconditionError,
    Goodput,
    GoodputReport,
    InvalidArgumentError,
    Job,
    JobGoodput,
    JobState,
    Node,
    NodeState,
    NotFoundError,
    PermissionDeniedError,
    PhalanxError,
    ResourceExhaustedError,
    RPCError,
    UnauthenticatedError,
    UnavailableError,
)
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(30)

JOB_KEYS = {
    "id",
    "name",
    "state",
    "replicas",
    "gpus_per_replica",
    "priority",
    "procs_per_replica",
    "command",
    "attempt",
    "message",
    "exit_code",
    "submitted_at",
    "started_at",
    "finished_at",
    "placement",
    "allocations",
    "failures",
    "preemptions",
    "not_before",
    "preempted_by",
    "preempt_deadline",
    "goodput",
    "max_restarts",
    "time_limit",
    "tenant",
    "queue",
    "flavor",
    # job graphs (issue 34)
    "after",
    "waiting_for",
    "array_spec",
    "array",
    "array_parent",
    "array_task",
}
GOODPUT_KEYS = {"allocated", "productive", "rollback", "restart", "waiting", "ratio"}


# -- a fake scheduler: a real gRPC server holding jobs in a dict -------------------------------------------------


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Just enough of the Scheduler service to exercise the SDK and the CLI.

    Knobs: ``fail[method] = n`` answers the next n calls of that method with UNAVAILABLE; ``delay[method]`` sleeps
    before answering; ``force[method] = (code, message)`` always fails with that status.
    """

    def __init__(self) -> None:
        self.jobs: dict[str, common_pb2.Job] = {}
        self.by_request: dict[str, str] = {}
        self.calls: dict[str, int] = {}
        self.request_ids: list[str] = []
        self.fail: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        self.force: dict[str, tuple[grpc.StatusCode, str]] = {}
        self.cond = threading.Condition()
        self.seq = 0
        self.events = 0  # JobEvents WatchJobs has sent, all streams together (wait_events)
        self.checkpoints: dict[str, str] = {}  # job id -> the outstanding request's reason
        self.goodput_requests: list[tuple[float, int]] = []
        self.nodes = [
            common_pb2.Node(
                name="gpu-a",
                state=common_pb2.NODE_STATE_READY,
                gpus=8,
                free_gpus=6,
                profile="dgx",
                gpu_model="H100",
                fabric_path=["leaf0", "spine0"],
                last_heartbeat=time.time(),
                address="10.0.0.1:7000",
            ),
            common_pb2.Node(
                name="gpu-b", state=common_pb2.NODE_STATE_DRAINED, gpus=8, free_gpus=8, message="maintenance"
            ),
        ]

    def _enter(self, method: str, context) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.delay.get(method):
            time.sleep(self.delay[method])
        if self.fail.get(method, 0) > 0:
            self.fail[method] -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is restarting")
        if method in self.force:
            context.abort(*self.force[method])

    def _job(self, job_id: str, context) -> common_pb2.Job:
        if job_id not in self.jobs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"job {job_id} not found")
        return self.jobs[job_id]

    def add_job(self, name="j", replicas=1, gpus=1, state=common_pb2.JOB_STATE_PENDING, **kw) -> common_pb2.Job:
        with self.cond:
            self.seq += 1
            job = common_pb2.Job(
                id=f"job-{self.seq:04d}",
                spec=common_pb2.JobSpec(
                    name=name,
                    replicas=replicas,
                    gpus_per_replica=gpus,
                    command=kw.pop("command", ["true"]),
                    priority=kw.pop("priority", 0),
                ),
                state=state,
                submitted_at=time.time() - 90 + self.seq,
                **kw,
            )
            self.jobs[job.id] = job
            self.cond.notify_all()
            return job

    def update(self, job_id: str, **fields) -> None:
        with self.cond:
            job = self.jobs[job_id]
            for key, value in fields.items():
                if key == "allocations":
                    del job.allocations[:]
                    job.allocations.extend(value)
                else:
                    setattr(job, key, value)
            self.cond.notify_all()

    # -- RPCs --

    def SubmitJob(self, request, context):
        self.request_ids.append(request.request_id)  # every attempt, including those answered UNAVAILABLE
        self._enter("SubmitJob", context)
        if request.spec.replicas <= 0 or request.spec.gpus_per_replica <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "replicas and gpus_per_replica must be positive")
        if request.spec.name == "refused-by-server":  # a request only the server can refuse
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused by the server")
        if request.request_id in self.by_request:
            return self.jobs[self.by_request[request.request_id]]
        job = self.add_job(request.spec.name, request.spec.replicas, request.spec.gpus_per_replica)
        job.spec.CopyFrom(request.spec)
        self.by_request[request.request_id] = job.id
        return job

    def GetJob(self, request, context):
        self._enter("GetJob", context)
        return self._job(request.job_id, context)

    def ListJobs(self, request, context):
        self._enter("ListJobs", context)
        jobs = sorted(self.jobs.values(), key=lambda j: j.submitted_at, reverse=True)
        if request.states:
            jobs = [j for j in jobs if j.state in set(request.states)]
        return scheduler_pb2.ListJobsResponse(jobs=jobs)

    def CancelJob(self, request, context):
        self._enter("CancelJob", context)
        job = self._job(request.job_id, context)
        if job.state in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {job.id} already finished")
        self.update(job.id, state=common_pb2.JOB_STATE_CANCELLED, message="cancelled by user", finished_at=time.time())
        return job

    def CheckpointJob(self, request, context):
        self._enter("CheckpointJob", context)
        job = self._job(request.job_id, context)
        if job.state not in (common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_PREEMPTING):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {job.id} is not running")
        reason = self.checkpoints.setdefault(job.id, request.reason or "user")  # an earlier request is kept
        return scheduler_pb2.CheckpointJobResponse(job=job, reason=reason, requested_at=1_700_000_000.0)

    def GetGoodput(self, request, context):
        """Every job: 1 GPU-hour allocated, 3/4 of it productive, an eighth each of rollback and restart."""
        self._enter("GetGoodput", context)
        self.goodput_requests.append((request.since, request.limit))
        per_job = dict(allocated=3600.0, productive=2700.0, rollback=450.0, restart=450.0, waiting=900.0)
        jobs = sorted(
            (j for j in self.jobs.values() if j.submitted_at >= request.since),
            key=lambda j: j.submitted_at,
            reverse=True,
        )
        n = len(jobs)
        return scheduler_pb2.GetGoodputResponse(
            cluster=common_pb2.Goodput(**{k: v * n for k, v in per_job.items()}, ratio=0.75 if n else 1.0),
            job_count=n,
            jobs=[
                scheduler_pb2.JobGoodput(
                    job_id=j.id,
                    name=j.spec.name,
                    state=j.state,
                    attempts=1,
                    goodput=common_pb2.Goodput(**per_job, ratio=0.75),
                )
                for j in jobs[: request.limit or 100]
            ],
        )

    def ListNodes(self, request, context):
        self._enter("ListNodes", context)
        return scheduler_pb2.ListNodesResponse(nodes=self.nodes)

    def WatchJobs(self, request, context):
        self._enter("WatchJobs", context)
        sent: dict[str, bytes] = {}
        while context.is_active():
            with self.cond:
                ids = list(request.job_ids) or list(self.jobs)
                changed = [
                    self.jobs[i] for i in ids if i in self.jobs and sent.get(i) != self.jobs[i].SerializeToString()
                ]
                snapshot = [
                    (j.id, j.SerializeToString(), common_pb2.Job.FromString(j.SerializeToString())) for j in changed
                ]
                if not snapshot:
                    self.cond.wait(0.05)
            for job_id, raw, job in snapshot:
                sent[job_id] = raw
                yield scheduler_pb2.JobEvent(job=job)
                with self.cond:
                    self.events += 1
                    self.cond.notify_all()

    def wait_events(self, count: int, timeout: float = 20.0) -> None:
        """Block until WatchJobs has sent `count` events in all (a test drives the next change only once the
        watcher has seen the previous one, however slow the machine)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.events >= count, timeout):
                raise AssertionError(f"only {self.events} of {count} watch events sent within {timeout:g}s")


@contextlib.contextmanager
def serve_fake():
    """Start a FakeScheduler on 127.0.0.1 (port 0); yields (servicer, "127.0.0.1:PORT")."""
    servicer = FakeScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def closed_port_address() -> str:
    return closed_address()


@pytest.fixture
def fake():
    with serve_fake() as pair:
        yield pair


@pytest.fixture
def client(fake):
    _, address = fake
    with Client(address, timeout=5) as c:
        yield c


def later(delay: float, fn, *args, **kwargs) -> threading.Timer:
    t = threading.Timer(delay, fn, args, kwargs)
    t.start()
    return t


# -- typed conversion --------------------------------------------------------------------------------------------


def _full_job_proto() -> common_pb2.Job:
    return common_pb2.Job(
        id="j1",
        spec=common_pb2.JobSpec(
            name="train",
            replicas=2,
            gpus_per_replica=4,
            priority=7,
            procs_per_replica=1,
            command=["python", "train.py"],
            env={"A": "1"},
        ),
        state=common_pb2.JOB_STATE_RUNNING,
        allocations=[
            common_pb2.Allocation(replica=0, node="n1", gpus=[0, 1, 2, 3]),
            common_pb2.Allocation(replica=1, node="n2", gpus=[4, 5, 6, 7]),
        ],
        attempt=2,
        message="running",
        submitted_at=100.5,
        started_at=101.0,
        exit_code=0,
        placement=common_pb2.PlacementInfo(tier="leaf", domains=2, score=1.5, reason="two nodes under leaf0"),
    )


def test_job_from_proto_is_typed_and_to_dict_is_the_cli_shape():
    job = Job.from_proto(_full_job_proto())
    assert job.state is JobState.RUNNING and job.state == "RUNNING" and not job.terminal
    assert job.allocations == [Allocation(0, "n1", [0, 1, 2, 3]), Allocation(1, "n2", [4, 5, 6, 7])]
    assert job.nodes == ("n1", "n2") and job.total_gpus == 8
    with pytest.raises(FrozenInstanceError):
        job.state = JobState.FAILED  # type: ignore[misc]

    d = job.to_dict()
    assert JOB_KEYS <= set(d)
    assert d["id"] == "j1" and d["state"] == "RUNNING" and d["priority"] == 7 and isinstance(d["priority"], int)
    assert d["allocations"] == [
        {"replica": 0, "node": "n1", "gpus": [0, 1, 2, 3]},
        {"replica": 1, "node": "n2", "gpus": [4, 5, 6, 7]},
    ]
    assert d["command"] == ["python", "train.py"] and d["procs_per_replica"] == 1 and d["attempt"] == 2
    assert d["placement"] == {"tier": "leaf", "domains": 2, "score": 1.5, "reason": "two nodes under leaf0"}
    assert d["finished_at"] == 0.0 and d["started_at"] == 101.0
    assert json.loads(json.dumps(d)) == d


@pytest.mark.parametrize(
    "number,name",
    [
        (1, "PENDING"),
        (2, "RUNNING"),
        (3, "SUCCEEDED"),
        (4, "FAILED"),
        (5, "CANCELLED"),
        (6, "PREEMPTED"),
        (7, "PREEMPTING"),
    ],
)
def test_every_proto_job_state_converts(number, name):
    assert common_pb2.JobState.Name(number) == f"JOB_STATE_{name}"
    job = Job.from_proto(common_pb2.Job(id="x", state=number))
    assert job.state.value == name and job.to_dict()["state"] == name
    assert job.terminal == (name in {"SUCCEEDED", "FAILED", "CANCELLED"})


def test_recovery_preemption_and_goodput_fields():
    msg = _full_job_proto()
    job = Job.from_proto(msg)
    assert (job.failures, job.preemptions, job.not_before, job.preempted_by, job.preempt_deadline) == (
        0,
        0,
        0.0,
        "",
        0.0,
    )
    assert job.goodput is None and job.to_dict()["goodput"] is None  # ListJobs, SubmitJob, watch: not filled
    msg.state = common_pb2.JOB_STATE_PREEMPTING
    msg.failures, msg.preemptions, msg.not_before = 2, 1, 123.5
    msg.preempted_by, msg.preempt_deadline = "abcdef012345", 456.25
    msg.goodput.CopyFrom(
        common_pb2.Goodput(allocated=100, productive=70, rollback=20, restart=10, waiting=5, ratio=0.7)
    )
    job = Job.from_proto(msg)
    assert job.state is JobState.PREEMPTING and not job.terminal
    assert job.goodput == Goodput(100.0, 70.0, 20.0, 10.0, 5.0, 0.7)
    d = job.to_dict()
    assert JOB_KEYS <= set(d)
    assert (d["state"], d["failures"], d["preemptions"], d["not_before"], d["preempted_by"], d["preempt_deadline"]) == (
        "PREEMPTING",
        2,
        1,
        123.5,
        "abcdef012345",
        456.25,
    )
    assert d["goodput"] == {
        "allocated": 100.0,
        "productive": 70.0,
        "rollback": 20.0,
        "restart": 10.0,
        "waiting": 5.0,
        "ratio": 0.7,
    }
    assert json.loads(json.dumps(d)) == d
    # goodput grows while a job runs: it takes no part in equality (watch drops repeats by equality)
    msg.goodput.allocated = 200
    assert Job.from_proto(msg) == job
    msg.ClearField("goodput")
    assert Job.from_proto(msg) == job


def test_job_state_parse_accepts_any_spelling():
    assert JobState.parse("running") is JobState.RUNNING
    assert JobState.parse("JOB_STATE_FAILED") is JobState.FAILED
    assert JobState.parse("preempting") is JobState.PREEMPTING
    with pytest.raises(ValueError, match="unknown job state"):
        JobState.parse("DONE")


def test_node_from_proto_and_to_dict():
    node = Node.from_proto(
        common_pb2.Node(
            name="n1",
            state=common_pb2.NODE_STATE_LOST,
            gpus=8,
            free_gpus=0,
            fabric_path=["leaf1", "spine0"],
            message="lease expired",
            cpus=192,
            memory_bytes=2 << 40,
            free_cpus=64.5,
            free_memory_bytes=1 << 40,
        )
    )
    assert node.state is NodeState.LOST
    d = node.to_dict()
    assert {"name", "gpus", "free_gpus", "state"} <= set(d)
    assert d == {
        "name": "n1",
        "gpus": 8,
        "free_gpus": 0,
        "state": "LOST",
        "profile": "",
        "gpu_model": "",
        "fabric_path": ["leaf1", "spine0"],
        "message": "lease expired",
        "last_heartbeat": 0.0,
        "address": "",
        "shared_gpus": 0,
        "health": "UNSPECIFIED",
        "health_reason": "",
        "unhealthy_gpus": {},
        "gpu_details": [],
        "strikes": 0,
        "mig_manage": False,
        "containment": "",
        "releasing_gpus": 0,
        "cpus": 192.0,
        "memory_bytes": 2 << 40,
        "free_cpus": 64.5,
        "free_memory_bytes": 1 << 40,
    }
    mig = Node.from_proto(
        common_pb2.Node(
            name="n2",
            gpus=2,
            strikes=3,
            mig_manage=True,
            gpu_details=[
                common_pb2.NodeGpu(
                    index=0, name="H100", mig_mode="disabled", mig_mode_pending="enabled", mig_switching=True
                ),
                common_pb2.NodeGpu(
                    index=1,
                    name="H100",
                    mig_mode="enabled",
                    mig_instances=[
                        common_pb2.NodeMigInstance(
                            profile="3g.40gb",
                            start=4,
                            size=4,
                            uuid="MIG-x",
                            managed=False,
                            gpu_instance_id=2,
                            compute_instance_id=0,
                        )
                    ],
                ),
            ],
        )
    )
    d = mig.to_dict()
    assert mig.mig_gpus == [1] and d["strikes"] == 3 and d["mig_manage"] is True
    assert [g["mig_mode"] for g in d["gpu_details"]] == ["disabled", "enabled"]
    assert [(g["mig_mode_pending"], g["mig_switching"], g["mig_switch_error"]) for g in d["gpu_details"]] == [
        ("enabled", True, ""),
        ("", False, ""),
    ]
    assert d["gpu_details"][1]["mig_instances"] == [
        {
            "profile": "3g.40gb",
            "start": 4,
            "size": 4,
            "uuid": "MIG-x",
            "managed": False,
            "gpu_instance_id": 2,
            "compute_instance_id": 0,
        }
    ]
    assert json.loads(json.dumps(d)) == d


# -- the API against the fake ------------------------------------------------------------------------------------


def test_target_defaults_to_env_then_localhost(monkeypatch):
    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    with Client() as c:
        assert c.target == "127.0.0.1:50051"
    monkeypatch.setenv("PHALANX_SCHEDULER", "sched:1234")
    with Client() as c:
        assert c.target == "sched:1234"
    with Client("other:1") as c:
        assert c.target == "other:1"


def test_submit_get_list_cancel_nodes(fake, client):
    servicer, _ = fake
    job = client.submit(
        "train",
        2,
        4,
        ["python", "train.py", "--lr", "3e-4"],
        priority=5,
        procs_per_replica=1,
        env={"NCCL_DEBUG": "INFO"},
    )
    assert isinstance(job, Job) and job.state is JobState.PENDING
    assert (job.name, job.replicas, job.gpus_per_replica, job.priority, job.procs_per_replica) == ("train", 2, 4, 5, 1)
    assert job.command == ["python", "train.py", "--lr", "3e-4"] and job.env == {"NCCL_DEBUG": "INFO"}
    assert len(servicer.request_ids[0]) == 32  # a uuid4 hex idempotency key was generated

    other = client.submit("eval", 1, 1, "python eval.py --fast")
    assert other.command == ["python", "eval.py", "--fast"]
    assert client.get_job(job.id) == job
    assert [j.id for j in client.list_jobs()] == [other.id, job.id]  # the server's order: newest first

    servicer.update(other.id, state=common_pb2.JOB_STATE_RUNNING)
    assert [j.id for j in client.list_jobs(["RUNNING"])] == [other.id]
    assert [j.id for j in client.list_jobs(JobState.PENDING)] == [job.id]

    cancelled = client.cancel(job.id)
    assert cancelled.state is JobState.CANCELLED and cancelled.message == "cancelled by user"

    nodes = client.nodes()
    assert [(n.name, n.state, n.free_gpus) for n in nodes] == [
        ("gpu-a", NodeState.READY, 6),
        ("gpu-b", NodeState.DRAINED, 8),
    ]
    assert nodes[0].fabric_path == ["leaf0", "spine0"]


def test_checkpoint_and_goodput(fake, client):
    servicer, _ = fake
    running = servicer.add_job("train", state=common_pb2.JOB_STATE_RUNNING)
    pending = servicer.add_job("waits")
    result = client.checkpoint(running.id)
    assert isinstance(result, CheckpointResult)
    assert result.job.id == running.id and result.job.state is JobState.RUNNING
    assert (result.reason, result.requested_at) == ("user", 1_700_000_000.0)
    assert client.checkpoint(running.id, reason="again").reason == "user"  # the earlier request is kept
    assert result.to_dict()["job"] == result.job.to_dict() and result.to_dict()["job_id"] == running.id
    with pytest.raises(FailedPreconditionError):
        client.checkpoint(pending.id)
    with pytest.raises(NotFoundError):
        client.checkpoint("nope")

    report = client.goodput()
    assert isinstance(report, GoodputReport) and servicer.goodput_requests == [(0.0, 0)]
    assert report.job_count == 2 and report.cluster == Goodput(7200.0, 5400.0, 900.0, 900.0, 1800.0, 0.75)
    assert [j.job_id for j in report.jobs] == [pending.id, running.id]
    assert report.jobs[1] == JobGoodput(
        running.id, "train", JobState.RUNNING, Goodput(3600.0, 2700.0, 450.0, 450.0, 900.0, 0.75), 1
    )
    d = report.to_dict()
    assert set(d) == {"cluster", "job_count", "jobs", "tenants", "queues", "next_page_token"}
    assert set(d["cluster"]) == GOODPUT_KEYS and (d["tenants"], d["queues"], d["next_page_token"]) == ([], [], "")
    assert d["jobs"][1] == {
        "job_id": running.id,
        "name": "train",
        "state": "RUNNING",
        "attempts": 1,
        "goodput": report.jobs[1].goodput.to_dict(),
    }
    assert len(client.goodput(since=time.time() + 60).jobs) == 0
    assert [j.job_id for j in client.goodput(limit=1).jobs] == [pending.id]
    assert servicer.goodput_requests[-1] == (0.0, 1)

    servicer.fail["CheckpointJob"] = 1  # idempotent (an outstanding request is kept): retried like the rest
    servicer.fail["GetGoodput"] = 1
    assert client.checkpoint(running.id).job.id == running.id and client.goodput().job_count == 2
    assert servicer.calls["CheckpointJob"] == 6 and servicer.calls["GetGoodput"] == 5


def test_explicit_request_id_makes_submit_idempotent(fake, client):
    a = client.submit("x", 1, 1, ["true"], request_id="req-1")
    b = client.submit("x", 1, 1, ["true"], request_id="req-1")
    assert a.id == b.id and len(fake[0].jobs) == 1


def test_not_found_maps_to_not_found_error(client):
    with pytest.raises(NotFoundError) as info:
        client.get_job("nope")
    err = info.value
    assert isinstance(err, RPCError) and isinstance(err, PhalanxError)
    assert err.code is grpc.StatusCode.NOT_FOUND and err.code_name == "NOT_FOUND"
    assert err.message == "job nope not found"


def test_invalid_argument_maps_and_is_not_retried(fake, client):
    with pytest.raises(InvalidArgumentError) as info:
        client.submit("bad", 0, 1, ["true"])
    assert info.value.code_name == "INVALID_ARGUMENT" and "must be positive" in info.value.message
    assert fake[0].calls["SubmitJob"] == 1


@pytest.mark.parametrize(
    "code,cls",
    [
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPreconditionError),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError),
        (grpc.StatusCode.UNAUTHENTICATED, UnauthenticatedError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
        (grpc.StatusCode.INTERNAL, RPCError),
    ],
)
def test_status_codes_map_to_exception_classes(fake, client, code, cls):
    fake[0].force["ListNodes"] = (code, "computer says no")
    with pytest.raises(cls) as info:
        client.nodes()
    assert type(info.value) is cls
    assert info.value.code is code and info.value.code_name == code.name and info.value.message == "computer says no"
    assert fake[0].calls["ListNodes"] == 1


@pytest.mark.parametrize(
    "method,call",
    [
        ("GetJob", lambda c, jid: c.get_job(jid)),
        ("ListJobs", lambda c, jid: c.list_jobs()),
        ("CancelJob", lambda c, jid: c.cancel(jid)),
        ("ListNodes", lambda c, jid: c.nodes()),
    ],
)
def test_unavailable_is_retried_for_idempotent_calls(fake, client, method, call):
    servicer, _ = fake
    job = servicer.add_job()
    servicer.fail[method] = 2
    call(client, job.id)
    assert servicer.calls[method] == 3


def test_submit_is_retried_with_the_same_request_id(fake, client):
    servicer, _ = fake
    servicer.fail["SubmitJob"] = 3
    job = client.submit("train", 1, 8, ["python", "train.py"])
    ids = servicer.request_ids
    assert servicer.calls["SubmitJob"] == 4 and len(ids) == 4
    assert len(set(ids)) == 1 and len(ids[0]) == 32  # one uuid4 hex key, reused by every retry
    assert list(servicer.jobs) == [job.id] and job.state is JobState.PENDING

    client.submit("train", 1, 8, ["python", "train.py"])  # a new call is a new request: a new key
    assert len(set(servicer.request_ids)) == 2 and len(servicer.jobs) == 2


def test_unavailable_gives_up_after_retries(fake):
    servicer, address = fake
    servicer.fail["ListNodes"] = 100
    with Client(address, timeout=5, retries=2) as c, pytest.raises(UnavailableError) as info:
        c.nodes()
    assert servicer.calls["ListNodes"] == 3
    assert info.value.code_name == "UNAVAILABLE" and info.value.message == "scheduler is restarting"

    servicer.calls.clear()
    with Client(address, timeout=5, retries=0) as c, pytest.raises(UnavailableError):
        c.nodes()
    assert servicer.calls["ListNodes"] == 1


def test_unreachable_scheduler_says_so():
    address = closed_port_address()
    # Said at once, not at the deadline: UNAVAILABLE, where waiting for the server would end DEADLINE_EXCEEDED.
    with Client(address, timeout=20, retries=1) as c, pytest.raises(UnavailableError) as info:
        c.list_jobs()
    assert info.value.message.startswith(f"cannot reach scheduler at {address}")


def test_deadline_exceeded(fake):
    servicer, address = fake
    servicer.delay["GetJob"] = 1.0  # it would answer after 1 s: the 0.2 s deadline ends the call first
    job = servicer.add_job()
    with Client(address, timeout=0.2) as c, pytest.raises(DeadlineExceededError) as info:
        c.get_job(job.id)
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and info.value.code_name == "DEADLINE_EXCEEDED"


def test_watch_streams_every_change(fake, client):
    servicer, _ = fake
    job = servicer.add_job("w")

    def drive():  # each change once the watcher has been sent the one before
        servicer.wait_events(1)
        servicer.update(
            job.id,
            state=common_pb2.JOB_STATE_RUNNING,
            allocations=[common_pb2.Allocation(replica=0, node="gpu-a", gpus=[3])],
        )
        servicer.wait_events(2)
        servicer.update(job.id, state=common_pb2.JOB_STATE_SUCCEEDED, exit_code=0)

    later(0, drive)
    seen = []
    stream = client.watch(job.id, timeout=5)
    for update in stream:
        seen.append(update)
        if update.terminal:
            break
    stream.close()
    assert [u.state for u in seen] == [JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED]
    assert seen[1].allocations == [Allocation(0, "gpu-a", [3])]


def test_watch_resumes_after_unavailable(fake, client):
    servicer, _ = fake
    job = servicer.add_job("w", state=common_pb2.JOB_STATE_RUNNING)
    servicer.fail["WatchJobs"] = 1
    it = client.watch([job.id], timeout=5)
    first = next(it)
    assert first.state is JobState.RUNNING and servicer.calls["WatchJobs"] == 2
    it.close()


def test_wait_returns_the_terminal_job(fake, client):
    servicer, _ = fake
    job = servicer.add_job("w")
    later(0.1, servicer.update, job.id, state=common_pb2.JOB_STATE_RUNNING)
    later(0.3, servicer.update, job.id, state=common_pb2.JOB_STATE_FAILED, exit_code=3, message="rank 0 exited 3")
    done = client.wait(job.id, timeout=5)
    assert done.state is JobState.FAILED and done.exit_code == 3 and done.message == "rank 0 exited 3"


def test_wait_for_a_chosen_state_and_timeout(fake, client):
    servicer, _ = fake
    job = servicer.add_job("w")
    later(0.1, servicer.update, job.id, state=common_pb2.JOB_STATE_RUNNING)
    assert client.wait(job.id, states=["RUNNING"], timeout=5).state is JobState.RUNNING
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="did not reach"):
        client.wait(job.id, timeout=0.3)
    assert time.monotonic() - start >= 0.3  # it waited its timeout (and then gave up: the job never finishes)
    with pytest.raises(NotFoundError):
        client.wait("nope", timeout=1)


# -- AsyncClient parity ------------------------------------------------------------------------------------------


async def test_async_client_parity(fake):
    servicer, address = fake
    async with AsyncClient(address, timeout=5) as c:
        job = await c.submit("train", 2, 4, ["python", "train.py"], priority=3, env={"A": "1"})
        assert job.state is JobState.PENDING and job.priority == 3 and job.env == {"A": "1"}
        assert await c.get_job(job.id) == job
        assert [j.id for j in await c.list_jobs(["PENDING"])] == [job.id]
        assert [n.name for n in await c.nodes()] == ["gpu-a", "gpu-b"]

        with pytest.raises(NotFoundError) as info:
            await c.get_job("nope")
        assert info.value.code_name == "NOT_FOUND"

        servicer.fail["GetJob"] = 2
        assert (await c.get_job(job.id)).id == job.id
        assert servicer.calls["GetJob"] == 5  # 2 earlier calls, 2 UNAVAILABLE, 1 answer

        servicer.fail["SubmitJob"] = 2
        await c.submit("again", 1, 1, ["true"])
        assert servicer.calls["SubmitJob"] == 4

        servicer.update(job.id, state=common_pb2.JOB_STATE_RUNNING)
        result = await c.checkpoint(job.id, reason="async")
        assert isinstance(result, CheckpointResult) and result.reason == "async" and result.job.id == job.id
        report = await c.goodput(limit=1)
        assert isinstance(report, GoodputReport) and report.job_count == 2 and len(report.jobs) == 1
        states = []
        async for update in c.watch([job.id], timeout=5):
            states.append(update.state)
            if len(states) == 1:
                servicer.update(job.id, state=common_pb2.JOB_STATE_SUCCEEDED)
            if update.terminal:
                break
        assert states == [JobState.RUNNING, JobState.SUCCEEDED]

        other = servicer.add_job("w2")
        asyncio.get_running_loop().call_later(
            0.2, lambda: servicer.update(other.id, state=common_pb2.JOB_STATE_CANCELLED)
        )
        assert (await c.wait(other.id, timeout=5)).state is JobState.CANCELLED
        assert (await c.cancel(other.id)).state is JobState.CANCELLED


async def test_async_client_errors_and_deadline(fake):
    servicer, address = fake
    servicer.delay["ListNodes"] = 1.0
    async with AsyncClient(address, timeout=0.2) as c:
        with pytest.raises(DeadlineExceededError):
            await c.nodes()
    servicer.delay.clear()
    servicer.fail["ListJobs"] = 100
    async with AsyncClient(address, timeout=5, retries=1) as c:
        with pytest.raises(UnavailableError):
            await c.list_jobs()
    assert servicer.calls["ListJobs"] == 2
    address = closed_port_address()
    async with AsyncClient(address, timeout=20, retries=0) as c:  # UNAVAILABLE at once, not at the deadline
        with pytest.raises(UnavailableError, match="cannot reach scheduler at"):
            await c.nodes()


# -- checkpoint and goodput against the real scheduler -----------------------------------------------------------


async def test_async_checkpoint_and_goodput_against_the_real_scheduler(sqlite_url, service_logs):
    settings = SchedulerSettings(
        db_url=sqlite_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0"]), poll_interval=0.2
    )
    async with LiteCluster(settings, lambda address: [LiteAgent(address, "node-0")]) as cluster:
        async with AsyncClient(cluster.scheduler.address, timeout=10) as c:
            running = await c.submit("runs", 1, 8, ["run"])
            pending = await c.submit("waits", 1, 8, ["run"])
            await cluster.wait_running(running.id)
            result = await c.checkpoint(running.id, reason="sdk")
            assert (result.job.id, result.job.state, result.reason) == (running.id, JobState.RUNNING, "sdk")
            assert cluster.sql("SELECT job_id, reason FROM checkpoint_requests") == [(running.id, "sdk")]
            with pytest.raises(FailedPreconditionError):
                await c.checkpoint(pending.id)
            with pytest.raises(NotFoundError):
                await c.checkpoint("0123456789ab")

            report = await c.goodput()
            assert report.job_count == 2 and {j.job_id for j in report.jobs} == {running.id, pending.id}
            for g in [report.cluster, *(j.goodput for j in report.jobs)]:
                assert abs(g.allocated - (g.productive + g.rollback + g.restart)) <= 1e-6
            job = await c.get_job(running.id)
            assert job.goodput is not None and job.goodput.allocated > 0 and set(job.goodput.to_dict()) == GOODPUT_KEYS
            assert all(j.goodput is None for j in await c.list_jobs())  # filled by GetJob only
