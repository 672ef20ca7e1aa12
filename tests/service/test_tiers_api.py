"""`required_tier` / `preferred_tier` end to end: CLI and SDK -> gRPC -> the real scheduler -> the ledger -> back.

The scheduler runs in-process (services.scheduler.main.serve) on SQLite and on PostgreSQL, with protocol-level
LiteAgents (8 GPUs each) under a two-tier fabric of 4 nodes per leaf. Whether placement honours the tiers is the
placement core's business (tests/unit/test_core_placement.py); here: validation at submit, the impossible-tier refusal,
the round trip through every layer, and the 0001 -> 0002 migration of an existing ledger.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from helpers.lite_cluster import LiteCluster, run_sql
from helpers.procs import eventually
from sqlalchemy import text

from db.engine import make_engine
from db.migrate import current, head_revision, upgrade
from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.cli.main import main as cli_main
from phalanx.client import AsyncClient, FailedPreconditionError, InvalidArgumentError
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

RUNNING = common_pb2.JOB_STATE_RUNNING


class Cluster(LiteCluster):
    """A scheduler and `nodes` LiteAgents; node-0..3 under leaf0, node-4..7 under leaf1, all under spine0."""

    default_command = ("sleep", "30")

    def __init__(self, db_url: str, nodes: int = 8, nodes_per_leaf: int = 4) -> None:
        self.names = [f"node-{i}" for i in range(nodes)]
        super().__init__(
            SchedulerSettings(
                db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(self.names, nodes_per_leaf=nodes_per_leaf)
            ),
            lambda address: [LiteAgent(address, n) for n in self.names],
        )

    def job_rows(self) -> int:
        return self.sql("SELECT count(*) FROM jobs")[0][0]


async def _cli(capsys, *argv) -> tuple[int, str, str]:
    """Run the CLI in a worker thread: its client is synchronous and the scheduler lives on this event loop."""
    code = await asyncio.to_thread(cli_main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- validation ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["required_tier", "preferred_tier"])
async def test_unknown_tier_is_invalid_argument_and_writes_nothing(db_url, field):
    async with Cluster(db_url) as c:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.submit("bad", 1, 8, **{field: "rack"})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        message = info.value.details()
        assert field in message and "'rack'" in message
        for name in ("node", "leaf", "spine", "cluster"):
            assert name in message  # the valid names are listed
        assert c.job_rows() == 0
        jobs = await c.stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000))
        assert list(jobs.jobs) == []


async def test_every_known_tier_name_is_accepted(db_url):
    async with Cluster(db_url) as c:
        for tier in ("node", "leaf", "spine", "cluster"):
            job = await c.submit(f"ok-{tier}", 1, 8, command=("sleep", "0.1"), required_tier=tier, preferred_tier=tier)
            assert (job.spec.required_tier, job.spec.preferred_tier) == (tier, tier)
        assert c.job_rows() == 4


async def test_sdk_raises_invalid_argument_for_an_unknown_tier(db_url):
    async with Cluster(db_url) as c:
        async with AsyncClient(c.scheduler.address, timeout=10) as client:
            with pytest.raises(InvalidArgumentError, match="valid tiers: node, leaf, spine, cluster"):
                await client.submit("bad", 1, 8, ["sleep", "1"], required_tier="Leaf")
        assert c.job_rows() == 0


# -- a gang that can never fit under one domain of its required tier -------------------------------------------------


async def test_impossible_required_tier_is_failed_precondition(db_url):
    async with Cluster(db_url) as c:
        # 5 nodes x 8 GPUs under one leaf, but every leaf has 4 nodes.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.submit("wide", 5, 8, required_tier="leaf")
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        message = info.value.details()
        assert "required_tier=leaf" in message and "5 replicas of 8 GPUs" in message
        assert "4 node(s)" in message and "at most 4" in message
        # Two replicas of 8 GPUs never share one 8-GPU node.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.submit("fat", 2, 8, required_tier="node")
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "required_tier=node" in info.value.details()
        assert c.job_rows() == 0
        # The same gangs under a tier that can hold them are accepted; a preference is never refused.
        spine = await c.submit("wide-spine", 5, 8, command=("sleep", "0.1"), required_tier="spine")
        pref = await c.submit("wide-pref", 5, 8, command=("sleep", "0.1"), preferred_tier="leaf")
        small = await c.submit("small-node", 2, 4, command=("sleep", "0.1"), required_tier="node")
        tiers = (spine.spec.required_tier, pref.spec.preferred_tier, small.spec.required_tier)
        assert tiers == ("spine", "leaf", "node")
        assert c.job_rows() == 3


async def test_impossible_tier_counts_every_known_node_even_when_busy(db_url):
    """The refusal is from static capacity: a leaf that is busy now still counts, so the gang is accepted."""
    async with Cluster(db_url) as c:
        busy = await c.submit("busy", 4, 8, command=("run",), required_tier="leaf")
        await eventually(lambda: _in_state(c, busy.id, RUNNING), what="busy gang running")
        waiting = await c.submit("waits", 4, 8, command=("run",), required_tier="leaf")
        assert waiting.spec.required_tier == "leaf"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.submit("never", 5, 8, required_tier="leaf")
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def _in_state(c: Cluster, job_id: str, state: int):
    job = await c.job(job_id)
    return job if job.state == state else None


# -- the round trip ------------------------------------------------------------------------------------------------


async def test_tiers_round_trip_through_submit_get_list_ledger_and_restart(db_url):
    async with Cluster(db_url) as c:
        job = await c.submit("leafy", 2, 8, command=("run",), required_tier="leaf", preferred_tier="node")
        assert (job.spec.required_tier, job.spec.preferred_tier) == ("leaf", "node")
        got = await c.job(job.id)
        assert (got.spec.required_tier, got.spec.preferred_tier) == ("leaf", "node")
        listed = {j.id: j for j in (await c.stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000))).jobs}
        assert listed[job.id].spec.required_tier == "leaf"
        assert c.sql("SELECT required_tier, preferred_tier FROM jobs WHERE id = :j", j=job.id) == [("leaf", "node")]
        # The scheduler's view hands the tiers to the placement core.
        record = c.scheduler.service.state.jobs[job.id]
        request = record.request()
        assert (request.required_tier, request.preferred_tier) == ("leaf", "node")
        running = await eventually(lambda: _in_state(c, job.id, RUNNING), what="leafy running")
        assert len(running.allocations) == 2
        assert running.spec.required_tier == "leaf"
        plain = await c.submit("plain", 1, 8, command=("run",))
        assert (plain.spec.required_tier, plain.spec.preferred_tier) == ("", "")
    # A fresh scheduler on the same ledger loads the tiers back (ledger.job_from_row).
    async with Cluster(db_url) as c:
        record = c.scheduler.service.state.jobs[job.id]
        assert (record.required_tier, record.preferred_tier) == ("leaf", "node")
        assert c.scheduler.service.state.jobs[plain.id].required_tier == ""
        assert (await c.job(job.id)).spec.preferred_tier == "node"


async def test_cli_submit_and_job_json_show_the_tiers(db_url, capsys, service_logs):
    async with Cluster(db_url) as c:
        capsys.readouterr()
        base = ("--scheduler", c.scheduler.address, "--timeout", "10")
        code, out, err = await _cli(
            capsys,
            *base,
            "submit",
            "--name",
            "cli",
            "--replicas",
            "2",
            "--gpus-per-replica",
            "8",
            "--required-tier",
            "leaf",
            "--preferred-tier",
            "node",
            "--json",
            "--",
            "sleep",
            "30",
        )
        assert code == 0, err
        submitted = json.loads(out)
        assert (submitted["required_tier"], submitted["preferred_tier"]) == ("leaf", "node")
        code, out, err = await _cli(capsys, *base, "job", submitted["id"], "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert (shown["required_tier"], shown["preferred_tier"]) == ("leaf", "node")
        code, out, err = await _cli(capsys, *base, "jobs", "--json")
        assert code == 0, err
        assert [j["required_tier"] for j in json.loads(out)["jobs"]] == ["leaf"]
        # Refusals come back as the CLI's error lines, exit code 1, nothing on stdout.
        code, out, err = await _cli(
            capsys,
            *base,
            "submit",
            "--name",
            "x",
            "--replicas",
            "1",
            "--gpus-per-replica",
            "8",
            "--required-tier",
            "rack",
            "--json",
            "--",
            "true",
        )
        assert code == 1 and out == "" and err.startswith("error: INVALID_ARGUMENT: ") and "valid tiers" in err
        code, out, err = await _cli(
            capsys,
            *base,
            "submit",
            "--name",
            "x",
            "--replicas",
            "5",
            "--gpus-per-replica",
            "8",
            "--required-tier",
            "leaf",
            "--json",
            "--",
            "true",
        )
        assert code == 1 and out == "" and err.startswith("error: FAILED_PRECONDITION: ")
        assert c.job_rows() == 1


async def test_sdk_submit_and_to_dict_carry_the_tiers(db_url):
    async with Cluster(db_url) as c:
        async with AsyncClient(c.scheduler.address, timeout=10) as client:
            job = await client.submit("sdk", 1, 8, ["sleep", "30"], required_tier="spine", preferred_tier="leaf")
            assert (job.required_tier, job.preferred_tier) == ("spine", "leaf")
            again = await client.get_job(job.id)
            assert again.to_dict()["required_tier"] == "spine" and again.to_dict()["preferred_tier"] == "leaf"
            plain = await client.submit("plain", 1, 8, ["sleep", "30"])
            assert (plain.to_dict()["required_tier"], plain.to_dict()["preferred_tier"]) == ("", "")
            with pytest.raises(FailedPreconditionError, match="required_tier=leaf"):
                await client.submit("wide", 5, 8, ["sleep", "30"], required_tier="leaf")


# -- migration 0001 -> 0002 on an existing ledger ----------------------------------------------------------------------


@pytest.mark.slow
async def test_migration_0002_keeps_existing_jobs_with_empty_tiers(empty_db_url):
    url = empty_db_url
    upgrade(url, "0001")
    assert current(url) == "0001"
    engine = make_engine(url)
    with engine.begin() as conn:  # a job written by a 0001 scheduler (plain SQL: the models are at head)
        conn.execute(
            text(
                "INSERT INTO jobs (id, request_id, name, state, priority, replicas, gpus_per_replica, procs_per_replica, "
                "command, env, attempt, message, exit_code, placement, submitted_at, started_at, finished_at, version) "
                "VALUES ('0123456789ab', NULL, 'old', 'SUCCEEDED', 0, 1, 8, 0, :command, '{}', 1, 'done', 0, '{}', "
                "1.0, 2.0, 3.0, 2)"
            ),
            {"command": json.dumps(["true"])},
        )
    engine.dispose()
    upgrade(url)
    assert current(url) == head_revision()
    assert run_sql(url, "SELECT name, required_tier, preferred_tier FROM jobs") == [("old", "", "")]
    # The scheduler reads the old row, and writes new ones with tiers next to it.
    async with Cluster(url) as c:
        old = await c.job("0123456789ab")
        assert old.spec.name == "old" and old.state == common_pb2.JOB_STATE_SUCCEEDED
        assert (old.spec.required_tier, old.spec.preferred_tier) == ("", "")
        new = await c.submit("new", 1, 8, command=("sleep", "0.1"), required_tier="leaf")
        assert (await c.job(new.id)).spec.required_tier == "leaf"
    rows = run_sql(url, "SELECT name, required_tier FROM jobs WHERE name = 'new'")
    assert rows == [("new", "leaf")]
    # The old job finished in 1970: it is kept once, in jobs or (once the scheduler's retention, --retain-finished
    # 30d, took it) in the archive.
    kept = run_sql(url, "SELECT id, state FROM jobs WHERE name = 'old'")
    kept += run_sql(url, "SELECT id, state FROM job_archive WHERE name = 'old'")
    assert kept == [("0123456789ab", "SUCCEEDED")]
