"""Host CPUs and memory in the scheduling core: placement only where both are free, reservations all or nothing,
preemption and backfill giving them back (phalanx.core.resources)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.capacity import CapacityError, ClusterCapacity
from phalanx.core.decide import DecideConfig, Memo, PendingJob, Reserve, RunningJob, Snapshot, Wait, decide
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import Unplaceable, place_gang
from phalanx.core.preemption import PreemptionPolicy
from phalanx.core.resources import (
    check_use,
    cpu_milli,
    describe,
    format_cpus,
    format_size,
    human_size,
    parse_size,
    room,
)

G = 2**30


def node(name: str, gpus: int = 8, cpus: int = 32, memory: int = 256 * G, path: tuple[str, ...] = ("leaf0",)):
    return NodeCapacity(name, gpus, set(range(gpus)), True, path, cpu_milli=cpus * 1000, memory=memory)


def ask(job: str, replicas: int, gpus: int, cpus: float = 0, memory: int = 0, **kw) -> GangRequest:
    return GangRequest(job, replicas, gpus, cpu_milli=round(cpus * 1000), memory=memory, **kw)


# ---- sizes and CPUs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,want",
    [("512M", 512 << 20), ("64G", 64 << 30), ("1.5G", 3 << 29), ("2Ti", 2 << 40), ("4096", 4096), ("8GiB", 8 << 30)],
)
def test_sizes_parse(text: str, want: int) -> None:
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "0", "-1G", "12X", "G", "1.0000001K", "64 GB of RAM", "nan", "2000P"])
def test_malformed_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size like 512M"):
        parse_size(text)


@given(st.integers(min_value=1, max_value=1 << 50))
@settings(max_examples=200, deadline=None)
def test_a_size_formats_back_to_itself(n: int) -> None:
    assert parse_size(format_size(n)) == n


def test_cpus_are_thousandths() -> None:
    assert cpu_milli(0.5) == 500 and cpu_milli(8) == 8000 and cpu_milli(0) == 0
    assert format_cpus(500) == "0.5" and format_cpus(8000) == "8"
    for bad in (-1.0, float("nan"), float("inf"), 0.0001):
        with pytest.raises(ValueError):
            cpu_milli(bad)
    assert describe(8000, 64 * G) == "8 CPUs and 64G memory" and describe(1000, 0) == "1 CPU"
    assert human_size(3 << 29) == "1.5G"


# ---- placement ---------------------------------------------------------------------------------------------------


def test_a_request_without_host_resources_sees_the_gpus_alone() -> None:
    cap = ClusterCapacity([node("n0", cpus=0, memory=0)])
    got = place_gang(cap, ask("j", 1, 8))
    assert isinstance(got, Placement) and got.replicas[0].cpu_milli == 0


def test_replicas_go_only_where_their_cpus_and_memory_are_free() -> None:
    # n0 has the GPUs but too few CPUs for two replicas; n1 feeds both.
    cap = ClusterCapacity([node("n0", cpus=8), node("n1", cpus=32)])
    cap.reserve(Placement("busy", (ReplicaPlacement(0, "n1", (0, 1, 2, 3)),), "", 0, 0.0, ""))
    got = place_gang(cap, ask("j", 2, 2, cpus=6))
    assert isinstance(got, Placement)
    assert [r.node for r in got.replicas] == ["n1", "n1"]
    assert all(r.cpu_milli == 6000 and r.memory == 0 for r in got.replicas)
    cap.reserve(got)
    assert cap.nodes["n1"].cpu_used == 12000 and cap.nodes["n0"].cpu_used == 0


def test_memory_binds_as_cpus_do_and_the_reason_says_so() -> None:
    cap = ClusterCapacity([node("n0", memory=100 * G), node("n1", memory=100 * G)])
    got = place_gang(cap, ask("j", 4, 2, memory=40 * G))
    assert isinstance(got, Placement) and sorted(r.node for r in got.replicas) == ["n0", "n0", "n1", "n1"]
    refused = place_gang(cap, ask("k", 6, 1, memory=40 * G))
    assert isinstance(refused, Unplaceable)
    assert "40G memory" in refused.reason and "100G memory" in refused.reason


def test_a_node_that_reported_no_cpus_takes_no_replica_asking_for_them() -> None:
    cap = ClusterCapacity([node("old", cpus=0, memory=0), node("new", gpus=4)])
    got = place_gang(cap, ask("j", 1, 4, cpus=1))
    assert isinstance(got, Placement) and got.replicas[0].node == "new"
    assert isinstance(place_gang(cap, ask("k", 2, 4, cpus=1)), Unplaceable)


def test_a_cpu_bound_node_offers_its_closest_gpus() -> None:
    from phalanx.core.closeness import GpuCloseness

    # GPUs 4-7 are one NVLink clique, 0-3 another (higher is closer); CPUs feed one replica of 4.
    ranks = tuple(tuple(0 if i == j else (9 if (i < 4) == (j < 4) else 1) for j in range(8)) for i in range(8))
    n = node("n0", cpus=4)
    n.closeness = GpuCloseness(ranks, False)
    n.free = {0, 4, 5, 6, 7}
    got = place_gang(ClusterCapacity([n]), ask("j", 1, 4, cpus=4))
    assert isinstance(got, Placement) and got.replicas[0].gpus == (4, 5, 6, 7)


def test_partial_replicas_stop_at_what_their_node_feeds() -> None:
    cap = ClusterCapacity([node("n0", gpus=1, cpus=4), node("n1", gpus=1, cpus=4)])
    got = place_gang(cap, ask("j", 4, 1, cpus=2, gpu_milli=200))
    assert isinstance(got, Placement)
    per = {}
    for r in got.replicas:
        per[r.node] = per.get(r.node, 0) + 1
    assert per == {"n0": 2, "n1": 2}
    assert isinstance(place_gang(cap, ask("k", 5, 1, cpus=2, gpu_milli=100)), Unplaceable)
    assert cap.nodes["n0"].schedulable and cap.nodes["n0"].cpu_used == 0  # the search left nothing behind


@given(
    cpus=st.lists(st.integers(min_value=0, max_value=16), min_size=1, max_size=6),
    gangs=st.lists(
        st.tuples(st.integers(1, 3), st.sampled_from([1, 2, 4]), st.integers(0, 8), st.integers(0, 3)),
        min_size=1,
        max_size=8,
    ),
)
@settings(max_examples=60, deadline=None)
def test_reserved_host_resources_never_exceed_a_node(cpus: list[int], gangs) -> None:
    cap = ClusterCapacity(node(f"n{i}", cpus=c, memory=64 * G) for i, c in enumerate(cpus))
    held: dict[str, list[int]] = {n: [0, 0] for n in cap.nodes}
    placed = []
    for i, (replicas, gpus, c, m) in enumerate(gangs):
        got = place_gang(cap, ask(f"j{i}", replicas, gpus, cpus=c, memory=m * 16 * G))
        if isinstance(got, Placement):
            cap.reserve(got)
            placed.append(got)
            for r in got.replicas:
                held[r.node][0] += r.cpu_milli
                held[r.node][1] += r.memory
    for n in cap.nodes.values():
        assert n.cpu_used <= n.cpu_milli and n.memory_used <= n.memory
        assert [n.cpu_used, n.memory_used] == held[n.name]
    for p in placed:
        cap.release_placement(p)
    assert all(n.cpu_used == 0 and n.memory_used == 0 and len(n.free) == n.total for n in cap.nodes.values())


def test_a_reservation_over_a_nodes_cpus_changes_nothing() -> None:
    cap = ClusterCapacity([node("n0", cpus=8)])
    over = Placement(
        "j",
        (ReplicaPlacement(0, "n0", (0,), cpu_milli=5000), ReplicaPlacement(1, "n0", (1,), cpu_milli=5000)),
        "",
        0,
        0.0,
        "",
    )
    assert "has 8 of its 8 CPUs free, not 10" in check_use(cap.nodes, over.replicas)
    with pytest.raises(CapacityError, match="CPUs free"):
        cap.reserve(over)
    assert cap.nodes["n0"].free == set(range(8)) and cap.nodes["n0"].cpu_used == 0
    assert room(cap.nodes["n0"], 5000, 0) == 1


# ---- the decision ------------------------------------------------------------------------------------------------


def _running(job: str, reps: tuple[ReplicaPlacement, ...], priority: int = 0) -> RunningJob:
    g = len(reps[0].gpus)
    request = GangRequest(job, len(reps), g, priority, cpu_milli=reps[0].cpu_milli, memory=reps[0].memory)
    placement = Placement(job, reps, "", 0, 0.0, "")
    return RunningJob(request, placement, 0.0, "default", "*", gpus=float(len(reps) * g), progress_since=0.0)


def test_preemption_frees_cpus_when_cpus_are_what_binds() -> None:
    """The node has idle GPUs, but its CPUs are taken: the preemptor evicts the low-priority gang holding them."""
    cap = ClusterCapacity([node("n0", cpus=16)])
    lo = _running("lo", (ReplicaPlacement(0, "n0", (0, 1), cpu_milli=16000),))
    cap.reserve(lo.placement)
    snap = Snapshot(
        capacity=cap,
        pending=[PendingJob(ask("hi", 1, 2, cpus=8, priority=10, submitted_at=1.0), "default", 0.0)],
        running={"lo": lo},
        config=DecideConfig(preemption=PreemptionPolicy(min_runtime_s=0.0, grace_period_s=0.0), poll_s=5.0),
        memo=Memo(),
    )
    plan = decide(snap, 10_000.0)
    reserves = plan.of(Reserve)
    assert [r.job for r in reserves] == ["hi"]
    assert reserves[0].placement.replicas[0].cpu_milli == 8000
    assert cap.nodes["n0"].cpu_used == 8000  # lo's CPUs given back, hi's taken


def test_a_gang_waits_with_a_reason_naming_the_cpus() -> None:
    cap = ClusterCapacity([node("n0", cpus=16)])
    lo = _running("lo", (ReplicaPlacement(0, "n0", (0,), cpu_milli=12000),))
    cap.reserve(lo.placement)
    snap = Snapshot(
        capacity=cap,
        pending=[PendingJob(ask("j", 1, 1, cpus=8, submitted_at=1.0), "default", 0.0)],
        running={"lo": lo},
        config=DecideConfig(poll_s=5.0),
        memo=Memo(),
    )
    plan = decide(snap, 10_000.0)
    (wait,) = plan.of(Wait)
    assert "8 CPUs" in wait.status.reason and "4 CPUs" in wait.status.reason


def test_a_binding_placement_leaves_the_index_as_it_found_it() -> None:
    """The narrowed view is the capacity itself for the search (no copy); afterwards every node and the index read
    as before, and a fresh index over the same nodes agrees with it."""
    nodes = [node(f"n{i}", cpus=8 if i % 3 else 64, path=(f"leaf{i // 4}", "spine0")) for i in range(16)]
    cap = ClusterCapacity(nodes)
    cap.reserve(Placement("busy", (ReplicaPlacement(0, "n1", (0, 1), cpu_milli=4000),), "", 0, 0.0, ""))
    before = {n.name: (set(n.free), n.schedulable) for n in cap.nodes.values()}
    stats = {lv: cap.domain_stats(lv, 2) for lv in range(cap.levels() + 1)}
    got = place_gang(cap, ask("j", 6, 2, cpus=4, avoid=frozenset({"n0"})))
    assert isinstance(got, Placement)
    per: dict[str, int] = {}
    for r in got.replicas:
        per[r.node] = per.get(r.node, 0) + 4000
    assert all(cap.nodes[n].cpu_used + c <= cap.nodes[n].cpu_milli for n, c in per.items())
    assert {n.name: (set(n.free), n.schedulable) for n in cap.nodes.values()} == before
    assert {lv: cap.domain_stats(lv, 2) for lv in range(cap.levels() + 1)} == stats
    fresh = ClusterCapacity(cap.copy().nodes.values())
    assert {lv: fresh.domain_stats(lv, 2) for lv in range(fresh.levels() + 1)} == stats


@given(
    nodes=st.lists(
        st.tuples(st.integers(0, 8), st.integers(0, 32), st.integers(0, 4)),  # free GPUs, free CPUs, leaf
        min_size=1,
        max_size=12,
    ),
    gpus=st.sampled_from([1, 2, 4, 8]),
    cpus=st.integers(1, 24),
)
@settings(max_examples=150, deadline=None)
def test_a_gang_of_one_replica_goes_to_the_tightest_node_whose_cpus_feed_it(nodes, gpus: int, cpus: int) -> None:
    """Issue 35's faster placement with host resources keeps the rule for a gang of one replica: best fit by free GPUs
    among the nodes whose CPUs feed it, and it waits only when no node can hold it."""
    made = []
    for i, (free, free_cpus, leaf) in enumerate(nodes):
        n = node(f"n{i:02d}", cpus=32, path=(f"leaf{leaf}", "spine0"))
        n.free = set(range(free))
        n.cpu_used = (32 - free_cpus) * 1000
        made.append(n)
    cap = ClusterCapacity(made)
    feasible = [n for n in made if len(n.free) >= gpus and (n.cpu_milli - n.cpu_used) >= cpus * 1000]
    got = place_gang(cap, ask("j", 1, gpus, cpus=cpus))
    if not feasible:
        assert isinstance(got, Unplaceable)
        return
    assert isinstance(got, Placement)
    (rep,) = got.replicas
    chosen = cap.nodes[rep.node]
    assert chosen in feasible and len(rep.gpus) == gpus and set(rep.gpus) <= chosen.free
    assert len(chosen.free) == min(len(n.free) for n in feasible)
    assert rep.cpu_milli == cpus * 1000


def test_nodes_with_free_lists_the_schedulable_nodes_with_a_free_gpu_as_a_scan_would() -> None:
    cap = ClusterCapacity(node(f"n{i}", gpus=4) for i in range(6))
    cap.take("n0", {0, 1, 2, 3})
    cap.take("n1", {0})
    cap.set_schedulable("n2", False)
    cap.release("n0", {3})
    expected = {n.name for n in cap.nodes.values() if n.schedulable and n.free}
    assert {n.name for n in cap.nodes_with_free()} == expected == {"n0", "n1", "n3", "n4", "n5"}
