"""The operator's spare pool (issue 34, item 2): `phalanx pool create NAME --tier nvlink --per-domain K` keeps K whole
nodes idle in each domain of a tier, for any running gang there that loses a node and has no spare of its own there.

Pure rules, no I/O (the scheduler's services/scheduler/pools.py applies them; tests call them directly):

- `pool_problems`: what is wrong with a pool definition, in words, before anything is written;
- `rebook`: which nodes a pool holds in each domain after a change: a booked node that went down, or that a job
  without a time limit now holds (the gang that swapped it in), leaves the pool; each missing one is replaced by an
  idle node of the domain (whole GPUs free, schedulable, in no other pool), the fewest-GPU-first then by name;
- `choose_pool_node`: the booked node of the dead node's domain that takes the dead node's replicas;
- `lent`: which booked nodes are lent, and to whom.

Lending: the capacity index's `lending` set (ClusterCapacity.lending) holds every booked pool node; a gang without a
time limit is placed on a view of the index less those nodes (ClusterCapacity.unlent; placement.gang.place_gang), a
gang with one there first and on the pool's nodes only when it fits nowhere else. So only backfill jobs with time
limits land there, and a swap that needs such a node preempts its borrower at once, with no checkpoint handshake.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

MAX_POOL_NAME = 64


@dataclass
class SparePool:
    """A pool: its tier, how many nodes per domain, and the nodes it books per domain now (domain -> nodes)."""

    name: str
    tier: str
    per_domain: int
    created_at: float = 0.0
    booked: dict[str, list[str]] = field(default_factory=dict)

    def nodes(self) -> set[str]:
        return {n for nodes in self.booked.values() for n in nodes}


def pool_problems(
    name: str,
    tier: str,
    per_domain: int,
    domains: Mapping[str, Collection[str]] | None,
    tier_names: Sequence[str],
    taken: Collection[str] = (),
) -> list[str]:
    """Every problem of a pool definition. `domains`: the tier's domains with their nodes (None: unknown tier);
    `tier_names`: the tiers a pool may name; `taken`: the names of the pools that exist."""
    out = []
    if not name or len(name) > MAX_POOL_NAME or not all(c.isalnum() or c in "-_." for c in name):
        out.append(f"pool name must be 1-{MAX_POOL_NAME} letters, digits, '-', '_' or '.', got {name[:80]!r}")
    if domains is None:
        out.append(f"unknown tier {tier!r}: the fabric's tiers are {', '.join(tier_names)}")
    if per_domain < 1:
        out.append(f"per_domain must be at least 1 node per domain, got {per_domain}")
    elif domains is not None:
        most = max((len(nodes) for nodes in domains.values()), default=0)
        if per_domain > most:
            out.append(
                f"per_domain {per_domain} is more than any domain of tier {tier!r} holds (the largest has {most} "
                "node(s))"
            )
    return out


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node as the pool sees it: whether it could serve a swap (`usable`: schedulable, no FATAL GPU), whether it
    is idle now (every GPU free, no partial use), who holds it (the jobs on it, each with whether it has a time
    limit), and its GPU count."""

    name: str
    usable: bool
    idle: bool
    holders: tuple[tuple[str, bool], ...] = ()
    gpus: int = 0


def rebook(
    pool: SparePool, domains: Mapping[str, Sequence[str]], nodes: Mapping[str, Candidate], other_pools: Collection[str]
) -> dict[str, list[str]]:
    """The pool's booking after this moment: per domain, the booked nodes kept (usable, and held by nobody or by
    jobs with time limits only: borrowers) and idle nodes added until `per_domain` (or the domain has none left)."""
    out: dict[str, list[str]] = {}
    for domain, members in sorted(domains.items()):
        keep = []
        for name in pool.booked.get(domain, ()):
            c = nodes.get(name)
            if c is not None and c.usable and name in members and all(limited for _, limited in c.holders):
                keep.append(name)
        keep = keep[: pool.per_domain]
        if len(keep) < pool.per_domain:
            free = [
                nodes[m]
                for m in members
                if m in nodes and nodes[m].usable and nodes[m].idle and m not in keep and m not in other_pools
            ]
            free.sort(key=lambda c: (c.gpus, c.name))
            keep += [c.name for c in free[: pool.per_domain - len(keep)]]
        out[domain] = sorted(keep)
    return out


def choose_pool_node(
    pools: Iterable[SparePool],
    domain_of: Mapping[str, Mapping[str, str]],
    dead: str,
    need: int,
    free: Mapping[str, int],
) -> tuple[SparePool, str] | None:
    """(pool, node): the first booked node, by pool name then node name, in the dead node's domain of the pool's
    tier with at least `need` GPUs free once its borrowers are gone (`free`: each booked node's whole GPUs not
    FATAL, borrowers' included). None: no pool holds one for it. `domain_of`: tier -> node -> domain."""
    for pool in sorted(pools, key=lambda p: p.name):
        domain = domain_of.get(pool.tier, {}).get(dead, "")
        for node in sorted(pool.booked.get(domain, ())):
            if node != dead and free.get(node, 0) >= need:
                return pool, node
    return None


def lent(pool: SparePool, holders: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The pool's booked nodes lent now: node -> the jobs (borrowers) holding GPUs there."""
    return {n: list(holders[n]) for n in sorted(pool.nodes()) if holders.get(n)}
