"""The SDK's service calls (Client and AsyncClient) against an in-process scheduler with LiteAgents: typed results,
the endpoints stream (now, then each change, ending when the service is deleted), an update made from the current
spec with dataclasses.replace, and the SDK's errors."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually

from phalanx.client import (
    AsyncClient,
    Client,
    Endpoint,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    RPCError,
    ServiceSpec,
    ServiceSpecError,
)
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(60)


def cluster(db_url: str) -> LiteCluster:
    names = [f"node-{i}" for i in range(4)]
    settings = SchedulerSettings(
        db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names, nodes_per_leaf=4), retry_backoff_s=0.05
    )
    return LiteCluster(settings, lambda address: [LiteAgent(address, n) for n in names])


async def test_the_async_client_creates_watches_updates_and_deletes(sqlite_url, service_logs):
    async with cluster(sqlite_url) as c, AsyncClient(c.scheduler.address) as client:
        spec = ServiceSpec("web", replicas=2, gpus_per_node=4, command=["run"], port=9000)
        created = await client.create_service(spec)
        assert (created.name, created.revision, created.desired_replicas) == ("web", 1, 2)
        assert created.spec is not None and created.spec.command == ["run"] and created.spec.nodes == 1

        stream = client.watch_endpoints("web")
        seen: list[list[Endpoint]] = []
        async for endpoints in stream:
            seen.append(endpoints)
            if len(endpoints) == 2:
                break
        await stream.aclose()
        assert seen[-1] == [Endpoint(0, "127.0.0.1:9000", 1), Endpoint(1, "127.0.0.1:9000", 1)]
        assert all(a != b for a, b in zip(seen, seen[1:]))  # a list is sent only when it changed

        current = await client.get_service("web")
        assert current.spec is not None
        updated = await client.update_service("web", dataclasses.replace(current.spec, env={"V": "2"}), max_surge=1)
        assert updated.revision == 2 and updated.spec is not None and updated.spec.max_surge == 1
        with pytest.raises(RPCError) as err:
            await client.create_service(spec)
        assert err.value.code_name == "ALREADY_EXISTS"

        # the stream ends when the service is deleted
        async def watch_until_deleted() -> int:
            count = 0
            async for _ in client.watch_endpoints("web"):
                count += 1
            return count

        watcher = asyncio.ensure_future(watch_until_deleted())

        async def watching():
            return c.scheduler.service.fanout.watched

        await eventually(watching, what="the endpoints watch open")
        deleted = await client.delete_service("web")
        assert deleted.deleted
        assert await asyncio.wait_for(watcher, 30) >= 1
        assert await client.list_services() == []


async def test_the_blocking_client_and_its_errors(sqlite_url, service_logs):
    async with cluster(sqlite_url) as c:

        def calls() -> None:
            with Client(c.scheduler.address) as client:
                doc = {"name": "api", "replicas": 1, "gpus_per_node": 2, "command": "run", "port": 7000}
                service = client.apply_service(doc)  # a spec file's mapping, checked against the schema
                assert service.revision == 1 and [s.name for s in client.list_services()] == ["api"]
                with pytest.raises(ServiceSpecError):  # nothing sent
                    client.apply_service({**doc, "replicas": 0})
                with pytest.raises(InvalidArgumentError):  # the scheduler's check: 5 x 8 GPUs, the cluster has 4 x 8
                    client.create_service(ServiceSpec("big", 1, nodes_per_replica=5, gpus_per_node=8, command=["r"]))
                with pytest.raises(NotFoundError):
                    client.get_service("nope")
                for endpoints in client.watch_endpoints("api", timeout=20):
                    if endpoints:
                        assert endpoints == [Endpoint(0, "127.0.0.1:7000", 1)]
                        break
                assert client.scale_service("api", 2).desired_replicas == 2
                client.push_metric("api", "queue_depth", 3.0, replica=0)
                with pytest.raises(FailedPreconditionError, match="no revision 0 to roll back to"):
                    client.rollback_service("api")  # it has only revision 1

        await asyncio.to_thread(calls)
