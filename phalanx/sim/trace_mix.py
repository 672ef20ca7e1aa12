"""The multi-tenant mix: Philly teams' own jobs plus high-priority pre-training gangs and low-priority fine-tuning
jobs drawn from Alibaba's pods (what is real and what is drawn: the docstring of :mod:`phalanx.sim.traces`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable

from .trace_records import Trace, TraceJob, _root, gang_shape
from .trace_sources import _philly_runtimes, _quantile, load_alibaba_v2023, load_philly

MIX_PRETRAIN_PRIORITY = 100  # "high"
MIX_FINETUNE_PRIORITY = -100  # "batch"
MIX_PRETRAIN_GPUS = (64, 128, 256)


def load_mix(
    data=None,
    teams: int | Iterable[str] = 4,
    jobs_per_team: int = 300,
    hours: float = 168.0,
    pretrain: int = 8,
    finetune: int = 2000,
    seed: int = 0,
) -> Trace:
    """A multi-tenant mix: Philly teams' own jobs, plus high-priority pre-training gangs and low-priority
    fine-tuning jobs spread across the teams (see the module docstring, ``mix``, for what is real)."""
    import random

    if hours <= 0:
        raise ValueError("hours must be > 0")
    root = _root(data)
    philly = load_philly(root)
    counts = Counter(j.tenant for j in philly)
    if isinstance(teams, int):
        if not 1 <= teams <= len(counts):
            raise ValueError(f"teams must be 1..{len(counts)}")
        chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:teams]]
    else:
        chosen = list(teams)
        bad = [t for t in chosen if t not in counts]
        if bad or not chosen:
            raise ValueError(f"unknown Philly team(s) {bad}; known: {', '.join(sorted(counts))}")
    window = hours * 3600.0
    taken: Counter[str] = Counter()
    jobs = []
    for j in philly:  # by submit time
        if j.tenant in chosen and taken[j.tenant] < jobs_per_team:
            taken[j.tenant] += 1
            jobs.append(j)
    span = max((j.submit_s for j in jobs), default=0.0)
    if span > 0:
        jobs = [dataclasses.replace(j, submit_s=j.submit_s * window / span) for j in jobs]
    rng = random.Random(seed)
    runtimes = _philly_runtimes(root)
    for i in range(pretrain):
        gpus = rng.choice(MIX_PRETRAIN_GPUS)
        r, g = gang_shape(gpus)
        duration = min(72 * 3600.0, _quantile(runtimes, rng.uniform(0.95, 0.995)))
        team = chosen[i % len(chosen)]
        jobs.append(
            TraceJob(
                job_id=f"pt{i}-{team}",
                tenant=team,
                submit_s=rng.uniform(0.0, 0.8 * window),
                replicas=r,
                gpus_per_replica=g,
                gpu_milli=0,
                duration_s=duration,
                model="pretrain",
                duration_estimated=True,
                source="mix:pretrain",
                priority=MIX_PRETRAIN_PRIORITY,
            )
        )
    pool = [j for j in load_alibaba_v2023(root) if j.gpus_per_replica > 0 and 60.0 <= j.duration_s <= 12 * 3600.0]
    if finetune and not pool:
        raise ValueError("the Alibaba default list has no GPU pods to draw fine-tuning jobs from")
    for i in range(finetune):
        src = rng.choice(pool)
        team = rng.choice(chosen)
        jobs.append(
            TraceJob(
                job_id=f"ft{i}-{team}",
                tenant=team,
                submit_s=rng.uniform(0.0, window),
                replicas=src.replicas,
                gpus_per_replica=src.gpus_per_replica,
                gpu_milli=src.gpu_milli,
                duration_s=src.duration_s,
                model="finetune",
                duration_estimated=src.duration_estimated,
                source="mix:finetune",
                priority=MIX_FINETUNE_PRIORITY,
            )
        )
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    return Trace(jobs, name="mix", skipped_reasons=philly.skipped_reasons)
