"""The node agent on partial GPUs: MIG instances (the NVML backend, the manager) and fractional shares.

Everything MIG runs through the real nvidia-ml-py bindings over the simulated NVML library (phalanx.simhost.nvml),
which keeps MIG state with NVIDIA's placement rules and records the mutations made. Agent tests run real rank
processes (as tests/service/test_node_agent.py does) against its fake NodeService and check the environment each rank got.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from phalanx.api.v1 import agent_pb2, common_pb2
from phalanx.profiles import load_profile
from phalanx.simhost.nvml import SimulatedHost, bind
from services.node_agent import launcher
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.mig_manager import MigError, MigManager, NvmlMigBackend
from services.node_agent.simulated import fake_gpu_uuid, nvml_for_topology, simulated_node, simulated_topology
from services.node_agent.state import AgentState

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_node_agent import (
    RANK_CMD,
    FakeNodeService,
    exited,
    rank_env,
    rank_pids,
    record_takes,
    start_server,
    starts,
    until,
)

S = common_pb2
H100 = ("NVIDIA H100 80GB HBM3", 81559)
H100_MEMORY = 81559


def h100_host(mig=True, state_file=None, model=H100, gpus=8) -> SimulatedHost:
    dump = load_profile("dgx-h100").dump
    host = SimulatedHost.from_dump(
        dump, gpu_model=model[0], memory_mib=model[1], mig_enabled=mig, state_file=state_file
    )
    del host.gpus[gpus:]
    return host


def nvml_backend(host: SimulatedHost) -> NvmlMigBackend:
    """The production backend over the real pynvml over `host`; `backend.host` is the host."""
    b = NvmlMigBackend({g.index: (g.name, g.memory_mib) for g in host.gpus}, nvml=bind(host))
    b.host = host
    return b


def h100_backend(**kw) -> NvmlMigBackend:
    return nvml_backend(h100_host(**kw))


def mutations(host: SimulatedHost) -> list[str]:
    return [c[0] for c in host.calls]


def used_mask(b: NvmlMigBackend, gpu: int) -> int:
    mask = 0
    for i in b.list_instances(gpu):
        mask |= i.mask
    return mask


# ------------------------------------------------------------------------------------------------ NVML backend


@pytest.mark.parametrize(
    "profile,size,good,bad",
    [
        ("1g.10gb", 1, [0, 1, 2, 3, 4, 5, 6], [7]),
        ("1g.10gb+me", 1, [0, 3, 6], [7]),
        ("1g.20gb", 2, [0, 2, 4, 6], [1, 3, 5]),
        ("2g.20gb", 2, [0, 2, 4], [1, 6]),
        ("3g.40gb", 4, [0, 4], [1, 2, 3]),
        ("4g.40gb", 4, [0], [2, 4]),
        ("7g.80gb", 8, [0], [1, 4]),
    ],
)
def test_valid_and_invalid_starts(profile, size, good, bad):
    for start in good:
        b = h100_backend()
        made = b.create_instance(0, profile, start)
        assert made.uuid.startswith("MIG-") and made.gi_id >= 1 and made.ci_id == 0
        assert [(i.profile, i.start, i.size) for i in b.list_instances(0)] == [(profile, start, size)]
    for start in bad:
        b = h100_backend()
        with pytest.raises(MigError, match="Invalid Argument"):
            b.create_instance(0, profile, start)
        assert b.list_instances(0) == []


def test_overlap_refused_and_valid_geometries():
    b = h100_backend()
    b.create_instance(0, "3g.40gb", 0)
    for profile, start in [("2g.20gb", 2), ("7g.80gb", 0), ("4g.40gb", 0), ("1g.10gb", 3)]:
        with pytest.raises(MigError, match="cannot create MIG instance .*Insufficient resources"):
            b.create_instance(0, profile, start)
    # 4g + 3g
    u4 = b.create_instance(1, "4g.40gb", 0).uuid
    u3 = b.create_instance(1, "3g.40gb", 4).uuid
    assert u4 != u3 and used_mask(b, 1) == 0xFF
    # seven 1g small instances fill slices 0-6; slice 7 holds none
    uuids = {b.create_instance(2, "1g.10gb", s).uuid for s in range(7)}
    assert len(uuids) == 7 and used_mask(b, 2) == 0x7F
    with pytest.raises(MigError):
        b.create_instance(2, "1g.10gb", 7)
    # 2g + 2g + 2g + 1g (large)
    for s in (0, 2, 4):
        b.create_instance(3, "2g.20gb", s)
    b.create_instance(3, "1g.20gb", 6)
    assert used_mask(b, 3) == 0xFF
    # one media-extension instance per GPU
    b.create_instance(4, "1g.10gb+me", 0)
    with pytest.raises(MigError, match="Insufficient resources"):
        b.create_instance(4, "1g.10gb+me", 1)
    b.create_instance(4, "1g.10gb", 1)


def test_create_records_ids_and_destroy_is_exact():
    b = h100_backend()
    first = b.create_instance(0, "3g.40gb", 4)
    assert mutations(b.host) == ["create_gi", "create_ci"]
    assert b.host.calls[0] == ("create_gi", 0, "3g.40gb", 4, 4)
    with pytest.raises(MigError, match="no MIG instance 99"):
        b.destroy_instance(0, 4, 4, 99)  # another instance id at that placement: not touched
    assert len(b.list_instances(0)) == 1
    b.destroy_instance(0, 4, 4, first.gi_id)
    assert mutations(b.host)[-2:] == ["destroy_ci", "destroy_gi"] and b.list_instances(0) == []
    with pytest.raises(MigError, match="no MIG instance"):
        b.destroy_instance(0, 4, 4, first.gi_id)


def test_nvml_refuses_what_the_hardware_refuses():
    b = h100_backend(mig=[True] * 5 + [False] * 3)
    with pytest.raises(MigError, match="no MIG profile '1g.5gb'"):
        b.create_instance(0, "1g.5gb", 0)  # an A100 40GB profile
    with pytest.raises(MigError, match="MIG mode is not enabled on GPU 5.*nvidia-smi -i 5 -mig 1"):
        b.create_instance(5, "3g.40gb", 0)
    assert b.host.calls == []
    l40s = nvml_backend(h100_host(model=("NVIDIA L40S", 46068)))
    with pytest.raises(MigError, match="no MIG profile|does not support MIG"):
        l40s.create_instance(0, "1g.10gb", 0)
    # other families: their own names and memory
    nvml_backend(h100_host(model=("NVIDIA A100-SXM4-40GB", 40960))).create_instance(0, "1g.5gb", 0)
    nvml_backend(h100_host(model=("NVIDIA H200", 143771))).create_instance(0, "3g.71gb", 4)
    broken = h100_host()
    broken.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(MigError, match="cannot initialise NVML"):
        nvml_backend(broken).create_instance(0, "3g.40gb", 0)


def test_pending_mode_says_reset():
    host = h100_host(mig=False)
    host.gpus[0].mig_mode = [0, 1]
    with pytest.raises(MigError, match="pending: reset the GPU"):
        nvml_backend(host).create_instance(0, "3g.40gb", 0)


def test_failed_compute_instance_leaves_no_gpu_instance():
    b = h100_backend()
    b.host.fail["nvmlGpuInstanceCreateComputeInstance"] = 23  # NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(MigError, match="cannot create the compute instance"):
        b.create_instance(0, "3g.40gb", 0)
    assert mutations(b.host) == ["create_gi", "destroy_gi"] and b.list_instances(0) == []


def test_state_survives_a_new_host(tmp_path):
    f = tmp_path / "gpus.json"
    b = h100_backend(state_file=f)
    u = b.create_instance(4, "4g.40gb", 0).uuid
    again = h100_backend(state_file=f)
    assert [(i.profile, i.uuid) for i in again.list_instances(4)] == [("4g.40gb", u)]
    with pytest.raises(MigError, match="Insufficient resources"):
        again.create_instance(4, "7g.80gb", 0)


# ------------------------------------------------------------------------------------------------ manager


def manager(backend=None) -> MigManager:
    return MigManager(backend or h100_backend(), simulated_topology("node-a", "dgx-h100"))


def sl(gpu, profile, start, size):
    return {"gpu": gpu, "profile": profile, "start": start, "size": size}


def test_manager_never_uses_or_destroys_what_it_did_not_create():
    m = manager()
    host = m.backend.host
    host.add_mig_instance(0, "3g.40gb", 4)  # there before the agent: an administrator's
    with pytest.raises(MigError, match="did not create .*occupied by someone else"):
        m.acquire("j/1/0", [sl(0, "3g.40gb", 4, 4)])
    with pytest.raises(MigError, match="overlaps .*did not create"):
        m.acquire("j/1/0", [sl(0, "7g.80gb", 0, 8)])
    mine = m.acquire("j/1/1", [sl(0, "4g.40gb", 0, 4)])[0]
    assert mine["created"] is True and mine["gi_id"] >= 1 and mine["ci_id"] == 0
    assert [(r["gpu"], r["start"], r["gi_id"]) for r in m.created] == [(0, 0, mine["gi_id"])]
    assert m.release("j/1/1", [mine]) == [(0, 0, 4)]
    assert [(i.profile, i.start) for i in m.backend.list_instances(0)] == [("3g.40gb", 4)]
    assert m.created == [] and "destroy_gi" in mutations(host)
    assert m.clean_up() == [] and len(m.backend.list_instances(0)) == 1  # still not ours


def test_manager_shared_instance_released_by_last_user():
    m = manager()
    a = m.acquire("a/1/0", [sl(1, "2g.20gb", 2, 2)])
    b = m.acquire("b/1/0", [sl(1, "2g.20gb", 2, 2)])
    assert a[0]["uuid"] == b[0]["uuid"] and mutations(m.backend.host).count("create_gi") == 1
    assert m.release("a/1/0", a) == [] and len(m.backend.list_instances(1)) == 1
    assert m.release("b/1/0", b) == [(1, 2, 2)] and m.backend.list_instances(1) == []


def test_manager_reconfigures_its_own_unused_instances_but_not_used_ones():
    m = manager()
    old = m.acquire("old/1/0", [sl(2, "7g.80gb", 0, 8)])
    m._users.clear()  # its rank ended while the release failed: a leftover of ours
    got = m.acquire("j/1/0", [sl(2, "3g.40gb", 0, 4)])
    assert [(i.profile, i.start) for i in m.backend.list_instances(2)] == [("3g.40gb", 0)]
    assert old[0]["gi_id"] not in {r["gi_id"] for r in m.created if r["gpu"] == 2} or len(m.created) == 1
    with pytest.raises(MigError, match="in use by rank j/1/0"):
        m.acquire("k/1/0", [sl(2, "4g.40gb", 0, 4)])
    assert m.backend.list_instances(2)[0].uuid == got[0]["uuid"]
    # a GPU a whole-GPU rank uses keeps its geometry
    with pytest.raises(MigError, match="GPU 3 is in use by rank w/1/0"):
        m.acquire("k/1/0", [sl(3, "1g.10gb", 0, 1)], busy_gpus={3: "w/1/0"})
    assert m.backend.list_instances(3) == []


def test_manager_failed_acquire_keeps_nothing():
    m = manager()
    m.acquire("x/1/0", [sl(4, "1g.10gb", 1, 1)])
    with pytest.raises(MigError):
        m.acquire("y/1/0", [sl(5, "3g.40gb", 0, 4), sl(4, "2g.20gb", 0, 2)])  # second overlaps x's instance
    assert m.backend.list_instances(5) == []  # the first, made for this call, rolled back
    with pytest.raises(MigError, match="cannot start at memory slice 2"):
        m.acquire("y/1/0", [sl(5, "3g.40gb", 2, 4)])
    with pytest.raises(MigError, match="no MIG profile"):
        m.acquire("y/1/0", [sl(5, "3g.20gb", 0, 4)])
    assert [r["gpu"] for r in m.created] == [4]


def test_manager_adopt_and_clean_up_after_a_restart():
    b = h100_backend()
    m1 = manager(b)
    live = m1.acquire("live/1/0", [sl(6, "1g.10gb", 0, 1)])
    m1.acquire("dead/1/0", [sl(6, "1g.10gb", 1, 1)])
    b.host.add_mig_instance(6, "1g.10gb", 2)  # someone else's
    m2 = MigManager(b, simulated_topology("node-a", "dgx-h100"), created=m1.created)  # a restarted agent
    m2.adopt("live/1/0", live)
    assert m2.clean_up() == [(6, 1, 1)]  # the dead rank's instance: ours, unused
    assert sorted(i.start for i in b.list_instances(6)) == [0, 2]
    with pytest.raises(MigError, match="in use by rank live/1/0"):
        m2.acquire("new/1/0", [sl(6, "1g.20gb", 0, 2)])
    assert m2.release("live/1/0", live) == [(6, 0, 1)]
    assert [i.start for i in b.list_instances(6)] == [2]


# ------------------------------------------------------------------------------------------------ env helpers


@pytest.mark.parametrize(
    "milli,pct,mem",
    [(250, "25", "0=20389M"), (5, "1", "0=407M"), (15, "2", "0=1223M"), (999, "100", "0=81477M"), (1, "1", "0=81M")],
)
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

    def start(
        port, *, backend=None, state_dir=None, profile="dgx-h100", node="node-a", mig="all", mig_manage=False
    ) -> NodeAgent:
        state_dir = state_dir or tmp_path / "state"
        sim = simulated_node(node, profile, mig_gpus=mig, state_dir=state_dir)
        agent = NodeAgent(
            AgentConfig(
                scheduler=f"127.0.0.1:{port}",
                node_name=node,
                topology=sim.topology,
                nvml=sim.nvml,
                state_dir=state_dir,
                kill_grace_s=0.5,
                backoff_initial_s=0.05,
                backoff_cap_s=0.3,
                poll_interval_s=0.02,
                rpc_timeout_s=2.0,
                flush_timeout_s=2.0,
                mig_backend=backend,
                mig_manage=mig_manage,
            )
        )
        agent.sim = sim
        started.append((agent, asyncio.create_task(agent.run())))
        return agent

    yield start
    for agent, task in started:
        if not task.done():
            agent.request_stop()
            try:
                await asyncio.wait_for(task, 10)
            except Exception:
                task.cancel()


def launch(fake: FakeNodeService, revision: int, job: str, attempt: int, ranks: list[dict]) -> None:
    """ranks: {rank, gpus, env, slices: [(gpu, profile, start, size)], gpu_milli}."""
    msg = agent_pb2.LaunchReplica(job_id=job, attempt=attempt, replica=0, command=RANK_CMD)
    for r in ranks:
        msg.ranks.append(
            agent_pb2.RankLaunch(
                rank=r["rank"],
                local_rank=r["rank"],
                gpus=r["gpus"],
                env=r["env"],
                gpu_milli=r.get("gpu_milli", 0),
                slices=[S.MigSlice(gpu=g, profile=p, start=s, size=z) for g, p, s, z in r.get("slices", [])],
            )
        )
    fake.push(agent_pb2.Assignment(revision=revision, launch=msg))


def env_of(tmp: Path, job: str, rank: int) -> dict:
    return json.loads((tmp / f"{job}-r{rank}.env.json").read_text())


def failed(fake, job, rank=0):
    return fake.report(job, rank, S.RANK_STATE_FAILED_TO_START)


def mig_uuids(agent: NodeAgent, gpu: int) -> dict[int, str]:
    """start slice -> MIG device UUID of the instances on `gpu` of the agent's simulated host."""
    return {i.start: i.uuid for i in agent.mig.backend.list_instances(gpu)}


@pytest.mark.slow
async def test_mig_ranks_get_mig_uuids_and_instances_go_when_they_end(fake, agents, tmp_path):
    a = agents(fake.port)
    launch(
        fake,
        1,
        "mig",
        1,
        [
            {
                "rank": 0,
                "gpus": [2],
                "env": rank_env(tmp_path, "mig", 0, 3, CUDA_VISIBLE_DEVICES="2", SLEEP=1.0),
                "slices": [(2, "3g.40gb", 4, 4)],
            },
            {
                "rank": 1,
                "gpus": [2],
                "env": rank_env(tmp_path, "mig", 1, 3, CUDA_VISIBLE_DEVICES="2", SLEEP=1.0),
                "slices": [(2, "1g.10gb", 0, 1)],
            },
            {
                "rank": 2,
                "gpus": [5, 6],
                "env": rank_env(tmp_path, "mig", 2, 3, CUDA_VISIBLE_DEVICES="5,6", SLEEP=1.0),
                "slices": [(5, "7g.80gb", 0, 8), (6, "2g.20gb", 2, 2)],
            },
        ],
    )
    await until(lambda: all(fake.report("mig", r, S.RANK_STATE_RUNNING) for r in range(3)), what="RUNNING")
    on2, on5, on6 = mig_uuids(a, 2), mig_uuids(a, 5), mig_uuids(a, 6)
    assert set(on2) == {4, 0}
    rec = a.state.ranks["mig/1/0"]  # the live rank's record (a finished one is dropped once reported)
    assert rec.slices[0]["uuid"] == on2[4] and rec.slices[0]["created"] and rec.slices[0]["gi_id"] >= 1
    await until(lambda: all(fake.report("mig", r, S.RANK_STATE_EXITED) for r in range(3)), what="EXITED")
    assert env_of(tmp_path, "mig", 0)["CUDA_VISIBLE_DEVICES"] == on2[4]
    assert env_of(tmp_path, "mig", 1)["CUDA_VISIBLE_DEVICES"] == on2[0]
    assert env_of(tmp_path, "mig", 2)["CUDA_VISIBLE_DEVICES"] == ",".join([on5[0], on6[2]])
    assert env_of(tmp_path, "mig", 0)["RANK"] == "0" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env_of(
        tmp_path, "mig", 0
    )
    await until(lambda: not any(a.mig.backend.list_instances(g) for g in range(8)), what="instances destroyed")
    # the record of the instances the agent made is saved empty once the last release is done
    await until(lambda: AgentState.load(tmp_path / "state" / "state.json").mig_created == [], what="record saved")


async def test_fractional_rank_env_and_whole_gpu_unchanged(fake, agents, tmp_path):
    agents(fake.port, mig="none")
    launch(
        fake,
        1,
        "frac",
        1,
        [
            {
                "rank": 0,
                "gpus": [3],
                "env": rank_env(tmp_path, "frac", 0, 2, CUDA_VISIBLE_DEVICES="3"),
                "gpu_milli": 250,
            },
            {"rank": 1, "gpus": [3], "env": rank_env(tmp_path, "frac", 1, 2, CUDA_VISIBLE_DEVICES="3"), "gpu_milli": 5},
        ],
    )
    launch(
        fake, 2, "whole", 1, [{"rank": 0, "gpus": [4], "env": rank_env(tmp_path, "whole", 0, CUDA_VISIBLE_DEVICES="4")}]
    )
    await until(
        lambda: (
            all(fake.report("frac", r, S.RANK_STATE_EXITED) for r in range(2))
            and fake.report("whole", 0, S.RANK_STATE_EXITED)
        ),
        what="EXITED",
    )
    e0, e1 = env_of(tmp_path, "frac", 0), env_of(tmp_path, "frac", 1)
    assert e0["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert e0["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20389M" and e0["PHALANX_GPU_MILLI"] == "250"
    assert e1["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1" and e1["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=407M"
    w = env_of(tmp_path, "whole", 0)
    assert w["CUDA_VISIBLE_DEVICES"] == fake_gpu_uuid("node-a", 4)  # a whole GPU by its UUID
    assert not {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "PHALANX_GPU_MILLI"} & set(w)


async def test_mig_failures_fail_the_start_retryably_not_the_agent(fake, agents, tmp_path):
    agents(fake.port, mig="0,2,3")
    launch(
        fake,
        1,
        "badstart",
        1,
        [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "badstart", 0), "slices": [(0, "3g.40gb", 2, 4)]}],
    )
    launch(
        fake,
        2,
        "off",
        1,
        [{"rank": 0, "gpus": [1], "env": rank_env(tmp_path, "off", 0), "slices": [(1, "1g.10gb", 0, 1)]}],
    )
    launch(
        fake,
        3,
        "both",
        1,
        [
            {
                "rank": 0,
                "gpus": [2],
                "env": rank_env(tmp_path, "both", 0),
                "gpu_milli": 500,
                "slices": [(2, "1g.10gb", 0, 1)],
            }
        ],
    )
    await until(
        lambda: failed(fake, "badstart") and failed(fake, "off") and failed(fake, "both"), what="FAILED_TO_START"
    )
    assert "cannot start at memory slice 2" in failed(fake, "badstart").message
    assert "MIG mode is not enabled on GPU 1" in failed(fake, "off").message
    assert failed(fake, "badstart").retryable and failed(fake, "off").retryable
    assert "not both" in failed(fake, "both").message and not failed(fake, "both").retryable
    for job in ("badstart", "off", "both"):
        assert fake.states(job, 0) == [S.RANK_STATE_FAILED_TO_START] and starts(tmp_path, job, 0) == 0
    # the agent goes on
    launch(
        fake,
        4,
        "ok",
        1,
        [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "ok", 0), "slices": [(0, "4g.40gb", 0, 4)]}],
    )
    await until(lambda: fake.report("ok", 0, S.RANK_STATE_EXITED), what="later MIG rank EXITED")


async def test_failed_create_rolls_back_the_attempts_instances(fake, agents, tmp_path):
    """Rank 1's instance cannot be made: rank 0's, made for the same attempt, is destroyed at once; rank 2 is not
    started; every report is FAILED_TO_START and retryable."""
    a = agents(fake.port)
    host = a.sim.host
    host.add_mig_instance(3, "1g.10gb", 4)  # an administrator's, in the way of rank 1 (3g at 4)
    launch(
        fake,
        1,
        "gang",
        1,
        [
            {
                "rank": 0,
                "gpus": [3],
                "env": rank_env(tmp_path, "gang", 0, 3, SLEEP=60),
                "slices": [(3, "3g.40gb", 0, 4)],
            },
            {"rank": 1, "gpus": [3], "env": rank_env(tmp_path, "gang", 1, 3), "slices": [(3, "3g.40gb", 4, 4)]},
            {"rank": 2, "gpus": [4], "env": rank_env(tmp_path, "gang", 2, 3), "slices": [(4, "7g.80gb", 0, 8)]},
        ],
    )
    await until(lambda: failed(fake, "gang", 1) and failed(fake, "gang", 2), what="FAILED_TO_START")
    assert "did not create" in failed(fake, "gang", 1).message and failed(fake, "gang", 1).retryable
    assert "not started" in failed(fake, "gang", 2).message and failed(fake, "gang", 2).retryable
    await until(lambda: [i.start for i in a.mig.backend.list_instances(3)] == [4], what="rank 0's instance gone")
    assert a.mig.backend.list_instances(4) == [] and starts(tmp_path, "gang", 2) == 0
    await until(lambda: a.mig.created == [], what="the record of rank 0's instance dropped")


async def test_no_mig_on_non_mig_gpus(fake, agents, tmp_path):
    agents(fake.port, profile="pcie-2numa")  # L40S
    launch(
        fake,
        1,
        "l40s",
        1,
        [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "l40s", 0), "slices": [(0, "1g.10gb", 0, 1)]}],
    )
    await until(lambda: failed(fake, "l40s"), what="FAILED_TO_START")
    assert "does not support MIG" in failed(fake, "l40s").message


async def test_geometry_kept_while_ranks_use_the_gpu(fake, agents, tmp_path):
    a = agents(fake.port)
    backend = a.mig.backend
    launch(fake, 1, "whole", 1, [{"rank": 0, "gpus": [5], "env": rank_env(tmp_path, "whole", 0, SLEEP=60)}])
    launch(
        fake,
        2,
        "m4",
        1,
        [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "m4", 0, SLEEP=60), "slices": [(0, "4g.40gb", 0, 4)]}],
    )
    await until(
        lambda: fake.report("whole", 0, S.RANK_STATE_RUNNING) and fake.report("m4", 0, S.RANK_STATE_RUNNING),
        what="RUNNING",
    )
    launch(
        fake,
        3,
        "on-whole",
        1,
        [{"rank": 0, "gpus": [5], "env": rank_env(tmp_path, "on-whole", 0), "slices": [(5, "3g.40gb", 0, 4)]}],
    )
    launch(
        fake,
        4,
        "m7",
        1,
        [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "m7", 0), "slices": [(0, "7g.80gb", 0, 8)]}],
    )
    await until(lambda: failed(fake, "on-whole") and failed(fake, "m7"), what="FAILED_TO_START")
    assert "GPU 5 is in use by rank whole/1/0" in failed(fake, "on-whole").message
    assert "in use by rank m4/1/0" in failed(fake, "m7").message
    assert backend.list_instances(5) == [] and [i.profile for i in backend.list_instances(0)] == ["4g.40gb"]
    # 3g next to the running 4g is fine
    launch(
        fake,
        5,
        "m3",
        1,
        [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "m3", 0), "slices": [(0, "3g.40gb", 4, 4)]}],
    )
    await until(lambda: fake.report("m3", 0, S.RANK_STATE_EXITED), what="m3 EXITED")
    fake.kill(6, "m4", 1)
    await until(lambda: fake.report("m4", 0, S.RANK_STATE_KILLED), what="m4 KILLED")
    await until(lambda: backend.list_instances(0) == [], what="4g destroyed after its rank")
    # now the whole GPU is free for a 7g
    launch(
        fake,
        7,
        "m7b",
        1,
        [{"rank": 0, "gpus": [0], "env": rank_env(tmp_path, "m7b", 0), "slices": [(0, "7g.80gb", 0, 8)]}],
    )
    await until(lambda: fake.report("m7b", 0, S.RANK_STATE_EXITED), what="7g rank EXITED")


async def test_redelivered_mig_launch_starts_once(fake, agents, tmp_path):
    a = agents(fake.port)
    taken = record_takes(a)
    ranks = [{"rank": 0, "gpus": [1], "env": rank_env(tmp_path, "dup", 0, SLEEP=60), "slices": [(1, "2g.20gb", 0, 2)]}]
    launch(fake, 1, "dup", 1, ranks)
    await until(lambda: fake.report("dup", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    await until(lambda: starts(tmp_path, "dup", 0) == 1, what="its start recorded")
    pids = rank_pids(a, "dup")
    port = fake.port
    await fake.server.stop(0)
    fake.replay_all = True
    launch(fake, 2, "dup", 1, ranks)
    fake.server, _ = await start_server(fake, port)
    await until(lambda: 2 in fake.acks, what="ack of the re-delivered launch")
    await until(lambda: taken.count(1) >= 2, what="revision 1 taken again")
    assert rank_pids(a, "dup") == pids  # both launches handled: still the first process
    assert starts(tmp_path, "dup", 0) == 1 and fake.states("dup", 0) == [S.RANK_STATE_RUNNING]
    assert mutations(a.sim.host) == ["create_gi", "create_ci"]
    fake.kill(3, "dup", 1)
    await until(lambda: fake.report("dup", 0, S.RANK_STATE_KILLED), what="KILLED")
    await until(lambda: a.mig.backend.list_instances(1) == [], what="instance destroyed")


@pytest.mark.slow
async def test_restart_keeps_instances_of_adopted_ranks_and_leaves_others(fake, agents, tmp_path):
    state_dir = tmp_path / "state"
    a = agents(fake.port, state_dir=state_dir)  # the simulated GPUs' MIG state lives in the state dir
    launch(
        fake,
        1,
        "live",
        1,
        [{"rank": 0, "gpus": [3], "env": rank_env(tmp_path, "live", 0, SLEEP=60), "slices": [(3, "3g.40gb", 0, 4)]}],
    )
    launch(
        fake,
        2,
        "short",
        1,
        [{"rank": 0, "gpus": [3], "env": rank_env(tmp_path, "short", 0, SLEEP=0.3), "slices": [(3, "3g.40gb", 4, 4)]}],
    )
    await until(
        lambda: fake.report("live", 0, S.RANK_STATE_RUNNING) and fake.report("short", 0, S.RANK_STATE_RUNNING),
        what="RUNNING",
    )
    await until(lambda: 2 in fake.acks, what="acks")
    await until(lambda: starts(tmp_path, "live", 0) == 1, what="live's start recorded")
    live_uuid = mig_uuids(a, 3)[0]
    await a.abort()  # crash: ranks keep running, instances stay
    live_pid = fake.report("live", 0, S.RANK_STATE_RUNNING).pid
    a.sim.host.add_mig_instance(7, "1g.10gb", 0)  # an administrator's, made while no agent ran
    await until(lambda: exited(a, "short/1/0"), what="'short' to exit while no agent runs")
    b = agents(fake.port, state_dir=state_dir)
    await until(lambda: fake.report("short", 0, S.RANK_STATE_EXITED), what="short EXITED")
    await until(lambda: [i.start for i in b.mig.backend.list_instances(3)] == [0], what="short's instance destroyed")
    assert b.state.ranks["live/1/0"].child_pid == live_pid  # adopted, not started again
    assert launcher.pid_alive(live_pid) and starts(tmp_path, "live", 0) == 1
    assert b.mig.backend.list_instances(3)[0].uuid == live_uuid
    assert b.mig.users(3, 0, 4) == {"live/1/0"}
    assert [i.start for i in b.mig.backend.list_instances(7)] == [0]  # someone else's: left alone
    # registration shows it as occupied by someone else, and ours as managed
    topo = b._current_topology()
    assert [(m.start, m.managed) for m in topo.gpus[7].mig_instances] == [(0, False)]
    assert [(m.start, m.managed) for m in topo.gpus[3].mig_instances] == [(0, True)]
    launch(
        fake,
        3,
        "clash",
        1,
        [{"rank": 0, "gpus": [3], "env": rank_env(tmp_path, "clash", 0), "slices": [(3, "7g.80gb", 0, 8)]}],
    )
    await until(lambda: failed(fake, "clash"), what="clash FAILED_TO_START")
    fake.kill(4, "live", 1)
    await until(lambda: fake.report("live", 0, S.RANK_STATE_KILLED), what="adopted rank KILLED")
    await until(lambda: b.mig.backend.list_instances(3) == [], what="adopted rank's instance destroyed at its end")
    assert len(b.mig.backend.list_instances(7)) == 1


async def test_agent_given_only_a_simulated_topology_runs_mig_through_nvml(fake, tmp_path):
    """An AgentConfig with a simulated topology and no bindings but `simulated_nvml`: the agent makes a simulated host
    from it."""
    topo = simulated_topology("node-b", "dgx-h100", mig_gpus="1")
    agent = NodeAgent(
        AgentConfig(
            scheduler=f"127.0.0.1:{fake.port}",
            node_name="node-b",
            topology=topo,
            state_dir=tmp_path / "b",
            kill_grace_s=0.5,
            backoff_initial_s=0.05,
            poll_interval_s=0.02,
            rpc_timeout_s=2.0,
            flush_timeout_s=2.0,
            simulated_nvml=nvml_for_topology,
        )
    )
    assert agent.mig.backend.kind == "nvml-simulated"
    task = asyncio.create_task(agent.run())
    try:
        launch(
            fake,
            1,
            "m",
            1,
            [{"rank": 0, "gpus": [1], "env": rank_env(tmp_path, "m", 0), "slices": [(1, "1g.10gb", 0, 1)]}],
        )
        await until(lambda: fake.report("m", 0, S.RANK_STATE_EXITED), what="EXITED")
        assert env_of(tmp_path, "m", 0)["CUDA_VISIBLE_DEVICES"].startswith("MIG-")
    finally:
        agent.request_stop()
        await asyncio.wait_for(task, 10)


# ------------------------------------------------------------------------------------------------ --mig-manage

E, D = agent_pb2.GpuInfo.MIG_MODE_ENABLED, agent_pb2.GpuInfo.MIG_MODE_DISABLED


def mode_of(fake: FakeNodeService, gpu: int):
    hb = fake.last_heartbeat
    return next((m for m in hb.mig_modes if m.gpu == gpu), None) if hb is not None else None


def switch(fake: FakeNodeService, revision: int, gpu: int, enable: bool) -> None:
    fake.push(
        agent_pb2.Assignment(
            revision=revision, set_mig_mode=agent_pb2.SetMigMode(gpu=gpu, enable=enable, reason="test")
        )
    )


async def test_mig_manage_switches_idle_gpus_and_reports_through_heartbeats(fake, agents, tmp_path):
    a = agents(fake.port, mig="none", mig_manage=True)
    await until(lambda: fake.registrations and fake.registrations[-1].mig_manage, what="registered")
    await until(lambda: mode_of(fake, 2) is not None, what="a heartbeat with MIG modes")
    assert (mode_of(fake, 2).current, mode_of(fake, 2).pending, mode_of(fake, 2).switching) == (D, D, False)
    # a whole-GPU rank on GPU 1: its mode cannot change
    launch(fake, 1, "whole", 1, [{"rank": 0, "gpus": [1], "env": rank_env(tmp_path, "whole", 0, SLEEP=60)}])
    await until(lambda: fake.report("whole", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    switch(fake, 2, 2, True)
    switch(fake, 3, 1, True)
    await until(lambda: mode_of(fake, 2).current == E and mode_of(fake, 1).error, what="switch reported")
    assert "in use by rank whole/1/0" in mode_of(fake, 1).error and mode_of(fake, 1).current == D
    assert ("set_mig_mode", 2, 1) in a.sim.host.calls and ("set_mig_mode", 1, 1) not in a.sim.host.calls
    # the GPU now serves MIG ranks
    launch(
        fake, 4, "m", 1, [{"rank": 0, "gpus": [2], "env": rank_env(tmp_path, "m", 0), "slices": [(2, "1g.10gb", 0, 1)]}]
    )
    await until(lambda: fake.report("m", 0, S.RANK_STATE_EXITED), what="MIG rank EXITED")
    await until(lambda: a.mig.backend.list_instances(2) == [], what="its instance destroyed")
    # back off again; a re-registration carries the mode NVML has now
    switch(fake, 5, 2, False)
    await until(lambda: mode_of(fake, 2).current == D, what="switched back")
    assert a._current_topology().gpus[2].mig_mode == D


async def test_mig_manage_leaves_foreign_instances_and_waits_for_a_reset(fake, agents, tmp_path):
    a = agents(fake.port, mig="0", mig_manage=True)
    a.sim.host.add_mig_instance(0, "3g.40gb", 0)  # an administrator's
    switch(fake, 1, 0, False)
    await until(lambda: mode_of(fake, 0) is not None and mode_of(fake, 0).error, what="refusal reported")
    assert "did not create" in mode_of(fake, 0).error and mode_of(fake, 0).current == E
    a.sim.host.mig_reset_required = True  # a pass-through VM: NVML cannot reset the GPU itself
    switch(fake, 2, 3, True)
    await until(lambda: mode_of(fake, 3).pending == E, what="pending reported")
    assert (mode_of(fake, 3).current, mode_of(fake, 3).switching, mode_of(fake, 3).error) == (D, True, "")
    a.sim.host.reset_gpu(3)  # the operator's `nvidia-smi -r -i 3`
    await until(lambda: mode_of(fake, 3).current == E and not mode_of(fake, 3).switching, what="done after reset")


async def test_without_mig_manage_a_switch_is_refused(fake, agents, tmp_path):
    a = agents(fake.port, mig="none")
    switch(fake, 1, 2, True)
    await until(lambda: 1 in fake.acks, what="ack")
    await until(lambda: 2 in a._mig_switch_errors, what="the switch refused")
    assert a._mig_switch_errors == {2: "this agent was not started with --mig-manage"}
    assert ("set_mig_mode", 2, 1) not in a.sim.host.calls
    beats = fake.heartbeats
    await until(lambda: fake.heartbeats > beats, what="a heartbeat after the refusal")
    assert not fake.last_heartbeat.mig_modes  # only --mig-manage agents send them


def test_switching_to_the_current_mode_cancels_a_pending_one():
    m = manager(h100_backend(mig=[False] * 8))
    host = m.backend.host
    host.mig_reset_required = True
    assert m.switch_mode(2, True, {}) == (0, 1)  # pending: waits for a reset
    assert m.switch_mode(2, False, {}) == (0, 0)  # asked back before the reset: nothing pending any more
    host.reset_gpu(2)
    assert host.gpus[2].mig_mode == [0, 0]
