"""The operator's spare pools' pure rules (phalanx.core.pools): a definition's problems, the booking per domain, the
node a swap takes, what is lent, the pool invariant, and placement hiding pool nodes from gangs without a time
limit (placement.place_gang with ClusterCapacity.lending)."""

from __future__ import annotations

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import place_gang
from phalanx.core.pools import Candidate, SparePool, choose_pool_node, lent, pool_problems, rebook
from phalanx.core.spare_invariants import pool_violations

DOMAINS = {"nvl-0": ["n0", "n1", "n2"], "nvl-1": ["n3", "n4", "n5"]}


def idle(name: str, gpus: int = 4) -> Candidate:
    return Candidate(name, True, True, (), gpus)


def test_problems_name_each_bad_input():
    assert pool_problems("p", "nvlink", 1, DOMAINS, ["node", "nvlink", "cluster"]) == []
    assert "unknown tier 'rack'" in pool_problems("p", "rack", 1, None, ["node", "nvlink"])[0]
    assert "at least 1" in pool_problems("p", "nvlink", 0, DOMAINS, [])[0]
    assert "more than any domain" in pool_problems("p", "nvlink", 4, DOMAINS, [])[0]
    assert "pool name" in pool_problems("a b", "nvlink", 1, DOMAINS, [])[0]
    assert len(pool_problems("", "rack", -1, None, [])) == 3


def test_rebook_books_idle_nodes_keeps_borrowed_ones_and_drops_lost_or_taken_ones():
    pool = SparePool("p", "nvlink", 1)
    nodes = {n: idle(n) for ns in DOMAINS.values() for n in ns}
    nodes["n0"] = Candidate("n0", True, False, (("gang", False),), 4)  # busy with normal work
    assert rebook(pool, DOMAINS, nodes, ()) == {"nvl-0": ["n1"], "nvl-1": ["n3"]}
    pool.booked = {"nvl-0": ["n1"], "nvl-1": ["n3"]}
    nodes["n1"] = Candidate("n1", True, False, (("backfill", True),), 4)  # lent: kept
    assert rebook(pool, DOMAINS, nodes, ()) == {"nvl-0": ["n1"], "nvl-1": ["n3"]}
    nodes["n3"] = Candidate("n3", False, True, (), 4)  # lost: replaced by an idle node of its domain
    nodes["n1"] = Candidate("n1", True, False, (("gang", False),), 4)  # swapped into a gang: replaced
    assert rebook(pool, DOMAINS, nodes, ()) == {"nvl-0": ["n2"], "nvl-1": ["n4"]}
    # Another pool's nodes are not booked twice; a domain with none idle has a missing node.
    assert rebook(SparePool("q", "nvlink", 2), DOMAINS, nodes, {"n2", "n4"}) == {"nvl-0": [], "nvl-1": ["n5"]}


def test_choose_pool_node_takes_the_dead_nodes_domain_only_and_enough_gpus():
    pools = [SparePool("p", "nvlink", 1, booked={"nvl-0": ["n2"], "nvl-1": ["n5"]})]
    domain_of = {"nvlink": {"n0": "nvl-0", "n3": "nvl-1"}}
    got = choose_pool_node(pools, domain_of, "n3", 4, {"n2": 4, "n5": 4})
    assert got is not None and got[1] == "n5"
    assert choose_pool_node(pools, domain_of, "n0", 8, {"n2": 4, "n5": 8}) is None  # too few GPUs there
    assert choose_pool_node(pools, {"nvlink": {}}, "n0", 4, {"n2": 4}) is None  # not in any pool's domain


def test_lent_and_the_invariant():
    pool = SparePool("p", "nvlink", 1, booked={"nvl-0": ["n2"], "nvl-1": ["n5"]})
    assert lent(pool, {"n2": ["bf"], "n0": ["gang"]}) == {"n2": ["bf"]}
    assert pool_violations([pool], [("bf", 600.0, ["n2"]), ("gang", 0.0, ["n0", "n1"])]) == []
    assert pool_violations([pool], [("gang", 0.0, ["n0", "n5"])]) == [
        "job gang without a time limit holds node n5 of pool p"
    ]


def test_placement_hides_pool_nodes_from_gangs_without_a_time_limit():
    cap = ClusterCapacity([NodeCapacity(f"n{i}", 4, set(range(4)), path=(f"nvl-{i // 3}",)) for i in range(6)])
    cap.lending = frozenset({"n2", "n5"})
    for i in (0, 1, 3, 4):
        cap.take(f"n{i}", range(4))
    plain = place_gang(cap, GangRequest("plain", 1, 4))
    assert not isinstance(plain, Placement)  # only pool nodes are free
    limited = place_gang(cap, GangRequest("limited", 1, 4, time_limit=600))
    assert isinstance(limited, Placement) and limited.nodes[0] in {"n2", "n5"}
    assert cap.nodes["n2"].schedulable and cap.nodes["n5"].schedulable  # shown again afterwards
    cap.release("n0", range(4))  # a normal node free again: a time-limited gang goes there, not on the pool
    again = place_gang(cap, GangRequest("limited", 1, 4, time_limit=600))
    assert isinstance(again, Placement) and again.nodes[0] == "n0"
    cap.lending = frozenset()
    assert isinstance(place_gang(cap, GangRequest("plain", 2, 4)), Placement)


def test_the_pool_less_view_follows_every_change_and_is_rebuilt_when_the_booking_changes():
    nodes = [NodeCapacity(f"n{i}", 4, set(range(4)), path=(f"nvl-{i // 3}",), gpu_model="H100") for i in range(6)]
    cap = ClusterCapacity(nodes)
    cap.lending = frozenset({"n2", "n5"})
    view = cap.unlent()
    assert sorted(view.nodes) == ["n0", "n1", "n3", "n4"] and cap.unlent() is view
    first = place_gang(cap, GangRequest("a", 2, 4, gpu_model="h100"))  # a restricted view inside the pool-less one
    assert isinstance(first, Placement)
    cap.reserve(first)  # through the whole view: the pool-less one (and its GPU-model view) follow
    second = place_gang(cap, GangRequest("b", 2, 4, gpu_model="h100"))
    assert isinstance(second, Placement) and not set(second.nodes) & set(first.nodes)
    cap.reserve(second)
    assert not isinstance(place_gang(cap, GangRequest("c", 1, 4, gpu_model="h100")), Placement)
    cap.set_schedulable("n2", False)
    lent = place_gang(cap, GangRequest("d", 1, 4, time_limit=60))
    assert isinstance(lent, Placement) and lent.nodes[0] == "n5"  # n2 is down
    cap.lending = frozenset({"n5"})  # the booking changed: n2 back to normal work (once schedulable)
    assert cap.unlent() is not view and "n2" in cap.unlent().nodes
    cap.set_schedulable("n2", True)
    assert isinstance(place_gang(cap, GangRequest("e", 1, 4)), Placement)
