"""Host CPUs and memory as the agent registers them: the shipped profiles' `host_cpus` / `host_memory`, the real
host's CPU affinity and MemTotal (capped by the agent's own cgroup), and the --host-cpus / --host-memory overrides."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from phalanx.core.resources import parse_size
from phalanx.profiles import affinity_cpus, list_profiles, load_profile, parse_cpu_list, parse_profile
from services.node_agent import host_resources
from services.node_agent.host_resources import HostResources, profile_host_resources, real_host_resources, resolve
from services.node_agent.main import build_parser, host_overrides, host_profile
from services.node_agent.state import AgentState

T = 2**40
G = 2**30

# profile -> (CPUs in the union of its CPU Affinity column, host_cpus, host_memory)
EXPECTED = {
    "dgx-h100": (192, 192, 2 * T),  # 0-47,96-143 + 48-95,144-191
    "hgx-h200": (192, 192, 2 * T),
    "dgx-a100": (128, 256, 1 * T),  # the matrix lists the GPUs' 4 NUMA nodes of 8; the header says 2 x 64 cores x 2
    "gb200-nvl72-tray": (144, 144, 960 * G),  # 2 Grace x 72 cores, 2 x 480 GB LPDDR5X
    "gb200-nvl72": (144, 144, 960 * G),  # the tray's, through `# base:`
    "pcie-2numa": (128, 128, 512 * G),
}


def test_every_shipped_profile_has_its_expected_host_resources():
    assert set(list_profiles()) == set(EXPECTED), "a new profile needs its host resources checked here"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_profile_host_cpus_and_memory(name):
    union, cpus, memory = EXPECTED[name]
    p = load_profile(name)
    assert len(affinity_cpus(p.dump)) == union
    assert p.host_cpus == cpus
    assert p.host_memory == memory
    if name != "gb200-nvl72":  # its headers come from its base
        assert "# host_memory:" in p.text
    assert profile_host_resources(p) == HostResources(float(cpus), memory)


def test_the_host_cpus_header_wins_over_the_affinity_column():
    text = load_profile("dgx-h100").text.replace("# host_memory: 2T", "# host_memory: 1536G\n# host_cpus: 112")
    p = parse_profile(text, "custom")
    assert (p.host_cpus, p.host_memory) == (112, 1536 * G)
    assert len(affinity_cpus(p.dump)) == 192


def test_a_bare_dump_says_no_memory_and_its_affinity_cpus():
    body = "\n".join(line for line in load_profile("pcie-2numa").text.splitlines() if not line.startswith("#"))
    p = parse_profile(body, "bare")
    assert p.host_memory == 0 and p.host_cpus == 128
    real = HostResources(7.0, 3 * G)
    assert profile_host_resources(p, real) == HostResources(128.0, 3 * G)  # what it does not say: the real host's


@pytest.mark.parametrize(
    "header", ["# host_memory: lots", "# host_memory: 0", "# host_cpus: 0", "# host_cpus: 1.5", "# host_cpus: -4"]
)
def test_a_malformed_host_header_is_refused(header):
    text = load_profile("dgx-h100").text.replace("# host_memory: 2T", header)
    with pytest.raises(ValueError, match="bad host_"):
        parse_profile(text, "bad")


def test_cpu_lists():
    assert parse_cpu_list("0-47,96-143") == set(range(48)) | set(range(96, 144))
    assert parse_cpu_list("3") == {3} and parse_cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == set()
    for bad in ("a-b", "4-2", "1-", "0,x"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


# --- the real host -------------------------------------------------------------------------------------------------


def test_a_real_host_reports_its_cpu_affinity_and_memtotal():
    found = real_host_resources()
    affinity = len(os.sched_getaffinity(0))
    quota = host_resources.cgroup_cpu_limit()
    assert found.cpus == (affinity if quota is None or quota >= affinity else round(quota, 3))
    memtotal = next(
        int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines() if "MemTotal:" in line
    )
    limit = host_resources.cgroup_memory_limit()
    assert found.memory_bytes == (memtotal if limit is None or limit >= memtotal else limit)
    assert found.cpus >= 1 and found.memory_bytes > 64 * 2**20
    assert resolve(None) == found  # no simulated profile, no override: the real host


def _fake_host(tmp: Path, *, v1: dict[str, dict[str, str]] | None = None, v2: dict[str, str] | None = None) -> dict:
    """A fake /proc/meminfo, /proc/self/mounts, /proc/self/cgroup and cgroup tree; returns real_host_resources's
    keyword arguments. v1: controller -> {file relative to the mount: content}; v2: {file: content} in the
    unified hierarchy. The process's cgroup is /a/b in every hierarchy."""
    root = tmp / "cgroup"
    mounts, own = [], []
    for i, (controller, files) in enumerate((v1 or {}).items()):
        mounts.append(f"cgroup {root}/{controller} cgroup rw,relatime,{controller} 0 0")
        own.append(f"{i + 1}:{controller}:/a/b")
        for rel, content in files.items():
            (root / controller / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / controller / rel).write_text(content)
    if v2 is not None:
        mounts.append(f"cgroup2 {root}/unified cgroup2 rw,relatime 0 0")
        own.append("0::/a/b")
        for rel, content in v2.items():
            (root / "unified" / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / "unified" / rel).write_text(content)
    (tmp / "mounts").write_text("\n".join(mounts) + "\n")
    (tmp / "cgroup.txt").write_text("\n".join(own) + "\n")
    (tmp / "meminfo").write_text("MemTotal:       16384000 kB\nMemFree:         1000 kB\n")
    return dict(
        meminfo=tmp / "meminfo", root=str(root), mounts=str(tmp / "mounts"), self_cgroup=str(tmp / "cgroup.txt")
    )


def test_the_agents_own_v1_cgroup_caps_cpus_and_memory(tmp_path):
    paths = _fake_host(
        tmp_path,
        v1={
            "cpu": {
                "cpu.cfs_quota_us": "-1",
                "cpu.cfs_period_us": "100000",
                "a/cpu.cfs_quota_us": "150000",  # an ancestor's quota binds its descendants
                "a/cpu.cfs_period_us": "100000",
                "a/b/cpu.cfs_quota_us": "-1",
                "a/b/cpu.cfs_period_us": "100000",
            },
            "memory": {
                "memory.limit_in_bytes": "9223372036854771712",  # unlimited
                "a/b/memory.limit_in_bytes": str(4 * G),
            },
        },
    )
    found = real_host_resources(**paths)
    assert found.memory_bytes == 4 * G  # below MemTotal (16384000 kB)
    assert found.cpus == min(1.5, len(os.sched_getaffinity(0)))


def test_a_cgroup_limit_above_the_host_does_not_raise_it(tmp_path):
    paths = _fake_host(tmp_path, v1={"memory": {"a/b/memory.limit_in_bytes": str(64 * G)}})
    found = real_host_resources(**paths)
    assert found.memory_bytes == 16384000 * 1024 and found.cpus == len(os.sched_getaffinity(0))


def test_the_agents_own_v2_cgroup_caps_cpus_and_memory(tmp_path):
    paths = _fake_host(
        tmp_path, v2={"a/cpu.max": "max 100000", "a/b/cpu.max": "50000 100000", "a/b/memory.max": str(2 * G)}
    )
    found = real_host_resources(**paths)
    assert found.memory_bytes == 2 * G and found.cpus == 0.5


# --- overrides -----------------------------------------------------------------------------------------------------


def test_overrides_win():
    h100 = load_profile("dgx-h100")
    assert resolve(h100) == HostResources(192.0, 2 * T)
    assert resolve(h100, 12.0, None) == HostResources(12.0, 2 * T)
    assert resolve(h100, None, 64 * G) == HostResources(192.0, 64 * G)
    assert resolve(None, 3.5, 8 * G) == HostResources(3.5, 8 * G)


def test_the_host_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("PHALANX_HOST_CPUS", raising=False)
    monkeypatch.delenv("PHALANX_HOST_MEMORY", raising=False)
    args = build_parser().parse_args(["--simulate", "hgx-h200", "--host-cpus", "24", "--host-memory", "256G"])
    assert host_overrides(args) == (24.0, 256 * G)
    assert host_profile(args).name == "hgx-h200"
    assert resolve(host_profile(args), *host_overrides(args)) == HostResources(24.0, 256 * G)
    assert host_overrides(build_parser().parse_args([])) == (None, None)
    for flag, value in (("--host-cpus", "0"), ("--host-cpus", "many"), ("--host-memory", "12 apples")):
        with pytest.raises(ValueError, match=flag):
            host_overrides(build_parser().parse_args([flag, value]))
    monkeypatch.setenv("PHALANX_HOST_MEMORY", "1T")
    assert host_overrides(build_parser().parse_args([])) == (None, parse_size("1T"))


def test_a_simulate_from_file_takes_its_headers(tmp_path):
    dump = tmp_path / "mybox.txt"
    dump.write_text(load_profile("pcie-2numa").text.replace("# host_memory: 512G", "# host_memory: 384G"))
    args = build_parser().parse_args(["--simulate-from", str(dump)])
    assert resolve(host_profile(args)) == HostResources(128.0, 384 * G)


# --- the agent's state file ----------------------------------------------------------------------------------------


def test_an_older_state_file_loads_with_no_reservations(tmp_path):
    path = tmp_path / "state.json"
    rank = {"job_id": "j", "attempt": 1, "rank": 0, "gpus": [0], "state": "running", "wrapper_pid": 1}
    path.write_text(json.dumps({"version": 1, "node_name": "n", "ranks": {"j/1/0": rank}}))
    st = AgentState.load(path)
    rec = st.ranks["j/1/0"]
    assert (rec.cpus, rec.memory_bytes) == (0.0, 0) and st.oom_seen == {}
    rec.cpus, rec.memory_bytes = 0.5, 64 * 2**20
    st.oom_seen["j/1"] = 1
    st.save()
    again = AgentState.load(path)
    assert (again.ranks["j/1/0"].cpus, again.ranks["j/1/0"].memory_bytes) == (0.5, 64 * 2**20)
    assert again.oom_seen == {"j/1": 1}
