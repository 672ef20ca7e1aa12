"""Serving fleets through the scheduler (ServiceService) with protocol-level agents: replicas are whole gangs that
restart alone, rolling updates keep their floor of ready replicas, scaling preempts lower-priority training, and a
bad spec changes nothing."""

from __future__ import annotations

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually

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
        first = await watch.read()
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
