"""Submitting a 10,000-task job array against submitting one plain job, through the gRPC API.

An in-process scheduler (services.scheduler.main.serve) on a fresh ledger (SQLite in a temporary directory, or a
scratch PostgreSQL database made and dropped through --pg ADMIN_URL, such as
postgresql+psycopg://postgres@127.0.0.1/test) with --nodes lightweight agents of 8 GPUs
(phalanx.testing.lite_agent). SubmitJob answers once the cycle that took the submission committed, so each figure
is the whole round trip: the checks, the ledger write and the scheduling pass after it. The two kinds of submission
alternate, --repeat times each:
- plain: one gang of 1 x 8 GPUs;
- array: the same gang with --array 0-9999 (or --tasks): one ledger row for the array, plus the tasks the pass
  creates to place at once (none can start on the full cluster, so one, which holds its place in the queue).
The cluster is full (a long gang on every node) unless --idle, where each array's submission also places tasks.

Run: .venv/bin/python bench/array_submit.py [--tasks 10000] [--repeat 30] [--nodes 4] [--idle] [--pg ADMIN_URL]
The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc
from sqlalchemy import create_engine, text

from db.engine import make_engine
from db.migrate import upgrade
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def figures(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(values, 50) * 1000, 2), "p99_ms": round(pct(values, 99) * 1000, 2), "n": len(values)}


async def run(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="phalanx-array-bench-"))
    db_url = scratch_database(args.pg) if args.pg else f"sqlite:///{workdir / 'ledger.db'}"
    try:
        return await measure(args, db_url)
    finally:
        if args.pg:
            drop_scratch(args.pg, db_url)


def scratch_database(admin: str) -> str:
    """A new, empty PostgreSQL database next to `admin`'s (dropped by drop_scratch)."""
    name = f"phalanx_array_bench_{uuid.uuid4().hex[:8]}"
    engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return admin.rsplit("/", 1)[0] + "/" + name


def drop_scratch(admin: str, url: str) -> None:
    engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)'))
    engine.dispose()


async def measure(args: argparse.Namespace, db_url: str) -> dict:
    upgrade(db_url)
    settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", max_array_size=max(10_001, args.tasks))
    server = await serve(settings)
    agents = [LiteAgent(server.address, f"node-{i}") for i in range(args.nodes)]
    for agent in agents:
        await agent.start()
    channel = grpc.aio.insecure_channel(server.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def submit(name: str, command: list[str], array: str = "") -> tuple[float, common_pb2.Job]:
        spec = common_pb2.JobSpec(name=name, replicas=1, gpus_per_replica=8, command=command, array=array)
        t0 = time.perf_counter()
        job = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, request_id=uuid.uuid4().hex))
        return time.perf_counter() - t0, job

    try:
        await asyncio.sleep(0.5)  # the agents registered
        if not args.idle:
            for i in range(args.nodes):
                await submit(f"filler-{i}", ["run"])
        spec = f"0-{args.tasks - 1}"
        plain: list[float] = []
        arrays: list[float] = []
        for _ in range(3):  # warm-up: connections, caches
            await submit("warm", ["sleep", "0.01"])
        for i in range(args.repeat):
            took, _ = await submit(f"plain-{i}", ["run"])
            plain.append(took)
            took, job = await submit(f"array-{i}", ["run"], spec)
            assert job.array.tasks == args.tasks, job
            arrays.append(took)
        engine = make_engine(db_url)
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT count(*) FROM jobs")).scalar_one()
        engine.dispose()
    finally:
        await channel.close()
        for agent in agents:
            await agent.stop()
        await server.stop()
    return {
        "store": "postgresql" if args.pg else "sqlite",
        "tasks": args.tasks,
        "cluster": "idle" if args.idle else "full",
        "nodes": args.nodes,
        "plain": figures(plain),
        "array": figures(arrays),
        "ratio_p50": round(pct(arrays, 50) / pct(plain, 50), 2),
        "job_rows": rows,
        "arrays_submitted": args.repeat,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--idle", action="store_true", help="no filler gangs: arrays place tasks as they arrive")
    parser.add_argument(
        "--pg", default="", metavar="ADMIN_URL", help="PostgreSQL: a scratch database is made beside this one"
    )
    args = parser.parse_args()
    out = asyncio.run(run(args))
    say(f"{args.tasks}-task array: p50 {out['array']['p50_ms']} ms, p99 {out['array']['p99_ms']} ms")
    say(f"plain job:        p50 {out['plain']['p50_ms']} ms, p99 {out['plain']['p99_ms']} ms")
    say(f"ledger rows after {args.repeat} arrays and {args.repeat} plain jobs: {out['job_rows']}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
