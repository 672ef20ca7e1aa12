"""The free-capacity view of a cluster that placement reads and reservations update.

Static structure (which domain of each tier a node sits in) is built once per set of nodes; free capacity is an
index kept up to date on every reservation and release: for each domain, a histogram of its nodes' free-GPU
counts. "How many replicas of G GPUs does this leaf hold?" is then a sum over at most (GPUs per node + 1)
buckets, not a scan of the leaf's nodes, and the best-fitting single node comes from a bucket of nodes with the
same free count.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from operator import mul

from .mig import MEDIA_BIT, family_slices, full_mask, mig_family
from .model import FULL_MIG_MASK, NodeCapacity, Placement, ReplicaPlacement
from .resources import check_use

# A node's free shape (`shape_key`): (GPU model, memory MiB, GPUs, whole free GPUs, MIG masks, milli shares in use).
NodeShape = tuple[str, int, int, int, tuple[int, ...], tuple[int, ...]]


class CapacityError(RuntimeError):
    """A reservation or release that does not match the view: a bug or a stale view."""


def domain_key(node: NodeCapacity, level: int, top: int) -> str:
    """Domain of `node` at `level`: 0 is the node itself, 1..top-1 its switch of that tier, `top` the cluster."""
    if level == 0:
        return node.name
    if level >= top:
        return ""
    return node.path[level - 1] if level - 1 < len(node.path) else ""


# The time budget of the exact placement search, in ms (0: none); see placement.place_gang and docs/benchmarks.md.
PLACEMENT_BUDGET_MS = 50.0


class ClusterCapacity:
    def __init__(self, nodes: Iterable[NodeCapacity] = (), *, placement_budget_ms: float = PLACEMENT_BUDGET_MS) -> None:
        self.nodes: dict[str, NodeCapacity] = {n.name: n for n in nodes}
        # What place_gang's exact search may spend on a placement in this view (decide sets it from DecideConfig).
        self.placement_budget_ms = placement_budget_ms
        self._built = False
        # Views over the nodes of one GPU model (see `restricted`), kept up to date with this one.
        self._subs: dict[str, ClusterCapacity] = {}
        # The operator's spare pools' booked nodes (phalanx.core.pools): placement hides them from a gang without a
        # time limit, so that only backfill jobs with time limits borrow them (placement.gang.place_gang, `unlent`).
        self._lending: frozenset[str] = frozenset()

    # ---- structure -------------------------------------------------------------------------------------------

    def add(self, node: NodeCapacity) -> None:
        self.nodes[node.name] = node
        self._built = False
        self._subs.clear()

    def copy(self) -> ClusterCapacity:
        """A view over copies of the nodes: changing it leaves this one (and its nodes) alone."""
        view = ClusterCapacity(
            (
                dataclasses.replace(n, free=set(n.free), mig=dict(n.mig), milli=dict(n.milli), foreign=dict(n.foreign))
                for n in self.nodes.values()
            ),
            placement_budget_ms=self.placement_budget_ms,
        )
        view.lending = self.lending
        return view

    @property
    def lending(self) -> frozenset[str]:
        return self._lending

    @lending.setter
    def lending(self, nodes: frozenset[str]) -> None:
        if nodes != self._lending:
            self._lending = frozenset(nodes)
            self._subs.pop(_UNLENT, None)

    def unlent(self) -> ClusterCapacity:
        """The same nodes less the spare pools' (`lending`), with their own index kept up to date with this one, as
        `restricted`'s: placement of a gang without a time limit reads it, and hiding the pools' nodes costs nothing
        per placement (it is rebuilt only when the pools' booking changes)."""
        sub = self._subs.get(_UNLENT)
        if sub is None:
            lending = self._lending
            sub = self._subs[_UNLENT] = ClusterCapacity(
                (n for n in self.nodes.values() if n.name not in lending), placement_budget_ms=self.placement_budget_ms
            )
        sub.placement_budget_ms = self.placement_budget_ms
        return sub

    def restricted(self, gpu_model: str) -> ClusterCapacity:
        """The same nodes, only those whose GPU model contains `gpu_model` (case-insensitive), with their own
        index. It shares the NodeCapacity objects and follows every change made through this view."""
        key = gpu_model.lower()
        sub = self._subs.get(key)
        if sub is None:
            sub = self._subs[key] = ClusterCapacity(
                (n for n in self.nodes.values() if key in n.gpu_model.lower()),
                placement_budget_ms=self.placement_budget_ms,
            )
        return sub

    def _build(self) -> None:
        nodes = list(self.nodes.values())
        self.depth = max((len(n.path) for n in nodes), default=0)
        self.top = self.depth + 1
        self.largest = max((n.total for n in nodes), default=0)
        self._members: list[dict[str, list[NodeCapacity]]] = [{} for _ in range(self.top + 1)]
        self._hist: list[dict[str, list[int]]] = [{} for _ in range(self.top + 1)]
        # Nodes by effective free count, each bucket a sorted list of names (the tightest node is bucket[0]).
        self._by_free: list[list[str]] = [[] for _ in range(self.largest + 1)]
        self._effective: dict[str, int] = {}
        self._pos: dict[str, int] = {node.name: i for i, node in enumerate(nodes)}  # order of the members lists
        self._stats: dict[tuple[int, int], dict[str, tuple[int, int]]] = {}  # domain_stats, until a count changes
        self._weights: dict[int, list[int]] = {}  # `_slot_weights` (g), `_room_weights` (-g)
        # Child domains (keys of level - 1) of every domain of level >= 2, and whether the domains form a tree
        # (every child domain under exactly one parent); placement walks down the index only on a tree.
        self._children: list[dict[str, list[str]]] = [{} for _ in range(self.top + 1)]
        parent: list[dict[str, str]] = [{} for _ in range(self.top + 1)]
        self.is_tree = True
        for node in nodes:
            eff = min(len(node.free), self.largest) if node.schedulable else 0
            self._effective[node.name] = eff
            self._by_free[eff].append(node.name)
            for level in range(1, self.top + 1):
                key = domain_key(node, level, self.top)
                self._members[level].setdefault(key, []).append(node)
                hist = self._hist[level].get(key)
                if hist is None:
                    hist = self._hist[level][key] = [0] * (self.largest + 1)
                hist[eff] += 1
                if level >= 2:
                    child = domain_key(node, level - 1, self.top)
                    seen = parent[level - 1].setdefault(child, key)
                    if seen != key:
                        self.is_tree = False
                    elif child not in self._children[level].setdefault(key, []):
                        self._children[level][key].append(child)
        for bucket in self._by_free:
            bucket.sort()
        self.most_nodes = [1] + [
            max((len(m) for m in self._members[lv].values()), default=0) for lv in range(1, self.top + 1)
        ]
        # Effective free GPUs per domain, and per free count the tie-tier domains holding a node with that count:
        # the fragmentation tie-break of `tightest_node` reads both.
        self._dom_free: list[dict[str, int]] = [{} for _ in range(self.top + 1)]
        for level in range(1, self.top + 1):
            for key, hist in self._hist[level].items():
                self._dom_free[level][key] = sum(f * c for f, c in enumerate(hist))
        # Each node's (histogram, free totals, domain key) per level 1..top, so an update needs no key computation.
        self._cells: dict[str, list[tuple[list[int], dict[str, int], str]]] = {
            node.name: [
                (self._hist[lv][k], self._dom_free[lv], k)
                for lv in range(1, self.top + 1)
                for k in (domain_key(node, lv, self.top),)
            ]
            for node in nodes
        }
        # The tie-break's tier: the lowest switch tier whose domains group nodes (an NVLink tier of single-node
        # domains says nothing), below the cluster root; 0 when there is none.
        self._tie_level = next((lv for lv in range(1, self.top) if self.most_nodes[lv] > 1), 0)
        self._tie_key = (
            {node.name: domain_key(node, self._tie_level, self.top) for node in nodes} if self._tie_level else {}
        )
        self._leaves_with: list[set[str]] = [set() for _ in range(self.largest + 1)]
        # Per tie-tier domain, its nodes by effective free count (sorted names), like `_by_free` per domain.
        self._tie_buckets: dict[str, list[list[str]]] = {}
        for name, key in self._tie_key.items():
            buckets = self._tie_buckets.setdefault(key, [[] for _ in range(self.largest + 1)])
            buckets[self._effective[name]].append(name)
        for buckets in self._tie_buckets.values():
            for bucket in buckets:
                bucket.sort()
        if self._tie_level:
            for key, hist in self._hist[self._tie_level].items():
                for f, count in enumerate(hist):
                    if count:
                        self._leaves_with[f].add(key)
        # Each node's tie-tier (histogram, key, free-count buckets), for `_changed`.
        self._tie_cell: dict[str, tuple[list[int], str, list[list[str]]]] = {
            name: (self._hist[self._tie_level][key], key, self._tie_buckets[key]) for name, key in self._tie_key.items()
        }
        self._built = True
        self._total = sum(n.total for n in nodes)
        self.mig_mode_gpus = sum(len(n.mig_gpus) for n in nodes)  # GPUs in MIG mode (they take only MIG instances)
        self._ever: dict[int, int] = {}
        # Nodes by free shape, for partial-GPU placement (core.shares): refreshed lazily from `_dirty`.
        self._shapes: dict[NodeShape, list[str]] = {}
        self._shape_of: dict[str, NodeShape | None] = {}
        self._dirty: set[str] = set(self.nodes)
        # Nodes not schedulable (drained, down, or hidden for a while), kept with every change.
        self._down: set[str] = {node.name for node in nodes if not node.schedulable}
        self._down_frozen: frozenset[str] | None = None

    def _ensure(self) -> None:
        if not self._built:
            self._build()

    def _touch(self, node: NodeCapacity) -> None:
        """A node's free GPUs, partial use or schedulability changed: update this index and the restricted views."""
        self._changed(node)
        if self._subs:
            self._touch_subs(node)

    def _touch_subs(self, node: NodeCapacity) -> None:
        for sub in self._subs.values():
            if node.name in sub.nodes:
                sub._touch(node)

    def _changed_many(self, nodes: list[NodeCapacity]) -> None:
        """`_changed` for many distinct nodes at once (a large gang's reservation): the same index afterwards, with
        each free-count bucket they leave or join edited once instead of once per node."""
        if len(nodes) < _BATCH or not self._built:
            for node in nodes:
                self._changed(node)
            return
        largest, effective, cells, dirty, down = self.largest, self._effective, self._cells, self._dirty, self._down
        moved: list[tuple[str, int, int]] = []
        for node in nodes:
            name = node.name
            dirty.add(name)
            schedulable = node.schedulable
            if schedulable:
                if name in down:
                    down.discard(name)
                    self._down_frozen = None
            elif name not in down:
                down.add(name)
                self._down_frozen = None
            new = min(len(node.free), largest) if schedulable else 0
            old = effective[name]
            if new == old:
                continue
            effective[name] = new
            delta = new - old
            for hist, free, key in cells[name]:
                hist[old] -= 1
                hist[new] += 1
                free[key] += delta
            moved.append((name, old, new))
        if not moved:
            return
        if self._stats:
            self._stats.clear()
        _move(self._by_free, moved)
        if self._tie_level:
            by_key: dict[str, list[tuple[str, int, int]]] = {}
            tie_cell = self._tie_cell
            for move in moved:
                by_key.setdefault(tie_cell[move[0]][1], []).append(move)
            leaves_with = self._leaves_with
            for key, moves in by_key.items():
                hist, _, buckets = tie_cell[moves[0][0]]
                _move(buckets, moves)
                for f in {f for _, old, new in moves for f in (old, new)}:
                    if hist[f]:
                        leaves_with[f].add(key)
                    else:
                        leaves_with[f].discard(key)

    def _changed(self, node: NodeCapacity) -> None:
        """Move a node to the histogram buckets of its current effective free count."""
        if not self._built:
            return
        name = node.name
        self._dirty.add(name)
        schedulable = node.schedulable
        down = self._down
        if schedulable:
            if name in down:
                down.discard(name)
                self._down_frozen = None
        elif name not in down:
            down.add(name)
            self._down_frozen = None
        new = min(len(node.free), self.largest) if schedulable else 0
        effective = self._effective
        old = effective[name]
        if new == old:
            return
        effective[name] = new
        if self._stats:
            self._stats.clear()
        delta = new - old
        # Per level: the histogram and free totals of the node's domain, precomputed by _build.
        for hist, free, key in self._cells[name]:
            hist[old] -= 1
            hist[new] += 1
            free[key] += delta
        bucket = self._by_free[old]
        del bucket[bisect_left(bucket, name)]
        insort(self._by_free[new], name)
        if self._tie_level:
            hist, key, buckets = self._tie_cell[name]
            if not hist[old]:
                self._leaves_with[old].discard(key)
            if hist[new] == 1:
                self._leaves_with[new].add(key)
            bucket = buckets[old]
            del bucket[bisect_left(bucket, name)]
            insort(buckets[new], name)

    # ---- queries ---------------------------------------------------------------------------------------------

    def shape(self) -> tuple[list[int], int]:
        """The most nodes any domain of each level holds, and the largest node's GPUs."""
        self._ensure()
        return self.most_nodes, self.largest

    def levels(self) -> int:
        """Index of the top (cluster) level: 0 node, 1..depth switch tiers, depth+1 cluster."""
        self._ensure()
        return self.top

    def domain_stats(self, level: int, gpus_per_replica: int) -> dict[str, tuple[int, int]]:
        """For every domain of `level` (>= 1): (replicas of this size it holds now, free GPUs)."""
        self._ensure()
        g = gpus_per_replica
        got = self._stats.get((level, g))
        if got is not None:
            return dict(got)
        weights = self._slot_weights(g)
        free = self._dom_free[level]
        out = {key: (sum(map(mul, hist, weights)), free[key]) for key, hist in self._hist[level].items()}
        self._stats[(level, g)] = out
        return dict(out)

    def _slot_weights(self, g: int) -> list[int]:
        """Per free count f (0..largest): the replicas of `g` GPUs a node with f free holds, f // g."""
        got = self._weights.get(g)
        if got is None:
            got = self._weights[g] = [f // g for f in range(self.largest + 1)] if g > 0 else [0] * (self.largest + 1)
        return got

    def _room_weights(self, g: int) -> list[int]:
        """Per free count f: the free GPUs of a node with f free if it holds a replica of `g` GPUs, else 0."""
        got = self._weights.get(-g)
        if got is None:
            got = self._weights[-g] = [f if f >= g else 0 for f in range(self.largest + 1)]
        return got

    def members(self, level: int, key: str) -> list[NodeCapacity]:
        self._ensure()
        return self._members[level].get(key, [])

    def tightest_node(self, gpus: int) -> NodeCapacity | None:
        """The schedulable node with the fewest free GPUs that still has `gpus` free.

        Ties (nodes with the same free count) are decided by fragmentation: the node under the fullest domain
        (least free GPUs) of the lowest switch tier that groups nodes, then the domain's name, then the node's.
        Work then goes where capacity is already broken up, and emptier leaves (or NVLink domains) stay whole for
        large gangs. Reads the per-domain index: O(min(nodes with that free count, domains
        of that tier holding one)), never O(nodes).
        """
        self._ensure()
        for f in range(max(gpus, 1), self.largest + 1):
            bucket = self._by_free[f]
            if not bucket:
                continue
            tie = self._tie_level
            if len(bucket) == 1 or not tie:
                return self.nodes[bucket[0]]
            leaves = self._leaves_with[f]
            if len(bucket) <= len(leaves):
                leaves = set(map(self._tie_key.__getitem__, bucket))
            leaf = self._fullest(list(leaves))
            return self.nodes[self._tie_buckets[leaf][f][0]]
        return None

    def _fullest(self, domains: list[str]) -> str:
        """The tie-tier domain with the least free GPUs, ties by name (one C-level pass)."""
        free = self._dom_free[self._tie_level]
        return min(zip(map(free.__getitem__, domains), domains))[1]

    def nodes_with_free(self) -> Iterator[NodeCapacity]:
        """The schedulable nodes with at least one free whole GPU, from the index: O(such nodes), not a scan of every
        node (on a busy cluster most have none). Do not change the capacity while iterating."""
        self._ensure()
        nodes, by_free = self.nodes, self._by_free
        for f in range(1, self.largest + 1):
            for name in by_free[f]:
                yield nodes[name]

    def most_free_on_a_node(self) -> int:
        """The largest effective free count of any node (0 when none is schedulable or free)."""
        self._ensure()
        for f in range(self.largest, 0, -1):
            if self._by_free[f]:
                return f
        return 0

    def effective_free(self, node: str) -> int:
        """Free GPUs of `node` as placement sees them: 0 when it is not schedulable."""
        self._ensure()
        return self._effective.get(node, 0)

    def child_stats(self, level: int, key: str, gpus_per_replica: int) -> dict[str, tuple[int, int]]:
        """For every child of domain `key` of `level` (>= 1) that holds at least one replica of this size:
        (replicas it holds, free GPUs on its nodes that hold a replica). Children of a level-1 domain are nodes.

        Read from the index: O(children x GPUs per node), not a scan of the domain's nodes. Meaningful only when
        `is_tree` (for level >= 2).
        """
        self._ensure()
        g = gpus_per_replica
        out: dict[str, tuple[int, int]] = {}
        if level == 1:
            eff = self._effective
            members = self._members[1].get(key, ())
            buckets = None
            if level == self.top:
                buckets = self._by_free
            elif level == self._tie_level:
                buckets = self._tie_buckets.get(key)
            if buckets is not None and g <= self.largest:
                # The nodes with room, from the free-count buckets, in the members' order: when they are few, far
                # cheaper than a scan of a large domain (a cluster without a fabric has one of every node).
                names = [name for f in range(max(g, 1), self.largest + 1) for name in buckets[f]]
                if len(names) * 4 < len(members):
                    pos = self._pos
                    for name in sorted(names, key=pos.__getitem__):
                        f = eff[name]
                        out[name] = (f // g, f)
                    return out
            for node in members:
                f = eff[node.name]
                if f >= g:
                    out[node.name] = (f // g, f)
            return out
        hists = self._hist[level - 1]
        slot_w, room_w = self._slot_weights(g), self._room_weights(g)
        for child in self._children[level].get(key, ()):
            hist = hists[child]
            slots = sum(map(mul, hist, slot_w))
            if slots:
                out[child] = (slots, sum(map(mul, hist, room_w)))
        return out

    def shape_buckets(self) -> dict[NodeShape, list[str]]:
        """Schedulable nodes with any free capacity, grouped by free shape (`shape_key`); each list sorted by name.
        Nodes of one shape are interchangeable for a partial-GPU request, so placement scores one per shape."""
        self._ensure()
        for name in self._dirty:
            old = self._shape_of.get(name)
            new = shape_key(self.nodes[name]) if name in self.nodes else None
            if old == new:
                continue
            if old is not None:
                bucket = self._shapes[old]
                del bucket[bisect_left(bucket, name)]
                if not bucket:
                    del self._shapes[old]
            if new is not None:
                insort(self._shapes.setdefault(new, []), name)
            self._shape_of[name] = new
        self._dirty.clear()
        return self._shapes

    def node_slots(self, level: int, key: str, gpus_per_replica: int) -> tuple[int, ...]:
        """Replicas of this size each node of domain `key` of `level` (>= 1) holds, ascending; nodes that hold
        none are left out. Read from the index: O(nodes that hold one + GPUs per node)."""
        self._ensure()
        g = gpus_per_replica
        hist = self._hist[level].get(key)
        if hist is None or g < 1:
            return ()
        out: list[int] = []
        for f in range(g, len(hist)):
            if hist[f]:
                out += [f // g] * hist[f]
        return tuple(out)

    def most_slots(self, level: int, key: str, gpus_per_replica: int) -> int:
        """The most replicas of this size any one node of domain `key` of `level` (>= 1) holds."""
        self._ensure()
        hist = self._hist[level].get(key)
        if hist is None or gpus_per_replica < 1:
            return 0
        for f in range(len(hist) - 1, gpus_per_replica - 1, -1):
            if hist[f]:
                return f // gpus_per_replica
        return 0

    def unschedulable(self) -> frozenset[str]:
        """The names of the nodes that are not schedulable now (from the index: O(1) while none changes)."""
        self._ensure()
        if self._down_frozen is None:
            self._down_frozen = frozenset(self._down)
        return self._down_frozen

    def free_gpus(self) -> int:
        self._ensure()
        return sum(f * c for hist in self._hist[self.top].values() for f, c in enumerate(hist))

    def total_gpus(self) -> int:
        self._ensure()
        return self._total

    def max_replicas_ever(self, gpus_per_replica: int) -> int:
        """Replicas of this size the whole cluster could hold if empty (drained and lost nodes included, and GPUs
        in MIG mode: a mode is configuration, which the next registration may change)."""
        if gpus_per_replica <= 0:
            return 0
        self._ensure()
        if gpus_per_replica not in self._ever:
            self._ever[gpus_per_replica] = sum(n.total // gpus_per_replica for n in self.nodes.values())
        return self._ever[gpus_per_replica]

    # ---- updates ---------------------------------------------------------------------------------------------

    def reserve(self, placement: Placement) -> None:
        """Take every GPU (or part of one) of the placement and its replicas' host resources, or none (raises
        CapacityError and changes nothing)."""
        wanted: dict[str, tuple[NodeCapacity, set[int]]] = {}
        partial = [rep for rep in placement.replicas if rep.mig_profile or rep.gpu_milli]
        if partial:
            self._check_partial(partial)
        nodes = self.nodes
        first = placement.replicas[0] if placement.replicas else None
        uses = first is not None and (first.cpu_milli or first.memory)
        if uses:
            why = check_use(nodes, placement.replicas)
            if why:
                raise CapacityError(why)
        for rep in placement.replicas:
            if rep.mig_profile or rep.gpu_milli:
                continue
            node = nodes.get(rep.node)
            if node is None:
                raise CapacityError(f"unknown node {rep.node!r}")
            gpus = set(rep.gpus)
            seen = wanted.get(rep.node)
            if not gpus <= node.free or (seen is not None and gpus & seen[1]):
                raise CapacityError(f"GPUs {sorted(gpus)} of {rep.node} are not free")
            if seen is None:
                wanted[rep.node] = node, gpus
            else:
                seen[1].update(gpus)
        if len(wanted) < _BATCH or self._subs or not self._built:
            for node, gpus in wanted.values():
                self._take(node, gpus)
        else:  # a large gang: the index updated once for all its nodes
            for node, gpus in wanted.values():
                node.free -= gpus
                if node.mig_gpus and gpus & node.mig_gpus:
                    for gpu in gpus & node.mig_gpus:
                        node.mig[gpu] = FULL_MIG_MASK
            self._changed_many([node for node, _ in wanted.values()])
        for rep in partial:
            self.take_partial(rep)
        if uses:
            for rep in placement.replicas:
                self.take_use(rep.node, rep.cpu_milli, rep.memory)

    def release_placement(self, placement: Placement) -> None:
        """Give back everything `placement` holds (whole GPUs, MIG instances and shares)."""
        for rep in placement.replicas:
            self.release_replica(rep)

    def release_replica(self, rep: ReplicaPlacement) -> None:
        if rep.mig_profile or rep.gpu_milli:
            self.release_partial(rep)
        else:
            self.release(rep.node, rep.gpus)
        if rep.cpu_milli or rep.memory:
            self.release_use(rep.node, rep.cpu_milli, rep.memory)

    def take_use(self, node: str, cpu_milli: int, memory: int) -> None:
        """Hold host resources on `node` (a replica's, already checked, or read back from the ledger). Not indexed:
        placement reads them node by node (placement.gang._fitted_view)."""
        n = self.nodes.get(node)
        if n is not None:
            n.cpu_used += cpu_milli
            n.memory_used += memory

    def release_use(self, node: str, cpu_milli: int, memory: int) -> None:
        n = self.nodes.get(node)
        if n is not None:
            n.cpu_used = max(0, n.cpu_used - cpu_milli)
            n.memory_used = max(0, n.memory_used - memory)

    def _check_partial(self, reps: list[ReplicaPlacement]) -> None:
        mig: dict[tuple[str, int], int] = {}
        milli: dict[tuple[str, int], int] = {}
        for rep in reps:
            node = self.nodes.get(rep.node)
            if node is None:
                raise CapacityError(f"unknown node {rep.node!r}")
            (gpu,) = rep.gpus
            key = (rep.node, gpu)
            if not 0 <= gpu < node.total:
                raise CapacityError(f"{rep.node} has no GPU {gpu}")
            if rep.mig_profile:
                if gpu not in node.mig_gpus:
                    raise CapacityError(f"GPU {gpu} of {rep.node} is not in MIG mode: it takes no MIG instance")
                used = mig.get(key, node.mig.get(gpu, 0 if gpu in node.free else None))
                # Overlapping slices, or a second `+me` instance (MEDIA_BIT), or slices past the family's last one.
                slices = family_slices(mig_family(node.gpu_model, node.memory_mib))[1]
                if used is None or used & rep.mig_mask or (rep.mig_mask & ~MEDIA_BIT) >> slices:
                    raise CapacityError(
                        f"MIG slices {rep.mig_start}-{rep.mig_start + rep.mig_size - 1} of GPU {gpu} "
                        f"of {rep.node} are not free"
                    )
                mig[key] = used | rep.mig_mask
            else:
                used = milli.get(key, node.milli.get(gpu, 0 if gpu in node.free else None))
                if used is None or used + rep.gpu_milli > 1000:
                    raise CapacityError(f"GPU {gpu} of {rep.node} has no {rep.gpu_milli}/1000 share free")
                milli[key] = used + rep.gpu_milli
            if key in mig and key in milli:
                raise CapacityError(f"GPU {gpu} of {rep.node} cannot hold MIG instances and shares at once")

    def take_partial(self, rep: ReplicaPlacement) -> None:
        """Take a MIG instance or a share (already checked, or read back from the ledger)."""
        n = self.nodes.get(rep.node)
        if n is None:
            return
        (gpu,) = rep.gpus
        if not 0 <= gpu < n.total:  # a GPU its node no longer has (see `vanished_gpus`): nothing of it to count
            return
        n.free.discard(gpu)
        if rep.mig_profile:
            n.mig[gpu] = n.mig.get(gpu, 0) | rep.mig_mask
        else:
            n.milli[gpu] = n.milli.get(gpu, 0) + rep.gpu_milli
        self._touch(n)

    def release_partial(self, rep: ReplicaPlacement) -> None:
        n = self.nodes.get(rep.node)
        if n is None:
            return
        (gpu,) = rep.gpus
        if rep.mig_profile:
            left = n.mig.get(gpu, 0) & ~rep.mig_mask
            table = n.mig
            base = n.base_mig(gpu)
            if base is not None:  # a GPU in MIG mode stays in `mig` (its foreign slices stay used)
                n.mig[gpu] = left | base
                self._touch(n)
                return
        else:
            left = max(0, n.milli.get(gpu, 0) - rep.gpu_milli)
            table = n.milli
        if left:
            table[gpu] = left
        else:
            table.pop(gpu, None)
            if 0 <= gpu < n.total and gpu not in n.mig and gpu not in n.milli:
                n.free.add(gpu)
        self._touch(n)

    def take(self, node: str, gpus: Iterable[int]) -> None:
        n = self.nodes.get(node)
        if n is None:
            return
        self._take(n, set(gpus))

    def _take(self, n: NodeCapacity, gpus: set[int]) -> None:
        gpus = {g for g in gpus if 0 <= g < n.total}  # never a GPU the node does not have (`vanished_gpus`)
        n.free -= gpus
        if n.mig_gpus and gpus & n.mig_gpus:  # a GPU in MIG mode held whole (FATAL, or a whole-GPU job of old)
            for gpu in gpus & n.mig_gpus:
                n.mig[gpu] = FULL_MIG_MASK
        self._changed(n)
        if self._subs:
            self._touch_subs(n)

    def release(self, node: str, gpus: Iterable[int]) -> None:
        n = self.nodes.get(node)
        if n is None:
            return
        if n.mig_gpus or n.foreign:
            gpus = set(gpus)
            for gpu in gpus & n.mig_gpus:
                n.mig[gpu] = n.foreign.get(gpu, 0)
        if n.mig or n.milli:
            n.free |= {g for g in gpus if 0 <= g < n.total and g not in n.mig and g not in n.milli}
        else:
            n.free |= {g for g in gpus if 0 <= g < n.total}
        self._changed(n)
        if self._subs:
            self._touch_subs(n)

    @contextmanager
    def narrowed(self, changes: dict[str, tuple[set[int], bool]]) -> Iterator[None]:
        """Within the block, the named nodes offer only the given free GPUs and schedulability (a subset of what
        they have: placement.gang._fitted_view hides what their CPUs and memory cannot feed); the index follows, in one
        batch each way, and everything is back as it was after."""
        saved = []
        for name, (free, schedulable) in changes.items():
            node = self.nodes[name]
            saved.append((node, node.free, node.schedulable))
            node.free, node.schedulable = free, schedulable
        self._follow([node for node, _, _ in saved])
        try:
            yield
        finally:
            for node, free, schedulable in saved:
                node.free, node.schedulable = free, schedulable
            self._follow([node for node, _, _ in saved])

    def _follow(self, nodes: list[NodeCapacity]) -> None:
        self._changed_many(nodes)
        for sub in self._subs.values():
            sub._follow([n for n in nodes if n.name in sub.nodes])  # and its own views (unlent's restricted ones)

    def set_schedulable(self, node: str, schedulable: bool) -> None:
        n = self.nodes.get(node)
        if n is None:
            return
        n.schedulable = schedulable
        self._touch(n)


def vanished_gpus(replicas: Iterable[ReplicaPlacement], node: str, gpus: int) -> list[int]:
    """The GPUs of `node` that these replicas (a running gang's) hold and that a node of `gpus` GPUs does not have:
    it registered again with fewer (a GPU fell off the bus and its agent restarted). The capacity view never counts
    such a GPU (take, take_partial), and the gang holding one cannot run: the scheduler tears it down whole, as on a
    fatal GPU error. Sorted; empty when every GPU the gang holds there still exists."""
    return sorted({g for rep in replicas if rep.node == node for g in rep.gpus if not 0 <= g < gpus})


_UNLENT = "\0unlent"  # the key of `unlent`'s view among the views (a GPU model's key is never that)
_BATCH = 8  # nodes from which an update edits each free-count bucket once (`_changed_many`)


def _move(buckets: list[list[str]], moves: list[tuple[str, int, int]]) -> None:
    """Move names between sorted free-count buckets: (name, old count, new count) each, names distinct."""
    out: dict[int, list[str]] = {}
    into: dict[int, list[str]] = {}
    for name, old, new in moves:
        out.setdefault(old, []).append(name)
        into.setdefault(new, []).append(name)
    for f, names in out.items():
        bucket = buckets[f]
        if len(names) <= _BATCH:
            for name in names:
                del bucket[bisect_left(bucket, name)]
        else:
            gone = set(names)
            bucket[:] = [name for name in bucket if name not in gone]
    for f, names in into.items():
        bucket = buckets[f]
        if len(names) <= _BATCH:
            for name in names:
                insort(bucket, name)
        else:
            bucket += names
            bucket.sort()  # two sorted runs, or one run and a few: a linear merge


def shape_key(node: NodeCapacity) -> NodeShape | None:
    """What a partial-GPU request sees of a node: model, memory, GPUs, whole free GPUs, and the partial use of the
    others (sorted, since which GPU index holds what does not change the score). None when it offers nothing.
    Only GPUs in MIG mode count as MIG capacity: a GPU outside it that carries instances (a foreign one, or one
    placed before its mode was known) offers nothing."""
    if not node.schedulable:
        return None
    mig_gpus = node.mig_gpus
    full = full_mask(mig_family(node.gpu_model, node.memory_mib))  # all of the family's slices used: nothing left
    mig = tuple(sorted(m for g, m in node.mig.items() if m & full != full and g in mig_gpus))
    milli = tuple(sorted(m for m in node.milli.values() if m < 1000))
    if not node.free and not mig and not milli:
        return None
    return (node.gpu_model, node.memory_mib, node.total, len(node.free), mig, milli)
