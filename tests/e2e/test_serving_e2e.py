"""Serving end to end on `LocalCluster` (real scheduler, checkpoint coordinator and simulated agents as processes,
SQLite; real rank processes; the agents run the leader's readiness probe):

- a 2-replica x 2-node service loses a node: only that replica restarts, whole, elsewhere; the other stays ready
  throughout and the endpoints follow; then a rolling update of K=3 never drops below 2 ready;
- scaling a service from 2 to 4 preempts a training gang through the checkpoint handshake, which later resumes
  from its checkpoint and counts exactly its steps;
- the autoscaler follows a fake Prometheus metric up and down; a bad spec is INVALID_ARGUMENT and changes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from helpers.local_clusters import environ_of, eventually_sync

from phalanx.api.v1 import common_pb2, service_pb2, service_pb2_grpc
from phalanx.cli.cluster import LocalCluster
from phalanx.client import Client, JobState

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc"),
]

# A model server stand-in: it "loads" for a moment, then says it is ready (the probe checks the file) and serves.
SERVER = (
    "import os, pathlib, time\n"
    "time.sleep(0.3)\n"
    "pathlib.Path('ready').write_text(os.environ.get('PHALANX_ATTEMPT', ''))\n"
    "while True:\n"
    "    time.sleep(1)\n"
)
PROBE = common_pb2.ReadyProbe(command=["sh", "-c", "test -f ready"], period_s=0.2)


def _template(nodes: int, gpus: int = 8, **kw) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(
        replicas=nodes, gpus_per_replica=gpus, command=[sys.executable, "-c", SERVER], procs_per_replica=1, **kw
    )
    spec.ready_probe.CopyFrom(PROBE)
    return spec


def _processes_of(job_id: str, node: str) -> list[int]:
    return [
        int(e.name)
        for e in Path("/proc").iterdir()
        if e.name.isdigit()
        and int(e.name) != os.getpid()
        and (env := environ_of(int(e.name))).get("PHALANX_JOB_ID") == job_id
        and env.get("PHALANX_NODE") == node
    ]


class Services:
    """The ServiceService of a local cluster, with waits on the service's state."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.channel = grpc.insecure_channel(cluster.address)
        self.stub = service_pb2_grpc.ServiceServiceStub(self.channel)

    def get(self, name: str) -> service_pb2.Service:
        return self.stub.GetService(service_pb2.GetServiceRequest(name=name), timeout=10)

    def ready(self, name: str, count: int, *, revision: int = 0, timeout: float = 60.0) -> service_pb2.Service:
        def check():
            got = self.get(name)
            ok = got.ready_replicas == count == len(got.replicas)
            return got if ok and all(r.revision == revision for r in got.replicas if revision) else None

        return eventually_sync(check, timeout=timeout, what=f"{count} ready replicas of {name}", interval=0.1)

    def close(self) -> None:
        self.channel.close()


class EndpointLog:
    """Every Endpoints message of one service's WatchEndpoints stream, in a thread."""

    def __init__(self, services: Services, name: str) -> None:
        self.call = services.stub.WatchEndpoints(service_pb2.WatchEndpointsRequest(name=name))
        self.seen: list[list[tuple[int, str]]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.seen.append([(e.replica, e.address) for e in message.endpoints])
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)


def test_a_lost_node_restarts_only_its_replica_then_a_rolling_update_keeps_two_ready(cluster_factory):
    cluster = cluster_factory(6, lease_timeout=3.0)
    services = Services(cluster)
    try:
        spec = service_pb2.ServiceSpec(name="web", replicas=2, template=_template(2), port=8000)
        services.stub.CreateService(service_pb2.CreateServiceRequest(spec=spec), timeout=30)
        before = services.ready("web", 2)
        log = EndpointLog(services, "web")
        eventually_sync(lambda: log.seen and len(log.seen[-1]) == 2, timeout=10, what="both endpoints listed")
        victim, other = before.replicas
        node = victim.nodes[1]  # a worker's node: the whole replica must go, its leader too
        cluster.kill_agent(node)
        for pid in _processes_of(victim.job_id, node):
            os.kill(pid, signal.SIGKILL)

        def moved():
            got = services.get("web")
            again = next(r for r in got.replicas if r.index == victim.index)
            return got if again.ready and node not in again.nodes and got.ready_replicas == 2 else None

        after = eventually_sync(moved, timeout=60, what="the lost replica back on other nodes")
        kept = next(r for r in after.replicas if r.index == other.index)
        assert kept.job_id == other.job_id and list(kept.nodes) == list(other.nodes)
        with Client(cluster.address, timeout=10) as client:
            assert client.get_job(other.job_id).attempt == 1  # the other replica was never touched
            assert client.get_job(victim.job_id).attempt == 2  # the lost one restarted whole, as one gang
        eventually_sync(lambda: len(log.seen[-1]) == 2, timeout=10, what="the endpoints back to two")
        log.close()
        # The endpoints followed: the lost replica left them, and the other one never did.
        assert any(len(seen) == 1 for seen in log.seen), log.seen
        assert all(any(r == other.index for r, _ in seen) for seen in log.seen), log.seen
        assert log.seen[-1] == [(0, "127.0.0.1:8000"), (1, "127.0.0.1:8000")]

        services.stub.DeleteService(service_pb2.DeleteServiceRequest(name="web"), timeout=30)
        roll = service_pb2.ServiceSpec(name="roll", replicas=3, template=_template(1), port=8000, max_unavailable=1)
        services.stub.CreateService(service_pb2.CreateServiceRequest(spec=roll), timeout=30)
        services.ready("roll", 3)
        log = EndpointLog(services, "roll")
        eventually_sync(lambda: log.seen and len(log.seen[-1]) == 3, timeout=10, what="three endpoints")
        new = _template(1)
        new.env["MODEL_VERSION"] = "2"
        services.stub.UpdateService(service_pb2.UpdateServiceRequest(name="roll", template=new), timeout=30)
        services.ready("roll", 3, revision=2)
        eventually_sync(lambda: len(log.seen[-1]) == 3, timeout=10, what="three endpoints again")
        log.close()
        assert min(len(seen) for seen in log.seen) >= 2, log.seen  # never below K - max_unavailable ready
    finally:
        services.close()


STEPS, EVERY = 60, 20
CKPT_ENV = {"PHALANX_CHECKPOINT_POLL_S": "0.2"}


def _count_steps(out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "phalanx.examples.count_steps",
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        "--step-time",
        "0.1",
        "--out",
        str(out),
        "--sync-timeout",
        "120",
    ]


def _ledger(cluster: LocalCluster, sql: str, *params) -> list[sqlite3.Row]:
    conn = sqlite3.connect(f"file:{cluster.state_dir / 'phalanx.db'}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def test_scaling_up_preempts_training_which_checkpoints_and_resumes_exactly(cluster_factory, tmp_path):
    out = tmp_path / "out"
    cluster = cluster_factory(4, min_runtime=1.0, preemption_grace=10.0)
    services = Services(cluster)
    try:
        spec = service_pb2.ServiceSpec(name="chat", replicas=2, template=_template(1, priority=100))
        services.stub.CreateService(service_pb2.CreateServiceRequest(spec=spec), timeout=30)
        services.ready("chat", 2)
        with Client(cluster.address, timeout=10) as client:
            train = client.submit("train", 2, 8, _count_steps(out), procs_per_replica=1, env=CKPT_ENV)
            client.wait(train.id, ["RUNNING"], timeout=30)
            eventually_sync(
                lambda: _ledger(
                    cluster, "SELECT 1 FROM checkpoints WHERE job_id = ? AND state = 'COMMITTED'", train.id
                ),
                timeout=60,
                what="a first committed checkpoint",
            )
            services.stub.ScaleService(service_pb2.ScaleServiceRequest(name="chat", replicas=4), timeout=30)
            services.ready("chat", 4)
            first = _ledger(cluster, "SELECT * FROM job_attempts WHERE job_id = ? AND attempt = 1", train.id)[0]
            assert first["outcome"] == "PREEMPTED", dict(first)
            assert "its checkpoint is committed" in first["reason"], dict(first)  # the handshake, not the deadline
            services.stub.ScaleService(service_pb2.ScaleServiceRequest(name="chat", replicas=2), timeout=30)
            done = client.wait(train.id, timeout=120)
        assert done.state is JobState.SUCCEEDED and done.attempt == 2 and done.preemptions == 1, done
        second = _ledger(cluster, "SELECT * FROM job_attempts WHERE job_id = ? AND attempt = 2", train.id)[0]
        assert second["restored_step"] == first["committed_step"] >= 0, (dict(first), dict(second))
        for rank in range(2):
            result = json.loads((out / train.id / f"rank-{rank}.json").read_text())
            assert (result["count"], result["step"], result["attempt"]) == (STEPS, STEPS, 2), result
            assert result["restored_step"] == first["committed_step"]
    finally:
        services.close()


class FakeMetrics:
    """A Prometheus endpoint whose vLLM queue length the test sets."""

    def __init__(self) -> None:
        owner = self
        self.waiting = 0.0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = f"vllm:num_requests_waiting {owner.waiting}\n".encode()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_autoscaler_follows_a_fake_metric_and_a_bad_spec_changes_nothing(cluster_factory):
    cluster = cluster_factory(3)
    services = Services(cluster)
    metrics = FakeMetrics()
    try:
        spec = service_pb2.ServiceSpec(name="auto", replicas=1, template=_template(1))
        spec.autoscale.CopyFrom(
            service_pb2.Autoscale(
                min_replicas=1,
                max_replicas=3,
                metric="vllm:num_requests_waiting",
                target=5,
                metrics_port=metrics.port,
                period_s=0.2,
                scale_down_window_s=1.0,
            )
        )
        services.stub.CreateService(service_pb2.CreateServiceRequest(spec=spec), timeout=30)
        services.ready("auto", 1)
        metrics.waiting = 15
        up = services.ready("auto", 3)
        assert "vllm:num_requests_waiting averages" in up.autoscaler
        metrics.waiting = 0
        services.ready("auto", 1)

        jobs_before = _ledger(cluster, "SELECT count(*) AS n FROM jobs")[0]["n"]
        revisions_before = _ledger(cluster, "SELECT count(*) AS n FROM service_revisions")[0]["n"]
        unknown_role = service_pb2.ServiceSpec(name="bad", replicas=1, template=_template(0))
        unknown_role.template.roles.add(name="prefill", replicas=1)
        unknown_role.template.roles.add(name="Decode!", replicas=1)
        for bad in (
            service_pb2.ServiceSpec(name="bad", replicas=0, template=_template(1)),
            service_pb2.ServiceSpec(name="bad", replicas=1, template=_template(5)),  # more nodes than any domain
            unknown_role,
        ):
            with pytest.raises(grpc.RpcError) as err:
                services.stub.CreateService(service_pb2.CreateServiceRequest(spec=bad), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert [s.spec.name for s in services.stub.ListServices(service_pb2.ListServicesRequest()).services] == ["auto"]
        assert _ledger(cluster, "SELECT count(*) AS n FROM jobs")[0]["n"] == jobs_before
        assert _ledger(cluster, "SELECT count(*) AS n FROM service_revisions")[0]["n"] == revisions_before
    finally:
        metrics.close()
        services.close()
