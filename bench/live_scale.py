"""The real scheduler at size: 4,096 nodes x 8 GPUs, 10,000 pending gangs, 100,000 finished jobs (issue 18).

Setup, on a fresh PostgreSQL database (created and dropped):
- 100,000 finished jobs (with an attempt each) written into the ledger's history first;
- a real `phalanx-scheduler` process (services.scheduler.main) on a rail-optimized fat-tree of 4,096 nodes
  (scalable units of 32 nodes under one leaf group, 16 units per spine group), with Prometheus metrics on;
- 4,096 lightweight agents (phalanx.testing.lite_agent: the real node protocol, no processes) in a process of
  their own, sharing 16 gRPC channels, heartbeating every 10 s;
- 10,000 gangs of mixed sizes (1 GPU to 128 nodes x 8 GPUs, one rank per replica, ranks that run 10-60 s and
  exit, each with a time limit backfill plans with): the first ones fill the cluster, the rest wait;
- a steady stream for --steady seconds: one new gang per reservation (so about 10,000 keep waiting), a cancel of
  a random waiting gang twice a second, completions as the ranks exit; readers time the first page of `phalanx
  jobs` (ListJobs), `phalanx job` (GetJob) and `phalanx goodput` (GetGoodput) twice a second.
Then a second replica starts on the same database and the same stream runs again with half the submits and
cancels sent to it (a follower: its writes reach the leader through the ledger).

It prints: bring-up time (first registration to every node READY); the leader's cycle time p50 and p99 (from its
phalanx_scheduler_cycle_seconds histogram: the upper bound of the bucket holding the quantile) with 1 and 2
replicas; reservations per second with 1 and 2 replicas (RUNNING events on a WatchJobs stream); submit latency
p99; the latencies of the reads; the scheduler's RSS on the empty database, with the history, with the nodes and
with the live jobs.

Targets (exit status 1 when one is missed; --no-targets only prints):
- bring-up under 60 s;
- cycle p99 under 200 ms with 10,000 pending, with 1 and with 2 replicas;
- 2 replicas reserve at least 0.95x as fast as 1 (the same offered load; the margin is this machine's noise);
- a first page of `phalanx jobs` under 100 ms (p50), `phalanx job` under 100 ms (p50);
- memory grows with the nodes and the live jobs only: the 100,000 finished jobs add under 64 MiB;
- the deep-queue drain (issue 35): after the first steady phase a quarter of the running gangs is cancelled at
  once with the queue still deep; the gangs reserved in the first second of the refill, per second, are at least
  0.5x the empty-cluster rate (300 gangs of the mix submitted 64 at a time before any queue, then cancelled), and
  the first refill's delay is printed (it must not wait for a cycle period).

Run: .venv/bin/python bench/live_scale.py [--quick] [--no-targets] [--nodes 4096] [--pending 10000]
     [--history 100000] [--steady 60] [--db URL]
Progress goes to stderr; the last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc
import psycopg
from helpers.procs import start_scheduler
from sqlalchemy import insert

from db.engine import make_engine, normalize_url
from db.migrate import upgrade
from db.models import Job, JobAttempt
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.core.fabric import default_fabric, to_slurm_tree
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler import accounting

RUNNING = common_pb2.JOB_STATE_RUNNING
PENDING = common_pb2.JOB_STATE_PENDING
# (replicas, GPUs per replica) and weight: 1 GPU to 128 nodes; about 49 GPUs a gang on average
SHAPES = [((1, 1), 35), ((1, 8), 30), ((2, 8), 15), ((8, 8), 12), ((32, 8), 6), ((128, 8), 2)]


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


# Every cycle logs its duration (cycle_slow, services/scheduler/service.py), for CycleLog
EVERY_CYCLE = {"PHALANX_SLOW_CYCLE_MS": "0"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Histogram:
    """A Prometheus histogram scraped from /metrics: cumulative bucket counts by upper bound."""

    def __init__(self, text: str, name: str, labels: str = "") -> None:
        """`labels`: the series' other labels as the exposition writes them (`method="SubmitJob"`), if any."""
        self.buckets: dict[float, float] = {}
        self.count = self.sum = 0.0
        want = set(re.findall(r'\w+="[^"]*"', labels))
        for line in text.splitlines():
            m = re.match(rf"{name}_(bucket|count|sum)(?:{{(.*)}})? (\S+)$", line)
            if m is None:
                continue
            kind, found, value = m.group(1), set(re.findall(r'\w+="[^"]*"', m.group(2) or "")), float(m.group(3))
            le = next((x for x in found if x.startswith("le=")), None)
            if found - {le} != want:
                continue  # another series (the exposition puts `le` first, then the others)
            if kind == "bucket" and le is not None:
                self.buckets[float(le[4:-1])] = value
            elif kind == "count":
                self.count = value
            elif kind == "sum":
                self.sum = value

    def minus(self, other: Histogram) -> Histogram:
        out = Histogram("", "")
        out.buckets = {le: c - other.buckets.get(le, 0.0) for le, c in self.buckets.items()}
        out.count, out.sum = self.count - other.count, self.sum - other.sum
        return out

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket that holds the q-quantile (an upper bound of it)."""
        want = q * self.count
        for le in sorted(self.buckets):
            if self.buckets[le] >= want:
                return le
        return float("inf")


class CycleLog:
    """Every cycle's duration, measured (not a histogram's bucket): the scheduler runs with PHALANX_SLOW_CYCLE_MS=0,
    so each cycle logs `cycle_slow ms=...`; a phase reads the lines written since its start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size

    def since_mark(self) -> list[float]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            text = f.read().decode(errors="replace")
        out = []
        for line in text.splitlines():
            if "cycle_slow" not in line:
                continue
            if line.startswith("{"):  # the services log JSON when stderr is not a terminal
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("event") == "cycle_slow":
                        out.append(float(event["ms"]) / 1000)
            elif m := re.search(r"\bms=([0-9.]+)", line):
                out.append(float(m.group(1)) / 1000)
        return out


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def scrape(port: int, name: str = "phalanx_scheduler_cycle_seconds") -> Histogram:
    return Histogram(metrics_text(port), name)


def rpc_latency(port: int, method: str) -> Histogram:
    """The scheduler's handling time of one unary method (phalanx_rpc_latency_seconds), as a histogram."""
    return Histogram(metrics_text(port), "phalanx_rpc_latency_seconds", f'method="{method}"')


def lane_batches(port: int, lane: str) -> Histogram:
    """One lane's transactions (phalanx_scheduler_status_lane_batch_seconds): status, or accept."""
    return Histogram(metrics_text(port), "phalanx_scheduler_status_lane_batch_seconds", f'lane="{lane}"')


def gauge(port: int, name: str) -> float:
    for line in metrics_text(port).splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return float("nan")


def leader_epoch(ports: list[int]) -> tuple[int, float]:
    """(the port of the replica that leads now, its leadership epoch)."""
    for port in ports:
        if gauge(port, "phalanx_scheduler_leader") == 1:
            return port, gauge(port, "phalanx_scheduler_leader_epoch")
    return ports[0], float("nan")


def seed_history(db_url: str, count: int) -> None:
    """`count` finished jobs submitted over the last 60 days, each with one attempt, accounted (what goodput reads)."""
    engine = make_engine(db_url)
    now = time.time()
    rng = random.Random(7)
    batch = 5000
    with engine.begin() as conn:
        for start in range(0, count, batch):
            jobs, attempts = [], []
            for i in range(start, min(count, start + batch)):
                (replicas, gpus), _ = rng.choices(SHAPES, [w for _, w in SHAPES])[0]
                submitted = now - rng.uniform(3600, 60 * 86400)
                began = submitted + rng.uniform(1, 600)
                ended = began + rng.uniform(60, 8 * 3600)
                state = rng.choices(["SUCCEEDED", "FAILED", "CANCELLED"], [85, 10, 5])[0]
                job_id = f"h{i:011d}{uuid.uuid4().hex[:8]}"
                jobs.append(
                    dict(
                        id=job_id,
                        name=f"history-{i}",
                        state=state,
                        priority=0,
                        replicas=replicas,
                        gpus_per_replica=gpus,
                        procs_per_replica=1,
                        command=["train.py", "--config", f"run-{i}.yaml"],
                        env={},
                        attempt=1,
                        message="exited 0" if state == "SUCCEEDED" else state.lower(),
                        exit_code=0 if state == "SUCCEEDED" else 1,
                        placement={},
                        submitted_at=submitted,
                        started_at=began,
                        finished_at=ended,
                        version=3,
                        struck_nodes=[],
                    )
                )
                attempts.append(
                    dict(
                        job_id=job_id,
                        attempt=1,
                        gpus=float(replicas * gpus),
                        reserved_at=began,
                        running_at=began + 5,
                        ended_at=ended,
                        outcome=state,
                        reason="",
                    )
                )
            conn.execute(insert(Job), jobs)
            conn.execute(insert(JobAttempt), attempts)
            # accounted as the scheduler that finished them would have (into goodput_totals, jobs.accounted)
            accounting.account_finished(conn, [j["id"] for j in jobs], now)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("ANALYZE")  # the statistics autovacuum would have by now on a cluster with this history
    engine.dispose()


def agents_process(address: str, nodes: int, channels: int, pipe) -> None:
    async def run() -> None:
        chans = [grpc.aio.insecure_channel(address) for _ in range(channels)]
        reports: list[tuple[float, float]] = []  # (wall time, seconds) of every rank report, for the phases
        agents = [
            LiteAgent(
                address, f"node-{i:04d}", shared_channel=chans[i % channels], ack_delay=1.0, report_latency=reports
            )
            for i in range(nodes)
        ]
        gate = asyncio.Semaphore(256)

        async def start(agent: LiteAgent) -> None:
            async with gate:
                await agent.start()

        pipe.send(("starting", time.time()))
        await asyncio.gather(*(start(a) for a in agents))
        pipe.send(("registered", time.time()))
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        for a in agents:
            await a.stop()
        for c in chans:
            await c.close()
        pipe.send(("reports", reports))

    asyncio.run(run())


class Load:
    """Submits, cancels, watches and reads through real gRPC stubs, against one or two replicas."""

    def __init__(self, addresses: list[str], rng: random.Random, runtime: tuple[float, float], nodes: int) -> None:
        self.shapes = [(s, w) for s, w in SHAPES if s[0] <= nodes]  # a gang larger than the cluster is refused
        self.channels = [grpc.aio.insecure_channel(a) for a in addresses for _ in range(2)]
        self.stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self.channels]
        self.rng = rng
        self.runtime = runtime
        self.state: dict[str, int] = {}
        self.reserved_at: list[float] = []
        self.reserved_time: dict[str, float] = {}  # job id -> when its first RUNNING event came
        self.submit_latency: list[float] = []
        self.cancels = 0
        self.read_errors: list[str] = []

    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return self.rng.choice(self.stubs)

    async def close(self) -> None:
        for c in self.channels:
            await c.close()

    def spec(self) -> common_pb2.JobSpec:
        (replicas, gpus), _ = self.rng.choices(self.shapes, [w for _, w in self.shapes])[0]
        run = round(self.rng.uniform(*self.runtime), 1)
        return common_pb2.JobSpec(
            name=f"load-{replicas}x{gpus}",
            replicas=replicas,
            gpus_per_replica=gpus,
            procs_per_replica=1,
            command=["sleep", str(run)],
            time_limit_s=run * 3 + 30,
        )

    async def submit(self, measure: bool = False) -> str:
        t0 = time.perf_counter()
        job = await self.stub().SubmitJob(scheduler_pb2.SubmitJobRequest(spec=self.spec()), timeout=60)
        if measure:
            self.submit_latency.append(time.perf_counter() - t0)
        self.state.setdefault(job.id, job.state)
        if job.state == RUNNING:  # decided at submit: the reply may come before the event
            self.reserved_time.setdefault(job.id, time.perf_counter())
        return job.id

    async def empty_rate(self, count: int, concurrency: int = 64) -> tuple[float, int]:
        """The admission rate on the empty cluster, before any queue: `count` gangs of the mix (a fraction of the
        cluster) submitted `concurrency` at a time; gangs reserved per second from the first submit to the last
        reservation. Then they are cancelled, so the cluster is empty again for the fill."""
        t0 = time.perf_counter()
        ids: list[str] = []
        left = [count]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                ids.append(await self.submit())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        deadline = time.perf_counter() + 30
        while time.perf_counter() < deadline and any(self.state.get(j) == PENDING for j in ids):
            await asyncio.sleep(0.05)
        times = [self.reserved_time[j] for j in ids if j in self.reserved_time]
        rate = len(times) / (max(times) - t0) if times else 0.0
        await self.cancel_all(ids)
        return rate, len(times)

    async def cancel_all(self, job_ids: list[str]) -> None:
        """Cancel these jobs at once, one CancelJob each, concurrently (one that ended meanwhile is passed over)."""

        async def cancel(job_id: str) -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.stub().CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id), timeout=60)

        await asyncio.gather(*(cancel(j) for j in job_ids))

    async def submit_many(self, count: int, concurrency: int = 64) -> None:
        left = [count]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                await self.submit()

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def watch(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        async for event in stub.WatchJobs(scheduler_pb2.WatchJobsRequest()):
            job = event.job
            was = self.state.get(job.id)
            self.state[job.id] = job.state
            if job.state == RUNNING and was != RUNNING:
                self.reserved_at.append(time.perf_counter())
                self.reserved_time.setdefault(job.id, self.reserved_at[-1])

    def pending(self) -> list[str]:
        return [j for j, s in self.state.items() if s == PENDING]

    def burst(self, since: float, window: float = 1.0) -> tuple[int, float, float]:
        """The reservations after `since`: (how many in the `window` seconds from the first of them, seconds from
        `since` to that first one, the rate in gangs/s over that window, or over the span of those reservations
        when they end sooner). Gangs that end on their own keep reserving in the background at a far lower rate."""
        times = sorted(t for t in self.reserved_at if t >= since)
        if not times:
            return 0, float("nan"), 0.0
        inside = [t for t in times if t - times[0] <= window]
        span = min(window, inside[-1] - inside[0])
        return len(inside), times[0] - since, (len(inside) / span if len(inside) > 1 and span > 0 else 0.0)

    async def drain(self, fraction: float) -> dict:
        """Free `fraction` of the running gangs at once (one CancelJob each, concurrently) with the queue deep, and
        measure the refill (issue 35 item 3: a freed capacity is refilled without waiting for a cycle period, and at
        more than one admission per cycle): the first reservation after the first cancel; the reservations from the
        first cancel to one second after the last cancel was answered (the window), and the drain rate, those
        reservations over the span from the first cancel to the last of them (the refill is bounded by what was
        freed: once that is taken, the window's rest only dilutes the rate). Anchored at the cancels, not at the
        first reservation after them (a gang that ended on its own just then anchored it before the refill began,
        and the rate measured the wait)."""
        running = [j for j, st in self.state.items() if st == RUNNING]
        victims = self.rng.sample(running, min(len(running), max(1, int(len(running) * fraction))))
        t0 = time.perf_counter()
        await self.cancel_all(victims)
        cancelled = time.perf_counter() - t0
        await asyncio.sleep(2.0)  # the window's second, and then some
        _, first, _ = self.burst(t0)
        window = cancelled + 1.0
        inside = sorted(t for t in self.reserved_at if t0 <= t <= t0 + window)
        span = (inside[-1] - t0) if inside else window  # the drain: from the first cancel to its last reservation
        return {
            "cancelled": len(victims),
            "cancels_s": round(cancelled, 3),
            "refill_first_ms": ms(first),
            "refill_reservations": len(inside),
            "window_s": round(window, 3),
            "span_s": round(span, 3),
            "per_window_s": round(len(inside) / window, 1),
            "drain_per_s": round(len(inside) / span, 1) if span > 0 else 0.0,
        }

    async def steady(self, seconds: float, reads: dict[str, list[float]]) -> tuple[float, int]:
        """One new gang per reservation, two cancels a second; returns (reservations/s, reservations)."""
        end = time.perf_counter() + seconds
        start_count = len(self.reserved_at)
        t0 = time.perf_counter()

        async def refill() -> None:
            seen = len(self.reserved_at)
            while time.perf_counter() < end:
                now = len(self.reserved_at)
                await asyncio.gather(*(self.submit(measure=True) for _ in range(min(now - seen, 64))))
                seen += min(now - seen, 64)
                await asyncio.sleep(0.05)

        async def cancel() -> None:
            while time.perf_counter() < end:
                await asyncio.sleep(0.5)
                waiting = self.pending()
                if waiting:
                    victim = self.rng.choice(waiting)
                    self.state[victim] = common_pb2.JOB_STATE_CANCELLED
                    try:
                        await self.stub().CancelJob(scheduler_pb2.CancelJobRequest(job_id=victim), timeout=30)
                        self.cancels += 1
                    except grpc.aio.AioRpcError:
                        pass  # it started or finished meanwhile

        async def read() -> None:
            some = next(iter(self.state))
            calls = (
                ("jobs_page", lambda s: s.ListJobs(scheduler_pb2.ListJobsRequest(page_size=100), timeout=30)),
                ("job", lambda s: s.GetJob(scheduler_pb2.GetJobRequest(job_id=some), timeout=30)),
                ("goodput", lambda s: s.GetGoodput(scheduler_pb2.GetGoodputRequest(), timeout=60)),
            )
            while time.perf_counter() < end:
                for key, call in calls:
                    t = time.perf_counter()
                    try:
                        await call(self.stubs[0])
                        reads[key].append(time.perf_counter() - t)
                    except grpc.aio.AioRpcError as exc:  # counted, and the run goes on
                        self.read_errors.append(f"{key}: {exc.code().name} {exc.details()[:120]}")
                await asyncio.sleep(0.5)

        await asyncio.gather(refill(), cancel(), read())
        done = len(self.reserved_at) - start_count
        return done / (time.perf_counter() - t0), done


class VacuumStandIn:
    """What autovacuum does on a default server, for one whose autovacuum is off (this build machine's): VACUUM
    (ANALYZE) of the bench's database every `interval` seconds, on a thread of its own. Without it the planner keeps
    the statistics of an empty ledger (allocations "empty" with half a million rows) and dead rows pile up, and the
    archive's deletes and scans take seconds of the server's CPU each."""

    def __init__(self, db_url: str, interval: float = 20.0) -> None:
        self.url, self.interval = db_url, interval
        self.stop = threading.Event()
        self.runs = 0
        self.thread = threading.Thread(target=self._run, name="vacuum-stand-in", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute("VACUUM (ANALYZE)")
                self.runs += 1
            except psycopg.Error as exc:
                say(f"vacuum stand-in: {exc}")


def autovacuum_on(admin_url: str) -> bool:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        (value,) = conn.execute("SHOW autovacuum").fetchone()
    return value == "on"


def goodput_direct(db_url: str, samples: int = 10) -> list[float]:
    """GetGoodput's read (accounting.read_goodput_report, first page) run by the bench's own process on its own
    connection, in one snapshot as the scheduler reads it: what the read costs the database and Python alone, beside
    what the scheduler's reply costs with its threads busy (which sets whether its p99 is the read or the process)."""
    engine = make_engine(db_url)
    took = []
    try:
        for _ in range(samples):
            t = time.perf_counter()
            with engine.connect() as conn:
                conn = conn.execution_options(isolation_level="REPEATABLE READ", readonly=True)
                with conn.begin():
                    accounting.read_goodput_report(conn, time.time(), limit=100)
            took.append(time.perf_counter() - t)
    finally:
        engine.dispose()
    return took


async def wait_ready(db_url: str, nodes: int, timeout: float) -> float:
    plain = normalize_url(db_url).replace("postgresql+psycopg://", "postgresql://")
    deadline = time.time() + timeout
    with psycopg.connect(plain, autocommit=True) as conn:
        while time.time() < deadline:
            (ready,) = conn.execute("SELECT count(*) FROM nodes WHERE state = 'READY'").fetchone()
            if ready >= nodes:
                return time.time()
            await asyncio.sleep(0.2)
    raise SystemExit(f"only {ready} of {nodes} nodes READY after {timeout:.0f} s")


async def run(args, workdir: Path) -> dict:
    admin = normalize_url(args.db).replace("postgresql+psycopg://", "postgresql://")
    db_name = f"phalanx_live_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    db_url = admin.rsplit("/", 1)[0] + "/" + db_name
    results: dict = {"nodes": args.nodes, "gpus": args.nodes * 8, "pending_target": args.pending}
    procs = []
    agent_proc = None
    phases: dict[int, tuple[float, float]] = {}  # steady phase -> its wall-clock span (the agents' report times)
    vacuum: VacuumStandIn | None = None
    results["server_autovacuum"] = autovacuum_on(admin)
    if not results["server_autovacuum"]:
        say("the server runs with autovacuum off: the bench vacuums and analyzes its database every 20 s instead")
        vacuum = VacuumStandIn(db_url)
    try:
        upgrade(db_url)
        fabric = default_fabric([f"node-{i:04d}" for i in range(args.nodes)], nodes_per_leaf=32, leaves_per_spine=16)
        fabric_file = workdir / "topology.conf"
        fabric_file.write_text(to_slurm_tree(fabric))
        flags = [
            "--fabric",
            str(fabric_file),
            "--heartbeat-interval",
            "10",
            "--lease-timeout",
            "600",
            "--launch-timeout",
            "3600",
        ]

        # RSS on the empty ledger, then with the history: the history must cost (almost) nothing.
        probe = start_scheduler(db_url, workdir / "probe.log", *flags)
        time.sleep(1.0)
        results["rss_empty_mib"] = rss_mib(probe.proc.pid)
        probe.terminate()
        say(f"scheduler RSS on an empty ledger: {results['rss_empty_mib']} MiB")
        t = time.perf_counter()
        seed_history(db_url, args.history)
        say(f"history: {args.history} finished jobs written in {time.perf_counter() - t:.1f} s")

        port_a = free_port()
        flags += args.scheduler_arg
        a = start_scheduler(db_url, workdir / "scheduler-a.log", *flags, "--metrics-port", str(port_a), env=EVERY_CYCLE)
        cycles_a = CycleLog(workdir / "scheduler-a.log")
        procs.append(a)
        time.sleep(1.0)
        results["rss_history_mib"] = rss_mib(a.proc.pid)
        say(f"scheduler RSS with the history: {results['rss_history_mib']} MiB")

        ctx = multiprocessing.get_context("spawn")
        pipe, child = ctx.Pipe()
        agent_proc = ctx.Process(target=agents_process, args=(a.address, args.nodes, 16, child))
        agent_proc.start()
        _, started = await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        if vacuum is not None:
            vacuum.thread.start()
        ready = await wait_ready(db_url, args.nodes, timeout=600)
        results["bringup_s"] = round(ready - started, 2)
        results["rss_nodes_mib"] = rss_mib(a.proc.pid)
        say(f"bring-up: {args.nodes} nodes READY in {results['bringup_s']} s; RSS {results['rss_nodes_mib']} MiB")

        rng = random.Random(11)
        load = Load([a.address], rng, args.runtime, args.nodes)
        watcher = asyncio.create_task(load.watch(load.stubs[0]))
        await asyncio.sleep(0.5)
        probe = max(10, min(300, args.nodes * 8 // 100))
        rate, reserved = await load.empty_rate(probe)
        results["empty_cluster_per_s"] = round(rate, 1)
        say(f"empty cluster: {reserved} of {probe} gangs reserved, 64 submits at a time: {rate:.1f} gangs/s")
        await asyncio.sleep(1.0)
        t = time.perf_counter()
        await load.submit_many(args.pending)
        say(f"{args.pending} gangs submitted in {time.perf_counter() - t:.1f} s")
        await asyncio.sleep(2.0)
        results["running_after_fill"] = sum(1 for s in load.state.values() if s == RUNNING)
        results["pending_after_fill"] = len(load.pending())
        say(f"running {results['running_after_fill']}, pending {results['pending_after_fill']}")

        reads: dict[str, list[float]] = {"jobs_page": [], "job": [], "goodput": []}
        before = scrape(port_a)
        rpc_before = {
            m: rpc_latency(port_a, m) for m in ("SchedulerServicer/SubmitJob", "NodeServicer/ReportRankStatus")
        }
        lanes_before = {lane: lane_batches(port_a, lane) for lane in ("status", "accept")}
        cycles_a.mark()
        started = time.time()
        rate1, n1 = await load.steady(args.steady, reads)
        phases[1] = (started, time.time())
        cycles = scrape(port_a).minus(before)
        measured = cycles_a.since_mark()
        for method, earlier in rpc_before.items():  # the server's handling time: without the bench's own loop
            served = rpc_latency(port_a, method).minus(earlier)
            name = method.split("/")[-1]
            results[f"server_{name}_p50_le_ms"] = ms(served.quantile(0.5))
            results[f"server_{name}_p99_le_ms"] = ms(served.quantile(0.99))
        for lane, earlier in lanes_before.items():  # the lanes' transactions: rank rows and beats; accepted jobs
            batches = lane_batches(port_a, lane).minus(earlier)
            results[f"{lane}_lane_batches_1"] = int(batches.count)
            results[f"{lane}_lane_batch_p50_le_ms"] = ms(batches.quantile(0.5))
            results[f"{lane}_lane_batch_p99_le_ms"] = ms(batches.quantile(0.99))
        results.update(
            reservations_per_s_1=round(rate1, 1),
            reservations_1=n1,
            cycles_1=int(cycles.count),
            cycle_p50_ms_1=ms(cycles.quantile(0.5)),
            cycle_p99_ms_1=ms(cycles.quantile(0.99)),
            cycle_mean_ms_1=ms(cycles.sum / max(cycles.count, 1)),
            cycle_measured_p50_ms_1=ms(pct(measured, 50)),
            cycle_measured_p99_ms_1=ms(pct(measured, 99)),
            cycle_measured_max_ms_1=ms(max(measured, default=float("nan"))),
            submit_p50_ms=ms(pct(load.submit_latency, 50)),
            submit_p99_ms=ms(pct(load.submit_latency, 99)),
            pending_1=len(load.pending()),
            rss_live_mib=rss_mib(a.proc.pid),
            live_jobs=sum(1 for s in load.state.values() if s in (PENDING, RUNNING)),
        )
        for key, values in reads.items():
            results[f"{key}_p50_ms"] = ms(pct(values, 50))
            results[f"{key}_p99_ms"] = ms(pct(values, 99))
        say(
            f"1 replica: {rate1:.1f} reservations/s ({n1}); cycles {int(cycles.count)}: p50 <= "
            f"{results['cycle_p50_ms_1']} ms, p99 <= {results['cycle_p99_ms_1']} ms, mean "
            f"{results['cycle_mean_ms_1']} ms; measured p50 {results['cycle_measured_p50_ms_1']} ms p99 "
            f"{results['cycle_measured_p99_ms_1']} ms; submit p50 {results['submit_p50_ms']} ms p99 "
            f"{results['submit_p99_ms']} ms; pending {results['pending_1']}"
        )
        say(
            f"reads: jobs page p50 {results['jobs_page_p50_ms']} ms (p99 {results['jobs_page_p99_ms']}), job "
            f"{results['job_p50_ms']} ms, goodput {results['goodput_p50_ms']} ms (p99 {results['goodput_p99_ms']})"
        )
        say(f"RSS with {results['live_jobs']} live jobs: {results['rss_live_mib']} MiB")
        say(
            "the scheduler's own handling time (histogram buckets' upper bounds): SubmitJob p50 <= "
            f"{results['server_SubmitJob_p50_le_ms']} ms p99 <= {results['server_SubmitJob_p99_le_ms']} ms; "
            f"ReportRankStatus p50 <= {results['server_ReportRankStatus_p50_le_ms']} ms p99 <= "
            f"{results['server_ReportRankStatus_p99_le_ms']} ms; the status lane's {results['status_lane_batches_1']} "
            f"transactions p50 <= {results['status_lane_batch_p50_le_ms']} ms p99 <= "
            f"{results['status_lane_batch_p99_le_ms']} ms; the accept writer's {results['accept_lane_batches_1']} "
            f"p50 <= {results['accept_lane_batch_p50_le_ms']} ms p99 <= {results['accept_lane_batch_p99_le_ms']} ms"
        )
        direct = goodput_direct(db_url)
        results["goodput_direct_p50_ms"], results["goodput_direct_p99_ms"] = ms(pct(direct, 50)), ms(pct(direct, 99))
        say(
            f"goodput read by this process, straight from the ledger (no scheduler, no gRPC): p50 "
            f"{results['goodput_direct_p50_ms']} ms, p99 {results['goodput_direct_p99_ms']} ms"
        )

        drain = await load.drain(0.25)
        results.update({k if k.startswith("drain_") else f"drain_{k}": v for k, v in drain.items()})
        empty = results["empty_cluster_per_s"]
        results["drain_over_empty"] = round(drain["drain_per_s"] / empty, 3) if empty else 0.0
        say(
            f"deep queue ({len(load.pending())} pending): {drain['cancelled']} running gangs cancelled in "
            f"{drain['cancels_s']} s; first refill {drain['refill_first_ms']} ms after the first cancel; "
            f"{drain['refill_reservations']} reserved in the {drain['window_s']} s from the first cancel to 1 s after "
            f"the last ({drain['per_window_s']}/s), the last of them {drain['span_s']} s after the first cancel: "
            f"{drain['drain_per_s']} gangs/s ({results['drain_over_empty']}x the empty-cluster rate)"
        )
        reports = {}
        for line in metrics_text(port_a).splitlines():
            m = re.match(r'phalanx_scheduler_rank_reports_total\{path="(\w+)"\} (\S+)', line)
            if m:
                reports[m.group(1)] = int(float(m.group(2)))
        results["rank_reports"] = reports
        say(f"rank reports by path so far: {reports}")

        port_b = free_port()
        b = start_scheduler(db_url, workdir / "scheduler-b.log", *flags, "--metrics-port", str(port_b), env=EVERY_CYCLE)
        logs = {port_a: CycleLog(workdir / "scheduler-a.log"), port_b: CycleLog(workdir / "scheduler-b.log")}
        procs.append(b)
        await asyncio.sleep(2.0)
        load_b = Load([b.address], rng, args.runtime, args.nodes)
        load.stubs += load_b.stubs
        load.channels += load_b.channels
        reads2: dict[str, list[float]] = {"jobs_page": [], "job": [], "goodput": []}
        # The leader's cycles: the replica that leads at the end (leadership can move under load; then the count of
        # epochs says so and the figures are those of the one that led at the end, over the whole phase).
        ports = [port_a, port_b]
        _, epoch_before = leader_epoch(ports)
        before_all = {port: scrape(port) for port in ports}
        for log_file in logs.values():
            log_file.mark()
        started = time.time()
        rate2, n2 = await load.steady(args.steady, reads2)
        phases[2] = (started, time.time())
        leader_port, epoch_after = leader_epoch(ports)
        cycles = scrape(leader_port).minus(before_all[leader_port])
        measured = logs[leader_port].since_mark()
        results.update(
            leader_2="a" if leader_port == port_a else "b",
            leadership_changes_2=int(epoch_after - epoch_before) if epoch_after == epoch_after else -1,
        )
        results.update(
            reservations_per_s_2=round(rate2, 1),
            reservations_2=n2,
            cycles_2=int(cycles.count),
            cycle_p50_ms_2=ms(cycles.quantile(0.5)),
            cycle_p99_ms_2=ms(cycles.quantile(0.99)),
            cycle_mean_ms_2=ms(cycles.sum / max(cycles.count, 1)),
            cycle_measured_p50_ms_2=ms(pct(measured, 50)),
            cycle_measured_p99_ms_2=ms(pct(measured, 99)),
            replicas_ratio=round(rate2 / rate1, 3) if rate1 else 0.0,
            read_errors=len(load.read_errors),
        )
        for line in load.read_errors[:5]:
            say(f"read error: {line}")
        say(
            f"2 replicas: {rate2:.1f} reservations/s ({n2}, {results['replicas_ratio']}x one); leader "
            f"({results['leader_2']}, {results['leadership_changes_2']} leadership changes) cycles "
            f"{int(cycles.count)}: p50 <= {results['cycle_p50_ms_2']} ms, p99 <= {results['cycle_p99_ms_2']} ms, "
            f"mean {results['cycle_mean_ms_2']} ms; measured p50 {results['cycle_measured_p50_ms_2']} ms p99 "
            f"{results['cycle_measured_p99_ms_2']} ms"
        )
        watcher.cancel()
        await load.close()
    finally:
        if vacuum is not None:
            vacuum.stop.set()
            vacuum.thread.join(60)
            results["vacuum_stand_in_runs"] = vacuum.runs
        if agent_proc is not None:
            pipe.send("stop")
            reports: list = []
            while pipe.poll(60):  # (the agents' earlier notes may be unread: skip to their reports)
                kind, body = pipe.recv()
                if kind == "reports":
                    reports = body
                    break
            if reports:
                for n, (start, end) in phases.items():
                    took = [s for t, s in reports if start <= t <= end]
                    results[f"rank_report_p50_ms_{n}"] = ms(pct(took, 50))
                    results[f"rank_report_p99_ms_{n}"] = ms(pct(took, 99))
                    results[f"rank_reports_{n}"] = len(took)
                    say(
                        f"rank reports, phase {n}: {len(took)} answered, p50 {results[f'rank_report_p50_ms_{n}']} ms, "
                        f"p99 {results[f'rank_report_p99_ms_{n}']} ms"
                    )
            agent_proc.join(60)
            if agent_proc.is_alive():
                agent_proc.kill()
        for p in procs:
            p.terminate()
        if args.keep_db:
            say(f"the database is kept (--keep-db): {db_url}")
        else:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
    return results


def check_targets(r: dict) -> list[str]:
    missed = []
    if not r["bringup_s"] < 60:
        missed.append(f"bring-up {r['bringup_s']} s, target < 60 s")
    for n in (1, 2):
        if not r[f"cycle_measured_p99_ms_{n}"] < 200:
            missed.append(
                f"cycle p99 with {n} replica(s) {r[f'cycle_measured_p99_ms_{n}']} ms (measured), target < 200"
            )
    if not r["replicas_ratio"] >= 0.95:
        missed.append(f"2 replicas at {r['replicas_ratio']}x the reservation rate of 1, target >= 0.95x")
    if not r["jobs_page_p50_ms"] < 100:
        missed.append(f"first page of phalanx jobs {r['jobs_page_p50_ms']} ms, target < 100 ms")
    if not r["job_p50_ms"] < 100:
        missed.append(f"phalanx job {r['job_p50_ms']} ms, target < 100 ms")
    if not r["drain_over_empty"] >= 0.5:
        missed.append(
            f"deep-queue drain {r['drain_per_s']} gangs/s, {r['drain_over_empty']}x the empty-cluster rate "
            f"({r['empty_cluster_per_s']}/s), target >= 0.5x (issue 35)"
        )
    if not r["rss_history_mib"] - r["rss_empty_mib"] < 64:
        missed.append(
            f"the history adds {r['rss_history_mib'] - r['rss_empty_mib']:.0f} MiB to the scheduler, target < 64"
        )
    return missed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--db",
        default=os.environ.get("PHALANX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test"),
        help="PostgreSQL server (a database is created and dropped)",
    )
    p.add_argument("--nodes", type=int, default=4096)
    p.add_argument("--pending", type=int, default=10000)
    p.add_argument("--history", type=int, default=100000)
    p.add_argument("--steady", type=float, default=60.0, help="seconds of each steady phase")
    p.add_argument(
        "--runtime",
        default=None,
        type=lambda s: tuple(float(x) for x in s.split(",")),
        metavar="LO,HI",
        help="seconds a gang's ranks run, uniform in [LO, HI] (default 10,60; --quick 3,15)",
    )
    p.add_argument(
        "--quick", action="store_true", help="512 nodes, 1,000 gangs, 10,000 finished jobs, 15 s phases (CI size)"
    )
    p.add_argument("--no-targets", action="store_true", help="print the figures; do not check the targets")
    p.add_argument("--keep-db", action="store_true", help="keep the bench's database at the end (to study it)")
    p.add_argument(
        "--scheduler-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for the schedulers (repeatable; e.g. --scheduler-arg=--no-status-lane for a baseline)",
    )
    args = p.parse_args()
    if args.quick:
        args.nodes, args.pending, args.history, args.steady = 512, 1000, 10000, 15.0
    if args.runtime is None:
        args.runtime = (3.0, 15.0) if args.quick else (10.0, 60.0)
    workdir = Path(tempfile.mkdtemp(prefix="phalanx-live-scale-"))
    say(f"logs: {workdir}")
    results = asyncio.run(run(args, workdir))
    missed = [] if args.no_targets else check_targets(results)
    results["targets_missed"] = missed
    for line in missed:
        say(f"TARGET MISSED: {line}")
    print(json.dumps(results))
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
