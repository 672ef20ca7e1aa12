"""The simulator's network model: a job's step time is its compute time plus its ring AllReduce time.

Pure (no I/O). Units: bytes, bytes per second, seconds. The model, its assumptions and its sources are in
docs/design.md, "Simulator network model". In short:

- AllReduce time (NCCL's ring, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): every edge of
  the ring carries 2(n-1)/n x S bytes per AllReduce of S bytes over n ranks, so `t = 2(n-1)/n x S / B`, B being the
  ring's bus bandwidth (NCCL's "busbw"): the rate of its slowest edge.
- Edges (`ring_edges`): the ring follows rank order, as in `phalanx.core.cost.ring_cost`; an edge joins consecutive
  replicas on different nodes (and the last to the first). Inside a node the ring runs on NVLink; between two nodes
  of one multi-node NVLink domain (GB200 NVL72) on domain NVLink; otherwise over InfiniBand, NCCL's channels spread
  over the node's NICs, one NIC (rail) per GPU.
- Uncontended bus bandwidth (`ring_demand`): the least of the NVLink figure (the NVLink-domain figure for nodes of a
  multi-node domain) wherever a node holds two or more of the job's GPUs, the NVLink-domain figure wherever an edge
  joins two nodes of one domain and, per node with IB edges, (the NICs the job uses there, one per GPU up to
  `nics_per_node`, x per-rail bandwidth) / (IB edges leaving the node). So no rail carries more than its per-rail
  bandwidth.
- Uplinks: an IB edge between nodes under different switches of a tier leaves the lower switch through its uplink
  (leaf -> spine, spine -> core, ...). Each uplink's capacity is (nodes under it x NICs per node x per-rail
  bandwidth) / oversubscription; a ring with k edges leaving a domain puts k x B on its uplink. On a rail-optimized
  fabric (`Fabric.rails`), an edge inside one scalable unit whose channels change rail goes up to the spine too (the
  fraction of its channels that change rail).
- Contention (`NetworkState`): jobs whose rings cross a shared uplink get max-min fair bus bandwidths (progressive
  filling over all uplinks at once, `max_min_fair`), recomputed on every `add` and `remove`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from phalanx.core.fabric import Fabric
from phalanx.core.model import Placement, ReplicaPlacement

GB = 1e9  # bytes; bandwidths here are decimal GB/s, as NCCL and the vendors quote them

NVLINK = "nvlink"  # the ring's bottleneck is NVLink inside one node
NVLINK_DOMAIN = "nvlink_domain"  # ... NVLink between the nodes of one multi-node NVLink domain
IB = "ib"  # ... the nodes' InfiniBand NICs (rails)
UPLINK = "uplink"  # ... a shared switch uplink (contention or oversubscription)
NONE = "none"  # one rank: no AllReduce traffic


@dataclass(frozen=True, slots=True)
class NetworkSpec:
    """Link bandwidths, all per direction, in bytes per second, in NCCL's bus-bandwidth convention (busbw is
    compared with the hardware's unidirectional per-GPU peak).

    Defaults: a DGX H100 SuperPOD. NVLink4 is 18 links x 50 GB/s = 900 GB/s bidirectional per GPU, i.e. 450 GB/s
    per direction. One ConnectX-7 NDR NIC per GPU at 400 Gb/s = 50 GB/s, 8 rails. The multi-node NVLink domain
    figure is GB200 NVL72's NVLink5 (1.8 TB/s bidirectional per GPU, 900 GB/s per direction): set `nvlink_bw` to it
    too when simulating GB200 trays, and `nics_per_node` to 4.

    `oversubscription` is the leaf -> spine ratio (downlink to uplink bandwidth): 1.0 is the non-blocking SuperPOD
    reference design, 2.0 or 4.0 an oversubscribed fabric. `upper_oversubscription` applies again at every tier
    above the leaf (spine -> core, ...).
    """

    nvlink_bw: float = 450 * GB
    nvlink_domain_bw: float = 900 * GB
    ib_rail_bw: float = 50 * GB
    nics_per_node: int = 8
    oversubscription: float = 1.0
    upper_oversubscription: float = 1.0

    def __post_init__(self) -> None:
        for name in ("nvlink_bw", "nvlink_domain_bw", "ib_rail_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.nics_per_node < 1:
            raise ValueError(f"nics_per_node must be at least 1, got {self.nics_per_node!r}")
        if not (self.oversubscription >= 1.0 and self.upper_oversubscription >= 1.0):
            raise ValueError("oversubscription ratios must be at least 1.0 (1.0 = non-blocking)")

    def uplink_capacity(self, level: int, nodes_under: int) -> float:
        """Bytes/s up out of a switch of tier `level` (0 = leaf) with `nodes_under` nodes below it:
        (nodes x NICs per node x per-rail bandwidth) / (leaf ratio x upper ratio per tier above the leaf)."""
        ratio = self.oversubscription * self.upper_oversubscription**level
        return nodes_under * self.nics_per_node * self.ib_rail_bw / ratio


def allreduce_time(message_bytes: float, ranks: int, bandwidth: float) -> float:
    """Seconds of one ring AllReduce of `message_bytes` over `ranks` ranks at bus bandwidth `bandwidth` (bytes/s):
    2(n-1)/n x S / B (NCCL's busbw = algbw x 2(n-1)/n, algbw = S / t). 0 for one rank or an empty message."""
    if ranks <= 1 or message_bytes <= 0:
        return 0.0
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth!r}")
    return edge_bytes(message_bytes, ranks) / bandwidth


def edge_bytes(message_bytes: float, ranks: int) -> float:
    """Bytes each ring edge carries per AllReduce: 2(n-1)/n x S (reduce-scatter, then all-gather)."""
    return 2.0 * (ranks - 1) / ranks * message_bytes if ranks > 1 else 0.0


class Uplink(NamedTuple):
    """The uplink out of switch `domain` of fabric tier `tier` (`level` its index among the switch tiers, 0 the
    leaf): traffic leaving the domain goes up through it to the tier above."""

    level: int
    tier: str
    domain: str


@dataclass(frozen=True)
class RingDemand:
    """What one job's ring asks of the network.

    `bandwidth`: its bus bandwidth on an otherwise idle fabric before uplinks (NVLink, NVLink domain or NICs),
    `link` which of them bounds it. `uplinks`: per uplink, how many ring edges (fractional on rail-optimized
    fabrics) leave its domain; the uplink carries that many times the ring's bus bandwidth.
    """

    job_id: str
    ranks: int
    bandwidth: float
    link: str
    uplinks: Mapping[Uplink, float] = field(default_factory=dict)

    def uplink_bytes(self, message_bytes: float) -> dict[str, float]:
        """Bytes per AllReduce of `message_bytes` sent up the uplinks, per tier name ("leaf": into the spines)."""
        out: dict[str, float] = {}
        per_edge = edge_bytes(message_bytes, self.ranks)
        for up, edges in self.uplinks.items():
            out[up.tier] = out.get(up.tier, 0.0) + edges * per_edge
        return out


def _ranks(placement: Placement) -> int:
    return sum(max(len(r.gpus), 1) for r in placement.replicas)


def ring_edges(placement: Placement) -> list[tuple[ReplicaPlacement, ReplicaPlacement]]:
    """The ring's inter-node edges in rank order (replica index), wrap-around included, as `core.cost.ring_cost`
    counts its hops: each pair of consecutive replicas on different nodes."""
    replicas = sorted(placement.replicas, key=lambda r: r.replica)
    if len({r.node for r in replicas}) < 2:
        return []
    return [(a, b) for a, b in zip(replicas, replicas[1:] + replicas[:1], strict=True) if a.node != b.node]


def _same_nvlink_domain(fabric: Fabric, a: str, b: str) -> bool:
    if not fabric.has_nvlink:
        return False
    pa, pb = fabric.path(a), fabric.path(b)
    return bool(pa) and bool(pb) and pa[0] == pb[0]


def _in_multi_node_domain(fabric: Fabric, node: str) -> bool:
    """Whether the node sits in a declared (or grouped) NVLink domain rather than alone behind its own NVSwitch
    (then its domain is keyed by its own name, see core.fabric)."""
    if not fabric.has_nvlink:
        return False
    path = fabric.path(node)
    return bool(path) and path[0] != node


def _rail_change(fabric: Fabric, a: ReplicaPlacement, b: ReplicaPlacement) -> float:
    """Fraction of an edge's channels (local rank k of a to local rank k of b) that change rail."""
    pairs = list(zip(a.gpus, b.gpus, strict=False))
    if not pairs:
        return 0.0
    return sum(ga % fabric.rails != gb % fabric.rails for ga, gb in pairs) / len(pairs)


def ring_demand(placement: Placement, fabric: Fabric, spec: NetworkSpec) -> RingDemand:
    """The job's uncontended bus bandwidth, what bounds it, and the uplinks its ring crosses (see the module)."""
    ranks = _ranks(placement)
    if ranks <= 1:
        return RingDemand(placement.job_id, ranks, math.inf, NONE)
    per_node: dict[str, set[int]] = {}
    for rep in placement.replicas:
        per_node.setdefault(rep.node, set()).update(rep.gpus or (0,))
    bounds: list[tuple[float, int, str]] = []  # (bandwidth, preference on ties, link)
    for node, gpus in per_node.items():
        if len(gpus) > 1 or len(per_node) == 1:
            # A node of a multi-node domain (GB200 tray) reaches its own GPUs through the domain's NVSwitches too.
            bounds.append(
                (spec.nvlink_domain_bw, 1, NVLINK_DOMAIN)
                if _in_multi_node_domain(fabric, node)
                else (spec.nvlink_bw, 2, NVLINK)
            )
    ib_out: dict[str, int] = {}
    uplinks: dict[Uplink, float] = {}
    tiers = fabric.switch_tiers
    for a, b in ring_edges(placement):
        if _same_nvlink_domain(fabric, a.node, b.node):
            bounds.append((spec.nvlink_domain_bw, 1, NVLINK_DOMAIN))
            continue
        ib_out[a.node] = ib_out.get(a.node, 0) + 1
        pa, pb = fabric.switch_path(a.node), fabric.switch_path(b.node)
        for level in range(min(len(pa), len(pb), len(tiers))):
            if level and pa[level] == pa[level - 1]:
                continue  # a padded tier (a switch hanging off a higher one): no switch of its own here
            if pa[level] != pb[level]:
                up = Uplink(level, tiers[level], pa[level])
                uplinks[up] = uplinks.get(up, 0.0) + 1.0
            elif level == 0 and fabric.rails:
                moved = _rail_change(fabric, a, b)
                if moved:
                    up = Uplink(0, tiers[0], pa[0])
                    uplinks[up] = uplinks.get(up, 0.0) + moved
    for node, edges in ib_out.items():
        nics = min(len(per_node[node]), spec.nics_per_node)
        bounds.append((nics * spec.ib_rail_bw / edges, 0, IB))
    bandwidth, _, link = min(bounds)
    return RingDemand(placement.job_id, ranks, bandwidth, link, uplinks)


def nodes_under(fabric: Fabric) -> dict[tuple[int, str], int]:
    """Nodes below each switch: (switch tier level, switch name) -> count."""
    counts: dict[tuple[int, str], int] = {}
    for node in fabric.paths:
        for level, switch in enumerate(fabric.switch_path(node)):
            counts[(level, switch)] = counts.get((level, switch), 0) + 1
    return counts


def uplink_capacity(
    fabric: Fabric, spec: NetworkSpec, uplink: Uplink, counts: Mapping[tuple[int, str], int] | None = None
) -> float:
    """Capacity of one uplink (`NetworkSpec.uplink_capacity` with the fabric's node count under the switch)."""
    counts = nodes_under(fabric) if counts is None else counts
    return spec.uplink_capacity(uplink.level, counts.get((uplink.level, uplink.domain), 0))


@dataclass(frozen=True)
class Bottleneck:
    """A ring's bus bandwidth, the link that bounds it (NVLINK, NVLINK_DOMAIN, IB, UPLINK or NONE) and, for UPLINK,
    which uplink."""

    bandwidth: float
    link: str
    uplink: Uplink | None = None


def bottleneck(placement: Placement, fabric: Fabric, spec: NetworkSpec = NetworkSpec()) -> Bottleneck:
    """The placement's bus bandwidth alone on the fabric: the least of its NVLink / NIC bound and, for every uplink
    it crosses k times, the uplink's capacity / k (a job alone on an oversubscribed fabric still feels the ratio)."""
    demand = ring_demand(placement, fabric, spec)
    best = Bottleneck(demand.bandwidth, demand.link)
    counts = nodes_under(fabric) if demand.uplinks else {}
    for up, edges in sorted(demand.uplinks.items()):
        share = uplink_capacity(fabric, spec, up, counts) / edges
        if share < best.bandwidth:
            best = Bottleneck(share, UPLINK, up)
    return best


J = TypeVar("J", bound=Hashable)
L = TypeVar("L", bound=Hashable)


@dataclass(frozen=True)
class Allocation:
    """Max-min fair rates, and for each flow the link that froze it (None: its own cap did)."""

    rates: dict
    limits: dict


def max_min_fair(
    capacity: Mapping[L, float], usage: Mapping[J, Mapping[L, float]], cap: Mapping[J, float]
) -> Allocation:
    """Max-min fair rates by progressive filling (water-filling; Bertsekas and Gallager, Data Networks, 6.5.2).

    Flow j at rate r puts usage[j][l] x r on link l (its ring's edges through the uplink) and never exceeds cap[j].
    All unfrozen rates rise together; when a link fills, the flows on it freeze; when a flow reaches its cap, it
    freezes. The result: no rate can rise without lowering one that is no larger. Deterministic (sorted keys).
    """
    rates = {j: 0.0 for j in usage}
    limits: dict = {j: None for j in usage}
    remaining = {link: float(c) for link, c in capacity.items()}
    active = sorted((j for j in usage if cap[j] > 0), key=repr)
    while active:
        weight: dict = {}
        for j in active:
            for link, w in usage[j].items():
                if w > 0:
                    weight[link] = weight.get(link, 0.0) + w
        step = min((cap[j] - rates[j] for j in active), default=math.inf)
        full = None
        for link in sorted(weight, key=repr):
            room = max(remaining.get(link, 0.0), 0.0) / weight[link]
            if room < step:
                step, full = room, link
        if step == math.inf:  # flows with no cap and no link: nothing bounds them
            for j in active:
                rates[j] = math.inf
            break
        for j in active:
            rates[j] += step
        for link, w in weight.items():
            remaining[link] = remaining.get(link, 0.0) - step * w
        saturated = {link for link, w in weight.items() if remaining[link] <= 1e-12 * max(capacity.get(link, 0.0), 1.0)}
        if full is not None:
            saturated.add(full)
        still = []
        for j in active:
            hit = sorted((link for link in usage[j] if usage[j][link] > 0 and link in saturated), key=repr)
            if cap[j] - rates[j] <= 1e-12 * cap[j]:  # its own cap first: on a tie, the link is not what binds
                rates[j] = cap[j]
            elif hit:
                limits[j] = full if full in hit else hit[0]
            else:
                still.append(j)
        for link in saturated:
            remaining[link] = 0.0
        active = still
    return Allocation(rates, limits)


@dataclass(frozen=True)
class NetJob:
    """A running job as the network sees it: where its ranks are, the bytes it AllReduces per step (e.g. 2 bytes
    x parameters for bf16 gradients) and its compute seconds per step."""

    placement: Placement
    message_bytes: float
    compute_time: float

    @property
    def job_id(self) -> str:
        return self.placement.job_id


class NetworkState:
    """The running jobs and their bus bandwidths under uplink contention.

    Jobs whose rings cross no uplink run at their `ring_demand` bandwidth; the others share every uplink they cross
    max-min fairly (`max_min_fair` over all uplinks at once), recomputed on every `add` and `remove`.
    """

    def __init__(self, fabric: Fabric, spec: NetworkSpec = NetworkSpec()) -> None:
        self.fabric = fabric
        self.spec = spec
        self._counts = nodes_under(fabric)
        self._jobs: dict[str, NetJob] = {}
        self._demand: dict[str, RingDemand] = {}
        self._rate: dict[str, float] = {}
        self._limit: dict[str, Uplink | None] = {}

    # ---- events ----------------------------------------------------------------------------------------------

    def add(self, job: NetJob) -> dict[str, float]:
        """Start a job; returns the bus bandwidth of every job whose bandwidth changed (the new one included)."""
        if job.job_id in self._jobs:
            raise ValueError(f"job {job.job_id!r} is already running")
        self._jobs[job.job_id] = job
        self._demand[job.job_id] = ring_demand(job.placement, self.fabric, self.spec)
        return self._recompute(new=job.job_id)

    def remove(self, job_id: str) -> dict[str, float]:
        """Finish a job; returns the bus bandwidth of every remaining job whose bandwidth changed."""
        if job_id not in self._jobs:
            raise KeyError(job_id)
        del self._jobs[job_id], self._demand[job_id]
        self._rate.pop(job_id, None)
        self._limit.pop(job_id, None)
        return self._recompute()

    def _recompute(self, new: str | None = None) -> dict[str, float]:
        before = dict(self._rate)
        shared = {j: d for j, d in self._demand.items() if d.uplinks}
        for j, d in self._demand.items():
            if not d.uplinks:
                self._rate[j], self._limit[j] = d.bandwidth, None
        if shared:
            links = {up for d in shared.values() for up in d.uplinks}
            capacity = {up: uplink_capacity(self.fabric, self.spec, up, self._counts) for up in links}
            alloc = max_min_fair(
                capacity, {j: d.uplinks for j, d in shared.items()}, {j: d.bandwidth for j, d in shared.items()}
            )
            self._rate.update(alloc.rates)
            self._limit.update(alloc.limits)
        return {j: r for j, r in self._rate.items() if j == new or before.get(j) != r}

    # ---- queries ---------------------------------------------------------------------------------------------

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def bandwidth(self, job_id: str) -> float:
        """The job's current bus bandwidth (bytes/s)."""
        return self._rate[job_id]

    def bottleneck(self, job_id: str) -> Bottleneck:
        """What bounds the job now: the uplink that froze it in the fair share, else its own NVLink/NIC bound."""
        up = self._limit[job_id]
        if up is not None:
            return Bottleneck(self._rate[job_id], UPLINK, up)
        return Bottleneck(self._rate[job_id], self._demand[job_id].link)

    def allreduce_time(self, job_id: str) -> float:
        job = self._jobs[job_id]
        return allreduce_time(job.message_bytes, self._demand[job_id].ranks, self._rate[job_id])

    def step_time(self, job_id: str) -> float:
        """Seconds per step: compute time + AllReduce time at the job's current bus bandwidth."""
        return self._jobs[job_id].compute_time + self.allreduce_time(job_id)

    def uplink_load(self) -> dict[Uplink, tuple[float, float]]:
        """Per uplink in use: (bytes/s the running rings put on it, its capacity)."""
        load: dict[Uplink, float] = {}
        for j, d in self._demand.items():
            for up, edges in d.uplinks.items():
                load[up] = load.get(up, 0.0) + edges * self._rate[j]
        return {up: (v, uplink_capacity(self.fabric, self.spec, up, self._counts)) for up, v in sorted(load.items())}

    def uplink_bytes(self, job_id: str) -> dict[str, float]:
        """Bytes per step the job sends up switch uplinks, per tier name of the switch they leave."""
        return self._demand[job_id].uplink_bytes(self._jobs[job_id].message_bytes)

    def cross_spine_bytes(self, job_id: str) -> float:
        """Bytes per step the job's ring sends through the spine layer: up its leaves' uplinks (level 0)."""
        d = self._demand[job_id]
        per_edge = edge_bytes(self._jobs[job_id].message_bytes, d.ranks)
        return sum(edges for up, edges in d.uplinks.items() if up.level == 0) * per_edge

    def total_cross_spine_bytes(self, job_ids: Iterable[str] | None = None) -> float:
        """`cross_spine_bytes` summed over the running jobs (or over `job_ids`)."""
        return sum(self.cross_spine_bytes(j) for j in (self._jobs if job_ids is None else job_ids))
