"""Checkpoint commit latency through the real coordinator, on SQLite and PostgreSQL (issue 16).

For each database (a fresh migrated SQLite file; a fresh PostgreSQL database when the server answers, dropped at
the end) it starts a real checkpoint coordinator (`services.checkpoint_coordinator.serve()` on 127.0.0.1 port 0,
its default 5 s sweep, JSON logs to a file) in its own process, so the measuring client does not share its GIL,
and writes into the ledger what the scheduler records for a RUNNING gang of N ranks: its nodes and GPUs, the job
(attempt 1) and one allocation per GPU (N/8 replicas x 8 GPUs), so the coordinator's fence reads the world size
from the allocations as it does in production. Then for N in --ranks (default 8, 64, 512), checkpoint after
checkpoint (one warm-up checkpoint first, not counted):
- ranks 0..N-2 send ReportShard over gRPC all at once (one grpc.aio channel, every call in flight together, as a
  gang's ranks do at the end of a save), and every answer must be PENDING;
- then the last rank's ReportShard, the one that commits: the commit latency is from sending it to receiving the
  answer with state COMMITTED (p50, p99, mean; with 20 checkpoints the p99 is the worst one);
- and the time of the whole checkpoint, from the first shard sent to COMMITTED, reported as shards per second.
Baselines from the same run, same database, same server: one durable commit (a one-row INSERT in its own
transaction, `engine.begin()` on db.engine.make_engine's engine: on SQLite WAL with synchronous FULL, so every
commit syncs the WAL; on PostgreSQL synchronous_commit as the server has it, printed), and one plain unary gRPC
round trip to the coordinator (grpc.health.v1 Health/Check), half of the samples before the checkpoints and half
after; the ratio is commit p50 / (durable commit p50 + health RPC p50).

The DDP section (skipped without torch, or with --no-ddp): phalanx.examples.ddp_tiny as --ddp-ranks local gloo
ranks, --ddp-steps steps, without checkpoints (the baseline), then with a collective DCP checkpoint every
--ddp-every steps through a real coordinator (SQLite), then a second attempt that restores the last one (and must
end bit-identical to the baseline): the mean save time, the training time's overhead, the restore time.

Run: .venv/bin/python bench/checkpoint_commit.py [--ranks 8,64,512] [--checkpoints N] [--pg URL | --no-pg] [--quick]
     [--no-ddp] [--ddp-ranks 2] [--ddp-steps 200] [--ddp-every 20]
Progress goes to stderr; the last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import create_engine, insert, select, text

from db.engine import make_engine, normalize_url
from db.migrate import upgrade
from db.models import Allocation, Gpu, Job, Node
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc

DEFAULT_PG = os.environ.get("PHALANX_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
GPUS_PER_NODE = 8
RPC_TIMEOUT_S = 120.0
SYNCHRONOUS = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def default_checkpoints(ranks: int, quick: bool) -> int:
    """20 checkpoints up to 128 ranks, fewer above (512 ranks: 5), so the default run fits in about 2 minutes on
    2 cores (a 512-rank checkpoint takes about 6 s there)."""
    if quick:
        return 5 if ranks <= 64 else 2
    return max(3, min(20, 2560 // ranks))


# -- the coordinator, in its own process ------------------------------------------------------------------------


def coordinator_process(db_url: str, log_path: str, pipe) -> None:
    """serve() on 127.0.0.1:0 with its JSON logs in `log_path`; sends its address, stops on any message."""
    sys.path.insert(0, str(ROOT))
    from phalanx.common.logging import configure_logging
    from services.checkpoint_coordinator import serve

    with open(log_path, "w") as log:
        sys.stderr = log  # configure_logging writes to stderr: a file here, not a terminal, so JSON lines
        configure_logging("checkpointd")

        async def run() -> None:
            try:
                server = await serve(db_url, "127.0.0.1:0")
            except BaseException as exc:
                pipe.send(("error", f"{type(exc).__name__}: {exc}"))
                raise
            pipe.send(("ok", server.address))
            await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
            await server.stop(1.0)

        asyncio.run(run())


class Coordinator:
    def __init__(self, db_url: str, log_path: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=coordinator_process, args=(db_url, str(log_path), child), daemon=True)
        self.log_path = log_path

    def __enter__(self) -> str:
        self.proc.start()
        if not self.pipe.poll(60):
            raise RuntimeError(f"the coordinator did not start in 60 s (log: {self.log_path})")
        status, value = self.pipe.recv()
        if status != "ok":
            raise RuntimeError(f"the coordinator failed to start: {value} (log: {self.log_path})")
        return value

    def __exit__(self, *exc) -> None:
        try:
            self.pipe.send("stop")
        except OSError:
            pass
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


# -- the ledger: a RUNNING gang of N ranks, as the scheduler records it ------------------------------------------


def insert_gang(db_url: str, ranks: int) -> str:
    """Nodes of 8 GPUs, a RUNNING job (attempt 1) of ranks/8 replicas x 8 GPUs (1 replica of N GPUs under 8) and
    one allocation per GPU: the coordinator's fence counts the attempt's allocations (store.ledger_world_size)."""
    per_replica = min(ranks, GPUS_PER_NODE) if ranks % GPUS_PER_NODE == 0 or ranks < GPUS_PER_NODE else 1
    replicas = ranks // per_replica
    job_id = f"bench-ckpt-{ranks}-{uuid.uuid4().hex[:8]}"
    now = time.time()
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                insert(Job).values(
                    id=job_id,
                    name=job_id,
                    state="RUNNING",
                    replicas=replicas,
                    gpus_per_replica=per_replica,
                    procs_per_replica=0,
                    command=["train"],
                    attempt=1,
                    submitted_at=now,
                )
            )
            rows = []
            for replica in range(replicas):
                node_id = conn.execute(
                    insert(Node).values(
                        name=f"{job_id}-n{replica}",
                        state="READY",
                        gpus=GPUS_PER_NODE,
                        registered_at=now,
                        last_heartbeat=now,
                    )
                ).inserted_primary_key[0]
                conn.execute(insert(Gpu), [{"node_id": node_id, "index": i} for i in range(GPUS_PER_NODE)])
                gpus = conn.execute(
                    select(Gpu.id, Gpu.index).where(Gpu.node_id == node_id, Gpu.index < per_replica).order_by(Gpu.index)
                ).all()
                rows += [
                    {
                        "job_id": job_id,
                        "attempt": 1,
                        "replica": replica,
                        "node_id": node_id,
                        "gpu_id": g.id,
                        "gpu_index": g.index,
                        "reserved_at": now,
                    }
                    for g in gpus
                ]
            conn.execute(insert(Allocation), rows)
    finally:
        engine.dispose()
    return job_id


# -- measurements -------------------------------------------------------------------------------------------------


def _shard(job_id: str, step: int, rank: int) -> pb.Shard:
    digest = hashlib.sha256(f"{job_id}/{step}/{rank}".encode()).hexdigest()
    return pb.Shard(
        rank=rank,
        uri=f"file:///ckpt/{job_id}/step-{step}/rank-{rank}.pt",
        size_bytes=64 << 20,
        checksum=f"sha256:{digest}",
    )


async def one_checkpoint(stub, job_id: str, ranks: int, step: int) -> tuple[float, float]:
    """(last shard -> COMMITTED, first shard -> COMMITTED) in seconds."""
    reqs = [
        pb.ReportShardRequest(job_id=job_id, attempt=1, step=step, world_size=0, shard=_shard(job_id, step, r))
        for r in range(ranks)
    ]
    t0 = time.perf_counter()
    answers = await asyncio.gather(*(stub.ReportShard(r, timeout=RPC_TIMEOUT_S) for r in reqs[:-1]))
    t1 = time.perf_counter()
    last = await stub.ReportShard(reqs[-1], timeout=RPC_TIMEOUT_S)
    t2 = time.perf_counter()
    early = [a.state for a in answers if a.state != "PENDING"]
    if early:
        raise RuntimeError(
            f"step {step}: {len(early)} of the first {ranks - 1} shards answered {early[0]}, not PENDING"
        )
    if last.state != "COMMITTED" or last.world_size != ranks or len(last.shards) != ranks:
        raise RuntimeError(
            f"step {step}: the last shard answered {last.state} with {len(last.shards)} of "
            f"{last.world_size} shards; expected COMMITTED with {ranks}"
        )
    return t2 - t1, t2 - t0


def durable_commits(db_url: str, samples: int) -> list[float]:
    """One-row INSERTs, each in its own transaction through make_engine (BEGIN IMMEDIATE ... COMMIT on SQLite)."""
    engine = make_engine(db_url)
    out = []
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS bench_commit_floor (id VARCHAR(32) PRIMARY KEY, body TEXT)"))
        for i in range(samples + 5):
            row = {"id": uuid.uuid4().hex, "body": "x" * 200}
            t0 = time.perf_counter()
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO bench_commit_floor (id, body) VALUES (:id, :body)"), row)
            if i >= 5:  # the first few open the pool's connections
                out.append(time.perf_counter() - t0)
    finally:
        engine.dispose()
    return out


async def health_rpcs(channel, samples: int) -> list[float]:
    stub = health_pb2_grpc.HealthStub(channel)
    req = health_pb2.HealthCheckRequest(service="")
    out = []
    for i in range(samples + 5):
        t0 = time.perf_counter()
        await stub.Check(req, timeout=RPC_TIMEOUT_S)
        if i >= 5:
            out.append(time.perf_counter() - t0)
    return out


def durability(db_url: str) -> dict:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                database = engine.url.database
                return {
                    "journal_mode": conn.exec_driver_sql("PRAGMA journal_mode").scalar(),
                    "synchronous": SYNCHRONOUS.get(conn.exec_driver_sql("PRAGMA synchronous").scalar(), "?"),
                    "sqlite_version": conn.exec_driver_sql("SELECT sqlite_version()").scalar(),
                    "filesystem": filesystem_of(Path(database)),
                }
            return {
                name: conn.exec_driver_sql(f"SHOW {name}").scalar()
                for name in ("synchronous_commit", "fsync", "wal_sync_method", "server_version")
            }
    finally:
        engine.dispose()


def filesystem_of(path: Path) -> str:
    """The type of the mount holding `path` (tmpfs would make the SQLite baseline not durable)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if (
                    len(parts) >= 3
                    and str(path.resolve()).startswith(parts[1].rstrip("/") + "/")
                    and len(parts[1]) > len(best)
                ):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


async def measure_database(label: str, db_url: str, args, workdir: Path) -> dict:
    """Baselines and the commit latency for every N on one migrated database."""
    facts = durability(db_url)
    say(f"[{label}] durability: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    jobs = {n: insert_gang(db_url, n) for n in args.ranks}
    result: dict = {"durability": facts}
    floor: list[float] = []
    rpc: list[float] = []
    with Coordinator(db_url, workdir / f"checkpointd-{label}.log") as address:
        say(f"[{label}] coordinator at {address} (log: {workdir / f'checkpointd-{label}.log'})")
        async with grpc.aio.insecure_channel(address) as channel:
            stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(channel)
            half = max(1, args.baseline_samples // 2)
            floor += await asyncio.to_thread(durable_commits, db_url, half)
            rpc += await health_rpcs(channel, half)
            for n in args.ranks:
                count = args.checkpoints or default_checkpoints(n, args.quick)
                job_id = jobs[n]
                await one_checkpoint(stub, job_id, n, 0)  # warm-up, not counted
                commit, whole = [], []
                for step in range(1, count + 1):
                    c, w = await one_checkpoint(stub, job_id, n, step)
                    commit.append(c)
                    whole.append(w)
                figures = {
                    "checkpoints": count,
                    "commit_p50_ms": ms(pct(commit, 50)),
                    "commit_p99_ms": ms(pct(commit, 99)),
                    "commit_mean_ms": ms(statistics.fmean(commit)),
                    "checkpoint_p50_ms": ms(pct(whole, 50)),
                    "checkpoint_p99_ms": ms(pct(whole, 99)),
                    "shards_per_s": round(n / statistics.median(whole), 1),
                }
                result[str(n)] = figures
                say(
                    f"[{label}] {n:>4} ranks, {count} checkpoints: last shard -> COMMITTED p50 "
                    f"{figures['commit_p50_ms']} ms, p99 {figures['commit_p99_ms']} ms, mean "
                    f"{figures['commit_mean_ms']} ms; all {n} shards p50 {figures['checkpoint_p50_ms']} ms "
                    f"({figures['shards_per_s']} shards/s)"
                )
            floor += await asyncio.to_thread(durable_commits, db_url, half)
            rpc += await health_rpcs(channel, half)
    base = {
        "durable_commit_p50_ms": ms(pct(floor, 50)),
        "durable_commit_p99_ms": ms(pct(floor, 99)),
        "health_rpc_p50_ms": ms(pct(rpc, 50)),
        "health_rpc_p99_ms": ms(pct(rpc, 99)),
        "samples": len(floor),
    }
    result["baseline"] = base
    floor_plus_rpc = pct(floor, 50) + pct(rpc, 50)
    for n in args.ranks:
        result[str(n)]["commit_p50_over_baseline"] = round(result[str(n)]["commit_p50_ms"] / ms(floor_plus_rpc), 2)
    say(
        f"[{label}] baseline: one durable commit p50 {base['durable_commit_p50_ms']} ms (p99 "
        f"{base['durable_commit_p99_ms']} ms), one health RPC p50 {base['health_rpc_p50_ms']} ms (p99 "
        f"{base['health_rpc_p99_ms']} ms); commit p50 / (commit + RPC): "
        + ", ".join(f"{n} ranks {result[str(n)]['commit_p50_over_baseline']}x" for n in args.ranks)
    )
    return result


async def on_sqlite(args, workdir: Path) -> dict:
    db_url = f"sqlite:///{workdir / 'phalanx-bench.db'}"
    upgrade(db_url)
    return await measure_database("sqlite", db_url, args, workdir)


def pg_problem(admin_url: str) -> str | None:
    try:
        engine = create_engine(admin_url, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
        return None
    except Exception as exc:  # any failure means "no server"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


async def on_postgresql(args, workdir: Path) -> dict:
    admin_url = normalize_url(args.pg)
    problem = pg_problem(admin_url)
    if problem:
        reason = f"PostgreSQL not reachable at {admin_url} ({problem})"
        say(f"[postgresql] skipped: {reason}")
        return {"skipped": reason}
    name = f"phalanx_bench_ckpt_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    db_url = admin_url.rpartition("/")[0] + "/" + name
    try:
        upgrade(db_url)
        return await measure_database("postgresql", db_url, args, workdir)
    finally:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :n AND pid <> pg_backend_pid()"
                ),
                {"n": name},
            )
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


# -- sections: each takes the parsed arguments and returns figures merged into the final JSON object -------------


def commit_latency(args) -> dict:
    """Last shard -> COMMITTED for every N, on SQLite and PostgreSQL, with the durable-commit + RPC baseline."""
    workdir = Path(tempfile.mkdtemp(prefix="phalanx-bench-ckpt-", dir=args.workdir))
    try:
        out = {"ranks": args.ranks, "sqlite": asyncio.run(on_sqlite(args, workdir))}
        out["postgresql"] = {"skipped": "--no-pg"} if args.no_pg else asyncio.run(on_postgresql(args, workdir))
        return out
    finally:
        if args.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _ddp_gang(out: Path, steps: int, every: int, world: int, env_extra: dict[str, str]) -> list[dict]:
    """phalanx.examples.ddp_tiny as `world` local rank processes; their rank-<r>.json results."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
            **env_extra,
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "phalanx.examples.ddp_tiny",
                    "--steps",
                    str(steps),
                    "--every",
                    str(every),
                    "--out",
                    str(out),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    for rank, proc in enumerate(procs):
        text_out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"ddp_tiny rank {rank} exited {proc.returncode}: {text_out.decode()[-1500:]}")
    job = env_extra.get("PHALANX_JOB_ID", "local")
    return [json.loads((out / job / f"rank-{r}.json").read_text()) for r in range(world)]


def ddp_overhead(args) -> dict:
    """The tiny DDP job's checkpoint cost: the same training without checkpoints (the baseline), with a collective
    DCP checkpoint every --ddp-every steps through a real coordinator (SQLite), and a second attempt that restores
    the last one. Figures from the ranks' own timers (rank 0's; train_s includes the saves)."""
    import importlib.util

    if args.no_ddp:
        return {"ddp": {"skipped": "--no-ddp"}}
    if importlib.util.find_spec("torch") is None:
        return {"ddp": {"skipped": "torch is not installed (pip install 'phalanx[torch]')"}}
    world, steps, every = args.ddp_ranks, args.ddp_steps, args.ddp_every
    workdir = Path(tempfile.mkdtemp(prefix="phalanx-bench-ddp-", dir=args.workdir))
    try:
        db_url = f"sqlite:///{workdir / 'ledger.db'}"
        upgrade(db_url)
        job_id = insert_gang(db_url, world)
        say(f"ddp: {world} ranks, {steps} steps: baseline without checkpoints")
        base = _ddp_gang(workdir / "base", steps, 0, world, {})[0]
        with Coordinator(db_url, workdir / "coordinator.log") as address:
            env = {
                "PHALANX_JOB_ID": job_id,
                "PHALANX_ATTEMPT": "1",
                "PHALANX_CHECKPOINT_ADDR": address,
                "PHALANX_CHECKPOINT_DIR": str(workdir / "ckpt"),
                "PHALANX_CHECKPOINT_POLICY": "off",
            }
            say(f"ddp: the same with a collective checkpoint every {every} steps")
            saved = _ddp_gang(workdir / "out", steps, every, world, env)[0]
            engine = make_engine(db_url)
            with engine.begin() as conn:
                conn.execute(Job.__table__.update().where(Job.id == job_id).values(attempt=2))
            engine.dispose()
            say("ddp: a second attempt restores the last checkpoint")
            resumed = _ddp_gang(workdir / "out", steps, 0, world, dict(env, PHALANX_ATTEMPT="2"))[0]
        if resumed["restored_step"] != steps or resumed["params_sha256"] != base["params_sha256"]:
            raise RuntimeError(f"the resumed run does not match the baseline: {resumed} vs {base}")
        size = sum(f.stat().st_size for f in (workdir / "ckpt").rglob("*") if f.is_file()) // max(1, saved["saves"])
        return {
            "ddp": {
                "ranks": world,
                "steps": steps,
                "every": every,
                "saves": saved["saves"],
                "train_s_baseline": round(base["train_s"], 3),
                "train_s_with_checkpoints": round(saved["train_s"], 3),
                "save_ms_mean": round(ms(saved["save_s"] / max(1, saved["saves"])), 2),
                "checkpoint_overhead_pct": round(100 * (saved["train_s"] - base["train_s"]) / base["train_s"], 1),
                "restore_ms": round(ms(resumed["restore_s"]), 2),
                "checkpoint_bytes": size,
                "resumed_bit_identical": True,
            }
        }
    finally:
        if args.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


SECTIONS = [commit_latency, ddp_overhead]  # a section is f(args) -> dict, merged into the final JSON object


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--ranks",
        default=[8, 64, 512],
        type=lambda s: [int(x) for x in s.split(",")],
        help="gang sizes, comma-separated (default 8,64,512)",
    )
    p.add_argument(
        "--checkpoints",
        type=int,
        default=0,
        help="checkpoints measured per gang size (default: 20 up to 128 ranks, 5 at 512)",
    )
    p.add_argument(
        "--baseline-samples",
        type=int,
        default=400,
        help="durable commits and health RPCs, each (half before the checkpoints, half after)",
    )
    p.add_argument(
        "--pg",
        default=DEFAULT_PG,
        help="PostgreSQL server (env PHALANX_TEST_PG); a database is created for the run and dropped",
    )
    p.add_argument("--no-pg", action="store_true", help="SQLite only")
    p.add_argument("--workdir", default=None, help="where the SQLite file and the coordinator log go (a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the SQLite file and the coordinator log")
    p.add_argument("--quick", action="store_true", help="few checkpoints and baseline samples, for a smoke run")
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP job's save/restore overhead")
    p.add_argument("--ddp-ranks", type=int, default=2, help="ranks of the DDP job (default 2)")
    p.add_argument("--ddp-steps", type=int, default=200, help="training steps of the DDP job (default 200)")
    p.add_argument("--ddp-every", type=int, default=20, help="its checkpoint interval in steps (default 20)")
    args = p.parse_args()
    if any(n < 1 for n in args.ranks):
        p.error("--ranks must be positive")
    if args.quick:
        args.baseline_samples = min(args.baseline_samples, 60)
        args.ddp_steps = min(args.ddp_steps, 40)
    started = time.perf_counter()
    results: dict = {"bench": "checkpoint_commit"}
    for section in SECTIONS:
        results.update(section(args))
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
