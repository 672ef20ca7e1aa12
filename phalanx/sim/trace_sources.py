"""Loaders of the public traces: Philly (Gavel's derived trace), Alibaba GPU v2023 (the FGD artifact: pods and
nodes) and Pollux's workloads, each mapped to :class:`~phalanx.sim.trace_records.TraceJob` by the rules in the
docstring of :mod:`phalanx.sim.traces`.
"""

from __future__ import annotations

import bisect
import csv
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

from .trace_records import (
    _BATCH_RE,
    ALIBABA_DIR,
    MAX_GPUS_PER_NODE,
    PHILLY_DIR,
    POLLUX_DIR,
    DataNotFound,
    Trace,
    TraceJob,
    TraceNode,
    _open_text,
    _param_bytes,
    _root,
    _Skips,
    _sub,
    gang_shape,
)

# --------------------------------------------------------------------------------------------- philly


_PHILLY_MEDIAN_S = 1186.0
_PHILLY_SIGMA = 2.2  # log-normal fallback spread (only when philly_runtime is missing)


def _philly_runtimes(root: Path) -> list[float]:
    f = root / "philly" / "philly_runtime_from_alibaba_analysis.csv.gz"
    if not f.is_file():
        return []
    out: list[float] = []
    with _open_text(f) as fh:
        next(fh, None)
        for line in fh:
            try:
                v = float(line)
            except ValueError:
                continue
            if v > 0 and math.isfinite(v):
                out.append(v)
    out.sort()
    return out


def _quantile(sorted_vals: list[float], q: float) -> float:
    if sorted_vals:
        i = min(len(sorted_vals) - 1, max(0, int(q * len(sorted_vals))))
        return sorted_vals[i]
    # log-normal with the Philly median
    from statistics import NormalDist

    z = NormalDist().inv_cdf(min(max(q, 1e-9), 1 - 1e-9))
    return _PHILLY_MEDIAN_S * math.exp(_PHILLY_SIGMA * z)


def philly_teams(data=None) -> list[str]:
    """The VC hashes (team names) in gavel-philly-derived/seed0."""
    d = _sub(data, PHILLY_DIR) / "seed0"
    return sorted(p.name.split(".")[0] for p in d.glob("*.trace*"))


def load_philly(
    data=None,
    teams: Iterable[str] | str | None = None,
    limit: int | None = None,
    steps_per_s: Mapping | None = None,
    gpus_per_node: int = MAX_GPUS_PER_NODE,
) -> Trace:
    """Gavel's Philly-derived per-VC traces (all 15 teams unless ``teams``); ``limit`` caps jobs per team."""
    root = _root(data)
    seed = _sub(root, PHILLY_DIR) / "seed0"
    known = philly_teams(root)
    if teams is None:
        want = known
    else:
        want = [teams] if isinstance(teams, str) else list(teams)
        bad = [t for t in want if t not in known]
        if bad:
            raise ValueError(f"unknown Philly team(s) {bad}; known: {', '.join(known)}")
    skip = _Skips("philly")
    rows = []  # (team, idx, job_type, steps, arrival, gpus)
    for team in want:
        path = seed / f"{team}.trace.gz"
        if not path.exists():
            path = seed / f"{team}.trace"
        n = 0
        with _open_text(path) as fh:
            for idx, line in enumerate(fh):
                if limit is not None and n >= limit:
                    break
                parts = line.rstrip("\r\n").split("\t")
                if len(parts) != 7:
                    skip("field count != 7")
                    continue
                try:
                    steps = int(parts[4])
                    arrival = float(parts[5])
                    gpus = int(parts[6])
                except ValueError:
                    skip("non-numeric steps/arrival/scale_factor")
                    continue
                if steps <= 0 or gpus <= 0 or not math.isfinite(arrival) or arrival < 0 or not parts[0]:
                    skip("non-positive steps/GPUs or bad arrival")
                    continue
                rows.append((team, idx, parts[0], steps, arrival, gpus))
                n += 1
    durations: dict[int, tuple[float, bool]] = {}
    if steps_per_s:
        for i, r in enumerate(rows):
            rate = steps_per_s.get((r[2], r[5]), steps_per_s.get(r[2]))
            if rate and rate > 0:
                durations[i] = (r[3] / rate, False)
    todo = [i for i in range(len(rows)) if i not in durations]
    if todo:
        runtimes = _philly_runtimes(root)
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i in todo:
            groups[(rows[i][2], rows[i][5])].append(i)
        for members in groups.values():
            members.sort(key=lambda i: rows[i][3])
            steps_sorted = [rows[i][3] for i in members]
            m = len(members)
            for i in members:
                s = rows[i][3]
                # mid-rank of ties -> identical step counts get identical durations
                lo = bisect.bisect_left(steps_sorted, s)
                hi = bisect.bisect_right(steps_sorted, s)
                q = ((lo + hi) / 2.0) / m
                durations[i] = (max(1.0, _quantile(runtimes, q)), True)
    jobs = []
    for i, (team, idx, jt, steps, arrival, gpus) in enumerate(rows):
        replicas, per_replica = gang_shape(gpus, gpus_per_node)
        batch = _BATCH_RE.search(jt)
        dur, est = durations[i]
        jobs.append(
            TraceJob(
                job_id=f"{team}-{idx}",
                tenant=team,
                submit_s=arrival,
                replicas=replicas,
                gpus_per_replica=per_replica,
                gpu_milli=0,
                duration_s=dur,
                model=jt,
                batch_size=int(batch.group(1)) if batch else 0,
                total_steps=steps,
                param_bytes=_param_bytes(jt),
                duration_estimated=est,
                source="philly",
            )
        )
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    return skip.done(jobs, "philly")


# --------------------------------------------------------------------------------------------- alibaba


def alibaba_task_lists(data=None) -> list[str]:
    d = _sub(data, ALIBABA_DIR) / "csv"
    return sorted(p.name[len("openb_pod_list_") :].split(".")[0] for p in d.glob("openb_pod_list_*.csv*"))


def _csv_file(d: Path, stem: str) -> Path | None:
    for cand in (d / f"{stem}.csv.gz", d / f"{stem}.csv"):
        if cand.is_file():
            return cand
    return None


def load_alibaba_v2023(data=None, task_list: str = "default") -> Trace:
    """Alibaba GPU v2023 (FGD "openb") pod list ``openb_pod_list_<task_list>``."""
    d = _sub(data, ALIBABA_DIR) / "csv"
    f = _csv_file(d, f"openb_pod_list_{task_list}")
    if f is None:
        raise ValueError(f"unknown Alibaba task list {task_list!r}; known: {', '.join(alibaba_task_lists(data))}")
    skip = _Skips(f"alibaba:{task_list}")
    jobs = []
    with _open_text(f) as fh:
        rd = csv.DictReader(fh)
        need = {"name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"}
        if not need <= set(rd.fieldnames or ()):
            raise ValueError(f"{f}: header {rd.fieldnames} lacks {sorted(need)}")
        timed = "creation_time" in (rd.fieldnames or ())
        for row in rd:
            try:
                name = row["name"]
                cpu = int(row["cpu_milli"])
                mem = int(row["memory_mib"])
                ngpu = int(row["num_gpu"])
                milli = int(row["gpu_milli"])
            except (TypeError, ValueError):
                skip("non-numeric resource")
                continue
            if not name or cpu < 0 or mem < 0 or ngpu < 0:
                skip("negative resource or no name")
                continue
            if ngpu == 0:
                reps, gpr, frac = 1, 0, 0
            elif ngpu == 1 and 0 < milli < 1000:
                reps, gpr, frac = 1, 1, milli
            elif milli == 1000 and ngpu <= MAX_GPUS_PER_NODE:
                reps, gpr, frac = 1, ngpu, 0
            else:
                skip("bad num_gpu/gpu_milli combination")
                continue
            est = False
            if timed:
                try:
                    created = float(row["creation_time"])
                    deleted = float(row["deletion_time"])
                    sched = row.get("scheduled_time") or ""
                    start = float(sched) if sched else created
                except (TypeError, ValueError):
                    skip("non-numeric time")
                    continue
                if not sched:
                    est = True
                if created < 0 or deleted < start or start < created:
                    skip("times out of order")
                    continue
                submit, dur = created, max(1.0, deleted - start)
            else:
                submit, dur, est = 0.0, 1.0, True
            spec = row.get("gpu_spec") or ""
            jobs.append(
                TraceJob(
                    job_id=name,
                    tenant="",
                    submit_s=submit,
                    replicas=reps,
                    gpus_per_replica=gpr,
                    gpu_milli=frac,
                    duration_s=dur,
                    cpu_milli=cpu,
                    memory_mib=mem,
                    gpu_models=tuple(s for s in spec.split("|") if s),
                    qos=row.get("qos") or "",
                    status=row.get("pod_phase") or "",
                    duration_estimated=est,
                    source=f"alibaba:{task_list}",
                )
            )
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    return skip.done(jobs, f"alibaba:{task_list}")


def load_alibaba_nodes(data=None, all_nodes: bool = False) -> Trace:
    """The openb node list: 1,213 GPU nodes (``all_nodes``: plus 310 CPU-only)."""
    d = _sub(data, ALIBABA_DIR) / "csv"
    stem = "openb_node_list_all_node" if all_nodes else "openb_node_list_gpu_node"
    f = _csv_file(d, stem)
    if f is None:
        raise DataNotFound(f"{d} has no {stem}.csv.gz")
    skip = _Skips(stem)
    nodes = []
    with _open_text(f) as fh:
        for row in csv.DictReader(fh):
            try:
                n = TraceNode(
                    name=row["sn"],
                    gpus=int(row["gpu"]),
                    model=row.get("model") or "",
                    cpu_milli=int(row["cpu_milli"]),
                    memory_mib=int(row["memory_mib"]),
                )
            except (KeyError, TypeError, ValueError):
                skip("non-numeric or missing field")
                continue
            if not n.name or n.gpus < 0 or n.cpu_milli < 0 or n.memory_mib < 0:
                skip("negative resource or no name")
                continue
            nodes.append(n)
    return skip.done(nodes, stem)


# --------------------------------------------------------------------------------------------- pollux


POLLUX_VARIANTS = {"simulator": "simulator-workloads", "testbed": "workloads", "realistic": "workloads-realistic"}


# reference GPU-hours: geometric middle of the GPU-time class the Pollux generator drew each app from
_POLLUX_GPU_HOURS = {
    "cifar10": 0.5,
    "ncf": 0.5,
    "deepspeech2": math.sqrt(10.0),
    "bert": math.sqrt(10.0),
    "yolov3": math.sqrt(1000.0),
    "imagenet": math.sqrt(100000.0),
}


def load_pollux(
    data=None, workload: str = "workload-1", variant: str = "simulator", gpus_per_node: int = MAX_GPUS_PER_NODE
) -> Trace:
    """A Pollux workload (160 jobs); ``variant`` simulator (default) | testbed | realistic."""
    if variant not in POLLUX_VARIANTS:
        raise ValueError(f"unknown Pollux variant {variant!r}; known: {', '.join(POLLUX_VARIANTS)}")
    w = str(workload)
    if w.isdigit():
        w = f"workload-{w}"
    d = _sub(data, POLLUX_DIR) / POLLUX_VARIANTS[variant]
    f = d / f"{w}.csv"
    if not re.fullmatch(r"workload-\d+", w) or not f.is_file():
        known = sorted(p.stem for p in d.glob("workload-*.csv"))
        raise ValueError(f"unknown Pollux workload {workload!r}; known: {', '.join(known)}")
    skip = _Skips(f"pollux:{w}")
    jobs = []
    with _open_text(f) as fh:
        for row in csv.DictReader(fh):
            try:
                name = row["name"]
                t = float(row["time"])
                app = row["application"]
                n = int(row["num_replicas"])
                bs = int(row["batch_size"])
            except (KeyError, TypeError, ValueError):
                skip("non-numeric or missing field")
                continue
            if not name or n <= 0 or t < 0 or bs <= 0 or app not in _POLLUX_GPU_HOURS:
                skip("bad value or unknown application")
                continue
            r, g = gang_shape(n, gpus_per_node)
            jobs.append(
                TraceJob(
                    job_id=name,
                    tenant="",
                    submit_s=t,
                    replicas=r,
                    gpus_per_replica=g,
                    gpu_milli=0,
                    duration_s=_POLLUX_GPU_HOURS[app] * 3600.0 / n,
                    model=app,
                    batch_size=bs,
                    param_bytes=_param_bytes(app),
                    duration_estimated=True,
                    source=f"pollux:{w}:{variant}",
                )
            )
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    return skip.done(jobs, f"pollux:{w}")
