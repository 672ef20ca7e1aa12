"""Phalanx beside its peers, in one run on one machine, with the same shapes (issue 35, item 4).

Phalanx: a real scheduler process on a fresh PostgreSQL database with lightweight agents in a process of their own
(bench/gang_reservation.py's Bench, reused as it is). Ray: placement groups on a local `ray.cluster_utils.Cluster`
of fake GPU nodes (`pip install -e .[peers]`). Both clusters have 4 nodes x 8 GPUs, and are measured one after the
other, never at the same time:
- 1-GPU gang, submit to reserved, p50 / p99. Phalanx: from the SubmitJob call to the moment the client first knows
  the gang is reserved (a SubmitJob reply in RUNNING, or the RUNNING event on a WatchJobs stream, whichever comes
  first; both are printed too). Ray: a 1-bundle placement group, `placement_group([{"GPU": 1}])` to
  `ray.get(pg.ready())`. Each sample is cancelled / removed before the next one, and waits until it is freed.
- 4 x 8 gang p50: Phalanx 4 replicas x 8 GPUs; Ray 4 bundles of {"GPU": 8}, strategy PACK (and STRICT_SPREAD).
- gangs reserved per second, 8 clients: bench/gang_reservation.py's mixed 1/8/64-GPU gangs that fill the cluster
  (on 4 nodes: one 8-GPU gang and sixteen 1-GPU gangs), submitted by 8 SDK clients x 8 in flight; Ray creates the
  same gangs as placement groups from 8 threads, pipelined (every group created, then all its `ready()` awaited).
  The rate is gangs from the first submit to the last reservation; all are freed again between rounds.
- Slurm 22.05 (Debian's slurm-wlm, as root): one slurmctld and one `slurmd -N nK` per node on ports of their own,
  fake GPUs in gres.conf, munge with a key of its own (bench/slurm_peer.py, which says what each figure times).
  1-GPU: `salloc -N1 --gres=gpu:1 /bin/true` from its launch to "Granted job allocation" (Slurm's client is its
  command line: starting salloc is part of it); 4 x 8: `salloc -N4 --gres=gpu:8`. Throughput: the same mix by
  `sbatch` from 8 threads, jobs from the first submit to the last allocation in slurmctld's log (SchedulerParameters
  batch_sched_delay=0: with Slurm's default of 3 s a burst waits for its next scheduling pass even longer); also the
  rate at which sbatch accepts them, and the mix as `salloc --no-shell` allocations (decided at submit).
  Without slurm-wlm on PATH, or as non-root, or with --no-slurm, the bench says it skipped Slurm, and why.
Without --quick, Phalanx's figures at 256 nodes are added (Phalanx alone: Ray cannot run 256 raylets here).

Targets (issue 35), as ratios Phalanx / Ray of this run: 1-GPU p50 <= 0.8x; 4 x 8 p50 <= 0.8x (PACK); gangs per
second >= 2x; and Phalanx / Slurm: gangs per second >= 2x Slurm's sbatch jobs allocated per second. The bench prints
them and names the missed ones in its JSON (`targets_missed`); it exits 0.

Run: .venv/bin/python bench/peers.py [--samples N] [--quick] [--no-ray] [--no-slurm] [--db ADMIN_URL]
The last line of output is one JSON object: {"bench": "peers", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import gang_reservation as gr  # bench/ is on sys.path when this file runs (and the test puts it there)
import slurm_peer as sp

from db.engine import normalize_url
from phalanx.api.v1 import common_pb2, scheduler_pb2

NODES = 4  # the ratio rows: Ray's local cluster runs one raylet per node, so a few nodes is what one machine holds
GPUS_PER_NODE = 8
BIG_NODES = 256  # Phalanx alone, as in bench/gang_reservation.py
WARMUP = 3  # samples dropped on each side (Ray starts its workers on the first ready(); Phalanx warms its caches)
TARGETS = (  # (Phalanx's figure, Ray's, bound on Phalanx / Ray, "le": at most / "ge": at least, what it says)
    ("g1_p50_ms", "g1_p50_ms", 0.8, "le", "1-GPU gang p50"),
    ("g4x8_p50_ms", "g4x8_p50_ms", 0.8, "le", "4 x 8 gang p50 (Ray PACK)"),
    ("g4x8_p50_ms", "g4x8_spread_p50_ms", None, "", "4 x 8 gang p50 (Ray STRICT_SPREAD)"),
    ("gangs_per_s", "gangs_per_s", 2.0, "ge", "gangs reserved per second, 8 clients"),
)
SLURM_TARGETS = (  # the same, Phalanx / Slurm (the ratios are keyed "slurm_" + Slurm's figure, less its unit)
    ("g1_p50_ms", "g1_p50_ms", None, "", "1-GPU gang p50 (Slurm salloc -N1)"),
    ("g4x8_p50_ms", "g4x8_p50_ms", None, "", "4 x 8 gang p50 (Slurm salloc -N4)"),
    ("gangs_per_s", "sbatch_per_s", 2.0, "ge", "gangs reserved per second vs Slurm sbatch jobs allocated per second"),
    ("gangs_per_s", "sbatch_accepted_per_s", None, "", "gangs reserved per second vs Slurm sbatch jobs accepted"),
    ("gangs_per_s", "salloc_per_s", None, "", "gangs reserved per second vs Slurm salloc --no-shell allocations"),
)
SLURM_SCHEDULER_PARAMETERS = "batch_sched_delay=0"  # batch jobs on Slurm's next pass, not up to 3 s later
say = gr.say
pct = gr.pct


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


# --- Phalanx ---------------------------------------------------------------------------------------------------


async def phalanx_latency(bench: gr.Bench, replicas: int, gpus: int, samples: int) -> dict:
    """Submit, wait until reserved, cancel; `samples` times on an otherwise idle cluster."""
    known, reply, event = [], [], []
    spec = common_pb2.JobSpec(name=f"peers-{replicas}x{gpus}", replicas=replicas, gpus_per_replica=gpus)
    spec.command.append("hang")
    for i in range(samples + WARMUP):
        t0 = time.perf_counter()
        job = await bench.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))
        t_reply = time.perf_counter()
        t_event = await bench.wait_reserved(job.id)
        await bench.cancel(job.id)
        if i < WARMUP:
            continue
        reply.append(t_reply - t0)
        event.append(t_event - t0)
        known.append((min(t_reply, t_event) if job.state == gr.RUNNING else t_event) - t0)
    return {
        "p50_ms": ms(pct(known, 50)),
        "p99_ms": ms(pct(known, 99)),
        "reply_p50_ms": ms(pct(reply, 50)),
        "event_p50_ms": ms(pct(event, 50)),
    }


async def phalanx_side(admin: str, nodes: int, samples: int, rounds: int, *scheduler_args: str) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="phalanx-peers-"))
    out: dict = {"nodes": nodes, "scheduler_args": list(scheduler_args)}
    try:
        async with gr.Bench(admin, nodes, workdir, scheduler_args) as bench:
            gr.quiesce(admin)
            one = await phalanx_latency(bench, 1, 1, samples)
            out |= {f"g1_{k}": v for k, v in one.items()}
            say(f"phalanx {nodes} nodes: 1-GPU p50 {one['p50_ms']} ms, p99 {one['p99_ms']} ms {phases(one)}")
            big = await phalanx_latency(bench, 4, 8, samples)
            out |= {f"g4x8_{k}": v for k, v in big.items()}
            say(f"phalanx {nodes} nodes: 4 x 8 p50 {big['p50_ms']} ms, p99 {big['p99_ms']} ms {phases(big)}")
            rates = await bench.throughput(clients=8, rounds=rounds, inflight=8)
            out["gangs_per_s"] = round(statistics.median(rates), 1)
            out["gangs_per_round"] = len(gr.gang_mix(nodes))
            say(f"phalanx {nodes} nodes: {out['gangs_per_s']} gangs/s (rounds: {[round(r) for r in rates]})")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def phases(fig: dict) -> str:
    return f"(reply {fig['reply_p50_ms']} ms, RUNNING event {fig['event_p50_ms']} ms at p50)"


# --- Ray --------------------------------------------------------------------------------------------------------


def ray_missing() -> str | None:
    try:
        import ray  # noqa: F401
        from ray.cluster_utils import Cluster  # noqa: F401
    except ImportError as exc:
        return f"ray is not installed ({exc}); pip install -e .[peers]"
    return None


class RayCluster:
    """A local Ray cluster of `nodes` raylets with fake GPUs, one of them the head; the driver is this process."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.lock = threading.Lock()  # the client threads' shared queue of gangs and list of groups

    def __enter__(self) -> RayCluster:
        import ray
        from ray.cluster_utils import Cluster

        # A raylet and its workers per node on a small machine: one CPU each, the smallest object store.
        args = {"num_cpus": 1, "num_gpus": GPUS_PER_NODE, "object_store_memory": 80 * 1024 * 1024}
        t0 = time.perf_counter()
        self.cluster = Cluster(initialize_head=True, head_node_args=args | {"include_dashboard": False})
        for _ in range(self.nodes - 1):
            self.cluster.add_node(**args)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False, logging_level="error")
        self.wait_free()
        self.version = ray.__version__
        say(f"ray {self.version}: {self.nodes} nodes x {GPUS_PER_NODE} GPUs up in {time.perf_counter() - t0:.1f} s")
        return self

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()

    def wait_free(self, groups=(), timeout: float = 30.0) -> None:
        """Until every group given is REMOVED and the GCS sees all GPUs free again (outside the timed part)."""
        import ray
        from ray.util import placement_group_table

        deadline = time.monotonic() + timeout
        pending = list(groups)
        while time.monotonic() < deadline:
            pending = [pg for pg in pending if placement_group_table(pg).get("state") != "REMOVED"]
            if not pending and ray.available_resources().get("GPU", 0) >= self.nodes * GPUS_PER_NODE:
                return
            time.sleep(0.005)
        raise TimeoutError(f"ray: placement groups not freed in {timeout} s")

    def latency(self, bundles: list[dict], strategy: str, samples: int) -> dict:
        import ray
        from ray.util import placement_group, remove_placement_group

        out = []
        for i in range(samples + WARMUP):
            t0 = time.perf_counter()
            pg = placement_group(bundles, strategy=strategy)
            ray.get(pg.ready(), timeout=60)
            took = time.perf_counter() - t0
            remove_placement_group(pg)
            self.wait_free([pg])
            if i >= WARMUP:
                out.append(took)
        return {"p50_ms": ms(pct(out, 50)), "p99_ms": ms(pct(out, 99))}

    def throughput(self, clients: int, rounds: int) -> list[float]:
        """gang_reservation's mix as placement groups from `clients` threads, each creating its share of the
        groups one after another, then waiting for all of their `ready()` (pipelined), per round. The largest
        groups are created first: in gang_reservation's order (1-GPU first) Ray spreads the 1-GPU groups over the
        nodes and the 8-GPU group finds no whole node (`stranded` measures that)."""
        from ray.util import remove_placement_group

        rates = []
        for _ in range(rounds):
            queue = gr.gang_mix(self.nodes)[::-1]  # popped from the end: the largest first
            groups: list = []
            errors: list[BaseException] = []
            threads = [threading.Thread(target=self._creator, args=(queue, groups, errors)) for _ in range(clients)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            took = time.perf_counter() - t0
            if errors:
                raise errors[0]
            rates.append(len(groups) / took)
            for pg in groups:
                remove_placement_group(pg)
            self.wait_free(groups)
            time.sleep(0.3)  # as gang_reservation does between its rounds
        return rates

    def _creator(self, queue: list[int], groups: list, errors: list[BaseException]) -> None:
        """One client thread: create groups off the shared queue until it is empty, then wait for their ready()."""
        import ray
        from ray.util import placement_group

        refs = []
        try:
            while True:
                with self.lock:
                    if not queue:
                        break
                    gpus = queue.pop()
                replicas, per = gr.SHAPES[gpus]
                pg = placement_group([{"GPU": per}] * replicas, strategy="PACK")
                refs.append(pg.ready())
                with self.lock:
                    groups.append(pg)
            ray.get(refs, timeout=60)
        except BaseException as exc:  # raised again by the main thread
            errors.append(exc)

    def stranded(self, wait_s: float = 10.0) -> dict:
        """The mix once in gang_reservation's order (1-GPU groups first), from one thread: how many of its groups
        are ready after `wait_s` (Phalanx reserves all of them in that order)."""
        import ray
        from ray.util import placement_group, remove_placement_group

        mix = gr.gang_mix(self.nodes)
        groups = []
        for gpus in reversed(mix):  # the order in which Bench.throughput's clients pop them
            replicas, per = gr.SHAPES[gpus]
            groups.append(placement_group([{"GPU": per}] * replicas, strategy="PACK"))
        ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=wait_s)
        for pg in groups:
            remove_placement_group(pg)
        self.wait_free(groups)
        return {"ready": len(ready), "gangs": len(groups), "after_s": wait_s}


def ray_side(samples: int, rounds: int) -> dict:
    with RayCluster(NODES) as ray_cluster:
        out: dict = {"version": ray_cluster.version, "nodes": NODES}
        one = ray_cluster.latency([{"GPU": 1}], "PACK", samples)
        out |= {f"g1_{k}": v for k, v in one.items()}
        say(f"ray: 1-bundle group p50 {one['p50_ms']} ms, p99 {one['p99_ms']} ms")
        for strategy in ("PACK", "STRICT_SPREAD"):
            fig = ray_cluster.latency([{"GPU": GPUS_PER_NODE}] * 4, strategy, samples)
            key = "g4x8" if strategy == "PACK" else "g4x8_spread"
            out |= {f"{key}_{k}": v for k, v in fig.items()}
            say(f"ray: 4 x 8 {strategy} p50 {fig['p50_ms']} ms, p99 {fig['p99_ms']} ms")
        rates = ray_cluster.throughput(clients=8, rounds=rounds)
        out["gangs_per_s"] = round(statistics.median(rates), 1)
        say(f"ray: {out['gangs_per_s']} gangs/s pipelined from 8 threads (rounds: {[round(r) for r in rates]})")
        out["phalanx_order"] = ray_cluster.stranded()
        say(
            "ray: the mix in Phalanx's order (1-GPU groups first): {ready} of {gangs} ready after {after_s} s".format(
                **out["phalanx_order"]
            )
        )
    return out


# --- Slurm ------------------------------------------------------------------------------------------------------


def slurm_side(samples: int, rounds: int, no_slurm: bool = False) -> dict:
    """Slurm's figures, or {"skipped": why} when it is not run (--no-slurm, not installed, not root) or fails."""
    if no_slurm:
        why = "--no-slurm"
    elif missing := sp.missing_tools():
        why = f"{', '.join(missing)} not on PATH (Debian: apt-get install slurm-wlm)"
    elif os.geteuid() != 0:
        why = "slurmd must run as root (it starts jobs as their user)"
    else:
        try:
            return slurm_figures(samples, rounds)
        except (sp.SlurmError, OSError, subprocess.SubprocessError) as exc:
            why = f"Slurm failed: {exc}"
    say(f"skipped Slurm: {why}")
    return {"skipped": why}


def slurm_figures(samples: int, rounds: int, clients: int = 8) -> dict:
    with sp.SlurmCluster(NODES, GPUS_PER_NODE, scheduler_parameters=SLURM_SCHEDULER_PARAMETERS) as cluster:
        out: dict = {
            "version": cluster.version,
            "nodes": NODES,
            "daemons": f"1 slurmctld, {NODES} x `slurmd -N nK` on ports of their own, on this host",
            "auth": cluster.auth,
            "scheduler_parameters": SLURM_SCHEDULER_PARAMETERS,
        }
        say(f"{cluster.version}: {NODES} slurmd x {GPUS_PER_NODE} GPUs up in {cluster.started_s:.1f} s")
        for key, nodes, gpus in (("g1", 1, 1), ("g4x8", 4, GPUS_PER_NODE)):
            granted, exited = cluster.allocation_latency(nodes, gpus, samples, WARMUP)
            out |= {
                f"{key}_p50_ms": ms(pct(granted, 50)),
                f"{key}_p99_ms": ms(pct(granted, 99)),
                f"{key}_exit_p50_ms": ms(pct(exited, 50)),
            }
            say(
                f"slurm: salloc -N{nodes} --gres=gpu:{gpus} granted p50 {out[f'{key}_p50_ms']} ms, "
                f"p99 {out[f'{key}_p99_ms']} ms (salloc exited: p50 {out[f'{key}_exit_p50_ms']} ms)"
            )
        mix = gr.gang_mix(NODES)
        batch = cluster.sbatch_throughput(mix, gr.SHAPES, clients, rounds)
        out["sbatch_per_s"] = round(statistics.median(r["jobs"] / r["allocated_s"] for r in batch), 1)
        out["sbatch_accepted_per_s"] = round(statistics.median(r["jobs"] / r["submitted_s"] for r in batch), 1)
        out["sbatch_from_poll"] = sum(r["from_poll"] for r in batch)  # jobs slurmctld's log did not name
        say(
            f"slurm: sbatch from {clients} threads: {out['sbatch_per_s']} jobs/s allocated (rounds: "
            f"{[round(r['jobs'] / r['allocated_s']) for r in batch]}), {out['sbatch_accepted_per_s']} accepted"
        )
        alloc = cluster.salloc_throughput(mix, gr.SHAPES, clients, rounds)
        out["salloc_per_s"] = round(statistics.median(r["jobs"] / r["allocated_s"] for r in alloc), 1)
        say(f"slurm: salloc --no-shell from {clients} threads: {out['salloc_per_s']} jobs/s granted")
        out["jobs_per_round"] = len(mix)
        out["clients"] = clients
    return out


# --- the table --------------------------------------------------------------------------------------------------


def compare(phalanx: dict, ray: dict, slurm: dict | None = None) -> tuple[dict, list[str]]:
    """The ratios Phalanx / Ray (keyed by Ray's figure, less its unit) and Phalanx / Slurm (keyed "slurm_" + Slurm's
    figure, less its unit), and the targets they miss. A peer that was skipped (or not given) adds nothing."""
    ratios, missed = {}, []
    for peer, name, targets, prefix in ((ray, "Ray", TARGETS, ""), (slurm, "Slurm", SLURM_TARGETS, "slurm_")):
        if peer is None or "skipped" in peer:
            continue
        for pkey, rkey, bound, sense, what in targets:
            ratio = round(phalanx[pkey] / peer[rkey], 3)
            ratios[prefix + rkey.removesuffix("_ms")] = ratio
            if bound is not None and ((ratio > bound) if sense == "le" else (ratio < bound)):
                word = "at most" if sense == "le" else "at least"
                missed.append(f"{what}: Phalanx / {name} {ratio:.2f}x, target {word} {bound}x")
    return ratios, missed


def table(result: dict) -> str:
    p, r, s, ratios = result["phalanx"], result["ray"], result["slurm"], result["ratios"]
    skipped = "skipped" in r

    def row(what: str, pkey: str, rkey: str | None, unit: str, target: str, skey: str | None = None) -> str:
        """Phalanx's figure pkey beside Ray's rkey and Slurm's skey (None: no such figure), with their ratios."""
        cells = []
        for peer, key, prefix in ((r, rkey, ""), (s, skey, "slurm_")):
            ratio_key = prefix + key.removesuffix("_ms") if key else None
            value = "-" if key is None else "skipped" if "skipped" in peer else f"{peer[key]} {unit}"
            cells += [value, f"{ratios[ratio_key]:.2f}x" if ratio_key in ratios else "-"]
        return f"| {what} | {p[pkey]} {unit} | {' | '.join(cells)} | {target} |"

    lines = [
        f"Phalanx vs Ray and Slurm, {NODES} nodes x {GPUS_PER_NODE} GPUs each, {result['samples']} samples, "
        f"{result['date']}",
        "",
        "| figure | Phalanx | Ray | Phalanx / Ray | Slurm | Phalanx / Slurm | target |",
        "|---|---|---|---|---|---|---|",
        row("1-GPU gang, submit to reserved, p50", "g1_p50_ms", "g1_p50_ms", "ms", "<= 0.8x Ray", "g1_p50_ms"),
        row("1-GPU gang, submit to reserved, p99", "g1_p99_ms", "g1_p99_ms", "ms", "", "g1_p99_ms"),
        row("4 x 8 gang p50 (Ray PACK)", "g4x8_p50_ms", "g4x8_p50_ms", "ms", "<= 0.8x Ray", "g4x8_p50_ms"),
        row("4 x 8 gang p50 (Ray STRICT_SPREAD)", "g4x8_p50_ms", "g4x8_spread_p50_ms", "ms", ""),
        row("4 x 8 gang p99 (Ray PACK)", "g4x8_p99_ms", "g4x8_p99_ms", "ms", "", "g4x8_p99_ms"),
        row(
            "gangs reserved per second, 8 clients (Slurm: sbatch, allocated)",
            "gangs_per_s",
            "gangs_per_s",
            "/s",
            ">= 2x Ray, >= 2x Slurm",
            "sbatch_per_s",
        ),
        row(
            "gangs reserved per second vs Slurm sbatch accepted", "gangs_per_s", None, "/s", "", "sbatch_accepted_per_s"
        ),
        row("gangs reserved per second vs Slurm salloc --no-shell", "gangs_per_s", None, "/s", "", "salloc_per_s"),
        "",
        f"Phalanx 1-GPU p50: SubmitJob reply {p['g1_reply_p50_ms']} ms, RUNNING event {p['g1_event_p50_ms']} ms; "
        f"4 x 8: reply {p['g4x8_reply_p50_ms']} ms, event {p['g4x8_event_p50_ms']} ms.",
    ]
    base = result.get("phalanx_pass")
    if base:
        lines.append(
            f"Phalanx with every submit decided by a pass (--no-admission-lane, the baseline of decide-at-submit): "
            f"1-GPU p50 {base['g1_p50_ms']} ms, 4 x 8 p50 {base['g4x8_p50_ms']} ms, {base['gangs_per_s']} gangs/s; "
            f"lane / pass: {p['g1_p50_ms'] / base['g1_p50_ms']:.2f}x, {p['g4x8_p50_ms'] / base['g4x8_p50_ms']:.2f}x, "
            f"{p['gangs_per_s'] / base['gangs_per_s']:.2f}x."
        )
    locked = result.get("phalanx_locked")
    if locked:
        lines.append(
            f"Phalanx with every cycle waiting for the clock row's lock first (--no-fence-in-pipeline, the baseline "
            f"of the fence in the pipeline): 1-GPU p50 {locked['g1_p50_ms']} ms, 4 x 8 p50 {locked['g4x8_p50_ms']} ms, "
            f"{locked['gangs_per_s']} gangs/s; fence in the pipeline / lock first: "
            f"{p['g1_p50_ms'] / locked['g1_p50_ms']:.2f}x, {p['g4x8_p50_ms'] / locked['g4x8_p50_ms']:.2f}x, "
            f"{p['gangs_per_s'] / locked['gangs_per_s']:.2f}x."
        )
    big = result.get("phalanx_256")
    if big:
        lines.append(
            f"Phalanx at {big['nodes']} nodes (alone): 1-GPU p50 {big['g1_p50_ms']} / p99 {big['g1_p99_ms']} ms, "
            f"4 x 8 p50 {big['g4x8_p50_ms']} ms, {big['gangs_per_s']} gangs/s (mixed 1/8/64-GPU)."
        )
    if skipped:
        lines.append(f"Ray skipped: {r['skipped']}")
    else:
        order = r["phalanx_order"]
        lines.append(
            f"Ray creates the throughput mix largest first; in Phalanx's order (1-GPU first) {order['ready']} of "
            f"{order['gangs']} groups were ready after {order['after_s']} s."
        )
    if "skipped" in s:
        lines.append(f"Slurm skipped: {s['skipped']}")
    else:
        lines.append(
            f"Slurm: {s['version']}, {s['daemons']}, auth/{s['auth']}, SchedulerParameters={s['scheduler_parameters']}; "
            f'salloc from its launch to "Granted job allocation" (the command\'s start included), and to its exit '
            f"(ran /bin/true, gave the allocation back): 1-GPU p50 {s['g1_exit_p50_ms']} ms, 4 x 8 p50 "
            f"{s['g4x8_exit_p50_ms']} ms; {s['jobs_per_round']} jobs a round by {s['clients']} threads: sbatch, "
            f"first submit to last allocation in slurmctld's log, {s['sbatch_per_s']} jobs/s (accepted: "
            f"{s['sbatch_accepted_per_s']} jobs/s); salloc --no-shell, to the last grant, {s['salloc_per_s']} jobs/s."
        )
    for miss in result["targets_missed"]:
        lines.append(f"target missed: {miss}")
    return "\n".join(lines)


def run(args) -> dict:
    admin = normalize_url(args.db).replace("postgresql+psycopg://", "postgresql://")
    result: dict = {
        "bench": "peers",
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],  # the machine may be shared: say how busy
        "nodes": NODES,
        "gpus_per_node": GPUS_PER_NODE,
        "samples": args.samples,
        "rounds": args.rounds,
    }
    result["phalanx"] = asyncio.run(phalanx_side(admin, NODES, args.samples, args.rounds))
    # The baseline of decide-at-submit, in the same run: every submit decided by a pass, as before issue 35
    result["phalanx_pass"] = asyncio.run(phalanx_side(admin, NODES, args.samples, args.rounds, "--no-admission-lane"))
    # The baseline of the fence in the pipeline: every cycle waits for the clock row's lock before deciding
    result["phalanx_locked"] = asyncio.run(
        phalanx_side(admin, NODES, args.samples, args.rounds, "--no-fence-in-pipeline")
    )
    why = "--no-ray" if args.no_ray else ray_missing()
    if why:
        say(f"skipped Ray: {why}")
        result["ray"] = {"skipped": why}
    else:
        result["ray"] = ray_side(args.samples, args.rounds)
    result["slurm"] = slurm_side(args.samples, args.rounds, args.no_slurm)
    if not args.quick:
        result["phalanx_256"] = asyncio.run(phalanx_side(admin, BIG_NODES, args.samples, args.rounds))
    result["ratios"], result["targets_missed"] = compare(result["phalanx"], result["ray"], result["slurm"])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=200, help="latency samples per figure and side (--quick: 30)")
    p.add_argument("--quick", action="store_true", help="fewer samples and rounds, no 256-node run: under 2 minutes")
    p.add_argument("--no-ray", action="store_true", help="skip Ray (reported as skipped)")
    p.add_argument("--no-slurm", action="store_true", help="skip Slurm (reported as skipped), as where it is absent")
    p.add_argument(
        "--db",
        default=os.environ.get("PHALANX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test"),
        help="PostgreSQL server for Phalanx's ledger (a database is created and dropped), as gang_reservation.py",
    )
    args = p.parse_args()
    args.rounds = 20
    if args.quick:
        args.rounds = 5
        if "--samples" not in sys.argv:
            args.samples = 30
    result = run(args)
    print(table(result), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
