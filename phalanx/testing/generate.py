"""Scenarios drawn and shrunk: a seeded generator of the same shapes Hypothesis draws in the tests
(:func:`random_scenario`, bench/invariants.py), a filler of long low-priority gangs (:func:`fill`), and greedy
delta debugging of a failing scenario (:func:`shrink`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from phalanx.core.quota import DEFAULT_QUEUE, FlavorQuota, QueueSpec

from .scenario import Action, ClusterSpec, JobSpec, Scenario

PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb")
VERBS = ("submit", "advance", "release", "commit", "fail", "down", "up", "cancel", "mig", "gpu")
# How often each verb is drawn (submits and time dominate; failures are rare but present).
WEIGHTS = (24, 26, 16, 6, 3, 3, 3, 3, 2, 2)


def random_scenario(rng: random.Random, *, max_actions: int = 40) -> Scenario:
    """A scenario from a seeded generator (bench/invariants.py): the same shapes Hypothesis draws in the tests."""
    nodes = rng.choice((2, 2, 3, 3, 4, 6, 8, 12, 16, 32))
    gpus = rng.choice((8, 8, 4))
    cluster = ClusterSpec(
        nodes=nodes,
        gpus=gpus,
        per_leaf=rng.choice((2, 4, 8)),
        nvlink=rng.choice((0, 0, 2, 4)),
        mixed=rng.random() < 0.2,
        mig_gpus=rng.choice((0, 0, 1, 2)) if gpus == 8 else 0,
        confirming=rng.choice(("all", "all", "odd", "none")),
    )
    queues: tuple[QueueSpec, ...] = ()
    if rng.random() < 0.35:
        total = nodes * gpus
        queues = tuple(
            QueueSpec(
                name,
                {
                    "*": FlavorQuota(
                        gpus=float(rng.choice((total // 4, total // 2, total))),
                        borrow_limit=rng.choice((None, 0.0, float(gpus))),
                    ),
                },
                cohort="lab",
                weight=rng.choice((1.0, 2.0)),
            )
            for name in ("a", "b", "c")[: rng.choice((2, 3))]
        )
    actions: list[Action] = list(fill(cluster, rng.choice((-100, 0)), rng.choice(("early", "late", "never"))))
    if rng.random() < 0.5:
        actions = []
    for i in range(rng.randint(1, max_actions)):
        verb = rng.choices(VERBS, WEIGHTS)[0]
        if verb == "submit":
            actions.append(("submit", random_job(rng, f"j{i}", cluster, [q.name for q in queues])))
        elif verb == "advance":
            actions.append(("advance", rng.choice((0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0))))
        else:
            actions.append((verb, rng.randrange(64)))
    return Scenario(
        cluster,
        tuple(actions),
        queues,
        min_runtime_s=rng.choice((0.0, 0.0, 5.0, 5.0, 30.0)),
        grace_s=rng.choice((0.0, 3.0, 3.0, 20.0)),
        backoff_s=rng.choice((0.5, 1.0, 5.0)),
        max_attempts=rng.choice((2, 3, 5)),
    )


def fill(cluster: ClusterSpec, priority: int, checkpoint: str) -> tuple[Action, ...]:
    """Actions that fill the cluster with long gangs of whole nodes (two nodes each where there are two) of one
    priority, then let them pass a minimum runtime: what later arrivals of higher priority preempt."""
    size = 2 if cluster.nodes >= 2 else 1
    out: list[Action] = [
        ("submit", JobSpec(f"fill{i}", size, cluster.gpus, priority, work=300.0, checkpoint=checkpoint))
        for i in range(cluster.nodes // size)
    ]
    out.append(("advance", 6.0))
    return tuple(out)


def random_job(rng: random.Random, name: str, cluster: ClusterSpec, queues: Sequence[str]) -> JobSpec:
    kind = rng.random()
    mig = milli = 0
    profile = ""
    if kind < 0.1 and cluster.mig_gpus:
        profile = rng.choice(PROFILES)
        replicas, per = rng.choice((1, 1, 2)), 1
    elif kind < 0.2:
        milli = rng.choice((250, 500))
        replicas, per = rng.choice((1, 2)), 1
    else:
        per = min(rng.choice((1, 2, 4, cluster.gpus, cluster.gpus)), cluster.gpus)
        half = max(1, (cluster.nodes * cluster.gpus // per) // 2)
        replicas = rng.choice((1, 1, 2, 2, 3, 4, 8, half, half + 1))
        while replicas * per > 64:
            replicas //= 2
    del mig
    # An elastic gang (MIN:MAX) for a tenth of the whole-GPU gangs of 2 replicas or more (from `kind`, drawn already:
    # the seeded streams of the other fields stay as they were).
    elastic = not (profile or milli) and kind >= 0.9 and replicas >= 2
    job = JobSpec(
        name,
        replicas=max(1, replicas),
        gpus_per_replica=per,
        priority=rng.choice((-100, 0, 0, 100, 200)),
        queue=rng.choice(list(queues)) if queues else DEFAULT_QUEUE,
        work=rng.choice((2.0, 5.0, 10.0, 30.0, 60.0, 300.0)),
        time_limit=rng.choice((0.0, 0.0, 20.0, 60.0)),
        mig_profile=profile,
        gpu_milli=milli,
        required_tier=rng.choice(("", "", "", "leaf", "node")) if not (profile or milli) else "",
        gpu_model="A100" if cluster.mixed and rng.random() < 0.2 else "",
        checkpoint=rng.choice(("early", "late", "never")),
        fails=rng.choice((0, 0, 0, 1)),
        by_admin=rng.random() < 0.9,
        preempts=rng.random() < 0.9,
        min_replicas=max(1, replicas // 2) if elastic else 0,
    )
    # Drawn last, so the shapes above stay what a seed gave before segments existed.
    if not (profile or milli) and job.replicas > 1 and rng.random() < 0.25:
        # An elastic gang's segments leave it at least two (it grows and shrinks by whole segments), and its
        # minimum is a whole number of them.
        sizes = [d for d in range(1, job.replicas + (0 if elastic else 1)) if job.replicas % d == 0]
        job = replace(job, segment=rng.choice(sizes))
        if elastic:
            job = replace(job, min_replicas=max(job.segment, job.min_replicas // job.segment * job.segment))
        if rng.random() < 0.5:  # spares kept in the domain (drawn after the segment, for the same reason)
            job = replace(job, spares=rng.choice((1, 1, 2)))
    return job


def shrink(scenario: Scenario, fails) -> Scenario:  # type: ignore[no-untyped-def]
    """A smaller scenario on which `fails(scenario)` still holds: chunks of actions removed, then single ones,
    then the cluster made smaller (greedy delta debugging; what bench/invariants.py prints for a failure)."""
    best = scenario
    chunk = max(1, len(best.actions) // 2)
    while chunk >= 1:
        i, changed = 0, False
        while i < len(best.actions):
            trial = replace(best, actions=best.actions[:i] + best.actions[i + chunk :])
            if fails(trial):
                best, changed = trial, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    for smaller in (replace(best.cluster, nodes=n) for n in range(2, best.cluster.nodes)):
        trial = replace(best, cluster=smaller)
        if fails(trial):
            best = trial
            break
    return best
