"""Node failures for the trace replays: a Poisson process per node at a published rate, seeded and reproducible.

The rate. Meta's Llama 3 report (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4) counts 419
unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs, 78% of them attributed to
hardware: 419 / (54 x 16,384) = 4.74e-4 interruptions per GPU-day (`LLAMA3_PER_GPU_DAY`), a node of 8 GPUs
failing about every 264 days. It is the one rate per unit of hardware we can cite: the traces in `../shared/data/`
(AcmeTrace, Helios, Alibaba, Philly) give the share of *jobs* that failed (Acme's Seren 42.9%, Kalos 39.7%; Helios
15.5%), mostly user errors, not node failures per unit of time, so they do not give a node failure rate.

The process. Each node fails after an exponential time at `rate` x its GPUs per day, is down for a repair time
(exponential with mean `repair_mean_s`, a stated assumption: the report gives no repair time), then returns and can
fail again. Each node draws from its own generator, seeded by (seed, node name): the failures are the same whatever
the scheduling policy does, so policies compared with the same seed meet the same failures.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_HARDWARE_SHARE = 0.78
LLAMA3_PER_GPU_DAY = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * LLAMA3_GPUS)  # 4.74e-4
DEFAULT_REPAIR_HOURS = 4.0  # a stated assumption (not cited): a node drained, diagnosed, fixed or swapped

FAILURE_NAMES = {"llama3": LLAMA3_PER_GPU_DAY, "none": 0.0}


def parse_failure_rate(text: str | float) -> float:
    """`llama3` (Llama 3's 4.74e-4), `none` (0), or a rate in failures per GPU-day (`4.7e-4`, `llama3x10` for ten
    times Llama 3's). Raises ValueError with the accepted forms."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        t = text.strip().lower()
        base, _, times = t.partition("x")
        try:
            if base in FAILURE_NAMES:
                value = FAILURE_NAMES[base] * (float(times) if times else 1.0)
            else:
                value = float(t)
        except ValueError:
            value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"failure rate {text!r}: give llama3 (419 interruptions in 54 days on 16,384 GPUs, 4.74e-4 per "
            "GPU-day), llama3xN (N times that), none, or a number of failures per GPU-day >= 0"
        )
    return value


@dataclass(frozen=True)
class FailureModel:
    """Failures per GPU-day, the GPUs of a node, and the mean repair time (seconds)."""

    per_gpu_day: float = LLAMA3_PER_GPU_DAY
    gpus_per_node: int = 8
    repair_mean_s: float = DEFAULT_REPAIR_HOURS * 3600.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.per_gpu_day) and self.per_gpu_day >= 0):
            raise ValueError(f"per_gpu_day must be a finite number >= 0, got {self.per_gpu_day!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if not (math.isfinite(self.repair_mean_s) and self.repair_mean_s > 0):
            raise ValueError(f"repair_mean_s must be > 0, got {self.repair_mean_s!r}")

    @property
    def node_rate_per_s(self) -> float:
        return self.per_gpu_day * self.gpus_per_node / 86400.0


class NodeFailures:
    """The failure stream of every node: `next_failure(node, after)` and `repair_s(node)`, each node from its own
    generator, so the draws of one node do not depend on when the others are asked."""

    def __init__(self, model: FailureModel, seed: int = 0) -> None:
        self.model, self.seed = model, seed
        self._rngs: dict[str, random.Random] = {}

    def _rng(self, node: str) -> random.Random:
        rng = self._rngs.get(node)
        if rng is None:
            rng = self._rngs[node] = random.Random(f"phalanx-failures:{self.seed}:{node}")
        return rng

    def next_failure(self, node: str, after: float) -> float:
        """When `node`, up from `after`, fails next (inf at rate 0)."""
        rate = self.model.node_rate_per_s
        return after + self._rng(node).expovariate(rate) if rate > 0 else math.inf

    def repair_s(self, node: str) -> float:
        """How long `node`, failing now, stays down."""
        return self._rng(node).expovariate(1.0 / self.model.repair_mean_s)


@dataclass(frozen=True, order=True)
class Outage:
    down_at: float
    node: str
    up_at: float


def draw_outages(nodes: Iterable[str], model: FailureModel, horizon_s: float, seed: int = 0) -> list[Outage]:
    """Every outage that starts before `horizon_s`, in time order: the stream the replays use, drawn ahead."""
    stream = NodeFailures(model, seed)
    out: list[Outage] = []
    for node in nodes:
        t = stream.next_failure(node, 0.0)
        while t < horizon_s:
            up = t + stream.repair_s(node)
            out.append(Outage(t, node, up))
            t = stream.next_failure(node, up)
    return sorted(out)
