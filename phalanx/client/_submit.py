"""The SubmitJobRequest a submission sends (:meth:`phalanx.client.Client.submit` and the async client's), built once
for both."""

from __future__ import annotations

import shlex
import uuid
from collections.abc import Iterable, Mapping, Sequence

from phalanx.api.v1 import common_pb2, scheduler_pb2

from ._graph import dependency_messages


def build_submit_request(
    name: str,
    replicas: int,
    gpus_per_replica: int,
    command: Sequence[str] | str,
    *,
    priority: int,
    procs_per_replica: int,
    env: Mapping[str, str] | None,
    request_id: str | None,
    required_tier: str = "",
    preferred_tier: str = "",
    gpu_model: str = "",
    mig_profile: str = "",
    gpu_milli: int = 0,
    max_restarts: int = 0,
    time_limit: float = 0.0,
    queue: str = "",
    keep_checkpoints: int = 0,
    cpus_per_replica: float = 0,
    memory_per_replica: str | int = "",
    segment: int = 0,
    segment_tier: str = "",
    spares_per_segment: int = 0,
    min_replicas: int = 0,
    after: Iterable[str | tuple[str, str]] | str | None = None,
    array: str = "",
) -> scheduler_pb2.SubmitJobRequest:
    """Build a SubmitJobRequest; a missing request_id gets a fresh uuid4 hex (the idempotency key)."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    spec = common_pb2.JobSpec(
        name=name,
        replicas=int(replicas),
        gpus_per_replica=int(gpus_per_replica),
        priority=int(priority),
        procs_per_replica=int(procs_per_replica),
        command=argv,
        env={str(k): str(v) for k, v in (env or {}).items()},
        required_tier=str(required_tier or ""),
        preferred_tier=str(preferred_tier or ""),
        gpu_model=str(gpu_model or ""),
        mig_profile=str(mig_profile or ""),
        gpu_milli=int(gpu_milli or 0),
        max_restarts=int(max_restarts or 0),
        time_limit_s=float(time_limit or 0.0),
        queue=str(queue or ""),
        keep_checkpoints=int(keep_checkpoints or 0),
        cpus_per_replica=float(cpus_per_replica or 0),
        memory_per_replica=(
            f"{memory_per_replica}B"
            if isinstance(memory_per_replica, int) and memory_per_replica
            else str(memory_per_replica or "")
        ),
        segment=int(segment or 0),
        segment_tier=str(segment_tier or ""),
        spares_per_segment=int(spares_per_segment or 0),
        min_replicas=int(min_replicas or 0),
        after=dependency_messages(after),
        array=str(array or ""),
    )
    return scheduler_pb2.SubmitJobRequest(spec=spec, request_id=request_id or uuid.uuid4().hex)
