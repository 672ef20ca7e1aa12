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
    job_id: str
    submit_s: float
    replicas: int
    gpus_per_replica: int
    gpu_milli: int
    duration_s: float


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
            spec = {"nodes": int(nodes), "gpus": int(gpus or 8)}
            for opt in opts:
                key, _, value = opt.partition("=")
                name = {"leaf": "per_leaf", "spine": "leaves_per_spine", "oversub": "oversub"}[key]
                spec[name] = float(value) if name == "oversub" else int(value)
        except (ValueError, KeyError):
            raise ValueError(
                f"cluster {text!r}: give NODESxGPUS[,leaf=N][,spine=N][,oversub=R], e.g. 512x8,leaf=32"
            ) from None
        out = cls(**spec)
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
