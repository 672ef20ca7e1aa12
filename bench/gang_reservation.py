"""Submit-to-reserved latency and throughput through the real gRPC + PostgreSQL path.

For each cluster size (256 and 512 nodes x 8 GPUs) it starts a real scheduler process on a fresh PostgreSQL
database, registers lightweight agents that speak the real node protocol (phalanx.testing.lite_agent), and
measures:
- latency: one gang at a time on an idle cluster, SubmitJob call to the RUNNING event on a WatchJobs stream,
  for gangs of 1, 8 and 64 GPUs;
- throughput: 8 concurrent SDK clients submit a mix of 1-, 8- and 64-GPU gangs that fills the cluster; the rate
  is gangs reserved per second from the first submit to the last reservation (durable commits, no tricks);
- release-to-reserve: a pending 64-GPU gang, and the time from the cancel that makes room to its reservation.
Baselines from the same run: the durable commit floor (one INSERT + COMMIT on the same server) and a naive
one-transaction-per-submit writer with 8 threads, which is what a scheduler without group commit can reach.

Targets (issue 18), as ratios to the baselines of the same run, at every cluster size (exit status 1 when one is
missed; --no-targets only prints):
- a 1-GPU gang from SubmitJob to its RUNNING event in at most 8x the commit floor at p50, a 64-GPU gang in 12x;
- at least 0.45x the naive writer's rate with 8 SDK clients;
- a freed slot refilled (release-to-reserve) in under 5 ms at p50.

Run: .venv/bin/python bench/gang_reservation.py [--nodes 256,512] [--quick] [--no-targets]
The last line of output is one JSON object with every figure (and `targets_missed`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc
import psycopg
from helpers.procs import start_scheduler

from db.engine import normalize_url
from db.migrate import upgrade
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.client import AsyncClient
from phalanx.core.fabric import default_fabric, to_slurm_tree
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

RUNNING = common_pb2.JOB_STATE_RUNNING
SHAPES = {1: (1, 1), 8: (1, 8), 64: (8, 8)}  # GPUs -> (replicas, gpus per replica)


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def gang_mix(nodes: int) -> list[int]:
    """The throughput phase's gangs (GPU counts, keys of SHAPES) for `nodes` x 8 GPUs: a quarter of the GPUs in
    64-GPU gangs, a quarter in 8-GPU gangs, half in 1-GPU gangs (bench/peers.py replays the same mix on Ray)."""
    total = nodes * 8
    return [64] * (total // 4 // 64) + [8] * (total // 4 // 8) + [1] * (total // 2)


class Bench:
    def __init__(self, admin_url: str, nodes: int, workdir: Path, scheduler_args: tuple[str, ...] = ()) -> None:
        self.scheduler_args = scheduler_args  # more phalanx-scheduler flags (peers.py: --no-admission-lane)
        self.admin_url = admin_url
        self.nodes = nodes
        self.workdir = workdir
        self.reserved: dict[str, float] = {}
        self.waiters: dict[str, asyncio.Future] = {}

    async def __aenter__(self) -> Bench:
        self.db_name = f"phalanx_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.db_name}"')
        self.db_url = self.admin_url.rsplit("/", 1)[0] + "/" + self.db_name
        upgrade(self.db_url)
        # A SuperPOD-like fabric: scalable units of 32 nodes under one leaf group, 8 units per spine.
        fabric = default_fabric([f"node-{i:04d}" for i in range(self.nodes)], nodes_per_leaf=32, leaves_per_spine=8)
        fabric_file = self.workdir / f"topology-{self.nodes}.conf"
        fabric_file.write_text(to_slurm_tree(fabric))
        self.scheduler = start_scheduler(
            self.db_url,
            self.workdir / f"scheduler-{self.nodes}.log",
            "--launch-timeout",
            "3600",
            "--lease-timeout",
            "600",
            "--heartbeat-interval",
            "10",
            "--fabric",
            str(fabric_file),
            *self.scheduler_args,
        )
        self.started = time.monotonic()  # (the scheduler's service exists once it listens)
        # Agents live in their own process, so their gRPC work does not slow the measuring clients.
        ctx = multiprocessing.get_context("spawn")
        self.agent_pipe, child = ctx.Pipe()
        self.agent_proc = ctx.Process(target=agents_process, args=(self.scheduler.address, self.nodes, child))
        self.agent_proc.start()
        await asyncio.get_running_loop().run_in_executor(None, self.agent_pipe.recv)
        self.channel = grpc.aio.insecure_channel(self.scheduler.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.watch_task = asyncio.create_task(self._watch())
        await asyncio.sleep(0.5)
        # The scheduler decides before the clock row's lock (the fence in the pipeline) once it had time to hear
        # any other replica: two thirds of its lease after its start (SchedulerService._fence_off_until). Measure
        # from then, so the figures are of the path it keeps.
        quiet = SchedulerSettings.leader_lease_s * 2 / 3
        await asyncio.sleep(max(0.0, self.started + quiet - time.monotonic()))
        return self

    async def __aexit__(self, *exc) -> None:
        self.watch_task.cancel()
        self.agent_pipe.send("stop")
        self.agent_proc.join(30)
        await self.channel.close()
        self.scheduler.terminate()
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')

    async def _watch(self) -> None:
        async for event in self.stub.WatchJobs(scheduler_pb2.WatchJobsRequest()):
            job = event.job
            if job.state == RUNNING and job.id not in self.reserved:
                self.reserved[job.id] = time.perf_counter()
                fut = self.waiters.pop(job.id, None)
                if fut and not fut.done():
                    fut.set_result(None)

    async def wait_reserved(self, job_id: str, timeout: float = 30.0) -> float:
        if job_id not in self.reserved:
            fut = asyncio.get_running_loop().create_future()
            self.waiters[job_id] = fut
            if job_id not in self.reserved:
                await asyncio.wait_for(fut, timeout)
        return self.reserved[job_id]

    async def submit(self, gpus: int, command=("hang",), stub=None) -> str:
        r, g = SHAPES[gpus]
        spec = common_pb2.JobSpec(name=f"bench-{gpus}", replicas=r, gpus_per_replica=g, command=list(command))
        job = await (stub or self.stub).SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))
        return job.id

    async def cancel(self, job_id: str) -> None:
        await self.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id))

    async def cancel_all(self, ids: list[str], concurrency: int = 128) -> None:
        gate = asyncio.Semaphore(concurrency)

        async def one(job_id: str) -> None:
            async with gate:
                await self.cancel(job_id)

        await asyncio.gather(*(one(i) for i in ids))

    async def latency(self, gpus: int, samples: int) -> list[float]:
        out = []
        for _ in range(samples):
            t0 = time.perf_counter()
            job_id = await self.submit(gpus)
            out.append(await self.wait_reserved(job_id) - t0)
            await self.cancel(job_id)
        return out

    async def throughput(self, clients: int, rounds: int, inflight: int) -> list[float]:
        mix = gang_mix(self.nodes)
        rates = []
        sdk = [AsyncClient(self.scheduler.address, timeout=60) for _ in range(clients)]
        try:
            for _ in range(rounds):
                queue = list(mix)
                ids: list[str] = []
                t0 = time.perf_counter()

                async def worker(client: AsyncClient, queue: list[int] = queue, ids: list[str] = ids) -> None:
                    while queue:
                        gpus = queue.pop()
                        r, g = SHAPES[gpus]
                        job = await client.submit(f"tp-{gpus}", r, g, ["hang"])
                        ids.append(job.id)

                # Each SDK client pipelines `inflight` submissions at a time (an asyncio client is built for it).
                await asyncio.gather(*(worker(c) for c in sdk for _ in range(inflight)))
                last = max([await self.wait_reserved(i, 60) for i in ids])
                rates.append(len(ids) / (last - t0))
                await self.cancel_all(ids)
                await asyncio.sleep(0.3)
        finally:
            for c in sdk:
                await c.close()
        return rates

    async def release_to_reserve(self, samples: int) -> list[float]:
        out = []
        blockers = [await self.submit(8) for _ in range(self.nodes)]
        for b in blockers:
            await self.wait_reserved(b)
        for _ in range(samples):
            big = await self.submit(64)
            await asyncio.sleep(0.05)
            assert big not in self.reserved, "the cluster should be full"
            freed = blockers[:8]
            blockers = blockers[8:]
            for b in freed[:-1]:
                await self.cancel(b)
            t_release = time.perf_counter()  # the last cancel's release is what makes room
            await self.cancel(freed[-1])
            out.append(await self.wait_reserved(big) - t_release)
            await self.cancel(big)
            refill = [await self.submit(8) for _ in range(8)]
            for b in refill:
                await self.wait_reserved(b)
            blockers += refill
        for b in blockers:
            await self.cancel(b)
        return out


def agents_process(address: str, nodes: int, pipe) -> None:
    async def run() -> None:
        agents = [LiteAgent(address, f"node-{i:04d}") for i in range(nodes)]
        for i in range(0, nodes, 64):
            await asyncio.gather(*(a.start() for a in agents[i : i + 64]))
        pipe.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        for a in agents:
            await a.stop()

    asyncio.run(run())


def quiesce(admin_url: str) -> None:
    """Flush dirty buffers left by the previous phase, so a background checkpoint does not land in this one."""
    try:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute("CHECKPOINT")
    except psycopg.Error as exc:  # needs a superuser or pg_checkpoint; the figures are just noisier without it
        say(f"note: could not CHECKPOINT before measuring ({exc.__class__.__name__})")
    time.sleep(1.0)


def commit_floor(admin_url: str, samples: int = 500) -> float:
    with psycopg.connect(admin_url) as conn:
        conn.execute("CREATE TEMP TABLE floor (id text, body text)")
        conn.commit()
        out = []
        for _ in range(samples):
            t0 = time.perf_counter()
            conn.execute("INSERT INTO floor VALUES (%s, %s)", (uuid.uuid4().hex, "x" * 200))
            conn.commit()
            out.append(time.perf_counter() - t0)
    return pct(out, 50)


def naive_writer_rate(admin_url: str, threads: int = 8, seconds: float = 2.0) -> float:
    """One transaction per submission from 8 threads: the ceiling without group commit."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_naive (id text primary key, body text)")
    count = [0]
    stop = time.perf_counter() + seconds

    def run() -> None:
        with psycopg.connect(admin_url) as conn:
            n = 0
            while time.perf_counter() < stop:
                conn.execute("INSERT INTO bench_naive VALUES (%s, %s)", (uuid.uuid4().hex, "x" * 200))
                conn.commit()
                n += 1
            count[0] += n

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute("DROP TABLE bench_naive")
    return count[0] / seconds


async def run(args) -> dict:
    admin = normalize_url(args.db).replace("postgresql+psycopg://", "postgresql://")
    results: dict = {
        "commit_floor_ms": round(commit_floor(admin) * 1000, 3),
        "naive_txn_per_submit_per_s": round(naive_writer_rate(admin)),
    }
    say(
        f"baseline: durable commit p50 {results['commit_floor_ms']} ms; "
        f"naive one-txn-per-submit x8 threads {results['naive_txn_per_submit_per_s']}/s"
    )
    workdir = Path(tempfile.mkdtemp(prefix="phalanx-bench-"))
    for nodes in args.nodes:
        say(f"--- {nodes} nodes x 8 GPUs ---")
        async with Bench(admin, nodes, workdir) as bench:
            quiesce(admin)
            for gpus in (1, 8, 64):
                lat = await bench.latency(gpus, args.samples)
                key = f"n{nodes}_g{gpus}"
                results[f"{key}_p50_ms"] = round(pct(lat, 50) * 1000, 2)
                results[f"{key}_p99_ms"] = round(pct(lat, 99) * 1000, 2)
                say(f"latency {gpus:>2}-GPU gang: p50 {results[f'{key}_p50_ms']} ms, p99 {results[f'{key}_p99_ms']} ms")
            rates = await bench.throughput(args.clients, args.rounds, args.inflight)
            results[f"n{nodes}_throughput_gangs_per_s"] = round(statistics.median(rates), 1)
            say(
                f"throughput, {args.clients} SDK clients x {args.inflight} in flight, mixed 1/8/64-GPU gangs: "
                f"{results[f'n{nodes}_throughput_gangs_per_s']} gangs/s (rounds: {[round(r) for r in rates]})"
            )
            rel = await bench.release_to_reserve(args.release_samples)
            results[f"n{nodes}_release_to_reserve_p50_ms"] = round(pct(rel, 50) * 1000, 2)
            results[f"n{nodes}_release_to_reserve_p99_ms"] = round(pct(rel, 99) * 1000, 2)
            say(
                f"release-to-reserve of a pending 64-GPU gang: p50 {results[f'n{nodes}_release_to_reserve_p50_ms']} "
                f"ms, p99 {results[f'n{nodes}_release_to_reserve_p99_ms']} ms"
            )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--db",
        default=os.environ.get("PHALANX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test"),
        help="PostgreSQL server (a database per cluster size is created and dropped)",
    )
    p.add_argument("--nodes", default="256,512", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inflight", type=int, default=8, help="submissions each client keeps in flight")
    p.add_argument("--release-samples", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small sample counts, for a smoke run")
    p.add_argument("--no-targets", action="store_true", help="print the figures; do not check the targets")
    args = p.parse_args()
    if args.quick:
        args.samples, args.rounds, args.release_samples = 10, 1, 3
    results = asyncio.run(run(args))
    missed = check_targets(results, args.nodes)
    for line in missed:
        say(("target missed: " if not args.no_targets else "below target: ") + line)
    results["targets_missed"] = missed
    print(json.dumps(results))
    sys.exit(1 if missed and not args.no_targets else 0)


def check_targets(r: dict, sizes: list[int]) -> list[str]:
    floor, naive = r["commit_floor_ms"], r["naive_txn_per_submit_per_s"]
    missed = []
    for n in sizes:
        for gpus, bound in ((1, 8), (64, 12)):
            ratio = r[f"n{n}_g{gpus}_p50_ms"] / floor
            r[f"n{n}_g{gpus}_p50_over_floor"] = round(ratio, 2)
            if ratio > bound:
                missed.append(f"{n} nodes: {gpus}-GPU gang p50 is {ratio:.1f}x the commit floor, target <= {bound}x")
        rate = r[f"n{n}_throughput_gangs_per_s"] / naive
        r[f"n{n}_throughput_over_naive"] = round(rate, 3)
        if rate < 0.45:
            missed.append(f"{n} nodes: {rate:.2f}x the naive writer's rate, target >= 0.45x")
        refill = r[f"n{n}_release_to_reserve_p50_ms"]
        if refill >= 5:
            missed.append(f"{n} nodes: a freed slot refilled in {refill} ms at p50, target < 5 ms")
    return missed


if __name__ == "__main__":
    main()
