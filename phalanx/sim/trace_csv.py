"""The common CSV format of :class:`~phalanx.sim.trace_records.TraceJob`: one column per field, written by
:func:`write_csv` and read back, checked, by :func:`load_csv`.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .trace_records import MAX_GPUS_PER_NODE, Trace, TraceJob, _open_text, _Skips

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
            kw: dict[str, Any] = {}  # TraceJob's keyword arguments, each parsed to its field's type above
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
