"""services/node_agent/containment/ (the package): process containers for a job attempt's ranks.

The cgroup v1 tests use the real hierarchies under /sys/fs/cgroup (root only; they skip elsewhere), each test
under a parent of its own (the agent's own cgroup per hierarchy + "/phalanx-test-<pid>-<random>"), which the
fixture empties and removes even when the test fails. cgroup v2 is tested against a model of the kernel's rules
(tests/helpers/fake_cgroup2.py; see test_containment_v2.py), and detection against fake mounts and /proc/self/cgroup
files.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers.fake_cgroup2 import FakeCgroup2
from structlog.testing import capture_logs

from services.node_agent import containment
from services.node_agent.containment import (
    MARKER_ENV,
    ContainmentError,
    Limits,
    cgroup_v1,
    cgroup_v2,
    detect,
    format_size,
    parse_size,
    process_group,
)

CGROUP = Path("/sys/fs/cgroup")
MiB = 2**20

# Runs in the child: write its own pid into each join file, then exec the command (as the agent's rank wrapper).
JOIN = """
import os, sys
for path in filter(None, sys.argv[1].split(os.pathsep)):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
os.execvp(sys.argv[2], sys.argv[2:])
"""
# sh, a background sleep, and a setsid'ed daemon orphaned by a double fork (a session of its own).
DAEMONIZING = "(setsid sleep 300 &); sleep 300 & wait"


def _v1_missing() -> str | None:
    if os.geteuid() != 0:
        return "creating cgroups needs root"
    for c in ("memory", "pids", "freezer"):
        if not (CGROUP / c / "cgroup.procs").exists():
            return f"no cgroup v1 {c} hierarchy at {CGROUP / c}"
    return None


def _not_alive(pid: int) -> bool:
    """Gone from /proc, or a zombie (exited; this host's init reaps orphans lazily)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


def _wait_until(cond, timeout: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def _daemonized(group, sh: subprocess.Popen) -> set[int]:
    """Wait until the group holds sh, its sleep and the daemon (a session leader of its own); their pids."""

    def ready() -> set[int] | None:
        pids = group.pids()
        try:
            daemons = [p for p in pids if p != sh.pid and os.getsid(p) == p]
        except ProcessLookupError:  # the subshell that forked the daemon has just exited
            return None
        return pids if len(pids) == 3 and len(daemons) == 1 else None

    return _wait_until(ready, what="sh, its sleep and the setsid daemon")


def _scrub(dirs) -> None:
    """Kill everything in these cgroup directories (thawing them), then remove them bottom-up."""
    dirs = [d for d in dict.fromkeys(dirs) if d.is_dir()]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pids: set[int] = set()
        for top in dirs:
            for here, _, _ in os.walk(top):
                procs = Path(here, "cgroup.procs")
                pids |= {int(p) for p in procs.read_text().split()} if procs.exists() else set()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for top in dirs:
            for here, _, _ in os.walk(top):
                state = Path(here, "freezer.state")
                if state.exists():
                    state.write_text("THAWED")
        if not pids:
            break
        time.sleep(0.02)
    for top in dirs:
        for here, _, _ in os.walk(top, topdown=False):
            for _ in range(100):
                try:
                    os.rmdir(here)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    time.sleep(0.02)


@pytest.fixture
def spawn():
    """start(group, *argv, **popen_kw): a child that joins the group's cgroups, carries its marker and execs argv."""
    children: list[subprocess.Popen] = []

    def start(group, *argv: str, **kw) -> subprocess.Popen:
        env = {**os.environ, **group.env()}
        p = subprocess.Popen([sys.executable, "-c", JOIN, os.pathsep.join(group.join_files()), *argv], env=env, **kw)
        children.append(p)
        return p

    yield start
    for p in children:
        p.kill()
        p.wait(timeout=5)


def _test_node() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def v1(spawn):
    """A cgroup v1 containment on this host under parents of this test's own (spawn's children reaped after)."""
    missing = _v1_missing()
    if missing:
        pytest.skip(missing)
    c = detect(node_name=_test_node(), force="cgroup-v1")
    try:
        yield c
    finally:
        _scrub(c.parent_dirs().values())


# --- cgroup v1, for real ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["sigterm", "kill"])
def test_v1_group_holds_setsid_daemons_and_ending_it_leaves_nothing(v1, spawn, how):
    g = v1.create("job-abc-a1")
    assert g.kind == "cgroup-v1" and v1.names() == ["job-abc-a1"]
    assert g.join_files()[0].endswith("/job-abc-a1/cgroup.procs") and "/freezer/" in g.join_files()[0]
    assert {Path(f).parent.parent for f in g.join_files()} == set(v1.parent_dirs().values())
    assert g.env() == {MARKER_ENV: f"{v1.parent}/job-abc-a1"}

    sh = spawn(g, "sh", "-c", DAEMONIZING)
    pids = _daemonized(g, sh)
    assert sh.pid in pids
    (daemon,) = [p for p in pids if os.getsid(p) == p]
    assert os.getpgid(daemon) != os.getpgid(sh.pid)  # out of reach of killpg: only the cgroup holds it

    if how == "sigterm":
        assert g.signal(signal.SIGTERM) == 3
    else:
        g.kill()
    assert g.wait_empty(5) and g.empty()
    sh.wait(timeout=5)
    assert all(_not_alive(p) for p in pids)
    g.remove()
    assert not any(Path(f).parent.exists() for f in g.join_files())
    assert v1.names() == [] and v1.open("job-abc-a1") is None
    g.remove()  # idempotent


def test_v1_memory_limit_oom_kills_and_counts(v1, spawn):
    g = v1.create("mem", Limits(memory_bytes=64 * MiB))
    memory = g.dirs["memory"]
    assert int((memory / "memory.limit_in_bytes").read_text()) == 64 * MiB and g.memory_limit == 64 * MiB
    # Swap would let the allocation succeed past the limit: forbid it for this group.
    no_swap = False
    try:
        (memory / "memory.swappiness").write_text("0")
        no_swap = True
    except OSError:
        pass
    if (memory / "memory.memsw.limit_in_bytes").exists():
        (memory / "memory.memsw.limit_in_bytes").write_text(str(64 * MiB))
        no_swap = True
    swap_total = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("SwapTotal:"))
    if swap_total and not no_swap:
        pytest.skip("the host has swap and neither memory.swappiness nor memory.memsw can keep this group off it")

    p = spawn(g, sys.executable, "-c", "b = b'x' * (512 << 20); print('allocated 512M')", stdout=subprocess.PIPE)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL and b"allocated" not in out
    assert g.oom_kills() >= 1


def test_v1_pids_limit_refuses_forks(v1, spawn):
    g = v1.create("pids", Limits(pids_max=5))
    assert (g.dirs["pids"] / "pids.max").read_text().strip() == "5"
    forker = """
import os, time
ok = failed = 0
for _ in range(20):
    try:
        pid = os.fork()
    except OSError:
        failed += 1
        continue
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    ok += 1
print(ok, failed, flush=True)
time.sleep(60)
"""
    p = spawn(g, sys.executable, "-c", forker, stdout=subprocess.PIPE, text=True)
    ok, failed = map(int, p.stdout.readline().split())
    assert ok + failed == 20 and ok <= 4 and failed >= 16
    for _ in range(10):
        assert len(g.pids()) <= 5
        time.sleep(0.01)
    g.kill()
    assert g.wait_empty(5)


def test_v1_cpu_quota_and_device_rules(v1, spawn, tmp_path):
    proc_devices = tmp_path / "devices"
    proc_devices.write_text(
        "Character devices:\n  1 mem\n195 nvidia\n508 nvidia-caps\n509 nvidia-uvm\n\nBlock devices:\n"
    )
    c = cgroup_v1(v1.mounts, v1.parents, proc_devices=str(proc_devices))  # the same parents as the fixture's
    assert c.devices_enforced is ("devices" in v1.mounts) and c.limits_enforced
    g = c.create("limits", Limits(cpus=0.5, gpu_minors=(3,), cap_minors=(21, 22)))
    if "cpu" in g.dirs:
        assert (g.dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert (g.dirs["cpu"] / "cpu.cfs_period_us").read_text().strip() == "100000"
    if "devices" not in g.dirs:
        pytest.skip("no cgroup v1 devices hierarchy on this host")
    rules = (g.dirs["devices"] / "devices.list").read_text().splitlines()
    assert {"c 195:3 rwm", "c 195:255 rwm", "c 1:3 rwm", "c 136:* rwm", "c 509:* rwm"} <= set(rules)
    # Only the job's own MIG capabilities (nvidia-caps minors), never all of them.
    assert {r for r in rules if r.startswith("c 508:")} == {"c 508:21 rwm", "c 508:22 rwm"}
    assert not any(r.startswith(("c 195:2 ", "a ")) for r in rules)

    # Inside the group /dev/null opens; a device outside the list (one root can open from here) does not.
    outside = next((d for d in ("/dev/kmsg", "/dev/mem", "/dev/tty1") if _opens(d)), "")
    check = (
        "import os, sys\nos.close(os.open('/dev/null', os.O_WRONLY))\nprint('null ok')\n"
        "try:\n    os.close(os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)); print('other opened')\n"
        "except PermissionError:\n    print('other denied')\n"
    )
    p = spawn(g, sys.executable, "-c", check, outside or "/dev/null", stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=10)
    assert out.split("\n")[0] == "null ok"
    if outside:
        assert "other denied" in out, out


def _opens(device: str) -> bool:
    try:
        os.close(os.open(device, os.O_RDONLY | os.O_NONBLOCK))
        return True
    except OSError:
        return False


def test_v1_kill_is_quick_when_sigterm_is_ignored(v1, spawn):
    g = v1.create("stubborn")
    stubborn = "trap '' TERM; (setsid sh -c 'while :; do sleep 1; done' &); while :; do sleep 1; done"
    spawn(g, "sh", "-c", stubborn)
    _wait_until(lambda: len(g.pids()) >= 3, what="the stubborn processes")
    g.signal(signal.SIGTERM)
    time.sleep(0.1)
    assert len(g.pids()) >= 3  # ignored
    start = time.monotonic()
    g.kill()
    assert g.wait_empty(2)
    assert time.monotonic() - start < 2
    assert (g.dirs["freezer"] / "freezer.state").read_text().strip() == "THAWED"


def test_v1_remove_refuses_a_live_group_and_a_new_agent_finds_it(v1, spawn):
    g = v1.create("job-x-a2", Limits(memory_bytes=64 * MiB, pids_max=50))
    sleep = spawn(g, "sleep", "300")
    _wait_until(lambda: sleep.pid in g.pids(), what="the sleep in the group")
    with pytest.raises(ContainmentError, match="still has processes"):
        g.remove()
    assert all(Path(f).exists() for f in g.join_files())

    again = detect(parent=None, node_name=v1.parent.rsplit("phalanx-", 1)[1], force="cgroup-v1")  # a restarted agent
    assert again.parent_dirs() == v1.parent_dirs()
    assert again.names() == ["job-x-a2"] and again.open("nope") is None
    found = again.open("job-x-a2")
    assert found is not None and found.pids() == {sleep.pid} and found.memory_limit == 64 * MiB
    assert found.join_files() == g.join_files() and found.env() == g.env()

    # create() on an existing group applies the (now unlimited) limits again.
    reused = again.create("job-x-a2")
    assert int((reused.dirs["memory"] / "memory.limit_in_bytes").read_text()) > 2**62
    assert (reused.dirs["pids"] / "pids.max").read_text().strip() == "max"
    reused.kill()
    assert reused.wait_empty(5)
    reused.remove()
    assert again.open("job-x-a2") is None


def test_detect_on_this_host_picks_cgroup_v1():
    missing = _v1_missing()
    if missing:
        pytest.skip(missing)
    node = _test_node()
    c = detect(node_name=node)
    try:
        assert c.kind == "cgroup-v1", c.reason
        assert c.reason.startswith("cgroup v1 hierarchies freezer, memory, pids") and "under /sys/fs/cgroup" in c.reason
        own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
        assert c.parents["memory"] == os.path.join(own["memory"], f"phalanx-{node}")
        assert all(d.is_dir() for d in c.parent_dirs().values())
        assert not any(p.name.startswith("probe-") for d in c.parent_dirs().values() for p in d.iterdir())
    finally:
        if c.kind == "cgroup-v1":
            _scrub(c.parent_dirs().values())


# --- cgroup v2, against a model of the kernel's rules (tests/helpers/fake_cgroup2.py; more in test_containment_v2) --


def _fake_v2(tmp_path: Path, **kw) -> FakeCgroup2:
    fs = FakeCgroup2(tmp_path / "cg2", ("cpuset", "cpu", "io", "memory", "pids"), **kw)
    fs.make("/phalanx.slice/agent-n1")
    return fs


def test_v2_pids_kill_oom_and_remove_on_the_model(tmp_path):
    fs = _fake_v2(tmp_path)
    c = cgroup_v2(str(fs.mount), "/phalanx.slice/agent-n1", fs=fs)
    assert c.kind == "cgroup-v2" and c.limits_enforced and not c.devices_enforced
    g = c.create("job-y-a1")
    cg = "/phalanx.slice/agent-n1/job-y-a1"
    assert g.env() == {MARKER_ENV: cg}
    zombie = subprocess.Popen(["sleep", "0.2"])
    live = subprocess.Popen(["sleep", "30"])
    try:
        fs.write(fs.path(cg) / "cgroup.procs", str(zombie.pid))
        fs.write(fs.path(cg) / "cgroup.procs", str(live.pid))
        _wait_until(lambda: _not_alive(zombie.pid), what="an unreaped child")
        assert g.pids() == {live.pid} and not g.empty()  # a zombie is no member

        g.kill()
        assert fs.nodes[cg].kills == 1 and live.wait(timeout=5) == -signal.SIGKILL
        assert g.empty()

        fs.nodes[cg].files["memory.events"] = "low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n"
        assert g.oom_kills() == 2

        fs.place(cg, os.getppid())  # someone alive
        with pytest.raises(ContainmentError):
            g.remove()
        fs.place("/", os.getppid())
        g.remove()
        assert cg not in fs.nodes and c.names() == []
        g.remove()
    finally:
        zombie.wait()
        live.kill()
        live.wait()


def test_v2_kill_without_cgroup_kill_or_freeze_loops_sigkill(tmp_path):
    fs = _fake_v2(tmp_path, kill_file=False, freeze_file=False)
    g = cgroup_v2(str(fs.mount), "/phalanx.slice/agent-n1", fs=fs).create("job-w-a1")
    live = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        for p in live:
            fs.write(Path(g.join_files()[0]), str(p.pid))
        g.kill()
        assert [p.wait(timeout=5) for p in live] == [-signal.SIGKILL] * 2 and g.empty()
    finally:
        for p in live:
            p.kill()
            p.wait()


def test_v2_kill_goes_on_when_the_freeze_does_not_complete(tmp_path, monkeypatch):
    monkeypatch.setattr(containment.base, "FREEZE_WAIT_S", 0.05)  # a task stuck in the kernel would hold it ~1 s
    fs = _fake_v2(tmp_path, kill_file=False)
    fs.freeze_completes = False
    g = cgroup_v2(str(fs.mount), "/phalanx.slice/agent-n1", fs=fs).create("job-z-a1")
    sleep = subprocess.Popen(["sleep", "30"])
    try:
        fs.write(Path(g.join_files()[0]), str(sleep.pid))
        with capture_logs() as logs:
            g.kill()  # the model never reports "frozen 1"
        assert sleep.wait(timeout=5) == -signal.SIGKILL
        assert fs.read(fs.path("/phalanx.slice/agent-n1/job-z-a1") / "cgroup.freeze") == "0"
        assert [entry["event"] for entry in logs] == ["containment.freeze_timeout"]
        assert logs[0]["log_level"] == "warning" and logs[0]["group"] == "/phalanx.slice/agent-n1/job-z-a1"
    finally:
        sleep.kill()
        sleep.wait()


# --- detect(), against fake mounts -----------------------------------------------------------------------------------


def _fake_host(tmp_path: Path, *, v2_controllers: str = "hugetlb", memory_cgroup: str = "/process_api/xyz"):
    tmp_path.mkdir(exist_ok=True)
    lines = [f"cgroup2 {tmp_path}/unified cgroup2 rw,nosuid,nodev,noexec,relatime 0 0"]
    for mount, options in [
        ("cpu,cpuacct", "cpu,cpuacct"),
        ("memory", "memory"),
        ("pids", "pids"),
        ("freezer", "freezer"),
        ("devices", "devices"),
        ("systemd", "xattr,name=systemd"),
    ]:
        (tmp_path / mount).mkdir()
        lines.append(f"cgroup {tmp_path}/{mount} cgroup rw,nosuid,relatime,{options} 0 0")
    lines.append("proc /proc proc rw 0 0")
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text(v2_controllers + "\n")
    (tmp_path / "mounts").write_text("\n".join(lines) + "\n")
    (tmp_path / "cgroup").write_text(
        f"9:name=systemd:/\n8:pids:/user.slice/s1\n6:freezer:/\n5:devices:/\n4:memory:{memory_cgroup}\n"
        "1:cpu,cpuacct:/\n0::/system.slice/agent.service\n"
    )
    return {"root": str(tmp_path), "mounts": str(tmp_path / "mounts"), "self_cgroup": str(tmp_path / "cgroup")}


@pytest.fixture
def as_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)


def test_detect_falls_back_to_v1_when_v2_lacks_memory(tmp_path, as_root):
    c = detect(node_name="n1", **_fake_host(tmp_path))
    assert c.kind == "cgroup-v1" and c.limits_enforced and c.devices_enforced
    assert c.parents == {
        "freezer": "/phalanx-n1",
        "memory": "/process_api/xyz/phalanx-n1",
        "pids": "/user.slice/s1/phalanx-n1",
        "devices": "/phalanx-n1",
        "cpu": "/phalanx-n1",
    }
    assert c.parent == "/process_api/xyz/phalanx-n1"
    assert c.mounts["cpu"] == f"{tmp_path}/cpu,cpuacct"
    assert c.reason.startswith(f"cgroup v1 hierarchies freezer, memory, pids, devices, cpu under {tmp_path} (parents")
    assert (tmp_path / "memory/process_api/xyz/phalanx-n1").is_dir()
    assert not list(tmp_path.glob("*/**/probe-*"))

    explicit = detect("/phalanx.slice/agent-n1", node_name="n1", **_fake_host(tmp_path / "b"))
    assert set(explicit.parents.values()) == {"/phalanx.slice/agent-n1"}
    assert "(parent /phalanx.slice/agent-n1)" in explicit.reason


def test_detect_picks_v2_when_it_has_memory_and_pids(tmp_path, as_root):
    host = _fake_host(tmp_path, v2_controllers="cpu io memory pids")
    fs = FakeCgroup2(tmp_path / "unified", ("cpu", "io", "memory", "pids"))
    fs.nodes["/"].subtree = ["cpu", "io", "memory", "pids"]
    fs.make("/system.slice", enable=("cpu", "io", "memory", "pids"))
    fs.make("/system.slice/agent.service")
    c = detect(node_name="n1", fs=fs, **host)
    assert c.kind == "cgroup-v2" and c.parent == "/system.slice/agent.service/phalanx-n1"
    assert c.reason == (
        f"cgroup v2 at {tmp_path}/unified with controllers memory, pids, cpu (parent {c.parent}, delegated "
        "/system.slice/agent.service; devices by the v1 devices hierarchy)"
    )
    assert fs.is_dir(fs.path(c.parent)) and fs.subtree_control("/system.slice/agent.service")[:3] == [
        "memory",
        "pids",
        "cpu",
    ]


def test_detect_without_root_or_usable_cgroups_tracks_process_groups(tmp_path, monkeypatch):
    host = _fake_host(tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    c = detect(node_name="n1", **host)
    assert c.kind == "process-group" and not c.limits_enforced and c.parent == ""
    assert "not running as root" in c.reason

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    forced = detect(node_name="n1", force="process-group", **host)
    assert forced.kind == "process-group"
    with pytest.raises(ContainmentError, match="lacks memory and pids"):
        detect(node_name="n1", force="cgroup-v2", **host)
    with pytest.raises(ValueError):
        detect(force="cgroup-v3", **host)

    (tmp_path / "empty").write_text("")
    none = detect(node_name="n1", root=str(tmp_path), mounts=str(tmp_path / "empty"), self_cgroup=host["self_cgroup"])
    assert none.kind == "process-group" and "no cgroup v1 memory, pids, freezer hierarchy" in none.reason


def test_detect_falls_back_when_the_parent_cannot_be_made(tmp_path, as_root):
    host = _fake_host(tmp_path, memory_cgroup="/blocker/x")
    (tmp_path / "memory" / "blocker").write_text("a regular file where a cgroup directory should be")
    c = detect(node_name="n1", **host)
    assert c.kind == "process-group"
    assert "cgroup-v1 parent is not usable" in c.reason and "Not a directory" in c.reason
    assert not list(tmp_path.glob("*/**/probe-*"))
    with pytest.raises(ContainmentError, match="Not a directory"):
        detect(node_name="n1", force="cgroup-v1", **host)


# --- process groups --------------------------------------------------------------------------------------------------


def test_process_group_finds_and_kills_a_setsid_daemon_by_its_marker():
    c = process_group(node_name=_test_node())
    g = c.create("job-pg-a1")
    assert c.kind == g.kind == "process-group" and g.join_files() == [] and not c.limits_enforced
    assert g.env()[MARKER_ENV].endswith("/job-pg-a1")
    assert c.open("job-pg-a1") is None and c.names() == []
    sh = subprocess.Popen(["sh", "-c", DAEMONIZING], env={**os.environ, **g.env()}, start_new_session=True)
    try:
        pids = _daemonized(g, sh)
        assert sh.pid in pids
        assert c.names() == ["job-pg-a1"] and c.open("job-pg-a1").pids() == pids
        assert process_group(node_name="another-agent").names() == []
        with pytest.raises(ContainmentError):
            g.remove()
        g.kill()
        assert g.empty()
        sh.wait(timeout=5)
        assert all(_not_alive(p) for p in pids)
        g.remove()  # empty: nothing to do
        assert c.names() == [] and c.open("job-pg-a1") is None
    finally:
        g.kill()
        sh.kill()
        sh.wait()


def test_group_names_are_checked():
    with pytest.raises(ValueError, match="not made of"):
        process_group().create("../etc")


# --- sizes -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512M", 512 * MiB),
        ("64G", 64 * 2**30),
        ("1.5G", 1536 * MiB),
        ("100K", 100 * 1024),
        ("1T", 2**40),
        ("1048576", MiB),
        ("512MiB", 512 * MiB),
        ("512MB", 512 * MiB),
        ("512mi", 512 * MiB),
        ("4g", 4 * 2**30),
        (" 2 G ", 2 * 2**30),
        ("123B", 123),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12X", "", "M", "0", "0M", "-1G", "1.5", "1.0000001K", "1e9", "5 MiBs", "G64"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match=r"is not a size like 512M or 64G"):
        parse_size(text)


@pytest.mark.parametrize(
    "n, text",
    [(512 * MiB, "512M"), (64 * 2**30, "64G"), (1536 * MiB, "1536M"), (123, "123B"), (1024, "1K"), (2**40, "1T")],
)
def test_format_size(n, text):
    assert format_size(n) == text and parse_size(text) == n


def test_the_agents_default_address_is_the_one_that_routes_to_the_scheduler():
    from services.node_agent.main import route_address

    assert route_address("127.0.0.1:7070") == "127.0.0.1"  # loopback only for a scheduler on loopback
    assert route_address("localhost:7070,10.0.0.9:7070") == "127.0.0.1"  # the first replica's route
    assert route_address("no-such-host.invalid:7070") == "127.0.0.1"  # unresolvable: loopback, logged


def test_master_port_moves_past_the_ports_live_attempts_on_the_host_hold():
    from services.scheduler.transitions import master_port

    ports = range(30000, 30004)
    first = master_port("job-a", 1, ports)
    assert first in ports and master_port("job-a", 1, ports) == first  # stable for the attempt
    second = master_port("job-b", 1, ports, taken={first})
    assert second in ports and second != first
    assert master_port("job-c", 1, ports, taken=set(ports) - {30002}) == 30002
    with pytest.raises(ValueError, match="every port of 30000-30003 is taken"):
        master_port("job-d", 1, ports, taken=set(ports))
