"""The common trace record and what every trace loader shares: :class:`TraceJob`, :class:`TraceNode`,
:class:`Trace`, where the data is (:func:`find_data`), how n GPUs split into a gang (:func:`gang_shape`) and the
count of skipped rows. Imports nothing of ``phalanx.sim``, so every loader can import it (the mapping rules are
in the docstring of :mod:`phalanx.sim.traces`).
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("phalanx.sim.traces")  # the name the loaders always logged under


ENV_VAR = "PHALANX_DATA"
MAX_GPUS_PER_NODE = 8

PHILLY_DIR = "gavel-philly-derived"
ALIBABA_DIR = "alibaba-gpu-v2023-fgd"
POLLUX_DIR = "pollux-workloads"
TRACE_DIRS = (PHILLY_DIR, ALIBABA_DIR, POLLUX_DIR)


class DataNotFound(FileNotFoundError):
    """No trace data folder was found; the message lists where we looked and what to do."""


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
