"""The serving verbs of the `phalanx` CLI (service create/get/endpoints/scale/update/rollback/delete/push-metric,
services, apply -f) run for real against an in-process scheduler with protocol-level LiteAgents: their --json
shapes, their exit codes, and that a bad spec (a bad flag, a bad file, a replica no domain holds) creates nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc
from phalanx.cli.main import main
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(90)

REPLICA_KEYS = {"index", "revision", "state", "ready", "nodes", "leader_address"}


def cluster(db_url: str) -> LiteCluster:
    """8 LiteAgents of 8 GPUs, 4 nodes per leaf (a spine per leaf): a replica spans at most 4 nodes."""
    names = [f"node-{i}" for i in range(8)]
    settings = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(names, nodes_per_leaf=4, leaves_per_spine=1),
        retry_backoff_s=0.05,
    )
    return LiteCluster(settings, lambda address: [LiteAgent(address, n) for n in names])


async def phalanx(capsys, c: LiteCluster, *argv: str) -> tuple[int, str, str]:
    """The CLI in a worker thread (its client is synchronous; the scheduler lives on this event loop)."""
    code = await asyncio.to_thread(main, ["--scheduler", c.scheduler.address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def get_json(capsys, c: LiteCluster, name: str) -> dict:
    code, out, err = await phalanx(capsys, c, "service", "get", name, "--json")
    assert code == 0, err
    return json.loads(out)


async def settled(capsys, c: LiteCluster, name: str, replicas: int, revision: int) -> dict:
    """`service get --json` once `replicas` replicas of `revision` are all ready, and nothing else runs."""

    async def check():
        got = await get_json(capsys, c, name)
        rs = got["replicas"]
        done = len(rs) == replicas and all(r["ready"] and r["revision"] == revision for r in rs)
        return got if done else None

    return await eventually(check, timeout=30, what=f"{replicas} ready replicas of {name} at revision {revision}")


async def test_create_get_endpoints_scale_update_rollback_delete(sqlite_url, capsys, service_logs):
    async with cluster(sqlite_url) as c:
        code, out, err = await phalanx(
            capsys,
            c,
            "service",
            "create",
            "llm",
            "--replicas",
            "2",
            "--nodes-per-replica",
            "2",
            "--gpus-per-node",
            "8",
            "--port",
            "8000",
            "--spread-tier",
            "leaf",
            "--env",
            "MODEL=v1",
            "--json",
            "--",
            "run",
            "--flag-of-the-command",
        )
        assert code == 0, err
        created = json.loads(out)
        assert (created["name"], created["revision"], created["desired_replicas"]) == ("llm", 1, 2)
        assert created["spec"]["command"] == ["run", "--flag-of-the-command"]

        got = await settled(capsys, c, "llm", 2, 1)
        assert sorted(r["index"] for r in got["replicas"]) == [0, 1]
        for r in got["replicas"]:
            assert REPLICA_KEYS <= set(r)
            assert r["state"] == "READY" and len(r["nodes"]) == 2 and r["leader_address"] == "127.0.0.1:8000"
        leaves = {int(r["nodes"][0].split("-")[1]) // 4 for r in got["replicas"]}
        assert leaves == {0, 1}  # --spread-tier leaf

        code, out, err = await phalanx(capsys, c, "service", "endpoints", "llm", "--json")
        assert code == 0, err
        endpoints = json.loads(out)
        assert [(e["replica"], e["address"]) for e in endpoints] == [(0, "127.0.0.1:8000"), (1, "127.0.0.1:8000")]
        code, out, err = await phalanx(capsys, c, "service", "endpoints", "llm")
        assert code == 0 and out.splitlines()[0].split() == ["REPLICA", "ADDRESS", "REVISION"]

        # the replicas are jobs: `phalanx jobs` names their service
        code, out, err = await phalanx(capsys, c, "jobs", "--json")
        jobs = json.loads(out)["jobs"]
        assert sorted((j["name"], j["service"], j["service_replica"], j["ready"]) for j in jobs) == [
            ("llm-0", "llm", 0, True),
            ("llm-1", "llm", 1, True),
        ]
        code, out, err = await phalanx(capsys, c, "jobs")
        assert code == 0 and "llm#0 r1 ready" in out and out.splitlines()[0].split()[-1] == "SERVICE"

        code, out, err = await phalanx(capsys, c, "service", "scale", "llm", "3", "--json")
        assert code == 0 and json.loads(out)["desired_replicas"] == 3, err
        await settled(capsys, c, "llm", 3, 1)

        # update: the flags given change the current template (MODEL), the rest is kept (the command)
        code, out, err = await phalanx(capsys, c, "service", "update", "llm", "--env", "MODEL=v2", "--json")
        assert code == 0, err
        assert json.loads(out)["revision"] == 2
        got = await settled(capsys, c, "llm", 3, 2)
        assert got["spec"]["env"] == {"MODEL": "v2"} and got["spec"]["command"] == ["run", "--flag-of-the-command"]
        launched = {launch.env.get("MODEL") for a in c.agents for launch in a.launched if launch.job_id}
        assert {"v1", "v2"} <= launched

        code, out, err = await phalanx(capsys, c, "service", "rollback", "llm", "--json")
        assert code == 0, err
        assert json.loads(out)["revision"] == 3
        got = await settled(capsys, c, "llm", 3, 3)
        assert got["spec"]["env"] == {"MODEL": "v1"}
        assert [r["cause"] for r in got["revisions"]] == ["rollback to 1", "update", "create"]

        code, out, err = await phalanx(capsys, c, "services")
        assert code == 0 and out.splitlines()[1].split()[:3] == ["llm", "3", "3/3"], out

        code, out, err = await phalanx(capsys, c, "service", "delete", "llm", "--json")
        assert code == 0 and json.loads(out)["deleted"] is True, err
        code, out, err = await phalanx(capsys, c, "services", "--json")
        assert code == 0 and json.loads(out) == []
        code, out, err = await phalanx(capsys, c, "service", "get", "llm")
        assert code == 1 and out == "" and err.startswith("error: NOT_FOUND: ")

        async def all_stopped():
            return c.sql("SELECT count(*) FROM jobs WHERE service = 'llm' AND state IN ('PENDING', 'RUNNING')") == [
                (0,)
            ]

        await eventually(all_stopped, what="every replica of llm stopped")


SPEC_YAML = """\
# a 2 x 1-node service whose leaders answer GET :8000/health
name: chat
kind: Service
replicas: 2
gpus_per_node: 4
command: run --model tiny
env:
  PORT: 8000
ready_probe:
  http_port: 8000
  http_path: /health
  period_s: 1
max_surge: 1
autoscale:
  min_replicas: 1
  max_replicas: 4
  metric: vllm:num_requests_waiting
  target: 5
"""


async def report_ready(c: LiteCluster, job_id: str, node: str) -> None:
    """What the leader's agent reports when the probe passes (LiteAgents run no probes)."""
    job = await c.job(job_id)
    stub = agent_pb2_grpc.NodeServiceStub(c.channel)
    await stub.ReportReadiness(
        agent_pb2.ReportReadinessRequest(node_name=node, job_id=job_id, attempt=job.attempt, ready=True)
    )


async def test_apply_a_yaml_file_with_a_probe_and_watch_its_endpoints(sqlite_url, capsys, service_logs, tmp_path):
    spec_file = tmp_path / "chat.yaml"
    spec_file.write_text(SPEC_YAML)
    async with cluster(sqlite_url) as c:
        code, out, err = await phalanx(capsys, c, "apply", "-f", str(spec_file), "--json")
        assert code == 0, err
        applied = json.loads(out)
        assert (applied["name"], applied["revision"], applied["desired_replicas"]) == ("chat", 1, 2)
        assert applied["spec"]["ready_probe"] == {"http_port": 8000, "http_path": "/health", "period_s": 1.0}
        assert applied["spec"]["env"] == {"PORT": "8000"} and applied["spec"]["command"] == ["run", "--model", "tiny"]

        async def placed():
            got = await get_json(capsys, c, "chat")
            rs = got["replicas"]
            return got if len(rs) == 2 and all(r["state"] == "STARTING" for r in rs) else None

        got = await eventually(placed, what="2 replicas placed, not ready (their probe has not passed)")

        # the watcher, a real process: a JSON line now (nobody ready), then one per change, until Ctrl-C
        env = dict(os.environ, PHALANX_SCHEDULER=c.scheduler.address)
        err = (tmp_path / "watcher.err").open("wb")
        watcher = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "phalanx.cli.main",
            "service",
            "endpoints",
            "chat",
            "--watch",
            "--json",
            stdout=asyncio.subprocess.PIPE,
            stderr=err,  # a file, not an undrained pipe: a full pipe would block the watcher's exit
            env=env,
        )
        try:
            first = await asyncio.wait_for(watcher.stdout.readline(), 30)
            assert json.loads(first) == []
            replica = next(r for r in got["replicas"] if r["index"] == 0)
            await report_ready(c, replica["job_id"], replica["nodes"][0])
            second = await asyncio.wait_for(watcher.stdout.readline(), 30)
            assert [(e["replica"], e["address"]) for e in json.loads(second)] == [(0, "127.0.0.1:8000")]
            watcher.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(watcher.wait(), 30) == 130, (tmp_path / "watcher.err").read_text()
        finally:
            if watcher.returncode is None:
                watcher.kill()
                await watcher.wait()
            err.close()

        code, out, err = await phalanx(capsys, c, "service", "endpoints", "chat", "--json")
        assert code == 0 and json.loads(out) == [{"replica": 0, "address": "127.0.0.1:8000", "revision": 1}]

        # the same file again changes nothing; a new command is a new revision
        code, out, err = await phalanx(capsys, c, "apply", "-f", str(spec_file), "--json")
        assert code == 0 and json.loads(out)["revision"] == 1, err
        spec_file.write_text(SPEC_YAML.replace("--model tiny", "--model small"))
        code, out, err = await phalanx(capsys, c, "apply", "-f", str(spec_file), "--json")
        assert code == 0 and json.loads(out)["revision"] == 2, err

        # autoscaled: a count outside [min, max] is refused; a pushed metric is taken
        code, out, err = await phalanx(capsys, c, "service", "scale", "chat", "9")
        assert code == 1 and err.startswith("error: FAILED_PRECONDITION: ")
        code, out, err = await phalanx(
            capsys, c, "service", "push-metric", "chat", "vllm:num_requests_waiting", "12", "--json"
        )
        assert code == 0 and json.loads(out)["value"] == 12.0, err
        code, out, err = await phalanx(capsys, c, "service", "push-metric", "nope", "m", "1")
        assert code == 1 and err.startswith("error: NOT_FOUND: ")


BAD_YAML = """\
name: bad
replicas: 0
gpus_per_node: 8
command: [run]
roles:
  - {name: prefill, nodes: 2, cmd: run-prefill}
"""


async def test_a_bad_spec_exits_non_zero_and_creates_nothing(sqlite_url, capsys, service_logs, tmp_path):
    async with cluster(sqlite_url) as c:
        base = ["service", "create", "bad", "--gpus-per-node", "8"]
        # zero replicas: a usage error, nothing sent
        code, out, err = await phalanx(capsys, c, *base, "--replicas", "0", "--", "run")
        assert code == 2 and out == "" and "--replicas must be 1 to 10000, got 0" in err
        # a per-role option naming a role that is not there
        code, out, err = await phalanx(
            capsys, c, *base, "--replicas", "1", "--roles", "prefill:2,decode:1", "--role-command", "decoder=run x",
            "--", "run",
        )  # fmt: skip
        assert code == 2 and out == ""
        assert err.strip() == "error: --role-command: no role named 'decoder'; the roles are: prefill, decode"
        # more nodes than any domain holds (a spine holds 4): the scheduler's INVALID_ARGUMENT
        code, out, err = await phalanx(capsys, c, *base, "--replicas", "1", "--nodes-per-replica", "5", "--", "run")
        assert code == 1 and out == "" and err.startswith("error: INVALID_ARGUMENT: ") and "never be placed" in err
        # a file that is not of the schema: every problem, with its place in the file
        bad = tmp_path / "bad.yaml"
        bad.write_text(BAD_YAML)
        code, out, err = await phalanx(capsys, c, "apply", "-f", str(bad))
        assert code == 2 and out == ""
        assert "replicas: 0 is less than the minimum of 1" in err
        assert "roles[0]: unknown field 'cmd'" in err
        code, out, err = await phalanx(capsys, c, "apply", "-f", str(tmp_path / "missing.yaml"))
        assert code == 2 and "cannot read it" in err

        code, out, err = await phalanx(capsys, c, "services", "--json")
        assert code == 0 and json.loads(out) == []
        assert c.sql("SELECT count(*) FROM services") == [(0,)]
        assert c.sql("SELECT count(*) FROM jobs") == [(0,)]
