"""What an elastic gang may ask for (JobSpec.min_replicas; `replicas` is then its maximum): every problem in words,
before anything is written (servicer.validate_spec raises them as INVALID_ARGUMENT), and how it is kept in the job's
`shape` JSON ({"min_replicas": M}, beside other keys of that column such as segments')."""

from __future__ import annotations

from typing import Any

from phalanx.api.v1 import common_pb2

MIN_REPLICAS = "min_replicas"


def elastic_problems(spec: common_pb2.JobSpec) -> list[str]:
    """What is wrong with a JobSpec's elastic fields ([] for a gang that is not elastic)."""
    low, high = spec.min_replicas, spec.replicas
    if low == 0:
        return []
    if low < 0:
        return [f"min_replicas must be at least 1 (or 0: not elastic), got {low}"]
    problems = []
    if high >= 1 and low > high:
        problems.append(
            f"min_replicas {low} is more than replicas {high}, its maximum (--replicas MIN:MAX wants MIN <= MAX)"
        )
    # What an elastic gang is not combined with (yet): each would need its own rule for which replicas go. (Segments
    # and spares are: it grows and shrinks by whole segments, each with its spares; phalanx.core.elastic_units.)
    if spec.roles:
        problems.append("an elastic gang (min_replicas) cannot have roles: each role's size is fixed")
    if spec.mig_profile or spec.gpu_milli:
        problems.append("an elastic gang (min_replicas) takes whole GPUs: not a MIG profile or a GPU share")
    if spec.segment > 0 and low % spec.segment:
        problems.append(
            f"min_replicas {low} is not a multiple of segment {spec.segment}: an elastic gang with segments grows and "
            "shrinks by whole segments (--replicas MIN:MAX wants MIN and MAX multiples of --segment)"
        )
    if spec.start_order not in ("", "any"):
        problems.append(f"an elastic gang (min_replicas) starts all at once: not start_order {spec.start_order[:40]!r}")
    return problems


def smallest(spec: common_pb2.JobSpec) -> common_pb2.JobSpec:
    """The gang at its minimum size, for the checks of whether it could ever fit (an elastic gang whose maximum
    exceeds the cluster runs at what fits); `spec` itself when it is not elastic."""
    if not 0 < spec.min_replicas < spec.replicas:
        return spec
    small = common_pb2.JobSpec()
    small.CopyFrom(spec)
    small.replicas = spec.min_replicas
    return small


def shape_of_spec(spec: common_pb2.JobSpec) -> dict[str, Any]:
    """The job's `shape` keys for its elastic fields ({} when it is not elastic, or MIN equals MAX)."""
    if 0 < spec.min_replicas < spec.replicas:
        return {MIN_REPLICAS: spec.min_replicas}
    return {}


def shape_into_spec(shape: dict[str, Any], spec: common_pb2.JobSpec) -> None:
    """The elastic fields of a job's `shape` JSON back into its JobSpec."""
    low = shape.get(MIN_REPLICAS)
    if isinstance(low, int) and low > 0:
        spec.min_replicas = low
