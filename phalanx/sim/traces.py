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

Where the code lives (every name stays importable from here): the record, data discovery and gang shapes in
:mod:`phalanx.sim.trace_records`; the Philly, Alibaba and Pollux loaders in :mod:`phalanx.sim.trace_sources`; the
mix in :mod:`phalanx.sim.trace_mix`; the common CSV format in :mod:`phalanx.sim.trace_csv`; here, the spec
strings (:func:`load_trace`).
"""

from __future__ import annotations

import re

# The records and loaders live in their own modules; every name that lived here is still importable from here
# (the noqa: re-exports outside __all__).
from .trace_csv import load_csv, write_csv
from .trace_mix import MIX_FINETUNE_PRIORITY, MIX_PRETRAIN_GPUS, MIX_PRETRAIN_PRIORITY, load_mix  # noqa: F401
from .trace_records import (  # noqa: F401
    ALIBABA_DIR,
    ENV_VAR,
    MAX_GPUS_PER_NODE,
    PHILLY_DIR,
    POLLUX_DIR,
    TRACE_DIRS,
    DataNotFound,
    Trace,
    TraceJob,
    TraceNode,
    _has_traces,
    find_data,
    gang_shape,
)
from .trace_sources import (
    POLLUX_VARIANTS,  # noqa: F401
    alibaba_task_lists,
    load_alibaba_nodes,
    load_alibaba_v2023,
    load_philly,
    load_pollux,
    philly_teams,
)

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


SPEC_FORMS = (
    "philly",
    "philly:<vc>[,<vc>...]  or  philly:team=<vc>[,limit=N]",
    "alibaba  or  alibaba:<task list>  (default, cpu050, gpushare40, gpuspec10, multigpu20, ...)",
    "pollux  or  pollux:workload-<1..8>[,variant=simulator|testbed|realistic]",
    "csv:<path>  or  a path ending in .csv (the common TraceJob format)",
    "mix  or  mix:teams=<N|vc+vc...>,jobs=J,hours=H,pretrain=K,finetune=M,seed=S  (a multi-tenant mix)",
)


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
