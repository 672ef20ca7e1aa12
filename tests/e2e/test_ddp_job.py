"""A real torch.distributed job: `phalanx.examples.ddp_tiny` as rank processes (gloo, DDP, collective DCP
checkpoints through phalanx.train) against a real checkpoint coordinator on loopback.

- The gang's collective save: one `gang.dcp/` directory per checkpoint, each rank reporting only its own files
  (de-duplicated by DCP's planner: no rank writes a full copy), committed with one shard per rank.
- A second attempt restores it collectively and ends with parameters bit-identical to an uninterrupted run.
- Damage to one rank's part makes the next attempt fall back to the older intact checkpoint, on every rank, and
  still end bit-identical.

The ledger is SQLite only here: each case starts torch in several processes, and the coordinator's database
paths are the ones tests/service/test_checkpoint_trust.py runs on SQLite and PostgreSQL. The end-to-end case on a local
cluster (scheduler, agents, preemption) is tests/e2e/test_ddp_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from helpers.jobs import insert_job, set_attempt, set_world
from helpers.ports import reserved_port
from helpers.required import needs, torch_missing

from phalanx.train import torch_dcp
from services.checkpoint_coordinator import serve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    needs("torch", torch_missing()),
]

JOB = "job-ddp-tiny"
WORLD = 3  # odd: a float sum over three ranks changes with its order, so bit-identity tests the order too


def _free_port() -> int:
    return reserved_port()  # rank 0's TCPStore binds it only once torch starts: no port-0 bind may take it first


async def _run_gang(
    out: Path,
    steps: int,
    *,
    attempt: int = 1,
    every: int = 0,
    coordinator: str = "",
    ckpt_dir: Path | None = None,
    world: int = WORLD,
) -> list[dict]:
    """Run the example as `world` rank processes of one attempt; return their rank-<r>.json results."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PHALANX_ATTEMPT=str(attempt),
            PHALANX_NODE=f"node-{rank}",
            PHALANX_CHECKPOINT_POLL_S="0.2",
            # One intra-op thread per rank, as torchrun sets for several ranks on a host: the default (a spinning
            # OpenMP thread per core in every rank) oversubscribes a small machine many times over.
            OMP_NUM_THREADS="1",
        )
        env.pop("PHALANX_CHECKPOINT_ADDR", None)
        if coordinator:
            env.update(PHALANX_JOB_ID=JOB, PHALANX_CHECKPOINT_ADDR=coordinator, PHALANX_CHECKPOINT_DIR=str(ckpt_dir))
        else:
            env.pop("PHALANX_JOB_ID", None)
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
            "--timeout",
            "60",
        ]
        procs.append(
            await asyncio.create_subprocess_exec(
                *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        )
    try:
        outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), timeout=150)
    except TimeoutError:
        for p in procs:
            if p.returncode is None:
                p.kill()
        texts = [(await p.stdout.read()).decode()[-2000:] for p in procs]
        raise AssertionError(
            "the gang did not finish in 150 s:\n" + "\n".join(f"--- rank {r}:\n{t}" for r, t in enumerate(texts))
        ) from None
    for rank, (p, (text, _)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{text.decode()[-3000:]}"
    job_dir = out / (JOB if coordinator else "local")
    return [json.loads((job_dir / f"rank-{r}.json").read_text()) for r in range(world)]


@pytest.fixture
async def coordinator(sqlite_url):
    insert_job(sqlite_url, JOB)
    set_world(sqlite_url, JOB, WORLD)
    srv = await serve(sqlite_url, "127.0.0.1:0", sweep_interval=0)
    yield srv, sqlite_url
    await srv.stop(0)


def _committed(srv) -> list:
    import grpc

    from phalanx.api.v1 import checkpoint_pb2 as pb
    from phalanx.api.v1 import checkpoint_pb2_grpc

    with grpc.insecure_channel(srv.address) as ch:
        stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
        return list(stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id=JOB), timeout=10).checkpoints)


def _restore_state(srv):
    import grpc

    from phalanx.api.v1 import checkpoint_pb2 as pb
    from phalanx.api.v1 import checkpoint_pb2_grpc

    with grpc.insecure_channel(srv.address) as ch:
        stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
        return stub.GetRestore(pb.GetRestoreRequest(job_id=JOB), timeout=10)


async def test_collective_checkpoint_each_rank_writes_its_part_resumes_bit_identical_and_falls_back(
    coordinator, tmp_path
):
    srv, url = coordinator
    ckpt = tmp_path / "ckpt"
    baseline = await _run_gang(tmp_path / "base", 20)
    assert len({r["params_sha256"] for r in baseline}) == 1  # DDP keeps the replicas equal

    first = await _run_gang(tmp_path / "out", 10, every=5, coordinator=srv.address, ckpt_dir=ckpt)
    assert [r["saves"] for r in first] == [2] * WORLD
    checkpoints = await asyncio.to_thread(_committed, srv)  # the server runs on this event loop
    assert [c.step for c in checkpoints] == [10, 5]
    newest = checkpoints[0]
    assert newest.state == "COMMITTED" and newest.world_size == WORLD
    gang = ckpt / JOB / "10" / "attempt-1" / "gang.dcp"
    assert sorted(s.uri for s in newest.shards) == [f"{gang.as_uri()}#rank-{r}" for r in range(WORLD)]
    names = sorted(p.name for p in gang.iterdir())
    assert names == [".metadata"] + [f"__{r}_0.distcp" for r in range(WORLD)], names
    # Each rank wrote its own part once: every entry of the state (parameters, Adam's moments, ...) is stored in
    # exactly one rank's file, and neither file holds them all (DCP's metadata says where each entry lives).
    where: dict[str, set[str]] = {}
    from torch.distributed.checkpoint import FileSystemReader

    for index, info in FileSystemReader(gang).read_metadata().storage_data.items():
        where.setdefault(index.fqn, set()).add(info.relative_path)
    tensors = [fqn for fqn in where if fqn.startswith(("model.", "optim.state."))]
    assert len(tensors) >= 4 * 3, sorted(where)  # 4 parameters, each with exp_avg and exp_avg_sq
    assert all(len(files) == 1 for files in where.values()), where
    by_file: dict[str, set[str]] = {}
    for fqn in tensors:
        by_file.setdefault(next(iter(where[fqn])), set()).add(fqn)
    assert set(by_file) == {f"__{r}_0.distcp" for r in range(WORLD)}, by_file
    assert all(0 < len(part) < len(tensors) for part in by_file.values()), by_file
    for s in newest.shards:  # each shard's size and sha256 cover that rank's files only
        files = torch_dcp.rank_files(gang, s.rank)
        assert (s.checksum, s.size_bytes) == torch_dcp.dir_checksum(gang, files)
        assert files == ([".metadata"] if s.rank == 0 else []) + [f"__{s.rank}_0.distcp"]

    # The next attempt restores step 10 collectively and trains on: bit-identical to the uninterrupted run.
    set_attempt(url, JOB, 2)
    second = await _run_gang(tmp_path / "out", 20, attempt=2, coordinator=srv.address, ckpt_dir=ckpt)
    assert [(r["restored_step"], r["step"]) for r in second] == [(10, 20)] * WORLD
    assert {r["params_sha256"] for r in second} == {baseline[0]["params_sha256"]}

    # Damage one rank's part of step 10: the next attempt falls back to step 5 on every rank, says so, and still
    # ends bit-identical.
    part = gang / "__1_0.distcp"
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    part.write_bytes(bytes(raw))
    set_attempt(url, JOB, 3)
    third = await _run_gang(tmp_path / "out", 20, attempt=3, coordinator=srv.address, ckpt_dir=ckpt)
    assert [(r["restored_step"], r["step"]) for r in third] == [(5, 20)] * WORLD
    assert {r["params_sha256"] for r in third} == {baseline[0]["params_sha256"]}
    state = await asyncio.to_thread(_restore_state, srv)
    assert state.consistent and state.step == 5 and state.fell_back_from == 10
    assert state.message == "restored from step 5 (step 10 was damaged: sha256 mismatch in rank 1's shard)"
