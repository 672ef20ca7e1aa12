"""Queues, quotas with cohort borrowing, and fair share (the Kueue cohort model, with DRF). Pure: no I/O.

A queue has a nominal quota per GPU *flavor*: a GPU model key such as "H100" (matched case-insensitively inside a
node's model name) or "*" for any model. A quota counts whole GPUs (a share of a GPU counts as its fraction) and,
separately, MIG compute slices ("3g.40gb" is 3). A job is admitted under one flavor of its queue:
- within nominal: the queue's use of the flavor plus the job stays within its nominal quota;
- borrowing: beyond nominal, up to the queue's borrowing limit for the flavor (none: no limit), and only out of
  what the other queues of its cohort leave unused of their nominal quota for that flavor (no cohort: no borrowing).
The flavors are tried in the order the queue lists them; the job is then placed on nodes of that model. A queue
with no quotas at all (the implicit "default" queue) is unlimited.

Borrowed capacity is given back by preemption (`reclaimable`): a job that fits its queue's nominal quota may evict
jobs of other queues of its cohort that are running on borrowed quota, whatever their priority.

Fair share: among jobs of equal priority, the queue with the lowest weighted dominant share goes first (Dominant
Resource Fairness over the cluster's GPU flavors and MIG slices: a queue's share is the largest fraction of any one
resource it uses, divided by its weight). The cluster's MIG slices are those of its GPUs in MIG mode only, and its
whole GPUs those outside MIG mode (`cluster_totals`): a GPU serves one kind or the other. The order is recomputed
after every admission, so queues interleave.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from . import mig
from .model import GangRequest
from .status import Code, Status

ANY = "*"
DEFAULT_QUEUE = "default"


@dataclass(frozen=True, slots=True)
class FlavorQuota:
    gpus: float = 0.0  # nominal GPUs
    borrow_limit: float | None = None  # at most this many GPUs beyond nominal (None: no limit)
    mig_slices: int = 0  # nominal MIG compute slices

    def __post_init__(self) -> None:
        for name in ("gpus", "mig_slices"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.borrow_limit is not None and not (math.isfinite(self.borrow_limit) and self.borrow_limit >= 0):
            raise ValueError(f"borrow_limit must be a number >= 0, got {self.borrow_limit!r}")


@dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    quotas: Mapping[str, FlavorQuota] = field(default_factory=dict)  # flavor -> quota, in preference order
    cohort: str = ""
    weight: float = 1.0
    tenants: frozenset[str] = frozenset()  # who may submit (empty: anyone)
    max_priority: int = 0  # the highest priority a non-admin may ask for in it ("default" unless granted more)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be > 0, got {self.weight!r}")

    @property
    def unlimited(self) -> bool:
        return not self.quotas


def demand(request: GangRequest) -> tuple[float, int]:
    """(GPUs, MIG compute slices) the gang holds when running."""
    if request.mig_profile:
        compute = request.mig_profile.split("g.", 1)[0]
        return 0.0, request.replicas * (int(compute) if compute.isdigit() else 7)
    if request.gpu_milli:
        return request.replicas * request.gpu_milli / 1000, 0
    return float(request.replicas * request.gpus_per_replica), 0


def mig_compute_slices(gpu_model: str, memory_mib: int = 0) -> int:
    """MIG compute slices one GPU of this model offers in MIG mode (its largest profile's: 7 on A100/H100/H200/
    B200/GB200); 0 when it has no MIG."""
    return max(
        (p.compute for p in mig.family_profiles(mig.mig_family(gpu_model, memory_mib) or "").values()), default=0
    )


def cluster_totals(gpus: Iterable[tuple[str, int, bool]]) -> dict[str, float]:
    """The DRF denominators (QuotaBook's `capacity`) from every GPU as (model, memory MiB, in MIG mode): whole GPUs
    count only outside MIG mode, MIG compute slices only on GPUs in MIG mode (a GPU serves one kind or the other)."""
    whole = slices = 0
    for model, memory, in_mig_mode in gpus:
        if in_mig_mode:
            slices += mig_compute_slices(model, memory)
        else:
            whole += 1
    return {"gpus": float(whole), "mig_slices": float(slices)}


def flavor_matches(flavor: str, gpu_model: str) -> bool:
    return flavor == ANY or flavor.lower() in gpu_model.lower()


@dataclass(frozen=True, slots=True)
class Admission:
    """A flavor the job may run under: `request` is the job restricted to that flavor's nodes."""

    flavor: str
    borrowing: bool
    request: GangRequest


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str

    @property
    def status(self) -> Status:
        return Status(Code.QUOTA, self.reason)


class QuotaBook:
    """Quota use within one scheduling pass: what each queue uses per flavor, what it may take next, and its share.

    `usage`: queue -> flavor -> (GPUs, MIG slices) of its running jobs. `capacity`: the cluster's totals per
    resource for DRF: flavor-independent here, {"gpus": total GPUs, "mig_slices": total slices} plus per model
    "gpus:<model>" when known (a missing total counts as 1 so shares stay finite)."""

    def __init__(
        self,
        queues: Mapping[str, QueueSpec],
        usage: Mapping[str, Mapping[str, tuple[float, int]]],
        capacity: Mapping[str, float] | None = None,
    ) -> None:
        self.queues = dict(queues)
        self.usage: dict[str, dict[str, list[float]]] = {
            q: {f: [float(g), float(s)] for f, (g, s) in flavors.items()} for q, flavors in usage.items()
        }
        self.capacity = dict(capacity or {})

    def spec(self, queue: str) -> QueueSpec:
        return self.queues.get(queue) or QueueSpec(queue)

    def used(self, queue: str, flavor: str) -> tuple[float, float]:
        g, s = self.usage.get(queue, {}).get(flavor, (0.0, 0.0))
        return g, s

    def lendable(self, queue: str, flavor: str) -> tuple[float, float]:
        """What the other queues of `queue`'s cohort leave unused of their nominal quota for `flavor`."""
        cohort = self.spec(queue).cohort
        if not cohort:
            return 0.0, 0.0
        gpus = slices = 0.0
        for other in self.queues.values():
            if other.name == queue or other.cohort != cohort or flavor not in other.quotas:
                continue
            q = other.quotas[flavor]
            g, s = self.used(other.name, flavor)
            gpus += max(0.0, q.gpus - g)
            slices += max(0.0, q.mig_slices - s)
        return gpus, slices

    def admit(self, queue: str, request: GangRequest) -> list[Admission] | Refusal:
        """The flavors `request` may run under now, nominal ones first; or why none."""
        spec = self.spec(queue)
        if spec.unlimited:
            return [Admission("", False, request)]
        need_g, need_s = demand(request)
        nominal: list[Admission] = []
        borrowed: list[Admission] = []
        why: list[str] = []
        for flavor, quota in spec.quotas.items():
            if request.gpu_model and not (
                flavor == ANY
                or flavor.lower() in request.gpu_model.lower()
                or request.gpu_model.lower() in flavor.lower()
            ):
                continue
            used_g, used_s = self.used(queue, flavor)
            over_g = used_g + need_g - quota.gpus
            over_s = used_s + need_s - quota.mig_slices
            restricted = request if flavor == ANY or request.gpu_model else _with_model(request, flavor)
            if over_g <= 1e-9 and over_s <= 1e-9:
                nominal.append(Admission(flavor, False, restricted))
                continue
            lend_g, lend_s = self.lendable(queue, flavor)
            limit = math.inf if quota.borrow_limit is None else quota.borrow_limit
            if max(over_g, 0) <= min(limit, lend_g) + 1e-9 and max(over_s, 0) <= lend_s + 1e-9:
                borrowed.append(Admission(flavor, True, restricted))
                continue
            what = f"{need_g:g} GPU(s)" if need_g else f"{need_s:g} MIG slice(s)"
            why.append(
                f"{flavor}: needs {what}, uses {used_g:g}/{quota.gpus:g} GPUs"
                + (f" and {used_s:g}/{quota.mig_slices:g} slices" if need_s else "")
                + (
                    f", the cohort {spec.cohort!r} lends {lend_g:g} more"
                    if spec.cohort
                    else ", no cohort to borrow from"
                )
                + (f" (borrow limit {quota.borrow_limit:g})" if quota.borrow_limit is not None else "")
            )
        if nominal or borrowed:
            return nominal + borrowed
        if not why:
            flavors = ", ".join(spec.quotas) or "none"
            return Refusal(f"queue {queue!r} has no quota for GPU model {request.gpu_model!r} (flavors: {flavors})")
        return Refusal(f"over queue {queue!r}'s quota: " + "; ".join(why))

    def charge(self, queue: str, flavor: str, request: GangRequest, sign: int = 1) -> None:
        g, s = demand(request)
        entry = self.usage.setdefault(queue, {}).setdefault(flavor, [0.0, 0.0])
        entry[0] += sign * g
        entry[1] += sign * s

    def borrowing(self, queue: str, flavor: str) -> bool:
        spec = self.spec(queue)
        quota = spec.quotas.get(flavor)
        if quota is None:
            return False
        g, s = self.used(queue, flavor)
        return g > quota.gpus + 1e-9 or s > quota.mig_slices + 1e-9

    def within_nominal(self, queue: str, flavor: str, request: GangRequest) -> bool:
        """Whether `request` fits `queue`'s nominal quota of `flavor` (may reclaim what others borrowed)."""
        spec = self.spec(queue)
        quota = spec.quotas.get(flavor)
        if quota is None:
            return False
        g, s = self.used(queue, flavor)
        need_g, need_s = demand(request)
        return g + need_g <= quota.gpus + 1e-9 and s + need_s <= quota.mig_slices + 1e-9

    def share(self, queue: str) -> float:
        """Weighted dominant share: the largest fraction of one resource the queue uses, over its weight."""
        total_g = self.capacity.get("gpus") or 1.0
        total_s = self.capacity.get("mig_slices") or 1.0
        g = sum(v[0] for v in self.usage.get(queue, {}).values())
        s = sum(v[1] for v in self.usage.get(queue, {}).values())
        return max(g / total_g, s / total_s) / self.spec(queue).weight


def _with_model(request: GangRequest, flavor: str) -> GangRequest:
    from dataclasses import replace

    return replace(request, gpu_model=flavor)


def fair_order(requests: Iterable[tuple[str, GangRequest]], book: QuotaBook) -> Iterator[tuple[str, GangRequest]]:
    """Yield (queue, request): the highest priority first; among equal priorities the queue with the lowest
    share now, then the oldest. Within a queue: priority, then submission order.

    Lazy: a queue's share is read again after its own job was yielded (the caller charges a job it admits before
    asking for the next), so admissions move a queue back at once. Only that queue's share can have changed, so a
    heap of queue heads keeps each pick O(log queues)."""
    by_queue: dict[str, list[GangRequest]] = {}
    for queue, request in requests:
        by_queue.setdefault(queue, []).append(request)
    for items in by_queue.values():
        items.sort(key=lambda r: r.order, reverse=True)  # pop() takes the first

    def entry(queue: str) -> tuple[int, float, float, str, str]:
        head = by_queue[queue][-1]
        return (-head.priority, book.share(queue), head.submitted_at, head.job_id, queue)

    heap = [entry(q) for q in by_queue]
    heapq.heapify(heap)
    while heap:
        *_, queue = heapq.heappop(heap)
        request = by_queue[queue].pop()
        yield queue, request
        if by_queue[queue]:
            heapq.heappush(heap, entry(queue))
        else:
            del by_queue[queue]


def usage_of(running: Iterable[tuple[str, str, GangRequest]]) -> dict[str, dict[str, tuple[float, int]]]:
    """Usage from running jobs given as (queue, flavor, request)."""
    out: dict[str, dict[str, list[float]]] = {}
    for queue, flavor, request in running:
        g, s = demand(request)
        entry = out.setdefault(queue, {}).setdefault(flavor, [0.0, 0])
        entry[0] += g
        entry[1] += s
    return {q: {f: (v[0], int(v[1])) for f, v in flavors.items()} for q, flavors in out.items()}


def positions(order: Sequence[tuple[str, GangRequest]]) -> dict[str, int]:
    """1-based position of each job in a fair order (what `phalanx queue` shows)."""
    return {request.job_id: i for i, (_, request) in enumerate(order, 1)}
