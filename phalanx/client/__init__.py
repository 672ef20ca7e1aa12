"""Python SDK for the Phalanx scheduler.

Use :class:`Client` (blocking) or :class:`AsyncClient` (asyncio)::

    from phalanx.client import Client, NotFoundError

    with Client() as client:                      # $PHALANX_SCHEDULER, else 127.0.0.1:50051
        job = client.submit("train", replicas=2, gpus_per_replica=8, command=["python", "train.py"])
        job = client.wait(job.id, timeout=3600)   # SUCCEEDED, FAILED or CANCELLED
        print(job.state, job.exit_code)

Serving fleets (services: K replicas of a model server, each a gang of N nodes)::

    spec = load_service_spec("llm.yaml")          # the spec file of `phalanx apply -f`, checked against its schema
    service = client.apply_service(spec)          # or client.create_service(ServiceSpec(...))
    for endpoints in client.watch_endpoints("llm"):
        print([e.address for e in endpoints])     # the ready replicas' leaders, now and after every change

Results are frozen dataclasses (:class:`Job`, :class:`Node`, :class:`Allocation`, :class:`GoodputReport`,
:class:`CheckpointResult`, :class:`Service`, :class:`Endpoint`) whose ``to_dict()`` is the JSON shape of the
``phalanx`` CLI. Errors derive from
:class:`PhalanxError`; see :mod:`phalanx.client._errors` for the tree (``RPCError`` and one subclass per common
gRPC status code).
"""

from ._async_client import AsyncClient
from ._channel import TLSConfig, open_aio_channel, open_channel, resolve_tls
from ._client import DEFAULT_RETRIES, DEFAULT_TARGET, DEFAULT_TIMEOUT, Client, resolve_target
from ._errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    PhalanxError,
    ResourceExhaustedError,
    RPCError,
    UnauthenticatedError,
    UnavailableError,
)
from ._service_types import (
    Autoscale,
    Endpoint,
    ReadyProbe,
    Role,
    Service,
    ServiceReplica,
    ServiceRevision,
    ServiceSpec,
)
from ._spares import PoolDomain, SparePool
from ._spec_file import ServiceSpecError, load_service_spec, parse_service_spec, service_schema, service_spec_problems
from ._types import (
    TERMINAL_STATES,
    Allocation,
    ArrayProgress,
    CheckpointResult,
    Claim,
    Dependency,
    Goodput,
    GoodputReport,
    GroupGoodput,
    Job,
    JobGoodput,
    JobState,
    MigSlice,
    Node,
    NodeState,
    QueueInfo,
)

__all__ = [
    "Client",
    # Channels with the SDK's auth, TLS, limits and retry policy, for the node agent and the rank library.
    "open_channel",
    "open_aio_channel",
    "resolve_tls",
    "TLSConfig",
    "AsyncClient",
    "Job",
    "ArrayProgress",
    "Dependency",
    "Node",
    "QueueInfo",
    "PoolDomain",
    "SparePool",
    "Allocation",
    "Claim",
    "MigSlice",
    "Goodput",
    "JobGoodput",
    "GroupGoodput",
    "GoodputReport",
    "CheckpointResult",
    "JobState",
    "NodeState",
    "TERMINAL_STATES",
    # Serving fleets
    "ServiceSpec",
    "Role",
    "ReadyProbe",
    "Autoscale",
    "Service",
    "ServiceReplica",
    "ServiceRevision",
    "Endpoint",
    "load_service_spec",
    "parse_service_spec",
    "service_spec_problems",
    "service_schema",
    "ServiceSpecError",
    "DEFAULT_TARGET",
    "DEFAULT_TIMEOUT",
    "DEFAULT_RETRIES",
    "resolve_target",
    "PhalanxError",
    "RPCError",
    "InvalidArgumentError",
    "NotFoundError",
    "FailedPreconditionError",
    "PermissionDeniedError",
    "UnauthenticatedError",
    "ResourceExhaustedError",
    "DeadlineExceededError",
    "UnavailableError",
]
