"""Serving fleets through the scheduler (ServiceService) with protocol-level agents: replicas are whole gangs that
restart alone, rolling updates keep their floor of ready replicas, scaling preempts lower-priority training, and a
bad spec changes nothing."""

from __future__ import annotations

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually, next_message

from phalanx.api.v1 import common_pb2, service_pb2, service_pb2_grpc
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

RUNNING = common_pb2.JOB_STATE_RUNNING


def cluster(db_url: str, nodes: int = 8, per_leaf: int = 4, **settings) -> LiteCluster:
    names = [f"node-{i}" for i in range(nodes)]
    config = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(names, nodes_per_leaf=per_leaf, leaves_per_spine=1),  # a spine per leaf
        retry_backoff_s=0.05,
        **settings,
    )
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in names])


def stub(c: LiteCluster) -> service_pb2_grpc.ServiceServiceStub:
    return service_pb2_grpc.ServiceServiceStub(c.channel)


def spec(name="llm", replicas=2, nodes=2, gpus=8, command=("run",), **kw) -> service_pb2.ServiceSpec:
    template = common_pb2.JobSpec(replicas=nodes, gpus_per_replica=gpus, command=list(command))
    for key in [k for k in kw if k in common_pb2.JobSpec.DESCRIPTOR.fields_by_name]:
        setattr(template, key, kw.pop(key))
    return service_pb2.ServiceSpec(name=name, replicas=replicas, template=template, **kw)


async def ready_count(c: LiteCluster, name: str, want: int) -> service_pb2.Service | None:
    got = await stub(c).GetService(service_pb2.GetServiceRequest(name=name))
    return got if got.ready_replicas == want and len(got.replicas) == want else None


async def test_a_service_runs_k_whole_replicas_with_lws_variables_and_endpoints(db_url):
    async with cluster(db_url) as c:
        created = await stub(c).CreateService(
            service_pb2.CreateServiceRequest(spec=spec(port=8000, spread_tier="leaf"))
        )
        assert created.revision == 1 and created.spec.replicas == 2
        svc = await eventually(lambda: ready_count(c, "llm", 2), what="2 ready replicas")
        assert sorted(r.index for r in svc.replicas) == [0, 1]
        leaves = set()
        for r in svc.replicas:
            assert r.state == "READY" and len(r.nodes) == 2 and r.leader_address == "127.0.0.1:8000"
            leaves.add(int(r.nodes[0].split("-")[1]) // 4)
            assert {int(n.split("-")[1]) // 4 for n in r.nodes} == {int(r.nodes[0].split("-")[1]) // 4}  # one leaf
        assert leaves == {0, 1}  # --spread-tier leaf: the two replicas in different leaves
        launches = [launch for a in c.agents for launch in a.launched if launch.job_id == svc.replicas[0].job_id]
        by_replica = {launch.replica: launch.env for launch in launches}
        assert by_replica[0]["LWS_WORKER_INDEX"] == "0" and by_replica[1]["LWS_WORKER_INDEX"] == "1"
        assert by_replica[1]["LWS_LEADER_ADDRESS"] == "127.0.0.1" and by_replica[1]["LWS_GROUP_SIZE"] == "2"
        assert by_replica[0]["PHALANX_SERVICE"] == "llm" and by_replica[0]["LWS_GROUP_INDEX"] == "0"
        listed = await stub(c).ListServices(service_pb2.ListServicesRequest())
        assert [s.spec.name for s in listed.services] == ["llm"]
        watch = stub(c).WatchEndpoints(service_pb2.WatchEndpointsRequest(name="llm"))
        first = await next_message(watch, what="the endpoints")
        assert [(e.replica, e.address) for e in first.endpoints] == [(0, "127.0.0.1:8000"), (1, "127.0.0.1:8000")]
        watch.cancel()


async def test_a_replica_whose_rank_exits_restarts_whole_and_alone(db_url):
    async with cluster(db_url) as c:
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec()))
        svc = await eventually(lambda: ready_count(c, "llm", 2), what="2 ready replicas")
        victim, other = svc.replicas[0], svc.replicas[1]
        changes = c.changes()
        node = next(a for a in c.agents if a.name == victim.nodes[1])
        task = next(t for (j, _, _), t in node.running.items() if j == victim.job_id)
        task.cancel()  # the rank dies; the agent reports it exited
        await node._report(victim.job_id, 1, 8, common_pb2.RANK_STATE_EXITED, 1)
        await changes.until(victim.job_id, lambda j: j.state == common_pb2.JOB_STATE_PENDING, "requeued")
        back = await eventually(lambda: ready_count(c, "llm", 2), what="the replica back")
        again = next(r for r in back.replicas if r.index == victim.index)
        assert again.job_id == victim.job_id  # the same gang, its next attempt
        leaf = {int(n.split("-")[1]) // 4 for n in victim.nodes}
        assert {int(n.split("-")[1]) // 4 for n in again.nodes} == leaf  # back in the domain it ran in
        assert "back in the domain it ran in before" in (await c.job(victim.job_id)).placement.reason
        kept = next(r for r in back.replicas if r.index == other.index)
        assert kept.job_id == other.job_id and (await c.job(other.job_id)).attempt == 1  # never touched
        assert not [j for j in changes.seen if j.id == other.job_id and not j.ready]


async def test_a_bad_spec_is_invalid_argument_and_changes_nothing(db_url):
    async with cluster(db_url) as c:
        bad = [
            spec(replicas=0),
            spec(nodes=5),  # a leaf holds 4 nodes: no domain could hold a replica
            spec(gpus=16),
            spec(name="Bad_Name"),
            spec(max_surge=0, max_unavailable=0),
            spec(spread_tier="rack"),
        ]
        roles = spec(nodes=0)
        roles.template.roles.add(name="prefill", replicas=2)
        roles.template.roles.add(name="prefill", replicas=1)
        bad.append(roles)
        mismatch = spec(nodes=2)
        mismatch.template.roles.add(name="prefill", replicas=2)
        mismatch.template.roles.add(name="decode", replicas=1)
        bad.append(mismatch)
        for s in bad:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=s))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (s, err.value.details())
        assert c.sql("SELECT count(*) FROM services") == [(0,)]
        assert c.sql("SELECT count(*) FROM jobs") == [(0,)]


class Readiness:
    """The ready replicas of a service, followed from the scheduler's committed job changes."""

    def __init__(self, c: LiteCluster, service: str, watch, now: service_pb2.Service) -> None:
        self.c, self.service, self.watch = c, service, watch
        self.state: dict[str, bool] = {r.job_id: r.ready for r in now.replicas}
        self.lowest: int | None = sum(self.state.values())

    @classmethod
    async def of(cls, c: LiteCluster, service: str) -> Readiness:
        """Subscribe first, then read the service: no change falls between the two."""
        watch = c.scheduler.service.fanout.subscribe(None)
        now = await stub(c).GetService(service_pb2.GetServiceRequest(name=service))
        return cls(c, service, watch, now)

    async def pump(self, until, timeout: float = 20.0):
        import asyncio

        async def run():
            while True:
                result = await until()
                if result:
                    return result
                try:
                    got = await asyncio.wait_for(self.watch.get(), 0.2)
                except TimeoutError:
                    continue
                assert got is not None
                job = got[0]
                if job.service == self.service:
                    self.state[job.id] = job.ready and job.state == RUNNING
                    count = sum(self.state.values())
                    if self.lowest is None or count < self.lowest:
                        self.lowest = count

        return await asyncio.wait_for(run(), timeout)


async def test_a_rolling_update_of_three_never_drops_below_two_ready(db_url):
    async with cluster(db_url, nodes=8) as c:
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=3, nodes=2)))
        await eventually(lambda: ready_count(c, "llm", 3), what="3 ready replicas")
        follow = await Readiness.of(c, "llm")
        new = common_pb2.JobSpec(replicas=2, gpus_per_replica=8, command=["run", "v2"])
        updated = await stub(c).UpdateService(service_pb2.UpdateServiceRequest(name="llm", template=new))
        assert updated.revision == 2

        async def rolled():
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
            done = len(got.replicas) == 3 and all(r.revision == 2 and r.ready for r in got.replicas)
            return got if done else None

        final = await follow.pump(rolled)
        assert follow.lowest is not None and follow.lowest >= 2, follow.lowest
        history = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
        assert [(r.revision, r.cause) for r in history.revisions] == [(2, "update"), (1, "create")]
        launched = {launch.job_id: list(launch.command) for a in c.agents for launch in a.launched}
        assert all(launched[r.job_id] == ["run", "v2"] for r in final.replicas)
        rolled_back = await stub(c).RollbackService(service_pb2.RollbackServiceRequest(name="llm"))
        assert rolled_back.revision == 3

        async def back():
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
            return got if all(r.revision == 3 and r.ready for r in got.replicas) and len(got.replicas) == 3 else None

        again = await follow.pump(back)
        launched = {launch.job_id: list(launch.command) for a in c.agents for launch in a.launched}
        assert all(launched[r.job_id] == ["run"] for r in again.replicas)
        assert again.revisions[0].cause == "rollback to 1"


async def test_scaling_up_preempts_a_lower_priority_gang_which_runs_again_after_scaling_down(db_url):
    from phalanx.core.preemption import PreemptionPolicy

    policy = PreemptionPolicy(min_runtime_s=0.0, grace_period_s=0.5)
    async with cluster(db_url, nodes=8, preemption=policy) as c:
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=2, nodes=2, priority=100)))
        await eventually(lambda: ready_count(c, "llm", 2), what="2 ready replicas")
        batch = await c.submit("train", 4, 8, ("run",), priority=0)
        await c.wait_running(batch.id)
        changes = c.changes()
        await stub(c).ScaleService(service_pb2.ScaleServiceRequest(name="llm", replicas=4))
        # asked to checkpoint first (the handshake), then stopped
        await changes.until(batch.id, lambda j: j.state == common_pb2.JOB_STATE_PREEMPTING, "asked to checkpoint")
        await eventually(lambda: ready_count(c, "llm", 4), what="4 ready replicas")
        stopped = await c.job(batch.id)
        assert stopped.state == common_pb2.JOB_STATE_PENDING and stopped.preemptions == 1
        await stub(c).ScaleService(service_pb2.ScaleServiceRequest(name="llm", replicas=2))
        resumed = await c.wait_running(batch.id)
        assert resumed.attempt == 2
        assert (await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))).ready_replicas == 2


async def test_a_lost_node_restarts_only_its_replica_elsewhere_and_endpoints_follow(db_url):
    async with cluster(db_url, nodes=8, lease_timeout=1.0, heartbeat_interval=0.2) as c:
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=2, nodes=2, port=9000)))
        svc = await eventually(lambda: ready_count(c, "llm", 2), what="2 ready replicas")
        victim, other = svc.replicas
        watch = stub(c).WatchEndpoints(service_pb2.WatchEndpointsRequest(name="llm"))
        assert len((await next_message(watch, what="the endpoints")).endpoints) == 2
        follow = await Readiness.of(c, "llm")
        lost = next(a for a in c.agents if a.name == victim.nodes[1])
        await lost.partition()
        gone = await next_message(watch, what="the endpoints without the lost replica")
        assert [e.replica for e in gone.endpoints] == [other.index]  # the lost one leaves at once
        back = await next_message(watch, what="the replica back elsewhere")
        assert sorted(e.replica for e in back.endpoints) == [0, 1]
        now = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
        moved = next(r for r in now.replicas if r.index == victim.index)
        assert lost.name not in moved.nodes and moved.job_id == victim.job_id
        assert follow.state.get(other.job_id, True)  # the other replica never stopped being ready
        assert (await c.job(other.job_id)).attempt == 1
        watch.cancel()


async def test_a_surge_replica_that_does_not_fit_waits_without_preempting_and_short_gangs_backfill(db_url):
    from phalanx.core.preemption import PreemptionPolicy

    policy = PreemptionPolicy(min_runtime_s=0.0, grace_period_s=0.5)
    async with cluster(db_url, nodes=4, preemption=policy) as c:
        first = spec(replicas=1, nodes=2, priority=100, max_surge=1, max_unavailable=0)
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=first))
        await eventually(lambda: ready_count(c, "llm", 1), what="1 ready replica")
        # The short gang's time limit runs from its reservation, so it covers its launch and its exit report too:
        # 2.5 s for 0.3 s of work leaves room for a loaded machine's slow cycles (1 s did not: a 0.7 s cycle after a
        # stall stopped it at its limit), and still ends well before the blocker's 6 s, whose end the surge awaits.
        blocker = await c.submit("blocker", 1, 8, ("sleep", "4"), time_limit_s=6.0)
        await c.wait_running(blocker.id)
        new = common_pb2.JobSpec(replicas=2, gpus_per_replica=8, command=["run", "v2"], priority=100)
        await stub(c).UpdateService(service_pb2.UpdateServiceRequest(name="llm", template=new))

        async def surge_waits():
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
            surge = [r for r in got.replicas if r.surge]
            return surge[0] if surge and surge[0].state == "PENDING" else None

        waiting = await eventually(surge_waits, what="a waiting surge replica")
        short = await c.submit("short", 1, 8, ("sleep", "0.3"), time_limit_s=2.5)
        unlimited = await c.submit("unlimited", 1, 8, ("run",))
        await eventually(lambda: _finished(c, short.id), what="the short gang backfilled and done")
        assert (await c.job(unlimited.id)).state == common_pb2.JOB_STATE_PENDING  # it would delay the surge

        async def rolled():
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
            return got if [(r.revision, r.ready) for r in got.replicas] == [(2, True)] else None

        await eventually(rolled, timeout=20.0, what="the rollout done once the blocker ended")
        done = await c.job(blocker.id)
        assert done.state == common_pb2.JOB_STATE_SUCCEEDED and done.preemptions == 0
        assert (await c.job(waiting.job_id)).preemptions == 0


async def _finished(c: LiteCluster, job_id: str):
    job = await c.job(job_id)
    return job if job.state == common_pb2.JOB_STATE_SUCCEEDED else None


async def test_restart_never_leaves_a_failed_replica_down_until_the_next_revision(db_url):
    async with cluster(db_url) as c:
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=2, restart="never")))
        svc = await eventually(lambda: ready_count(c, "llm", 2), what="2 ready replicas")
        victim = svc.replicas[0]
        node = next(a for a in c.agents if a.name == victim.nodes[0])
        await node._report(victim.job_id, 1, 0, common_pb2.RANK_STATE_EXITED, 3)

        async def down():
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
            states = sorted(r.state for r in got.replicas)
            return got if states == ["FAILED", "READY"] else None

        await eventually(down, what="one replica FAILED, one READY")
        await c.settled(svc.replicas[1].job_id)
        assert (await c.job(victim.job_id)).state == common_pb2.JOB_STATE_FAILED
        assert len((await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))).replicas) == 2
        new = common_pb2.JobSpec(replicas=2, gpus_per_replica=8, command=["run", "v2"], restart="never")
        await stub(c).UpdateService(service_pb2.UpdateServiceRequest(name="llm", template=new))

        async def replaced():
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
            return got if [(r.revision, r.state) for r in got.replicas] == [(2, "READY"), (2, "READY")] else None

        await eventually(replaced, what="both replicas at revision 2")


async def test_start_order_holds_the_rest_of_the_gang_until_the_first_group_runs(db_url):
    async with cluster(db_url) as c:
        leader_first = spec(name="lf", replicas=1, nodes=0, start_order="leader-first")
        leader_first.template.roles.add(name="leader", replicas=1, command=["hang"])  # never reports RUNNING
        leader_first.template.roles.add(name="worker", replicas=2, command=["run"])
        workers_first = spec(name="wf", replicas=1, nodes=0, start_order="workers-first")
        workers_first.template.roles.add(name="leader", replicas=1, command=["run"])
        workers_first.template.roles.add(name="worker", replicas=1, command=["hang"])
        for s in (leader_first, workers_first):
            await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=s))

        async def placed(name):
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name=name))
            return got.replicas[0] if got.replicas and got.replicas[0].state == "STARTING" else None

        lf = await eventually(lambda: placed("lf"), what="lf placed")
        wf = await eventually(lambda: placed("wf"), what="wf placed")
        await c.settled()
        launched = [launch for a in c.agents for launch in a.launched]
        assert sorted(x.replica for x in launched if x.job_id == lf.job_id) == [0]  # the workers wait
        assert sorted(x.replica for x in launched if x.job_id == wf.job_id) == [1]  # the leader waits
        (worker,) = [x for x in launched if x.job_id == wf.job_id]
        assert list(worker.command) == ["hang"] and worker.env["PHALANX_ROLE"] == "worker"


async def test_deleting_a_service_stops_every_replica(db_url):
    async with cluster(db_url) as c:
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=2)))
        svc = await eventually(lambda: ready_count(c, "llm", 2), what="2 ready replicas")
        deleted = await stub(c).DeleteService(service_pb2.DeleteServiceRequest(name="llm"))
        assert deleted.deleted
        for r in svc.replicas:
            assert (await c.job(r.job_id)).state == common_pb2.JOB_STATE_CANCELLED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert not (await stub(c).ListServices(service_pb2.ListServicesRequest())).services
        again = await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=1)))
        assert again.revision == 1  # the name is free again


async def test_the_autoscaler_follows_a_pushed_metric_up_and_down(db_url):
    async with cluster(db_url) as c:
        s = spec(replicas=1, nodes=1)
        s.autoscale.CopyFrom(
            service_pb2.Autoscale(
                min_replicas=1, max_replicas=3, metric="queue", target=10, period_s=0.1, scale_down_window_s=0.5
            )
        )
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=s))
        await eventually(lambda: ready_count(c, "llm", 1), what="1 ready replica")
        await stub(c).PushMetric(service_pb2.PushMetricRequest(service="llm", metric="queue", value=25, replica=-1))
        up = await eventually(lambda: ready_count(c, "llm", 3), what="scaled up to 3")
        assert "queue averages" in up.autoscaler
        await stub(c).PushMetric(service_pb2.PushMetricRequest(service="llm", metric="queue", value=1, replica=-1))
        await eventually(lambda: ready_count(c, "llm", 1), what="scaled back to 1")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub(c).ScaleService(service_pb2.ScaleServiceRequest(name="llm", replicas=5))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_queue_quota_covers_a_services_replicas(db_url):
    from phalanx.api.v1 import scheduler_pb2

    async with cluster(db_url) as c:
        await c.stub.SetQueue(
            scheduler_pb2.SetQueueRequest(
                spec=scheduler_pb2.QueueSpec(name="serve", quotas=[scheduler_pb2.FlavorQuota(flavor="*", gpus=16)])
            )
        )
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=3, nodes=1, queue="serve")))

        async def two_ready():
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
            return got if got.ready_replicas == 2 else None

        await eventually(two_ready, what="2 replicas within the quota")

        async def third_waits():
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
            waiting = [r for r in got.replicas if r.state == "PENDING"]
            return waiting[0] if len(got.replicas) == 3 and waiting and "quota" in waiting[0].message else None

        await eventually(third_waits, what="the third replica waiting on the quota")


class FakeMetrics:
    """A Prometheus endpoint whose vLLM queue length the test sets (what the autoscaler scrapes)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        owner = self
        self.waiting = 0.0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = (
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    f'vllm:num_requests_waiting{{model_name="llama"}} {owner.waiting}\n'
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_the_autoscaler_follows_a_scraped_prometheus_metric_up_and_down(db_url):
    metrics = FakeMetrics()
    try:
        async with cluster(db_url) as c:
            s = spec(replicas=1, nodes=1)
            s.autoscale.CopyFrom(
                service_pb2.Autoscale(
                    min_replicas=1,
                    max_replicas=3,
                    metric="vllm:num_requests_waiting",
                    target=5,
                    metrics_port=metrics.port,
                    period_s=0.1,
                    scale_down_window_s=0.5,
                )
            )
            await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=s))
            await eventually(lambda: ready_count(c, "llm", 1), what="1 ready replica")
            metrics.waiting = 15  # 3 x the target on the one replica: 3 wanted, the bound
            await eventually(lambda: ready_count(c, "llm", 3), what="scaled up to 3")
            metrics.waiting = 0
            await eventually(lambda: ready_count(c, "llm", 1), what="scaled back down to 1")
    finally:
        metrics.close()


async def test_a_retried_create_returns_the_service_and_a_different_one_is_already_exists(db_url):
    async with cluster(db_url) as c:
        first = await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(restart="none")))
        again = await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(restart="none")))
        assert (again.revision, again.created_at) == (first.revision, first.created_at)
        assert again.spec.template.restart == "never"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=3)))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_a_replica_restarts_past_the_schedulers_attempt_limit(db_url):
    """restart always: no limit (--max-attempts gives a batch gang up after 2 failures here; a server goes on)."""
    async with cluster(db_url, max_attempts=2) as c:
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=1, nodes=1)))
        svc = await eventually(lambda: ready_count(c, "llm", 1), what="1 ready replica")
        job_id = svc.replicas[0].job_id
        for attempt in range(1, 5):
            job = await c.wait_running(job_id)
            assert job.attempt == attempt
            node = next(a for a in c.agents if a.name == job.allocations[0].node)
            changes = c.changes()
            await node._report(job_id, attempt, 0, common_pb2.RANK_STATE_EXITED, 1)
            requeued = await changes.until(job_id, lambda j: j.state == common_pb2.JOB_STATE_PENDING, "requeued")
            assert f"requeued (failure {attempt}; a server restarts always)" in requeued.message
            changes.close()
        back = await c.wait_running(job_id)
        assert back.attempt == 5 and back.failures == 4


async def test_a_fatal_gpu_restarts_only_its_replica_on_another_node(db_url):
    from phalanx.api.v1 import agent_pb2

    async with cluster(db_url) as c:
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(replicas=2, nodes=1)))
        svc = await eventually(lambda: ready_count(c, "llm", 2), what="2 ready replicas")
        victim, other = svc.replicas
        sick = next(a for a in c.agents if a.name == victim.nodes[0])
        health = common_pb2.NodeHealth(
            state=common_pb2.HEALTH_STATE_DEGRADED,
            gpus=[common_pb2.GpuHealth(index=3, state=common_pb2.HEALTH_STATE_FATAL, reasons=["XID 79"])],
        )
        await sick.stub.Heartbeat(
            agent_pb2.HeartbeatRequest(node_name=sick.name, agent_instance=sick.instance, health=health)
        )

        async def moved():
            got = await stub(c).GetService(service_pb2.GetServiceRequest(name="llm"))
            again = next(r for r in got.replicas if r.index == victim.index)
            return got if again.ready and sick.name not in again.nodes and got.ready_replicas == 2 else None

        await eventually(moved, what="the replica restarted off the failed GPU's node")
        assert (await c.job(victim.job_id)).attempt == 2
        assert (await c.job(other.job_id)).attempt == 1  # the other replica never stopped


async def test_the_leader_exports_each_services_replica_counts(db_url):
    from prometheus_client import REGISTRY

    def gauge(name: str, kind: str) -> float | None:
        return REGISTRY.get_sample_value("phalanx_service_replicas", {"service": name, "kind": kind})

    async with cluster(db_url) as c:
        await stub(c).CreateService(service_pb2.CreateServiceRequest(spec=spec(name="gauged", replicas=2, nodes=1)))
        await eventually(lambda: ready_count(c, "gauged", 2), what="2 ready replicas")

        async def exported():
            return gauge("gauged", "ready") == 2 and gauge("gauged", "desired") == 2 and gauge("gauged", "live") == 2

        await eventually(exported, what="the gauges of 2 ready replicas")
        await stub(c).DeleteService(service_pb2.DeleteServiceRequest(name="gauged"))

        async def removed():
            return gauge("gauged", "ready") is None

        await eventually(removed, what="the deleted service's series gone")
