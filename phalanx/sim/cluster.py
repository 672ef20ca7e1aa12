"""What a replay runs on and what it replays: the virtual cluster's shape (:class:`ClusterSpec`: nodes, GPUs,
the fabric's leaves and spines) and the fields a trace job must have (:class:`Job`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.model import NodeCapacity


class Job(Protocol):
    # Read-only (properties): a replay only reads them, and a trace's jobs are frozen (TraceJob).
    @property
    def job_id(self) -> str: ...
    @property
    def submit_s(self) -> float: ...
    @property
    def replicas(self) -> int: ...
    @property
    def gpus_per_replica(self) -> int: ...
    @property
    def gpu_milli(self) -> int: ...
    @property
    def duration_s(self) -> float: ...


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    gpus: int = 8
    per_leaf: int = 32
    leaves_per_spine: int = 16
    oversub: float = 1.0  # leaf -> spine oversubscription for the network model (1: non-blocking)

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """ "NODESxGPUS[,leaf=N][,spine=N][,oversub=R]", e.g. "512x8,leaf=32,spine=16,oversub=2"."""
        head, *opts = [p.strip() for p in text.split(",")]
        try:
            nodes, _, gpus = head.lower().partition("x")
            counts = {"nodes": int(nodes), "gpus": int(gpus or 8)}
            oversub = cls.oversub
            for opt in opts:
                key, _, value = opt.partition("=")
                if key == "oversub":
                    oversub = float(value)
                else:
                    counts[{"leaf": "per_leaf", "spine": "leaves_per_spine"}[key]] = int(value)
        except (ValueError, KeyError):
            raise ValueError(
                f"cluster {text!r}: give NODESxGPUS[,leaf=N][,spine=N][,oversub=R], e.g. 512x8,leaf=32"
            ) from None
        out = cls(**counts, oversub=oversub)
        if min(out.nodes, out.gpus, out.per_leaf, out.leaves_per_spine, out.oversub) < 1:
            raise ValueError(f"cluster {text!r}: every number must be >= 1")
        return out

    def fabric(self):
        names = [f"n{i:05d}" for i in range(self.nodes)]
        return default_fabric(names, nodes_per_leaf=self.per_leaf, leaves_per_spine=self.leaves_per_spine)

    def build(self, topology: bool = True) -> tuple[ClusterCapacity, tuple[str, ...], dict[str, tuple[str, ...]]]:
        fabric = self.fabric()
        paths = {n: fabric.path(n) for n in fabric.paths}
        cap = ClusterCapacity(
            NodeCapacity(n, self.gpus, set(range(self.gpus)), True, paths[n] if topology else ()) for n in paths
        )
        return cap, (fabric.tiers if topology else ()), paths
