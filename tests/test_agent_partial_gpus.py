"""The node agent on partial GPUs: MIG instances (fake and NVML backends, the manager) and fractional shares.

Agent tests run real rank processes (as tests/test_node_agent.py does) against its fake NodeService and check the
environment each rank got. The NVML backend runs against a small stand-in for `pynvml` that keeps MIG state with
the real placement rules and records the calls made.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pynvml
import pytest

from phalanx.api.v1 import agent_pb2, common_pb2
from phalanx.testing.fake_nvml import GI_PROFILES, FakeGpu
from phalanx.testing.fake_nvml import FakeNvml as SharedFakeNvml
from services.node_agent import launcher
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.mig_manager import (
    FakeMigBackend,
    MigError,
    MigManager,
    NvmlMigBackend,
    backend_for,
    fake_mig_uuid,
)
from services.node_agent.simulated import simulated_topology
from services.node_agent.state import AgentState

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_node_agent import RANK_CMD, FakeNodeService, rank_env, start_server, starts, until  # noqa: E402

S = common_pb2
H100 = ("NVIDIA H100 80GB HBM3", 81559)
H100_MEMORY = 81559


def h100_backend(node="node-a", gpus=8, **kw) -> FakeMigBackend:
    return FakeMigBackend(node, {i: H100 for i in range(gpus)}, **kw)


# ------------------------------------------------------------------------------------------------ fake backend


@pytest.mark.parametrize("profile,size,good,bad", [
    ("1g.10gb", 1, [0, 1, 2, 3, 4, 5, 6], [7]),
    ("1g.20gb", 2, [0, 2, 4, 6], [1, 3, 5]),
    ("2g.20gb", 2, [0, 2, 4], [1, 6]),
    ("3g.40gb", 4, [0, 4], [1, 2, 3]),
    ("4g.40gb", 4, [0], [2, 4]),
    ("7g.80gb", 8, [0], [1, 4]),
])
def test_fake_valid_and_invalid_starts(profile, size, good, bad):
    for start in good:
        b = h100_backend()
        assert b.ensure_instance(0, profile, start, size).startswith("MIG-")
        assert [(i.profile, i.start, i.size) for i in b.list_instances(0)] == [(profile, start, size)]
    for start in bad:
        b = h100_backend()
        with pytest.raises(MigError, match="Invalid Argument"):
            b.ensure_instance(0, profile, start, size)
        assert b.list_instances(0) == []


def test_fake_overlap_refused_and_valid_geometries():
    b = h100_backend()
    b.ensure_instance(0, "3g.40gb", 0, 4)
    for profile, start, size in [("2g.20gb", 2, 2), ("7g.80gb", 0, 8), ("4g.40gb", 0, 4), ("1g.10gb", 3, 1)]:
        with pytest.raises(MigError, match="overlaps .*Insufficient Resources"):
            b.ensure_instance(0, profile, start, size)
    # 4g + 3g
    b2 = h100_backend()
    u4 = b2.ensure_instance(1, "4g.40gb", 0, 4)
    u3 = b2.ensure_instance(1, "3g.40gb", 4, 4)
    assert u4 != u3 and b2.used_mask(1) == 0xFF
    # seven 1g small instances fill slices 0-6; slice 7 holds none
    b3 = h100_backend()
    uuids = {b3.ensure_instance(2, "1g.10gb", s, 1) for s in range(7)}
    assert len(uuids) == 7 and b3.used_mask(2) == 0x7F
    with pytest.raises(MigError):
        b3.ensure_instance(2, "1g.10gb", 7, 1)
    # 2g + 2g + 2g + 1g (large)
    b4 = h100_backend()
    for s in (0, 2, 4):
        b4.ensure_instance(3, "2g.20gb", s, 2)
    b4.ensure_instance(3, "1g.20gb", 6, 2)
    assert b4.used_mask(3) == 0xFF


def test_fake_destroy_then_reuse_and_idempotent_ensure():
    b = h100_backend()
    first = b.ensure_instance(0, "3g.40gb", 4, 4)
    assert b.ensure_instance(0, "3g.40gb", 4, 4) == first  # found, not created again
    assert [c[0] for c in b.calls] == ["create"]
    with pytest.raises(MigError, match="overlaps"):
        b.ensure_instance(0, "1g.20gb", 6, 2)
    b.release_instance(0, 4, 4)
    assert b.list_instances(0) == []
    with pytest.raises(MigError, match="Not Found"):
        b.release_instance(0, 4, 4)
    b.ensure_instance(0, "2g.20gb", 4, 2)
    b.ensure_instance(0, "1g.20gb", 6, 2)
    assert b.ensure_instance(0, "3g.40gb", 0, 4) == fake_mig_uuid("node-a", 0, 0, "3g.40gb")
    assert b.used_mask(0) == 0xFF


def test_fake_uuids_are_deterministic_per_node_gpu_start_profile():
    a, a2, other = h100_backend("n1"), h100_backend("n1"), h100_backend("n2")
    u = a.ensure_instance(1, "1g.10gb", 3, 1)
    assert u == a2.ensure_instance(1, "1g.10gb", 3, 1) == fake_mig_uuid("n1", 1, 3, "1g.10gb")
    assert u != other.ensure_instance(1, "1g.10gb", 3, 1)
    assert u != a.ensure_instance(1, "1g.10gb", 4, 1) and u != a.ensure_instance(2, "1g.10gb", 3, 1)


def test_fake_refuses_what_nvml_would():
    b = h100_backend(mig_disabled={5})
    with pytest.raises(MigError, match="no MIG profile '1g.5gb'"):
        b.ensure_instance(0, "1g.5gb", 0, 1)  # an A100 40GB profile
    with pytest.raises(MigError, match="takes 4 memory slices"):
        b.ensure_instance(0, "3g.40gb", 0, 2)
    with pytest.raises(MigError, match="does not exist"):
        b.ensure_instance(9, "3g.40gb", 0, 4)
    with pytest.raises(MigError, match="MIG mode is not enabled on GPU 5"):
        b.ensure_instance(5, "3g.40gb", 0, 4)
    l40s = FakeMigBackend("n", {0: ("NVIDIA L40S", 46068)})
    with pytest.raises(MigError, match="does not support MIG"):
        l40s.ensure_instance(0, "1g.10gb", 0, 1)
    # other families: their own names and memory
    a100 = FakeMigBackend("n", {0: ("NVIDIA A100-SXM4-40GB", 40960)})
    a100.ensure_instance(0, "1g.5gb", 0, 1)
    h200 = FakeMigBackend("n", {0: ("NVIDIA H200", 143771)})
    h200.ensure_instance(0, "3g.71gb", 4, 4)


def test_fake_state_survives_a_new_backend(tmp_path):
    f = tmp_path / "mig.json"
    b = h100_backend(state_file=f)
    u = b.ensure_instance(4, "4g.40gb", 0, 4)
    again = h100_backend(state_file=f)
    assert [(i.profile, i.uuid) for i in again.list_instances(4)] == [("4g.40gb", u)]
    with pytest.raises(MigError, match="overlaps"):
        again.ensure_instance(4, "7g.80gb", 0, 8)


def test_backend_follows_discovery():
    sim = simulated_topology("n1", "dgx-h100")
    assert isinstance(backend_for(sim, "n1"), FakeMigBackend)
    real = agent_pb2.HostTopology(profile="nvml")
    real.gpus.append(agent_pb2.GpuInfo(index=0, name=H100[0], memory_mib=H100[1]))
    assert isinstance(backend_for(real, "n1"), NvmlMigBackend)


# ------------------------------------------------------------------------------------------------ manager


def manager(backend=None) -> MigManager:
    return MigManager(backend or h100_backend(), simulated_topology("node-a", "dgx-h100"))


def sl(gpu, profile, start, size):
    return {"gpu": gpu, "profile": profile, "start": start, "size": size}


def test_manager_acquire_release_only_what_it_created():
    m = manager()
    b = m.backend
    admin = b.ensure_instance(0, "3g.40gb", 4, 4)  # there before the agent: kept
    got = m.acquire("j/1/0", [sl(0, "3g.40gb", 4, 4)])
    assert got[0]["uuid"] == admin and got[0]["created"] is False
    mine = m.acquire("j/1/1", [sl(0, "4g.40gb", 0, 4)])[0]
    assert mine["created"] is True
    assert m.release("j/1/0", got) == []
    assert m.release("j/1/1", [mine]) == [(0, 0, 4)]
    assert [(i.profile, i.start) for i in b.list_instances(0)] == [("3g.40gb", 4)]


def test_manager_shared_instance_released_by_last_user():
    m = manager()
    a = m.acquire("a/1/0", [sl(1, "2g.20gb", 2, 2)])
    b = m.acquire("b/1/0", [sl(1, "2g.20gb", 2, 2)])
    assert a[0]["uuid"] == b[0]["uuid"] and b[0]["created"] is True
    assert m.release("a/1/0", a) == [] and len(m.backend.list_instances(1)) == 1
    assert m.release("b/1/0", b) == [(1, 2, 2)] and m.backend.list_instances(1) == []


def test_manager_reconfigures_unused_instances_but_not_used_ones():
    m = manager()
    b = m.backend
    b.ensure_instance(2, "7g.80gb", 0, 8)  # left over, nobody uses it
    got = m.acquire("j/1/0", [sl(2, "3g.40gb", 0, 4)])
    assert [(i.profile, i.start) for i in b.list_instances(2)] == [("3g.40gb", 0)]
    assert ("destroy", 2, "7g.80gb", 0, 8) in b.calls
    with pytest.raises(MigError, match="in use by rank j/1/0"):
        m.acquire("k/1/0", [sl(2, "4g.40gb", 0, 4)])
    assert b.list_instances(2)[0].uuid == got[0]["uuid"]
    # a GPU a whole-GPU rank uses keeps its geometry
    with pytest.raises(MigError, match="GPU 3 is in use by rank w/1/0"):
        m.acquire("k/1/0", [sl(3, "1g.10gb", 0, 1)], busy_gpus={3: "w/1/0"})
    assert b.list_instances(3) == []


def test_manager_failed_acquire_keeps_nothing():
    m = manager()
    m.acquire("x/1/0", [sl(4, "1g.10gb", 1, 1)])
    with pytest.raises(MigError):
        m.acquire("y/1/0", [sl(5, "3g.40gb", 0, 4), sl(4, "2g.20gb", 0, 2)])  # second overlaps x's instance
    assert m.backend.list_instances(5) == []
    with pytest.raises(MigError, match="cannot start at memory slice 2"):
        m.acquire("y/1/0", [sl(5, "3g.40gb", 2, 4)])
    with pytest.raises(MigError, match="no MIG profile"):
        m.acquire("y/1/0", [sl(5, "3g.20gb", 0, 4)])


def test_manager_adopt_keeps_instances_of_live_ranks():
    b = h100_backend()
    m1 = manager(b)
    live = m1.acquire("live/1/0", [sl(6, "1g.10gb", 0, 1)])
    dead = m1.acquire("dead/1/0", [sl(6, "1g.10gb", 1, 1)])
    m2 = manager(b)  # a restarted agent: adopts the live rank, settles the dead one
    m2.adopt("live/1/0", live)
    assert m2.release("dead/1/0", dead) == [(6, 1, 1)]
    with pytest.raises(MigError, match="in use by rank live/1/0"):
        m2.acquire("new/1/0", [sl(6, "1g.20gb", 0, 2)])
    assert [i.start for i in b.list_instances(6)] == [0]
    assert m2.release("live/1/0", live) == [(6, 0, 1)]


# ------------------------------------------------------------------------------------------------ env helpers


@pytest.mark.parametrize("milli,pct,mem", [(250, "25", "0=20389M"), (5, "1", "0=407M"), (15, "2", "0=1223M"),
                                           (999, "100", "0=81477M"), (1, "1", "0=81M")])
def test_fractional_env(milli, pct, mem):
    env = launcher.fractional_env({"CUDA_VISIBLE_DEVICES": "3", "RANK": "0"}, 3, milli, H100_MEMORY)
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["RANK"] == "0"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == pct
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == mem
    assert env["PHALANX_GPU_MILLI"] == str(milli)
    with pytest.raises(ValueError):
        launcher.fractional_env({}, 0, 1000, H100_MEMORY)


# ------------------------------------------------------------------------------------------------ agent


@pytest.fixture
async def fake():
    servicer = FakeNodeService()
    server, port = await start_server(servicer)
    servicer.server, servicer.port = server, port
    yield servicer
    await servicer.server.stop(0)


@pytest.fixture
async def agents(tmp_path):
    started: list[tuple[NodeAgent, asyncio.Task]] = []

    def start(port, *, backend=None, state_dir=None, profile="dgx-h100", node="node-a") -> NodeAgent:
        agent = NodeAgent(AgentConfig(
            scheduler=f"127.0.0.1:{port}", node_name=node, topology=simulated_topology(node, profile),
            state_dir=state_dir or tmp_path / "state", kill_grace_s=0.5, backoff_initial_s=0.05, backoff_cap_s=0.3,
            poll_interval_s=0.02, rpc_timeout_s=2.0, flush_timeout_s=2.0, mig_backend=backend,
        ))
        started.append((agent, asyncio.create_task(agent.run())))
        return agent

    yield start
    for agent, task in started:
        if not task.done():
            agent.request_stop()
            try:
                await asyncio.wait_for(task, 10)
            except Exception:  # noqa: BLE001
                task.cancel()


def launch(fake: FakeNodeService, revision: int, job: str, attempt: int, ranks: list[dict]) -> None:
    """ranks: {rank, gpus, env, slices: [(gpu, profile, start, size)], gpu_milli}."""
    msg = agent_pb2.LaunchReplica(job_id=job, attempt=attempt, replica=0, command=RANK_CMD)
    for r in ranks:
        msg.ranks.append(agent_pb2.RankLaunch(
            rank=r["rank"], local_rank=r["rank"], gpus=r["gpus"], env=r["env"], gpu_milli=r.get("gpu_milli", 0),
            slices=[S.MigSlice(gpu=g, profile=p, start=s, size=z) for g, p, s, z in r.get("slices", [])],
        ))
    fake.push(agent_pb2.Assignment(revision=revision, launch=msg))


def env_of(tmp: Path, job: str, rank: int) -> dict:
    return json.loads((tmp / f"{job}-r{rank}.env.json").read_text())


def failed(fake, job, rank=0):
    return fake.report(job, rank, S.RANK_STATE_FAILED_TO_START)


async def test_mig_ranks_get_mig_uuids_and_instances_go_when_they_end(fake, agents, tmp_path):
    backend = h100_backend()
    agents(fake.port, backend=backend)
    launch(fake, 1, "mig", 1, [
        {"rank": 0, "gpus": [2], "env": rank_env(tmp_path, "mig", 0, 3, CUDA_VISIBLE_DEVICES="2", SLEEP=0.5),
         "slices": [(2, "3g.40gb", 4, 4)]},
        {"rank": 1, "gpus": [2], "env": rank_env(tmp_path, "mig", 1, 3, CUDA_VISIBLE_DEVICES="2", SLEEP=0.5),
         "slices": [(2, "1g.10gb", 0, 1)]},
        {"rank": 2, "gpus": [5, 6], "env": rank_env(tmp_path, "mig", 2, 3, CUDA_VISIBLE_DEVICES="5,6", SLEEP=0.5),
         "slices": [(5, "7g.80gb", 0, 8), (6, "2g.20gb", 2, 2)]},
    ])
    await until(lambda: all(fake.report("mig", r, S.RANK_STATE_RUNNING) for r in range(3)), what="RUNNING")
    assert {(i.profile, i.start) for i in backend.list_instances(2)} == {("3g.40gb", 4), ("1g.10gb", 0)}
    await until(lambda: all(fake.report("mig", r, S.RANK_STATE_EXITED) for r in range(3)), what="EXITED")
    assert env_of(tmp_path, "mig", 0)["CUDA_VISIBLE_DEVICES"] == fake_mig_uuid("node-a", 2, 4, "3g.40gb")
    assert env_of(tmp_path, "mig", 1)["CUDA_VISIBLE_DEVICES"] == fake_mig_uuid("node-a", 2, 0, "1g.10gb")
    assert env_of(tmp_path, "mig", 2)["CUDA_VISIBLE_DEVICES"] == ",".join(
        [fake_mig_uuid("node-a", 5, 0, "7g.80gb"), fake_mig_uuid("node-a", 6, 2, "2g.20gb")])
    assert env_of(tmp_path, "mig", 0)["RANK"] == "0" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env_of(
        tmp_path, "mig", 0)
    await until(lambda: not any(backend.list_instances(g) for g in range(8)), what="instances destroyed")
    rec = AgentState.load(tmp_path / "state" / "state.json").ranks["mig/1/0"]
    assert rec.slices[0]["uuid"] == fake_mig_uuid("node-a", 2, 4, "3g.40gb") and rec.slices[0]["created"]


async def test_fractional_rank_env_and_whole_gpu_unchanged(fake, agents, tmp_path):
    agents(fake.port)
    launch(fake, 1, "frac", 1, [
        {"rank": 0, "gpus": [3], "env": rank_env(tmp_path, "frac", 0, 2, CUDA_VISIBLE_DEVICES="3"), "gpu_milli": 250},
        {"rank": 1, "gpus": [3], "env": rank_env(tmp_path, "frac", 1, 2, CUDA_VISIBLE_DEVICES="3"), "gpu_milli": 5},
    ])
    launch(fake, 2, "whole", 1, [{"rank": 0, "gpus": [4], "env": rank_env(tmp_path, "whole", 0,
                                                                           CUDA_VISIBLE_DEVICES="4")}])
    await until(lambda: all(fake.report("frac", r, S.RANK_STATE_EXITED) for r in range(2))
                and fake.report("whole", 0, S.RANK_STATE_EXITED), what="EXITED")
    e0, e1 = env_of(tmp_path, "frac", 0), env_of(tmp_path, "frac", 1)
    assert e0["CUDA_VISIBLE_DEVICES"] == "3" and e0["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert e0["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20389M" and e0["PHALANX_GPU_MILLI"] == "250"
    assert e1["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1" and e1["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=407M"
    w = env_of(tmp_path, "whole", 0)
    assert w["CUDA_VISIBLE_DEVICES"] == "4"
    assert not {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "PHALANX_GPU_MILLI"} & set(w)


async def test_mig_failures_fail_the_start_not_the_agent(fake, agents, tmp_path):
    backend = h100_backend(mig_disabled={1})
    agents(fake.port, backend=backend)
    launch(fake, 1, "badstart", 1, [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "badstart", 0),
                                     "slices": [(0, "3g.40gb", 2, 4)]}])
    launch(fake, 2, "off", 1, [{"rank": 0, "gpus": [1], "env": rank_env(tmp_path, "off", 0),
                                "slices": [(1, "1g.10gb", 0, 1)]}])
    launch(fake, 3, "both", 1, [{"rank": 0, "gpus": [2], "env": rank_env(tmp_path, "both", 0), "gpu_milli": 500,
                                 "slices": [(2, "1g.10gb", 0, 1)]}])
    await until(lambda: failed(fake, "badstart") and failed(fake, "off") and failed(fake, "both"),
                what="FAILED_TO_START")
    assert "cannot start at memory slice 2" in failed(fake, "badstart").message
    assert "MIG mode is not enabled on GPU 1" in failed(fake, "off").message
    assert "not both" in failed(fake, "both").message
    for job in ("badstart", "off", "both"):
        assert fake.states(job, 0) == [S.RANK_STATE_FAILED_TO_START] and starts(tmp_path, job, 0) == 0
    # the agent goes on
    launch(fake, 4, "ok", 1, [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "ok", 0),
                               "slices": [(0, "4g.40gb", 0, 4)]}])
    await until(lambda: fake.report("ok", 0, S.RANK_STATE_EXITED), what="later MIG rank EXITED")


async def test_no_mig_on_non_mig_gpus(fake, agents, tmp_path):
    agents(fake.port, profile="pcie-2numa")  # L40S
    launch(fake, 1, "l40s", 1, [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "l40s", 0),
                                 "slices": [(0, "1g.10gb", 0, 1)]}])
    await until(lambda: failed(fake, "l40s"), what="FAILED_TO_START")
    assert "does not support MIG" in failed(fake, "l40s").message


async def test_geometry_kept_while_ranks_use_the_gpu(fake, agents, tmp_path):
    backend = h100_backend()
    agents(fake.port, backend=backend)
    launch(fake, 1, "whole", 1, [{"rank": 0, "gpus": [5], "env": rank_env(tmp_path, "whole", 0, SLEEP=60)}])
    launch(fake, 2, "m4", 1, [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "m4", 0, SLEEP=60),
                               "slices": [(0, "4g.40gb", 0, 4)]}])
    await until(lambda: fake.report("whole", 0, S.RANK_STATE_RUNNING) and fake.report("m4", 0, S.RANK_STATE_RUNNING),
                what="RUNNING")
    launch(fake, 3, "on-whole", 1, [{"rank": 0, "gpus": [5], "env": rank_env(tmp_path, "on-whole", 0),
                                     "slices": [(5, "3g.40gb", 0, 4)]}])
    launch(fake, 4, "m7", 1, [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "m7", 0),
                               "slices": [(0, "7g.80gb", 0, 8)]}])
    await until(lambda: failed(fake, "on-whole") and failed(fake, "m7"), what="FAILED_TO_START")
    assert "GPU 5 is in use by rank whole/1/0" in failed(fake, "on-whole").message
    assert "in use by rank m4/1/0" in failed(fake, "m7").message
    assert backend.list_instances(5) == [] and [i.profile for i in backend.list_instances(0)] == ["4g.40gb"]
    # 3g next to the running 4g is fine
    launch(fake, 5, "m3", 1, [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "m3", 0),
                               "slices": [(0, "3g.40gb", 4, 4)]}])
    await until(lambda: fake.report("m3", 0, S.RANK_STATE_EXITED), what="m3 EXITED")
    fake.kill(6, "m4", 1)
    await until(lambda: fake.report("m4", 0, S.RANK_STATE_KILLED), what="m4 KILLED")
    await until(lambda: backend.list_instances(0) == [], what="4g destroyed after its rank")
    # now the whole GPU is free for a 7g
    launch(fake, 7, "m7b", 1, [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "m7b", 0),
                                "slices": [(0, "7g.80gb", 0, 8)]}])
    await until(lambda: fake.report("m7b", 0, S.RANK_STATE_EXITED), what="7g rank EXITED")


async def test_redelivered_mig_launch_starts_once(fake, agents, tmp_path):
    backend = h100_backend()
    agents(fake.port, backend=backend)
    ranks = [{"rank": 0, "gpus": [1], "env": rank_env(tmp_path, "dup", 0, SLEEP=60), "slices": [(1, "2g.20gb", 0, 2)]}]
    launch(fake, 1, "dup", 1, ranks)
    await until(lambda: fake.report("dup", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    port = fake.port
    await fake.server.stop(0)
    fake.replay_all = True
    launch(fake, 2, "dup", 1, ranks)
    fake.server, _ = await start_server(fake, port)
    await until(lambda: 2 in fake.acks, what="ack of the re-delivered launch")
    await asyncio.sleep(0.3)
    assert starts(tmp_path, "dup", 0) == 1 and fake.states("dup", 0) == [S.RANK_STATE_RUNNING]
    assert [c[0] for c in backend.calls] == ["create"]
    fake.kill(3, "dup", 1)
    await until(lambda: fake.report("dup", 0, S.RANK_STATE_KILLED), what="KILLED")
    await until(lambda: backend.list_instances(1) == [], what="instance destroyed")


async def test_restart_keeps_instances_of_adopted_ranks(fake, agents, tmp_path):
    state_dir = tmp_path / "state"
    a = agents(fake.port, state_dir=state_dir)  # default backend: the fake, kept in the state dir
    assert isinstance(a.mig.backend, FakeMigBackend)
    launch(fake, 1, "live", 1, [{"rank": 0, "gpus": [3], "env": rank_env(tmp_path, "live", 0, SLEEP=60),
                                 "slices": [(3, "3g.40gb", 0, 4)]}])
    launch(fake, 2, "short", 1, [{"rank": 0, "gpus": [3], "env": rank_env(tmp_path, "short", 0, SLEEP=0.3),
                                  "slices": [(3, "3g.40gb", 4, 4)]}])
    await until(lambda: fake.report("live", 0, S.RANK_STATE_RUNNING) and fake.report("short", 0, S.RANK_STATE_RUNNING),
                what="RUNNING")
    await until(lambda: 2 in fake.acks, what="acks")
    await a.abort()  # crash: ranks keep running, instances stay
    live_pid = fake.report("live", 0, S.RANK_STATE_RUNNING).pid
    await asyncio.sleep(0.6)  # "short" exits while no agent runs
    b = agents(fake.port, state_dir=state_dir)
    await until(lambda: fake.report("short", 0, S.RANK_STATE_EXITED), what="short EXITED")
    await until(lambda: [i.start for i in b.mig.backend.list_instances(3)] == [0], what="short's instance destroyed")
    await asyncio.sleep(0.2)
    assert launcher.pid_alive(live_pid) and starts(tmp_path, "live", 0) == 1
    assert b.mig.backend.list_instances(3)[0].uuid == fake_mig_uuid("node-a", 3, 0, "3g.40gb")
    assert b.mig.users(3, 0, 4) == {"live/1/0"}
    launch(fake, 3, "clash", 1, [{"rank": 0, "gpus": [3], "env": rank_env(tmp_path, "clash", 0),
                                  "slices": [(3, "7g.80gb", 0, 8)]}])
    await until(lambda: failed(fake, "clash"), what="clash FAILED_TO_START")
    fake.kill(4, "live", 1)
    await until(lambda: fake.report("live", 0, S.RANK_STATE_KILLED), what="adopted rank KILLED")
    await until(lambda: b.mig.backend.list_instances(3) == [], what="adopted rank's instance destroyed at its end")


# ------------------------------------------------------------------------------------------------ NVML backend


class FakeNvml(SharedFakeNvml):
    """The shared fake NVML (phalanx.testing.fake_nvml) with `gpus` H100s whose MIG mode is `mig_mode`
    ([current, pending]); `add` makes an instance by NVML profile id, as an administrator would."""

    def __init__(self, gpus: int = 2, mig_mode=(1, 1)) -> None:
        super().__init__([
            FakeGpu(i, f"GPU-fake-{i}", H100[0], H100[1], f"00000000:{0x18 + i:02X}:00.0", mig_capable=True,
                    mig_mode=list(mig_mode))
            for i in range(gpus)
        ])

    def add(self, gpu: int, pid: int, start: int, size: int, ci: bool = True) -> int:
        profile = next(k for k, v in GI_PROFILES.items() if v[0] == pid and v[2] == size)
        return self.add_mig_instance(gpu, profile, start, ci=ci)


def mig_uuid(nv: FakeNvml, gpu: int, gi_id: int) -> str:
    """The MIG device UUID the fake NVML gives GPU instance `gi_id` of GPU `gpu`."""
    return nv.nvmlDeviceGetUUID(("mig", gpu, gi_id))


def nvml_backend(nv: FakeNvml) -> NvmlMigBackend:
    return NvmlMigBackend({g.index: H100 for g in nv.gpus}, nvml=nv)


def test_nvml_creates_with_placement_when_missing():
    nv = FakeNvml()
    b = nvml_backend(nv)
    u = b.ensure_instance(1, "3g.40gb", 4, 4)
    assert nv.calls == [("create_gi", 1, 9, 4, 4),
                        ("create_ci", 1, 1, 100 + pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)]
    assert u == mig_uuid(nv, 1, 1)
    u_small = b.ensure_instance(1, "1g.10gb", 0, 1)
    assert nv.calls[-2] == ("create_gi", 1, 19, 0, 1) and u_small == mig_uuid(nv, 1, 2)
    u_large = b.ensure_instance(1, "1g.20gb", 2, 2)  # 1g with 2 memory slices: the REV2 profile
    assert nv.calls[-2] == ("create_gi", 1, 15, 2, 2) and u_large == mig_uuid(nv, 1, 3)
    assert [(i.profile, i.start, i.size, i.uuid) for i in b.list_instances(1)] == [
        ("1g.10gb", 0, 1, mig_uuid(nv, 1, 2)), ("1g.20gb", 2, 2, mig_uuid(nv, 1, 3)), ("3g.40gb", 4, 4, mig_uuid(nv, 1, 1))]


def test_nvml_reuses_an_instance_that_is_there():
    nv = FakeNvml()
    gi_id = nv.add(0, 5, 0, 4)  # a 4g.40gb with its compute instance
    b = nvml_backend(nv)
    assert b.ensure_instance(0, "4g.40gb", 0, 4) == mig_uuid(nv, 0, gi_id)
    assert nv.calls == []
    bare = nv.add(0, 9, 4, 4, ci=False)  # a GPU instance without compute instance: only that is made
    assert b.ensure_instance(0, "3g.40gb", 4, 4) == mig_uuid(nv, 0, bare)
    assert [c[0] for c in nv.calls] == ["create_ci"]


def test_nvml_refuses_when_mig_mode_is_off_or_placement_taken():
    nv = FakeNvml(mig_mode=(0, 0))
    with pytest.raises(MigError, match="MIG mode is not enabled on GPU 0.*nvidia-smi -i 0 -mig 1"):
        nvml_backend(nv).ensure_instance(0, "3g.40gb", 0, 4)
    assert nv.calls == []
    pending = FakeNvml(mig_mode=(0, 1))
    with pytest.raises(MigError, match="pending: reset the GPU"):
        nvml_backend(pending).ensure_instance(0, "3g.40gb", 0, 4)
    nv = FakeNvml()
    nv.add(0, 0, 0, 8)  # 7g.80gb
    with pytest.raises(MigError, match="cannot create MIG instance 3g.40gb at slices 0-3 of GPU 0"):
        nvml_backend(nv).ensure_instance(0, "3g.40gb", 0, 4)
    with pytest.raises(MigError, match="cannot create"):
        nvml_backend(FakeNvml()).ensure_instance(0, "3g.40gb", 2, 4)
    broken = FakeNvml()
    broken.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(MigError, match="cannot initialise NVML"):
        nvml_backend(broken).ensure_instance(0, "3g.40gb", 0, 4)


def test_nvml_release_destroys_compute_then_gpu_instance():
    nv = FakeNvml()
    b = nvml_backend(nv)
    b.ensure_instance(0, "2g.20gb", 2, 2)
    nv.calls.clear()
    b.release_instance(0, 2, 2)
    assert nv.calls == [("destroy_ci", 0, 1), ("destroy_gi", 0, 1)] and nv.gis == {}
    with pytest.raises(MigError, match="no MIG instance"):
        b.release_instance(0, 2, 2)


def test_nvml_manager_reconfigures_through_nvml():
    nv = FakeNvml()
    nv.add(0, 0, 0, 8)  # a 7g.80gb nobody of ours uses
    topo = agent_pb2.HostTopology(profile="nvml")
    for i in range(len(nv.gpus)):
        topo.gpus.append(agent_pb2.GpuInfo(index=i, name=H100[0], memory_mib=H100[1]))
    m = MigManager(nvml_backend(nv), topo)
    got = m.acquire("j/1/0", [sl(0, "3g.40gb", 4, 4)])
    assert [c[0] for c in nv.calls] == ["destroy_ci", "destroy_gi", "create_gi", "create_ci"]
    assert got[0]["uuid"] in {mig_uuid(nv, 0, gi) for gi in range(1, 8)} and got[0]["created"]
    assert m.release("j/1/0", got) == [(0, 4, 4)] and nv.gis == {}


async def test_agent_with_nvml_backend_mig_off_fails_the_start(fake, agents, tmp_path):
    nv = FakeNvml(gpus=8, mig_mode=(0, 0))
    agents(fake.port, backend=nvml_backend(nv))
    launch(fake, 1, "nomig", 1, [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "nomig", 0),
                                  "slices": [(0, "1g.10gb", 0, 1)]}])
    await until(lambda: failed(fake, "nomig"), what="FAILED_TO_START")
    assert "MIG mode is not enabled on GPU 0" in failed(fake, "nomig").message
    nv.gpus[0].mig_mode = [1, 1]
    launch(fake, 2, "mig", 1, [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "mig", 0),
                                "slices": [(0, "1g.10gb", 0, 1)]}])
    await until(lambda: fake.report("mig", 0, S.RANK_STATE_EXITED), what="EXITED")
    assert env_of(tmp_path, "mig", 0)["CUDA_VISIBLE_DEVICES"] == mig_uuid(nv, 0, 1)
    await until(lambda: nv.gis == {}, what="instance destroyed")
