"""The training side of the serving evaluation: jobs resampled from a real trace, arriving at the rate that offers a
chosen share of the cluster, seeded.

Each job is a (gang shape, duration) pair of a real job of the source trace (any `phalanx sim run --trace` spec:
`philly`, `mix`, `pollux`, a CSV...; whole-GPU gangs only, at most `max_gpus`), its duration capped at
`max_job_hours` (Philly's tail runs for weeks and would outlive any window). Arrivals are Poisson at the rate that
offers `load` x `gpus` GPU-seconds per second over the window, from `backlog_hours` before its start: the jobs
that "arrived" before the start are all queued at time 0, so the cluster starts full instead of ramping up from
empty. Every job has priority 0 (training never preempts training here: every preemption is serving's).

`source="synthetic"` (or a trace that cannot be found, when the caller asks for that) draws from a Philly-like mix
instead: mostly 1 GPU, some 2, 4 and 8, a few 16-256 GPU gangs, log-normal run times of median 1,186 s (Philly's
median, `philly/README.md`) and sigma 2, the same mix as bench/sim_replay.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from .trace_records import TraceJob, gang_shape

# The synthetic Philly-like mix: (GPUs, weight) and log-normal durations (median seconds, sigma).
SYNTH_SIZES = ((1, 68), (2, 4), (4, 13), (8, 12), (16, 1.6), (32, 0.8), (64, 0.4), (128, 0.15), (256, 0.05))
SYNTH_MEDIAN_S, SYNTH_SIGMA = 1186.0, 2.0

Shape = tuple[int, int, float]  # replicas, GPUs per replica, duration (s)


def pool_from_trace(jobs: Sequence[TraceJob], gpus_per_node: int, max_gpus: int) -> list[Shape]:
    """The (replicas, GPUs per replica, duration) of every whole-GPU gang of `jobs` that fits `max_gpus` GPUs of
    nodes of `gpus_per_node`."""
    return [
        (j.replicas, j.gpus_per_replica, j.duration_s)
        for j in jobs
        if not j.gpu_milli
        and 0 < j.gpus_per_replica <= gpus_per_node
        and j.replicas * j.gpus_per_replica <= max_gpus
        and j.duration_s > 0
    ]


def synthetic_pool(gpus_per_node: int, max_gpus: int, seed: int, size: int = 20000) -> list[Shape]:
    """`size` draws of the synthetic Philly-like mix (gangs over `max_gpus` left out)."""
    rng = random.Random(seed)
    sizes = [s for s, _ in SYNTH_SIZES if s <= max_gpus]
    weights = [w for s, w in SYNTH_SIZES if s <= max_gpus]
    out = []
    for _ in range(size):
        gpus = rng.choices(sizes, weights)[0]
        r, g = gang_shape(gpus, gpus_per_node)
        out.append((r, g, max(1.0, rng.lognormvariate(math.log(SYNTH_MEDIAN_S), SYNTH_SIGMA))))
    return out


def resample_training(
    pool: Sequence[Shape],
    *,
    gpus: float,
    hours: float,
    load: float = 1.0,
    seed: int = 0,
    max_job_hours: float = 24.0,
    backlog_hours: float = 6.0,
    source: str = "",
) -> list[TraceJob]:
    """Jobs drawn from `pool` arriving over [-backlog_hours, hours) at the rate that offers `load` x `gpus` GPUs
    (arrivals before 0 are queued at 0), sorted by submission."""
    if not pool:
        raise ValueError("no training job to resample: the source trace has no whole-GPU gang that fits")
    if not (load > 0 and gpus > 0 and hours > 0):
        raise ValueError("the training load, its GPUs and the hours must be positive")
    cap = max_job_hours * 3600.0
    mean_work = sum(r * g * min(d, cap) for r, g, d in pool) / len(pool)  # GPU-seconds per job
    rate = load * gpus / mean_work  # jobs per second
    rng = random.Random(seed)
    t, end = -backlog_hours * 3600.0, hours * 3600.0
    jobs: list[TraceJob] = []
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        r, g, d = pool[rng.randrange(len(pool))]
        jobs.append(
            TraceJob(
                job_id=f"t{len(jobs):06d}",
                tenant="training",
                submit_s=max(0.0, t),
                replicas=r,
                gpus_per_replica=g,
                gpu_milli=0,
                duration_s=min(d, cap),
                source=source or "resampled",
            )
        )
    return jobs
