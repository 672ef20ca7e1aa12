"""What host CPUs and memory cost placement (phalanx.core): the time to place an 8 x 8-GPU gang on a 4,096-node
cluster (8 GPUs each, 32 nodes per leaf, 8 leaves per spine), half of it taken, in three cases of the same run:

- `gpus_only`: the gang asks for no CPUs or memory (the baseline: the GPU index alone);
- `cpus_fit`: each replica asks for 16 CPUs and 256G, which every node can still feed (a scan of the nodes, then
  the GPU index as before);
- `cpus_bind`: 16 CPUs per replica where the running gangs hold most of the CPUs of a third of the nodes (a view
  of the GPUs those nodes' CPUs can feed, with its own index, then the search).

And the reservation's check (ClusterCapacity.reserve of such a placement, host resources included) against one
without them. Every placement is checked: no node gets more CPUs or memory than it has.

Run: .venv/bin/python bench/host_resources.py [--nodes N] [--samples N]
The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import place_gang

G = 2**30


def cluster(nodes: int, seed: int, squeeze: bool) -> ClusterCapacity:
    """Half of every node's GPUs taken at random; with `squeeze`, a third of the nodes have only 8 CPUs left."""
    rng = random.Random(seed)
    caps = []
    for i in range(nodes):
        leaf, spine = f"leaf{i // 32}", f"spine{i // 256}"
        node = NodeCapacity(f"n{i:05d}", 8, set(range(8)), True, (leaf, spine), cpu_milli=192_000, memory=2048 * G)
        caps.append(node)
    cap = ClusterCapacity(caps)
    for node in caps:
        taken = tuple(sorted(rng.sample(range(8), rng.choice((0, 4, 4, 8)))))
        if taken:
            cpu = 184_000 if squeeze and rng.random() < 1 / 3 else 32_000
            cap.reserve(
                Placement("busy", (ReplicaPlacement(0, node.name, taken, cpu_milli=cpu, memory=256 * G),), "", 0, 0, "")
            )
    return cap


def timed(cap: ClusterCapacity, request: GangRequest, samples: int) -> tuple[list[float], Placement]:
    times, got = [], None
    for _ in range(samples):
        t0 = time.perf_counter()
        got = place_gang(cap, request)
        times.append((time.perf_counter() - t0) * 1000)
    assert isinstance(got, Placement), got
    return times, got


def p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=15)
    args = ap.parse_args()
    out: dict[str, float | int] = {"nodes": args.nodes}
    plain = GangRequest("g", 8, 8)
    asks = GangRequest("g", 8, 8, cpu_milli=16_000, memory=256 * G)
    for name, cap, request in (
        ("gpus_only", cluster(args.nodes, 1, False), plain),
        ("cpus_fit", cluster(args.nodes, 1, False), asks),
        ("cpus_bind", cluster(args.nodes, 1, True), asks),
    ):
        times, got = timed(cap, request, args.samples)
        out[f"{name}_place_ms_p50"] = p50(times)
        out[f"{name}_place_ms_max"] = round(max(times), 3)
        t0 = time.perf_counter()
        cap.reserve(got)
        out[f"{name}_reserve_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        over = [n.name for n in cap.nodes.values() if n.cpu_used > n.cpu_milli or n.memory_used > n.memory]
        assert not over, f"overcommitted: {over[:5]}"
        print(
            f"{name:10s} place p50 {out[f'{name}_place_ms_p50']:8.2f} ms  max {out[f'{name}_place_ms_max']:8.2f} ms  "
            f"reserve {out[f'{name}_reserve_ms']:6.3f} ms  tier {got.tier}, {got.domains} domain(s)",
            flush=True,
        )
    out["bind_vs_gpus_only"] = round(out["cpus_bind_place_ms_p50"] / max(out["gpus_only_place_ms_p50"], 1e-6), 2)
    out["fit_vs_gpus_only"] = round(out["cpus_fit_place_ms_p50"] / max(out["gpus_only_place_ms_p50"], 1e-6), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
