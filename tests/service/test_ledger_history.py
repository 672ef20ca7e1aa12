"""phalanx.testing.history: a small hand-written ledger read back as invariant events, in the order a scheduler's
cycles make them, and judged by the checker (the live chaos test, tests/e2e/test_chaos_invariants.py, relies on it).
"""

from __future__ import annotations

import json

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from db.models import Allocation, Claim, Gpu, Job, JobAttempt, LedgerChange, Node, NodeEvent
from phalanx.core import invariants as inv
from phalanx.testing.history import history_from_ledger, starts_from_ledger

BATCH, DEFAULT, CRITICAL = -100, 0, 200


def _ledger(url: str, *, claims: bool = True) -> None:
    engine = create_engine(url)
    with Session(engine) as s:
        nodes = [Node(name=n, state="READY", gpus=8, registered_at=0.0, last_heartbeat=0.0) for n in ("n1", "n2", "n3")]
        s.add_all(nodes)
        s.flush()
        gpus = {(n.name, i): Gpu(node_id=n.id, index=i, mig_mode="DISABLED") for n in nodes for i in range(8)}
        s.add_all(gpus.values())
        s.flush()

        def job(job_id, priority, replicas, state, submitted, finished=0.0):
            s.add(
                Job(
                    id=job_id,
                    name=job_id,
                    state=state,
                    priority=priority,
                    replicas=replicas,
                    gpus_per_replica=8,
                    command=["true"],
                    submitted_at=submitted,
                    finished_at=finished,
                )
            )

        def attempt(job_id, n, reserved, ended, outcome, by="", where=(), released=None):
            s.add(
                JobAttempt(
                    job_id=job_id,
                    attempt=n,
                    gpus=8.0 * len(where),
                    reserved_at=reserved,
                    ended_at=ended,
                    outcome=outcome,
                    preempted_by=by,
                )
            )
            for replica, node in enumerate(where):
                rel = (released or {}).get(node, ended)
                for g in range(8):
                    s.add(
                        Allocation(
                            job_id=job_id,
                            attempt=n,
                            replica=replica,
                            node_id=next(x.id for x in nodes if x.name == node),
                            gpu_id=gpus[(node, g)].id,
                            gpu_index=g,
                            reserved_at=reserved,
                            released_at=rel,
                        )
                    )

        job("batch", BATCH, 1, "SUCCEEDED", 100.0, 130.0)
        job("crit", CRITICAL, 2, "SUCCEEDED", 105.0, 115.0)
        job("other", DEFAULT, 1, "SUCCEEDED", 101.0, 140.0)
        job("lost", DEFAULT, 1, "SUCCEEDED", 150.0, 220.0)
        s.flush()
        # batch on n1, preempted for crit (asked at 105, stopped at 110; n1 confirmed the release at 111, when crit
        # started there and on n2); "other" ran on n2 and was asked at 107 by a replacement claim
        attempt("batch", 1, 100.0, 110.0, "PREEMPTED", "crit", ["n1"], {"n1": 111.0})
        attempt("other", 1, 101.0, 109.0, "PREEMPTED", "crit", ["n2"])
        attempt("crit", 1, 111.0, 115.0, "SUCCEEDED", "", ["n1", "n2"])
        attempt("batch", 2, 120.0, 130.0, "SUCCEEDED", "", ["n1"])
        attempt("other", 2, 121.0, 140.0, "SUCCEEDED", "", ["n2"])
        # "lost" on n3, lost at 200 (its GPUs held until the agent came back: registered at 204, released at 205)
        attempt("lost", 1, 150.0, 200.0, "NODE_LOST", "", ["n3"], {"n3": 205.0})
        attempt("lost", 2, 210.0, 220.0, "SUCCEEDED", "", ["n3"])
        n3 = nodes[2].id
        s.add(NodeEvent(node_id=n3, at=200.0, gpu=-1, severity="FATAL", kind="LOST", code=0, reason="lease"))
        s.add(LedgerChange(generation=1, replica="r0", at=200.0, body=json.dumps({"nodes": [n3]})))
        s.add(LedgerChange(generation=2, replica="r0", at=204.0, body=json.dumps({"nodes": [n3]})))
        if claims:
            whole = lambda node: {"node": node, "gpus": list(range(8)), "mig_profile": "", "gpu_milli": 0}  # noqa: E731
            s.add(
                Claim(
                    job_id="crit",
                    priority=CRITICAL,
                    replicas=[whole("n1"), whole("n3")],
                    victims=["batch"],
                    created_at=105.0,
                    ended_at=107.0,
                    end_reason="replaced by a new claim",
                )
            )
            s.add(
                Claim(
                    job_id="crit",
                    priority=CRITICAL,
                    replicas=[whole("n1"), whole("n2")],
                    victims=["batch", "other"],
                    created_at=107.0,
                    ended_at=111.0,
                    end_reason="it runs",
                )
            )
        s.commit()
    engine.dispose()


def _kinds(history):
    return [(type(e).__name__, getattr(e, "job", getattr(e, "victim", getattr(e, "node", "")))) for e in history]


def test_history_from_a_hand_written_ledger(sqlite_url):
    _ledger(sqlite_url)
    history = history_from_ledger(sqlite_url)
    assert isinstance(history[0], inv.Cluster) and history[0].nodes == {"n1": 8, "n2": 8, "n3": 8}
    asked = [e for e in history if isinstance(e, inv.Asked)]
    # Each victim asked once, where a claim first names it: the replacement re-lists batch but asks only other.
    assert [(e.t, e.victim, e.attempt, e.by, e.reclaim) for e in asked] == [
        (105.0, "batch", 1, "crit", False),
        (107.0, "other", 1, "crit", False),
    ]
    made = [e for e in history if isinstance(e, inv.ClaimMade)]
    assert [(e.t, e.victims) for e in made] == [(105.0, ("batch",)), (107.0, ("batch", "other"))]
    assert {(h.node, h.gpu) for h in made[1].holds} == {(n, g) for n in ("n1", "n2") for g in range(8)}
    ended = {(e.job, e.attempt): e for e in history if isinstance(e, inv.Ended)}
    assert ended[("batch", 1)].held == ("n1",) and ended[("other", 1)].held == ()
    assert ended[("lost", 1)].held == ("n3",) and ended[("crit", 1)].held == ()
    # One instant, in a cycle's order: the release confirmed, the claim ended (not the replaced one), the start.
    at_111 = [(type(e).__name__, getattr(e, "job", "")) for e in history if e.t == 111.0]
    assert at_111 == [("Released", "batch"), ("ClaimEnded", "crit"), ("Started", "crit")]
    assert [e.reason for e in history if isinstance(e, inv.ClaimEnded)] == ["it runs"]
    # The node lost at 200 is back at its registration (the first change naming it after the loss).
    assert [(type(e).__name__, e.t) for e in history if isinstance(e, inv.NodeDown | inv.NodeUp)] == [
        ("NodeDown", 200.0),
        ("NodeUp", 204.0),
    ]
    starts = [e for e in history if isinstance(e, inv.Started)]
    assert [(e.job, e.attempt, e.expected, len(e.holds)) for e in starts][:3] == [
        ("batch", 1, 8, 8),
        ("other", 1, 8, 8),
        ("crit", 1, 16, 16),
    ]
    assert [e.t for e in history] == sorted(e.t for e in history)
    assert [e.job for e in history if isinstance(e, inv.Finished)] == ["crit", "batch", "other", "lost"]
    assert inv.check(history, grace_s=5.0, tick_s=1.0) == []
    assert [(s.job, s.attempt) for s in starts_from_ledger(sqlite_url)][:3] == [("batch", 1), ("other", 1), ("crit", 1)]


def test_a_preemption_without_a_claim_is_asked_a_grace_period_before_its_end(sqlite_url):
    _ledger(sqlite_url, claims=False)
    asked = [e for e in history_from_ledger(sqlite_url, grace_s=3.0) if isinstance(e, inv.Asked)]
    assert [(e.t, e.victim, e.by) for e in asked] == [(106.0, "other", "crit"), (107.0, "batch", "crit")]
    asked = [e for e in history_from_ledger(sqlite_url) if isinstance(e, inv.Asked)]
    assert [(e.t, e.victim) for e in asked] == [(109.0, "other"), (110.0, "batch")]  # at the end, without the grace


def test_the_checker_sees_a_gang_that_takes_back_what_its_preemptor_was_freeing(sqlite_url):
    """The ledger of issue 30's loop: batch, stopped for crit, starts again on the first node released (n1) and the
    idle one, and is preempted for crit a second time; crit then gets n1."""
    engine = create_engine(sqlite_url)
    _ledger(sqlite_url, claims=False)
    with Session(engine) as s:
        s.query(Allocation).filter(Allocation.job_id.in_(["crit", "other"])).delete()
        s.query(JobAttempt).filter(JobAttempt.job_id.in_(["crit", "other"])).delete()
        s.query(Allocation).filter(Allocation.job_id == "batch", Allocation.attempt == 2).delete()
        s.query(JobAttempt).filter(JobAttempt.job_id == "batch", JobAttempt.attempt == 2).delete()
        s.query(Job).filter(Job.id.in_(["crit", "batch"])).update(dict(state="RUNNING", finished_at=0.0))
        s.commit()
    engine.dispose()
    _add_attempt(sqlite_url, "batch", 2, 111.0, 116.0, "PREEMPTED", "crit", ["n1", "n3"])
    _add_attempt(sqlite_url, "crit", 1, 117.0, None, "", "", ["n1", "n2"])
    history = history_from_ledger(sqlite_url, grace_s=2.0)
    found = {v.invariant for v in inv.check(history, grace_s=2.0, tick_s=1.0)}
    assert {"b", "c"} <= found, found


def _add_attempt(url, job_id, n, reserved, ended, outcome, by, where):
    engine = create_engine(url)
    with Session(engine) as s:
        node_ids = {x.name: x.id for x in s.query(Node)}
        gpu_ids = {(x.node_id, x.index): x.id for x in s.query(Gpu)}
        s.add(
            JobAttempt(
                job_id=job_id,
                attempt=n,
                gpus=8.0 * len(where),
                reserved_at=reserved,
                ended_at=ended,
                outcome=outcome,
                preempted_by=by,
            )
        )
        for replica, node in enumerate(where):
            for g in range(8):
                s.add(
                    Allocation(
                        job_id=job_id,
                        attempt=n,
                        replica=replica,
                        node_id=node_ids[node],
                        gpu_id=gpu_ids[(node_ids[node], g)],
                        gpu_index=g,
                        reserved_at=reserved,
                        released_at=ended,
                    )
                )
        s.commit()
    engine.dispose()
