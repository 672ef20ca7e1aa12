"""What a submission must pass before the cycle accepts it (commands.submit_all): its queue exists and takes the
tenant, its priority is within what the queue grants a non-admin, and some state of this cluster could hold the
gang (GPUs per node and in all, the GPU model or MIG profile, host CPUs and memory, the required tier's domains).

Each check reads the view only and raises FailedPrecondition or PermissionDenied; none writes anything.
"""

from __future__ import annotations

from phalanx.api.v1 import common_pb2
from phalanx.core import mig
from phalanx.core.preemption import priority_name
from phalanx.core.quota import DEFAULT_QUEUE
from phalanx.core.resources import cpu_milli, describe, format_cpus, human_size, parse_size
from services.common.errors import FailedPrecondition, PermissionDenied

from .state import SchedulerState


def check_queue(state: SchedulerState, spec: common_pb2.JobSpec, tenant: str) -> None:
    """The queue must exist (except "default", which always does) and take this tenant."""
    name = spec.queue or DEFAULT_QUEUE
    queue = state.queues.get(name)
    if queue is None:
        if name != DEFAULT_QUEUE:
            known = ", ".join(sorted({DEFAULT_QUEUE, *state.queues}))
            raise FailedPrecondition(f"no queue {name[:64]!r}; queues: {known}")
        return
    if queue.tenants and tenant and tenant not in queue.tenants:
        raise PermissionDenied(f"tenant {tenant!r} may not submit to queue {name!r}")


def check_priority(state: SchedulerState, spec: common_pb2.JobSpec) -> None:
    """A non-admin may ask for no more than its queue's max_priority (0, "default", unless granted): refused, never
    silently lowered."""
    name = spec.queue or DEFAULT_QUEUE
    queue = state.queues.get(name)
    cap = queue.max_priority if queue is not None else 0
    if spec.priority > cap:
        raise PermissionDenied(
            f"priority {priority_name(spec.priority)} is above what queue {name!r} grants: at most "
            f"{priority_name(cap)}; an admin raises it with `phalanx quota set {name} --max-priority P`, or "
            "submits the job"
        )


def check_fits_ever(state: SchedulerState, spec: common_pb2.JobSpec) -> None:
    """Refuse a gang that no state of this cluster could hold (drained and lost nodes count as capacity)."""
    cap = state.capacity
    if not cap.nodes:
        raise FailedPrecondition("no nodes have registered yet, so no gang can be placed; start node agents first")
    nodes = cap.nodes
    largest = cap.shape()[1]
    g, r = spec.gpus_per_replica, spec.replicas
    if g > largest:
        raise FailedPrecondition(f"each replica needs {g} GPUs on one node, but the largest node has {largest} GPUs")
    total = cap.total_gpus()
    if g * r > total:
        raise FailedPrecondition(
            f"the gang needs {r} x {g} = {g * r} GPUs, but all {len(nodes)} known nodes have {total} GPUs in total"
        )
    fit = state.capacity.max_replicas_ever(g)
    if fit < r:
        raise FailedPrecondition(
            f"the gang needs {r} replicas of {g} GPUs, each on one node, but the {len(nodes)} known nodes can hold "
            f"at most {fit} such replicas even when empty"
        )


def check_fits_host_resources(state: SchedulerState, spec: common_pb2.JobSpec) -> None:
    """Refuse replicas asking more CPUs or memory than any node has, or a gang whose replicas the nodes could not
    feed all at once even when empty (drained and lost nodes count)."""
    cpu = cpu_milli(spec.cpus_per_replica)
    memory = parse_size(spec.memory_per_replica) if spec.memory_per_replica else 0
    if not (cpu or memory):
        return
    nodes = list(state.capacity.nodes.values())
    if spec.gpu_model:
        nodes = [n for n in nodes if spec.gpu_model.lower() in n.gpu_model.lower()]
    if cpu and not any(n.cpu_milli >= cpu for n in nodes):
        most = max((n.cpu_milli for n in nodes), default=0)
        raise FailedPrecondition(
            f"each replica asks for {format_cpus(cpu)} CPUs, but the most any node has is {format_cpus(most)}"
            + ("" if most else " (no node's agent reported its CPUs)")
        )
    if memory and not any(n.memory >= memory for n in nodes):
        most = max((n.memory for n in nodes), default=0)
        raise FailedPrecondition(
            f"each replica asks for {human_size(memory)} memory, but the most any node has is {human_size(most)}"
            + ("" if most else " (no node's agent reported its memory)")
        )
    partial = bool(spec.mig_profile or spec.gpu_milli)
    fit = 0
    for n in nodes:
        k = min(
            n.cpu_milli // cpu if cpu else 1 << 30,
            n.memory // memory if memory else 1 << 30,
            (1 << 30) if partial else n.total // max(1, spec.gpus_per_replica),
        )
        fit += k
    if fit < spec.replicas:
        raise FailedPrecondition(
            f"the gang needs {spec.replicas} replicas of {describe(cpu, memory)} each, but the known nodes can feed "
            f"at most {fit} such replicas with their GPUs even when empty"
        )


def check_fits_model(state: SchedulerState, spec: common_pb2.JobSpec) -> None:
    """Refuse a GPU model or MIG profile that no known node has (drained and lost nodes count)."""
    nodes = list(state.capacity.nodes.values())
    if spec.gpu_model:
        models = sorted({n.gpu_model for n in nodes if n.gpu_model})
        nodes = [n for n in nodes if spec.gpu_model.lower() in n.gpu_model.lower()]
        if not nodes:
            raise FailedPrecondition(
                f"no known node has GPU model {spec.gpu_model!r}; models here: {', '.join(models) or 'none'}"
            )
        if not (spec.mig_profile or spec.gpu_milli):
            fit = sum(n.total // spec.gpus_per_replica for n in nodes)
            if fit < spec.replicas:
                raise FailedPrecondition(
                    f"the {len(nodes)} known node(s) with GPU model {spec.gpu_model!r} hold at most {fit} replicas "
                    f"of {spec.gpus_per_replica} GPUs even when empty; the gang needs {spec.replicas}"
                )
    if spec.mig_profile:
        families = sorted({f for n in nodes if (f := mig.mig_family(n.gpu_model, n.memory_mib))})
        if not any(mig.resolve(spec.mig_profile, f) for f in families):
            offered = "; ".join(f"{f}: {', '.join(mig.family_profiles(f))}" for f in families)
            raise FailedPrecondition(
                f"no known node's GPUs offer MIG profile {spec.mig_profile!r}"
                + (f"; profiles here: {offered}" if offered else "; no node here has MIG-capable GPUs")
            )


def check_fits_required_tier(state: SchedulerState, spec: common_pb2.JobSpec, fabric_tiers: tuple[str, ...]) -> None:
    """Refuse a gang that no single domain of its required tier could ever hold.

    From the static structure only: every known node counts at its full size (drained and lost ones too), and a
    node's domain at a fabric tier is its switch of that tier, as placement sees it (nodes without one share the
    cluster root). "cluster" is check_fits_ever's business; the servicer has already checked the name.
    """
    tier = spec.required_tier
    if not tier or tier == "cluster":
        return
    g, r = spec.gpus_per_replica, spec.replicas
    nodes = list(state.capacity.nodes.values())
    if not nodes or g < 1:
        return
    if tier == "node":
        best = max(nodes, key=lambda n: (n.total // g, n.name))
        fit = best.total // g
        if fit < r:
            raise FailedPrecondition(
                f"required_tier=node: the gang needs {r} replicas of {g} GPUs on one node, but the largest node "
                f"({best.name}, {best.total} GPUs) holds at most {fit} such replica(s)"
            )
        return
    if tier not in fabric_tiers:
        return
    index = fabric_tiers.index(tier)
    domains: dict[str, list[int]] = {}
    for n in nodes:
        key = n.path[index] if index < len(n.path) else ""
        entry = domains.setdefault(key, [0, 0])
        entry[0] += n.total // g
        entry[1] += 1
    key, (fit, count) = max(domains.items(), key=lambda kv: (kv[1][0], kv[0]))
    if fit < r:
        where = key or f"the nodes outside any {tier}"
        raise FailedPrecondition(
            f"required_tier={tier}: the gang needs {r} replicas of {g} GPUs under one {tier}, but the largest "
            f"{tier} ({where}, {count} node(s)) holds at most {fit} such replica(s) even when empty"
        )
