"""Queues, quotas with cohort borrowing and DRF fair share (phalanx/core/quota.py), and their use in the scheduling
pass (phalanx/core/backfill.py)."""

from __future__ import annotations

import pytest

from phalanx.core.backfill import schedule_with_backfill
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity
from phalanx.core.quota import FlavorQuota, QueueSpec, QuotaBook, Refusal, demand, fair_order, usage_of

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def book(queues, usage=None, gpus=64.0):
    return QuotaBook({q.name: q for q in queues}, usage or {}, {"gpus": gpus, "mig_slices": 56})


def job(job_id, replicas=1, gpus=8, priority=0, t=0.0, **kw):
    return GangRequest(job_id, replicas, gpus, priority=priority, submitted_at=t, **kw)


def test_demand_counts_gpus_shares_and_mig_slices():
    assert demand(job("a", 2, 8)) == (16.0, 0)
    assert demand(job("b", 4, 1, gpu_milli=250)) == (1.0, 0)
    assert demand(job("c", 2, 1, mig_profile="3g.40gb")) == (0.0, 6)


def test_within_nominal_then_borrowing_from_the_cohort_then_refused():
    a = QueueSpec("a", {"H100": FlavorQuota(gpus=16, borrow_limit=8)}, cohort="research")
    b = QueueSpec("b", {"H100": FlavorQuota(gpus=16)}, cohort="research")
    q = book([a, b], {"a": {"H100": (16.0, 0)}, "b": {"H100": (4.0, 0)}})
    got = q.admit("a", job("x", 1, 8))
    assert [(x.flavor, x.borrowing, x.request.gpu_model) for x in got] == [("H100", True, "H100")]
    refused = q.admit("a", job("y", 2, 8))  # 16 beyond nominal > borrow limit 8
    assert isinstance(refused, Refusal) and "borrow limit 8" in refused.reason
    assert [x.borrowing for x in q.admit("b", job("z", 1, 8))] == [False]
    q.charge("b", "H100", job("z", 1, 8))  # b now uses 12 of 16: lends 4
    assert isinstance(q.admit("a", job("w", 1, 8)), Refusal)
    alone = book([QueueSpec("solo", {"H100": FlavorQuota(gpus=8)})], {"solo": {"H100": (8.0, 0)}})
    assert "no cohort" in alone.admit("solo", job("v", 1, 1)).reason


def test_flavors_in_order_and_a_model_filter_picks_one():
    q = book([QueueSpec("t", {"H100": FlavorQuota(gpus=8), "A100": FlavorQuota(gpus=16)})], {"t": {"H100": (8.0, 0)}})
    assert [a.flavor for a in q.admit("t", job("x"))] == ["A100"]  # H100 full; A100 within nominal
    q2 = book([QueueSpec("t", {"H100": FlavorQuota(gpus=8), "A100": FlavorQuota(gpus=16)})])
    assert [a.flavor for a in q2.admit("t", job("x"))] == ["H100", "A100"]
    assert [a.flavor for a in q2.admit("t", job("x", gpu_model="A100"))] == ["A100"]
    assert "no quota for GPU model 'B200'" in q2.admit("t", job("x", gpu_model="B200")).reason
    assert q2.admit("nobody-configured", job("x"))[0].flavor == ""  # an unknown queue is unlimited


def test_mig_quota_counts_slices():
    q = book([QueueSpec("m", {"*": FlavorQuota(gpus=0, mig_slices=7)})])
    assert q.admit("m", job("x", 2, 1, mig_profile="3g.40gb"))[0].flavor == "*"  # 6 of 7 slices
    assert isinstance(q.admit("m", job("y", 3, 1, mig_profile="3g.40gb")), Refusal)


def test_invalid_quotas_are_refused():
    with pytest.raises(ValueError):
        FlavorQuota(gpus=-1)
    with pytest.raises(ValueError):
        FlavorQuota(gpus=1, borrow_limit=float("nan"))
    with pytest.raises(ValueError):
        QueueSpec("q", weight=0)


def test_fair_order_interleaves_queues_by_weighted_dominant_share():
    q = book(
        [QueueSpec("a", {"*": FlavorQuota(gpus=64)}, weight=1), QueueSpec("b", {"*": FlavorQuota(gpus=64)}, weight=2)]
    )
    pending = [("a", job(f"a{i}", t=i)) for i in range(6)] + [("b", job(f"b{i}", t=i + 0.5)) for i in range(6)]
    picked = []
    for queue, request in fair_order(pending, q):
        picked.append(queue)
        q.charge(queue, "*", request)
        if len(picked) == 6:
            break
    assert picked.count("b") == 4 and picked.count("a") == 2  # b weighs twice as much
    # Priority first: a high-priority job of the busier queue still goes before the others.
    q3 = book([QueueSpec("a"), QueueSpec("b")], {"a": {"": (32.0, 0)}})
    order = [r.job_id for _, r in fair_order([("a", job("hi", priority=5, t=9)), ("b", job("lo", t=0))], q3)]
    assert order == ["hi", "lo"]


def cluster(models: list[str], per_leaf: int = 4):
    names = [f"n{i}" for i in range(len(models))]
    fabric = default_fabric(names, nodes_per_leaf=per_leaf)
    return ClusterCapacity(
        NodeCapacity(n, 8, set(range(8)), True, fabric.path(n), None, m) for n, m in zip(names, models)
    ), fabric.tiers


def test_a_pass_skips_what_its_quota_refuses_and_charges_the_flavor_it_used():
    cap, tiers = cluster([H100] * 2 + [A100] * 2)
    queues = [
        QueueSpec("small", {"H100": FlavorQuota(gpus=8), "A100": FlavorQuota(gpus=8)}),
        QueueSpec("other", {"*": FlavorQuota(gpus=32)}),
    ]
    q = book(queues, gpus=32)
    pending = [job("s1", t=1), job("s2", t=2), job("s3", t=3), job("o1", 2, 8, t=4)]
    owner = {"s1": "small", "s2": "small", "s3": "small", "o1": "other"}
    result = schedule_with_backfill(cap, pending, tiers, book=q, queues=owner)
    assert {p.job_id for p in result.placements} == {"s1", "s2", "o1"}
    assert result.flavors["s1"] == "H100" and result.flavors["s2"] == "A100" and result.flavors["o1"] == "*"
    assert "over queue 'small'" in result.quota_blocked["s3"]
    assert result.blocked is None  # a quota refusal is not a capacity head: nothing is reserved for it
    placed = {p.job_id: p for p in result.placements}
    assert all(n in ("n0", "n1") for n in placed["s1"].nodes) and all(n in ("n2", "n3") for n in placed["s2"].nodes)


def test_drf_shares_converge_to_the_weights_under_saturation():
    """Three queues with weights 1, 2, 3 keep 40 jobs each waiting on a 48-node cluster: after many rounds of
    jobs finishing and the pass refilling, each queue holds GPUs in proportion to its weight (fairness error)."""
    cap, tiers = cluster([H100] * 48, per_leaf=8)
    specs = [QueueSpec(n, {}, weight=w) for n, w in (("w1", 1), ("w2", 2), ("w3", 3))]
    running: dict[str, tuple[str, GangRequest, object]] = {}
    seq = 0
    pending: list[GangRequest] = []
    owner: dict[str, str] = {}
    samples = []
    for round_ in range(60):
        for queue in ("w1", "w2", "w3"):
            while sum(1 for r in pending if owner[r.job_id] == queue) < 40:
                seq += 1
                request = job(f"j{seq}", t=seq)
                owner[request.job_id] = queue
                pending.append(request)
        usage = usage_of((owner[j], "", r) for j, (_, r, _) in running.items())
        q = QuotaBook({s.name: s for s in specs}, usage, {"gpus": 48 * 8})
        result = schedule_with_backfill(cap, pending, tiers, book=q, queues=owner)
        placed = {p.job_id: p for p in result.placements}
        for p in result.placements:
            running[p.job_id] = (owner[p.job_id], next(r for r in pending if r.job_id == p.job_id), p)
        pending = [r for r in pending if r.job_id not in placed]
        if round_ >= 20:
            held = {s.name: 0 for s in specs}
            for queue, request, _ in running.values():
                held[queue] += request.gpus
            samples.append({k: v / (48 * 8) for k, v in held.items()})
        # A sixth of the running jobs (the oldest) finish each round.
        for job_id in sorted(running, key=lambda j: int(j[1:]))[: max(1, len(running) // 6)]:
            cap.release_placement(running.pop(job_id)[2])
    target = {"w1": 1 / 6, "w2": 2 / 6, "w3": 3 / 6}
    mean = {k: sum(s[k] for s in samples) / len(samples) for k in target}
    error = max(abs(mean[k] - target[k]) for k in target)
    assert error < 0.05, (mean, target)
