"""Hypothesis strategies for the randomized invariant checker: the same shapes as
`phalanx.testing.world.random_scenario` (bench/invariants.py), drawn so that Hypothesis can shrink a failure to a
minimal scenario (fewer actions, smaller jobs, a smaller cluster)."""

from __future__ import annotations

from hypothesis import strategies as st

from phalanx.core.quota import FlavorQuota, QueueSpec
from phalanx.testing.world import PROFILES, VERBS, WEIGHTS, ClusterSpec, JobSpec, Scenario, fill

# Weighted as bench/invariants.py's generator weights them (world.WEIGHTS): submits and time dominate.
_VERBS = tuple(v for v, w in zip(VERBS, WEIGHTS, strict=True) for _ in range(max(1, w // 3)))

clusters = st.builds(
    ClusterSpec,
    nodes=st.sampled_from((2, 3, 4, 6, 8, 12, 16, 32)),
    gpus=st.sampled_from((8, 4)),
    per_leaf=st.sampled_from((2, 4, 8)),
    nvlink=st.sampled_from((0, 2, 4)),
    mixed=st.booleans(),
    mig_gpus=st.sampled_from((0, 1, 2)),
    confirming=st.sampled_from(("all", "odd", "none")),
)


@st.composite
def jobs(draw, name: str, cluster: ClusterSpec, queues: tuple[str, ...]) -> JobSpec:
    kind = draw(st.sampled_from(("whole", "whole", "whole", "share", "mig")))
    profile, milli, per = "", 0, 1
    if kind == "mig" and cluster.mig_gpus and cluster.gpus == 8:
        profile = draw(st.sampled_from(PROFILES))
        replicas = draw(st.integers(1, 2))
    elif kind == "share":
        milli = draw(st.sampled_from((250, 500)))
        replicas = draw(st.integers(1, 2))
    else:
        # Whole nodes and gangs of a good part of the cluster first: contention is what the invariants are about.
        per = min(cluster.gpus, draw(st.sampled_from((8, 4, 2, 1))))
        half = max(1, (cluster.nodes * cluster.gpus // per) // 2)
        replicas = draw(st.sampled_from((half, 1, 2, half + 1, 3, 4, 8)))
        while replicas * per > 64:
            replicas //= 2
        replicas = max(1, replicas)
    whole = not (profile or milli)
    segments = [d for d in range(1, replicas + 1) if replicas % d == 0] if whole and replicas > 1 else [0]
    return JobSpec(
        name,
        replicas=replicas,
        gpus_per_replica=per,
        priority=draw(st.sampled_from((0, 200, -100, 100))),
        queue=draw(st.sampled_from(queues)) if queues else "default",
        work=draw(st.sampled_from((60.0, 10.0, 2.0, 5.0, 30.0, 300.0))),
        time_limit=draw(st.sampled_from((0.0, 20.0, 60.0))),
        mig_profile=profile,
        gpu_milli=milli,
        required_tier=draw(st.sampled_from(("", "leaf", "node"))) if whole else "",
        gpu_model=draw(st.sampled_from(("", "A100"))) if cluster.mixed else "",
        checkpoint=draw(st.sampled_from(("early", "late", "never"))),
        fails=draw(st.integers(0, 1)),
        by_admin=not draw(st.booleans()) if queues else True,  # (a user's job: only with queues)
        preempts=draw(st.sampled_from((True, True, True, False))),  # False: a service's surge replica
        segment=draw(st.sampled_from((0, 0, 0, *segments))),  # a multi-level gang: replicas per segment
    )


def lab_queues(draw, cluster: ClusterSpec, names: tuple[str, ...], *, mig: bool = False) -> tuple[QueueSpec, ...]:
    """Queues of one cohort ("lab") with drawn quotas (a whole, half or quarter of the cluster's GPUs), borrow limits
    and weights; `mig`: each also draws a quota of MIG slices."""
    total = cluster.nodes * cluster.gpus
    return tuple(
        QueueSpec(
            name,
            {
                "*": FlavorQuota(
                    gpus=float(draw(st.sampled_from((total, total // 2, total // 4)))),
                    borrow_limit=draw(st.sampled_from((None, 0.0, float(cluster.gpus)))),
                    **({"mig_slices": draw(st.sampled_from((0, 7, 14)))} if mig else {}),
                )
            },
            cohort="lab",
            weight=draw(st.sampled_from((1.0, 2.0))),
        )
        for name in names
    )


@st.composite
def scenarios(draw, max_actions: int = 40) -> Scenario:
    cluster = draw(clusters)
    queues: tuple[QueueSpec, ...] = ()
    if draw(st.booleans()):
        count = draw(st.integers(2, 3))
        queues = lab_queues(draw, cluster, ("a", "b", "c")[:count])
    names = tuple(q.name for q in queues)
    count = draw(st.integers(1, max_actions))
    actions: list = []
    if draw(st.booleans()):  # a cluster full of long low-priority gangs first: what preemption is for
        prio = draw(st.sampled_from((-100, 0)))
        actions += fill(cluster, prio, draw(st.sampled_from(("early", "late", "never"))))
    for i in range(count):
        verb = draw(st.sampled_from(_VERBS))
        if verb == "submit":
            actions.append(("submit", draw(jobs(f"j{i}", cluster, names))))
        elif verb == "advance":
            actions.append(("advance", draw(st.sampled_from((5.0, 1.0, 0.5, 2.0, 3.0, 10.0, 30.0)))))
        else:
            actions.append((verb, draw(st.integers(0, 63))))
    return Scenario(
        cluster,
        tuple(actions),
        queues,
        min_runtime_s=draw(st.sampled_from((0.0, 5.0, 30.0))),
        grace_s=draw(st.sampled_from((3.0, 0.0, 20.0))),
        backoff_s=draw(st.sampled_from((1.0, 0.5, 5.0))),
        max_attempts=draw(st.sampled_from((3, 2, 5))),
    )
