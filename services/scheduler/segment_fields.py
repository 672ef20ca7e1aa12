"""What a gang may ask for segments (multi-level gangs: `segment`, `segment_tier`), every problem in words before
anything is written (the servicer raises them as INVALID_ARGUMENT), and how they travel: the jobs.shape JSON column
({"segment": S, "segment_tier": T}; {} for a plain gang) and the placement JSON's "segments" (the domain of each
segment, as placed)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from phalanx.api.v1 import common_pb2
from phalanx.core.placement.segments import default_segment_tier
from services.common.errors import InvalidArgument

# What the submit check reads of a known node: (name, GPUs, switch path from the lowest tier up, GPU model).
KnownNode = tuple[str, int, tuple[str, ...], str]


def segment_problems(spec: common_pb2.JobSpec, tiers: Sequence[str]) -> list[str]:
    """What is wrong with a JobSpec's segment fields on their own (`tiers`: the tier names a job may ask for)."""
    problems: list[str] = []
    s = spec.segment
    if s < 0:
        problems.append(f"segment must be 0 (no segments) or a count of replicas per segment, got {s}")
    elif s and spec.replicas >= 1 and spec.replicas % s:
        problems.append(
            f"segment {s} does not divide replicas {spec.replicas}: the gang is replicas / segment segments of "
            f"{s} replicas each"
        )
    if spec.segment_tier and spec.segment_tier not in tiers:
        problems.append(
            f"segment_tier {spec.segment_tier[:80]!r} is not a tier of this cluster; valid tiers: {', '.join(tiers)}"
        )
    elif spec.segment_tier and not s:
        problems.append("segment_tier needs segment (replicas per segment)")
    if s and (spec.mig_profile or spec.gpu_milli):
        problems.append("segments need whole GPUs per replica, not a MIG instance or a GPU share")
    return problems


def check_segments_fit(nodes: Iterable[Any], spec: common_pb2.JobSpec, fabric_tiers: Sequence[str]) -> None:
    """InvalidArgument when no domain of the segment tier could ever hold the gang's segments, judged on the known
    nodes (the view's node records: name, gpus, path, gpu_model; read only, so the servicer needs no cycle)."""
    if spec.segment <= 0:
        return
    known = ((n.name, n.gpus, tuple(n.path), n.gpu_model) for n in nodes)
    why = segment_never_fits(known, spec, fabric_tiers)
    if why:
        raise InvalidArgument("invalid job: " + why)


def segment_never_fits(nodes: Iterable[KnownNode], spec: common_pb2.JobSpec, fabric_tiers: Sequence[str]) -> str:
    """Why no domain of the segment tier could ever hold the gang's segments ("" when some could, or when no node
    has registered yet). Static structure only: every known node (name, GPUs, switch path, GPU model) at its full
    size, drained and lost ones too; a node no switch of the tier names is in no domain of it."""
    s, g = spec.segment, spec.gpus_per_replica
    if s <= 0 or g < 1 or spec.replicas % s:
        return ""
    tier = spec.segment_tier or default_segment_tier(fabric_tiers)
    names = ["node", *fabric_tiers]
    if tier not in names:
        return ""  # the cluster: one domain, check_fits_ever's business
    level = names.index(tier)
    model = spec.gpu_model.lower()
    holds: dict[str, int] = {}
    for name, gpus, path, gpu_model in nodes:
        if model and model not in gpu_model.lower():
            continue
        key = name if level == 0 else (path[level - 1] if level <= len(path) else "")
        if key:
            holds[key] = holds.get(key, 0) + gpus // g
    if not holds:
        return ""
    largest = max(holds.values(), default=0)
    if largest < s:
        return (
            f"a segment of {s} replicas x {g} GPUs fits in no {tier} domain of this cluster even when empty: the "
            f"largest holds {largest} such replica(s)"
        )
    segments = sum(k // s for k in holds.values())
    if segments < spec.replicas // s:
        return (
            f"the gang's {spec.replicas // s} segments of {s} x {g} GPUs need as many {tier} domain slots, but the "
            f"{len(holds)} {tier} domains of this cluster hold {segments} such segment(s) even when empty"
        )
    return ""


def shape_of_spec(spec: common_pb2.JobSpec) -> dict[str, Any]:
    """The segment part of a job's jobs.shape JSON."""
    if spec.segment <= 0:
        return {}
    return {"segment": spec.segment, "segment_tier": spec.segment_tier}


def shape_into_spec(shape: dict[str, Any], spec: common_pb2.JobSpec) -> None:
    spec.segment = int(shape.get("segment") or 0)
    spec.segment_tier = str(shape.get("segment_tier") or "")


def placed_segments(placement: dict[str, Any]) -> list[str]:
    """The domain of each segment as placed (the placement JSON's "segments"; [] for a plain gang)."""
    return [str(d) for d in placement.get("segments") or ()]
