"""The capacity view never counts a GPU its node does not have: a node registered again with fewer GPUs, and the
allocations read back for its rebuild still name the GPUs that vanished (the scheduler tears those gangs down)."""

from __future__ import annotations

from phalanx.core.capacity import ClusterCapacity, shape_key, vanished_gpus
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import place_gang

H100 = ("NVIDIA H100 80GB HBM3", 81559)


def node(gpus: int, mig=()) -> NodeCapacity:
    return NodeCapacity("n", gpus, set(range(gpus)) - set(mig), True, ("leaf",), None, *H100, mig_gpus=frozenset(mig))


def only_existing_gpus(cap: ClusterCapacity) -> bool:
    return all(set(n.free) | set(n.mig) | set(n.milli) <= set(range(n.total)) for n in cap.nodes.values())


SHARE = ReplicaPlacement(0, "n", (3,), gpu_milli=500)
MIG = ReplicaPlacement(0, "n", (2,), mig_profile="3g.40gb", mig_start=0, mig_size=4)
WHOLE = ReplicaPlacement(0, "n", (1, 2))


def test_parts_and_whole_gpus_of_vanished_gpus_are_not_counted():
    cap = ClusterCapacity([node(1)])
    cap.take_partial(SHARE)
    cap.take_partial(MIG)
    cap.take("n", WHOLE.gpus)
    n = cap.nodes["n"]
    assert (n.free, n.milli, n.mig) == ({0}, {}, {})
    assert only_existing_gpus(cap)
    assert shape_key(n) == (*H100, 1, 1, (), ())  # no half share of a GPU 3 to offer
    # Releasing them (the torn-down gangs) changes nothing either.
    cap.release_partial(SHARE)
    cap.release_partial(MIG)
    cap.release("n", WHOLE.gpus)
    assert (n.free, n.milli, n.mig) == ({0}, {}, {}) and cap.free_gpus() == 1


def test_a_share_is_placed_on_a_gpu_that_exists():
    """The scheduler's cycle failed on "n has no GPU 3": the share left on the vanished GPU 3 drew the next one."""
    cap = ClusterCapacity([node(2)])
    cap.take("n", {0})
    cap.take_partial(SHARE)
    got = place_gang(cap, GangRequest("next", 1, 1, gpu_milli=250))
    assert isinstance(got, Placement) and got.replicas[0].gpus == (1,)
    cap.reserve(got)
    assert cap.nodes["n"].milli == {1: 250} and only_existing_gpus(cap)


def test_vanished_gpus_names_what_a_gang_holds_beyond_the_nodes_gpus():
    reps = [ReplicaPlacement(0, "n", (0, 1)), ReplicaPlacement(1, "m", (5,)), SHARE]
    assert vanished_gpus(reps, "n", 8) == []
    assert vanished_gpus(reps, "n", 2) == [3]
    assert vanished_gpus(reps, "n", 1) == [1, 3]
    assert vanished_gpus(reps, "n", 0) == [0, 1, 3]
    assert vanished_gpus(reps, "m", 4) == [5]
    assert vanished_gpus(reps, "other", 0) == []
