"""What a gang may ask for spares kept in the domain (`spares_per_segment`), every problem in words before anything is
written (the servicer raises them as INVALID_ARGUMENT), and how spares travel: the jobs.shape JSON key
"spares_per_segment" (merged with the segment keys, never replacing them), the placement JSON's "spares" (each slot's
segment and domain) and "swaps" (count, last), and the Job message's spares, swaps, last_swap_at and last_swap.

A gang without segments cannot keep spares: a spare is kept in a segment's domain, and a plain gang has none. Such a
request is refused (INVALID_ARGUMENT) with the way to ask for it: `--segment R` (the whole gang as one segment,
spares in its domain) or `--segment R --segment-tier cluster` (spares anywhere)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from phalanx.api.v1 import common_pb2
from phalanx.core.model import Placement
from phalanx.core.spares import SpareSlot, inflated, split_spares
from services.common.errors import InvalidArgument

from .segment_fields import KnownNode, segment_never_fits
from .state import JobRecord

SHAPE_KEY = "spares_per_segment"


def spares_per_segment(job: JobRecord) -> int:
    return int(job.shape.get("spares_per_segment") or 0) if job.shape else 0


def spare_slots(job: JobRecord) -> list[SpareSlot]:
    """Each spare slot of the job's attempt (placement JSON "spares"), booked where a row holds it."""
    booked = {r: (n, g) for r, n, g in job.spares}
    out = []
    for s in job.placement.get("spares") or ():
        node, gpus = booked.get(-1 - int(s["slot"]), ("", ()))
        out.append(SpareSlot(int(s["slot"]), int(s["segment"]), str(s["domain"]), node, tuple(gpus)))
    return out


def take_spares(job: JobRecord, placement: Placement) -> tuple[Placement, dict[str, Any]]:
    """A reservation's placement -> the gang's own part, and what the placement JSON adds for spares (the slots,
    and the swaps made so far, kept across attempts). Sets job.spares (none for a gang without spares)."""
    k = spares_per_segment(job)
    if not k:
        job.spares = []
        return placement, {}
    active, slots = split_spares(placement, int(job.shape.get("segment") or 0), k)
    job.spares = [(s.replica, s.node, s.gpus) for s in slots]
    extra: dict[str, Any] = {"spares": [dict(slot=s.slot, segment=s.segment, domain=s.domain) for s in slots]}
    if job.placement.get("swaps"):
        extra["swaps"] = job.placement["swaps"]
    return active, extra


def spare_problems(spec: common_pb2.JobSpec) -> list[str]:
    """What is wrong with a JobSpec's spares_per_segment on its own."""
    k = spec.spares_per_segment
    if k < 0:
        return [f"spares_per_segment must be 0 (no spares) or a count of spare replicas per segment, got {k}"]
    if k and spec.segment <= 0:
        return [
            f"spares_per_segment {k} needs segment: spares are kept in each segment's domain (for the whole gang "
            "in one domain give segment = replicas; for spares anywhere add segment_tier cluster)"
        ]
    return []


def check_spares_fit(nodes: Iterable[Any], spec: common_pb2.JobSpec, fabric_tiers: Sequence[str]) -> None:
    """InvalidArgument when no domain of the segment tier could ever hold a segment with its spares (the known nodes,
    read only, as segment_fields.check_segments_fit)."""
    if spec.spares_per_segment <= 0 or spec.segment <= 0:
        return
    why = spares_never_fit([(n.name, n.gpus, tuple(n.path), n.gpu_model) for n in nodes], spec, fabric_tiers)
    if why:
        raise InvalidArgument("invalid job: " + why)


def spares_never_fit(nodes: Iterable[KnownNode], spec: common_pb2.JobSpec, fabric_tiers: Sequence[str]) -> str:
    """Why no domain of the segment tier could ever hold a segment with its spares ("" when some could): the gang is
    checked as segments of segment + spares_per_segment replicas (what placement reserves)."""
    k, s = spec.spares_per_segment, spec.segment
    if k <= 0 or s <= 0 or spec.replicas % s:
        return ""
    big = common_pb2.JobSpec()
    big.CopyFrom(spec)
    big.replicas, big.segment = inflated(spec.replicas, s, k)
    why = segment_never_fits(nodes, big, fabric_tiers)
    return f"too many spares: with {k} spare(s) per segment, {why}" if why else ""


def spare_shape(spec: common_pb2.JobSpec) -> dict[str, Any]:
    """The spares part of a job's jobs.shape JSON (merged into the segment part by the caller)."""
    return {SHAPE_KEY: spec.spares_per_segment} if spec.spares_per_segment > 0 else {}


def spare_into_spec(shape: dict[str, Any], spec: common_pb2.JobSpec) -> None:
    spec.spares_per_segment = int(shape.get(SHAPE_KEY) or 0)


def spares_into_job(msg: common_pb2.Job, placement: dict[str, Any], rows, running: bool) -> None:
    """Fill the Job message's spares and swaps: each slot of the placement JSON with the node its row books it on
    (`rows`: the attempt's spare allocations, (negative replica, node, GPUs); only a running gang holds them)."""
    slots = placement.get("spares") or ()
    if slots:
        booked = {int(r): str(n) for r, n, _ in rows} if running else {}
        for slot in slots:
            node = booked.get(-1 - int(slot["slot"]), "")
            msg.spares.add(segment=int(slot["segment"]), domain=str(slot["domain"]), node=node, booked=bool(node))
    swaps = placement.get("swaps") or {}
    if swaps:
        msg.swaps = int(swaps.get("count", 0))
        msg.last_swap_at = float(swaps.get("at", 0.0))
        msg.last_swap = str(swaps.get("last", ""))
