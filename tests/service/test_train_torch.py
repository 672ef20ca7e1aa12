"""phalanx.train's torch.distributed.checkpoint adapter against a real coordinator (needs torch: `need("torch")`).

scripts/test installs torch==2.13.0 (CPU) into the venv; without it these tests skip, or fail where PHALANX_REQUIRE
lists torch (CI).
"""

from __future__ import annotations

import asyncio
import json
import pickle
import shutil
from pathlib import Path

import pytest
from helpers.jobs import insert_job, set_world
from helpers.required import needs, torch_missing

from phalanx import train
from phalanx.train import torch_dcp
from services.checkpoint_coordinator import serve

TORCH_MISSING = torch_missing()
if TORCH_MISSING is None:
    import torch
pytestmark = needs("torch", TORCH_MISSING)

JOB = "job-train-torch"


@pytest.fixture
async def server(db_url):
    insert_job(db_url, JOB)
    srv = await serve(db_url, "127.0.0.1:0", sweep_interval=0)
    yield srv
    await srv.stop(0)


def _env(server, tmp_path: Path, rank: int, world: int = 2) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "PHALANX_JOB_ID": JOB,
        "PHALANX_ATTEMPT": "1",
        "PHALANX_CHECKPOINT_ADDR": server.address,
        "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
    }


def _ranks(server, tmp_path, world: int = 2) -> list[train.Checkpointer]:
    return [train.Checkpointer(_env(server, tmp_path, r, world)) for r in range(world)]


def _model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _state(model: torch.nn.Linear, steps: int) -> dict:
    return {"model": model.state_dict(), "optim": {"step_count": steps, "lr": [0.1, torch.tensor(0.5)]}}


def _template() -> dict:
    return _state(torch.nn.Linear(4, 3), 0)


async def _save_step5(server, tmp_path):
    ranks = _ranks(server, tmp_path)
    models = [_model(100 + c.rank) for c in ranks]
    results = [await asyncio.to_thread(c.save, 5, _state(m, 5 + c.rank)) for c, m in zip(ranks, models)]
    return ranks, models, results


async def test_two_ranks_save_dcp_and_restore_into_templates(server, tmp_path):
    ranks, models, results = await _save_step5(server, tmp_path)
    assert [r.committed for r in results] == [False, True]
    for c, res in zip(ranks, results):
        shard = tmp_path / "ckpt" / JOB / "5" / "attempt-1" / f"rank-{c.rank}.dcp"
        assert shard.is_dir() and (shard / ".metadata").is_file()
        assert res.uri == shard.resolve().as_uri()
        assert (res.checksum, res.size_bytes) == torch_dcp.dir_checksum(shard)
        assert res.size_bytes == sum(p.stat().st_size for p in shard.rglob("*") if p.is_file())
    assert not list((tmp_path / "ckpt" / JOB / "5" / "attempt-1").glob(".*"))  # no temporary leftovers

    for c, model in zip(ranks, models):
        fresh = torch.nn.Linear(4, 3)
        template = _state(fresh, 0)
        step, state = await asyncio.to_thread(c.restore, template)
        assert step == 5 and state is template
        assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)  # in place
        assert state["optim"]["step_count"] == 5 + c.rank
        assert state["optim"]["lr"][0] == 0.1 and torch.equal(state["optim"]["lr"][1], torch.tensor(0.5))
    for c in ranks:
        c.close()


async def test_corrupt_dcp_file_is_skipped_on_every_rank(server, tmp_path):
    ranks, _, results = await _save_step5(server, tmp_path)
    shard = Path(results[1].uri.removeprefix("file://"))
    data_file = next(p for p in shard.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    assert [await asyncio.to_thread(c.restore, _template()) for c in ranks] == [None, None]
    assert ranks[0].last_restore.message == (
        "started from step 0: no intact checkpoint (step 5 was damaged: sha256 mismatch in rank 1's shard)"
    )
    # checking only its own shard, rank 0 restores it (and rank 1 still cannot)
    assert (await asyncio.to_thread(ranks[0].restore, _template(), verify="rank"))[0] == 5
    (shard / "extra").write_bytes(b"")  # an added file is a mismatch too
    data_file.unlink()
    assert await asyncio.to_thread(ranks[1].restore, _template(), verify="rank") is None
    assert "size mismatch in rank 1's shard" in ranks[1].last_restore.message
    for c in ranks:
        c.close()


async def test_dcp_restore_falls_back_to_the_older_intact_checkpoint(server, tmp_path):
    ranks = _ranks(server, tmp_path)
    models = [_model(200 + c.rank) for c in ranks]
    for c, m in zip(ranks, models):
        await asyncio.to_thread(c.save, 3, _state(m, 3))
    newer = [await asyncio.to_thread(c.save, 6, _state(_model(300 + c.rank), 6)) for c in ranks]
    shutil.rmtree(newer[0].uri.removeprefix("file://"))  # rank 0's shard of step 6 is gone
    for c, model in zip(ranks, models):
        fresh = torch.nn.Linear(4, 3)
        step, state = await asyncio.to_thread(c.restore, _state(fresh, 0))
        assert step == 3 and state["optim"]["step_count"] == 3 and torch.equal(fresh.weight, model.weight)
        assert c.last_restore.skipped[0].step == 6
        assert c.last_restore.message.startswith("restored from step 3 (step 6 was damaged: rank 0's shard is missing")
    for c in ranks:
        c.close()


async def test_restore_without_template_says_so(server, tmp_path):
    ranks, _, _ = await _save_step5(server, tmp_path)
    with pytest.raises(train.CheckpointError, match="template state_dict") as err:
        await asyncio.to_thread(ranks[0].restore)
    assert not isinstance(err.value, train.CheckpointCorruptError)
    with pytest.raises(train.CheckpointError, match="into the template failed: RuntimeError: Missing key"):
        await asyncio.to_thread(ranks[0].restore, {"other": torch.zeros(2)})
    for c in ranks:
        c.close()


async def test_non_tensor_state_is_json(server, tmp_path):
    ranks = _ranks(server, tmp_path)
    states = [{"rank": c.rank, "weights": [1.0, 2.0]} for c in ranks]
    for c, s in zip(ranks, states):
        res = await asyncio.to_thread(c.save, 3, s)
        assert res.uri.endswith(f"rank-{c.rank}.json")
        assert json.loads(Path(res.uri.removeprefix("file://")).read_text())["state"] == s
    assert [await asyncio.to_thread(c.restore) for c in ranks] == [(3, states[0]), (3, states[1])]
    # a template is ignored for a JSON shard
    assert await asyncio.to_thread(ranks[0].restore, _template()) == (3, states[0])
    for c in ranks:
        c.close()


class _ObjectStore:
    """A store without shard_dir (an object store): tensors go into it as raw bytes after the JSON."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def put(self, job_id, attempt, step, rank, data):
        uri = f"mem://{job_id}/{step}/attempt-{attempt}/rank-{rank}"
        self.blobs[uri] = data
        return uri

    def get(self, uri):
        return self.blobs[uri]


async def test_object_store_keeps_tensor_state_without_pickle(server, tmp_path, db_url):
    set_world(db_url, JOB, 1)
    store = _ObjectStore()
    with train.Checkpointer(_env(server, tmp_path, 0, world=1), store=store) as c:
        model = _model(7)
        res = await asyncio.to_thread(c.save, 2, _state(model, 2))
        assert res.committed and res.uri.startswith("mem://")
        blob = store.blobs[res.uri]
        assert blob.startswith(b'{"format":"phalanx.train/state-v1",')
        with pytest.raises(pickle.UnpicklingError):
            pickle.loads(blob)
        step, state = await asyncio.to_thread(c.restore)
        assert step == 2 and torch.equal(state["model"]["weight"], model.weight)
        assert state["optim"]["lr"][0] == 0.1 and torch.equal(state["optim"]["lr"][1], torch.tensor(0.5))


def test_is_state_dict():
    assert torch_dcp.is_state_dict({"a": {"b": [1, (2, torch.zeros(1))]}})
    assert not torch_dcp.is_state_dict({"a": {"b": [1, 2]}, "c": "x"})
    assert not torch_dcp.is_state_dict([torch.zeros(1)])  # not a Mapping
    loop: dict = {}
    loop["self"] = loop
    assert not torch_dcp.is_state_dict(loop)
    assert torch_dcp.is_dcp_uri("file:///x/rank-0.dcp") and not torch_dcp.is_dcp_uri("file:///x/rank-0.pkl")
    assert not torch_dcp.is_dcp_uri("s3://bucket/rank-0.dcp")


async def test_module_level_restore_takes_a_template(server, tmp_path, monkeypatch, db_url):
    set_world(db_url, JOB, 1)
    for key, value in _env(server, tmp_path, 0, world=1).items():
        monkeypatch.setenv(key, value)
    train.reset()
    try:
        model = _model(3)
        assert (await asyncio.to_thread(train.save, 4, _state(model, 4))).committed
        template = _template()
        step, state = await asyncio.to_thread(train.restore, template)
        assert step == 4 and torch.equal(state["model"]["weight"], model.weight)
    finally:
        train.reset()
