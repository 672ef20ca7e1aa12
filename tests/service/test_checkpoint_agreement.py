"""Collective step agreement (issue 16, contract 2): when a checkpoint is asked for (a request, or a rank's time
policy), every rank checkpoints at the same step, the first one every rank can still reach, which the coordinator
picks from the steps the ranks report with their polls. On SQLite and PostgreSQL, through the store and through
real Checkpointers talking gRPC to a coordinator on 127.0.0.1.

The Checkpointers run on a fake clock (their module's `time`), so the poll slots and the time policies are
deterministic; the coordinator and the database run on the real one.
"""

from __future__ import annotations

import asyncio
import collections
import random
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from helpers.jobs import insert_job, set_attempt
from sqlalchemy import select, update

from db.engine import make_engine
from db.models import Checkpoint, CheckpointRequest, CheckpointShard, CheckpointStepReport, Job
from phalanx import train
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc
from phalanx.train import _checkpointer
from services.checkpoint_coordinator import serve, store
from services.common.errors import FailedPrecondition, InvalidArgument

JOB = "job-agree-1"


# -- the store ------------------------------------------------------------------------------------------------------


@pytest.fixture
def engine(db_url):
    insert_job(db_url, JOB, attempt=1, replicas=4, gpus_per_replica=1)  # a gang of 4 ranks
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


def _agreement_rows(engine) -> tuple[list[tuple], list[tuple]]:
    with engine.connect() as conn:
        requests = [
            tuple(r)
            for r in conn.execute(
                select(
                    CheckpointRequest.job_id,
                    CheckpointRequest.requested_at,
                    CheckpointRequest.target_attempt,
                    CheckpointRequest.target_step,
                )
            )
        ]
        reports = [
            tuple(r)
            for r in conn.execute(
                select(
                    CheckpointStepReport.attempt,
                    CheckpointStepReport.rank,
                    CheckpointStepReport.step,
                    CheckpointStepReport.requested_at,
                ).order_by(CheckpointStepReport.attempt, CheckpointStepReport.rank)
            )
        ]
    return requests, reports


def _poll(engine, rank: int, step: int | None, attempt: int = 1) -> store.RequestRecord:
    return store.get_request(engine, JOB, attempt, rank, step)


def test_the_target_is_the_highest_reported_step_plus_one_and_stable(engine):
    # No request: a poll with a step writes nothing.
    assert not _poll(engine, 0, 3).requested
    assert _agreement_rows(engine) == ([], [])
    asked = store.request_checkpoint(engine, JOB, "user", now=100.0)
    # The ranks report different steps; nothing is decided until every rank 0..3 has reported.
    for rank, step, reported in ((0, 5, 1), (1, 7, 2), (2, 6, 3), (0, 6, 3)):  # rank 0 again: its report replaced
        got = _poll(engine, rank, step)
        assert (got.requested, got.target_step, got.ranks_reported, got.decided) == (True, None, reported, False)
    read = _poll(engine, 3, None)  # a poll without a step (an older client): read-only
    assert (read.requested, read.requested_at, read.target_step, read.ranks_reported) == (True, 100.0, None, 3)
    decided = _poll(engine, 3, 6)
    assert (decided.target_step, decided.ranks_reported, decided.decided) == (8, 4, True)  # max(6, 7, 6, 6) + 1
    assert _agreement_rows(engine) == (
        [(JOB, 100.0, 1, 8)],
        [(1, 0, 6, 100.0), (1, 1, 7, 100.0), (1, 2, 6, 100.0), (1, 3, 6, 100.0)],
    )
    # Stable: later polls (with steps at or before it, or none) get the same target and write nothing.
    before = _agreement_rows(engine)
    for rank, step in ((0, 7), (1, 8), (2, None), (3, 8)):
        got = _poll(engine, rank, step)
        assert (got.target_step, got.decided, got.restarted) == (8, False, False)
    assert _agreement_rows(engine) == before
    # A second request is idempotent: the first stands, and its agreement with it.
    again = store.request_checkpoint(engine, JOB, "interval")
    assert (again.reason, again.requested_at) == ("user", asked.requested_at)
    assert _poll(engine, 0, None).target_step == 8


def test_a_report_past_the_target_starts_the_agreement_over(engine):
    store.request_checkpoint(engine, JOB, "preemption", now=100.0)
    for rank in range(4):
        got = _poll(engine, rank, 10)
    assert got.target_step == 11
    # Rank 2 did not learn 11 in time (its polls failed) and is at 12: it can no longer checkpoint at 11.
    late = _poll(engine, 2, 12)
    assert (late.target_step, late.ranks_reported, late.restarted) == (None, 1, True)
    assert _agreement_rows(engine) == ([(JOB, 100.0, None, None)], [(1, 2, 12, 100.0)])
    for rank, step in ((0, 11), (1, 12), (3, 11)):
        got = _poll(engine, rank, step)
    assert (got.target_step, got.decided) == (13, True)  # a new target, necessarily later than the old one


def test_a_rank_out_of_range_or_another_attempt_is_refused_and_writes_nothing(engine, db_url):
    store.request_checkpoint(engine, JOB, "user", now=100.0)
    _poll(engine, 0, 4)
    before = _agreement_rows(engine)
    for rank in (4, 5, 1 << 30):  # the ledger has ranks 0..3 (the rank the client claims is not believed)
        with pytest.raises(InvalidArgument, match=r"rank must be in 0\.\.3"):
            _poll(engine, rank, 4)
    with pytest.raises(InvalidArgument, match="rank must be >= 0"):
        _poll(engine, -1, 4)
    for step in (-1, (1 << 63) - 1):  # the target, step + 1, must fit a BIGINT
        with pytest.raises(InvalidArgument, match="step must be in 0.."):
            _poll(engine, 1, step)
    for attempt in (0, 2):
        with pytest.raises(FailedPrecondition, match=f"attempt {attempt} is superseded"):
            _poll(engine, 1, 4, attempt=attempt)
    assert _agreement_rows(engine) == before
    # An attempt the scheduler tore down takes no report either (fenced like every write).
    with engine.begin() as conn:
        conn.execute(update(Job).where(Job.id == JOB).values(state="PENDING"))
    with pytest.raises(FailedPrecondition, match="has ended"):
        _poll(engine, 1, 4)
    assert _agreement_rows(engine) == before


def test_each_attempt_agrees_anew(engine, db_url):
    store.request_checkpoint(engine, JOB, "user", now=100.0)
    for rank in range(4):
        got = _poll(engine, rank, 20 + rank)
    assert got.target_step == 24
    set_attempt(db_url, JOB, 2)  # requeued before it checkpointed: the request stays, its target does not
    fresh = _poll(engine, 0, None, attempt=2)
    assert (fresh.requested, fresh.target_step, fresh.ranks_reported) == (True, None, 0)
    with pytest.raises(FailedPrecondition, match="superseded"):
        _poll(engine, 0, 25)
    for rank in range(4):  # restored from an older step
        got = _poll(engine, rank, 3, attempt=2)
    assert (got.target_step, got.decided, got.ranks_reported) == (4, True, 4)
    requests, reports = _agreement_rows(engine)
    assert requests == [(JOB, 100.0, 2, 4)]
    assert [(a, r, s) for a, r, s, _ in reports if a == 2] == [(2, r, 3) for r in range(4)]


def test_the_commit_clears_the_request_and_its_reports(engine):
    store.request_checkpoint(engine, JOB, "user", now=100.0)
    for rank in range(4):
        target = _poll(engine, rank, 7).target_step
    assert target == 8
    for rank in range(4):
        done = store.report_shard(
            engine, JOB, 1, target, 0, store.ShardRecord(rank, f"file:///c/{rank}", 1, f"sha256:{rank:064x}")
        )
    assert done.state == store.COMMITTED
    assert _agreement_rows(engine) == ([], [])
    assert not _poll(engine, 0, 9).requested


def _commit(engine, step: int, world: int = 4) -> store.CheckpointRecord:
    for rank in range(world):
        done = store.report_shard(
            engine, JOB, 1, step, 0, store.ShardRecord(rank, f"file:///c/{step}/{rank}", 1, f"sha256:{rank:064x}")
        )
    assert done.state == store.COMMITTED
    return done


def test_a_commit_before_the_agreed_step_leaves_the_request_and_its_agreement(engine):
    """A checkpoint begun after the request but at a step before the one the ranks agreed (one they took anyway,
    every N steps) does not clear it: ranks that know the target act on it without asking again, so it stands,
    stable, until a checkpoint at or past the target commits."""
    store.request_checkpoint(engine, JOB, "preemption", now=100.0)
    for rank in range(4):
        target = _poll(engine, rank, 4).target_step
    assert target == 5
    before = _agreement_rows(engine)
    _commit(engine, 4)
    assert _agreement_rows(engine) == before
    assert [(_poll(engine, r, 5).target_step) for r in range(4)] == [5] * 4
    _commit(engine, 5)
    assert _agreement_rows(engine) == ([], [])
    # Undecided, or decided at the committed step: the commit clears it, as always.
    for step, reporters in ((7, range(3)), (8, range(4))):
        store.request_checkpoint(engine, JOB, "user", now=200.0)
        for rank in reporters:
            _poll(engine, rank, step - 1)
        # A whole checkpoint recorded in one call clears by the same rule.
        store.record_checkpoint(
            engine,
            JOB,
            1,
            step,
            [store.ShardRecord(r, f"file:///r/{step}/{r}", 1, f"sha256:{r:064x}") for r in range(4)],
        )
        assert _agreement_rows(engine) == ([], [])


# -- real Checkpointers over gRPC -----------------------------------------------------------------------------------


class Clock:
    """The Checkpointers' time: wall clock and monotonic alike, moved by the test (sleep moves it too)."""

    def __init__(self, start: float = 1_000_000.5) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(_checkpointer, "time", c)
    return c


async def _serve(db_url: str, world: int):
    insert_job(db_url, JOB, attempt=1, replicas=world, gpus_per_replica=1)
    return await serve(db_url, "127.0.0.1:0", sweep_interval=0)


def _env(address: str, tmp_path, rank: int, world: int, **extra) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "PHALANX_JOB_ID": JOB,
        "PHALANX_ATTEMPT": "1",
        "PHALANX_CHECKPOINT_ADDR": address,
        "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
    }
    env.update(extra)
    return env


class Gang:
    """Ranks driven one step per tick, in shuffled order, each starting at its own step: a rank saves when its
    should_checkpoint says so, as a training loop does."""

    def __init__(
        self,
        ranks: list[train.Checkpointer],
        clock: Clock,
        seed: int,
        steps: list[int] | None = None,
        tick_s: float = 1.0,
    ) -> None:
        self.ranks, self.clock, self.rng, self.tick_s = ranks, clock, random.Random(seed), tick_s
        self.steps = list(steps) if steps is not None else [0] * len(ranks)
        self.fired: list[list[int]] = [[] for _ in ranks]
        self.saves: list[train.SaveResult] = []

    def tick(self, during=None) -> None:
        """One step of every rank; `during(steps)` runs once, between two ranks' calls at a random point."""
        self.clock.sleep(self.tick_s)
        order = list(range(len(self.ranks)))
        self.rng.shuffle(order)
        at = self.rng.randrange(len(order) + 1) if during is not None else -1
        for i, r in enumerate(order):
            if i == at:
                during(list(self.steps))
            self.steps[r] += 1
            step = self.steps[r]
            if self.ranks[r].should_checkpoint(step):
                self.fired[r].append(step)
                self.saves.append(self.ranks[r].save(step, {"rank": r, "step": step}))
        if at == len(order):
            during(list(self.steps))

    @property
    def committed(self) -> list[train.SaveResult]:
        return [s for s in self.saves if s.committed]

    def run_until_committed(self, limit: int) -> int:
        for n in range(1, limit + 1):
            self.tick()
            if self.committed:
                return n
        raise AssertionError(f"no checkpoint committed within {limit} ticks: fired {self.fired}")


def _ledger_checkpoints(db_url: str) -> list[tuple[int, str, list[int]]]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(Checkpoint.id, Checkpoint.step, Checkpoint.state).order_by(Checkpoint.step)
            ).all()
            return [
                (
                    r.step,
                    r.state,
                    list(
                        conn.scalars(
                            select(CheckpointShard.rank)
                            .where(CheckpointShard.checkpoint_id == r.id)
                            .order_by(CheckpointShard.rank)
                        )
                    ),
                )
                for r in rows
            ]
    finally:
        engine.dispose()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.slow
async def test_drifting_ranks_checkpoint_a_request_at_one_step(db_url, tmp_path, clock, seed):
    """8 ranks a step apart (odd ranks ahead), called in shuffled order; a RequestCheckpoint lands between two
    of them. Every rank returns True exactly once, at the same step, after the step every rank was at when the
    request arrived; the checkpoint commits and the request is cleared."""
    world = 8
    srv = await _serve(db_url, world)
    ch = grpc.insecure_channel(srv.address)
    stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
    ranks = [
        train.Checkpointer(_env(srv.address, tmp_path, r, world, PHALANX_CHECKPOINT_POLL_S="4"), channel=ch)
        for r in range(world)
    ]
    gang = Gang(ranks, clock, seed, steps=[r % 2 for r in range(world)])
    seen: dict[str, list[int]] = {}

    def ask(steps):
        seen["steps"] = steps
        stub.RequestCheckpoint(pb.RequestCheckpointRequest(job_id=JOB, reason="user"))

    def drive():
        for _ in range(3):
            gang.tick()
        assert gang.saves == []
        gang.tick(during=ask)
        ticks = gang.run_until_committed(12)
        for _ in range(6):  # the request is cleared: nothing more
            gang.tick()
        return ticks

    try:
        ticks = await asyncio.to_thread(drive)
        target = gang.fired[0][0]
        assert gang.fired == [[target]] * world, gang.fired
        assert target > max(seen["steps"])  # after every rank's step at the request
        assert ticks <= 4 + 3  # within a poll slot (4 ticks), then about two steps
        assert [s.step for s in gang.committed] == [target]
        assert _ledger_checkpoints(db_url) == [(target, "COMMITTED", list(range(world)))]
        state = await asyncio.to_thread(
            stub.GetCheckpointRequest, pb.GetCheckpointRequestRequest(job_id=JOB, attempt=1)
        )
        assert state.agreeing and not state.requested
    finally:
        for c in ranks:
            c.close()
        ch.close()
        await srv.stop(0)


@pytest.mark.slow
async def test_the_time_policy_leads_to_one_agreed_step(db_url, tmp_path, clock):
    """PHALANX_CHECKPOINT_INTERVAL_S=30 on 8 ranks started a second apart: the first whose interval passes asks
    the coordinator (reason "interval") instead of checkpointing alone, and every rank checkpoints at one step;
    the next interval, measured from that save, does it again."""
    world = 8
    srv = await _serve(db_url, world)
    ch = grpc.insecure_channel(srv.address)
    stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
    ranks = []
    for r in range(world):
        ranks.append(
            train.Checkpointer(
                _env(
                    srv.address, tmp_path, r, world, PHALANX_CHECKPOINT_POLL_S="4", PHALANX_CHECKPOINT_INTERVAL_S="30"
                ),
                channel=ch,
            )
        )
        clock.sleep(1.0)
    gang = Gang(ranks, clock, 7, steps=[r % 2 for r in range(world)])
    reasons: list[str] = []

    def drive():
        for checkpoints in (1, 2):
            for _ in range(45):
                gang.tick()
                state = stub.GetCheckpointRequest(pb.GetCheckpointRequestRequest(job_id=JOB, attempt=1))
                if state.requested:
                    reasons.append(state.reason)
                if len(gang.committed) == checkpoints and not state.requested:
                    break
            else:
                raise AssertionError(f"checkpoint {checkpoints} did not commit: fired {gang.fired}")

    try:
        await asyncio.to_thread(drive)
        assert reasons and set(reasons) == {"interval"}
        targets = sorted({s.step for s in gang.saves})
        assert len(targets) == 2, gang.fired
        assert gang.fired == [targets] * world, gang.fired
        assert [s.step for s in gang.committed] == targets
        assert [(s, st) for s, st, _ in _ledger_checkpoints(db_url)] == [(t, "COMMITTED") for t in targets]
    finally:
        for c in ranks:
            c.close()
        ch.close()
        await srv.stop(0)


class _Flaky:
    """A stub whose GetCheckpointRequest fails while `failing` is set (as a coordinator out of reach)."""

    def __init__(self, stub) -> None:
        self._stub, self.failing = stub, False

    def __getattr__(self, name):
        method = getattr(self._stub, name)
        if name != "GetCheckpointRequest":
            return method

        def call(request, timeout=None):
            if self.failing:
                raise _RpcError()
            return method(request, timeout=timeout)

        return call


class _RpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INTERNAL

    def details(self):
        return "injected"


async def test_a_rank_that_missed_the_agreed_step_gets_a_new_agreement(db_url, tmp_path, clock):
    """Rank 0's poll fails at the step it would have learned the target: it is past it at its next poll, so the
    coordinator starts over and both ranks checkpoint, and commit, at a new step (rank 1's lone shard at the old
    one never commits). Without that, the request would stay outstanding, never answered."""
    srv = await _serve(db_url, 2)
    ch = grpc.insecure_channel(srv.address)
    stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
    ranks = [
        train.Checkpointer(_env(srv.address, tmp_path, r, 2, PHALANX_CHECKPOINT_POLL_S="0"), channel=ch)
        for r in range(2)
    ]
    flaky = ranks[0]._stub = _Flaky(ranks[0]._stub)

    def step(rank: int, s: int) -> bool:
        if ranks[rank].should_checkpoint(s):
            ranks[rank].save(s, {"rank": rank, "step": s})
            return True
        return False

    def drive():
        got = [(step(0, 1), step(1, 1))]
        stub.RequestCheckpoint(pb.RequestCheckpointRequest(job_id=JOB, reason="preemption"))
        got.append((step(0, 2), step(1, 2)))  # both report 2: the target is 3 (rank 1 learns it)
        flaky.failing = True
        got.append((step(0, 3), step(1, 3)))  # rank 0 learns nothing; rank 1 saves step 3 alone
        flaky.failing = False
        got.append((step(0, 4), step(1, 4)))  # rank 0 reports 4, past 3: over again; both report 4
        got.append((step(0, 5), step(1, 5)))  # the new target
        got.append((step(0, 6), step(1, 6)))
        return got

    try:
        assert await asyncio.to_thread(drive) == [
            (False, False),
            (False, False),
            (False, True),
            (False, False),
            (True, True),
            (False, False),
        ]
        assert _ledger_checkpoints(db_url) == [(3, "PENDING", [1]), (5, "COMMITTED", [0, 1])]
    finally:
        for c in ranks:
            c.close()
        ch.close()
        await srv.stop(0)


async def test_a_periodic_checkpoint_just_before_the_agreed_step_does_not_split_the_ranks(db_url, tmp_path, clock):
    """A request's step is agreed one step after a checkpoint the ranks take anyway (PHALANX_CHECKPOINT_EVERY):
    rank 1's report decides the target (5) at step 4, rank 0 reported 4 just before and does not know it yet,
    and both save step 4 (every 4), a checkpoint begun after the request. Its commit must not clear the request:
    rank 1 acts on the target it holds without polling again (same poll slot), while rank 0 still polls at every
    step, so a cleared request would have rank 1 checkpoint at step 5 and rank 0 not (the demo's exit 4, "the
    ranks disagree whether to checkpoint"). The request stands until its agreed step commits."""
    srv = await _serve(db_url, 2)
    ch = grpc.insecure_channel(srv.address)
    stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
    env = dict(PHALANX_CHECKPOINT_POLL_S="10", PHALANX_CHECKPOINT_EVERY="4")
    ranks = [train.Checkpointer(_env(srv.address, tmp_path, r, 2, **env), channel=ch) for r in range(2)]

    def decide(rank: int, s: int) -> bool:
        return ranks[rank].should_checkpoint(s)

    def lockstep(s: int, first: int = 0) -> tuple[bool, bool]:
        """Both ranks decide at step `s` (`first` calls first), then save if they agree, as a training loop in
        lockstep does (the collectives of a data-parallel step)."""
        got = {first: decide(first, s)}
        got[1 - first] = decide(1 - first, s)
        if got[0] and got[1]:
            for r in (0, 1):
                ranks[r].save(s, {"rank": r, "step": s})
        return got[0], got[1]

    def drive():
        got = [lockstep(1), lockstep(2)]  # both poll once at step 1 (no request), then wait for the next slot
        stub.RequestCheckpoint(pb.RequestCheckpointRequest(job_id=JOB, reason="preemption"))
        three = [decide(1, 3)]  # rank 1: still in the slot of its last poll, it does not see the request yet
        clock.sleep(10)  # the next poll slot
        three.insert(0, decide(0, 3))  # rank 0 polls, sees the request and reports step 3
        got.append((three[0], three[1]))
        got.append(lockstep(4))  # rank 0 reports 4; rank 1 polls (a new slot), reports 4 and decides 5; every 4
        got.append(lockstep(5))  # rank 0 polls (it reports at every step), rank 1 holds 5 (same slot)
        got.append(lockstep(6))
        return got

    try:
        got = await asyncio.to_thread(drive)
        assert got == [(False, False), (False, False), (False, False), (True, True), (True, True), (False, False)]
        assert _ledger_checkpoints(db_url) == [(4, "COMMITTED", [0, 1]), (5, "COMMITTED", [0, 1])]
        state = await asyncio.to_thread(
            stub.GetCheckpointRequest, pb.GetCheckpointRequestRequest(job_id=JOB, attempt=1)
        )
        assert state.agreeing and not state.requested  # the agreed step's commit cleared it
    finally:
        for c in ranks:
            c.close()
        ch.close()
        await srv.stop(0)


class _OldCoordinator:
    """A coordinator from before the step agreement: its answers have no `agreeing`."""

    def __init__(self) -> None:
        self.requested = False

    def GetCheckpointRequest(self, request, timeout=None):
        return pb.CheckpointRequestState(
            requested=self.requested, requested_at=5.0 if self.requested else 0.0, interval_s=3600.0
        )

    def BeginCheckpoint(self, request, timeout=None):
        return pb.Checkpoint(state="PENDING")

    def ReportShard(self, request, timeout=None):
        return pb.Checkpoint(state="COMMITTED")

    def RequestCheckpoint(self, request, timeout=None):  # never called: an older coordinator gets the old behaviour
        raise AssertionError("RequestCheckpoint sent to a coordinator that does not agree steps")


def test_an_older_coordinator_keeps_the_old_behaviour(tmp_path, clock):
    env = _env("127.0.0.1:1", tmp_path, 0, 2, PHALANX_CHECKPOINT_POLL_S="0", PHALANX_CHECKPOINT_INTERVAL_S="60")
    with train.Checkpointer(env) as c:
        c._stub = old = _OldCoordinator()
        assert not c.should_checkpoint(1)
        old.requested = True
        assert c.should_checkpoint(2)  # at once, on this rank's own step
        c.save(2, {"x": 1})
        assert not c.should_checkpoint(3)  # answered
        old.requested = False
        clock.sleep(61)
        assert c.should_checkpoint(4)  # the time policy decides locally


# -- 512 ranks, the default policy ----------------------------------------------------------------------------------


@pytest.fixture
def scratch(tmp_path):
    """A directory in memory (/dev/shm) where there is one, else tmp_path: a commit's fsync costs nothing there,
    and the 512-rank test makes about 1,500 of them (plus 512 shard files)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and shm.stat().st_mode & 0o002):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="phalanx-agreement-", dir=shm))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
async def test_512_ranks_commit_one_checkpoint_with_the_default_policy(sqlite_template, scratch, clock, monkeypatch):
    """The default policy (auto: the coordinator's suggested interval) on a gang of 512 ranks, all in one thread
    over one shared channel: once the interval has passed, every rank checkpoints at one step and it commits,
    with a few calls per rank (about 15 s on two cores; SQLite only, to keep it quick: PostgreSQL runs the same
    code paths in the tests above)."""
    world = 512
    shutil.copy(sqlite_template, scratch / "phalanx.db")
    db_url = f"sqlite:///{scratch / 'phalanx.db'}"
    calls: collections.Counter[str] = collections.Counter()
    call = train.Checkpointer._call

    def counted(self, method, request):
        calls[method] += 1
        return call(self, method, request)

    monkeypatch.setattr(train.Checkpointer, "_call", counted)
    srv = await _serve(db_url, world)
    ch = grpc.insecure_channel(srv.address)
    ranks = [train.Checkpointer(_env(srv.address, scratch, r, world), channel=ch) for r in range(world)]
    gang = Gang(ranks, clock, 3)

    # A gang that has trained for 10 days without a checkpoint: past the interval the coordinator suggests (with
    # no failures measured, about 14 h), which each rank learns from its first poll.
    clock.sleep(10 * 86400.0)

    def drive():
        return gang.run_until_committed(6)

    try:
        ticks = await asyncio.to_thread(drive)
        interval = ranks[0].auto_interval_s
        assert 0 < interval < 10 * 86400.0 and all(c.auto_interval_s == interval for c in ranks)
        target = gang.fired[0][0]
        assert gang.fired == [[target]] * world
        assert (ticks, target, len(gang.committed)) == (2, 2, 1)  # every rank reports step 1, then saves at 2
        assert _ledger_checkpoints(db_url) == [(target, "COMMITTED", list(range(world)))]
        # One poll per rank to report step 1 (the first rank's twice: before and after it asks), one more by each
        # rank but the one whose report decided, to learn the step; one request; a begin and a shard per rank.
        assert calls == {
            "GetCheckpointRequest": 2 * world,
            "RequestCheckpoint": 1,
            "BeginCheckpoint": world,
            "ReportShard": world,
        }
    finally:
        for c in ranks:
            c.close()
        ch.close()
        await srv.stop(0)
