"""The service controller's latency and cost, against plain gangs in the same run.

An in-process scheduler (services.scheduler.main.serve) on a fresh ledger (PostgreSQL when --pg URL is given, else
SQLite in a temporary directory) with lightweight agents speaking the real node protocol
(phalanx.testing.lite_agent), --nodes x 8 GPUs under leaves of 8. Replicas are 2 nodes x 8 GPUs; without a probe a
replica is ready once every rank runs. It measures:
- scale-up: ScaleService(K -> K+1) to the new replica's reservation (RUNNING) and to its readiness, against the
  baseline of a plain SubmitJob of the same gang to its RUNNING event;
- replica restart: a rank of a replica exits, to the replica ready again (restart always, backoff 0);
- rolling update: a service of --replicas K updated to a new revision, to every replica of it ready, with
  max-surge 0 / max-unavailable 1 and with max-surge 2 / max-unavailable 2, and the lowest ready count seen;
- steady cost: with --services steady services, the cycles per second against an idle scheduler's in the same run
  (a steady fleet should cost reads only) and the time of one reconcile read.

Run: .venv/bin/python bench/serving_control.py [--nodes 64] [--replicas 8] [--services 32] [--repeat 20]
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

from db.migrate import upgrade
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, service_pb2, service_pb2_grpc
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.serving.views import read_service_views
from services.scheduler.settings import SchedulerSettings

RUNNING = common_pb2.JOB_STATE_RUNNING


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(values, 50) * 1000, 2), "p99_ms": round(pct(values, 99) * 1000, 2), "n": len(values)}


class Feed:
    """The scheduler's committed job changes, in this process, each stamped when it was published (a task takes
    them as they come, so a change is not stamped late by a caller still waiting on its RPC's answer)."""

    def __init__(self, service) -> None:
        self.service = service
        self.watch = service.fanout.subscribe(None)
        self.seen: list[tuple[common_pb2.Job, float]] = []
        self.arrived = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._take())

    async def _take(self) -> None:
        while True:
            got = await self.watch.get()
            assert got is not None, "the change feed overflowed"
            self.seen.append((got[0], time.perf_counter()))
            self.arrived.set()

    async def until(self, check, timeout: float = 30.0) -> tuple[common_pb2.Job, float]:
        async def run():
            i = 0
            while True:
                while i < len(self.seen):
                    job, at = self.seen[i]
                    i += 1
                    if check(job):
                        return job, at
                self.arrived.clear()
                await self.arrived.wait()

        return await asyncio.wait_for(run(), timeout)

    def close(self) -> None:
        self.task.cancel()
        self.service.fanout.unsubscribe(self.watch)


def template(command: str = "run") -> common_pb2.JobSpec:
    return common_pb2.JobSpec(replicas=2, gpus_per_replica=8, command=[command])


async def main(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="phalanx-serving-bench-"))
    db_url = args.pg or f"sqlite:///{workdir / 'ledger.db'}"
    if args.pg:
        import psycopg

        name = f"phalanx_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        db_url = args.pg.rsplit("/", 1)[0] + "/" + name
    upgrade(db_url)
    names = [f"node-{i:04d}" for i in range(args.nodes)]
    settings = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(names, nodes_per_leaf=8),
        retry_backoff_s=0.0,
        launch_timeout=600.0,
        lease_timeout=600.0,
    )
    scheduler = await serve(settings)
    agents = [LiteAgent(scheduler.address, n) for n in names]
    for agent in agents:
        await agent.start()
    channel = grpc.aio.insecure_channel(scheduler.address)
    jobs = scheduler_pb2_grpc.SchedulerStub(channel)
    svc = service_pb2_grpc.ServiceServiceStub(channel)
    service = scheduler.service
    out: dict = {"nodes": args.nodes, "gpus": args.nodes * 8, "store": "postgresql" if args.pg else "sqlite"}
    try:
        # -- baseline: a plain 2 x 8 gang, SubmitJob to RUNNING, one at a time
        base = []
        for i in range(args.repeat):
            feed = Feed(service)
            t0 = time.perf_counter()
            job = await jobs.SubmitJob(
                scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(name=f"plain-{i}", **_shape()))
            )
            _, t1 = await feed.until(lambda j, jid=job.id: j.id == jid and j.state == RUNNING)
            base.append(t1 - t0)
            feed.close()
            await jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
        out["plain_submit_to_running"] = ms(base)
        say("plain gang, submit to RUNNING:", out["plain_submit_to_running"])

        # -- scale-up: K -> K+1, to the new replica's reservation and readiness
        await svc.CreateService(
            service_pb2.CreateServiceRequest(spec=service_pb2.ServiceSpec(name="up", replicas=1, template=template()))
        )
        await _ready(svc, "up", 1)
        reserved, ready = [], []
        for k in range(1, args.repeat + 1):
            feed = Feed(service)
            t0 = time.perf_counter()
            await svc.ScaleService(service_pb2.ScaleServiceRequest(name="up", replicas=k + 1))
            job, t1 = await feed.until(
                lambda j, k=k: j.service == "up" and j.service_replica == k and j.state == RUNNING
            )
            _, t2 = await feed.until(lambda j, jid=job.id: j.id == jid and j.ready)
            reserved.append(t1 - t0)
            ready.append(t2 - t0)
            feed.close()
            await svc.ScaleService(service_pb2.ScaleServiceRequest(name="up", replicas=k))
            await _ready(svc, "up", k)
        out["scale_up_to_running"] = ms(reserved)
        out["scale_up_to_ready"] = ms(ready)
        say("scale-up, to RUNNING:", out["scale_up_to_running"], "to ready:", out["scale_up_to_ready"])

        # -- a replica's rank exits: the replica ready again
        restart = []
        for _ in range(args.repeat):
            view = await svc.GetService(service_pb2.GetServiceRequest(name="up"))
            victim = view.replicas[0]
            current = await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=victim.job_id))
            node = next(a for a in agents if a.name == victim.nodes[0])
            feed = Feed(service)
            t0 = time.perf_counter()
            await node._report(victim.job_id, current.attempt, 0, common_pb2.RANK_STATE_EXITED, 1)
            _, t1 = await feed.until(
                lambda j, jid=victim.job_id, a=current.attempt: j.id == jid and j.ready and j.attempt > a
            )
            restart.append(t1 - t0)
            feed.close()
        out["replica_restart_to_ready"] = ms(restart)
        say("replica restart, rank exit to ready:", out["replica_restart_to_ready"])
        await svc.DeleteService(service_pb2.DeleteServiceRequest(name="up"))

        # -- rolling updates
        for surge, unavailable in ((0, 1), (2, 2)):
            name = f"roll-{surge}-{unavailable}"
            spec = service_pb2.ServiceSpec(
                name=name,
                replicas=args.replicas,
                template=template(),
                max_surge=surge,
                max_unavailable=unavailable,
            )
            await svc.CreateService(service_pb2.CreateServiceRequest(spec=spec))
            await _ready(svc, name, args.replicas)
            feed = Feed(service)
            state = {
                r.job_id: r.ready for r in (await svc.GetService(service_pb2.GetServiceRequest(name=name))).replicas
            }
            lowest = sum(state.values())
            t0 = time.perf_counter()
            await svc.UpdateService(service_pb2.UpdateServiceRequest(name=name, template=template("run-v2")))
            while True:
                job, _ = await feed.until(lambda j, n=name: j.service == n)
                state[job.id] = job.ready and job.state == RUNNING
                lowest = min(lowest, sum(state.values()))
                view = await svc.GetService(service_pb2.GetServiceRequest(name=name))
                if len(view.replicas) == args.replicas and all(r.revision == 2 and r.ready for r in view.replicas):
                    break
            took = time.perf_counter() - t0
            feed.close()
            out[f"rollout_surge{surge}_unavailable{unavailable}"] = {
                "seconds": round(took, 3),
                "per_replica_ms": round(took / args.replicas * 1000, 2),
                "lowest_ready": lowest,
                "floor": args.replicas - unavailable,
            }
            say(
                f"rolling update of {args.replicas} (surge {surge}, unavailable {unavailable}):",
                out[f"rollout_surge{surge}_unavailable{unavailable}"],
            )
            await svc.DeleteService(service_pb2.DeleteServiceRequest(name=name))

        # -- steady cost: services that are ready cause no cycles beyond an idle scheduler's (the baseline)
        window = 5.0

        async def cycles_per_s() -> float:
            await asyncio.sleep(1.0)
            before = service.cycle_id
            await asyncio.sleep(window)
            return round((service.cycle_id - before) / window, 2)

        idle = await cycles_per_s()
        count = min(args.services, args.nodes // 2)
        for i in range(count):
            spec = service_pb2.ServiceSpec(
                name=f"steady-{i}",
                replicas=1,
                template=common_pb2.JobSpec(replicas=1, gpus_per_replica=8, command=["run"]),
            )
            await svc.CreateService(service_pb2.CreateServiceRequest(spec=spec))
        for i in range(count):
            await _ready(svc, f"steady-{i}", 1)
        steady = await cycles_per_s()
        reads = []
        for _ in range(10):
            t0 = time.perf_counter()
            await service.read_snapshot(read_service_views)
            reads.append(time.perf_counter() - t0)
        out["steady"] = {
            "services": count,
            "cycles_per_s": steady,
            "idle_cycles_per_s": idle,
            "reconcile_read": ms(reads),
        }
        say("steady services:", out["steady"])
    finally:
        await channel.close()
        for agent in agents:
            await agent.stop()
        await scheduler.stop()
    return out


def _shape() -> dict:
    return dict(replicas=2, gpus_per_replica=8, command=["run"])


async def _ready(svc, name: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = await svc.GetService(service_pb2.GetServiceRequest(name=name))
        if view.ready_replicas == count == len(view.replicas):
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"{name}: {count} ready replicas not reached in {timeout}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--services", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--pg", default="", help="PostgreSQL admin URL (a fresh database is made); default SQLite")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(json.dumps(result, sort_keys=True))
