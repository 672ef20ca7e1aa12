"""The serving autoscaler's rule: how many replicas a service wants from a metric, the way the Kubernetes
Horizontal Pod Autoscaler decides (pure: no I/O, no clock; the scheduler's service controller and the simulator
both call it).

One step (`recommend`):
1. The metric is averaged over the replicas that reported it (the ready ones); the raw recommendation is
   ceil(current x average / target), as HPA's `desiredReplicas = ceil[currentReplicas x currentMetric /
   desiredMetric]`. Within `tolerance` of the target (HPA's default 10%) it is the current count.
2. Stabilization, as HPA's `behavior`: every raw recommendation is kept with its time; a scale down takes the
   highest recommendation of the last `scale_down_window_s` (HPA default 300 s), a scale up the lowest of the last
   `scale_up_window_s` (HPA default 0 s). A brief dip does not drop replicas that a returning load needs, and a
   spike must last to add them when the up window is set.
3. The result is clamped to [min_replicas, max_replicas].

With no values (no replica ready, no push yet) the count stays where it is: scaling on no data would flap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    """Scale within [min_replicas, max_replicas] so that `metric` averages `target` per ready replica."""

    min_replicas: int
    max_replicas: int
    metric: str
    target: float
    tolerance: float = 0.1
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0

    def problems(self) -> list[str]:
        """What is wrong with the policy, in words (empty: nothing)."""
        out = []
        if self.min_replicas < 1:
            out.append(f"autoscale min must be at least 1, not {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            out.append(f"autoscale max ({self.max_replicas}) is below its min ({self.min_replicas})")
        if not self.metric:
            out.append("autoscale needs a metric name")
        if not (self.target > 0 and math.isfinite(self.target)):
            out.append(f"autoscale target must be a positive number, not {self.target}")
        if not 0 <= self.tolerance < 1:
            out.append(f"autoscale tolerance must be in [0, 1), not {self.tolerance}")
        if self.scale_up_window_s < 0 or self.scale_down_window_s < 0:
            out.append("autoscale stabilization windows cannot be negative")
        return out


@dataclass(slots=True)
class AutoscaleState:
    """What the rule remembers between steps: its raw recommendations with their times (oldest first)."""

    history: list[tuple[float, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Recommendation:
    replicas: int
    raw: int  # before stabilization and bounds
    average: float | None  # the metric's average over the reporting replicas (None: no data)
    reason: str


def raw_recommendation(policy: AutoscalePolicy, current: int, values: Sequence[float]) -> tuple[int, float | None]:
    """HPA's step 1: ceil(current x average / target), or `current` within the tolerance or with no data."""
    if not values:
        return current, None
    average = sum(values) / len(values)
    ratio = average / policy.target
    if abs(ratio - 1.0) <= policy.tolerance:
        return current, average
    # A service scaled to zero ready replicas still reports a queue through the API: start from one.
    base = max(current, 1)
    return math.ceil(base * ratio - 1e-9), average


def recommend(
    policy: AutoscalePolicy, current: int, values: Sequence[float], now: float, state: AutoscaleState
) -> Recommendation:
    """The replica count to run now (see the module's doc); records the raw recommendation in `state`."""
    raw, average = raw_recommendation(policy, current, values)
    if average is None:
        return Recommendation(_clamp(policy, current), raw, None, "no metric reported yet: the count stays")
    horizon = max(policy.scale_up_window_s, policy.scale_down_window_s)
    state.history = [(t, r) for t, r in state.history if now - t <= horizon]
    state.history.append((now, raw))
    down = [r for t, r in state.history if now - t <= policy.scale_down_window_s]
    up = [r for t, r in state.history if now - t <= policy.scale_up_window_s]
    wanted = raw
    if raw < current:
        wanted = min(current, max(down))  # the highest of the down window: never below what it recently needed
    elif raw > current:
        wanted = max(current, min(up))  # the lowest of the up window: a spike must last the window
    replicas = _clamp(policy, wanted)
    reason = (
        f"{policy.metric} averages {average:g} per replica against a target of {policy.target:g}: "
        f"{raw} wanted, {replicas} after stabilization and bounds [{policy.min_replicas}, {policy.max_replicas}]"
    )
    return Recommendation(replicas, raw, average, reason)


def _clamp(policy: AutoscalePolicy, replicas: int) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, replicas))
