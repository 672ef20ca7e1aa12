"""Fairness against quotas, as the replay measures it: each tenant's quota weight, its weighted max-min
entitlement over what the tenants want (water-filling), Jain's index, and one equal quota per tenant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from phalanx.core.quota import DEFAULT_QUEUE, FlavorQuota, QueueSpec

from .cluster import Job


def _tenant(job: Any) -> str:
    return getattr(job, "tenant", "") or DEFAULT_QUEUE


def _quota_weights(tenants: Sequence[str], quotas: Mapping[str, QueueSpec] | None) -> dict[str, float]:
    """Each tenant's share of the quotas' nominal GPUs (no quotas: equal shares), as in the per-tenant metrics."""
    nominal = {n: sum(q.gpus for q in spec.quotas.values()) for n, spec in (quotas or {}).items()}
    all_nominal = sum(nominal.values())
    if not all_nominal:
        return {t: 1 / len(tenants) for t in tenants}
    return {t: nominal.get(t, 0.0) / all_nominal for t in tenants}


def _entitlement(want: Mapping[str, float], weight: Mapping[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair shares (water-filling) of `capacity` GPUs: each tenant gets capacity in proportion to
    its weight, never more than it wants; what one does not want goes to the others, again by weight."""
    out = dict.fromkeys(want, 0.0)
    # Water-filling in one sweep: tenants in order of want per weight; each either wants less than the common level
    # (and gets it all) or gets the level times its weight.
    order = sorted((want[t] / weight[t], t) for t in want if want[t] > 1e-9 and weight.get(t, 0.0) > 0)
    left, wsum = capacity, sum(weight[t] for _, t in order)
    for ratio, t in order:
        if left <= 1e-9 or wsum <= 0:
            break
        give = min(want[t], left / wsum * weight[t]) if ratio * wsum > left else want[t]
        out[t] = give
        left -= give
        wsum -= weight[t]
    return out


def _jain(values: Sequence[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2), 1 when all are equal, 1/n at worst."""
    square = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square) if values and square > 0 else float("nan")


def equal_quotas(jobs: Sequence[Job], total_gpus: int, cohort: str = "all") -> dict[str, QueueSpec]:
    """One queue per tenant with an equal share of the cluster as its nominal quota, all in one cohort (idle quota is
    lent, and reclaimed when its owner needs it)."""
    tenants = sorted({getattr(j, "tenant", "") or DEFAULT_QUEUE for j in jobs})
    share = total_gpus / max(1, len(tenants))
    return {t: QueueSpec(t, {"*": FlavorQuota(gpus=share)}, cohort=cohort) for t in tenants}
