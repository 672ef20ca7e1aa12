"""Trace loaders for the simulator: real public job traces -> one common job record.

Data discovery
--------------
:func:`find_data` looks, in order, at ``--data DIR`` (the ``explicit`` argument), the ``PHALANX_DATA``
environment variable, and ``../shared/data`` relative to the working directory.  A folder counts when it
holds at least one of the trace folders below.  An explicit ``--data`` or ``PHALANX_DATA`` that does not
hold them is an error (it is not silently skipped); when nothing is found, :class:`DataNotFound` lists
every place it looked and what to do.

The common record
-----------------
:class:`TraceJob` (frozen).  A job is a gang of ``replicas`` identical replicas of ``gpus_per_replica``
whole GPUs each, or (``gpu_milli`` > 0) a fractional task holding ``gpu_milli`` thousandths of ONE GPU
(then ``replicas == 1`` and ``gpus_per_replica == 1``).  CPU-only tasks have ``gpus_per_replica == 0``.
``submit_s`` is seconds from the trace start; ``duration_s`` is the run time when the job runs alone at
full speed.  ``duration_estimated`` is True where the trace does not give that time directly (see below).
MIG is not in any of these traces.

Sources and mapping rules
-------------------------
``philly`` -- ``gavel-philly-derived/seed0/<vc>.trace.gz`` (Gavel, OSDI'20; 15 Philly VCs, 15,264 jobs).
  Tab-separated, no header, 7 fields: ``job_type, command, num_steps_arg, needs_data_dir, total_steps,
  arrival_time, scale_factor``.  Used: ``job_type`` -> ``model`` (batch size parsed from
  "... (batch size N)" -> ``batch_size``), ``total_steps``, ``arrival_time`` -> ``submit_s``,
  ``scale_factor`` (GPUs) -> the gang shape, the file name (VC hash) -> ``tenant``; job_id is
  ``<vc>-<line index>``.  Each VC file starts at t=0, so loading several teams overlays them on one
  timeline starting at 0.
  * Gang shape: a job of n GPUs is split into the fewest replicas of at most 8 GPUs (one 8-GPU node)
    that divide n evenly: r = the smallest integer >= ceil(n/8) that divides n, gpus_per_replica = n/r.
    So 1..8 -> 1 x n, 16 -> 2 x 8, 32 -> 4 x 8, 64 -> 8 x 8, 12 -> 2 x 6, 20 -> 4 x 5, 24 -> 3 x 8.
  * Duration: the trace holds steps, not seconds (Gavel made ``total_steps = duration x V100 steps/s of
    (job_type, scale_factor)`` from its throughput oracle, which is not in the data folder).  Give
    ``steps_per_s`` (a mapping of job_type or (job_type, scale_factor) -> steps/s) for exact seconds.
    Without it the duration is *calibrated*: within each (job_type, scale_factor) group the jobs are
    ranked by ``total_steps`` (which, at a fixed throughput, is the rank of their real duration) and the
    rank's quantile is mapped onto the real Philly runtime distribution
    (``philly/philly_runtime_from_alibaba_analysis.csv.gz``, runtimes > 0; median 1186 s), falling back to
    a log-normal with that median when that file is absent.  ``duration_estimated`` is True then.
``alibaba`` -- ``alibaba-gpu-v2023-fgd/csv/openb_pod_list_<list>.csv.gz`` (FGD, ATC'23; ``default`` has
  8,152 tasks).  Columns ``name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec, qos, pod_phase,
  creation_time, deletion_time, scheduled_time`` (``multigpu*`` lists: the first five only).
  * ``num_gpu == 0`` -> CPU-only (0 GPUs); ``num_gpu == 1`` and ``gpu_milli`` in 1..999 -> fractional
    (1 x 1, ``gpu_milli``); ``num_gpu == 1`` and ``gpu_milli == 1000`` -> 1 x 1 whole GPU; ``num_gpu`` k > 1
    -> one pod on one node: 1 x k (the trace has 2, 4, 8).
  * ``gpu_spec`` ("|"-separated, empty = any) -> ``gpu_models``; ``qos`` -> ``qos``; ``pod_phase`` ->
    ``status``; ``cpu_milli``, ``memory_mib`` as is; no tenant in the trace ("").
  * ``submit_s = creation_time``; ``duration_s = deletion_time - scheduled_time`` (pods never scheduled,
    i.e. Pending ones with an empty ``scheduled_time``: ``deletion_time - creation_time``, marked
    estimated); a zero-length pod gets 1 s.  Lists without times (``multigpu*``) get submit_s 0 and a
    placeholder duration_s of 1 s, marked estimated (the FGD method replays them in a seeded random
    order without departures anyway).
  :func:`load_alibaba_nodes` reads ``openb_node_list_gpu_node.csv.gz`` (1,213 nodes / 6,212 GPUs;
  ``all_nodes=True``: ``openb_node_list_all_node.csv.gz``, 1,523 nodes) -> :class:`TraceNode`.
``pollux`` -- ``pollux-workloads/<variant>/workload-<k>.csv`` (Pollux, OSDI'21; 160 jobs each).  Columns
  ``name, time, application, num_replicas, batch_size``.  Variants: ``simulator`` (default;
  ``simulator-workloads``, identical to the testbed ``workloads``), ``testbed``, ``realistic``.
  * ``num_replicas`` GPUs -> the same <= 8-per-replica gang rule as Philly (``gpus_per_node=4``
    reproduces Pollux's own 16 x 4-GPU cluster shape; both loaders take it); ``time`` -> ``submit_s``;
    ``application`` -> ``model``; ``batch_size`` as is; no tenant ("").
  * Duration: not in the CSV (Pollux's simulator derives it from per-application profiles, not in the
    data folder).  Estimated from the GPU-time class the Pollux workload generator drew each application
    from (cifar10/ncf < 1 GPU-hour; deepspeech2/bert 1-10; yolov3 10-100; imagenet 100-1000): the class's
    reference GPU-hours (0.5, 3.16, 31.6, 316) x 3600 / GPUs, ``duration_estimated`` True.
``csv`` -- a CSV in the common format (the :class:`TraceJob` field names as header; ``gpu_models`` is
  "|"-separated).  Written by :func:`write_csv`.
``mix`` -- a multi-tenant mix (:func:`load_mix`): several teams sharing one cluster, each with its own real
  Philly jobs plus, spread across the teams, large pre-training gangs at high priority and many small
  fine-tuning jobs at low priority.
  ``mix:teams=N|A+B+...,jobs=J,hours=H,pretrain=K,finetune=M,seed=S`` (defaults 4, 300, 168, 8, 2000, 0).
  Deterministic for a seed.  What is real and what is synthesized:
  * tenants: the N Philly VCs with the most jobs (ties by name), or the ones named; tenant = team.
  * team jobs (real, but for their arrival scale): each team's first J jobs (the ``philly`` loader: shapes,
    calibrated durations), ``priority`` 0.  Their submit times are scaled by one factor so that the last of
    them arrives at the end of the window of ``hours`` (order and relative gaps kept; the raw traces are
    sparse: their first 168 h hold a few dozen jobs).
  * pre-training gangs (synthesized, ``source`` "mix:pretrain"): K jobs, tenant round-robin over the teams
    in order, ``priority`` 100 ("high"); size drawn uniformly from 64, 128, 256 GPUs (8-GPU replicas, so
    8, 16, 32 replicas); duration the real Philly runtime distribution's quantile at a uniform draw in
    [0.95, 0.995] (the long tail: about 14 h to a few days), at most 72 h; submitted uniformly in the first
    80% of the window; ``model`` "pretrain", ``duration_estimated`` True.
  * fine-tuning jobs (real shapes and run times, synthesized owners and arrivals, ``source``
    "mix:finetune"): M jobs drawn with replacement from the Alibaba v2023 ``default`` list's GPU pods that
    ran between 60 s and 12 h (1, 2, 4 or 8 whole GPUs, or a fraction of one GPU with the pod's real
    ``gpu_milli``: about 45% of them), keeping their shape and duration; tenant drawn uniformly from the
    teams, ``priority`` -100 ("batch"), submitted uniformly in the window; ``model`` "finetune".
  Needs the ``gavel-philly-derived``, ``philly`` (runtimes; a log-normal fallback otherwise) and
  ``alibaba-gpu-v2023-fgd`` folders.

:func:`load_trace` takes a spec string (see :data:`SPEC_FORMS`) and returns the jobs sorted by submit time.
Every loader validates each row and skips malformed ones; the returned :class:`Trace` (a list) carries
``skipped`` and ``skipped_reasons``.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import gzip
import io
import logging
import math
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = [
    "DataNotFound",
    "TraceJob",
    "TraceNode",
    "Trace",
    "find_data",
    "load_philly",
    "philly_teams",
    "load_alibaba_v2023",
    "alibaba_task_lists",
    "load_alibaba_nodes",
    "load_pollux",
    "load_csv",
    "load_mix",
    "write_csv",
    "load_trace",
    "gang_shape",
    "SPEC_FORMS",
    "ENV_VAR",
]

ENV_VAR = "PHALANX_DATA"
MAX_GPUS_PER_NODE = 8

PHILLY_DIR = "gavel-philly-derived"
ALIBABA_DIR = "alibaba-gpu-v2023-fgd"
POLLUX_DIR = "pollux-workloads"
TRACE_DIRS = (PHILLY_DIR, ALIBABA_DIR, POLLUX_DIR)

SPEC_FORMS = (
    "philly",
    "philly:<vc>[,<vc>...]  or  philly:team=<vc>[,limit=N]",
    "alibaba  or  alibaba:<task list>  (default, cpu050, gpushare40, gpuspec10, multigpu20, ...)",
    "pollux  or  pollux:workload-<1..8>[,variant=simulator|testbed|realistic]",
    "csv:<path>  or  a path ending in .csv (the common TraceJob format)",
    "mix  or  mix:teams=<N|vc+vc...>,jobs=J,hours=H,pretrain=K,finetune=M,seed=S  (a multi-tenant mix)",
)


class DataNotFound(FileNotFoundError):
    """No trace data folder was found; the message lists where we looked and what to do."""


# --------------------------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class TraceJob:
    job_id: str
    tenant: str
    submit_s: float
    replicas: int
    gpus_per_replica: int
    gpu_milli: int
    duration_s: float
    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_models: tuple[str, ...] = ()
    model: str = ""
    batch_size: int = 0
    total_steps: int = 0
    param_bytes: int = 0
    qos: str = ""
    status: str = ""
    duration_estimated: bool = False
    source: str = ""
    priority: int = 0  # higher wins (phalanx.core.preemption); the real traces carry none: 0

    @property
    def total_gpus(self) -> int:
        """Whole GPUs held (a fractional task counts as 1 device)."""
        return self.replicas * self.gpus_per_replica

    @property
    def is_fractional(self) -> bool:
        return self.gpu_milli > 0

    @property
    def gpu_demand_milli(self) -> int:
        """GPU demand in thousandths of a GPU (fractional: gpu_milli; else 1000 x GPUs)."""
        return self.gpu_milli if self.gpu_milli else 1000 * self.total_gpus


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    gpus: int
    model: str
    cpu_milli: int
    memory_mib: int


class Trace(list):
    """A list of TraceJob (or TraceNode) with load diagnostics."""

    def __init__(self, items: Iterable = (), *, name: str = "", skipped_reasons: Mapping[str, int] | None = None):
        super().__init__(items)
        self.name = name
        self.skipped_reasons: dict[str, int] = dict(skipped_reasons or {})

    @property
    def skipped(self) -> int:
        return sum(self.skipped_reasons.values())


# --------------------------------------------------------------------------------------------- discovery


def _has_traces(p: Path) -> bool:
    return p.is_dir() and any((p / d).is_dir() for d in TRACE_DIRS)


def find_data(explicit: str | os.PathLike | None = None, *, cwd: str | os.PathLike | None = None) -> Path:
    """Find the trace data folder: ``explicit`` (--data), then $PHALANX_DATA, then ../shared/data from cwd."""
    expected = ", ".join(d + "/" for d in TRACE_DIRS)
    env = os.environ.get(ENV_VAR, "")
    for given, label, fix in (
        (explicit, "--data ", "Point --data at"),
        (env, f"{ENV_VAR}=", f"Set {ENV_VAR} (or pass --data) to"),
    ):
        if given is None or str(given) == "":
            continue
        p = Path(given).expanduser()
        if _has_traces(p):
            return p.resolve()
        raise DataNotFound(
            f"{label}{p}: {'no such folder' if not p.is_dir() else 'holds none of ' + expected}. "
            f"{fix} the folder that holds {expected}"
        )
    base = Path(cwd) if cwd is not None else Path.cwd()
    p = base / ".." / "shared" / "data"
    if _has_traces(p):
        return p.resolve()
    raise DataNotFound(
        "no trace data found. Looked at: --data (not given); "
        f"${ENV_VAR} (not set); {p.resolve()} (../shared/data from the working directory: "
        f"{'no such folder' if not p.is_dir() else 'holds none of ' + expected}). "
        f"Pass --data DIR or set {ENV_VAR}=DIR, where DIR holds {expected}"
    )


def _root(data: str | os.PathLike | None) -> Path:
    if data is None:
        return find_data()
    p = Path(data)
    if not p.is_dir():
        raise DataNotFound(f"data folder {p} does not exist; pass --data DIR or set {ENV_VAR}")
    return p


def _sub(data, name: str) -> Path:
    root = _root(data)
    sub = root / name
    if not sub.is_dir():
        raise DataNotFound(f"{root} has no {name}/ folder (needed for this trace)")
    return sub


def _open_text(path: Path):
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


# --------------------------------------------------------------------------------------------- helpers


def gang_shape(n_gpus: int, per_node: int = MAX_GPUS_PER_NODE) -> tuple[int, int]:
    """Split n GPUs into (replicas, gpus_per_replica): the fewest replicas of <= per_node GPUs dividing n."""
    if n_gpus <= 0:
        raise ValueError(f"GPU count must be positive, got {n_gpus}")
    if n_gpus <= per_node:
        return 1, n_gpus
    r = -(-n_gpus // per_node)
    while n_gpus % r:
        r += 1
    return r, n_gpus // r


_BATCH_RE = re.compile(r"\(batch size (\d+)\)")

# fp32 parameter bytes for models whose size is well known (optional; 0 = unknown).
_PARAM_COUNTS = {
    "ResNet-18": 11_173_962,  # CIFAR-10 ResNet-18 (Gavel's image_classification/cifar10; Pollux cifar10)
    "cifar10": 11_173_962,
    "ResNet-50": 25_557_032,  # torchvision ResNet-50 (Gavel imagenet; Pollux imagenet)
    "imagenet": 25_557_032,
    "bert": 109_482_240,  # BERT-base (Pollux fine-tunes BERT-base on SQuAD)
}


def _param_bytes(model: str) -> int:
    base = model.split(" (", 1)[0]
    n = _PARAM_COUNTS.get(base, 0)
    return 4 * n


class _Skips:
    def __init__(self, what: str):
        self.what = what
        self.c: Counter[str] = Counter()

    def __call__(self, reason: str) -> None:
        self.c[reason] += 1

    def done(self, items, name: str) -> Trace:
        t = Trace(items, name=name, skipped_reasons=self.c)
        if t.skipped:
            log.warning("%s: skipped %d malformed rows: %s", self.what, t.skipped, dict(self.c))
        return t


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
        r, g = gang_shape(gpus, gpus_per_node)
        m = _BATCH_RE.search(jt)
        dur, est = durations[i]
        jobs.append(
            TraceJob(
                job_id=f"{team}-{idx}",
                tenant=team,
                submit_s=arrival,
                replicas=r,
                gpus_per_replica=g,
                gpu_milli=0,
                duration_s=dur,
                model=jt,
                batch_size=int(m.group(1)) if m else 0,
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


# --------------------------------------------------------------------------------------------- common CSV

_FIELDS = [f.name for f in dataclasses.fields(TraceJob)]
_INT_FIELDS = {
    "replicas",
    "gpus_per_replica",
    "gpu_milli",
    "cpu_milli",
    "memory_mib",
    "batch_size",
    "total_steps",
    "param_bytes",
    "priority",
}
_FLOAT_FIELDS = {"submit_s", "duration_s"}
_REQUIRED = ("job_id", "submit_s", "replicas", "gpus_per_replica", "duration_s")


def write_csv(jobs: Iterable[TraceJob], path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(_FIELDS)
        for j in jobs:
            row = []
            for name in _FIELDS:
                v = getattr(j, name)
                if name == "gpu_models":
                    v = "|".join(v)
                elif isinstance(v, bool):
                    v = int(v)
                row.append(v)
            w.writerow(row)


def _valid_shape(j: TraceJob) -> str | None:
    if j.replicas < 1 or j.gpus_per_replica < 0 or j.gpus_per_replica > MAX_GPUS_PER_NODE:
        return "bad gang shape"
    if j.gpu_milli and (j.gpu_milli >= 1000 or j.replicas != 1 or j.gpus_per_replica != 1):
        return "bad fractional request"
    if j.gpu_milli < 0 or j.duration_s <= 0 or j.submit_s < 0 or not math.isfinite(j.duration_s):
        return "bad time or milli"
    return None


def load_csv(path: str | os.PathLike) -> Trace:
    """A CSV in the common format (header: TraceJob field names; required: job_id, submit_s, replicas,
    gpus_per_replica, duration_s)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace CSV {p} not found")
    skip = _Skips(f"csv:{p.name}")
    jobs = []
    with _open_text(p) as fh:
        rd = csv.DictReader(fh)
        missing = [f for f in _REQUIRED if f not in (rd.fieldnames or ())]
        if missing:
            raise ValueError(f"{p}: missing column(s) {missing}; expected a header of {_FIELDS}")
        for row in rd:
            kw = {}
            try:
                for name in _FIELDS:
                    v = row.get(name)
                    if v is None or v == "":
                        continue
                    if name in _INT_FIELDS:
                        kw[name] = int(v)
                    elif name in _FLOAT_FIELDS:
                        kw[name] = float(v)
                    elif name == "gpu_models":
                        kw[name] = tuple(s for s in v.split("|") if s)
                    elif name == "duration_estimated":
                        kw[name] = v.strip().lower() in ("1", "true", "yes")
                    else:
                        kw[name] = v
                kw.setdefault("tenant", "")
                kw.setdefault("gpu_milli", 0)
                kw.setdefault("source", f"csv:{p.name}")
                j = TraceJob(**kw)
            except (TypeError, ValueError):
                skip("non-numeric or missing field")
                continue
            why = _valid_shape(j)
            if why:
                skip(why)
                continue
            jobs.append(j)
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    return skip.done(jobs, f"csv:{p.name}")


# --------------------------------------------------------------------------------------------- mix

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


# --------------------------------------------------------------------------------------------- specs


def _bad_spec(spec: str, why: str) -> ValueError:
    return ValueError(f"bad trace spec {spec!r}: {why}. Accepted forms: " + "; ".join(SPEC_FORMS))


def load_trace(spec: str, data=None) -> Trace:
    """Load a trace from a spec string; the jobs come back sorted by submit time."""
    s = (spec or "").strip()
    if not s:
        raise _bad_spec(spec, "empty")
    if s.startswith("csv:"):
        return load_csv(s[4:])
    if s.lower().endswith((".csv", ".csv.gz")) and not s.lower().startswith(("philly", "alibaba", "pollux")):
        return load_csv(s)
    source, _, rest = s.partition(":")
    source = source.strip().lower()
    pos: list[str] = []
    kv: dict[str, str] = {}
    for item in (x.strip() for x in rest.split(",")) if rest else ():
        if not item:
            raise _bad_spec(spec, "empty item")
        if "=" in item:
            k, _, v = item.partition("=")
            k, v = k.strip().lower(), v.strip()
            if not k or not v:
                raise _bad_spec(spec, f"bad option {item!r}")
            kv[k] = v
        else:
            pos.append(item)

    def _int(k: str) -> int | None:
        if k not in kv:
            return None
        try:
            v = int(kv[k])
        except ValueError:
            raise _bad_spec(spec, f"{k} must be an integer") from None
        if v < 0:
            raise _bad_spec(spec, f"{k} must be >= 0")
        return v

    if source == "philly":
        unknown = set(kv) - {"team", "teams", "limit"}
        if unknown:
            raise _bad_spec(spec, f"unknown option(s) {sorted(unknown)} for philly")
        teams = list(pos)
        for k in ("team", "teams"):
            if k in kv:
                teams += [t for t in re.split(r"[+|;]", kv[k]) if t]
        try:
            return load_philly(data, teams=teams or None, limit=_int("limit"))
        except ValueError as e:
            raise _bad_spec(spec, str(e)) from None
    if source == "alibaba":
        unknown = set(kv) - {"list", "task_list"}
        if unknown or len(pos) > 1:
            raise _bad_spec(spec, "alibaba takes one task list")
        tl = pos[0] if pos else kv.get("list", kv.get("task_list", "default"))
        try:
            return load_alibaba_v2023(data, task_list=tl)
        except ValueError as e:
            raise _bad_spec(spec, str(e)) from None
    if source == "pollux":
        unknown = set(kv) - {"workload", "variant"}
        if unknown or len(pos) > 1:
            raise _bad_spec(spec, "pollux takes one workload and an optional variant=")
        wl = pos[0] if pos else kv.get("workload", "workload-1")
        try:
            return load_pollux(data, workload=wl, variant=kv.get("variant", "simulator"))
        except ValueError as e:
            raise _bad_spec(spec, str(e)) from None
    if source == "mix":
        unknown = set(kv) - {"teams", "team", "jobs", "hours", "pretrain", "finetune", "seed"}
        if unknown or pos:
            raise _bad_spec(spec, "mix takes teams=, jobs=, hours=, pretrain=, finetune=, seed=")
        named = kv.get("teams", kv.get("team", "4"))
        chosen: int | list[str] = int(named) if named.isdigit() else [t for t in re.split(r"[+|;]", named) if t]
        try:
            hours = float(kv.get("hours", "168"))
        except ValueError:
            raise _bad_spec(spec, "hours must be a number") from None
        counts = {k: _int(k) for k in ("jobs", "pretrain", "finetune", "seed")}
        try:
            return load_mix(
                data,
                teams=chosen,
                jobs_per_team=300 if counts["jobs"] is None else counts["jobs"],
                hours=hours,
                pretrain=8 if counts["pretrain"] is None else counts["pretrain"],
                finetune=2000 if counts["finetune"] is None else counts["finetune"],
                seed=counts["seed"] or 0,
            )
        except ValueError as e:
            raise _bad_spec(spec, str(e)) from None
    raise _bad_spec(spec, f"unknown source {source!r}")
