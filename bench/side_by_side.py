"""Two schedulers side by side, their samples interleaved one by one: a change measured on a noisy machine.

Sequential runs of one configuration differ by more than a change is often worth on a shared 2-core machine (the
same 1-GPU p50 ranged 4.1-7.1 ms from run to run on 2026-12-08). This bench starts scheduler A (this tree, as it
is) and scheduler B (this tree with `--b-flag` flags, or the scheduler of another checkout with `--b-tree`) at once,
each with its own database and lightweight agents (bench/gang_reservation.py's setup), and alternates the two
sample by sample (A B, then B A), so that whatever slows the machine slows both:

- submit to reserved (the SubmitJob call to the moment the client first knows: the reply in RUNNING or the
  WatchJobs RUNNING event), then a cancel, for a 1-GPU gang and a 4 x 8 gang;
- with `--release-rounds N`, release to reserve as gang_reservation.py measures it (a 64-GPU gang pending on a full
  cluster, 8 nodes freed), in batches alternated between A and B.

Examples:
    python bench/side_by_side.py --b-flag=--no-fence-in-pipeline
    git worktree add /tmp/base HEAD~3 && cp -r phalanx/api/v1 /tmp/base/phalanx/api/ &&
        python bench/side_by_side.py --b-tree /tmp/base

It prints each figure as it comes and ends with one JSON line (A/B ratios below 1: A is faster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT)]

import gang_reservation as gr
from helpers import procs

from db.engine import normalize_url
from phalanx.api.v1 import common_pb2, scheduler_pb2

WARMUP = 5  # pairs of samples dropped at the start of each shape


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def sample(bench: gr.Bench, spec: common_pb2.JobSpec) -> float:
    t0 = time.perf_counter()
    job = await bench.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))
    t_reply = time.perf_counter()
    t_event = await bench.wait_reserved(job.id)
    await bench.cancel(job.id)
    return (min(t_reply, t_event) if job.state == gr.RUNNING else t_event) - t0


async def start(admin: str, nodes: int, workdir: Path, flags: tuple[str, ...], tree: Path | None) -> gr.Bench:
    here = procs.ROOT
    procs.ROOT = tree or here  # start_scheduler runs `python -m services.scheduler.main` from procs.ROOT
    try:
        bench = gr.Bench(admin, nodes, workdir, flags)
        await bench.__aenter__()
    finally:
        procs.ROOT = here
    return bench


def figure(a: list[float], b: list[float]) -> dict:
    pa, pb = statistics.median(a) * 1000, statistics.median(b) * 1000
    return {"a_p50_ms": round(pa, 3), "b_p50_ms": round(pb, 3), "a_over_b": round(pa / pb, 3), "samples": len(a)}


async def run(args) -> dict:
    admin = normalize_url(args.db).replace("postgresql+psycopg://", "postgresql://")
    flags = tuple(args.b_flag)
    tree = Path(args.b_tree).resolve() if args.b_tree else None
    out: dict = {"bench": "side_by_side", "nodes": args.nodes, "b_flags": list(flags), "b_tree": str(tree or "")}
    a = await start(admin, args.nodes, Path(tempfile.mkdtemp(prefix="phalanx-a-")), (), None)
    try:
        b = await start(admin, args.nodes, Path(tempfile.mkdtemp(prefix="phalanx-b-")), flags, tree)
        try:
            gr.quiesce(admin)
            for replicas, gpus in ((1, 1), (4, 8)):
                spec = common_pb2.JobSpec(name="side-by-side", replicas=replicas, gpus_per_replica=gpus)
                spec.command.append("hang")
                times: dict[str, list[float]] = {"a": [], "b": []}
                for i in range(args.samples + WARMUP):
                    for name, bench in (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a)):
                        took = await sample(bench, spec)
                        if i >= WARMUP:
                            times[name].append(took)
                key = f"g{replicas}x{gpus}"
                out[key] = figure(times["a"], times["b"])
                say(f"{replicas} x {gpus}: {out[key]}")
            if args.release_rounds:
                times = {"a": [], "b": []}
                for i in range(args.release_rounds):
                    for name, bench in (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a)):
                        times[name] += await bench.release_to_reserve(args.release_per_round)
                out["release_to_reserve"] = figure(times["a"], times["b"])
                say(f"release to reserve: {out['release_to_reserve']}")
        finally:
            await b.__aexit__(None, None, None)
    finally:
        await a.__aexit__(None, None, None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b-flag", action="append", default=[], metavar="FLAG", help="a scheduler flag for B (repeatable)")
    p.add_argument("--b-tree", default=None, help="B runs the scheduler of this checkout (its protobuf code built)")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--samples", type=int, default=300, help="samples per shape and scheduler")
    p.add_argument(
        "--release-rounds", type=int, default=0, help="batches of release-to-reserve samples (needs 8+ nodes)"
    )
    p.add_argument("--release-per-round", type=int, default=6)
    p.add_argument("--db", default="postgresql://postgres@127.0.0.1:5432/test", help="PostgreSQL (databases are made)")
    args = p.parse_args()
    if not args.b_flag and not args.b_tree:
        p.error("say what B is: --b-flag FLAG or --b-tree PATH")
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
