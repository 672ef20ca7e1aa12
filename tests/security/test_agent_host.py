"""What a job can reach on an agent host, and what the agent's containment keeps it from (issue 31).

Threats (who: a job's rank code, or a tenant submitting it; what they control: their processes, their files, the
environment they were given, the device nodes they can open):
- T1 another job's GPU or MIG instance: opening other /dev/nvidia<N> or another instance's /dev/nvidia-caps/
  nvidia-cap<minor> (capabilities are per MIG instance: holding one opens that instance).
- T2 the agent process: killing it or its helpers through the attempt's own kill, or sharing its cgroup.
- T3 host memory beyond the job's limit.
- T4 fork bombs (the host's pid space).
- T5 escaping the container by setsid/double-fork, to outlive the attempt and keep a GPU busy.

The cgroup v2 checks run on the model of the kernel's rules (tests/helpers/fake_cgroup2.py; this host's unified
mount has no controllers); real cgroup v1 checks of the same limits are in tests/unit/test_containment.py
(test_v1_memory_limit_oom_kills_and_counts, test_v1_pids_limit_refuses_forks, test_v1_cpu_quota_and_device_rules).
Not covered (see containment.V2_DEVICES_NOT_ENFORCED): device rules on a pure cgroup v2 host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.fake_cgroup2 import FakeCgroup2

from services.node_agent.containment import MARKER_ENV, Limits, detect, device_rules, nvidia_cap_minors

D = "/system.slice/phalanx-agent.service"
SYSTEMD = ("cpu", "memory", "pids")


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A delegated v2 host modelled, the agent's containment on it, and an attempt's group (1 GiB, 64 pids)."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    fs = FakeCgroup2(tmp_path / "unified", SYSTEMD, inherit_by_marker=True)
    fs.nodes["/"].subtree = list(SYSTEMD)
    fs.make("/system.slice", enable=SYSTEMD)
    fs.make(D)
    fs.place(D, os.getpid())
    (tmp_path / "mounts").write_text(f"cgroup2 {fs.mount} cgroup2 rw 0 0\n")
    (tmp_path / "cgroup").write_text(f"0::{D}\n")
    c = detect(
        node_name="n", root=str(tmp_path), mounts=str(tmp_path / "mounts"), self_cgroup=str(tmp_path / "cgroup"), fs=fs
    )
    assert c.kind == "cgroup-v2", c.reason
    group = c.create("job-a1", Limits(memory_bytes=2**30, pids_max=64, gpu_minors=(0,)))
    children: list[subprocess.Popen] = []
    yield fs, c, group, children
    for p in children:
        p.kill()
        p.wait()


def test_t1_a_job_may_open_only_its_own_gpus_and_mig_capabilities(tmp_path):
    (tmp_path / "devices").write_text("Character devices:\n195 nvidia-frontend\n235 nvidia-caps\n236 nvidia-uvm\n")
    (tmp_path / "mig-minors").write_text(
        "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\n"
    )
    mine = nvidia_cap_minors([(0, 1, 0)], str(tmp_path / "mig-minors"))
    rules = device_rules(Limits(gpu_minors=(0,), cap_minors=mine), str(tmp_path / "devices"))
    caps = {r for r in rules if r.startswith("c 235:")}
    assert caps == {"c 235:12 rwm", "c 235:13 rwm"}  # not the other instance's 21/22, nor config/monitor
    assert not [r for r in rules if r.startswith("c 195:") and r.split()[1] not in ("195:0", "195:255", "195:254")]


def _seen(group, pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while pid not in group.pids():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def test_t2_the_agent_is_outside_the_attempts_cgroup_and_its_kill(host):
    fs, c, group, children = host
    assert fs.cgroup_of(os.getpid()) == f"{D}/agent"  # not in D (shared with nobody), not in the attempt's cgroup
    rank = subprocess.Popen(["sleep", "300"], env={**os.environ, **group.env()})
    children.append(rank)
    # The model sees a rank by the marker in /proc/<pid>/environ, and the kernel fills that in only after the exec
    # has closed the pipe Popen waits on: under load a read right after Popen can find it empty. Wait for it.
    assert _seen(group, rank.pid) and os.getpid() not in group.pids()
    group.kill()
    assert rank.wait(timeout=5) == -signal.SIGKILL
    assert fs.cgroup_of(os.getpid()) == f"{D}/agent"  # the agent survived the attempt's cgroup.kill


def test_t3_and_t4_memory_and_pids_limits_are_written_to_the_attempts_cgroup(host):
    fs, c, group, _ = host
    d = Path(group.join_files()[0]).parent
    assert fs.read(d / "memory.max") == str(2**30) and fs.read(d / "pids.max") == "64"
    assert group.memory_limit == 2**30


def test_t5_a_setsid_double_forked_daemon_is_still_in_the_group_and_killed(host):
    fs, c, group, children = host
    sh = subprocess.Popen(["sh", "-c", "(setsid sleep 300 &); sleep 300 & wait"], env={**os.environ, **group.env()})
    children.append(sh)

    deadline = time.monotonic() + 5
    while len(group.pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    members = group.pids()
    assert len(members) == 3 and any(os.getsid(p) == p for p in members if p != sh.pid)
    group.kill()
    deadline = time.monotonic() + 5
    while not group.empty() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert group.empty() and not any(MARKER_ENV in (p and "") for p in members)
