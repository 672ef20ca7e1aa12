"""Checkpoint retention (issue 16): the coordinator keeps the newest K complete committed checkpoints of each job
(--keep-checkpoints, default 3; a job's own keep_checkpoints overrides it), deletes the older ones' files and the
shards of aborted checkpoints, applies --finished-checkpoints to finished jobs, and deletes only files inside its
--checkpoint-dir. The policy is unit tested; the rest runs through the real coordinator on 127.0.0.1 (and the real
scheduler for SubmitJob), on SQLite and PostgreSQL, with real shard files."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import time
from pathlib import Path

import grpc
import pytest
from helpers.jobs import insert_job, set_attempt
from sqlalchemy import select, update
from structlog.testing import capture_logs

from db.engine import make_engine
from db.models import Checkpoint, Job
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc, common_pb2
from phalanx.train.store import LocalStore
from services.checkpoint_coordinator import main as checkpointd
from services.checkpoint_coordinator import retention, serve, store
from services.checkpoint_coordinator.retention import ABORTED, COMMITTED, PENDING, Candidate, Retention

pytestmark = pytest.mark.timeout(30)

JOB = "job-keep-1"
WORLD = 2


# -- the policy ----------------------------------------------------------------------------------------------------


def _c(cid: str, step: int, state: str = COMMITTED, complete: bool = True, at: float = 0.0) -> Candidate:
    return Candidate(
        cid,
        step,
        state,
        committed_at=at or float(step),
        created_at=at or float(step),
        complete=complete and state == COMMITTED,
    )


def _ids(chosen) -> set[str]:
    return {c.id for c in chosen}


def test_policy_keeps_the_newest_k_complete_committed_and_never_a_pending_one():
    ckpts = [_c(f"s{s}", s) for s in (1, 2, 3, 4, 5)] + [_c("p9", 9, PENDING), _c("a7", 7, ABORTED)]
    assert _ids(retention.select_deletions(ckpts, 3)) == {"s1", "s2", "a7"}
    assert _ids(retention.select_deletions(ckpts, 1)) == {"s1", "s2", "s3", "s4", "a7"}
    assert _ids(retention.select_deletions(ckpts, 0)) == {"s1", "s2", "s3", "s4", "s5", "a7"}
    assert _ids(retention.select_deletions(ckpts, 10)) == {"a7"}
    assert retention.select_deletions([_c("p", 1, PENDING)], 0) == []
    # restore order: a tie on the step goes to the later commit
    tie = [_c("early", 5, at=10.0), _c("late", 5, at=20.0), _c("old", 4)]
    assert _ids(retention.select_deletions(tie, 1)) == {"early", "old"}


def test_policy_an_incomplete_commit_is_not_counted_and_goes_once_k_newer_ones_are_kept():
    ckpts = [_c("torn", 9, complete=False), _c("s5", 5), _c("s4", 4), _c("s3", 3), _c("torn2", 2, complete=False)]
    # the newest (torn) is no restore point: the newest 2 complete ones are s5 and s4; s3 and torn2 come after
    assert _ids(retention.select_deletions(ckpts, 2)) == {"s3", "torn2"}


def test_policy_k_per_job_and_for_finished_jobs():
    keep = retention.effective_keep
    assert keep(3, 0, "RUNNING") == 3 and keep(3, 1, "RUNNING") == 1 and keep(3, 7, "PENDING") == 7
    for policy in ("keep", "latest", "delete"):
        assert keep(3, 0, "RUNNING", policy) == 3  # only finished jobs follow the finished policy
    for state in ("SUCCEEDED", "FAILED", "CANCELLED"):
        assert keep(3, 5, state, "keep") == 5
        assert keep(3, 5, state, "latest") == 1
        assert keep(3, 5, state, "delete") == 0
    with pytest.raises(ValueError):
        retention.validate_keep(0)
    with pytest.raises(ValueError):
        retention.validate_finished("forever")


def test_policy_only_paths_inside_the_jobs_directory_under_the_root(tmp_path):
    root = (tmp_path / "ckpt").resolve()
    (root / JOB / "5" / "attempt-1").mkdir(parents=True)
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    link = root / JOB / "5" / "attempt-1" / "rank-1.json"
    link.symlink_to(outside)
    ok = root / JOB / "5" / "attempt-1" / "rank-0.json"
    path = retention.deletable_path
    assert path(ok.as_uri(), root, JOB) == (ok, "")
    gang = root / JOB / "5" / "attempt-1" / "gang.dcp"
    assert path(f"{gang.as_uri()}#rank-3", root, JOB) == (gang, "")  # the fragment names a rank, not a path
    for uri in (
        outside.as_uri(),  # outside the root
        link.as_uri(),  # a symlink out of it
        f"file://{root}/{JOB}/5/../../other-job/5/rank-0.json",  # a '..' escape
        (root / "other-job" / "1" / "rank-0.json").as_uri(),  # another job's directory
        (root / JOB).as_uri(),
        root.as_uri(),  # the job's directory, the root
        f"s3://bucket/{JOB}/5/rank-0.json",
        "rank-0.json",
        f"file://host{ok}",
    ):
        got, why = path(uri, root, JOB)
        assert got is None and why, uri
    assert path(ok.as_uri(), None, JOB)[0] is None  # no --checkpoint-dir: nothing is deleted
    assert path(ok.as_uri(), root, "../x")[0] is None


def test_policy_a_referenced_path_is_protected(tmp_path):
    d = tmp_path / "job" / "5" / "attempt-1"
    assert retention.protected(d / "gang.dcp", [d / "gang.dcp"])
    assert retention.protected(d, [d / "rank-0.json"])  # a directory holding a kept shard
    assert retention.protected(d / "gang.dcp" / "x", [d / "gang.dcp"])
    assert not retention.protected(d / "rank-0.json", [d / "rank-1.json", tmp_path / "job" / "6"])


# -- the coordinator -----------------------------------------------------------------------------------------------


def _checksum(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Gang:
    """Ranks that write real shard files (phalanx.train's LocalStore layout) and report them."""

    def __init__(self, root: Path, job_id: str = JOB, world: int = WORLD, attempt: int = 1) -> None:
        self.store = LocalStore(root)
        self.job_id, self.world, self.attempt = job_id, world, attempt

    def shard(self, step: int, rank: int, size: int = 100) -> pb.Shard:
        data = bytes([rank]) * (size + step)
        uri = self.store.put(self.job_id, self.attempt, step, rank, data)
        return pb.Shard(rank=rank, uri=uri, size_bytes=len(data), checksum=_checksum(data))

    def files(self, step: int) -> list[Path]:
        return [self.store.path(self.job_id, self.attempt, step, r) for r in range(self.world)]

    async def commit(self, stub, step: int, shards: list[pb.Shard] | None = None) -> pb.Checkpoint:
        shards = shards or [self.shard(step, r) for r in range(self.world)]
        for s in shards:
            done = await stub.ReportShard(
                pb.ReportShardRequest(job_id=self.job_id, attempt=self.attempt, step=step, shard=s)
            )
        assert done.state == "COMMITTED"
        return done


@pytest.fixture
def root(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir()
    return path


@pytest.fixture
async def coordinator(db_url, root):
    insert_job(db_url, JOB, attempt=1, replicas=WORLD, gpus_per_replica=1)
    srv = await serve(db_url, "127.0.0.1:0", sweep_interval=0, checkpoint_dir=str(root))
    yield srv
    await srv.stop(0)


@pytest.fixture
async def stub(coordinator):
    async with grpc.aio.insecure_channel(coordinator.address) as ch:
        yield checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)


async def _listed(stub, job_id: str = JOB) -> list[int]:
    page = await stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id=job_id))
    return [c.step for c in page.checkpoints]


def _rows(db_url: str, job_id: str = JOB) -> dict[int, tuple[str, bool]]:
    """step -> (state, deleted) of every checkpoint row of the job."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return {
                int(r.step): (r.state, r.deleted_at is not None)
                for r in conn.execute(
                    select(Checkpoint.step, Checkpoint.state, Checkpoint.deleted_at).where(Checkpoint.job_id == job_id)
                )
            }
    finally:
        engine.dispose()


def _set_job(db_url: str, job_id: str = JOB, **values) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(update(Job).where(Job.id == job_id).values(**values))
    engine.dispose()


async def test_the_coordinator_keeps_the_newest_3_and_deletes_the_older_files(coordinator, stub, root, db_url):
    gang = Gang(root)
    with capture_logs() as logs:
        for step in (10, 20, 30, 40, 50):
            await gang.commit(stub, step)
            await coordinator.settle()
    assert await _listed(stub) == [50, 40, 30]
    assert (await stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=JOB))).step == 50
    for step in (30, 40, 50):
        assert all(f.is_file() for f in gang.files(step)), step
    for step in (10, 20):
        assert not any(f.exists() for f in gang.files(step)), step
        assert not (root / JOB / str(step)).exists()  # the emptied attempt-1/ and <step>/ directories too
    assert (root / JOB).is_dir()
    assert _rows(db_url) == {
        10: (COMMITTED, True),
        20: (COMMITTED, True),
        30: (COMMITTED, False),
        40: (COMMITTED, False),
        50: (COMMITTED, False),
    }
    deleted = [e for e in logs if e["event"] == "checkpoint_deleted"]
    assert [(e["job_id"], e["step"], e["files"], e["state"]) for e in deleted] == [
        (JOB, 10, 2, COMMITTED),
        (JOB, 20, 2, COMMITTED),
    ]
    assert deleted[0]["bytes_freed"] == 2 * 110 and deleted[0]["checkpoint_id"]


async def test_a_jobs_keep_checkpoints_in_its_row_overrides_the_default(coordinator, stub, root, db_url):
    _set_job(db_url, keep_checkpoints=1)
    gang = Gang(root)
    for step in (1, 2, 3):
        await gang.commit(stub, step)
    await coordinator.settle()
    assert await _listed(stub) == [3]
    assert [all(f.exists() for f in gang.files(s)) for s in (1, 2, 3)] == [False, False, True]


async def test_record_checkpoint_prunes_too_and_a_pending_checkpoint_is_never_deleted(coordinator, stub, root, db_url):
    _set_job(db_url, keep_checkpoints=1)
    gang = Gang(root)
    pending = gang.shard(99, 0)  # rank 0 of step 99 reported, rank 1 not yet
    await stub.ReportShard(pb.ReportShardRequest(job_id=JOB, attempt=1, step=99, shard=pending))
    for step in (1, 2):
        await stub.RecordCheckpoint(
            pb.RecordCheckpointRequest(
                job_id=JOB, attempt=1, step=step, shards=[gang.shard(step, r) for r in range(WORLD)]
            )
        )
    await coordinator.settle()
    assert await _listed(stub) == [2]
    assert gang.files(99)[0].is_file() and _rows(db_url)[99] == (PENDING, False)
    assert not any(f.exists() for f in gang.files(1))


async def test_a_shard_outside_the_jobs_directory_is_refused_and_nothing_is_deleted(
    coordinator, stub, root, db_url, tmp_path
):
    """The coordinator owns its checkpoint directory (confine.py): a shard elsewhere, or a symlink inside that leads
    out, is INVALID_ARGUMENT, writes nothing, and so can never make retention touch a file outside."""
    _set_job(db_url, keep_checkpoints=1)
    gang = Gang(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = elsewhere / "rank-1.json"
    outside.write_bytes(b"x" * 10)
    linked = gang.store.path(JOB, 1, 1, 0)  # rank 0's file is a symlink out of the checkpoint dir
    linked.parent.mkdir(parents=True)
    target = elsewhere / "rank-0.json"
    target.write_bytes(b"y" * 10)
    linked.symlink_to(target)
    for shard in (
        pb.Shard(rank=0, uri=linked.as_uri(), size_bytes=10, checksum=_checksum(b"y" * 10)),
        pb.Shard(rank=1, uri=outside.as_uri(), size_bytes=10, checksum=_checksum(b"x" * 10)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ReportShard(pb.ReportShardRequest(job_id=JOB, attempt=1, step=1, shard=shard))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "outside this job's storage prefix" in err.value.details()
    assert _rows(db_url) == {}
    await gang.commit(stub, 2)
    await gang.commit(stub, 3)
    await coordinator.settle()
    assert await _listed(stub) == [3]
    assert outside.read_bytes() == b"x" * 10 and target.read_bytes() == b"y" * 10


async def test_a_path_a_kept_checkpoint_references_is_not_deleted(coordinator, stub, root, db_url):
    """A collective DCP directory (`gang.dcp#rank-<r>`) named by two checkpoints: deleting the older one leaves it
    while the newer one is kept; deleting the newer one (the job finished, policy delete) removes it."""
    _set_job(db_url, keep_checkpoints=1)
    gang_dir = root / JOB / "5" / "attempt-1" / "gang.dcp"
    gang_dir.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (gang_dir / name).write_bytes(b"z" * 8)
    shards = [
        pb.Shard(rank=r, uri=f"{gang_dir.as_uri()}#rank-{r}", size_bytes=8, checksum=_checksum(b"%d" % r))
        for r in range(WORLD)
    ]
    await stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=JOB, attempt=1, step=5, shards=shards))
    await stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=JOB, attempt=1, step=5, shards=shards))
    await coordinator.settle()
    assert len(await _listed(stub)) == 1 and gang_dir.is_dir() and len(list(gang_dir.iterdir())) == 3
    engine = make_engine(db_url)
    try:
        _set_job(db_url, state="SUCCEEDED")
        with capture_logs() as logs:
            Retention(str(root), 3, "delete").sweep(engine)
    finally:
        engine.dispose()
    assert not (root / JOB / "5").exists()
    deleted = [e for e in logs if e["event"] == "checkpoint_deleted"]
    assert [(e["files"], e["bytes_freed"]) for e in deleted] == [(3, 24)]  # the directory once, not per rank


async def test_the_sweep_deletes_aborted_shards_through_the_coordinator(db_url, root):
    insert_job(db_url, JOB, attempt=1, replicas=WORLD, gpus_per_replica=1)
    srv = await serve(db_url, "127.0.0.1:0", sweep_interval=0.05, checkpoint_dir=str(root))
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
            gang = Gang(root)
            await gang.commit(stub, 1)
            await stub.ReportShard(pb.ReportShardRequest(job_id=JOB, attempt=1, step=2, shard=gang.shard(2, 0)))
            set_attempt(db_url, JOB, 2)  # relaunched: step 2 of attempt 1 never completes, the sweep aborts it
            deadline = time.monotonic() + 10
            # The sweep deletes the shard's files, then their emptied directories: wait for both.
            while (gang.files(2)[0].exists() or (root / JOB / "2").exists()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not gang.files(2)[0].exists() and not (root / JOB / "2").exists()
            assert _rows(db_url) == {1: (COMMITTED, False), 2: (ABORTED, True)}
            assert all(f.is_file() for f in gang.files(1))
    finally:
        await srv.stop(0)


def _commit_rows(engine, gang: Gang, steps) -> None:
    """Committed through the store only (as if the coordinator crashed before its retention pass)."""
    for step in steps:
        store.record_checkpoint(
            engine,
            gang.job_id,
            gang.attempt,
            step,
            [
                store.ShardRecord(s.rank, s.uri, s.size_bytes, s.checksum)
                for s in (gang.shard(step, r) for r in range(gang.world))
            ],
        )


def test_the_sweep_finds_committed_checkpoints_beyond_k_and_aborted_ones(db_url, root):
    insert_job(db_url, JOB, attempt=1, replicas=WORLD, gpus_per_replica=1)
    insert_job(db_url, "job-keep-2", attempt=1, replicas=WORLD, gpus_per_replica=1)
    engine = make_engine(db_url)
    try:
        gang, other = Gang(root), Gang(root, "job-keep-2")
        _commit_rows(engine, gang, (1, 2, 3, 4, 5))
        _commit_rows(engine, other, (1, 2))
        store.begin_checkpoint(engine, JOB, 1, 6, 0, deadline_s=1.0)
        store.report_shard(engine, JOB, 1, 6, 0, store.ShardRecord(0, gang.shard(6, 0).uri, 106, "sha256:x"))
        assert store.abort_expired(engine, now=time.time() + 60) == 1
        for f in gang.files(1):
            f.unlink()  # a crash after deleting some files and before marking them: no error, finished now
        deleted = Retention(str(root)).sweep(engine)
        assert sorted((d.job_id, d.step, d.state) for d in deleted) == [
            (JOB, 1, COMMITTED),
            (JOB, 2, COMMITTED),
            (JOB, 6, ABORTED),
        ]
        assert [r.step for r in store.list_checkpoints(engine, JOB)[0]] == [5, 4, 3]
        assert not gang.files(6)[0].exists() and not any(f.exists() for f in gang.files(2))
        assert all(f.is_file() for s in (1, 2) for f in other.files(s))
        assert Retention(str(root)).sweep(engine) == []  # nothing left to do
    finally:
        engine.dispose()


def test_a_failed_delete_keeps_the_checkpoint_and_the_next_sweep_retries(db_url, root, monkeypatch):
    insert_job(db_url, JOB, attempt=1, replicas=WORLD, gpus_per_replica=1)
    engine = make_engine(db_url)
    try:
        gang = Gang(root)
        _commit_rows(engine, gang, (1, 2))
        keeper = Retention(str(root), keep=1)
        real = retention.delete_path
        monkeypatch.setattr(
            retention, "delete_path", lambda path, stop_at: retention.Removal(errors=[f"{path}: Permission denied"])
        )
        with capture_logs() as logs:
            assert keeper.sweep(engine) == [] and keeper.sweep(engine) == []
        assert [e["event"] for e in logs] == ["checkpoint_delete_failed"]  # warned once, retried silently
        assert _rows(db_url)[1] == (COMMITTED, False)
        monkeypatch.setattr(retention, "delete_path", real)
        assert [d.step for d in keeper.sweep(engine)] == [1]
        assert not any(f.exists() for f in gang.files(1)) and _rows(db_url)[1] == (COMMITTED, True)
    finally:
        engine.dispose()


@pytest.mark.parametrize("policy, kept", [("keep", [4, 3, 2]), ("latest", [4]), ("delete", [])])
def test_finished_jobs_follow_the_finished_checkpoints_policy(db_url, root, policy, kept):
    insert_job(db_url, JOB, attempt=1, replicas=WORLD, gpus_per_replica=1)
    engine = make_engine(db_url)
    try:
        gang = Gang(root)
        _commit_rows(engine, gang, (1, 2, 3, 4))
        keeper = Retention(str(root), keep=3, finished=policy)
        assert [d.step for d in keeper.prune_job(engine, JOB)] == [1]  # running: the newest 3
        assert keeper.sweep(engine) == []
        _set_job(db_url, state="SUCCEEDED", finished_at=time.time())
        keeper.sweep(engine)
        assert [r.step for r in store.list_checkpoints(engine, JOB)[0]] == kept
        for step in (2, 3, 4):
            assert all(f.exists() for f in gang.files(step)) == (step in kept), step
        if policy == "delete":
            assert not any((root / JOB).iterdir())
    finally:
        engine.dispose()


async def test_keep_checkpoints_submitted_through_the_scheduler_is_obeyed(db_url, root):
    from helpers.lite_cluster import LiteCluster

    from phalanx.core.fabric import default_fabric
    from phalanx.testing.lite_agent import LiteAgent
    from services.scheduler.settings import SchedulerSettings

    coordinator = await serve(db_url, "127.0.0.1:0", sweep_interval=0, checkpoint_dir=str(root))
    settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["n0"]))
    try:
        async with (
            LiteCluster(settings, lambda addr: [LiteAgent(addr, "n0", gpus=8)]) as c,
            grpc.aio.insecure_channel(coordinator.address) as ch,
        ):
            for bad in (-1, 10_001):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await c.submit("bad", 1, 1, keep_checkpoints=bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "keep_checkpoints must be 0" in err.value.details() and str(bad) in err.value.details()
            job = await c.submit("keep-one", 2, 1, keep_checkpoints=1)
            assert job.spec.keep_checkpoints == 1
            assert (await c.job(job.id)).spec.keep_checkpoints == 1
            running = await c.wait_running(job.id)
            stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
            gang = Gang(root, job.id, world=2, attempt=running.attempt)
            for step in (1, 2, 3):
                await gang.commit(stub, step)
            await coordinator.settle()
            assert await _listed(stub, job.id) == [3]
            assert [all(f.exists() for f in gang.files(s)) for s in (1, 2, 3)] == [False, False, True]
    finally:
        await coordinator.stop(0)


# -- flags ---------------------------------------------------------------------------------------------------------


def test_checkpointd_retention_flags(monkeypatch, capsys):
    monkeypatch.delenv("PHALANX_CHECKPOINTD_KEEP_CHECKPOINTS", raising=False)
    monkeypatch.delenv("PHALANX_CHECKPOINTD_FINISHED_CHECKPOINTS", raising=False)
    args = checkpointd.parse_args([])
    assert (args.keep_checkpoints, args.finished_checkpoints) == (3, "keep")
    args = checkpointd.parse_args(["--keep-checkpoints", "5", "--finished-checkpoints", "latest"])
    assert (args.keep_checkpoints, args.finished_checkpoints) == (5, "latest")
    for argv in (
        ["--keep-checkpoints", "0"],
        ["--keep-checkpoints", "-2"],
        ["--keep-checkpoints", "x"],
        ["--finished-checkpoints", "forever"],
    ):
        with pytest.raises(SystemExit) as exc:
            checkpointd.parse_args(argv)
        assert exc.value.code == 2, argv
    assert "--keep-checkpoints" in capsys.readouterr().err
    monkeypatch.setenv("PHALANX_CHECKPOINTD_KEEP_CHECKPOINTS", "7")
    monkeypatch.setenv("PHALANX_CHECKPOINTD_FINISHED_CHECKPOINTS", "delete")
    args = checkpointd.parse_args([])
    assert (args.keep_checkpoints, args.finished_checkpoints) == (7, "delete")
    monkeypatch.setenv("PHALANX_CHECKPOINTD_KEEP_CHECKPOINTS", "0")
    with pytest.raises(SystemExit) as exc:
        checkpointd.parse_args([])
    assert exc.value.code == 2


async def test_serve_refuses_a_bad_retention_setting(sqlite_url):
    for kw in ({"keep_checkpoints": 0}, {"finished_checkpoints": "never"}):
        with pytest.raises(ValueError):
            await serve(sqlite_url, "127.0.0.1:0", sweep_interval=0, **kw)


def test_submit_spec_validation():
    from services.common.errors import InvalidArgument
    from services.scheduler.servicer import validate_spec

    spec = common_pb2.JobSpec(name="t", replicas=1, gpus_per_replica=1, command=["run"])
    for value in (0, 1, 10_000):
        spec.keep_checkpoints = value
        validate_spec(spec)
    for value in (-1, 10_001):
        spec.keep_checkpoints = value
        with pytest.raises(InvalidArgument, match="keep_checkpoints must be 0"):
            validate_spec(spec)


def _fake_scheduler():
    spec = importlib.util.spec_from_file_location(
        "_phalanx_fake_scheduler_retention", Path(__file__).with_name("test_client.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.serve_fake


def test_cli_submit_keep_checkpoints(monkeypatch, capsys):
    from phalanx.cli.main import main

    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    with _fake_scheduler()() as (servicer, address):
        base = [
            "--scheduler",
            address,
            "--timeout",
            "5",
            "submit",
            "--name",
            "t",
            "--replicas",
            "1",
            "--gpus-per-replica",
            "1",
        ]
        for bad in ("0", "-1", "x", "10001"):
            code = main(base + ["--keep-checkpoints", bad, "--", "true"])
            out, err = capsys.readouterr()
            assert code == 2 and out == "" and "--keep-checkpoints" in err, (bad, err)
        assert not servicer.jobs
        code = main(base + ["--keep-checkpoints", "2", "--json", "--", "true"])
        out, err = capsys.readouterr()
        assert code == 0, err
        job = json.loads(out)
        assert servicer.jobs[job["id"]].spec.keep_checkpoints == 2 and job["keep_checkpoints"] == 2
        code = main(base + ["--json", "--", "true"])
        out, err = capsys.readouterr()
        assert code == 0 and json.loads(out)["keep_checkpoints"] == 0  # the coordinator's default
        assert servicer.jobs[json.loads(out)["id"]].spec.keep_checkpoints == 0
