"""Which idle GPUs to switch into or out of MIG mode so that a waiting gang fits (`--mig-manage`). Pure: no I/O.

A GPU in MIG mode serves only MIG instances, a GPU outside it only whole-GPU jobs and shares (core.shares). A node
agent started with `--mig-manage` lets the scheduler switch an idle GPU's mode. When a pending gang cannot be placed
only because of the modes (a `--mig` gang and no GPU in MIG mode has room; a whole-GPU or share gang and idle GPUs
in MIG mode are in the way), `plan_switches` says which of the GPUs the scheduler may switch (the `candidates`: it
checks idleness, health, foreign instances, hold and backoff) to switch, and where the gang would go then.

Just enough: the fewest GPUs of the preferred order (`switch_order`) that make the gang fit are found by a binary
search over prefixes of that order (more GPUs of the needed mode never make a gang fit less), and of those only the
GPUs the resulting placement uses are switched. Into MIG mode, GPUs of nodes already partly in MIG mode come first,
then those of partly used nodes, the highest GPU index first: whole free nodes stay whole for large gangs (and
whole-GPU gangs take the lowest indexes). Out of MIG mode, the nodes with the most free whole GPUs come first: the
fewest switches to make room for a whole replica.

Switches under way (`switching`) count as done when they go the way the gang needs (the gang then waits for them,
`SwitchPlan.waiting`), and as out of placement otherwise, as the scheduler holds them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from . import mig
from .capacity import CapacityError, ClusterCapacity
from .model import GangRequest, NodeCapacity, Placement
from .placement import place_gang

Gpu = tuple[str, int]  # (node, GPU index)


@dataclass(frozen=True, slots=True)
class SwitchPlan:
    """`enable`: into MIG mode (for a MIG gang) or out of it (for whole GPUs or shares). `switch`: the GPUs to ask
    to switch now, in the preferred order; `waiting`: GPUs already switching that `placement` counts on; `placement`:
    where the gang goes once all of them switched."""

    enable: bool
    switch: tuple[Gpu, ...]
    waiting: tuple[Gpu, ...]
    placement: Placement

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """Every GPU the gang waits for (asked now and switching already)."""
        return tuple(sorted({*self.switch, *self.waiting}))


def wants_mig_mode(request: GangRequest) -> bool:
    """The mode a gang needs its GPUs in: MIG mode for a `--mig` gang, out of it for whole GPUs and shares."""
    return bool(request.mig_profile)


def offers(node: NodeCapacity, request: GangRequest) -> bool:
    """Whether a GPU of `node` could serve `request` in the mode it needs (its model, and for MIG its family's
    profiles)."""
    if request.gpu_model and request.gpu_model.lower() not in node.gpu_model.lower():
        return False
    family = mig.mig_family(node.gpu_model, node.memory_mib)
    if family is None:
        return False  # no MIG: its mode never changes
    return not request.mig_profile or mig.resolve(request.mig_profile, family) is not None


def switch_order(capacity: ClusterCapacity, candidates: Collection[Gpu], enable: bool) -> list[Gpu]:
    """The candidates in the order they are preferred (see the module docstring)."""
    nodes = capacity.nodes

    def key(c: Gpu) -> tuple[bool, bool, int, str, int] | tuple[int, str, int]:
        name, gpu = c
        n = nodes[name]
        if enable:
            return (not n.mig_gpus, len(n.free) >= n.total, len(n.free), name, -gpu)
        return (-len(n.free), name, gpu)

    return sorted((c for c in candidates if c[0] in nodes), key=key)


def _apply(node: NodeCapacity, gpu: int, enable: bool) -> None:
    """Put `gpu` of `node` (a copy) into the mode, empty: in MIG mode with no instance, or a free whole GPU."""
    if enable:
        node.free.discard(gpu)
        node.milli.pop(gpu, None)
        node.mig[gpu] = node.foreign.get(gpu, 0)
        node.mig_gpus = node.mig_gpus | {gpu}
    else:
        node.mig.pop(gpu, None)
        node.mig_gpus = node.mig_gpus - {gpu}
        if gpu not in node.foreign and 0 <= gpu < node.total:
            node.free.add(gpu)


def _view(
    capacity: ClusterCapacity,
    flips: Sequence[tuple[str, int, bool]],
    hidden: Collection[str],
    taken: Sequence[Placement],
) -> ClusterCapacity | None:
    """A copy of `capacity` with the GPUs of `flips` in their new mode, the `hidden` nodes unschedulable and the
    `taken` placements reserved; None when one of those no longer fits."""
    view = capacity.copy()
    for name, gpu, enable in flips:
        node = view.nodes.get(name)
        if node is not None:
            _apply(node, gpu, enable)
    for name in hidden:
        if name in view.nodes:
            view.nodes[name].schedulable = False
    for placement in taken:
        try:
            view.reserve(placement)
        except CapacityError:
            return None
    return view


def plan_switches(
    capacity: ClusterCapacity,
    request: GangRequest,
    candidates: Collection[Gpu],
    switching: Mapping[Gpu, bool] | None = None,
    fabric_tiers: Sequence[str] = (),
    *,
    hidden: Collection[str] = (),
    taken: Sequence[Placement] = (),
) -> SwitchPlan | None:
    """The GPUs to switch so that `request` fits, or None when no set of the candidates would make it fit (then it
    does not wait for a mode: something else is in the way). Does not change `capacity`.

    `capacity`: the free view (switching GPUs held, as the scheduler keeps them). `candidates`: the GPUs the caller
    allows to be switched to the mode the request needs (`wants_mig_mode`): idle, healthy, past their hold and
    backoff. `switching`: switches under way, GPU -> True into MIG mode / False out of it. `hidden`: nodes the gang
    may not use (a reserved head's region); `taken`: placements planned ahead of this gang (another gang waiting
    for switches), reserved first, so their GPUs are neither switched nor used here.

    A plan with nothing to switch and nothing to wait for means the gang fits as things are.
    """
    enable = wants_mig_mode(request)
    switching = dict(switching or {})
    coming = [(n, g, e) for (n, g), e in sorted(switching.items()) if e == enable]
    claimed = {(r.node, g) for p in taken for r in p.replicas for g in r.gpus}
    hidden = frozenset(hidden)
    order = [
        c
        for c in switch_order(capacity, candidates, enable)
        if c not in switching and c not in claimed and c[0] not in hidden and offers(capacity.nodes[c[0]], request)
    ]

    def attempt(k: int) -> Placement | None:
        view = _view(capacity, coming + [(n, g, enable) for n, g in order[:k]], hidden, taken)
        if view is None:
            return None
        got = place_gang(view, request, fabric_tiers)
        return got if isinstance(got, Placement) else None

    best = attempt(0)
    lo = hi = 0
    if best is None:
        if not order:
            return None
        best = attempt(len(order))
        if best is None:
            return None
        hi = len(order)  # attempt(lo) does not fit, attempt(hi) does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = attempt(mid)
            if got is None:
                lo = mid
            else:
                hi, best = mid, got
    used = {(r.node, g) for r in best.replicas for g in r.gpus}
    return SwitchPlan(
        enable,
        tuple(c for c in order[:hi] if c in used),
        tuple(c for c in sorted(switching) if switching[c] == enable and c in used),
        best,
    )
