"""Build protobuf messages from the in-memory view and from ledger rows."""

from __future__ import annotations

from typing import Any

from phalanx.api.v1 import common_pb2
from phalanx.core.resources import format_size

from .elastic_fields import shape_into_spec as elastic_into_spec
from .segment_fields import placed_segments, shape_into_spec
from .spare_fields import spare_into_spec, spares_into_job
from .state import JobRecord, Partial

JOB_STATES = {
    "PENDING": common_pb2.JOB_STATE_PENDING,
    "RUNNING": common_pb2.JOB_STATE_RUNNING,
    "SUCCEEDED": common_pb2.JOB_STATE_SUCCEEDED,
    "FAILED": common_pb2.JOB_STATE_FAILED,
    "CANCELLED": common_pb2.JOB_STATE_CANCELLED,
    "PREEMPTED": common_pb2.JOB_STATE_PREEMPTED,
}
JOB_STATE_NAMES_ALL = {**{v: k for k, v in JOB_STATES.items()}, common_pb2.JOB_STATE_PREEMPTING: "PREEMPTING"}
JOB_STATE_NAMES = {v: k for k, v in JOB_STATES.items()}
NODE_STATES = {
    "READY": common_pb2.NODE_STATE_READY,
    "DRAINED": common_pb2.NODE_STATE_DRAINED,
    "LOST": common_pb2.NODE_STATE_LOST,
}
RANK_STATE_NAMES = {
    common_pb2.RANK_STATE_ASSIGNED: "ASSIGNED",
    common_pb2.RANK_STATE_RUNNING: "RUNNING",
    common_pb2.RANK_STATE_EXITED: "EXITED",
    common_pb2.RANK_STATE_FAILED_TO_START: "FAILED_TO_START",
    common_pb2.RANK_STATE_KILLED: "KILLED",
    common_pb2.RANK_STATE_LOST: "LOST",
}


def _spec(j: Any) -> common_pb2.JobSpec:
    spec = _plain_spec(j)
    serving = j.get("serving") or {}
    if serving:
        serving_into_spec(serving, spec)
    shape = j.get("shape") or {}
    if shape:
        shape_into_spec(shape, spec)
        spare_into_spec(shape, spec)
        elastic_into_spec(shape, spec)
    if j.get("after") or j.get("array"):
        graph_into_spec(j, spec)
    return spec


def graph_into_spec(j: Any, spec: common_pb2.JobSpec) -> None:
    """A job's dependencies and array spec (jobs.after, jobs.array) back into its JobSpec."""
    for dep in j.get("after") or ():
        spec.after.add(job_id=str(dep.get("job_id", "")), condition=str(dep.get("condition", "")))
    spec.array = str((j.get("array") or {}).get("spec", ""))


def graph_into_job(j: Any, msg: common_pb2.Job) -> None:
    """A job's place in a job graph: its array and index, an array's progress, the dependencies not met yet."""
    msg.array_parent = j.get("array_parent") or ""
    msg.array_task = -1 if j.get("array_task") is None else int(j.get("array_task"))
    for dep in j.get("after") or ():
        if not dep.get("met"):
            msg.waiting_for.add(job_id=str(dep.get("job_id", "")), condition=str(dep.get("condition", "")))
    array = j.get("array") or {}
    if array:
        tasks, started = int(array.get("tasks", 0)), int(array.get("next", 0))
        msg.array.CopyFrom(
            common_pb2.ArrayProgress(
                tasks=tasks,
                limit=int(array.get("limit") or 0),
                waiting=tasks - started,
                active=len(array.get("live") or {}),
                succeeded=int(array.get("succeeded", 0)),
                failed=int(array.get("failed", 0)),
            )
        )


def serving_into_spec(serving: dict[str, Any], spec: common_pb2.JobSpec) -> None:
    """The serving fields of a job's `serving` JSON (ledger.jobs) back into its JobSpec."""
    for role in serving.get("roles") or ():
        spec.roles.add(
            name=str(role.get("name", "")),
            replicas=int(role.get("replicas", 0)),
            command=[str(a) for a in role.get("command") or ()],
            env={str(k): str(v) for k, v in (role.get("env") or {}).items()},
        )
    spec.start_order = str(serving.get("start_order") or "")
    spec.restart = str(serving.get("restart") or "")
    probe = serving.get("ready_probe")
    if probe:
        spec.ready_probe.CopyFrom(probe_message(probe))


def probe_message(probe: dict[str, Any]) -> common_pb2.ReadyProbe:
    return common_pb2.ReadyProbe(
        command=[str(a) for a in probe.get("command") or ()],
        http_port=int(probe.get("http_port") or 0),
        http_path=str(probe.get("http_path") or ""),
        period_s=float(probe.get("period_s") or 0.0),
        initial_delay_s=float(probe.get("initial_delay_s") or 0.0),
        timeout_s=float(probe.get("timeout_s") or 0.0),
        failure_threshold=int(probe.get("failure_threshold") or 0),
    )


def serving_of_spec(spec: common_pb2.JobSpec) -> dict[str, Any]:
    """What a JobSpec asks for serving, as the job's `serving` JSON ({} for a plain batch job)."""
    out: dict[str, Any] = {}
    if spec.roles:
        out["roles"] = [
            dict(name=r.name, replicas=r.replicas, command=list(r.command), env=dict(r.env)) for r in spec.roles
        ]
    if spec.start_order and spec.start_order != "any":
        out["start_order"] = spec.start_order
    if spec.restart:
        out["restart"] = spec.restart
    if spec.HasField("ready_probe"):
        p = spec.ready_probe
        out["ready_probe"] = dict(
            command=list(p.command),
            http_port=p.http_port,
            http_path=p.http_path,
            period_s=p.period_s,
            initial_delay_s=p.initial_delay_s,
            timeout_s=p.timeout_s,
            failure_threshold=p.failure_threshold,
        )
    return out


def _plain_spec(j: Any) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(
        name=j["name"],
        replicas=j["replicas"],
        gpus_per_replica=j["gpus_per_replica"],
        priority=j["priority"],
        procs_per_replica=j["procs_per_replica"],
        command=list(j["command"]),
        env=dict(j["env"] or {}),
        required_tier=j["required_tier"] or "",
        preferred_tier=j["preferred_tier"] or "",
        gpu_model=j.get("gpu_model") or "",
        mig_profile=j.get("mig_profile") or "",
        gpu_milli=j.get("gpu_milli") or 0,
        max_restarts=j.get("max_restarts") or 0,
        time_limit_s=j.get("time_limit") or 0.0,
        queue=j.get("queue") or "default",
        keep_checkpoints=j.get("keep_checkpoints") or 0,
        cpus_per_replica=(j.get("cpu_milli") or 0) / 1000,
        memory_per_replica=format_size(j["memory"]) if j.get("memory") else "",
    )


def _placement(p: dict[str, Any]) -> common_pb2.PlacementInfo | None:
    if not p:
        return None
    return common_pb2.PlacementInfo(
        tier=p.get("tier", ""), domains=p.get("domains", 0), score=p.get("score", 0.0), reason=p.get("reason", "")
    )


def allocation(
    replica: int, node: str, gpus, part: Partial | None, cpu_milli: int = 0, memory: int = 0
) -> common_pb2.Allocation:
    msg = common_pb2.Allocation(replica=replica, node=node, gpus=list(gpus), cpus=cpu_milli / 1000, memory_bytes=memory)
    if part is not None and part.profile:
        msg.slices.add(gpu=gpus[0], profile=part.profile, start=part.start, size=part.size)
    elif part is not None:
        msg.gpu_milli = part.milli
    return msg


def job_from_row(j: Any, allocations, partials: dict[int, Partial] | None = None) -> common_pb2.Job:
    partials = partials or {}
    state = JOB_STATES[j["state"]]
    if j["state"] == "RUNNING" and j.get("preempted_by") and j["preempted_by"] != j["id"]:  # (itself: a grow)
        state = common_pb2.JOB_STATE_PREEMPTING  # still running and holding its GPUs, but on its way out
    if j["state"] != "RUNNING":
        allocations = ()  # only a running job holds GPUs; a requeued or finished one shows none (ledger.read_jobs)
    spares = [a for a in allocations if a[0] < 0]  # spares kept in the domain: Job.spares, not allocations
    if spares:
        allocations = [a for a in allocations if a[0] >= 0]
    msg = common_pb2.Job(
        id=j["id"],
        spec=_spec(j),
        state=state,
        allocations=[
            allocation(r, n, g, partials.get(r), j.get("cpu_milli") or 0, j.get("memory") or 0)
            for r, n, g in allocations
        ],
        attempt=j["attempt"],
        message=j["message"],
        submitted_at=j["submitted_at"],
        started_at=j["started_at"],
        finished_at=j["finished_at"],
        placement=_placement(j["placement"] or {}),
        exit_code=j["exit_code"],
        failures=j.get("failures") or 0,
        preemptions=j.get("preemptions") or 0,
        not_before=j.get("not_before") or 0.0,
        preempted_by=j.get("preempted_by") or "",
        preempt_deadline=j.get("preempt_deadline") or 0.0,
        tenant=j.get("tenant") or "",
        flavor=j.get("flavor") or "",
        struck_nodes=[str(n) for n in (j.get("struck_nodes") or ()) if isinstance(n, str)],
        service=j.get("service") or "",
        service_replica=int((j.get("serving") or {}).get("replica", 0)),
        service_revision=int((j.get("serving") or {}).get("revision", 0)),
        ready=bool(j.get("ready")),
        ready_at=j.get("ready_at") or 0.0,
        segment_domains=placed_segments(j["placement"] or {}),
        current_replicas=len(allocations) if (j.get("shape") or {}).get("min_replicas") else 0,
    )
    spares_into_job(msg, j["placement"] or {}, spares, j["state"] == "RUNNING")
    graph_into_job(j, msg)
    return msg


def job_from_record(job: JobRecord) -> common_pb2.Job:
    return job_from_row(job.__dict__, [*job.allocations, *job.spares] if job.spares else job.allocations, job.partials)


_HEALTH: dict[str, common_pb2.HealthState] = {
    "HEALTHY": common_pb2.HEALTH_STATE_HEALTHY,
    "DEGRADED": common_pb2.HEALTH_STATE_DEGRADED,
    "FATAL": common_pb2.HEALTH_STATE_FATAL,
}


def node_health(n: Any) -> common_pb2.NodeHealth:
    detail = n.get("health_detail") or {}
    return common_pb2.NodeHealth(
        state=_HEALTH.get(n.get("health") or "HEALTHY", common_pb2.HEALTH_STATE_UNSPECIFIED),
        reason=detail.get("reason", ""),
        gpus=[
            common_pb2.GpuHealth(
                index=int(i),
                state=_HEALTH.get(g.get("state", ""), common_pb2.HEALTH_STATE_UNSPECIFIED),
                reasons=g.get("reasons", []),
            )
            for i, g in sorted((detail.get("gpus") or {}).items(), key=lambda kv: int(kv[0]))
        ],
    )


MIG_MODE_NAMES = {"ENABLED": "enabled", "DISABLED": "disabled", "UNSUPPORTED": "unsupported"}


def node_gpu(g: dict[str, Any]) -> common_pb2.NodeGpu:
    msg = common_pb2.NodeGpu(
        index=g["index"],
        uuid=g["uuid"],
        name=g["name"],
        memory_mib=g["memory_mib"],
        mig_mode=MIG_MODE_NAMES.get(g["mig_mode"], "unsupported"),
        mig_mode_pending=MIG_MODE_NAMES.get(g.get("mig_mode_pending") or "", ""),
        mig_switching=bool(g.get("mig_switching")),
        mig_switch_error=g.get("mig_switch_error") or "",
    )
    for i in g["mig_instances"]:
        if not isinstance(i, dict):
            continue
        msg.mig_instances.add(
            profile=str(i.get("profile", "")),
            start=_int32(i.get("start")),
            size=_int32(i.get("size")),
            uuid=str(i.get("uuid", "")),
            managed=bool(i.get("managed")),
            gpu_instance_id=_int32(i.get("gpu_instance_id"), -1),
            compute_instance_id=_int32(i.get("compute_instance_id"), -1),
        )
    return msg


def _int32(value: Any, default: int = 0) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        return default
    return v if -(2**31) <= v < 2**31 else default


def node_from_row(
    n: Any,
    used: int,
    shared: int = 0,
    gpus: list[dict[str, Any]] | None = None,
    releasing: dict[str, tuple[int, ...]] | None = None,
) -> common_pb2.Node:
    """`gpus`: the node's GPU rows (ledger.read_node_gpus). With them, a GPU in MIG mode or carrying a MIG instance
    Phalanx did not make is not free (it takes no whole-GPU job), and one carrying such an instance is shared."""
    health = node_health(n)
    fatal = sum(1 for g in health.gpus if g.state == common_pb2.HEALTH_STATE_FATAL)
    if gpus:
        foreign = {
            g["index"] for g in gpus if any(isinstance(i, dict) and not i.get("managed") for i in g["mig_instances"])
        }
        taken = {
            g["index"] for g in gpus if g["held"] or g["split"] or g["mig_mode"] == "ENABLED" or g.get("mig_switching")
        } | foreign
        used = max(used, len(taken))
        shared = len({g["index"] for g in gpus if g["split"]} | foreign)
    free = max(0, n["gpus"] - used) if n["state"] == "READY" else 0
    if health.state == common_pb2.HEALTH_STATE_FATAL or n.get("health") == "UNKNOWN":
        free = 0  # UNKNOWN: back after it was lost, not used until it reports healthy
    elif fatal:  # a FATAL GPU is not free; it may also be one of the used ones (a gang still running on it)
        free = max(0, min(free, n["gpus"] - fatal))
    return common_pb2.Node(
        health=health,
        name=n["name"],
        state=NODE_STATES.get(n["state"], common_pb2.NODE_STATE_UNSPECIFIED),
        gpus=n["gpus"],
        free_gpus=free,
        profile=n["profile"],
        gpu_model=n["gpu_model"],
        fabric_path=list(n["fabric_path"] or ()),
        message=n["message"],
        last_heartbeat=n["last_heartbeat"],
        address=n["address"],
        shared_gpus=shared,
        gpu_details=[node_gpu(g) for g in gpus or ()],
        strikes=n.get("strikes") or 0,
        mig_manage=bool(n.get("mig_manage")),
        containment=n.get("containment") or "",
        releasing_gpus=sum(len(g) for g in (releasing or {}).values()),
        cpus=(n.get("cpu_milli") or 0) / 1000,
        memory_bytes=n.get("memory") or 0,
        free_cpus=max(0, (n.get("cpu_milli") or 0) - (n.get("cpu_used") or 0)) / 1000,
        free_memory_bytes=max(0, (n.get("memory") or 0) - (n.get("memory_used") or 0)),
    )
