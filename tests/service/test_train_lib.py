"""phalanx.train (the rank-side library) against a real coordinator on 127.0.0.1, on SQLite and PostgreSQL.

The library is blocking (training code is), so each call runs in a thread beside the in-process server's loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from helpers.clock import FakeClock
from helpers.jobs import insert_job, set_attempt, set_world
from helpers.ports import reserved_port
from helpers.waits import eventually, holds
from sqlalchemy import select

from db.engine import make_engine
from db.models import Checkpoint
from phalanx import train
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc
from services.checkpoint_coordinator import serve

JOB = "job-train-1"


@pytest.fixture
async def server(db_url):
    insert_job(db_url, JOB)
    srv = await serve(db_url, "127.0.0.1:0", sweep_interval=0)
    yield srv
    await srv.stop(0)


def _env(server, tmp_path: Path, rank: int, world: int = 2, attempt: int = 1, **extra) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "PHALANX_JOB_ID": JOB,
        "PHALANX_ATTEMPT": str(attempt),
        "PHALANX_CHECKPOINT_ADDR": server.address,
        "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
    }
    env.update(extra)
    return env


def _ranks(server, tmp_path, world: int = 2, **kw) -> list[train.Checkpointer]:
    return [train.Checkpointer(_env(server, tmp_path, r, world, **kw)) for r in range(world)]


async def test_save_restore_round_trip_two_ranks(server, tmp_path):
    ranks = _ranks(server, tmp_path)
    assert [await asyncio.to_thread(c.restore) for c in ranks] == [None, None]
    states = [{"rank": r, "weights": list(range(r, r + 5))} for r in range(2)]
    first = await asyncio.to_thread(ranks[0].save, 5, states[0])
    assert not first.committed and first.checksum.startswith("sha256:")
    assert Path(tmp_path / "ckpt" / JOB / "5" / "attempt-1" / "rank-0.json").is_file()
    assert await asyncio.to_thread(ranks[1].restore) is None  # one shard of two: not a restore point
    second = await asyncio.to_thread(ranks[1].save, 5, states[1])
    assert second.committed and second.checkpoint_id == first.checkpoint_id
    assert [await asyncio.to_thread(c.restore) for c in ranks] == [(5, states[0]), (5, states[1])]

    # step 9: only rank 1 saves before the relaunch; the restore point stays step 5
    await asyncio.to_thread(ranks[1].save, 9, {"late": True})
    assert await asyncio.to_thread(ranks[0].restore) == (5, states[0])
    for c in ranks:
        c.close()


async def test_relaunch_restores_and_fences_the_old_attempt(server, tmp_path, db_url):
    old = _ranks(server, tmp_path)
    for c in old:
        await asyncio.to_thread(c.save, 3, {"r": c.rank})
    set_attempt(db_url, JOB, 2)
    new = _ranks(server, tmp_path, attempt=2)
    assert [await asyncio.to_thread(c.restore) for c in new] == [(3, {"r": 0}), (3, {"r": 1})]
    with pytest.raises(train.CheckpointRejectedError) as err:
        await asyncio.to_thread(old[0].save, 4, {"zombie": True})
    assert err.value.code == "FAILED_PRECONDITION" and "superseded" in str(err.value)
    # attempt 2 commits step 5; a late attempt-1 rank writing step 5 lands in its own file and is refused
    for c in new:
        await asyncio.to_thread(c.save, 5, {"new": c.rank})
    with pytest.raises(train.CheckpointRejectedError):
        await asyncio.to_thread(old[1].save, 5, {"zombie": True})
    assert [await asyncio.to_thread(c.restore) for c in new] == [(5, {"new": 0}), (5, {"new": 1})]
    for c in old + new:
        c.close()


async def test_a_rank_that_never_reports_aborts_the_checkpoint_and_restore_returns_the_previous(db_url, tmp_path):
    """Step 10: rank 0 saves, rank 1 never reports (hung or dead). The checkpoint aborts at its deadline, every rank's
    restore() still returns step 5, and a late report of the aborted step is refused, so it can never commit."""
    insert_job(db_url, JOB)
    srv = await serve(db_url, "127.0.0.1:0", sweep_interval=0.1)  # the sweeper aborts expired checkpoints
    ranks = _ranks(srv, tmp_path)  # step 5 has the coordinator's default deadline: both its reports land in it
    try:
        for c in ranks:
            await asyncio.to_thread(c.save, 5, {"step": 5, "rank": c.rank})
        ranks[0].deadline_s = 0.5  # the deadline of the checkpoint rank 0 begins next (step 10)
        partial = await asyncio.to_thread(ranks[0].save, 10, {"step": 10, "rank": 0})
        assert not partial.committed
        engine = make_engine(db_url)
        try:

            def states():
                with engine.connect() as conn:
                    return dict(conn.execute(select(Checkpoint.step, Checkpoint.state)).all())

            await eventually(lambda: holds(lambda: states().get(10) == "ABORTED"), what="step 10 aborted")
            assert states() == {5: "COMMITTED", 10: "ABORTED"}
        finally:
            engine.dispose()
        assert [await asyncio.to_thread(c.restore) for c in ranks] == [
            (5, {"step": 5, "rank": 0}),
            (5, {"step": 5, "rank": 1}),
        ]
        with pytest.raises(train.CheckpointRejectedError) as err:  # rank 1 wakes up too late
            await asyncio.to_thread(ranks[1].save, 10, {"step": 10, "rank": 1})
        assert err.value.code == "FAILED_PRECONDITION" and "aborted" in err.value.message
        assert [(await asyncio.to_thread(c.restore))[0] for c in ranks] == [5, 5]
    finally:
        for c in ranks:
            c.close()
        await srv.stop(0)


async def test_checksum_mismatch_on_restore_falls_back_on_every_rank(server, tmp_path):
    """Rank 1's shard of the only checkpoint is damaged: every rank (each checks every rank's shard) starts from
    step 0, and says why; checking only its own shard, rank 0 would restore it."""
    ranks = _ranks(server, tmp_path)
    results = [await asyncio.to_thread(c.save, 7, {"r": c.rank}) for c in ranks]
    path = Path(results[1].uri.removeprefix("file://"))
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    assert [await asyncio.to_thread(c.restore) for c in ranks] == [None, None]
    assert (
        ranks[0].last_restore.message
        == ranks[1].last_restore.message
        == ("started from step 0: no intact checkpoint (step 7 was damaged: sha256 mismatch in rank 1's shard)")
    )
    assert await asyncio.to_thread(ranks[0].restore, verify="rank") == (7, {"r": 0})
    for c in ranks:
        c.close()


async def test_world_size_change_is_refused(server, tmp_path):
    ranks = _ranks(server, tmp_path)
    for c in ranks:
        await asyncio.to_thread(c.save, 1, c.rank)
    with train.Checkpointer(_env(server, tmp_path, 0, world=4)) as wider:
        with pytest.raises(train.CheckpointError, match="world size 4"):
            await asyncio.to_thread(wider.restore)


async def test_should_checkpoint_every_n_steps(server, tmp_path):
    with train.Checkpointer(_env(server, tmp_path, 0, PHALANX_CHECKPOINT_EVERY="3")) as c:
        got = [s for s in range(10) if await asyncio.to_thread(c.should_checkpoint, s)]
    assert got == [3, 6, 9]


async def test_should_checkpoint_time_interval(server, tmp_path, monkeypatch):
    """A time policy fires on each rank at its own moment; the ranks agree one step through the coordinator. The
    ranks' clock is the test's: the interval passes when the test moves it, and steps 2-5 take no time at all."""
    from phalanx.train import _checkpointer

    clock = FakeClock()
    monkeypatch.setattr(_checkpointer, "time", clock)
    ranks = _ranks(server, tmp_path, PHALANX_CHECKPOINT_INTERVAL_S="0.2", PHALANX_CHECKPOINT_POLL_S="0")
    assert not any([await asyncio.to_thread(c.should_checkpoint, 1) for c in ranks])
    clock.advance(0.25)
    fired: dict[int, list[int]] = {c.rank: [] for c in ranks}
    for step in range(2, 6):
        for c in ranks:
            if await asyncio.to_thread(c.should_checkpoint, step):
                fired[c.rank].append(step)
                await asyncio.to_thread(c.save, step, f"s{c.rank}")
    # Both reported step 2 (the interval passed: rank 0 asked for a checkpoint), so the agreed step is 3.
    assert fired == {0: [3], 1: [3]}
    for c in ranks:
        c.close()


async def test_should_checkpoint_on_request_until_committed(server, tmp_path):
    ranks = _ranks(server, tmp_path, PHALANX_CHECKPOINT_POLL_S="0")
    assert not any([await asyncio.to_thread(c.should_checkpoint, 1) for c in ranks])
    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
        await stub.RequestCheckpoint(pb.RequestCheckpointRequest(job_id=JOB, reason="preemption"))
    # Each rank reports step 2; once both have, the agreed step is 3, the first both can still reach.
    assert not any([await asyncio.to_thread(c.should_checkpoint, 2) for c in ranks])
    assert all([await asyncio.to_thread(c.should_checkpoint, 3) for c in ranks])
    await asyncio.to_thread(ranks[0].save, 3, "a")
    # rank 0 has answered this request; rank 1 has not yet
    assert not await asyncio.to_thread(ranks[0].should_checkpoint, 4)
    assert await asyncio.to_thread(ranks[1].should_checkpoint, 3)
    await asyncio.to_thread(ranks[1].save, 3, "b")  # commits, which clears the request
    assert not any([await asyncio.to_thread(c.should_checkpoint, 4) for c in ranks])
    for c in ranks:
        c.close()


def _dead_port() -> int:
    return reserved_port()  # nothing listens there, and nothing will meanwhile


def test_poll_failure_is_no_request(tmp_path, monkeypatch):
    from phalanx.train import _checkpointer

    monkeypatch.setattr(_checkpointer, "RETRIES", 2)  # UNAVAILABLE is retried ~5 s by default; twice shows it too
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "PHALANX_JOB_ID": JOB,
        "PHALANX_ATTEMPT": "0",
        "PHALANX_CHECKPOINT_ADDR": f"127.0.0.1:{_dead_port()}",
        "PHALANX_CHECKPOINT_DIR": str(tmp_path),
    }
    with train.Checkpointer(env, timeout=1) as c:
        assert c.should_checkpoint(1) is False
        with pytest.raises(train.CheckpointRejectedError, match="UNAVAILABLE"):
            c.restore()


@pytest.mark.parametrize(
    "drop,needle",
    [
        ("RANK", "RANK"),
        ("PHALANX_JOB_ID", "PHALANX_JOB_ID"),
        ("PHALANX_CHECKPOINT_ADDR", "PHALANX_CHECKPOINT_ADDR"),
        ("PHALANX_CHECKPOINT_DIR", "PHALANX_CHECKPOINT_DIR"),
    ],
)
def test_missing_env_names_the_variable(tmp_path, drop, needle):
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "PHALANX_JOB_ID": JOB,
        "PHALANX_ATTEMPT": "0",
        "PHALANX_CHECKPOINT_ADDR": "127.0.0.1:1",
        "PHALANX_CHECKPOINT_DIR": str(tmp_path),
    }
    del env[drop]
    with pytest.raises(train.CheckpointConfigError, match=needle):
        train.Checkpointer(env)


def test_bad_env_values(tmp_path):
    base = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "PHALANX_JOB_ID": JOB,
        "PHALANX_ATTEMPT": "0",
        "PHALANX_CHECKPOINT_ADDR": "127.0.0.1:1",
        "PHALANX_CHECKPOINT_DIR": str(tmp_path),
    }
    for bad, needle in (
        ({"RANK": "2", "WORLD_SIZE": "2"}, "must be <"),
        ({"WORLD_SIZE": "x"}, "not an integer"),
        ({"PHALANX_CHECKPOINT_EVERY": "-1"}, ">= 0"),
        ({"PHALANX_CHECKPOINT_INTERVAL_S": "nan"}, ">= 0"),
    ):
        with pytest.raises(train.CheckpointConfigError, match=needle):
            train.Checkpointer({**base, **bad})


def test_local_store_refuses_unsafe_job_ids(tmp_path):
    store = train.LocalStore(tmp_path)
    for job in ("../x", "a/b", "", "."):
        with pytest.raises(train.CheckpointError):
            store.put(job, 0, 1, 0, b"x")
    with pytest.raises(train.CheckpointError):
        store.put("ok-job", -1, 1, 0, b"x")
    uri = store.put("ok-job", 2, 1, 0, b"data")
    assert store.get(uri) == b"data"
    assert uri == (tmp_path / "ok-job" / "1" / "attempt-2" / "rank-0.json").resolve().as_uri()


async def test_module_level_functions_use_os_environ(server, tmp_path, monkeypatch, db_url):
    set_world(db_url, JOB, 1)
    for key, value in _env(server, tmp_path, 0, world=1).items():
        monkeypatch.setenv(key, value)
    train.reset()
    try:
        assert await asyncio.to_thread(train.restore) is None
        result = await asyncio.to_thread(train.save, 1, {"x": 1})
        assert result.committed
        assert await asyncio.to_thread(train.restore) == (1, {"x": 1})
    finally:
        train.reset()
