"""Hosts that cross a real network (issue 19): the scheduler and each agent in a network namespace of its own,
addresses from 198.18.0.0/15 on veths into a bridge. MASTER_ADDR is rank 0's host's interface address, each agent
finds its --address from the route to the scheduler, and a partition (a link taken down) makes the cut-off agent
fence itself: its ranks are gone before the scheduler's lease on its node runs out, so the gang never runs twice.
"""

from __future__ import annotations

import getpass
import json
import subprocess
import sys
import time

import pytest
from helpers import netns
from helpers.procs import ROOT, ServiceProcess
from helpers.required import needs

from db.migrate import upgrade
from phalanx.client import Client, JobState
from services.node_agent import launcher

pytestmark = [pytest.mark.slow, needs("netns", netns.unavailable())]

LEASE_S = 4.0
KILL_GRACE_S = 0.5
# Each rank writes its environment and pid (whole: temp file, then rename), then runs until stopped.
RANK = (
    "import json, os, time\n"
    "d = os.environ['OUT_DIR']\n"
    "p = os.path.join(d, f\"{os.environ['PHALANX_ATTEMPT']}-{os.environ['RANK']}.json\")\n"
    "json.dump({'env': dict(os.environ), 'pid': os.getpid()}, open(p + '.part', 'w'))\n"
    "os.replace(p + '.part', p)\n"
    "time.sleep(600)\n"
)


def wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_two_hosts_get_real_addresses_and_a_partitioned_host_fences_itself(tmp_path):
    tmp_path.chmod(0o755)
    net = netns.Network()
    procs: list[subprocess.Popen] = []
    scheduler = None
    try:
        sched_addr = net.add_host("sched")
        hosts = {name: net.add_host(name) for name in ("n1", "n2")}
        net.join_from_root()
        upgrade(f"sqlite:///{tmp_path / 'ledger.db'}")
        scheduler = ServiceProcess(
            "services.scheduler.main",
            ["--db", f"sqlite:///{tmp_path / 'ledger.db'}", "--listen", f"{sched_addr}:7070"]
            + ["--lease-timeout", str(LEASE_S), "--heartbeat-interval", "0.3", "--retry-backoff", "0.2"],
            tmp_path / "scheduler.log",
            prefix=net.command("sched", []),
        )
        for name in hosts:
            log = open(tmp_path / f"agent-{name}.log", "ab")
            argv = [sys.executable, "-m", "services.node_agent.main", "--scheduler", f"{sched_addr}:7070"]
            argv += ["--node-name", name, "--simulate", "dgx-h100", "--state-dir", str(tmp_path / name)]
            argv += ["--kill-grace", str(KILL_GRACE_S), "--no-health"]  # no --address: found from the route
            argv += ["--run-as", getpass.getuser()]  # the ranks are this interpreter
            procs.append(subprocess.Popen(net.command(name, argv), stdout=log, stderr=log, cwd=str(ROOT)))
        out = tmp_path / "out"
        out.mkdir()
        with Client(f"{sched_addr}:7070", timeout=10) as client:
            nodes = wait(lambda: (n := client.nodes()) and len(n) == 2 and n, 30, "both agents registered")
            assert {n.name: n.address for n in nodes} == hosts  # each agent's address is its interface's
            assert all(n.containment in ("cgroup-v1", "cgroup-v2", "process-group") for n in nodes)
            job = client.submit(
                "two-hosts", 2, 8, [sys.executable, "-c", RANK], env={"OUT_DIR": str(out)}, max_restarts=3
            )
            ranks = wait(lambda: len(list(out.glob("1-*.json"))) == 16 and list(out.glob("1-*.json")), 30, "16 ranks")
            seen = [json.loads(p.read_text()) for p in ranks]
            rank0 = next(r for r in seen if r["env"]["RANK"] == "0")
            # MASTER_ADDR is the interface address of rank 0's host, reachable from the other host.
            assert rank0["env"]["MASTER_ADDR"] == hosts[rank0["env"]["PHALANX_NODE"]]
            assert {r["env"]["MASTER_ADDR"] for r in seen} == {rank0["env"]["MASTER_ADDR"]}
            on_n2 = [r["pid"] for r in seen if r["env"]["PHALANX_NODE"] == "n2"]
            assert len(on_n2) == 8

            net.set_link("n2", up=False)  # a partition: n2 cannot reach the scheduler, nor n1
            cut = time.monotonic()
            wait(lambda: not any(launcher.pid_alive(p) for p in on_n2), LEASE_S + 5, "n2's ranks fenced")
            fenced_after = time.monotonic() - cut
            assert fenced_after < LEASE_S, f"n2's ranks outlived the node lease ({fenced_after:.1f}s)"
            assert "self_fenced" in (tmp_path / "agent-n2.log").read_text()
            lost = wait(lambda: {n.name: n.state for n in client.nodes()}.get("n2") == "LOST", LEASE_S + 10, "n2 LOST")
            assert lost

            net.set_link("n2", up=True)  # healed: n2 registers again and the gang runs as its next attempt
            wait(lambda: {n.name: n.state for n in client.nodes()}.get("n2") == "READY", 20, "n2 READY again")
            wait(lambda: len(list(out.glob("2-*.json"))) == 16, 40, "the gang's second attempt on both hosts")
            got = client.get_job(job.id)
            assert got.state is JobState.RUNNING and got.attempt == 2
            assert not any(launcher.pid_alive(p) for p in on_n2)  # the first attempt never ran twice
            client.cancel(job.id)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        if scheduler is not None:
            scheduler.terminate()
        net.close()
