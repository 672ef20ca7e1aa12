"""The Young/Daly checkpoint interval policy: the pure formula and prior (phalanx.core.checkpoint_policy), the
coordinator's measured figures (GetCheckpointPolicy, GetCheckpointRequest) on SQLite and PostgreSQL, and the
rank-side automatic interval in phalanx.train."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest
from helpers.clock import FakeClock
from helpers.jobs import insert_job
from sqlalchemy import insert

from db.engine import make_engine
from db.models import Allocation, Checkpoint, Gpu, Node, NodeEvent
from phalanx import train
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc
from phalanx.core import checkpoint_policy as cp
from services.checkpoint_coordinator import serve
from services.checkpoint_coordinator.store import policy as store_policy

JOB = "job-policy-1"
OTHER = "job-policy-2"
H = 3600.0
PRIOR_NODE_MTBF_S = 6000 * H


# -- the formula and the prior (pure) ----------------------------------------------------------------------------


def test_young_daly_interval_known_numbers():
    # cost 60 s, MTBF 6,000 h = 21.6e6 s: sqrt(2 x 21.6e6 x 60) = sqrt(2.592e9) ~ 50,912 s ~ 14.1 h
    assert cp.young_daly_interval(60, PRIOR_NODE_MTBF_S) == math.sqrt(2 * 21.6e6 * 60)
    assert cp.young_daly_interval(60, PRIOR_NODE_MTBF_S) == pytest.approx(50_911.688, abs=1e-3)
    assert cp.young_daly_interval(8, 100) == 40.0
    assert cp.interval(8, 100) == 40.0  # Young's is the default method


def test_daly_refinement():
    young = cp.young_daly_interval(60, PRIOR_NODE_MTBF_S)
    daly = cp.daly_interval(60, PRIOR_NODE_MTBF_S)
    assert daly == pytest.approx(young - 60, rel=1e-3) and daly < young  # C << M: ~ sqrt(2CM) - C
    x = 8 / 200
    assert cp.interval(8, 100, method="daly") == pytest.approx(40 * (1 + math.sqrt(x) / 3 + x / 9) - 8)
    assert cp.daly_interval(300, 100) == 100  # C >= 2M: the MTBF itself


def test_prior_is_documented_and_close_to_llama3():
    prior = cp.DEFAULT_PRIOR
    assert (prior.events, prior.node_hours) == (2.0, 12_000.0)
    assert prior.node_mtbf_s == PRIOR_NODE_MTBF_S
    llama3_node_hours_per_interruption = 2048 * 54 * 24 / 419  # 16,384 GPUs / 8, 54 days, 419 interruptions
    assert llama3_node_hours_per_interruption == pytest.approx(6335, abs=1)
    assert abs(prior.node_mtbf_s / H / llama3_node_hours_per_interruption - 1) < 0.1


def test_no_data_gives_the_prior_and_many_events_the_data():
    assert cp.node_mtbf_s(0, 0) == PRIOR_NODE_MTBF_S
    # 1,000 failures in 100,000 node-hours (a measured MTBF of 100 h): (12,000 + 100,000) / (2 + 1,000) h
    measured = cp.node_mtbf_s(1000, 100_000)
    assert measured == (12_000 + 100_000) / 1002 * H
    assert abs(measured / (100 * H) - 1) < 0.12
    # node-hours without failures lengthen the estimate; failures shorten it
    assert cp.node_mtbf_s(0, 12_000) == 2 * PRIOR_NODE_MTBF_S
    assert cp.node_mtbf_s(2, 0) == PRIOR_NODE_MTBF_S / 2
    custom = cp.FailurePrior(events=1, node_hours=100)
    assert cp.node_mtbf_s(1, 100, custom) == 100 * H


def test_job_mtbf_divides_by_the_nodes_it_spans():
    assert cp.job_mtbf_s(PRIOR_NODE_MTBF_S, 1) == PRIOR_NODE_MTBF_S
    assert cp.job_mtbf_s(PRIOR_NODE_MTBF_S, 4) == 1500 * H
    policy = cp.compute_policy(events=0, node_hours=0, nodes=4)
    assert policy.mtbf_s == 1500 * H and policy.node_mtbf_s == PRIOR_NODE_MTBF_S
    assert policy.interval_s == math.sqrt(2 * 1500 * H * 60)
    assert (policy.cost_s, policy.cost_source, policy.cost_samples) == (60.0, "prior", 0)
    assert (policy.mtbf_source, policy.method, policy.nodes) == ("prior", "young", 4)
    # twice the nodes: 1/sqrt(2) of the interval
    assert cp.compute_policy(events=0, node_hours=0, nodes=8).interval_s == pytest.approx(
        policy.interval_s / math.sqrt(2)
    )


def test_cost_estimate_job_then_cluster_then_prior():
    assert cp.estimate_cost([10, 20], [100]) == (15.0, "job", 2)
    assert cp.estimate_cost([], [30, 50]) == (40.0, "cluster", 2)
    assert cp.estimate_cost([0.0, 0.0], [8]) == (8.0, "cluster", 1)  # a zero duration measured nothing
    assert cp.estimate_cost([], []) == (cp.PRIOR_COST_S, "prior", 0) == (60.0, "prior", 0)
    assert cp.estimate_cost([], [], prior_cost_s=5) == (5.0, "prior", 0)
    measured = cp.compute_policy(events=3, node_hours=10, job_durations=[4, 6])
    assert (measured.cost_s, measured.mtbf_source) == (5.0, "measured+prior")
    assert measured.interval_s == math.sqrt(2 * (12_010 / 5 * H) * 5)


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: cp.young_daly_interval(-1, 100), "cost_s must be > 0"),
        (lambda: cp.young_daly_interval(0, 100), "cost_s must be > 0"),
        (lambda: cp.young_daly_interval(float("nan"), 100), "cost_s must be finite"),
        (lambda: cp.young_daly_interval(60, 0), "mtbf_s must be > 0"),
        (lambda: cp.young_daly_interval(60, float("inf")), "mtbf_s must be finite"),
        (lambda: cp.young_daly_interval("x", 100), "must be a number"),
        (lambda: cp.daly_interval(60, -5), "mtbf_s must be > 0"),
        (lambda: cp.interval(60, 100, method="fast"), "method must be one of young, daly"),
        (lambda: cp.node_mtbf_s(-1, 0), "events must be >= 0"),
        (lambda: cp.node_mtbf_s(0, float("nan")), "node_hours must be finite"),
        (lambda: cp.job_mtbf_s(100, 0), "nodes must be an integer >= 1"),
        (lambda: cp.job_mtbf_s(100, 1.5), "nodes must be an integer >= 1"),
        (lambda: cp.FailurePrior(events=0), "prior events must be > 0"),
        (lambda: cp.FailurePrior(node_hours=-1), "prior node_hours must be > 0"),
        (lambda: cp.estimate_cost([-1], []), "checkpoint duration must be >= 0"),
        (lambda: cp.estimate_cost([], [], prior_cost_s=0), "prior_cost_s must be > 0"),
        (lambda: cp.compute_policy(events=-1, node_hours=0), "events must be an integer >= 0"),
        (lambda: cp.compute_policy(events=0, node_hours=-2), "node_hours must be >= 0"),
    ],
)
def test_invalid_inputs_raise_value_error(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


# -- the coordinator's measured figures ---------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fresh_cluster_figures(monkeypatch):
    """These tests change the cluster's figures between calls: no caching of them."""
    monkeypatch.setattr(store_policy, "CLUSTER_FIGURES_TTL_S", 0.0)


@pytest.fixture
async def server(db_url):
    insert_job(db_url, JOB, attempt=1, replicas=1)  # one rank: its ranks save with WORLD_SIZE 1
    insert_job(db_url, OTHER, attempt=0)
    srv = await serve(db_url, "127.0.0.1:0", sweep_interval=0)
    yield srv
    await srv.stop(0)


@pytest.fixture
async def stub(server):
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)


def _write(db_url: str, *statements) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        for table, rows in statements:
            if rows:
                conn.execute(insert(table), rows)
    engine.dispose()


def _nodes(spans: list[tuple[float, float]]) -> tuple:
    return Node, [
        {"id": i + 1, "name": f"node-{i + 1}", "state": "READY", "gpus": 2, "registered_at": reg, "last_heartbeat": hb}
        for i, (reg, hb) in enumerate(spans)
    ]


def _gpus(nodes: int) -> tuple:
    return Gpu, [{"id": n * 10 + g, "node_id": n, "index": g} for n in range(1, nodes + 1) for g in range(2)]


def _events(*severities: str, node: int = 1) -> tuple:
    return NodeEvent, [
        {"node_id": node, "at": 100.0 + i, "severity": s, "kind": "LOST" if s == "FATAL" else "XID"}
        for i, s in enumerate(severities)
    ]


def _checkpoints(
    job: str,
    durations: list[float],
    *,
    state: str = "COMMITTED",
    start: float = 1000.0,
    attempt: int = 1,
    tag: str = "",
) -> tuple:
    rows = []
    for i, d in enumerate(durations):
        created = start + 100 * i
        rows.append(
            {
                "id": f"{job[-1]}{tag}{state[0]}{i}",
                "job_id": job,
                "attempt": attempt,
                "step": i + 1,
                "state": state,
                "created_at": created,
                "committed_at": created + d if state == "COMMITTED" else None,
                "world_size": 1,
                "deadline_at": created + 600,
                "message": "",
            }
        )
    return Checkpoint, rows


async def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details()


async def test_policy_without_data_is_the_prior(stub):
    p = await stub.GetCheckpointPolicy(pb.GetCheckpointPolicyRequest(job_id=JOB))
    assert (p.job_id, p.nodes, p.events, p.node_hours, p.cost_samples) == (JOB, 1, 0, 0.0, 0)
    assert (p.cost_source, p.mtbf_source, p.method) == ("prior", "prior", "young")
    assert (p.prior_events, p.prior_node_hours) == (2.0, 12_000.0)
    assert p.node_mtbf_s == p.mtbf_s == PRIOR_NODE_MTBF_S and p.cost_s == 60.0
    assert p.interval_s == pytest.approx(math.sqrt(2 * 21.6e6 * 60))


async def test_policy_measures_failures_nodes_and_cost(stub, db_url):
    _write(
        db_url,
        # alive 2 h, 1 h, and a heartbeat before the registration (counts 0): 3 node-hours
        _nodes([(0.0, 7200.0), (1000.0, 4600.0), (5000.0, 4000.0)]),
        _gpus(3),
        _events("FATAL", "WARNING", "FATAL", node=1),
        _events("FATAL", "DEGRADED", node=2),
        (
            Allocation,
            [
                # the job's current attempt (1): two GPUs on node 1, one on node 2 -> 2 nodes
                {
                    "job_id": JOB,
                    "attempt": 1,
                    "replica": 0,
                    "node_id": 1,
                    "gpu_id": 10,
                    "gpu_index": 0,
                    "reserved_at": 1.0,
                    "released_at": None,
                },
                {
                    "job_id": JOB,
                    "attempt": 1,
                    "replica": 0,
                    "node_id": 1,
                    "gpu_id": 11,
                    "gpu_index": 1,
                    "reserved_at": 1.0,
                    "released_at": None,
                },
                {
                    "job_id": JOB,
                    "attempt": 1,
                    "replica": 1,
                    "node_id": 2,
                    "gpu_id": 20,
                    "gpu_index": 0,
                    "reserved_at": 1.0,
                    "released_at": None,
                },
                # released, and of an old attempt: not counted
                {
                    "job_id": JOB,
                    "attempt": 1,
                    "replica": 1,
                    "node_id": 3,
                    "gpu_id": 30,
                    "gpu_index": 0,
                    "reserved_at": 1.0,
                    "released_at": 2.0,
                },
                {
                    "job_id": JOB,
                    "attempt": 0,
                    "replica": 0,
                    "node_id": 3,
                    "gpu_id": 31,
                    "gpu_index": 1,
                    "reserved_at": 0.5,
                    "released_at": None,
                },
            ],
        ),
        # the job's committed checkpoints: 10 s and 20 s; a zero-length (RecordCheckpoint) one, a pending and an
        # aborted one, and another job's, are not its cost
        _checkpoints(JOB, [10.0, 20.0]),
        _checkpoints(JOB, [0.0], start=5000.0, tag="z"),
        _checkpoints(JOB, [1.0], state="PENDING", start=6000.0),
        _checkpoints(JOB, [1.0], state="ABORTED", start=7000.0),
        _checkpoints(OTHER, [500.0], attempt=0),
    )
    p = await stub.GetCheckpointPolicy(pb.GetCheckpointPolicyRequest(job_id=JOB))
    assert (p.events, p.nodes, p.cost_samples, p.cost_source, p.mtbf_source) == (3, 2, 2, "job", "measured+prior")
    assert p.node_hours == pytest.approx(3.0)
    node_mtbf = (12_000 + 3) / (2 + 3) * H
    assert p.node_mtbf_s == pytest.approx(node_mtbf) and p.mtbf_s == pytest.approx(node_mtbf / 2)
    assert p.cost_s == pytest.approx(15.0)
    assert p.interval_s == pytest.approx(math.sqrt(2 * (node_mtbf / 2) * 15.0))

    # the other job has no allocation (1 node) and its own 500 s checkpoint; the cluster figures are the same
    o = await stub.GetCheckpointPolicy(pb.GetCheckpointPolicyRequest(job_id=OTHER))
    assert (o.nodes, o.events, o.cost_source, o.cost_samples) == (1, 3, "job", 1)
    assert o.cost_s == pytest.approx(500.0) and o.mtbf_s == pytest.approx(node_mtbf)

    # GetCheckpointRequest carries the same suggestion to the ranks
    state = await stub.GetCheckpointRequest(pb.GetCheckpointRequestRequest(job_id=JOB, attempt=1))
    assert not state.requested
    assert (state.interval_s, state.mtbf_s, state.cost_s) == (p.interval_s, p.mtbf_s, p.cost_s)
    await stub.RequestCheckpoint(pb.RequestCheckpointRequest(job_id=JOB, reason="user"))
    state = await stub.GetCheckpointRequest(pb.GetCheckpointRequestRequest(job_id=JOB, attempt=1))
    assert state.requested and state.reason == "user" and state.interval_s == p.interval_s


async def test_cost_uses_the_jobs_last_five_then_the_clusters_last_twenty(stub, db_url):
    # the job: durations 1..7 s, in commit order: the last five are 3..7 (mean 5)
    # the other job: 25 checkpoints, 1..25 s: the cluster's last twenty (of 32) are the other job's 6..25
    _write(
        db_url,
        _checkpoints(JOB, [float(d) for d in range(1, 8)], start=0.0),
        _checkpoints(OTHER, [float(d) for d in range(1, 26)], attempt=0, start=10_000.0),
    )
    p = await stub.GetCheckpointPolicy(pb.GetCheckpointPolicyRequest(job_id=JOB))
    assert (p.cost_s, p.cost_source, p.cost_samples) == (pytest.approx(5.0), "job", 5)
    insert_job(db_url, "job-policy-3", attempt=0)  # no checkpoint of its own
    q = await stub.GetCheckpointPolicy(pb.GetCheckpointPolicyRequest(job_id="job-policy-3"))
    assert (q.cost_s, q.cost_source, q.cost_samples) == (pytest.approx(15.5), "cluster", 20)


async def test_cost_falls_back_to_the_cluster(stub, db_url):
    _write(db_url, _checkpoints(OTHER, [4.0, 8.0], attempt=0))
    p = await stub.GetCheckpointPolicy(pb.GetCheckpointPolicyRequest(job_id=JOB))
    assert (p.cost_s, p.cost_source, p.cost_samples) == (pytest.approx(6.0), "cluster", 2)
    assert p.interval_s == pytest.approx(math.sqrt(2 * PRIOR_NODE_MTBF_S * 6.0))


async def test_policy_errors(stub):
    code, details = await _code(stub.GetCheckpointPolicy(pb.GetCheckpointPolicyRequest(job_id="")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "job_id is required" in details
    for job_id in ("no-such-job", "x" * 300, "bad\x00id"):
        code, details = await _code(stub.GetCheckpointPolicy(pb.GetCheckpointPolicyRequest(job_id=job_id)))
        assert code == grpc.StatusCode.NOT_FOUND and "not found" in details


# -- the rank side: the automatic interval -------------------------------------------------------------------------


def _env(server, tmp_path: Path, **extra) -> dict[str, str]:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "PHALANX_JOB_ID": JOB,
        "PHALANX_ATTEMPT": "1",
        "PHALANX_CHECKPOINT_ADDR": server.address,
        "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "PHALANX_CHECKPOINT_POLL_S": "0",
    }
    env.update(extra)
    return env


async def test_auto_interval_triggers_and_the_jobs_policy_wins(server, stub, db_url, tmp_path, monkeypatch):
    # A failure-prone cluster and a near-free checkpoint make the suggestion short: 9,998 failures in no
    # node-hours give a node MTBF of 12,000 / 10,000 h = 4,320 s, and a 10 us checkpoint sqrt(2 x 4320 x 1e-5) s.
    _write(db_url, _nodes([(0.0, 0.0)]), _events(*["FATAL"] * 9998), _checkpoints(JOB, [1e-5], start=1000.0))
    policy = await stub.GetCheckpointPolicy(pb.GetCheckpointPolicyRequest(job_id=JOB))
    assert policy.interval_s == pytest.approx(math.sqrt(2 * 4320 * 1e-5), rel=1e-6)
    assert 0.2 < policy.interval_s < 0.4
    # The ranks' clock is the test's: the interval passes when the test moves it, however long the set-up took.
    from phalanx.train import _checkpointer

    clock = FakeClock()
    monkeypatch.setattr(_checkpointer, "time", clock)

    auto = train.Checkpointer(_env(server, tmp_path))
    explicit_auto = train.Checkpointer(_env(server, tmp_path, PHALANX_CHECKPOINT_POLICY="AUTO"))
    off = train.Checkpointer(_env(server, tmp_path, PHALANX_CHECKPOINT_POLICY="off"))
    by_time = train.Checkpointer(_env(server, tmp_path, PHALANX_CHECKPOINT_INTERVAL_S="1000"))
    by_steps = train.Checkpointer(_env(server, tmp_path, PHALANX_CHECKPOINT_EVERY="1000"))
    everyone = [auto, explicit_auto, off, by_time, by_steps]
    try:
        assert [await asyncio.to_thread(c.should_checkpoint, 1) for c in everyone] == [False] * 5
        assert auto.suggested_interval_s == pytest.approx(policy.interval_s)
        assert auto.auto_interval_s == pytest.approx(policy.interval_s)
        assert (off.auto_interval_s, by_time.auto_interval_s, by_steps.auto_interval_s) == (0.0, 0.0, 0.0)
        assert explicit_auto.auto_interval_s == pytest.approx(policy.interval_s)
        clock.advance(policy.interval_s + 0.01)
        # The job's own policy wins: these do not ask for a checkpoint when the suggested interval passes.
        assert [await asyncio.to_thread(c.should_checkpoint, 2) for c in (off, by_time, by_steps)] == [False] * 3
        asked = await stub.GetCheckpointRequest(pb.GetCheckpointRequestRequest(job_id=JOB, attempt=1))
        assert not asked.requested
        # The automatic policy asks for one (reason "interval"); with one rank the agreed step is the next one.
        assert not await asyncio.to_thread(auto.should_checkpoint, 2)
        asked = await stub.GetCheckpointRequest(pb.GetCheckpointRequestRequest(job_id=JOB, attempt=1))
        assert (asked.requested, asked.reason, asked.target_step) == (True, "interval", 3)
        assert await asyncio.to_thread(auto.should_checkpoint, 3)
        result = await asyncio.to_thread(auto.save, 3, {"w": 1})
        assert result.committed
        assert not await asyncio.to_thread(auto.should_checkpoint, 4)  # measured again from the save
    finally:
        for c in everyone:
            c.close()


def test_bad_policy_env_is_refused(tmp_path):
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "PHALANX_JOB_ID": JOB,
        "PHALANX_ATTEMPT": "0",
        "PHALANX_CHECKPOINT_ADDR": "127.0.0.1:1",
        "PHALANX_CHECKPOINT_DIR": str(tmp_path),
        "PHALANX_CHECKPOINT_POLICY": "sometimes",
    }
    with pytest.raises(train.CheckpointConfigError, match="PHALANX_CHECKPOINT_POLICY"):
        train.Checkpointer(env)


def test_cluster_figures_are_cached_for_every_poll_of_a_while(db_url, monkeypatch):
    monkeypatch.setattr(store_policy, "CLUSTER_FIGURES_TTL_S", 30.0)
    store_policy._cluster_cache.clear()
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            first = store_policy._cluster_figures(conn)
        with engine.begin() as conn:
            conn.execute(
                insert(Node).values(name="n1", state="READY", gpus=8, registered_at=0.0, last_heartbeat=3600.0)
            )
        with engine.connect() as conn:
            assert store_policy._cluster_figures(conn) == first  # within the TTL: the cached figures
        store_policy._cluster_cache.clear()
        with engine.connect() as conn:
            assert store_policy._cluster_figures(conn)[1] == first[1] + 3600.0
    finally:
        store_policy._cluster_cache.clear()
        engine.dispose()
