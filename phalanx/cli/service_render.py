"""Human-readable output of the ``phalanx service`` verbs: a service's detail with its replicas, the services table,
endpoints, and the lines of ``service endpoints --watch``. Their ``--json`` shapes are the SDK's ``to_dict()``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime

from phalanx.client import Endpoint, Service, ServiceSpec

from .render import format_time, table

__all__ = ["service_detail", "services_table", "endpoints_table", "endpoints_line", "endpoints_json"]


def _gang(spec: ServiceSpec) -> str:
    nodes = spec.nodes
    gang = f"{nodes} node{'s' if nodes != 1 else ''} x {spec.gpus_per_node} GPUs"
    if spec.roles:
        parts = [f"{r.name} x {r.nodes}" + (f": {' '.join(r.command)}" if r.command else "") for r in spec.roles]
        gang += " (" + "; ".join(parts) + ")"
    return gang + " per replica"


def _probe(spec: ServiceSpec) -> str:
    p = spec.ready_probe
    if p is None:
        return "none (ready once every rank runs)"
    if p.http_port:
        return f"GET :{p.http_port}{p.http_path or '/'} answers 2xx"
    return f"{' '.join(p.command)} exits 0"


def replicas_table(service: Service) -> str:
    """INDEX REV STATE READY NODES LEADER JOB MESSAGE, one row per replica (a surge replica's index marked ``+``)."""
    return table(
        ["INDEX", "REV", "STATE", "READY", "NODES", "LEADER", "JOB", "MESSAGE"],
        [
            (
                f"{r.index}+" if r.surge else r.index,
                r.revision,
                r.state,
                "yes" if r.ready else "no",
                ",".join(r.nodes) or "-",
                r.leader_address or "-",
                r.job_id or "-",
                r.message,
            )
            for r in service.replicas
        ],
    )


def service_detail(service: Service) -> str:
    """A ``key: value`` view of one service, then its replicas (and its revisions, from ``service get``)."""
    lines: list[tuple[str, object]] = [
        ("service", service.name + (" (deleted)" if service.deleted else "")),
        ("revision", service.revision),
        ("replicas", f"{service.ready_replicas} ready of {service.desired_replicas}"),
        ("message", service.message or "-"),
    ]
    spec = service.spec
    if spec is not None:
        lines += [
            ("gang", _gang(spec)),
            ("command", " ".join(spec.command) or "-"),
            ("ready probe", _probe(spec)),
            ("restart", spec.restart),
            ("rollout", f"max unavailable {spec.max_unavailable or 0}, max surge {spec.max_surge or 0}"),
        ]
        if spec.autoscale is not None:
            a = spec.autoscale
            lines.append(("autoscale", f"{a.min_replicas}-{a.max_replicas} replicas, {a.metric} at {a.target:g}"))
    if service.autoscaler:
        lines.append(("autoscaler", service.autoscaler))
    lines.append(("endpoints", ", ".join(e.address for e in service.endpoints) or "-"))
    if service.created_at:
        lines.append(("created", format_time(service.created_at)))
    width = max(len(k) for k, _ in lines) + 1
    out = [f"{(k + ':').ljust(width)} {v}" for k, v in lines]
    if service.replicas:
        out.append("")
        out.append(replicas_table(service))
    if service.revisions:
        out.append("")
        out.append(
            table(
                ["REVISION", "CREATED", "CAUSE", "COMMAND"],
                [(r.revision, format_time(r.created_at), r.cause, " ".join(r.command)) for r in service.revisions],
            )
        )
    return "\n".join(out)


def services_table(services: Sequence[Service]) -> str:
    """``phalanx services``: NAME REVISION READY (ready/desired) MESSAGE."""
    return table(
        ["NAME", "REVISION", "READY", "MESSAGE"],
        [(s.name, s.revision, f"{s.ready_replicas}/{s.desired_replicas}", s.message) for s in services],
    )


def endpoints_table(endpoints: Sequence[Endpoint]) -> str:
    """``phalanx service endpoints``: REPLICA ADDRESS REVISION."""
    return table(["REPLICA", "ADDRESS", "REVISION"], [(e.replica, e.address, e.revision) for e in endpoints])


def endpoints_json(endpoints: Sequence[Endpoint]) -> list[dict[str, object]]:
    """``--json``: ``[{"replica", "address", "revision"}]``, the ready replicas by index."""
    return [e.to_dict() for e in endpoints]


def endpoints_line(name: str, endpoints: Sequence[Endpoint], now: float | None = None) -> str:
    """One line of ``service endpoints --watch``: the time, the service, how many, and ``replica=address``."""
    stamp = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC).strftime("%H:%M:%S")
    listed = " ".join(f"{e.replica}={e.address}" for e in endpoints) or "-"
    return f"{stamp} {name} {len(endpoints)} ready: {listed}"
