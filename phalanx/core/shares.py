"""Partial GPUs: MIG instances and fractional (milli-GPU) shares, placed to keep fragmentation low.

The score follows FGD (Weng et al., "Beware of Fragmentation", USENIX ATC'23). A node's fragmentation with respect
to a task is the free capacity on it that the task could not use; its expected fragmentation F is that, averaged
over a workload mix. A request goes where it raises F the least: on a node already split into instances of the same
size rather than on a whole free GPU, and never onto an empty 8-GPU node while a partly used one fits. Capacity is
counted in GPUs: a MIG memory slice is 1/8 of one (1/4 on A30: `mig.family_slices`), a share of m thousandths is
m/1000. A `+me` MIG profile fits once per GPU (its mask carries `mig.MEDIA_BIT`).

MIG mode separates the two kinds (`NodeCapacity.mig_gpus`): a MIG instance goes only on a GPU in MIG mode (the
agent reported MIG_MODE_ENABLED), a share or a whole-GPU job only on a GPU that is not (DISABLED or UNSUPPORTED).
The fragmentation measure follows: a whole free GPU serves no MIG task, and a GPU in MIG mode no whole-GPU or share
task. MIG instances Phalanx did not make (`NodeCapacity.foreign`) keep their slices used.

Nodes of the same free shape (`capacity.shape_key`: model, GPUs, whole free GPUs, the MIG masks and shares in use)
score the same, so each shape is scored once and the request goes to the first node of the best shape: a request
costs O(shapes x GPU states x start slices), never a scan of every node.

Fractional shares are scored with the packing core's fragmentation measure (`phalanx/core/packing.py`,
`share_fragmentation`), the one `phalanx sim fgd` checks against the FGD paper's published results; CPUs are not
counted yet (agents do not report them), so a share never strands a GPU for want of CPU here.

The workload mix defaults to equal weight on whole-GPU tasks of 1, 2, 4 and 8 GPUs, the six MIG shapes and shares
of 1/4 and 1/2 GPU; a caller that knows its workload (the simulator, from the trace) passes its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from . import mig
from .capacity import ClusterCapacity, NodeShape
from .model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from .packing import Fragmentation, PackTask, TypicalMix
from .resources import room

# The GPU a replica takes on a node of some shape: ("free",) a whole free GPU, ("mig", mask) a GPU in MIG mode with
# that mask used, ("milli", used) a share GPU with that many thousandths used.
GpuState = tuple[Literal["free"]] | tuple[Literal["mig", "milli"], int]


@dataclass(frozen=True, slots=True)
class Task:
    """One kind of task in the workload mix: `gpus` whole GPUs, or a MIG shape (index into mig's shape table, so
    it applies to every family), or a share of `milli` thousandths."""

    gpus: int = 0
    mig_shape: int = -1
    milli: int = 0


DEFAULT_MIX: tuple[tuple[Task, float], ...] = (
    *((Task(gpus=k), 1.0) for k in (1, 2, 4, 8)),
    *((Task(mig_shape=s), 1.0) for s in range(len(mig.SHAPES))),
    (Task(milli=250), 1.0),
    (Task(milli=500), 1.0),
)


@dataclass(frozen=True, slots=True)
class PartialUnplaceable:
    job_id: str
    reason: str


def _free_capacity(free: int, migs: Sequence[int], millis: Sequence[int], slices: int = mig.MEMORY_SLICES) -> float:
    """Free GPUs, counting a MIG memory slice as 1/`slices` of one (the family's memory slices: 8, or 4 on A30)."""
    full = (1 << slices) - 1
    return free + sum(slices - mig.used_slices(m & full) for m in migs) / slices + sum(1000 - m for m in millis) / 1000


def _memory_slices(model: str, memory: int) -> int:
    return mig.family_slices(mig.mig_family(model, memory))[1]


@lru_cache(maxsize=65536)
def fragmentation(shape: NodeShape, mix: tuple[tuple[Task, float], ...] = DEFAULT_MIX) -> float:
    """Expected fragmentation (in GPUs) of a node of this free shape under the workload mix."""
    model, memory, total, free, migs, millis = shape
    family = mig.mig_family(model, memory)
    slices = mig.family_slices(family)[1]
    capacity = _free_capacity(free, migs, millis, slices)
    partial = capacity - free
    weighted = weight = 0.0
    for task, w in mix:
        if task.gpus:
            if task.gpus > total:
                continue
            frag = capacity if free < task.gpus else partial
        elif task.mig_shape >= 0:
            p = mig.shape_profile(family, task.mig_shape)  # None: not MIG, or no such shape (A30 has no 3g)
            if p is None:
                frag = capacity
            else:  # only GPUs in MIG mode serve it (a whole free GPU is not in MIG mode)
                usable = sum(mig.max_instances(m, p) for m in migs) * p.size
                frag = capacity - usable / slices
        else:
            per_free = (1000 // task.milli) * task.milli
            usable = free * per_free + sum(((1000 - m) // task.milli) * task.milli for m in millis)
            frag = capacity - usable / 1000
        weighted += w * frag
        weight += w
    return weighted / weight if weight else 0.0


@dataclass(frozen=True, slots=True)
class _Option:
    delta: float
    after_capacity: float
    node: str
    gpu_state: GpuState  # ("free",) | ("mig", mask) | ("milli", used)
    start: int  # MIG start slice, -1 for shares


def place_partial(
    capacity: ClusterCapacity,
    request: GangRequest,
    tier_names: Sequence[str] = (),
    mix: tuple[tuple[Task, float], ...] = DEFAULT_MIX,
) -> Placement | PartialUnplaceable:
    """Place every replica of a partial-GPU request (one MIG instance or one share each), all or none.

    Replicas are placed one after another, each where it raises fragmentation least given the ones before; the
    capacity is left as it was found. Does not change `capacity`.
    """
    if request.gpus_per_replica != 1:
        return PartialUnplaceable(request.job_id, "a MIG or fractional replica uses one GPU (gpus_per_replica 1)")
    if request.mig_profile and request.gpu_milli:
        return PartialUnplaceable(request.job_id, "ask for a MIG profile or a GPU share, not both")
    cap = capacity.restricted(request.gpu_model) if request.gpu_model else capacity
    taken: list[ReplicaPlacement] = []
    total_delta = 0.0
    uses = bool(request.cpu_milli or request.memory)
    full: list[str] = []  # nodes hidden once their host resources feed no further replica of this gang
    try:
        for replica in range(request.replicas):
            option = _best_option(cap, request, mix)
            if option is None:
                return PartialUnplaceable(request.job_id, _why_not(cap, request, len(taken)))
            rep = _replica(cap, request, replica, option)
            cap.take_partial(rep)
            taken.append(rep)
            total_delta += option.delta
            if uses:
                cap.take_use(rep.node, request.cpu_milli, request.memory)
                if room(cap.nodes[rep.node], request.cpu_milli, request.memory) == 0:
                    cap.set_schedulable(rep.node, False)
                    full.append(rep.node)
    finally:
        for rep in taken:
            cap.release_partial(rep)
            if uses:
                cap.release_use(rep.node, request.cpu_milli, request.memory)
        for name in full:
            cap.set_schedulable(name, True)
    what = request.mig_profile or f"{request.gpu_milli}/1000 GPU"
    first = taken[0]
    where = (
        f"GPU {first.gpus[0]} of {first.node}"
        if len(taken) == 1
        else f"{len({(r.node, r.gpus[0]) for r in taken})} GPU(s) on {len({r.node for r in taken})} node(s)"
    )
    slices = (
        f" (slices {first.mig_start}-{first.mig_start + first.mig_size - 1})"
        if len(taken) == 1 and first.mig_profile
        else ""
    )
    tier, spanned = _tier(capacity, taken, tier_names)
    reason = (
        f"{request.replicas} x {what} on {where}{slices}; fragmentation {total_delta:+.3f} GPU "
        f"(FGD score, lower is better)"
    )
    return Placement(request.job_id, tuple(taken), tier, spanned, round(total_delta, 6), reason)


_NO_CPU_LIMIT = 1 << 62  # agents do not report CPUs yet: every task's CPU fits


@lru_cache(maxsize=16)
def share_fragmentation(mix: tuple[tuple[Task, float], ...] = DEFAULT_MIX) -> Fragmentation:
    """The packing core's fragmentation measure (`phalanx.core.packing`, FGD's definition, the one `phalanx sim fgd`
    evaluates) over the mix's whole-GPU and share tasks: fractional shares are scored with it. MIG tasks are left
    out: no share GPU can serve them, so they would add the same amount to every option."""
    tasks = [
        (PackTask(0, 0, t.gpus, 1000) if t.gpus else PackTask(0, 0, 1, t.milli), w) for t, w in mix if t.gpus or t.milli
    ]
    return Fragmentation(TypicalMix(tasks))


def _share_gpus(free: int, millis: Sequence[int]) -> list[int]:
    return [1000] * free + [1000 - u for u in millis]


def _best_option(
    cap: ClusterCapacity,
    request: GangRequest,
    mix: tuple[tuple[Task, float], ...],
) -> _Option | None:
    best: _Option | None = None
    shares = share_fragmentation(mix) if request.gpu_milli else None
    for shape, names in cap.shape_buckets().items():
        model, memory, total, free, migs, millis = shape
        if shares is not None:
            before = shares.of(model, _NO_CPU_LIMIT, _share_gpus(free, millis)) / 1000
        else:
            before = fragmentation(shape, mix)
        for gpu_state, start, after in _moves(shape, request):
            if shares is not None:
                delta = shares.of(model, _NO_CPU_LIMIT, _share_gpus(after[3], after[5])) / 1000 - before
            else:
                delta = fragmentation(after, mix) - before
            cap_after = _free_capacity(after[3], after[4], after[5], _memory_slices(model, memory))
            option = _Option(round(delta, 9), cap_after, names[0], gpu_state, start)
            if best is None or (option.delta, option.after_capacity, option.node, option.start) < (
                best.delta,
                best.after_capacity,
                best.node,
                best.start,
            ):
                best = option
    return best


def _moves(shape: NodeShape, request: GangRequest) -> Iterator[tuple[GpuState, int, NodeShape]]:
    """Every distinct way to put one replica on a node of this shape: (GPU state used, start slice, new shape)."""
    model, memory, total, free, migs, millis = shape
    if request.mig_profile:
        profile = mig.resolve(request.mig_profile, mig.mig_family(model, memory))
        if profile is None:
            return
        # Only GPUs in MIG mode (each in `migs`, mask 0 when empty); a whole free GPU is not in MIG mode.
        for used in dict.fromkeys(migs):
            for start in mig.free_starts(used, profile):
                new = used | profile.mask(start)
                rest = list(migs)
                rest.remove(used)
                yield ("mig", used), start, (model, memory, total, free, tuple(sorted([*rest, new])), millis)
    else:
        m = request.gpu_milli
        states: list[GpuState] = [("milli", u) for u in dict.fromkeys(millis) if u + m <= 1000]
        if free:
            states.append(("free",))
        for state in states:
            used = state[1] if state[0] == "milli" else 0
            rest = list(millis)
            if state[0] == "milli":
                rest.remove(used)
            yield state, -1, (model, memory, total, free - (state[0] == "free"), migs, tuple(sorted([*rest, used + m])))


def _replica(cap: ClusterCapacity, request: GangRequest, replica: int, option: _Option) -> ReplicaPlacement:
    node = cap.nodes[option.node]
    state = option.gpu_state  # tested through state[0] so that mypy narrows the tagged tuple
    if state[0] == "free":
        # The highest free index: whole-GPU gangs take the lowest ones first (rail alignment, aligned blocks).
        gpu = max(node.free)
    elif state[0] == "mig":
        gpu = min(g for g, m in node.mig.items() if m == state[1] and g in node.mig_gpus)
    else:
        gpu = min(g for g, m in node.milli.items() if m == state[1])
    if request.mig_profile:
        profile = mig.resolve(request.mig_profile, mig.mig_family(node.gpu_model, node.memory_mib))
        assert profile is not None
        return ReplicaPlacement(
            replica, node.name, (gpu,), mig_profile=profile.name, mig_start=option.start, mig_size=profile.size
        )
    return ReplicaPlacement(replica, node.name, (gpu,), gpu_milli=request.gpu_milli)


def _tier(capacity: ClusterCapacity, reps: list[ReplicaPlacement], names: Sequence[str]) -> tuple[str, int]:
    nodes = [capacity.nodes[n] for n in dict.fromkeys(r.node for r in reps)]
    if len(nodes) == 1:
        return "node", 1
    depth = max(len(n.path) for n in nodes)

    def key(n: NodeCapacity, level: int) -> str:
        return n.name if level == 0 else (n.path[level - 1] if level - 1 < len(n.path) else "")

    for level in range(1, depth + 2):
        if level > depth or len({key(n, level) for n in nodes}) == 1:
            name = names[level] if level < len(names) else ("cluster" if level > depth else f"tier{level}")
            return name, len({key(n, level - 1) for n in nodes})
    raise AssertionError("the cluster level is one domain")


def _why_not(cap: ClusterCapacity, request: GangRequest, placed: int) -> str:
    nodes = list(cap.nodes.values())
    prefix = f"{request.replicas} x " if request.replicas > 1 else ""
    if request.gpu_model and not nodes:
        return f"no node has GPU model {request.gpu_model!r}"
    if request.mig_profile:
        families = {mig.mig_family(n.gpu_model, n.memory_mib) for n in nodes}
        offering = sorted(f for f in families if f and mig.resolve(request.mig_profile, f))
        if not offering:
            known = sorted(f for f in families if f)
            if not known:
                return f"no node here has MIG-capable GPUs, so MIG profile {request.mig_profile} cannot be placed"
            names = ", ".join(f"{f}: {', '.join(mig.family_table(f))}" for f in known)
            return f"no GPU here offers MIG profile {request.mig_profile} ({names})"
        in_mode = [
            n
            for n in nodes
            if n.mig_gpus and mig.resolve(request.mig_profile, mig.mig_family(n.gpu_model, n.memory_mib))
        ]
        if not in_mode:
            capable = sum(n.total for n in nodes if mig.mig_family(n.gpu_model, n.memory_mib) in offering)
            return (
                f"{prefix}{request.mig_profile}: no GPU is in MIG mode (a MIG instance goes only on a GPU whose "
                f"agent reports MIG mode enabled; the {capable} {'/'.join(offering)} GPU(s) here are not in MIG "
                f"mode and serve whole-GPU jobs and shares)"
            )
        gpus = sum(len(n.mig_gpus) for n in in_mode)
        return (
            f"{prefix}{request.mig_profile}: no free placement for it on any of the {gpus} "
            f"{'/'.join(offering)} GPU(s) in MIG mode now ({placed} of {request.replicas} replicas fit)"
        )
    hint = ""
    if any(n.mig_gpus for n in nodes):
        hint = f"; the {sum(len(n.mig_gpus) for n in nodes)} GPU(s) in MIG mode take only MIG instances"
    return (
        f"{prefix}{request.gpu_milli}/1000 GPU: no GPU has that share free now "
        f"({placed} of {request.replicas} replicas fit{hint})"
    )
