"""The live scheduler's history, read back from its ledger as `phalanx.core.invariants` events.

`history_from_ledger(engine_or_url)` turns what the ledger keeps into the time-ordered event list that
`invariants.check` judges (tests/e2e/test_chaos_invariants.py runs it on a chaos run of real processes):

- `Cluster`: the nodes (`nodes.gpus`) and the GPUs in MIG mode (`gpus.mig_mode` ENABLED, as registered last), just
  before the first event.
- `Submitted`: `jobs.submitted_at`, priority, queue, shape; `demand` as quota.demand computes it; `fits_empty`
  from a placement of the gang on the empty cluster (every node up, MIG modes as they are now).
- `Started`: `job_attempts.reserved_at`, with the holds of the attempt's `allocations` rows (whole GPUs, a MIG
  instance's memory slices gathered into its mask, shares with their thousandths; the `hold` rows of split GPUs
  left out); `flavor` is the job's (the ledger keeps only its last).
- `Ended`: `job_attempts.ended_at` and `outcome`; `held`: the nodes where the attempt's whole-GPU rows were
  released after it ended (or not yet): its processes there were still exiting (the clean GPU handover).
- `Released`: per held node, the latest `released_at` of the attempt's rows there.
- `Finished`: `jobs.finished_at` of a job in a final state.
- `ClaimMade` / `ClaimEnded`: the `claims` rows (`created_at`, `replicas`, `victims`; `ended_at`, `end_reason`). A
  claim ended because it was "replaced by a new claim" is not ended for the checker: the replacement, made in the
  same decision, takes its place.
- `Asked`: a claim names its preemptor's victims, the earlier ones included when it replaces another, so a victim
  is asked where a claim first names the attempt of it that runs then (`reclaim`: the victim's priority is not below
  its preemptor's, the only way decide evicts such a gang). A preemption without a claim (a scheduler run with
  `--no-claims`, or the attempts of before claims) leaves only `job_attempts.preempted_by` and the end: its ask is
  then placed `grace_s` before the end (when given; else at the end itself), not before the attempt's start. The
  ledger does not keep an ask that was called off (its preemptor found room elsewhere) without a claim.
- `NodeDown`: a node event of kind LOST. `NodeUp`: its agent registered again: the first `ledger_changes` row after
  the loss that names the node (its registration rewrote the row), or, when those rows are gone (kept ten minutes),
  the first release or reservation of its GPUs after the loss (a later bound than the truth).
- `GpusLost`: a node event of severity FATAL naming a GPU; `MigMode`: a node event of kind mig_mode.
- Spares kept in the domain: `Submitted.spares` from `jobs.shape`; a `Started` of such a gang carries its spares
  (the rows of negative replicas: slot -1 - replica, segment slot // K) apart from its ranks. A swap (the scheduler
  re-labels the rows and moves them to the next attempt) is not rebuilt from the ledger: judge a history with swaps
  on the model world (phalanx.testing.world), not here.
- `Quiet`: at `quiet_at`, when the caller knows when arrivals and failures stopped (the ledger does not).

What the ledger does not keep, and so is not in the history: the decisions' backfill reservations (`Reserved`: the
job's message says it in words, overwritten at each decision), GPUs repaired (`GpusBack`), and asks called off.

Events of one instant (one scheduling cycle writes everything with its one `now`) are ordered as a cycle makes them:
nodes lost, attempts that ended by themselves (and their jobs finished), releases confirmed, nodes back; then the
decision: victims stopped, claims ended, reservations (starts), claims made, victims asked. An ask and the stop of
the same attempt at one instant (a zero grace period) keep that order.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine

from phalanx.core import invariants as inv
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.mig import MEDIA_BIT, is_media
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import place_gang
from phalanx.core.quota import demand

__all__ = ["StartRecord", "history_from_ledger", "starts_from_ledger"]

FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")

# The order of events of one instant (see the module docstring).
_NODE_DOWN, _ENDED, _FINISHED, _RELEASED, _NODE_UP = 0, 1, 2, 3, 4
_ASKED_BEFORE_STOP, _STOPPED = 5, 6
_CLAIM_ENDED, _STARTED, _CLAIM_MADE, _ASKED, _QUIET = 7, 8, 9, 10, 11
_SUBMITTED = -1  # a job submitted in the cycle that starts it comes first


def _engine(engine_or_url: Engine | str) -> tuple[Engine, bool]:
    if isinstance(engine_or_url, Engine):
        return engine_or_url, False
    url = str(engine_or_url)
    for bare in ("postgresql://", "postgres://"):
        if url.startswith(bare):
            url = "postgresql+psycopg://" + url[len(bare) :]
    return create_engine(url), True


def _json(value: Any) -> Any:
    if isinstance(value, str | bytes):
        return json.loads(value or "null")
    return value


def _json_dict(value: Any) -> dict[str, Any]:
    """A JSON column read through plain SQL: a dict on PostgreSQL, its text on SQLite."""
    if isinstance(value, str):
        value = json.loads(value or "{}")
    return value if isinstance(value, dict) else {}


def _rows(conn: Connection, sql: str, **params: Any) -> list[Any]:
    return list(conn.execute(text(sql), params))


def _has_table(conn: Connection, name: str) -> bool:
    if conn.dialect.name == "sqlite":
        sql = "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = :n"
    else:
        sql = "SELECT count(*) FROM information_schema.tables WHERE table_name = :n"
    return bool(conn.execute(text(sql), dict(n=name)).scalar())


@dataclass(frozen=True)
class StartRecord:
    """One attempt's start as the ledger holds it: for start-order comparisons (the simulator's replay)."""

    t: float
    job: str
    name: str
    attempt: int


def starts_from_ledger(engine_or_url: Engine | str) -> list[StartRecord]:
    """Every attempt's start (reservation), in time order (then job id)."""
    engine, own = _engine(engine_or_url)
    try:
        with engine.connect() as conn:
            rows = _rows(
                conn,
                "SELECT a.reserved_at, a.job_id, j.name, a.attempt FROM job_attempts a JOIN jobs j ON j.id = a.job_id "
                "ORDER BY a.reserved_at, a.job_id, a.attempt",
            )
    finally:
        if own:
            engine.dispose()
    return [StartRecord(float(t), job, name, int(attempt)) for t, job, name, attempt in rows]


def history_from_ledger(
    engine_or_url: Engine | str,
    *,
    grace_s: float | None = None,
    quiet_at: float | None = None,
    tiers: Iterable[str] = (),
) -> list[inv.Event]:
    """The ledger's history as `invariants` events in time order (see the module docstring).

    `grace_s`: the scheduler's preemption grace, to place the asks no claim recorded; `quiet_at`: when arrivals and
    failures stopped (a `Quiet` event then); `tiers`: the fabric's tier names (for `fits_empty` of gangs that
    require one)."""
    engine, own = _engine(engine_or_url)
    try:
        with engine.connect() as conn:
            return _history(conn, grace_s, quiet_at, tuple(tiers))
    finally:
        if own:
            engine.dispose()


class _Events:
    """The history being built: events with their rank within an instant and the order they were added in (what
    breaks ties between events of the same instant and rank)."""

    def __init__(self) -> None:
        self.out: list[tuple[float, int, int, inv.Event]] = []  # (t, rank within the instant, sequence, event)

    def add(self, t: float, rank: int, event: inv.Event) -> None:
        self.out.append((t, rank, len(self.out), event))

    def in_order(self) -> list[tuple[float, int, int, inv.Event]]:
        return sorted(self.out, key=lambda e: (e[0], e[1], e[2]))


@dataclass
class _Allocations:
    """The attempts' GPUs as the allocations rows hold them."""

    holds: dict[tuple[str, int], list[inv.Hold]]  # (job, attempt) -> what it held
    whole_release: dict[tuple[str, int, str], list[float | None]]  # (job, attempt, node) -> its whole GPUs' releases
    reserved_on: dict[str, list[float]]  # node -> reservations there
    released_on: dict[str, list[float]]  # node -> releases there
    ranks: dict[tuple[str, int], dict[int, str]] = field(default_factory=dict)  # (job, attempt) -> replica -> node
    spare_holds: dict[tuple[str, int], list[inv.Hold]] = field(default_factory=dict)  # ... the spares' GPUs


def _history(
    conn: Connection, grace_s: float | None, quiet_at: float | None, tiers: tuple[str, ...]
) -> list[inv.Event]:
    events = _Events()
    nodes, models, mig = _nodes_and_gpus(conn)
    jobs = _submissions(conn, events, _empty_capacity(nodes, models, mig), tiers)
    allocations = _allocations(conn, nodes)
    attempts, by_job = _attempts(conn)
    _claims_and_asks(conn, events, jobs, attempts, by_job, grace_s)
    _starts_ends_releases(events, jobs, attempts, allocations)
    _node_events(conn, events, nodes, allocations)
    if quiet_at is not None:
        events.add(quiet_at, _QUIET, inv.Quiet(quiet_at))
    out = events.in_order()
    first = out[0][0] if out else 0.0
    cluster = inv.Cluster(first, {name: count for name, count in nodes.values()}, mig, tiers, _domains(conn, tiers))
    return [cluster, *(e for _, _, _, e in out)]


def _domains(conn: Connection, tiers: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Per tier, each node's domain of it (from its fabric path), for invariant (h)."""
    out: dict[str, dict[str, str]] = {tier: {} for tier in tiers}
    out["node"] = {}
    for name, path in _rows(conn, "SELECT name, fabric_path FROM nodes"):
        out["node"][str(name)] = str(name)
        for tier, domain in zip(tiers, _json(path) or (), strict=False):
            out[tier][str(name)] = str(domain)
    return out


def _nodes_and_gpus(
    conn: Connection,
) -> tuple[dict[int, tuple[str, int]], dict[int, tuple[str, int]], frozenset[tuple[str, int]]]:
    """(node id -> (name, GPUs), node id -> (GPU model, memory MiB), the GPUs in MIG mode as (node, index))."""
    nodes: dict[int, tuple[str, int]] = {}
    for node_id, name, count in _rows(conn, "SELECT id, name, gpus FROM nodes ORDER BY name"):
        nodes[int(node_id)] = (str(name), int(count))
    gpu_rows = _rows(conn, 'SELECT node_id, "index", name, memory_mib, mig_mode FROM gpus')
    mig = frozenset(
        (nodes[int(n)][0], int(i)) for n, i, _, _, mode in gpu_rows if mode == "ENABLED" and int(n) in nodes
    )
    models: dict[int, tuple[str, int]] = {}
    for n, _, model, memory, _ in gpu_rows:
        models.setdefault(int(n), (str(model or ""), int(memory or 0)))
    return nodes, models, mig


def _submissions(
    conn: Connection, events: _Events, empty: ClusterCapacity, tiers: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """The jobs rows by id (each with its `request`), and a `Submitted` event for each."""
    jobs: dict[str, dict[str, Any]] = {}
    for row in _rows(
        conn,
        "SELECT id, state, priority, queue, replicas, gpus_per_replica, mig_profile, gpu_milli, submitted_at, "
        "finished_at, required_tier, gpu_model, flavor, serving, shape FROM jobs",
    ):
        jobs[row.id] = dict(row._mapping)
    for job_id, j in jobs.items():
        request = GangRequest(
            job_id,
            int(j["replicas"]),
            1 if (j["mig_profile"] or j["gpu_milli"]) else int(j["gpus_per_replica"]),
            int(j["priority"]),
            float(j["submitted_at"]),
            required_tier=j["required_tier"] or "",
            gpu_model=j["gpu_model"] or "",
            mig_profile=j["mig_profile"] or "",
            gpu_milli=int(j["gpu_milli"] or 0),
            segment=int(_json_dict(j.get("shape")).get("segment") or 0),
            segment_tier=str(_json_dict(j.get("shape")).get("segment_tier") or ""),
            min_replicas=int(_json_dict(j.get("shape")).get("min_replicas") or 0),  # an elastic gang (h)
        )
        j["request"] = request
        fits = isinstance(place_gang(empty, request, tiers, budget_ms=0.0), Placement)
        events.add(
            float(j["submitted_at"]),
            _SUBMITTED,
            inv.Submitted(
                float(j["submitted_at"]),
                job_id,
                int(j["priority"]),
                j["queue"] or "default",
                request.replicas,
                request.gpus_per_replica,
                demand(request),
                fits,
                not _json_dict(j.get("serving")).get("surge"),
                request.segment,
                request.segment_tier,
                int(_json_dict(j.get("shape")).get("spares_per_segment") or 0),
                request.min_replicas if request.elastic else 0,
            ),
        )
    return jobs


def _allocations(conn: Connection, nodes: dict[int, tuple[str, int]]) -> _Allocations:
    """What each attempt held (whole GPUs, MIG instances gathered into their masks, shares), when its whole GPUs
    were released per node, and the reservations and releases on each node."""
    holds: dict[tuple[str, int], list[inv.Hold]] = defaultdict(list)
    mig_parts: dict[tuple[str, int, int, str, int], tuple[int, str]] = {}  # (job, attempt, replica, node, gpu)
    whole_release: dict[tuple[str, int, str], list[float | None]] = defaultdict(list)  # (job, attempt, node)
    reserved_on: dict[str, list[float]] = defaultdict(list)  # node -> reservations there
    released_on: dict[str, list[float]] = defaultdict(list)  # node -> releases there
    ranks: dict[tuple[str, int], dict[int, str]] = {}  # (job, attempt) -> replica -> node
    spare_holds: dict[tuple[str, int], list[inv.Hold]] = {}
    for job_id, attempt, replica, node_id, gpu, kind, unit, profile, milli, reserved, released in _rows(
        conn,
        "SELECT job_id, attempt, replica, node_id, gpu_index, kind, unit, profile, gpu_milli, reserved_at, released_at "
        "FROM allocations WHERE kind != 'hold' ORDER BY job_id, attempt, replica, gpu_index, unit",
    ):
        node = nodes.get(int(node_id), (f"node#{node_id}", 0))[0]
        key = (job_id, int(attempt))
        ranks.setdefault(key, {})[int(replica)] = node
        reserved_on[node].append(float(reserved))
        if released is not None:
            released_on[node].append(float(released))
        if kind == "gpu":
            holds[key].append(inv.Hold(node, int(gpu)))
            if int(replica) < 0:  # a spare kept in the domain
                spare_holds.setdefault(key, []).append(inv.Hold(node, int(gpu)))
            whole_release[(job_id, int(attempt), node)].append(None if released is None else float(released))
        elif kind == "mig":
            part = (job_id, int(attempt), int(replica), node, int(gpu))
            mask, _ = mig_parts.get(part, (0, ""))
            mig_parts[part] = (mask | (1 << int(unit)), str(profile or ""))
        elif kind == "share":
            holds[key].append(inv.Hold(node, int(gpu), milli=int(milli or 0)))
    for (job_id, attempt, _replica, node, gpu), (mask, profile) in sorted(mig_parts.items()):
        holds[(job_id, attempt)].append(inv.Hold(node, gpu, mig_mask=mask | (MEDIA_BIT if is_media(profile) else 0)))
    return _Allocations(holds, whole_release, reserved_on, released_on, ranks, spare_holds)


def _attempts(
    conn: Connection,
) -> tuple[dict[tuple[str, int], dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """The job_attempts rows by (job, attempt), and each job's in attempt order."""
    attempts: dict[tuple[str, int], dict[str, Any]] = {}
    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in _rows(
        conn,
        "SELECT job_id, attempt, reserved_at, ended_at, outcome, preempted_by FROM job_attempts "
        "ORDER BY job_id, attempt",
    ):
        a = dict(row._mapping)
        attempts[(row.job_id, int(row.attempt))] = a
        by_job[row.job_id].append(a)
    return attempts, by_job


def _claims_and_asks(
    conn: Connection,
    events: _Events,
    jobs: dict[str, dict[str, Any]],
    attempts: dict[tuple[str, int], dict[str, Any]],
    by_job: dict[str, list[dict[str, Any]]],
    grace_s: float | None,
) -> None:
    """`ClaimMade` and `ClaimEnded` from the claims rows, then the victims' `Asked`: where a claim first names the
    attempt of a victim that runs then, and, for preemptions no claim recorded, `grace_s` before the end."""
    asked: set[tuple[str, int]] = set()  # victims' attempts asked (by a claim)
    asks: list[tuple[float, str, int, str]] = []  # (t, victim, attempt, by)
    claims_by_job: dict[str, list[Any]] = defaultdict(list)
    if _has_table(conn, "claims"):
        for row in _rows(
            conn,
            "SELECT id, job_id, replicas, victims, created_at, ended_at, end_reason FROM claims "
            "ORDER BY created_at, id",
        ):
            claims_by_job[row.job_id].append(row)
    for job_id, rows in claims_by_job.items():
        chain: dict[str, int] = {}  # victim -> the attempt this chain of replacements asked
        replaced = False
        for row in rows:
            t = float(row.created_at)
            victims = tuple(str(v) for v in _json(row.victims) or ())
            events.add(t, _CLAIM_MADE, inv.ClaimMade(t, job_id, _claim_holds(_json(row.replicas) or ()), victims))
            if not replaced:
                chain = {}
            for victim in victims:
                running = _running_at(by_job.get(victim, ()), t, job_id)
                if running is None or chain.get(victim) == running:
                    continue
                chain[victim] = running
                asks.append((t, victim, running, job_id))
                asked.add((victim, running))
            replaced = row.end_reason == "replaced by a new claim"
            if row.ended_at is not None and not replaced:
                events.add(
                    float(row.ended_at), _CLAIM_ENDED, inv.ClaimEnded(float(row.ended_at), job_id, row.end_reason or "")
                )
    # Preemptions no claim recorded: asked `grace_s` before the end (at the end without it).
    for (job_id, attempt), a in attempts.items():
        if a["outcome"] == "PREEMPTED" and a["preempted_by"] and (job_id, attempt) not in asked and a["ended_at"]:
            end = float(a["ended_at"])
            t = max(float(a["reserved_at"]), end - grace_s) if grace_s is not None else end
            asks.append((t, job_id, attempt, a["preempted_by"]))
    for t, victim, attempt, by in asks:
        a = attempts[(victim, attempt)]
        stops_now = a["ended_at"] is not None and float(a["ended_at"]) == t
        vp, bp = int(jobs[victim]["priority"]), int(jobs[by]["priority"]) if by in jobs else math.inf
        events.add(t, _ASKED_BEFORE_STOP if stops_now else _ASKED, inv.Asked(t, victim, attempt, by, reclaim=vp >= bp))


def _starts_ends_releases(
    events: _Events,
    jobs: dict[str, dict[str, Any]],
    attempts: dict[tuple[str, int], dict[str, Any]],
    allocations: _Allocations,
) -> None:
    """Each attempt's `Started`, `Ended` (with the nodes it still held) and `Released` per held node; each final
    job's `Finished`."""
    holds, whole_release = allocations.holds, allocations.whole_release
    for (job_id, attempt), a in attempts.items():
        job = jobs.get(job_id)
        if job is None:
            continue
        gang: GangRequest = job["request"]
        got = holds.get((job_id, attempt), ())
        # (an elastic gang's attempt has the size it was placed at: invariant h judges it)
        expected = len(got) if gang.elastic else gang.replicas * gang.gpus_per_replica
        t0 = float(a["reserved_at"])
        placed = allocations.ranks.get((job_id, attempt), {}) if gang.segment else {}
        per = int(_json_dict(job.get("shape")).get("spares_per_segment") or 0)
        spares = tuple(((-1 - r) // per, n) for r, n in sorted(placed.items(), reverse=True) if r < 0) if per else ()
        if not gang.elastic:
            expected = (gang.replicas + len(spares)) * gang.gpus_per_replica
        events.add(
            t0,
            _STARTED,
            inv.Started(
                t0,
                job_id,
                attempt,
                tuple(got),
                expected,
                job["flavor"] or "",
                tuple(node for r, node in sorted(placed.items()) if r >= 0),
                spares,
                tuple(allocations.spare_holds.get((job_id, attempt), ())),
            ),
        )
        if a["ended_at"] is None:
            continue
        end = float(a["ended_at"])
        held: list[str] = []
        for (jid, att, node), released in sorted(whole_release.items()):
            if (jid, att) != (job_id, attempt):
                continue
            if any(r is None or r > end for r in released):
                held.append(node)
                if all(r is not None for r in released):
                    last = max(r for r in released if r is not None)
                    events.add(last, _RELEASED, inv.Released(last, job_id, attempt, node))
        preempted = a["outcome"] == "PREEMPTED"
        events.add(
            end, _STOPPED if preempted else _ENDED, inv.Ended(end, job_id, attempt, a["outcome"] or "", tuple(held))
        )
    for job_id, j in jobs.items():
        if j["state"] in FINAL_STATES and j["finished_at"]:
            t = float(j["finished_at"])
            events.add(t, _FINISHED, inv.Finished(t, job_id, j["state"]))


def _node_events(
    conn: Connection, events: _Events, nodes: dict[int, tuple[str, int]], allocations: _Allocations
) -> None:
    """Nodes lost (`NodeDown`) and back (`NodeUp`: the first sign of the node after the loss), GPU failures
    (`GpusLost`) and MIG mode switches (`MigMode`), from the node events."""
    names = {node_id: name for node_id, (name, _) in nodes.items()}
    changes: list[tuple[float, set[int]]] = []
    if _has_table(conn, "ledger_changes"):
        for at, body in _rows(conn, "SELECT at, body FROM ledger_changes ORDER BY at"):
            try:
                changes.append((float(at), {int(n) for n in json.loads(body).get("nodes", ())}))
            except (ValueError, TypeError):
                continue
    lost: dict[str, list[float]] = defaultdict(list)
    for node_id, at, gpu, severity, kind, code in _rows(
        conn, "SELECT node_id, at, gpu, severity, kind, code FROM node_events ORDER BY at, id"
    ):
        name = names.get(int(node_id))
        if name is None:
            continue
        at = float(at)
        if kind == "LOST":
            events.add(at, _NODE_DOWN, inv.NodeDown(at, name))
            lost[name].append(at)
        elif kind == "mig_mode":
            events.add(at, _NODE_UP, inv.MigMode(at, name, int(gpu), bool(code)))
        elif severity == "FATAL" and int(gpu) >= 0:
            events.add(at, _NODE_DOWN, inv.GpusLost(at, name, (int(gpu),)))
    for name, times in lost.items():
        node_id = next(i for i, n in names.items() if n == name)
        for k, at in enumerate(times):
            upto = times[k + 1] if k + 1 < len(times) else math.inf
            candidates = [t for t, ids in changes if at < t < upto and node_id in ids]
            candidates += [t for t in allocations.released_on.get(name, ()) if at < t < upto]
            candidates += [t for t in allocations.reserved_on.get(name, ()) if at < t < upto]
            if candidates:
                back = min(candidates)
                events.add(back, _NODE_UP, inv.NodeUp(back, name))


def _running_at(attempts: Iterable[dict[str, Any]], t: float, by: str) -> int | None:
    """The victim's attempt running at `t` (one that stops at `t` for `by` counts: a zero grace period)."""
    for a in attempts:
        start, end = float(a["reserved_at"]), a["ended_at"]
        if start <= t and (end is None or float(end) > t or (float(end) == t and a["preempted_by"] == by)):
            return int(a["attempt"])
    return None


def _claim_holds(replicas: Iterable[dict[str, Any]]) -> tuple[inv.Hold, ...]:
    out: list[inv.Hold] = []
    for r in replicas:
        profile = str(r.get("mig_profile", "") or "")
        size, start = int(r.get("mig_size", 0) or 0), int(r.get("mig_start", -1))
        mask = (((1 << size) - 1) << start | (MEDIA_BIT if is_media(profile) else 0)) if profile else 0
        for g in r.get("gpus", ()):
            out.append(inv.Hold(str(r["node"]), int(g), mig_mask=mask, milli=int(r.get("gpu_milli", 0) or 0)))
    return tuple(out)


def _empty_capacity(
    nodes: dict[int, tuple[str, int]], models: dict[int, tuple[str, int]], mig: frozenset[tuple[str, int]]
) -> ClusterCapacity:
    caps = []
    for node_id, (name, count) in nodes.items():
        in_mig = frozenset(g for n, g in mig if n == name)
        model, memory = models.get(node_id, ("", 0))
        caps.append(
            NodeCapacity(
                name,
                count,
                set(range(count)) - in_mig,
                True,
                (),
                None,
                model,
                memory,
                mig_gpus=in_mig,
            )
        )
    return ClusterCapacity(caps)
