"""Typed, immutable views of serving fleets (``proto/phalanx/api/v1/service.proto``): what a service asks for
(:class:`ServiceSpec`, in the vocabulary of the spec file that ``phalanx apply -f`` reads) and what it is
(:class:`Service`, its replicas and revisions), and its endpoints.

A replica is a gang: ``nodes_per_replica`` nodes (the template's ``replicas``) of ``gpus_per_node`` GPUs (its
``gpus_per_replica``). ``to_dict()`` is the JSON shape of the ``phalanx service`` commands; ``ServiceSpec.to_dict()``
is a spec file that ``phalanx apply -f`` takes back.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.api.v1 import common_pb2, service_pb2

__all__ = ["Role", "ReadyProbe", "Autoscale", "ServiceSpec", "ServiceReplica", "ServiceRevision", "Service", "Endpoint"]


def _argv(command: Sequence[str] | str) -> list[str]:
    """A command as argv: a string is split like a shell would (:func:`shlex.split`)."""
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _env(env: Mapping[str, Any] | None) -> dict[str, str]:
    """Variables as strings (a spec file may give a number: ``PORT: 8000``)."""
    return {str(k): str(v) for k, v in (env or {}).items()}


@dataclass(frozen=True)
class Role:
    """One part of a replica: ``nodes`` of its nodes, with their own command (empty: the service's) and extra
    env. The ranks see ``PHALANX_ROLE`` (the name) and ``PHALANX_ROLE_INDEX`` (their node within the role)."""

    name: str
    nodes: int
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def to_proto(self) -> common_pb2.Role:
        """The ``phalanx.v1.Role`` message."""
        return common_pb2.Role(name=self.name, replicas=int(self.nodes), command=list(self.command), env=self.env)

    @classmethod
    def from_proto(cls, msg: common_pb2.Role) -> Role:
        """Build from a ``phalanx.v1.Role`` message."""
        return cls(msg.name, int(msg.replicas), list(msg.command), dict(msg.env))

    def to_dict(self) -> dict[str, Any]:
        """The spec file's shape: ``{"name", "nodes"}``, plus ``command`` and ``env`` when set."""
        out: dict[str, Any] = {"name": self.name, "nodes": self.nodes}
        if self.command:
            out["command"] = list(self.command)
        if self.env:
            out["env"] = dict(self.env)
        return out


@dataclass(frozen=True)
class ReadyProbe:
    """A readiness probe run by the leader's node agent: ``command`` (exit 0: ready) or an HTTP GET of
    ``http_port`` and ``http_path`` (2xx: ready), exactly one of the two. 0 means the scheduler's default
    (period 2 s, timeout 2 s, 3 failures in a row make a ready replica unready)."""

    command: list[str] = field(default_factory=list)
    http_port: int = 0
    http_path: str = ""
    period_s: float = 0.0
    initial_delay_s: float = 0.0
    timeout_s: float = 0.0
    failure_threshold: int = 0

    def to_proto(self) -> common_pb2.ReadyProbe:
        """The ``phalanx.v1.ReadyProbe`` message."""
        return common_pb2.ReadyProbe(
            command=list(self.command),
            http_port=int(self.http_port),
            http_path=self.http_path or ("/" if self.http_port else ""),
            period_s=float(self.period_s),
            initial_delay_s=float(self.initial_delay_s),
            timeout_s=float(self.timeout_s),
            failure_threshold=int(self.failure_threshold),
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.ReadyProbe) -> ReadyProbe:
        """Build from a ``phalanx.v1.ReadyProbe`` message."""
        return cls(
            list(msg.command),
            int(msg.http_port),
            msg.http_path,
            float(msg.period_s),
            float(msg.initial_delay_s),
            float(msg.timeout_s),
            int(msg.failure_threshold),
        )

    def to_dict(self) -> dict[str, Any]:
        """The spec file's shape: ``command`` or ``http_port`` (and ``http_path``), and the timings that are set."""
        out: dict[str, Any] = {"command": list(self.command)} if self.command else {"http_port": self.http_port}
        if self.http_port and self.http_path:
            out["http_path"] = self.http_path
        for name in ("period_s", "initial_delay_s", "timeout_s", "failure_threshold"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class Autoscale:
    """An HPA-style autoscaler: within [``min_replicas``, ``max_replicas``], it aims ``metric`` at ``target`` per
    ready replica. The metric is scraped from each ready leader at ``http://ADDRESS:metrics_port/metrics_path``
    (``metrics_port`` 0: not scraped, only pushed with :meth:`Client.push_metric`). 0 means the default: a
    scale-down window of 300 s, no scale-up window, a tolerance of 0.1, a period of 5 s, ``/metrics``."""

    min_replicas: int
    max_replicas: int
    metric: str
    target: float
    metrics_port: int = 0
    metrics_path: str = ""
    scale_down_window_s: float = 0.0
    scale_up_window_s: float = 0.0
    tolerance: float = 0.0
    period_s: float = 0.0

    def to_proto(self) -> service_pb2.Autoscale:
        """The ``phalanx.v1.Autoscale`` message."""
        return service_pb2.Autoscale(
            min_replicas=int(self.min_replicas),
            max_replicas=int(self.max_replicas),
            metric=self.metric,
            target=float(self.target),
            metrics_port=int(self.metrics_port),
            metrics_path=self.metrics_path,
            scale_down_window_s=float(self.scale_down_window_s),
            scale_up_window_s=float(self.scale_up_window_s),
            tolerance=float(self.tolerance),
            period_s=float(self.period_s),
        )

    @classmethod
    def from_proto(cls, msg: service_pb2.Autoscale) -> Autoscale:
        """Build from a ``phalanx.v1.Autoscale`` message."""
        return cls(
            int(msg.min_replicas),
            int(msg.max_replicas),
            msg.metric,
            float(msg.target),
            int(msg.metrics_port),
            msg.metrics_path,
            float(msg.scale_down_window_s),
            float(msg.scale_up_window_s),
            float(msg.tolerance),
            float(msg.period_s),
        )

    def to_dict(self) -> dict[str, Any]:
        """The spec file's shape: the four required keys, and the others that are set."""
        out: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "metric": self.metric,
            "target": self.target,
        }
        for name in (
            "metrics_port",
            "metrics_path",
            "scale_down_window_s",
            "scale_up_window_s",
            "tolerance",
            "period_s",
        ):
            if getattr(self, name):
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class ServiceSpec:
    """What a service asks for: ``replicas`` (K) model replicas, each a gang of ``nodes_per_replica`` (N) nodes with
    ``gpus_per_node`` (G) GPUs each, running ``command``. The field names are those of the spec file (its schema:
    ``phalanx/schemas/service.schema.json``); :meth:`from_dict` reads one, :meth:`to_dict` writes one.

    Change one with :func:`dataclasses.replace` (``replace(service.spec, command=[...])``) and hand it to
    :meth:`Client.update_service` or :meth:`Client.apply_service`.

    Attributes:
        nodes_per_replica: N; 0: the roles' nodes added up (1 without roles).
        roles: Parts of a replica with their own commands; the first role's first node is the leader.
        start_order: "" or "any" (all at once), "leader-first", "workers-first".
        restart: "always" (a replica that exits restarts whole) or "never" (it stays down, FAILED).
        port: The leader's serving port in the endpoints (0: the ready probe's ``http_port``).
        procs_per_node: 0: one process per GPU; 1: one per node with all its GPUs.
        max_unavailable: Rolling update: replicas below K unready at once (None: 1).
        max_surge: Rolling update: replicas above K at once (None: 0).
    """

    name: str
    replicas: int
    nodes_per_replica: int = 0
    gpus_per_node: int = 1
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    priority: int = 0
    queue: str = ""
    roles: list[Role] = field(default_factory=list)
    start_order: str = ""
    ready_probe: ReadyProbe | None = None
    port: int = 0
    restart: str = "always"
    spread_tier: str = ""
    required_tier: str = ""
    preferred_tier: str = ""
    gpu_model: str = ""
    procs_per_node: int = 0
    cpus_per_node: float = 0.0
    memory_per_node: str = ""
    max_unavailable: int | None = None
    max_surge: int | None = None
    autoscale: Autoscale | None = None

    @property
    def nodes(self) -> int:
        """N: the nodes of one replica (``nodes_per_replica``, else the roles' sum, else 1)."""
        return self.nodes_per_replica or sum(r.nodes for r in self.roles) or 1

    def template(self) -> common_pb2.JobSpec:
        """The replica template: the ``phalanx.v1.JobSpec`` of one replica's gang."""
        spec = common_pb2.JobSpec(
            name=self.name,
            replicas=int(self.nodes_per_replica or (0 if self.roles else 1)),
            gpus_per_replica=int(self.gpus_per_node),
            priority=int(self.priority),
            procs_per_replica=int(self.procs_per_node),
            command=_argv(self.command),
            env=_env(self.env),
            required_tier=self.required_tier,
            preferred_tier=self.preferred_tier,
            gpu_model=self.gpu_model,
            queue=self.queue,
            cpus_per_replica=float(self.cpus_per_node),
            memory_per_replica=str(self.memory_per_node or ""),
            roles=[r.to_proto() for r in self.roles],
            start_order="" if self.start_order == "any" else self.start_order,
            restart="never" if self.restart in ("never", "none") else "always",
        )
        if self.ready_probe is not None:
            spec.ready_probe.CopyFrom(self.ready_probe.to_proto())
        return spec

    def to_proto(self) -> service_pb2.ServiceSpec:
        """The ``phalanx.v1.ServiceSpec`` message."""
        msg = service_pb2.ServiceSpec(
            name=self.name,
            replicas=int(self.replicas),
            template=self.template(),
            spread_tier=self.spread_tier,
            port=int(self.port),
        )
        if self.max_unavailable is not None:
            msg.max_unavailable = int(self.max_unavailable)
        if self.max_surge is not None:
            msg.max_surge = int(self.max_surge)
        if self.autoscale is not None:
            msg.autoscale.CopyFrom(self.autoscale.to_proto())
        return msg

    @classmethod
    def from_proto(cls, msg: service_pb2.ServiceSpec) -> ServiceSpec:
        """Build from a ``phalanx.v1.ServiceSpec`` message (as the scheduler answers it)."""
        return cls(
            name=msg.name,
            replicas=int(msg.replicas),
            spread_tier=msg.spread_tier,
            port=int(msg.port),
            max_unavailable=int(msg.max_unavailable) if msg.HasField("max_unavailable") else None,
            max_surge=int(msg.max_surge) if msg.HasField("max_surge") else None,
            autoscale=Autoscale.from_proto(msg.autoscale) if msg.autoscale.max_replicas else None,
            **template_fields(msg.template),
        )

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ServiceSpec:
        """Build from a spec file's document (see ``phalanx/schemas/service.schema.json``). It is not checked
        against the schema here: :func:`phalanx.client.load_service_spec` checks a file, and
        :func:`phalanx.client.service_spec_problems` a document.

        Raises:
            KeyError, TypeError, ValueError: A document that does not have the schema's shape.
        """
        probe = doc.get("ready_probe")
        auto = doc.get("autoscale")
        return cls(
            name=str(doc["name"]),
            replicas=int(doc["replicas"]),
            nodes_per_replica=int(doc.get("nodes_per_replica") or 0),
            gpus_per_node=int(doc["gpus_per_node"]),
            command=_argv(doc["command"]),
            env=_env(doc.get("env")),
            priority=_priority(doc.get("priority", 0)),
            queue=str(doc.get("queue") or ""),
            roles=[
                Role(str(r["name"]), int(r["nodes"]), _argv(r.get("command") or []), _env(r.get("env")))
                for r in doc.get("roles") or ()
            ],
            start_order=str(doc.get("start_order") or ""),
            ready_probe=None if probe is None else ReadyProbe(**dict(probe, command=_argv(probe.get("command") or []))),
            port=int(doc.get("port") or 0),
            restart=str(doc.get("restart") or "always"),
            spread_tier=str(doc.get("spread_tier") or ""),
            required_tier=str(doc.get("required_tier") or ""),
            preferred_tier=str(doc.get("preferred_tier") or ""),
            gpu_model=str(doc.get("gpu_model") or ""),
            procs_per_node=int(doc.get("procs_per_node") or 0),
            cpus_per_node=float(doc.get("cpus_per_node") or 0.0),
            memory_per_node=_memory(doc.get("memory_per_node")),
            max_unavailable=None if doc.get("max_unavailable") is None else int(doc["max_unavailable"]),
            max_surge=None if doc.get("max_surge") is None else int(doc["max_surge"]),
            autoscale=None if auto is None else Autoscale(**auto),
        )

    def to_dict(self) -> dict[str, Any]:
        """A spec file's document (what ``phalanx apply -f`` takes): the required keys, and every other one that
        is set."""
        out: dict[str, Any] = {"name": self.name, "replicas": self.replicas}
        if self.nodes_per_replica:
            out["nodes_per_replica"] = self.nodes_per_replica
        out["gpus_per_node"] = self.gpus_per_node
        out["command"] = list(self.command)
        for key in ("priority", "queue", "start_order", "port", "spread_tier", "required_tier"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        for key in ("preferred_tier", "gpu_model", "procs_per_node", "cpus_per_node", "memory_per_node"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.env:
            out["env"] = dict(self.env)
        if self.roles:
            out["roles"] = [r.to_dict() for r in self.roles]
        if self.ready_probe is not None:
            out["ready_probe"] = self.ready_probe.to_dict()
        out["restart"] = "never" if self.restart in ("never", "none") else "always"
        if self.max_unavailable is not None:
            out["max_unavailable"] = self.max_unavailable
        if self.max_surge is not None:
            out["max_surge"] = self.max_surge
        if self.autoscale is not None:
            out["autoscale"] = self.autoscale.to_dict()
        return out


def template_fields(t: common_pb2.JobSpec) -> dict[str, Any]:
    """The :class:`ServiceSpec` fields of a replica template (a ``phalanx.v1.JobSpec``)."""
    return dict(
        nodes_per_replica=int(t.replicas),
        gpus_per_node=int(t.gpus_per_replica),
        command=list(t.command),
        env=dict(t.env),
        priority=int(t.priority),
        queue=t.queue,
        roles=[Role.from_proto(r) for r in t.roles],
        start_order=t.start_order,
        ready_probe=ReadyProbe.from_proto(t.ready_probe) if t.HasField("ready_probe") else None,
        restart="never" if t.restart in ("never", "none") else "always",
        required_tier=t.required_tier,
        preferred_tier=t.preferred_tier,
        gpu_model=t.gpu_model,
        procs_per_node=int(t.procs_per_replica),
        cpus_per_node=float(t.cpus_per_replica),
        memory_per_node=t.memory_per_replica,
    )


def _priority(value: Any) -> int:
    from phalanx.core.preemption import parse_priority

    return parse_priority(value)


def _memory(value: Any) -> str:
    """A spec file's memory: bytes (an integer) or a size with a unit ("64G"), as the API takes it."""
    if value is None or value == "":
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value}B"
    from phalanx.core.resources import parse_size

    parse_size(str(value))  # ValueError: not a size
    return str(value).strip()


@dataclass(frozen=True)
class ServiceReplica:
    """One replica of a service: a gang job (``job_id``) of one revision.

    ``state`` is PENDING (waiting for GPUs), STARTING (placed, not ready yet), READY, RESTARTING (torn down and
    requeued), FAILED (down for good, with ``restart`` never) or TERMINATING (being removed). ``leader_address`` is
    ``host:port`` of its leader ("" until placed); ``surge``: started above K by a rolling update."""

    index: int
    revision: int
    state: str
    ready: bool = False
    nodes: tuple[str, ...] = ()
    leader_address: str = ""
    job_id: str = ""
    message: str = ""
    surge: bool = False

    @classmethod
    def from_proto(cls, msg: service_pb2.ServiceReplica) -> ServiceReplica:
        """Build from a ``phalanx.v1.ServiceReplica`` message."""
        return cls(
            int(msg.index),
            int(msg.revision),
            msg.state,
            bool(msg.ready),
            tuple(msg.nodes),
            msg.leader_address,
            msg.job_id,
            msg.message,
            bool(msg.surge),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape: ``{"index", "revision", "state", "ready", "nodes", "leader_address", "job_id",
        "message", "surge"}``."""
        return {
            "index": self.index,
            "revision": self.revision,
            "state": self.state,
            "ready": self.ready,
            "nodes": list(self.nodes),
            "leader_address": self.leader_address,
            "job_id": self.job_id,
            "message": self.message,
            "surge": self.surge,
        }


@dataclass(frozen=True)
class ServiceRevision:
    """One revision of a service's replica template: its number, when and why it was made ("create", "update",
    "apply", "rollback to N"), and the template's fields (those of :class:`ServiceSpec` that a revision holds)."""

    revision: int
    created_at: float
    cause: str
    template: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, msg: service_pb2.ServiceRevision) -> ServiceRevision:
        """Build from a ``phalanx.v1.ServiceRevision`` message."""
        fields = template_fields(msg.template)
        probe, roles = fields.pop("ready_probe"), fields.pop("roles")
        template = {k: v for k, v in fields.items() if v}
        if roles:
            template["roles"] = [r.to_dict() for r in roles]
        if probe is not None:
            template["ready_probe"] = probe.to_dict()
        return cls(int(msg.revision), float(msg.created_at), msg.cause, template)

    @property
    def command(self) -> list[str]:
        """The command of this revision's replicas."""
        return list(self.template.get("command", []))

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape: ``{"revision", "created_at", "cause", "template"}``."""
        return {
            "revision": self.revision,
            "created_at": self.created_at,
            "cause": self.cause,
            "template": dict(self.template),
        }


@dataclass(frozen=True)
class Endpoint:
    """A ready replica's leader: ``address`` (``host:port``) serves requests for replica ``replica``."""

    replica: int
    address: str
    revision: int = 0

    @classmethod
    def from_proto(cls, msg: service_pb2.Endpoint) -> Endpoint:
        """Build from a ``phalanx.v1.Endpoint`` message."""
        return cls(int(msg.replica), msg.address, int(msg.revision))

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape: ``{"replica", "address", "revision"}``."""
        return {"replica": self.replica, "address": self.address, "revision": self.revision}


@dataclass(frozen=True)
class Service:
    """A service as the scheduler reports it: its current ``revision``, the replica count it aims at
    (``desired_replicas``), its ``replicas`` (each a gang; during a rolling update, of two revisions), how many are
    ready, and what its controller does or waits for (``message``).

    ``revisions`` (newest first) come from :meth:`Client.get_service` only; ``autoscaler`` is the autoscaler's last
    decision in words ("" without one)."""

    name: str
    revision: int
    desired_replicas: int
    replicas: tuple[ServiceReplica, ...] = ()
    ready_replicas: int = 0
    message: str = ""
    tenant: str = ""
    created_at: float = 0.0
    deleted: bool = False
    autoscaler: str = ""
    spec: ServiceSpec | None = field(default=None, compare=False)
    revisions: tuple[ServiceRevision, ...] = field(default=(), compare=False)

    @property
    def endpoints(self) -> list[Endpoint]:
        """The ready replicas' leader addresses, by replica index (what :meth:`Client.watch_endpoints` streams)."""
        return [Endpoint(r.index, r.leader_address, r.revision) for r in self.replicas if r.ready and r.leader_address]

    @classmethod
    def from_proto(cls, msg: service_pb2.Service) -> Service:
        """Build from a ``phalanx.v1.Service`` message."""
        return cls(
            name=msg.spec.name,
            revision=int(msg.revision),
            desired_replicas=int(msg.spec.replicas),
            replicas=tuple(ServiceReplica.from_proto(r) for r in msg.replicas),
            ready_replicas=int(msg.ready_replicas),
            message=msg.message,
            tenant=msg.tenant,
            created_at=float(msg.created_at),
            deleted=bool(msg.deleted),
            autoscaler=msg.autoscaler,
            spec=ServiceSpec.from_proto(msg.spec),
            revisions=tuple(ServiceRevision.from_proto(r) for r in msg.revisions),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape printed by ``phalanx service get --json`` (a stable contract): ``{"name", "revision",
        "desired_replicas", "ready_replicas", "replicas": [replica objects], "message", "tenant", "created_at",
        "deleted", "autoscaler", "spec": {a spec file}, "revisions": [...]}``."""
        return {
            "name": self.name,
            "revision": self.revision,
            "desired_replicas": self.desired_replicas,
            "ready_replicas": self.ready_replicas,
            "replicas": [r.to_dict() for r in self.replicas],
            "message": self.message,
            "tenant": self.tenant,
            "created_at": self.created_at,
            "deleted": self.deleted,
            "autoscaler": self.autoscaler,
            "spec": None if self.spec is None else self.spec.to_dict(),
            "revisions": [r.to_dict() for r in self.revisions],
        }
