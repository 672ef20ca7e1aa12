"""Several scheduler replicas in one address (`host1:port,host2:port`): the SDK's channel target."""

from __future__ import annotations

import asyncio

import grpc

from phalanx.client._channel import channel_target, open_aio_channel


def test_single_address_is_kept():
    assert channel_target("127.0.0.1:50051") == ("127.0.0.1:50051", [])
    assert channel_target("sched.example:50051") == ("sched.example:50051", [])


def test_a_list_becomes_one_pick_first_channel():
    assert channel_target("127.0.0.1:1, 127.0.0.1:2") == ("ipv4:127.0.0.1:1,127.0.0.1:2", [])
    target, options = channel_target("localhost:7,127.0.0.1:8")
    assert target.startswith("ipv") and target.endswith(":8")
    assert options == [("grpc.default_authority", "localhost:7")]


async def test_channel_fails_over_to_the_next_address():
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    dead = grpc.aio.server()
    dead_port = dead.add_insecure_port("127.0.0.1:0")  # bound, never started: connections are refused
    try:
        channel = open_aio_channel(f"127.0.0.1:{dead_port},127.0.0.1:{port}")
        reply = await asyncio.wait_for(
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), wait_for_ready=True), 10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await channel.close()
    finally:
        await server.stop(None)
