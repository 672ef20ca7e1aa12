"""High availability: several scheduler replicas, one leader holding a fenced lease on the ledger's clock row.

Real processes on PostgreSQL: only the leader schedules; the others take submissions and agents; kill -9 of the
leader under load hands over within seconds, losing and repeating nothing; a leader stopped (SIGSTOP) past its
lease is deposed, and when it resumes the epoch check refuses its scheduling: it goes on as a follower.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
import uuid

import grpc
import pytest
from helpers.ports import reserved_port
from helpers.procs import eventually, start_scheduler
from sqlalchemy import create_engine, text

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.client._channel import open_aio_channel
from phalanx.testing.lite_agent import LiteAgent

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

LEASE = 1.5
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED
TERMINAL = {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_CANCELLED, common_pb2.JOB_STATE_FAILED}


def free_port() -> int:
    return reserved_port()


def start_replicas(pg_url, tmp_path, n: int, metrics: bool = False):
    replicas = []
    for i in range(n):
        extra = ["--metrics-port", str(free_port())] if metrics else []
        r = start_scheduler(
            pg_url,
            tmp_path / f"r{i}.log",
            "--replica-id",
            f"r{i}",
            "--leader-lease",
            str(LEASE),
            "--lease-timeout",
            "10",
            "--heartbeat-interval",
            "0.5",
            *extra,
        )
        r.name, r.metrics = f"r{i}", (int(extra[1]) if extra else None)
        replicas.append(r)
    return replicas


def targets(replicas, first: int) -> str:
    """Every replica's address, `first`'s first: an agent or client uses it and fails over to the others."""
    order = replicas[first:] + replicas[:first]
    return ",".join(r.address for r in order)


class Ledger:
    def __init__(self, url: str) -> None:
        self.engine = create_engine(url)

    def clock(self) -> tuple[str, int, float]:
        with self.engine.connect() as conn:
            row = conn.execute(text("SELECT leader, leader_epoch, leader_until FROM ledger_clock WHERE id = 1")).one()
        return row[0], int(row[1]), float(row[2])

    def rows(self, sql: str):
        with self.engine.connect() as conn:
            return conn.execute(text(sql)).all()

    def placements(self) -> list[tuple[str, int, str, int, float]]:
        """(job, attempt, scheduler, epoch, started_at) of every reservation in the ledger's jobs."""
        out = []
        for job_id, attempt, placement, started in self.rows(
            "SELECT id, attempt, placement, started_at FROM jobs WHERE attempt > 0"
        ):
            p = placement if isinstance(placement, dict) else json.loads(placement or "{}")
            out.append((job_id, attempt, p.get("scheduler", ""), int(p.get("epoch", 0)), float(started)))
        return out

    def check_no_double_booking(self) -> None:
        double = self.rows(
            "SELECT a.gpu_id FROM allocations a JOIN allocations b ON a.gpu_id = b.gpu_id AND a.id < b.id "
            "AND a.reserved_at < COALESCE(b.released_at, 'infinity') "
            "AND b.reserved_at < COALESCE(a.released_at, 'infinity')"
        )
        assert double == [], "a GPU was held by two allocations at once"
        assert self.rows("SELECT job_id FROM job_attempts GROUP BY job_id HAVING count(*) > 1") == [], (
            "a job was placed twice"
        )

    def close(self) -> None:
        self.engine.dispose()


async def wait_leader(ledger: Ledger, *, not_: str = "", timeout: float = 15.0) -> tuple[str, int, float]:
    async def check():
        leader, epoch, until = ledger.clock()
        return (leader, epoch, until) if leader and leader != not_ and until > time.time() else None

    return await eventually(check, timeout=timeout, interval=0.02, what="a leader in the ledger")


def spec(name: str, seconds: float = 0.2, gpus: int = 4) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(name=name, replicas=1, gpus_per_replica=gpus, command=["sleep", f"{seconds}"])


async def submit(stub, job_spec, timeout: float = 30.0) -> str:
    """Submit with one request id, retried on UNAVAILABLE (idempotent: never two jobs)."""
    request_id = uuid.uuid4().hex
    deadline = time.monotonic() + timeout
    while True:
        try:
            job = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=job_spec, request_id=request_id), timeout=5)
            return job.id
        except grpc.aio.AioRpcError as exc:
            if (
                exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                or time.monotonic() > deadline
            ):
                raise
            await asyncio.sleep(0.1)


async def all_finished(stub, ids: set[str]):
    jobs = (await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000), timeout=10)).jobs
    done = {j.id: j.state for j in jobs if j.id in ids and j.state in TERMINAL}
    return done if len(done) == len(ids) else None


def log_of(replica) -> str:
    return replica.log_path.read_text(errors="replace")


async def test_one_leader_schedules_what_followers_accept(pg_url, tmp_path):
    replicas = start_replicas(pg_url, tmp_path, 3)
    ledger = Ledger(pg_url)
    agents = [LiteAgent(targets(replicas, i % 3), f"node-{i}") for i in range(6)]
    channels = [open_aio_channel(r.address) for r in replicas]
    stubs = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in channels]
    try:
        leader, epoch, _ = await wait_leader(ledger)
        assert leader == "r0"  # the first replica up takes the free lease; the others find it held
        for a in agents:
            await a.start()
        followers = [i for i, r in enumerate(replicas) if r.name != leader]
        ids = set(await asyncio.gather(*(submit(stubs[followers[i % 2]], spec(f"f-{i}")) for i in range(40))))
        finished = await eventually(
            lambda: all_finished(stubs[followers[0]], ids),
            timeout=30,
            interval=0.2,
            what="every job submitted to a follower finished",
        )
        assert set(finished.values()) == {SUCCEEDED}
        placements = ledger.placements()
        assert {(p[2], p[3]) for p in placements} == {(leader, epoch)}, "only the leader reserved"
        assert ledger.clock()[:2] == (leader, epoch)  # renewed all along, never changed hands
        for r in replicas:
            assert ("leadership_acquired" in log_of(r)) == (r.name == leader), r.name
        # Work reached agents connected to every replica.
        assert all(a.launched for a in agents)
        ledger.check_no_double_booking()
    finally:
        for a in agents:
            await a.stop()
        for ch in channels:
            await ch.close()
        for r in replicas:
            r.terminate()
        ledger.close()


async def test_kill9_leader_under_load_a_follower_takes_over(pg_url, tmp_path):
    replicas = start_replicas(pg_url, tmp_path, 3)
    ledger = Ledger(pg_url)
    agents = [LiteAgent(targets(replicas, i % 3), f"node-{i}") for i in range(6)]
    # Clients that list every replica: a submission in flight to the dead leader is retried on another one.
    channels = [open_aio_channel(targets(replicas, i)) for i in range(3)]
    stubs = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in channels]
    try:
        await wait_leader(ledger)
        for a in agents:
            await a.start()
        submitted: list[str] = []

        async def stream(k: int) -> None:
            for i in range(60):
                submitted.append(await submit(stubs[k], spec(f"s{k}-{i}", 0.3, gpus=(1, 2, 4, 8)[i % 4])))
                await asyncio.sleep(0.03)

        load = [asyncio.create_task(stream(k)) for k in range(3)]
        await eventually(
            lambda: _count(ledger, "SELECT count(*) FROM jobs WHERE state = 'SUCCEEDED'", 10),
            timeout=20,
            what="load under way",
        )
        # The leader of the moment (a replica stalled past its lease on a loaded machine may have handed it on since
        # the start), frozen before it is killed, so that what is killed is the leader and not a replica that lost
        # the lease between the look and the kill.
        victim, epoch, stopped_at = await freeze_the_leader(replicas, ledger)
        leader = victim.name
        victim.kill9()
        new_leader, new_epoch, _ = await wait_leader(ledger, not_=leader, timeout=15)
        print(f"failover after kill -9: {time.time() - stopped_at:.2f}s ({leader}/{epoch} -> {new_leader}/{new_epoch})")
        # The next epoch went to one of the survivors (a loaded machine may stall that one past its lease too, and
        # the third take over: legitimate, as long as each epoch had one leader). The ledger shows an epoch as soon
        # as the cycle that took it commits; its replica logs `leadership_acquired` only after that commit returned
        # (Leadership.committed), so on a loaded host the log can lag the ledger that wait_leader read: wait for the
        # line of epoch + 1 (written once that commit returns, whatever else happens) before counting who wrote it.
        await eventually(
            lambda: _any_acquired(replicas, epoch + 1), timeout=15, what=f"the log line of epoch {epoch + 1}"
        )
        successors = [r.name for r in replicas if epoch + 1 in _acquired(r)]
        assert len(successors) == 1 and successors[0] != leader, successors
        await asyncio.gather(*load)
        ids = set(submitted)
        assert len(ids) == len(submitted) == 180
        alive = next(i for i, r in enumerate(replicas) if r.name == new_leader)
        finished = await eventually(
            lambda: all_finished(stubs[alive], ids), timeout=45, interval=0.3, what="every submitted job finished"
        )
        assert set(finished.values()) == {SUCCEEDED}, {s for s in finished.values()}
        in_ledger = {r[0] for r in ledger.rows("SELECT id FROM jobs")}
        assert in_ledger == ids, "a job was lost or invented"
        ledger.check_no_double_booking()
        placements = ledger.placements()
        assert all(a == 1 for _, a, _, _, _ in placements), "a job was placed twice"
        # Every reservation was made under a leadership epoch by its one leader; the killed leader reserved nothing
        # after it was stopped, and all that was reserved since was reserved under the epochs after its own.
        by_epoch: dict[int, set[str]] = {}
        for _, _, scheduler, at_epoch, _ in placements:
            by_epoch.setdefault(at_epoch, set()).add(scheduler)
        assert all(len(names) == 1 for names in by_epoch.values()), by_epoch
        since = [p for p in placements if p[4] > stopped_at]
        assert since and all(p[3] > epoch and p[2] != leader for p in since), since
        launches = [(launch.job_id, launch.attempt, launch.replica) for a in agents for launch in a.launched]
        assert len(launches) == len(set(launches))
        assert _count_now(ledger, "SELECT count(*) FROM allocations WHERE released_at IS NULL") == 0
    finally:
        for a in agents:
            await a.stop()
        for ch in channels:
            await ch.close()
        for r in replicas:
            if r.proc.poll() is None:
                r.terminate()
        ledger.close()


async def test_stopped_leader_is_fenced_when_it_resumes(pg_url, tmp_path):
    replicas = start_replicas(pg_url, tmp_path, 2, metrics=True)
    ledger = Ledger(pg_url)
    old, new = replicas
    channels = [open_aio_channel(r.address) for r in replicas]
    stubs = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in channels]
    # The agents talk to the replica that will survive (with the other as fallback).
    agents = [LiteAgent(targets(replicas, 1), f"node-{i}") for i in range(3)]
    try:
        leader, epoch, _ = await wait_leader(ledger)
        assert leader == old.name
        for a in agents:
            await a.start()
        before = {await submit(stubs[1], spec(f"before-{i}", 0.1)) for i in range(4)}
        await eventually(lambda: all_finished(stubs[1], before), timeout=20, what="first jobs done")

        old.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        try:
            # A submission to the stopped leader waits in its socket; on resume it runs as a follower's command.
            late = asyncio.create_task(
                _call(
                    stubs[0].SubmitJob(
                        scheduler_pb2.SubmitJobRequest(spec=spec("sent-to-stopped-leader", 0.1), request_id="late-1"),
                        timeout=40,
                        wait_for_ready=True,
                    )
                )
            )
            # (Stopped inside a transaction, it holds the clock row until PostgreSQL's idle timeout, 2 x lease, ends
            # its session.)
            taken = await wait_leader(ledger, not_=old.name, timeout=15)
            print(f"takeover from a stopped leader: {time.time() - stopped_at:.2f}s (lease {LEASE}s)")
            assert taken[:2] == (new.name, epoch + 1)
            during = {await submit(stubs[1], spec(f"during-{i}", 0.1)) for i in range(4)}
            await eventually(lambda: all_finished(stubs[1], during), timeout=20, what="new leader schedules")
            # The old lease long gone: the new leader has renewed its own since.
            await eventually(
                lambda: _renewed_since(ledger, new.name, epoch + 1, taken[2]), what="the new leader's lease renewed"
            )
        finally:
            old.proc.send_signal(signal.SIGCONT)
        resumed_at = time.time()

        await eventually(lambda: _has(old, "leadership_lost"), timeout=10, what="the old leader saw the new epoch")
        late_job = await late
        after = {await submit(stubs[0], spec(f"after-{i}", 0.1)) for i in range(4)}  # through the old one
        ids = before | during | after | {late_job.id}
        finished = await eventually(lambda: all_finished(stubs[0], ids), timeout=20, what="every job done")
        assert set(finished.values()) == {SUCCEEDED}

        # Fencing, from the ledger: nothing the old leader reserved is younger than its stop; everything since
        # the takeover was reserved under the new epoch, the late submission included.
        placements = {p[0]: p for p in ledger.placements()}
        assert not [p for p in placements.values() if p[2] == old.name and p[4] >= stopped_at]
        for job_id in during | after | {late_job.id}:
            assert placements[job_id][2:4] == (new.name, epoch + 1), placements[job_id]
        assert ledger.clock()[:2] == (new.name, epoch + 1), "the old leader took the lease back"
        ledger.check_no_double_booking()
        # ... and from the old replica itself: its log and metrics say it was deposed and follows.
        lost = [json.loads(line) for line in log_of(old).splitlines() if "leadership_lost" in line]
        assert lost and lost[0].get("leader_epoch") == epoch + 1 and lost[0].get("epoch") == epoch
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{old.metrics}/metrics", timeout=5).read().decode()
        assert _metric(metrics, "phalanx_scheduler_leader") == 0
        assert _metric(metrics, "phalanx_scheduler_fenced_total") >= 1
        assert _metric(metrics, "phalanx_scheduler_leader_epoch") == epoch + 1
        new_metrics = urllib.request.urlopen(f"http://127.0.0.1:{new.metrics}/metrics", timeout=5).read().decode()
        assert _metric(new_metrics, "phalanx_scheduler_leader") == 1
        assert resumed_at > stopped_at
    finally:
        for a in agents:
            await a.stop()
        for ch in channels:
            await ch.close()
        for r in replicas:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGCONT)
                r.terminate()
        ledger.close()


async def freeze_the_leader(replicas, ledger: Ledger):
    """SIGSTOP the replica the ledger names as the leader, and check that it still is once it can no longer renew or
    write (else let it go on and look again): (that replica, its epoch, when it was stopped)."""
    while True:
        leader, epoch, _ = await wait_leader(ledger)
        replica = next(r for r in replicas if r.name == leader)
        replica.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        if ledger.clock()[:2] == (leader, epoch):
            return replica, epoch, stopped_at
        replica.proc.send_signal(signal.SIGCONT)  # it had lost the lease before it stopped: not the leader


async def _renewed_since(ledger: Ledger, name: str, epoch: int, until: float) -> bool:
    leader, at_epoch, now_until = ledger.clock()
    return (leader, at_epoch) == (name, epoch) and now_until > until


def _acquired(replica) -> set[int]:
    """The leadership epochs a replica's log says it acquired."""
    return {json.loads(line)["epoch"] for line in log_of(replica).splitlines() if '"leadership_acquired"' in line}


async def _any_acquired(replicas, epoch: int) -> bool:
    return any(epoch in _acquired(r) for r in replicas)


async def _call(call):
    return await call


async def _count(ledger: Ledger, sql: str, at_least: int):
    return _count_now(ledger, sql) >= at_least


def _count_now(ledger: Ledger, sql: str) -> int:
    return int(ledger.rows(sql)[0][0])


async def _has(replica, needle: str) -> bool:
    return needle in log_of(replica)


def _metric(body: str, name: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


async def test_services_are_kept_by_whichever_replica_leads(pg_url, tmp_path):
    """A service created through a follower is reconciled by the leader; after kill -9 of the leader the next
    leader's controller carries on (it scales the service), and no index ever has two live replica gangs."""
    from phalanx.api.v1 import service_pb2, service_pb2_grpc

    replicas = start_replicas(pg_url, tmp_path, 2)
    ledger = Ledger(pg_url)
    agents = [LiteAgent(targets(replicas, i % 2), f"node-{i}") for i in range(4)]
    channels = [open_aio_channel(r.address) for r in replicas]
    try:
        leader, _, _ = await wait_leader(ledger)
        for a in agents:
            await a.start()
        follower = next(i for i, r in enumerate(replicas) if r.name != leader)
        svc = service_pb2_grpc.ServiceServiceStub(channels[follower])
        template = common_pb2.JobSpec(replicas=1, gpus_per_replica=8, command=["run"])
        await svc.CreateService(
            service_pb2.CreateServiceRequest(spec=service_pb2.ServiceSpec(name="ha", replicas=2, template=template)),
            timeout=30,
        )

        async def ready(count: int):
            got = await svc.GetService(service_pb2.GetServiceRequest(name="ha"), timeout=5)
            return got if got.ready_replicas == count == len(got.replicas) else None

        await eventually(lambda: ready(2), timeout=30, interval=0.1, what="2 ready replicas")
        old = next(r for r in replicas if r.name == leader)
        old.proc.send_signal(signal.SIGKILL)
        await wait_leader(ledger, not_=leader, timeout=30)
        await svc.ScaleService(service_pb2.ScaleServiceRequest(name="ha", replicas=3), timeout=30)
        await eventually(lambda: ready(3), timeout=30, interval=0.1, what="3 ready replicas under the new leader")
        rows = ledger.rows("SELECT serving FROM jobs WHERE service = 'ha' AND state IN ('PENDING', 'RUNNING')")
        indexes = sorted(int((s if isinstance(s, dict) else json.loads(s))["replica"]) for (s,) in rows)
        assert indexes == [0, 1, 2], indexes  # one live gang per index, whoever led
        ledger.check_no_double_booking()
    finally:
        for a in agents:
            await a.stop()
        for ch in channels:
            await ch.close()
        for r in replicas:
            if r.proc.poll() is None:
                r.terminate()
        ledger.close()
