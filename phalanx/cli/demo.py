"""``phalanx demo``: a local cluster, seven jobs through the SDK (placement, gang waiting, MIG and shares, then a
preemption with checkpoint-restart), an eighth with torch (a DDP job), a service of two replicas rolled to a new
revision (demo_serving.py), and a readable account of what happened."""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx.core.preemption import parse_priority

from . import render
from .cluster import StopOnSignal, add_common_flags, cluster_from_args, print_ready, start_or_report
from .common import UsageError
from .demo_serving import demo_service
from .local_cluster import DEFAULT_DEMO_STATE_DIR, DEFAULT_PROFILE, MARKER, LocalCluster

RANK_PROGRAM = (
    "import os, time\n"
    "e = os.environ\n"
    "print(f\"rank {e['RANK']}/{e['WORLD_SIZE']} on {e.get('PHALANX_NODE', '?')} \"\n"
    "      f\"CUDA_VISIBLE_DEVICES={e['CUDA_VISIBLE_DEVICES']} MASTER_ADDR={e.get('MASTER_ADDR', '')}\", flush=True)\n"
    "time.sleep(float(e.get('DEMO_SLEEP', '3')))\n"
)


def _gpu_ranges(gpus: Sequence[int]) -> str:
    gpus = sorted(gpus)
    if not gpus:
        return "-"
    parts, start, prev = [], gpus[0], gpus[0]
    for g in gpus[1:] + [None]:  # type: ignore[list-item]
        if g is not None and g == prev + 1:
            prev = g
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if g is not None:
            start = prev = g
    return ",".join(parts)


def _say(text: str = "") -> None:
    print(text, flush=True)


def _describe_placement(job) -> None:
    what = (
        f"MIG {job.mig_profile}"
        if job.mig_profile
        else f"{job.gpu_milli}/1000 GPU"
        if job.gpu_milli
        else f"{job.gpus_per_replica} GPUs"
    )
    _say(f"  {job.name} ({job.id}) is RUNNING: {job.replicas} x {what}, attempt {job.attempt}")
    for a in sorted(job.allocations, key=lambda a: a.replica):
        if a.slices:
            part = ", ".join(
                f"GPU {s.gpu} MIG {s.profile} (memory slices {s.start}-{s.start + s.size - 1})" for s in a.slices
            )
        elif a.gpu_milli:
            part = f"{a.gpu_milli}/1000 of GPU {_gpu_ranges(a.gpus)} (MPS)"
        else:
            part = f"GPUs {_gpu_ranges(a.gpus)}"
        _say(f"    replica {a.replica} -> {a.node}  {part}")
    p = job.placement
    if p:
        _say(f"    placement: {p.get('reason', '')} (tier {p.get('tier', '?')}, {p.get('domains', 0)} domain(s))")
    elif job.message:
        _say(f"    {job.message}")


def _prepare_demo_dir(state_dir: Path) -> None:
    """The demo starts from an empty ledger: wipe a state directory it created before, refuse any other."""

    if not state_dir.exists():
        return
    if (state_dir / MARKER).exists():
        lock = state_dir / "cluster.lock"
        if lock.exists():
            with open(lock, "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    raise UsageError(
                        f"a cluster is running with state directory {state_dir}; stop it or pass --state-dir"
                    ) from None
        shutil.rmtree(state_dir)
    elif any(state_dir.iterdir()):
        raise UsageError(f"{state_dir} exists and was not created by phalanx; pass another --state-dir")


def cmd_demo(args: argparse.Namespace) -> int:
    """``phalanx demo``: a local cluster, seven jobs through the SDK (placement, gang waiting, MIG and shares,
    then a preemption with checkpoint-restart), an eighth with torch (a DDP job), a readable account, exit 0 when
    all succeed."""
    from phalanx.client import Client, PhalanxError

    if args.mig_gpus is not None and args.mig_gpus < 1:
        raise UsageError("the demo runs a MIG job: --mig-gpus must be at least 1")
    if args.nodes < 3:
        raise UsageError("the demo needs at least 3 nodes (2 for its gangs, and one with a GPU in MIG mode)")
    state_dir = Path(args.state_dir)
    _prepare_demo_dir(state_dir)
    cluster = cluster_from_args(args, state_dir)
    sleep_s = str(args.sleep)
    command = [sys.executable, "-c", RANK_PROGRAM]
    env = {"DEMO_SLEEP": sleep_s}
    ok = False
    with StopOnSignal() as stopper:
        try:
            _say(
                f"Starting a local Phalanx cluster: {args.nodes} simulated {DEFAULT_PROFILE} nodes "
                f"(8 GPUs each), SQLite ledger, state in {state_dir}/"
            )
            if not start_or_report(cluster, stopper):
                return 1
            print_ready(cluster)
            mig_gpus = cluster.mig_gpu_indexes()
            last = cluster.node_names[-1]
            # The last node has GPUs in MIG mode (they take only MIG instances): a gang of 8-GPU replicas "as
            # large as the cluster" is one replica per other node.
            total = args.nodes - 1
            _say(
                f"GPU(s) {','.join(map(str, mig_gpus))} of {last} are in MIG mode: only MIG instances go there, "
                "and MIG instances only go there"
            )
            _say()
            with Client(cluster.address) as client:
                # 1. a 2-node gang, a 4-GPU job and partial GPUs (a MIG instance, two quarter-GPU shares): all fit
                gang, ids, shown = _demo_fitting_jobs(client, command, env, stopper)
                # 2. a gang as large as the whole cluster: it must wait, holding nothing
                big = _demo_big_gang(client, total, last, command, env)
                ids.append(big.id)
                ok = _watch_until_finished(client, ids, big, shown, stopper, args.job_timeout)
                # 3. preemption and checkpoint-restart: a batch training gang makes way for a critical one
                _say()
                preempt_ok, more = _demo_preemption(client, cluster, total, stopper)
                ok, ids = ok and preempt_ok, ids + more
                # 4. a real torch.distributed job, when torch is installed
                _say()
                if _torch_available():
                    ddp_ok, more = _demo_ddp(client, cluster)
                    ok, ids = ok and ddp_ok, ids + more
                else:
                    _say(
                        "torch is not installed, so the demo skips its DistributedDataParallel job "
                        "(pip install 'phalanx[torch]' to see it)"
                    )
                # 5. serving: a service with a readiness probe, its endpoints, a rolling update, its deletion
                _say()
                ok = demo_service(client, _say, stopper) and ok
            _demo_epilogue(cluster, gang.id, ids, ok)
            if args.keep:
                _say(
                    f"\nThe cluster keeps running (--keep): export PHALANX_SCHEDULER={cluster.address} and try "
                    "`phalanx nodes`, `phalanx jobs`. Ctrl-C stops it."
                )
                cluster.wait(stopper.event)
        except KeyboardInterrupt:
            if not (args.keep and ok):
                sys.stderr.write("error: interrupted\n")
                return 130
        except PhalanxError as exc:
            sys.stderr.write(f"error: {exc}\n")
            return 1
        finally:
            cluster.stop()
    return 0 if ok else 1


def _demo_fitting_jobs(client, command: list[str], env: dict[str, str], stopper) -> tuple[Any, list[str], set[str]]:
    """Step 1: a 2 x 8 gang, a 4-GPU job, a MIG instance and two quarter-GPU shares, which all fit; each one's
    placement once it has one. (the gang, the four ids, the ids whose placement was shown)."""
    gang = client.submit("gang-2x8", 2, 8, command, env=env)
    single = client.submit("single-4gpu", 1, 4, command, env=env)
    mig = client.submit("mig-3g.40gb", 1, 1, command, env=env, mig_profile="3g.40gb")
    shares = client.submit("shares-2x250m", 2, 1, command, env=env, gpu_milli=250)
    _say(f"Submitted {gang.name} ({gang.id}): 2 replicas x 8 GPUs, one process per GPU")
    _say(f"Submitted {single.name} ({single.id}): 1 replica x 4 GPUs")
    _say(f"Submitted {mig.name} ({mig.id}): 1 MIG instance of profile 3g.40gb")
    _say(f"Submitted {shares.name} ({shares.id}): 2 replicas x 250/1000 of a GPU (MPS shares)")
    shown: set[str] = set()
    for job_id in (gang.id, single.id, mig.id, shares.id):
        job = client.wait(job_id, ["RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"], timeout=60)
        if job.allocations:
            _describe_placement(job)
            shown.add(job_id)
        stopper.check()
    return gang, [gang.id, single.id, mig.id, shares.id], shown


def _demo_big_gang(client, total: int, last: str, command: list[str], env: dict[str, str]):
    """Step 2: a gang of `total` 8-GPU replicas, every 8-GPU node: it waits, holding nothing. The job, as it is
    once queued (or after 10 s)."""
    from phalanx.client import JobState

    big = client.submit(f"big-{total}x8", total, 8, command, env=env)
    _say(
        f"Submitted {big.name} ({big.id}): {total} replicas x 8 GPUs = every 8-GPU node of the "
        f"cluster ({last} has GPUs in MIG mode)"
    )
    deadline = time.monotonic() + 10
    while True:
        big = client.get_job(big.id)
        if big.state is not JobState.PENDING or big.message != "queued" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if big.state is JobState.PENDING:
        held = sum(len(a.gpus) for a in big.allocations)
        _say(
            f"  {big.name} is PENDING and holds {held} GPUs (gangs are reserved all at once or "
            f"not at all): {big.message}"
        )
    else:
        _say(f"  {big.name} is {big.state.value}: {big.message}")
    _say()
    return big


def _watch_until_finished(client, ids: list[str], big, shown: set[str], stopper, timeout: float) -> bool:
    """A line per start (with its placement, unless `shown`) and per end of the jobs `ids` (the last one `big`,
    the others running) until all have finished; whether all SUCCEEDED."""
    from phalanx.client import JobState

    _say(f"Watching until all {len(ids)} jobs finish:")
    last: dict[str, JobState] = {i: JobState.RUNNING for i in ids[:-1]}
    last[big.id] = big.state
    final: dict[str, object] = {}
    stream = client.watch(ids, timeout=timeout)
    try:
        for job in stream:
            stopper.check()
            if last.get(job.id) == job.state:
                continue
            last[job.id] = job.state
            stamp = time.strftime("%H:%M:%S")
            if job.state is JobState.RUNNING and job.id not in shown:
                _say(f"{stamp} {job.name} started")
                _describe_placement(job)
                shown.add(job.id)
            elif job.terminal:
                took = f" after {job.finished_at - job.started_at:.1f}s" if job.started_at else ""
                _say(f"{stamp} {job.name} {job.state.value}{took} (exit code {job.exit_code}): {job.message}")
                final[job.id] = job
                if len(final) == len(ids):
                    break
            elif job.state is not JobState.RUNNING:
                _say(f"{stamp} {job.name} {job.state.value}: {job.message}")
    finally:
        stream.close()
    return all(getattr(final.get(i), "state", None) is JobState.SUCCEEDED for i in ids)


def _demo_epilogue(cluster: LocalCluster, gang_id: str, ids: list[str], ok: bool) -> None:
    """Rank 0 of the 2 x 8 gang, read from its node's agent as any user would; the jobs table; the verdict."""
    from phalanx.client import Client

    _say(f"\n$ phalanx --scheduler {cluster.address} logs {gang_id} --rank 0 --tail 3")
    with Client(cluster.address) as client:
        rank0 = [line for _, line in client.logs(gang_id, rank=0, tail=3)]
    _say("  " + ("\n  ".join(rank0) or "(empty)"))
    _say(f"\n$ phalanx --scheduler {cluster.address} jobs")
    with Client(cluster.address) as client:
        _say(render.jobs_table(client.list_jobs()))
    _say()
    _say(
        f"All {len(ids)} jobs SUCCEEDED."
        if ok
        else f"Not every job SUCCEEDED; see the logs under {cluster.logs_dir} and {cluster.state_dir / 'agents'}"
    )


def _demo_preemption(client, cluster: LocalCluster, nodes: int, stopper) -> tuple[bool, list[str]]:
    """A batch-priority 2-node gang trains (phalanx.examples.count_steps, checkpointing through phalanx.train); a
    critical gang as large as the cluster (`nodes` x 8 GPUs: every node whose GPUs are all out of MIG mode)
    arrives, waits out the trainer's minimum runtime, preempts it (it checkpoints, then stops) and runs; the trainer
    resumes from its checkpoint and ends with the exact count."""
    from phalanx.client import JobState

    steps, every = 60, 20
    out = cluster.state_dir / "train"
    train_cmd = [
        sys.executable,
        "-m",
        "phalanx.examples.count_steps",
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--step-time",
        "0.1",
        "--out",
        str(out),
    ]
    trainer = client.submit(
        "train-batch",
        2,
        8,
        train_cmd,
        priority=parse_priority("batch"),
        procs_per_replica=1,
        env={"PHALANX_CHECKPOINT_POLL_S": "0.2"},
    )
    _say(
        f"Submitted {trainer.name} ({trainer.id}): 2 x 8 GPUs at priority batch (-100), a training loop of {steps} "
        f"steps that checkpoints every {every} through phalanx.train"
    )
    client.wait(trainer.id, ["RUNNING"], timeout=60)
    time.sleep(1.0)
    urgent = client.submit(
        f"urgent-{nodes}x8",
        nodes,
        8,
        [sys.executable, "-c", "import time; time.sleep(2)"],
        priority=parse_priority("critical"),
    )
    _say(f"Submitted {urgent.name} ({urgent.id}): every 8-GPU node of the cluster at priority critical (200)")
    seen: dict[str, tuple] = {}
    final: dict[str, object] = {}
    stream = client.watch([trainer.id, urgent.id], timeout=120)
    try:
        for job in stream:
            stopper.check()
            key = (job.state, job.attempt, job.message if job.state is JobState.PENDING else "")
            if seen.get(job.id) == key:
                continue
            seen[job.id] = key
            stamp = time.strftime("%H:%M:%S")
            if job.terminal:
                _say(f"{stamp} {job.name} {job.state.value} (attempt {job.attempt}): {job.message}")
                final[job.id] = job
                if len(final) == 2:
                    break
            elif job.state is JobState.PREEMPTING:
                _say(f"{stamp} {job.name} PREEMPTING: {job.message}")
            else:
                attempt = f" (attempt {job.attempt})" if job.attempt else ""
                _say(f"{stamp} {job.name} {job.state.value}{attempt}: {job.message}")
    finally:
        stream.close()
    done = final.get(trainer.id)
    results = sorted((out / trainer.id).glob("rank-*.json"))
    counts = [json.loads(p.read_text())["count"] for p in results]
    restored = [json.loads(p.read_text())["restored_step"] for p in results]
    good = (
        getattr(done, "state", None) is JobState.SUCCEEDED
        and getattr(final.get(urgent.id), "state", None) is JobState.SUCCEEDED
        and len(counts) == 2
        and counts == [steps, steps]
    )
    if results:
        _say(
            f"  {trainer.name}: both ranks counted {counts} of {steps} steps; the last attempt resumed from step "
            f"{restored[0]} (its preemption checkpoint), so no committed step was lost or done twice"
        )
    job = client.get_job(trainer.id)
    ran = client.get_job(urgent.id)
    # The invariant the claim keeps (issue 30): the victim is preempted once, and its preemptor runs on what it
    # freed before the victim's next attempt.
    once = job.preemptions == 1 and 0 < ran.started_at <= job.started_at and job.attempt == 2
    _say(
        f"  {trainer.name} was preempted {job.preemptions} time(s); {urgent.name} started at "
        f"{time.strftime('%H:%M:%S', time.localtime(ran.started_at))}, "
        + (
            f"before {trainer.name}'s attempt {job.attempt} (at "
            f"{time.strftime('%H:%M:%S', time.localtime(job.started_at))})"
            if once
            else f"and {trainer.name} ran {job.attempt} attempt(s), the last from "
            f"{time.strftime('%H:%M:%S', time.localtime(job.started_at))}"
        )
    )
    good = good and once
    if job.goodput is not None:
        g = job.goodput
        _say(
            f"  goodput of {trainer.name}: {g.productive:.0f} productive of {g.allocated:.0f} allocated GPU-seconds "
            f"({g.ratio:.0%}); rollback {g.rollback:.0f}, restart {g.restart:.0f}, waiting {g.waiting:.0f}"
        )
    return good, [trainer.id, urgent.id]


def _torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _demo_ddp(client, cluster: LocalCluster) -> tuple[bool, list[str]]:
    """phalanx.examples.ddp_tiny as a 2 x 2-rank gang: gloo, an all-reduce check, DistributedDataParallel and a
    collective DCP checkpoint every 20 steps through phalanx.train."""
    from phalanx.client import JobState

    steps, every = 60, 20
    out = cluster.state_dir / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "phalanx.examples.ddp_tiny",
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--out",
        str(out),
    ]
    job = client.submit("ddp-tiny", 2, 2, cmd, env={"PHALANX_CHECKPOINT_POLL_S": "0.5"})
    _say(
        f"Submitted {job.name} ({job.id}): 2 replicas x 2 ranks of torch.distributed (gloo) training a small "
        f"model with DistributedDataParallel, {steps} steps, a collective DCP checkpoint every {every}"
    )
    done = client.wait(job.id, timeout=180)
    results = [json.loads(p.read_text()) for p in sorted((out / job.id).glob("rank-*.json"))]
    params = {r["params_sha256"] for r in results}
    good = done.state is JobState.SUCCEEDED and len(results) == 4 and len(params) == 1
    _say(f"{time.strftime('%H:%M:%S')} {job.name} {done.state.value}: {done.message}")
    if results:
        nodes = sorted({r["node"] for r in results})
        saves = results[0]["saves"]
        _say(
            f"  {job.name}: {len(results)} ranks on {', '.join(nodes)} checked an all-reduce, trained {steps} steps "
            f"and saved {saves} collective checkpoints (each rank wrote its own part of each); every rank ends "
            f"with the same parameters (sha256 {next(iter(params))[:12]})"
            if len(params) == 1
            else f"  {job.name}: the ranks' parameters differ: {sorted(params)}"
        )
    return good, [job.id]


# -- registration ----------------------------------------------------------------------------------------------


def register(subparsers) -> None:
    """Add ``demo`` to the ``phalanx`` CLI."""
    demo = subparsers.add_parser(
        "demo",
        help="start a local cluster of 8 simulated nodes and run seven jobs through it (eight with torch)",
        description="Start a local cluster (SQLite, simulated dgx-h100 nodes), submit a 2 x 8 gang, a 4-GPU job "
        "and a gang as large as the cluster (which waits, holding nothing), and report what "
        "happens; then a batch training gang is preempted by a critical one and resumes from its "
        "checkpoint; with torch installed, a DistributedDataParallel job trains and checkpoints collectively. Exits 0 "
        "when every job SUCCEEDED. The state directory is wiped first.",
    )
    add_common_flags(demo, nodes=8, state_dir=DEFAULT_DEMO_STATE_DIR)
    demo.add_argument("--keep", action="store_true", help="keep the cluster running afterwards, until Ctrl-C")
    demo.add_argument("--sleep", type=float, default=4.0, metavar="S", help="seconds each rank runs (default 4)")
    demo.add_argument(
        "--job-timeout",
        type=float,
        default=180.0,
        metavar="S",
        help="give up when the jobs have not finished after S seconds (default 180)",
    )
    demo.set_defaults(func=cmd_demo)
