"""Multi-level gangs through the scheduler service (LiteCluster, SQLite and PostgreSQL): a segmented gang's spec is
kept in jobs.shape, each segment placed inside one NVLink domain with contiguous ranks, a gang whose segment does
not fit now waits naming it, and bad segment fields are refused with INVALID_ARGUMENT before anything is written."""

from __future__ import annotations

import json

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually
from helpers.waits import holds

from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core import invariants as inv
from phalanx.core.fabric import default_fabric, group_nvlink_domains
from phalanx.testing.history import history_from_ledger
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

NAMES = [f"node-{i}" for i in range(8)]
# 4 NVLink domains of 2 nodes (4 GPUs each), two under each leaf, both leaves under one spine.
FABRIC = group_nvlink_domains(default_fabric(NAMES, nodes_per_leaf=4, leaves_per_spine=2), 2)


def cluster(db_url: str) -> LiteCluster:
    config = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=FABRIC)
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n, gpus=4) for n in NAMES])


def domains_of_segments(job: common_pb2.Job, s: int) -> list[set[str]]:
    nodes = {a.replica: a.node for a in job.allocations}
    return [{FABRIC.path(nodes[r])[0] for r in range(i, i + s)} for i in range(0, len(nodes), s)]


async def test_a_segmented_gang_runs_each_segment_in_one_domain(db_url):
    async with cluster(db_url) as c:
        big = await c.submit("big", 6, 4, segment=2)
        assert big.spec.segment == 2 and big.spec.segment_tier == ""
        running = await c.wait_running(big.id)
        assert [len(d) for d in domains_of_segments(running, 2)] == [1, 1, 1]
        assert [next(iter(d)) for d in domains_of_segments(running, 2)] == list(running.segment_domains)
        assert len(set(running.segment_domains)) == 3
        assert sorted(a.replica for a in running.allocations) == list(range(6))
        assert "3 segments of 2 x 4 GPUs, each inside one nvlink" in running.placement.reason
        (shape,) = c.sql("SELECT shape FROM jobs WHERE id = :id", id=big.id)[0]
        shape = json.loads(shape) if isinstance(shape, str) else shape
        assert shape == {"segment": 2, "segment_tier": ""}


async def test_a_segment_that_fits_no_free_domain_waits_naming_it_then_starts(db_url):
    async with cluster(db_url) as c:
        # Two gangs of one 3-node segment per leaf: each takes a whole NVLink domain and one node of the other, so
        # the 2 free nodes sit in two different domains.
        fillers = [await c.submit(f"filler{i}", 3, 4, segment=3, segment_tier="leaf") for i in range(2)]
        for job in fillers:
            await c.wait_running(job.id)
        waiting = await c.submit("waiting", 2, 4, segment=2)  # 2 x 4 GPUs fit the free GPUs, but in no one domain

        async def named():
            job = await c.job(waiting.id)
            return job if "segment 1 of 1 (2 x 4 GPUs) fits in no free nvlink domain now" in job.message else None

        job = await eventually(named, what="the waiting gang's message naming its segment")
        assert job.state == common_pb2.JOB_STATE_PENDING and not job.allocations

        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=fillers[0].id))
        started = await c.wait_running(waiting.id)
        assert [len(d) for d in domains_of_segments(started, 2)] == [1]

    # The ledger's history, judged by the invariants: (h) sees every start of these segmented gangs.
    history = history_from_ledger(db_url, tiers=FABRIC.tiers)
    starts = [e for e in history if isinstance(e, inv.Started)]
    assert len(starts) == 3 and all(len(e.replica_nodes) in (2, 3) for e in starts)
    assert history[0].domains["nvlink"]["node-0"] == FABRIC.path("node-0")[0]
    assert [v for v in inv.check(history) if v.invariant == "j"] == []
    checker = inv.Checker()
    checker.feed(history[0])
    bad = inv.Submitted(0.0, "x", 0, replicas=2, gpus_per_replica=4, segment=2)
    checker.feed(bad)
    crossed = inv.Started(0.0, "x", 1, (), 0, replica_nodes=("node-1", "node-2"))
    assert [v.invariant for v in checker.feed(crossed) if v.invariant == "j"] == ["j"]  # nvl-0 and nvl-1


async def test_a_leaf_segment_tier_is_kept_and_placed(db_url):
    async with cluster(db_url) as c:
        job = await c.submit("leafy", 8, 4, segment=4, segment_tier="leaf")
        running = await c.wait_running(job.id)
        assert running.spec.segment_tier == "leaf"
        assert sorted(running.segment_domains) == ["leaf0", "leaf1"]
        nodes = {a.replica: a.node for a in running.allocations}
        for i, leaf in enumerate(running.segment_domains):
            assert {FABRIC.path(nodes[r])[1] for r in range(4 * i, 4 * i + 4)} == {leaf}


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(replicas=4, segment=3), "segment 3 does not divide replicas 4"),
        (dict(replicas=4, segment=-1), "segment must be 0"),
        (dict(replicas=4, segment=2, segment_tier="rack"), "segment_tier 'rack' is not a tier"),
        (dict(replicas=4, segment=4), "fits in no nvlink domain of this cluster even when empty"),
        (dict(replicas=4, segment_tier="leaf"), "segment_tier needs segment"),
    ],
)
async def test_bad_segments_are_invalid_argument_and_write_nothing(db_url, fields, words):
    async with cluster(db_url) as c:
        await eventually(
            lambda: holds(lambda: len(c.scheduler.service.state.nodes) == len(NAMES)), what="every node registered"
        )
        fields = dict(fields)  # the parameter is shared by the SQLite and PostgreSQL runs
        replicas = fields.pop("replicas")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit("bad", replicas, 4, **fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in err.value.details()
        assert c.sql("SELECT count(*) FROM jobs")[0][0] == 0
