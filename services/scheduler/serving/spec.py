"""What a service spec must be, beyond its replica template's job checks: every problem in words, before anything
is written (the servicer raises them as INVALID_ARGUMENT)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from phalanx.api.v1 import service_pb2

from ..serving_fields import NAME, normalize_roles

MAX_SERVICE_REPLICAS = 10_000


def name_problems(name: str) -> list[str]:
    if not NAME.match(name or ""):
        return [
            f"service name {name[:70]!r} must be 1-63 lowercase letters, digits or '-', starting and ending "
            "with a letter or digit"
        ]
    return []


def service_problems(spec: service_pb2.ServiceSpec, tier_names: Sequence[str]) -> list[str]:
    """What is wrong with a service spec beyond its template's job checks (servicer.validate_spec runs those)."""
    problems = name_problems(spec.name)
    if not 1 <= spec.replicas <= MAX_SERVICE_REPLICAS:
        problems.append(f"replicas must be 1-{MAX_SERVICE_REPLICAS}, got {spec.replicas}")
    if spec.spread_tier and spec.spread_tier not in tier_names:
        problems.append(
            f"spread_tier {spec.spread_tier[:60]!r} is not a tier of this cluster; valid tiers: {', '.join(tier_names)}"
        )
    surge = spec.max_surge if spec.HasField("max_surge") else 0
    unavailable = spec.max_unavailable if spec.HasField("max_unavailable") else 1
    if surge < 0 or unavailable < 0:
        problems.append("max_surge and max_unavailable cannot be negative")
    elif surge == 0 and unavailable == 0:
        problems.append("max_surge and max_unavailable cannot both be 0: a rolling update could never start")
    if not 0 <= spec.port <= 65535:
        problems.append(f"port must be 0-65535, got {spec.port}")
    if spec.template.restart not in ("", "always", "never", "none"):  # "": always; "none" is the CLI's never
        problems.append(f"restart {spec.template.restart[:30]!r} must be always or none (never)")
    if spec.template.time_limit_s:
        problems.append("a service's replicas run until stopped: time_limit_s must be 0")
    if spec.template.max_restarts:
        problems.append("a service's replicas restart by its restart policy: max_restarts must be 0")
    if spec.HasField("autoscale") and spec.autoscale.max_replicas:
        problems += autoscale_problems(spec)
    return problems


def autoscale_problems(spec: service_pb2.ServiceSpec) -> list[str]:
    from .autoscaling import policy_of

    a = spec.autoscale
    problems = policy_of(a).problems()
    if a.max_replicas > MAX_SERVICE_REPLICAS:
        problems.append(f"autoscale max must be at most {MAX_SERVICE_REPLICAS}, got {a.max_replicas}")
    if not 0 <= a.metrics_port <= 65535:
        problems.append(f"autoscale metrics_port must be 0-65535, got {a.metrics_port}")
    if a.metrics_path and not a.metrics_path.startswith("/"):
        problems.append(f"autoscale metrics_path {a.metrics_path[:60]!r} must start with '/'")
    if not (math.isfinite(a.period_s) and 0 <= a.period_s <= 3600):
        problems.append(f"autoscale period_s must be 0-3600 seconds, got {a.period_s}")
    return problems


__all__ = ["MAX_SERVICE_REPLICAS", "autoscale_problems", "name_problems", "normalize_roles", "service_problems"]
