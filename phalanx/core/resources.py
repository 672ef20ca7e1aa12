"""Host CPUs and memory as scheduled resources, beside the GPUs.

A gang may ask each replica for CPUs (in thousandths: `cpu_milli`) and memory (bytes). A node offers what its agent
reported; a replica fits a node only with both free there, and a gang is reserved all or nothing, GPUs and host
resources together (ClusterCapacity.reserve). The GPU index (core.capacity) stays a histogram of free GPUs: for a
gang that asks for host resources, placement runs on a view whose nodes offer only the GPUs their free CPUs and
memory can feed (placement's `_fitted_view`), built only when some node's CPUs or memory bind for that gang.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import NodeCapacity, ReplicaPlacement

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([KMGTP])(?:iB|i|B)?|B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}

MAX_CPUS = 1 << 20  # per replica: more than any host has, small enough for exact thousandths in a float
MAX_MEMORY = 1 << 60  # bytes per replica (1 EiB)


def parse_size(text: str) -> int:
    """'512M' -> 536870912; binary units K, M, G, T, P (case-insensitive, optional 'i'/'iB'/'B'), or plain bytes."""
    m = _SIZE.fullmatch(text.strip())
    try:
        n = Decimal(m.group(1)) * _UNITS[(m.group(2) or "").upper()] if m else Decimal(0)
    except InvalidOperation:
        n = Decimal(0)
    if n <= 0 or n != int(n) or n > MAX_MEMORY:
        raise ValueError(f"memory size {text!r} is not a size like 512M or 64G")
    return int(n)


def format_size(n: int) -> str:
    """536870912 -> '512M': the largest binary unit that divides n exactly; 'B' when none does."""
    for unit in ("P", "T", "G", "M", "K"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return f"{n}B"


def human_size(n: int) -> str:
    """536870912 -> '512M', 1.5 GiB -> '1.5G': for people (rounded to one decimal), not for parsing back."""
    for unit in ("P", "T", "G", "M", "K"):
        if n >= _UNITS[unit]:
            value = n / _UNITS[unit]
            return f"{value:.1f}".rstrip("0").rstrip(".") + unit
    return f"{n}B"


def cpu_milli(cpus: float) -> int:
    """CPUs as a request gives them (0.5, 8) -> thousandths; ValueError when not a count of CPUs."""
    if not math.isfinite(cpus) or cpus < 0 or cpus > MAX_CPUS:
        raise ValueError(f"CPUs per replica must be between 0 and {MAX_CPUS}, got {cpus}")
    milli = round(cpus * 1000)
    if cpus and not milli:
        raise ValueError(f"CPUs per replica must be at least 0.001, got {cpus}")
    return milli


def format_cpus(milli: int) -> str:
    """8000 -> '8', 500 -> '0.5'."""
    return f"{milli / 1000:.3f}".rstrip("0").rstrip(".")


def describe(cpu: int, memory: int) -> str:
    """'8 CPUs and 64G memory', '8 CPUs', '64G memory'; '' when neither is asked."""
    parts = []
    if cpu:
        parts.append(f"{format_cpus(cpu)} CPU{'' if cpu == 1000 else 's'}")
    if memory:
        parts.append(f"{format_size(memory)} memory")
    return " and ".join(parts)


def room(node: NodeCapacity, cpu: int, memory: int) -> int | None:
    """How many more replicas asking `cpu` thousandths of CPUs and `memory` bytes fit `node`'s free host resources;
    None when the request asks for neither (no bound)."""
    bound: int | None = None
    if cpu:
        bound = max(0, node.cpu_milli - node.cpu_used) // cpu
    if memory:
        by_memory = max(0, node.memory - node.memory_used) // memory
        bound = by_memory if bound is None else min(bound, by_memory)
    return bound


def check_use(nodes: dict[str, NodeCapacity], replicas: Iterable[ReplicaPlacement]) -> str:
    """Why the replicas' host resources do not fit their nodes together ('' when they do)."""
    want: dict[str, list[int]] = {}
    for rep in replicas:
        if rep.cpu_milli or rep.memory:
            use = want.setdefault(rep.node, [0, 0])
            use[0] += rep.cpu_milli
            use[1] += rep.memory
    for name, (cpu, memory) in want.items():
        node = nodes.get(name)
        if node is None:
            return f"unknown node {name!r}"
        if cpu and node.cpu_used + cpu > node.cpu_milli:
            return (
                f"{name} has {format_cpus(max(0, node.cpu_milli - node.cpu_used))} of its "
                f"{format_cpus(node.cpu_milli)} CPUs free, not {format_cpus(cpu)}"
            )
        if memory and node.memory_used + memory > node.memory:
            return (
                f"{name} has {human_size(max(0, node.memory - node.memory_used))} of its "
                f"{human_size(node.memory)} memory free, not {human_size(memory)}"
            )
    return ""
