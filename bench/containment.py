"""The cost of containment: a real scheduler (SQLite) and a real node agent (this host's cgroups as root, else the
process-group fallback) running real rank processes.

1. Handover. An 8-GPU gang holds every GPU of the node; a second 8-GPU gang waits. The first is cancelled, and the
   bench measures, from the cancel, when the second gang is reserved (its RUNNING event), when the first gang's
   last process is gone, and when the second gang's first rank starts. Twice: a rank that exits at SIGTERM, and
   one that ignores it (then the agent SIGKILLs it after --kill-grace). `overlap_ms` is how long processes of both
   gangs were alive on the same GPUs at once (0 is the goal: issue 19, item 6).
2. Launch latency. A 64-rank attempt (the fake scheduler of the tests, a real grpc.aio server) on an agent whose
   state file holds an empty history, against one holding 50,000 finished ranks of an earlier agent (which a
   bounded state drops at load): from the launch sent to all 64 ranks reported RUNNING.

Run: .venv/bin/python bench/containment.py [--samples N] [--history N] [--quick]
The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "service"))

import grpc
import structlog

from db.migrate import upgrade
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.core.fabric import default_fabric
from services.node_agent import launcher
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.simulated import nvml_for_topology, simulated_topology
from services.node_agent.state import AgentState, RankRecord
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

RUNNING = common_pb2.JOB_STATE_RUNNING
RANK_RUNNING = common_pb2.RANK_STATE_RUNNING
# A rank: writes "<pid> <start time>" to $STARTED_DIR/<job>-<rank>, then sleeps; IGNORE_TERM=1 ignores SIGTERM.
RANK = (
    "import os, signal, time\n"
    "if os.environ.get('IGNORE_TERM') == '1':\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "p = os.path.join(os.environ['STARTED_DIR'], os.environ['PHALANX_JOB_ID'] + '-' + os.environ['RANK'])\n"
    "open(p + '.part', 'w').write(f'{os.getpid()} {time.time()}')\n"
    "os.replace(p + '.part', p)\n"
    "time.sleep(600)\n"
)


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


async def until(pred, timeout: float = 30.0, interval: float = 0.002) -> float:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("the bench waited too long")
        await asyncio.sleep(interval)
    return time.time()


async def handover(workdir: Path, samples: int, ignore_term: bool, kill_grace: float) -> dict:
    db = f"sqlite:///{workdir / 'ledger.db'}"
    upgrade(db)
    settings = SchedulerSettings(
        db_url=db,
        listen="127.0.0.1:0",
        fabric=default_fabric(["node-b"]),
        heartbeat_interval=0.5,
        lease_timeout=30.0,
        launch_timeout=60.0,
        poll_interval=0.2,
    )
    scheduler = await serve(settings)
    agent = NodeAgent(
        AgentConfig(
            scheduler=scheduler.address,
            node_name="node-b",
            topology=simulated_topology("node-b", "dgx-h100"),
            state_dir=workdir / "agent",
            kill_grace_s=kill_grace,
            poll_interval_s=0.01,
            health_enabled=False,
            simulated_nvml=nvml_for_topology,
        )
    )
    task = asyncio.create_task(agent.run())
    started = workdir / "started"
    started.mkdir()
    channel = grpc.aio.insecure_channel(scheduler.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    reserved: dict[str, float] = {}

    async def watch() -> None:
        async for event in stub.WatchJobs(scheduler_pb2.WatchJobsRequest()):
            if event.job.state == RUNNING:
                reserved.setdefault(event.job.id, time.time())

    watcher = asyncio.create_task(watch())
    out: dict[str, list[float]] = {"reserve": [], "gone": [], "next_start": [], "overlap": []}
    try:
        await until(lambda: agent.registrations >= 1)

        async def submit(name: str) -> str:
            spec = common_pb2.JobSpec(
                name=name,
                replicas=1,
                gpus_per_replica=8,
                command=[sys.executable, "-c", RANK],
                env={"STARTED_DIR": str(started), "IGNORE_TERM": "1" if ignore_term else "0"},
            )
            return (await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))).id

        def pids(job: str) -> list[int]:
            found = [started / f"{job}-{r}" for r in range(8)]  # (written whole: temp file, then rename)
            return [int(p.read_text().split()[0]) for p in found if p.exists()]

        current = await submit("first")
        await until(lambda: len(pids(current)) == 8)
        for _ in range(samples):
            following = await submit("next")
            await asyncio.sleep(0.2)
            assert following not in reserved, "the node is full: the next gang waits"
            old = pids(current)
            t0 = time.time()
            await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=current))
            t_reserved = await until(lambda f=following: f in reserved)
            t_gone = await until(lambda o=old: not any(launcher.pid_alive(p) for p in o))
            await until(lambda f=following: len(pids(f)) == 8)
            first_start = min(float((started / f"{following}-{r}").read_text().split()[1]) for r in range(8))
            out["reserve"].append(t_reserved - t0)
            out["gone"].append(t_gone - t0)
            out["next_start"].append(first_start - t0)
            out["overlap"].append(max(0.0, t_gone - first_start))
            current = following
        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=current))
    finally:
        watcher.cancel()
        await channel.close()
        agent.request_stop()
        await asyncio.wait_for(task, 30)
        await scheduler.stop()
    kind = "ignores SIGTERM" if ignore_term else "exits at SIGTERM"
    figures = {k: round(statistics.median(v) * 1000, 1) for k, v in out.items()}
    say(
        f"handover, a rank that {kind} ({agent.containment.kind if agent.containment else '?'}, kill grace "
        f"{kill_grace:g}s): from the cancel, the next gang reserved in {figures['reserve']} ms, the old gang gone "
        f"in {figures['gone']} ms, the next gang's first rank started at {figures['next_start']} ms; processes of "
        f"both on the same GPUs for {figures['overlap']} ms (p50 of {samples})"
    )
    return figures


async def launch_latency(workdir: Path, history: int, samples: int) -> float:
    from test_node_agent import FakeNodeService, start_server

    state_dir = workdir / "agent"
    if history:
        state = AgentState(path=state_dir / "state.json", node_name="node-l")
        for i in range(history):
            rec = RankRecord(job_id=f"old{i // 8:06d}", attempt=1, rank=i % 8, gpus=[i % 8], state="exited")
            state.ranks[rec.key] = rec
        state.save()
    fake = FakeNodeService(heartbeat_ms=1000)
    server, port = await start_server(fake)
    agent = NodeAgent(
        AgentConfig(
            scheduler=f"127.0.0.1:{port}",
            node_name="node-l",
            topology=simulated_topology("node-l", "dgx-h100"),
            state_dir=state_dir,
            kill_grace_s=1.0,
            poll_interval_s=0.01,
            health_enabled=False,
            simulated_nvml=nvml_for_topology,
        )
    )
    task = asyncio.create_task(agent.run())
    times = []
    try:
        await until(lambda: fake.registrations)
        for s in range(samples):
            job = f"big{s}"
            ranks = [{"rank": r, "gpus": [r % 8], "env": {"RANK": str(r)}} for r in range(64)]
            t0 = time.time()
            fake.launch(len(fake.assignments) + 1, job, 1, ranks, command=["sleep", "600"])
            await until(
                lambda j=job: len({r.rank for r in fake.reports if r.job_id == j and r.state == RANK_RUNNING}) == 64, 60
            )
            times.append(time.time() - t0)
            fake.kill(len(fake.assignments) + 1, job, 1)
            await until(
                lambda j=job: len({r.rank for r in fake.reports if r.job_id == j and r.state != RANK_RUNNING}) == 64, 60
            )
        kept = len(agent.state.ranks)
    finally:
        agent.request_stop()
        await asyncio.wait_for(task, 30)
        await server.stop(0)
    p50 = round(statistics.median(times) * 1000, 1)
    say(
        f"launch of a 64-rank attempt, {history:,} finished ranks in the saved history: p50 {p50} ms (state kept {kept} ranks)"
    )
    return p50


async def run(args) -> dict:
    results: dict = {"root": os.geteuid() == 0}
    for ignore in (False, True):
        with tempfile.TemporaryDirectory(prefix="phalanx-bench-containment-") as tmp:
            figures = await handover(Path(tmp), args.samples, ignore, args.kill_grace)
        key = "ignores_term" if ignore else "prompt"
        for name, value in figures.items():
            results[f"handover_{key}_{name}_ms"] = value
    for history in (0, args.history):
        with tempfile.TemporaryDirectory(prefix="phalanx-bench-launch-") as tmp:
            results[f"launch64_history{history}_p50_ms"] = await launch_latency(Path(tmp), history, args.launches)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=5, help="cancels per handover case")
    p.add_argument("--launches", type=int, default=3, help="64-rank launches per history")
    p.add_argument("--history", type=int, default=50_000, help="finished ranks in the saved history")
    p.add_argument("--kill-grace", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="small sample counts, for a smoke run")
    args = p.parse_args()
    if args.quick:
        args.samples, args.launches, args.history = 2, 1, 5_000
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    results = asyncio.run(run(args))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
