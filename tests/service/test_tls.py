"""Mutual TLS (services serve with --tls-cert/--tls-key/--tls-ca) and `phalanx cluster up --tokens FILE --tls`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from phalanx.cli.certs import generate_local_pki
from phalanx.cli.cluster import LocalCluster
from phalanx.client import AsyncClient, Client, PhalanxError, UnauthenticatedError
from phalanx.common.tokens import hash_token
from phalanx.core.fabric import default_fabric
from services.common.auth import ServerTLS
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings


async def test_mutual_tls_refuses_a_client_without_a_certificate(db_url, tmp_path):
    pki = generate_local_pki(tmp_path / "tls")
    settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["n0"]))
    running = await serve(settings, tls=ServerTLS(str(pki.server_cert), str(pki.server_key), str(pki.ca)))
    try:
        good = AsyncClient(
            running.address,
            retries=0,
            timeout=5,
            tls_ca=str(pki.ca),
            tls_cert=str(pki.client_cert),
            tls_key=str(pki.client_key),
        )
        assert await good.nodes() == []
        await good.close()
        for kw in ({"tls_ca": str(pki.ca)}, {}):  # TLS without a client certificate; plaintext
            bad = AsyncClient(running.address, retries=0, timeout=3, **kw)
            with pytest.raises(PhalanxError):
                await bad.nodes()
            await bad.close()
    finally:
        await running.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cluster_up_with_tokens_and_tls_runs_jobs_end_to_end(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        f"- {{token_sha256: {hash_token('alice-secret')}, tenant: alice, role: user}}\n"
        f"- {{token_sha256: {hash_token('bob-secret')}, tenant: bob, role: user}}\n"
    )
    messages: list[str] = []
    cluster = LocalCluster(
        nodes=2,
        state_dir=tmp_path / "cluster",
        port=0,
        log=messages.append,
        ready_timeout=60,
        tokens=tokens,
        tls=True,
        mig_gpus=0,
    )  # its 2 x 8 gang needs every GPU out of MIG mode
    cluster.start()
    try:
        pki = cluster.pki
        tls = dict(tls_ca=str(pki.ca), tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
        info = json.loads((cluster.state_dir / "cluster.json").read_text())
        assert info["authentication"] is True and info["tls"]["ca"] == str(pki.ca)
        with Client(cluster.address, token="", timeout=5, retries=0, **tls) as anonymous:
            with pytest.raises(UnauthenticatedError):
                anonymous.list_jobs()
        out = tmp_path / "out"
        command = [
            sys.executable,
            "-m",
            "phalanx.examples.count_steps",
            "--steps",
            "6",
            "--every",
            "2",
            "--step-time",
            "0.05",
            "--out",
            str(out),
        ]
        with (
            Client(cluster.address, token="alice-secret", timeout=10, **tls) as alice,
            Client(cluster.address, token="bob-secret", timeout=10, **tls) as bob,
        ):
            # ranks checkpoint through the coordinator with the service credential the agents hand them
            job = alice.submit("count", 2, 8, command, procs_per_replica=1)
            done = alice.wait(job.id, timeout=90)
            assert done.state.value == "SUCCEEDED", done.message
            assert [j.id for j in bob.list_jobs()] == []
            counts = [json.loads(p.read_text())["count"] for p in sorted((out / job.id).glob("rank-*.json"))]
            assert counts == [6, 6]
        # the CLI, with the environment a user would export
        env = {
            "PHALANX_SCHEDULER": cluster.address,
            "PHALANX_TOKEN": "alice-secret",
            "PHALANX_TLS_CA": str(pki.ca),
            "PHALANX_TLS_CERT": str(pki.client_cert),
            "PHALANX_TLS_KEY": str(pki.client_key),
        }
        import os

        result = subprocess.run(
            [sys.executable, "-m", "phalanx.cli.main", "jobs", "--json"],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert [j["id"] for j in json.loads(result.stdout)["jobs"]] == [job.id]
    finally:
        cluster.stop()


async def test_a_node_certificate_acts_only_as_its_node(db_url, tmp_path):
    """With mutual TLS, a client certificate whose CN is a registered node's name can act only as that node: node-1's
    certificate cannot heartbeat as node-0 (PERMISSION_DENIED, nothing changes); node-0's own can."""
    import grpc

    from phalanx.api.v1 import agent_pb2, agent_pb2_grpc
    from phalanx.cli.certs import node_cert

    pki = generate_local_pki(tmp_path / "tls", nodes=("node-0", "node-1"))
    settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0", "node-1"]))
    running = await serve(settings, tls=ServerTLS(str(pki.server_cert), str(pki.server_key), str(pki.ca)))
    channels = []

    def node_stub(node: str):
        cert, key = node_cert(tmp_path / "tls", node)
        creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), key.read_bytes(), cert.read_bytes())
        channel = grpc.aio.secure_channel(running.address, creds)
        channels.append(channel)
        return agent_pb2_grpc.NodeServiceStub(channel)

    try:
        from phalanx.testing.lite_agent import simple_topology

        for node in ("node-0", "node-1"):
            await node_stub(node).RegisterNode(
                agent_pb2.RegisterNodeRequest(node_name=node, topology=simple_topology(2), agent_instance=node)
            )
        evil = node_stub("node-1")
        for call in (
            evil.Heartbeat(agent_pb2.HeartbeatRequest(node_name="node-0", agent_instance="node-0"), timeout=5),
            evil.RegisterNode(
                agent_pb2.RegisterNodeRequest(node_name="node-0", topology=simple_topology(2)), timeout=5
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "the TLS certificate of node 'node-1' may not act as node 'node-0'" in err.value.details()
        reply = await node_stub("node-0").Heartbeat(
            agent_pb2.HeartbeatRequest(node_name="node-0", agent_instance="node-0"), timeout=5
        )
        assert not reply.reregister  # its own registration stands: the refused one changed nothing
    finally:
        for channel in channels:
            await channel.close()
        await running.stop()
