"""The service controller's commands, executed by the scheduling cycle in its transaction: a service's desired
state changes (create, update, scale, rollback, delete) and the reconcile that turns it into replica jobs.

Each runs in the cycle, so a change and the replicas it starts or stops commit together, under the leader's
fencing, and the new replicas are placed in that very cycle. A refused command raises before writing anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog
from google.protobuf.json_format import MessageToDict, ParseDict

from phalanx.api.v1 import common_pb2, service_pb2
from phalanx.core.rollout import ReplicaView, plan_fleet
from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)

from .. import ledger
from ..admission import (
    check_fits_ever,
    check_fits_host_resources,
    check_fits_model,
    check_fits_required_tier,
    check_priority,
    check_queue,
)
from ..commands import Submit, submit_all
from ..state import JobRecord
from ..transitions import Cycle, CycleCommand, change_job, set_job, teardown

log = structlog.get_logger()

SERVICE_FIELDS = ("spread_tier", "max_surge", "max_unavailable", "port")


def template_dict(template: common_pb2.JobSpec) -> dict[str, Any]:
    return MessageToDict(template, preserving_proto_field_name=True)


def template_of(data: dict[str, Any]) -> common_pb2.JobSpec:
    return ParseDict(data, common_pb2.JobSpec(), ignore_unknown_fields=True)


def spec_dict(spec: service_pb2.ServiceSpec, admin: bool) -> dict[str, Any]:
    """The service's own settings (not its template), as the services row keeps them."""
    out: dict[str, Any] = dict(
        spread_tier=spec.spread_tier,
        max_surge=spec.max_surge if spec.HasField("max_surge") else 0,
        max_unavailable=spec.max_unavailable if spec.HasField("max_unavailable") else 1,
        port=spec.port,
        admin=admin,
    )
    if spec.HasField("autoscale") and spec.autoscale.max_replicas:
        out["autoscale"] = MessageToDict(spec.autoscale, preserving_proto_field_name=True)
    return out


def service_spec_of(row: dict[str, Any]) -> service_pb2.ServiceSpec:
    """The ServiceSpec a services row (with its current template) stands for."""
    s = row["spec"] or {}
    spec = service_pb2.ServiceSpec(
        name=row["name"],
        replicas=row["replicas"],
        template=template_of(row["template"] or {}),
        spread_tier=s.get("spread_tier", ""),
        max_surge=int(s.get("max_surge", 0)),
        max_unavailable=int(s.get("max_unavailable", 1)),
        port=int(s.get("port", 0)),
    )
    if s.get("autoscale"):
        spec.autoscale.CopyFrom(ParseDict(s["autoscale"], service_pb2.Autoscale(), ignore_unknown_fields=True))
    return spec


def normalized_template(spec: service_pb2.ServiceSpec, fabric_tiers: tuple[str, ...]) -> common_pb2.JobSpec:
    """The replica template as the replicas run it: named after the service, restarting always unless asked never
    ("none" on the CLI), its replicas kept within one domain of the fabric's top tier unless it names a tier."""
    t = common_pb2.JobSpec()
    t.CopyFrom(spec.template)
    if not t.name:
        t.name = spec.name
    t.restart = "never" if t.restart in ("never", "none") else "always"
    if t.roles and t.replicas == 0:
        t.replicas = sum(max(0, r.replicas) for r in t.roles)
    if not t.required_tier and fabric_tiers:
        t.required_tier = fabric_tiers[-1]
    return t


def admit_template(cycle: Cycle, template: common_pb2.JobSpec, tenant: str, admin: bool) -> None:
    """What a submission of one replica must pass, checked once for the service: a replica no domain could ever
    hold is a bad spec (INVALID_ARGUMENT), a queue or priority it may not use is PERMISSION_DENIED."""
    if not cycle.state.capacity.nodes:
        raise FailedPrecondition("no nodes have registered yet, so no replica can be placed; start node agents first")
    try:
        check_fits_ever(cycle.state, template)
        check_fits_model(cycle.state, template)
        check_fits_host_resources(cycle.state, template)
        check_fits_required_tier(cycle.state, template, cycle.settings.fabric.tiers)
    except FailedPrecondition as exc:
        raise InvalidArgument(f"invalid service: a replica can never be placed here: {exc}") from exc
    check_queue(cycle.state, template, tenant)
    if not admin:
        check_priority(cycle.state, template)


def _own(cycle: Cycle, name: str, tenant: str | None) -> dict[str, Any]:
    rows = cycle.work.ask(ledger.read_services, names=[name])
    if not rows or (tenant is not None and rows[0]["tenant"] != tenant):
        raise NotFound(f"no service named {name[:64]!r}")
    return rows[0]


@dataclass
class CreateService(CycleCommand):
    """Create a service (apply: or roll an existing one to this spec when its template or settings differ)."""

    spec: service_pb2.ServiceSpec
    tenant: str = ""
    admin: bool = True
    apply: bool = False

    def execute(self, cycle: Cycle) -> str:
        name = self.spec.name
        template = normalized_template(self.spec, cycle.settings.fabric.tiers)
        existing = cycle.work.ask(ledger.read_services, names=[name])
        if existing and not self.apply:
            row = existing[0]
            same = (
                row["tenant"] == self.tenant
                and row["replicas"] == self.spec.replicas
                and (row["spec"] or {}) == spec_dict(self.spec, self.admin)
                and (row["template"] or {}) == template_dict(template)
            )
            if same:  # a retried create (its first try went through): the service as it asked, not an error
                return name
            raise AlreadyExists(f"a service named {name!r} exists; change it with `phalanx service update` or apply")
        if existing and existing[0]["tenant"] != self.tenant and not self.admin:
            raise AlreadyExists(f"the service name {name!r} is taken: choose another")  # another tenant's
        admit_template(cycle, template, self.tenant, self.admin)
        if not existing:
            cycle.work.write(
                ledger.insert_service,
                name,
                self.tenant,
                self.spec.replicas,
                spec_dict(self.spec, self.admin),
                template_dict(template),
                cycle.now,
            )
            log.info("service_created", service=name, replicas=self.spec.replicas, tenant=self.tenant)
        else:
            row = existing[0]
            changes: dict[str, Any] = {}
            settings = spec_dict(self.spec, self.admin)
            if settings != row["spec"]:
                changes["spec"] = settings
            if self.spec.replicas != row["replicas"] and not settings.get("autoscale"):
                changes["replicas"] = self.spec.replicas
            if changes:
                cycle.work.write(ledger.update_service, name, cycle.now, **changes)
            if template_dict(template) != (row["template"] or {}):
                cycle.work.write(
                    ledger.add_revision, name, row["revision"] + 1, template_dict(template), "apply", cycle.now
                )
        reconcile(cycle, [name])
        return name


@dataclass
class UpdateService(CycleCommand):
    """A new revision with a new replica template (and, optionally, new rollout bounds)."""

    name: str
    template: common_pb2.JobSpec
    tenant: str | None = None
    admin: bool = True
    max_surge: int | None = None
    max_unavailable: int | None = None
    cause: str = "update"

    def execute(self, cycle: Cycle) -> str:
        row = _own(cycle, self.name, self.tenant)
        spec = service_spec_of(row)
        spec.template.CopyFrom(self.template)
        if self.max_surge is not None:
            spec.max_surge = self.max_surge
        if self.max_unavailable is not None:
            spec.max_unavailable = self.max_unavailable
        if spec.max_surge == 0 and spec.max_unavailable == 0:
            raise InvalidArgument("max_surge and max_unavailable cannot both be 0: a rolling update could never start")
        template = normalized_template(spec, cycle.settings.fabric.tiers)
        admit_template(cycle, template, row["tenant"], self.admin)
        settings = dict(row["spec"] or {}, max_surge=spec.max_surge, max_unavailable=spec.max_unavailable)
        if settings != row["spec"]:
            cycle.work.write(ledger.update_service, self.name, cycle.now, spec=settings)
        if template_dict(template) != (row["template"] or {}):
            cycle.work.write(
                ledger.add_revision, self.name, row["revision"] + 1, template_dict(template), self.cause, cycle.now
            )
            log.info("service_revised", service=self.name, revision=row["revision"] + 1, cause=self.cause)
        reconcile(cycle, [self.name])
        return self.name


@dataclass
class RollbackService(CycleCommand):
    """Back to an earlier revision's template, as a new revision (`revision` 0: the one before the current)."""

    name: str
    revision: int = 0
    tenant: str | None = None
    admin: bool = True

    def execute(self, cycle: Cycle) -> str:
        row = _own(cycle, self.name, self.tenant)
        revisions = {r["revision"]: r for r in cycle.work.ask(ledger.read_revisions, self.name)}
        target = self.revision or row["revision"] - 1
        if target == row["revision"]:
            raise FailedPrecondition(f"service {self.name!r} runs revision {target} already")
        if target not in revisions:
            known = ", ".join(str(r) for r in sorted(revisions)) or "none"
            raise (NotFound if self.revision else FailedPrecondition)(
                f"service {self.name!r} has no revision {target} to roll back to; its revisions: {known}"
            )
        template = revisions[target]["template"]
        cycle.work.write(
            ledger.add_revision, self.name, row["revision"] + 1, template, f"rollback to {target}", cycle.now
        )
        log.info("service_rolled_back", service=self.name, to=target, revision=row["revision"] + 1)
        reconcile(cycle, [self.name])
        return self.name


@dataclass
class ScaleService(CycleCommand):
    name: str
    replicas: int
    tenant: str | None = None
    by_autoscaler: str = ""  # the autoscaler's reason, when it scales

    def execute(self, cycle: Cycle) -> str:
        row = _own(cycle, self.name, self.tenant)
        auto = (row["spec"] or {}).get("autoscale")
        if auto and not self.by_autoscaler:
            low, high = int(auto.get("min_replicas", 1)), int(auto.get("max_replicas", 1))
            if not low <= self.replicas <= high:
                raise FailedPrecondition(
                    f"service {self.name!r} is autoscaled within [{low}, {high}]: {self.replicas} is outside; "
                    "change its autoscaler's bounds with apply"
                )
        changes: dict[str, Any] = {}
        if self.replicas != row["replicas"]:
            changes["replicas"] = self.replicas
        if self.by_autoscaler and self.by_autoscaler != row["autoscaler"]:
            changes["autoscaler"] = self.by_autoscaler
        if changes:
            cycle.work.write(ledger.update_service, self.name, cycle.now, **changes)
            if "replicas" in changes:
                log.info("service_scaled", service=self.name, replicas=self.replicas, by=self.by_autoscaler or "user")
        reconcile(cycle, [self.name])
        return self.name


@dataclass
class DeleteService(CycleCommand):
    name: str
    tenant: str | None = None

    def execute(self, cycle: Cycle) -> str:
        _own(cycle, self.name, self.tenant)
        for job in [j for j in cycle.state.jobs.values() if j.service == self.name]:
            stop_replica(cycle, job, f"service {self.name} deleted")
        cycle.work.write(ledger.update_service, self.name, cycle.now, deleted_at=cycle.now, message="deleted")
        log.info("service_deleted", service=self.name)
        return self.name


@dataclass
class Reconcile(CycleCommand):
    """Bring the named services (None: every one) to their desired state."""

    names: list[str] | None = None
    errors: dict[str, str] = field(default_factory=dict)

    def execute(self, cycle: Cycle) -> dict[str, str]:
        return reconcile(cycle, self.names)


def stop_replica(cycle: Cycle, job: JobRecord, reason: str) -> None:
    """End a replica gang: a pending one at once, a running one torn down whole (CANCELLED, with the reason)."""
    if job.state == "PENDING":
        change_job(cycle, job, state="CANCELLED", finished_at=cycle.now, message=reason)
        del cycle.state.jobs[job.id]
        cycle.finished.append(job.id)
        if cycle.state.claims.pop(job.id, None) is not None:
            cycle.work.claim(ledger.end_claim, job.id, "cancelled", cycle.now)
            cycle.state.pass_due = True
        cycle.touched(job)
    elif job.state == "RUNNING":
        teardown(cycle, job, final_state="CANCELLED", message=reason)


def reconcile(cycle: Cycle, names: list[str] | None) -> dict[str, str]:
    """Start and stop replica gangs so that each service moves towards its desired state (phalanx.core.rollout);
    returns each service's message."""
    rows = cycle.work.ask(ledger.read_services, names=names)
    if not rows:
        return {}
    failed = cycle.work.ask(ledger.failed_replicas, [r["name"] for r in rows])
    by_service: dict[str, list[JobRecord]] = {}
    for job in cycle.state.jobs.values():
        if job.service:
            by_service.setdefault(job.service, []).append(job)
    messages = {}
    for row in rows:
        messages[row["name"]] = _reconcile_one(cycle, row, by_service.get(row["name"], []), failed.get(row["name"], []))
    return messages


def _reconcile_one(cycle: Cycle, row: dict[str, Any], jobs: list[JobRecord], failed: list[tuple[int, int, str]]) -> str:
    name, revision = row["name"], row["revision"]
    settings = row["spec"] or {}
    template = template_of(row["template"] or {})
    views = [
        ReplicaView(
            int(j.serving.get("replica", 0)),
            int(j.serving.get("revision", 0)),
            j.id,
            ready=j.ready and j.state == "RUNNING",
        )
        for j in jobs
    ]
    if template.restart == "never":
        live = {v.index for v in views}
        views += [ReplicaView(i, rev, jid, down=True) for i, rev, jid in failed if rev == revision and i not in live]
    plan = plan_fleet(
        views,
        row["replicas"],
        revision,
        max_surge=int(settings.get("max_surge", 0)),
        max_unavailable=int(settings.get("max_unavailable", 1)),
    )
    message = plan.message
    by_id = {j.id: j for j in jobs}
    for stop in plan.stops:
        stop_replica(cycle, by_id[stop.key], f"service {name}: {stop.reason}")
    if plan.starts:
        submits = []
        for start in plan.starts:
            spec = common_pb2.JobSpec()
            spec.CopyFrom(template)
            spec.name = f"{name}-{start.index}"
            replica_of = dict(replica=start.index, revision=start.revision)
            if settings.get("spread_tier"):
                replica_of["spread_tier"] = settings["spread_tier"]
            if start.surge:
                replica_of["surge"] = True
            submits.append(
                Submit(
                    spec,
                    "",
                    tenant=row["tenant"],
                    admin=bool(settings.get("admin", True)),
                    service=name,
                    replica_of=replica_of,
                )
            )
        for result in submit_all(cycle, submits).values():
            if isinstance(result, Exception):
                message = f"{message}; a replica could not be submitted: {result}"
                log.warning("service_replica_refused", service=name, error=str(result))
    if not any(v.revision != revision for v in views if not v.down):
        for job in jobs:  # the rollout is over: its surge replicas may preempt again when they restart
            if job.serving.get("surge") and job.state in ("PENDING", "RUNNING") and job.id in cycle.state.jobs:
                set_job(cycle, job, serving={k: v for k, v in job.serving.items() if k != "surge"})
    if message != row["message"]:
        cycle.work.write(ledger.update_service, name, cycle.now, message=message)
    return message
