"""A service's replica plan: which replica gangs to start and which to stop so that K replicas of the current
revision run, the way a Kubernetes Deployment rolls out (pure: the scheduler's service controller and the simulator
call it with what runs now and apply what it returns).

The rules, each checked by tests/unit/test_rollout.py over random fleets:
- Steady state (every live replica is of the current revision): start replicas until K run, at the lowest free
  indices; stop the surplus, unready ones first, then the highest indices.
- Rolling update (some live replicas are of an older revision):
  - at most K + max_surge replicas live at once: new-revision replicas are started within that bound;
  - never fewer than K - max_unavailable ready: an old replica that is ready is stopped only while the ready count
    stays at or above that floor after it goes (an unready old replica serves nothing and may go at once);
  - old replicas go only as far as the new ones need room: live replicas never drop below K - max_unavailable.
- A replica started while K or more are live is a surge replica: the caller starts it as a gang that never preempts,
  so that when it does not fit it waits for an old replica's release instead of evicting running work (the
  deadlock of LeaderWorkerSet issues 717 and 1050: the surge evicts or waits for what must go first).
- Replicas that are down for good (`restart never`) keep their slots: they count towards K until the next revision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica gang as the plan sees it."""

    index: int
    revision: int
    key: str  # the caller's handle (a job id)
    ready: bool = False
    down: bool = False  # failed for good (restart never): keeps its slot, never restarted


@dataclass(frozen=True, slots=True)
class Start:
    index: int
    revision: int
    surge: bool


@dataclass(frozen=True, slots=True)
class Stop:
    key: str
    index: int
    reason: str


@dataclass(frozen=True, slots=True)
class FleetPlan:
    starts: tuple[Start, ...]
    stops: tuple[Stop, ...]
    message: str  # what the fleet does or waits for, in one sentence


def plan_fleet(
    replicas: Sequence[ReplicaView], desired: int, revision: int, *, max_surge: int = 0, max_unavailable: int = 1
) -> FleetPlan:
    """The starts and stops that move `replicas` towards `desired` replicas of `revision` (see the module's doc)."""
    live = [r for r in replicas if not r.down]
    held = sum(1 for r in replicas if r.down and r.revision == revision)  # slots down for good
    new = [r for r in live if r.revision == revision]
    old = [r for r in live if r.revision != revision]
    want_new = max(0, desired - held)
    used = {r.index for r in live} | {r.index for r in replicas if r.down and r.revision == revision}
    if not old:
        return _steady(new, want_new, used, revision, desired, held)
    floor = max(0, desired - max_unavailable)
    ceiling = desired + max_surge
    ready = sum(1 for r in live if r.ready)
    total = len(live)
    missing = max(0, want_new - len(new))
    indices = _free(used, min(missing, max(0, ceiling - total)))
    total += len(indices)
    # Old replicas go only as far as the new ones need: live replicas never fall below the floor.
    removable = max(0, total - floor)
    stops: list[Stop] = []
    for r in sorted((r for r in old if not r.ready), key=lambda r: -r.index):
        if len(stops) >= removable:
            break
        stops.append(Stop(r.key, r.index, f"replaced by revision {revision} (it was not ready)"))
    above_floor = ready - floor
    for r in sorted((r for r in old if r.ready), key=lambda r: -r.index):
        if len(stops) >= removable or above_floor <= 0:
            break
        stops.append(Stop(r.key, r.index, f"replaced by revision {revision}"))
        above_floor -= 1
    # A start is a surge when, with this step's stops gone, K or more replicas live beside it.
    base = len(live) - len(stops)
    starts = [Start(index, revision, surge=base + i >= desired) for i, index in enumerate(indices)]
    new_ready = sum(1 for r in new if r.ready)
    message = (
        f"rolling out revision {revision}: {new_ready} of {want_new} new replica(s) ready, {len(old)} old left "
        f"({ready} ready of at least {floor})"
    )
    if not starts and not stops:
        if total >= ceiling and ready <= floor:
            message += "; waits for new replicas to become ready before the next old one goes"
        elif len(new) > new_ready:
            message += "; waits for its new replicas to become ready"
    return FleetPlan(tuple(starts), tuple(stops), message)


def _steady(new: list[ReplicaView], want: int, used: set[int], revision: int, desired: int, held: int) -> FleetPlan:
    starts: list[Start] = []
    stops: list[Stop] = []
    if len(new) < want:
        starts = [Start(i, revision, surge=False) for i in _free(used, want - len(new))]
    elif len(new) > want:
        surplus = sorted(new, key=lambda r: (r.ready, -r.index))[: len(new) - want]
        stops = [Stop(r.key, r.index, f"scaled down to {desired} replica(s)") for r in surplus]
    ready = sum(1 for r in new if r.ready)
    message = f"{ready} of {desired} replica(s) ready at revision {revision}"
    if held:
        message += f"; {held} down for good (restart never) until the next revision"
    return FleetPlan(tuple(starts), tuple(stops), message)


def _free(used: set[int], count: int) -> list[int]:
    """The `count` lowest indices not in `used` (which it extends)."""
    out: list[int] = []
    i = 0
    while len(out) < count:
        if i not in used:
            out.append(i)
            used.add(i)
        i += 1
    return out
