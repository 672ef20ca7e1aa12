"""The operator's spare pools in the scheduler (issue 34, item 2; the pure rules are phalanx.core.pools).

A pool (`phalanx pool create NAME --tier nvlink --per-domain K`, CreatePool) keeps K whole nodes of each domain of
its tier out of normal work: `book_pools`, at the start of each scheduling pass, books an idle node per missing slot
(and drops a booked node that went down), writes the pool's row when its booking changed, and sets the capacity
index's `lending` set, which placement hides from every gang without a time limit. Backfill jobs with time limits
may borrow those nodes.

`pool_swap` is the fallback of spares.swap_or_teardown: a running gang that loses a node (or a GPU) and has no spare
of its own there takes a booked pool node of the dead node's domain, through the per-job swap path (spares.swap: one
transaction, a restart from the last committed checkpoint, no requeue). A borrower on that node is preempted at
once, without the checkpoint handshake: it is a backfill job that knew the terms. The node then belongs to the gang
and leaves the pool; the next pass books another idle node of the domain in its place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from phalanx.core.placement.tiers import domain_of, tier_level, tier_names
from phalanx.core.pools import Candidate, SparePool, choose_pool_node, lent, pool_problems, rebook
from phalanx.core.spares import SpareSlot
from services.common.errors import AlreadyExists, InvalidArgument, NotFound

from . import ledger
from .state import JobRecord, SchedulerState
from .transitions import Cycle, CycleCommand, teardown

log = structlog.get_logger()

CLUSTER_DOMAIN = "cluster"  # the one domain of the top tier


def pool_tiers(state: SchedulerState, fabric_tiers: tuple[str, ...]) -> list[str]:
    """The tiers a pool may name: "node", the fabric's tiers, "cluster"."""
    return tier_names(state.capacity, fabric_tiers)


def tier_domains(state: SchedulerState, tier: str, fabric_tiers: tuple[str, ...]) -> dict[str, list[str]] | None:
    """The domains of `tier` with their nodes (names sorted); None: no such tier."""
    capacity = state.capacity
    if tier not in pool_tiers(state, fabric_tiers):
        return None
    level = tier_level(capacity, tier, fabric_tiers)
    if level is None:
        return None
    top = capacity.levels()
    out: dict[str, list[str]] = {}
    for name in sorted(capacity.nodes):
        key = CLUSTER_DOMAIN if level >= top else domain_of(capacity.nodes[name], level)
        if key:
            out.setdefault(key, []).append(name)
    return out


def _holders(state: SchedulerState) -> dict[str, list[tuple[str, bool]]]:
    """node -> the running jobs holding GPUs there, each with whether it has a time limit."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for job in state.jobs.in_state("RUNNING").values():
        for node in {n for _, n, _ in (*job.allocations, *job.spares)}:
            out.setdefault(node, []).append((job.id, job.time_limit > 0))
    return out


def _candidates(state: SchedulerState, names: set[str]) -> dict[str, Candidate]:
    holders = _holders(state)
    out = {}
    for name in names:
        rec, cap = state.nodes.get(name), state.capacity.nodes.get(name)
        if rec is None or cap is None:
            continue
        usable = rec.schedulable and not rec.fatal_gpus
        idle = len(cap.free) == cap.total and not cap.mig and not cap.milli and not holders.get(name)
        out[name] = Candidate(name, usable, idle, tuple(holders.get(name, ())), cap.total)
    return out


def book_pools(cycle: Cycle) -> None:
    """Bring every pool's booking up to date (see phalanx.core.pools.rebook) and the index's `lending` with it."""
    state = cycle.state
    if not state.pools:
        if state.capacity.lending:
            state.capacity.lending = frozenset()
        return
    tiers = cycle.settings.fabric.tiers
    taken: set[str] = set()
    for name in sorted(state.pools):
        pool = state.pools[name]
        domains = tier_domains(state, pool.tier, tiers) or {}
        members = {n for nodes in domains.values() for n in nodes}
        booked = rebook(pool, domains, _candidates(state, members), taken)
        taken |= {n for nodes in booked.values() for n in nodes}
        if booked != pool.booked:
            pool.booked = booked
            cycle.work.write(ledger.set_pool_booking, pool.name, booked, cycle.now)
            log.info("pool_booked", pool=pool.name, booked=booked)
    lending = frozenset(taken)
    if lending != state.capacity.lending:
        state.capacity.lending = lending
        state.pass_due = True


def pool_swap(cycle: Cycle, job: JobRecord, dead: str, swap: Callable[..., None], *, cause: str, message: str) -> bool:
    """Swap a pool node of the dead node's domain in for the gang's replicas on `dead` (`swap`: spares.swap, the
    per-job swap path, handed in), preempting the node's borrowers at once. False (nothing changed): no pool holds
    a node that fits there."""
    state = cycle.state
    if not state.pools or job.state != "RUNNING" or job.preempted_by or job.partials or job.mig_profile:
        return False
    hit = sorted(r for r, n, _ in job.allocations if n == dead)
    if not hit or job.gpu_milli:
        return False
    g = job.gpus_per_replica
    tiers = cycle.settings.fabric.tiers
    domains: dict[str, dict[str, str]] = {}
    for pool in state.pools.values():
        for domain, nodes in (tier_domains(state, pool.tier, tiers) or {}).items():
            if dead in nodes:
                domains.setdefault(pool.tier, {})[dead] = domain
    holders = _holders(state)
    free = {}
    for pool in state.pools.values():
        for node in pool.nodes():
            rec, cap = state.nodes.get(node), state.capacity.nodes.get(node)
            if rec is None or cap is None or not rec.schedulable or cap.mig_gpus or cap.foreign:
                continue
            if job.gpu_model and job.gpu_model.lower() not in cap.gpu_model.lower():
                continue
            if any(not limited for j, limited in holders.get(node, ()) if j != job.id):
                continue  # never preempt a job without a time limit (not a borrower)
            # GPUs still held for an ended attempt (releasing) are not the swap's to take: count them out before
            # any borrower is preempted for nothing.
            releasing = {g for gpus in rec.releasing.values() for g in gpus}
            free[node] = cap.total - len(rec.fatal_gpus | releasing)
    got = choose_pool_node(state.pools.values(), domains, dead, len(hit) * g, free)
    if got is None:
        return False
    pool, node = got
    for borrower_id, _ in holders.get(node, ()):
        borrower = state.jobs.get(borrower_id)
        if borrower is not None and borrower.id != job.id:
            preempt_borrower(cycle, borrower, node, pool.name, job.id)
    cap = state.capacity.nodes[node]
    whole = sorted(cap.free - state.nodes[node].fatal_gpus)
    if len(whole) < len(hit) * g:  # GPUs still held (a release under way): not usable now
        return False
    domain = next(d for d, nodes in pool.booked.items() if node in nodes)
    chosen: dict[int, SpareSlot] = {}
    for i, replica in enumerate(hit):
        gpus = tuple(whole[i * g : (i + 1) * g])
        state.capacity.take(node, gpus)
        if job.cpu_milli or job.memory:
            state.capacity.take_use(node, job.cpu_milli, job.memory)
        chosen[replica] = SpareSlot(-1, -1, domain, node, gpus)
    # The node is the gang's now: out of the pool (the next pass books another idle node of the domain).
    pool.booked = {d: [n for n in nodes if n != node] for d, nodes in pool.booked.items()}
    cycle.work.write(ledger.set_pool_booking, pool.name, pool.booked, cycle.now)
    state.capacity.lending = frozenset(state.capacity.lending - {node})
    state.pass_due = True
    swap(cycle, job, dead, chosen, cause=cause, message=message, pool=pool.name)
    return True


def preempt_borrower(cycle: Cycle, borrower: JobRecord, node: str, pool: str, by: str) -> None:
    """Stop a backfill job borrowing pool node `node` at once, with no checkpoint handshake, and requeue it. Its GPUs
    are free in this very cycle, even on a node whose agent confirms releases: the swap takes them now."""
    rec = cycle.state.nodes.get(node)
    confirms = rec.confirms_release if rec is not None else False
    if rec is not None:
        rec.confirms_release = False
    try:
        teardown(
            cycle,
            borrower,
            cause="PREEMPTED",
            message=f"preempted at once: node {node} of spare pool {pool}, which it borrowed, is needed by job {by}",
        )
    finally:
        if rec is not None:
            rec.confirms_release = confirms
    cycle.metrics.preempted.append((borrower.id, by))
    log.warning("pool_borrower_preempted", job=borrower.id, node=node, pool=pool, by=by)


@dataclass
class CreatePool(CycleCommand):
    """An admin creates a spare pool; bad input is refused before anything is written."""

    name: str
    tier: str
    per_domain: int

    def execute(self, cycle: Cycle) -> SparePool:
        state, tiers = cycle.state, cycle.settings.fabric.tiers
        domains = tier_domains(state, self.tier, tiers)
        problems = pool_problems(self.name, self.tier, self.per_domain, domains, pool_tiers(state, tiers))
        if problems:
            raise InvalidArgument("invalid pool: " + "; ".join(problems))
        if self.name in state.pools:
            raise AlreadyExists(f"pool {self.name!r} already exists")
        pool = SparePool(self.name, self.tier, self.per_domain, cycle.now, {})
        cycle.work.write(ledger.insert_pool, pool, cycle.now)
        state.pools[pool.name] = pool
        state.pass_due = True
        log.info("pool_created", pool=pool.name, tier=pool.tier, per_domain=pool.per_domain)
        return pool


@dataclass
class DeletePool(CycleCommand):
    name: str

    def execute(self, cycle: Cycle) -> str:
        pool = cycle.state.pools.get(self.name)
        if pool is None:
            raise NotFound(f"no pool {self.name[:64]!r}")
        cycle.work.write(ledger.delete_pool, self.name)
        del cycle.state.pools[self.name]
        cycle.state.capacity.lending = frozenset(cycle.state.capacity.lending - pool.nodes())
        cycle.state.pass_due = True
        log.info("pool_deleted", pool=self.name)
        return self.name


def pool_status(state: SchedulerState, pool: SparePool, fabric_tiers: tuple[str, ...]) -> dict[str, Any]:
    """A pool as `phalanx pool list` shows it: per domain, the nodes booked, those lent (with their borrowers), and
    how many are missing."""
    holders = {n: [j for j, _ in hs] for n, hs in _holders(state).items()}
    borrowed = lent(pool, holders)
    domains = tier_domains(state, pool.tier, fabric_tiers) or {}
    rows = []
    for domain in sorted(set(domains) | set(pool.booked)):
        booked = list(pool.booked.get(domain, ()))
        rows.append(
            dict(
                domain=domain,
                booked=booked,
                lent={n: borrowed[n] for n in booked if n in borrowed},
                missing=max(0, pool.per_domain - len(booked)),
            )
        )
    return dict(name=pool.name, tier=pool.tier, per_domain=pool.per_domain, created_at=pool.created_at, domains=rows)


def pool_statuses(state: SchedulerState, fabric_tiers: tuple[str, ...], name: str = "") -> list[Mapping[str, Any]]:
    return [pool_status(state, state.pools[n], fabric_tiers) for n in sorted(state.pools) if not name or n == name]
