"""bench/slurm_peer.py's pure parts: the slurm.conf and gres.conf it writes for several slurmd on one host, and its
readings of sinfo, squeue, sbatch, salloc and slurmctld's log. Nothing here starts Slurm."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import slurm_peer as sp

pytestmark = pytest.mark.unit


def conf_lines(text: str) -> dict[str, str]:
    """The key=value lines of a slurm.conf other than the node and partition lines."""
    out = {}
    for line in text.splitlines():
        if line.startswith(("NodeName=", "PartitionName=")):
            continue
        key, _, value = line.partition("=")
        assert key not in out, f"{key} twice"
        out[key] = value
    return out


def test_slurm_conf_gives_each_node_its_own_port_and_eight_fake_gpus():
    text = sp.slurm_conf(Path("/tmp/x"), 4, 8, 6817, [7001, 7002, 7003, 7004], Path("/tmp/x/munge/munge.socket"))
    nodes = [line for line in text.splitlines() if line.startswith("NodeName=")]
    assert [line.split()[0] for line in nodes] == ["NodeName=n1", "NodeName=n2", "NodeName=n3", "NodeName=n4"]
    for line, port in zip(nodes, (7001, 7002, 7003, 7004), strict=True):
        fields = dict(field.split("=", 1) for field in line.split())
        assert fields["Port"] == str(port)
        assert fields["NodeHostname"] == "localhost" and fields["NodeAddr"] == "127.0.0.1"
        assert fields["Gres"] == "gpu:8"
        assert int(fields["CPUs"]) >= 8  # one 1-CPU job per GPU fits
    conf = conf_lines(text)
    assert conf["GresTypes"] == "gpu"
    assert conf["SlurmctldPort"] == "6817"
    assert conf["SlurmdParameters"] == "config_overrides"  # the fake CPUs and GPUs this host lacks
    assert conf["AuthType"] == "auth/munge" and conf["AuthInfo"] == "socket=/tmp/x/munge/munge.socket"
    assert conf["CredType"] == "cred/munge"
    # Every per-node file is named by the node (%n), so the slurmd daemons do not share one.
    for key in ("SlurmdSpoolDir", "SlurmdPidFile", "SlurmdLogFile"):
        assert "%n" in conf[key] and conf[key].startswith("/tmp/x/"), key
    assert conf["StateSaveLocation"].startswith("/tmp/x/")
    assert "SchedulerParameters" not in conf  # Slurm's defaults unless asked
    assert text.endswith("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")


def test_slurm_conf_without_munge_and_with_scheduler_parameters():
    conf = conf_lines(sp.slurm_conf(Path("/d"), 2, 4, 1, [2, 3], None, "batch_sched_delay=0"))
    assert conf["AuthType"] == "auth/none" and conf["CredType"] == "cred/none"
    assert "AuthInfo" not in conf
    assert conf["SchedulerParameters"] == "batch_sched_delay=0"
    with pytest.raises(AssertionError):
        sp.slurm_conf(Path("/d"), 2, 4, 1, [2], None)  # a port per node


def test_gres_conf_names_one_fake_device_file_per_gpu():
    assert sp.gres_conf(Path("/t/dev"), 4, 8) == "NodeName=n[1-4] Name=gpu File=/t/dev/nvidia[0-7]\n"
    assert sp.node_names(3) == ["n1", "n2", "n3"]


def test_parse_sinfo_keeps_each_nodes_compact_state():
    text = "n1 idle\nn2 mix\n\nn3 idle*\nn4 drain\n"
    assert sp.parse_sinfo(text) == {"n1": "idle", "n2": "mix", "n3": "idle*", "n4": "drain"}
    assert sp.parse_sinfo("") == {}


def test_parse_squeue_reads_job_ids_and_states():
    assert sp.parse_squeue("3 R\n4 PD\n  17 CG\nJOBID ST\n\n") == {3: "R", 4: "PD", 17: "CG"}
    assert sp.parse_squeue("") == {}
    assert {"R", "CF"} == set(sp.ALLOCATED_STATES)


def test_parse_job_id_of_sbatch_parsable():
    assert sp.parse_job_id("42\n") == 42
    assert sp.parse_job_id("42;phalanxpeers\n") == 42
    for bad in ("", "sbatch: error: Batch job submission failed\n"):
        with pytest.raises(sp.SlurmError, match="no job id"):
            sp.parse_job_id(bad)


def test_granted_matches_sallocs_line():
    m = sp.GRANTED.search("salloc: Granted job allocation 1234\n")
    assert m and m.group(1) == "1234"
    assert not sp.GRANTED.search("salloc: Pending job allocation 1234\n")


LOG = """\
[2026-12-07T14:32:52.279] sched: _slurm_rpc_allocate_resources JobId=1 NodeList=n1 usec=479
[2026-12-07T14:33:26.272] _slurm_rpc_submit_batch_job: JobId=3 InitPrio=4294901757 usec=416
[2026-12-07T14:33:27.222] sched: Allocate JobId=3 NodeList=n1 #CPUs=1 Partition=main
[2026-12-07T14:33:27.224] sched: Allocate JobId=19 NodeList=n3 #CPUs=1 Partition=main
[2026-12-07T14:33:28.500] backfill: Started JobId=20 in main on n4
[2026-12-07T14:33:29.000] sched: Allocate JobId=3 NodeList=n2 #CPUs=1 Partition=main
[2026-12-07T14:33:29.100] _job_complete: JobId=19 done
"""


def test_parse_allocations_reads_slurmctlds_millisecond_timestamps():
    got = sp.parse_allocations(LOG)
    assert set(got) == {1, 3, 19, 20}  # a submit or a completion is not an allocation

    def at(stamp: str) -> float:
        return datetime.datetime.fromisoformat(stamp).timestamp()

    assert got[1] == at("2026-12-07T14:32:52.279")
    assert got[3] == at("2026-12-07T14:33:27.222")  # the first allocation of a job wins (a requeue is later)
    assert got[19] - got[3] == pytest.approx(0.002, abs=1e-6)
    assert got[20] == at("2026-12-07T14:33:28.500")
    assert sp.parse_allocations("") == {}


def test_free_ports_are_distinct():
    ports = sp.free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)


def test_without_the_tools_the_cluster_says_which_are_missing_and_starts_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH
    assert sp.missing_tools() == [*sp.CLIENT_TOOLS, *sp.DAEMONS]
    monkeypatch.setattr(sp.os, "geteuid", lambda: 0)
    cluster = sp.SlurmCluster(4, 8, auth="none")
    with pytest.raises(sp.SlurmError, match="salloc, sbatch, squeue, sinfo, scancel, slurmctld, slurmd not on PATH"):
        cluster.__enter__()
    assert cluster.procs == [] and cluster.dir is None


def test_as_non_root_the_cluster_refuses(monkeypatch):
    monkeypatch.setattr(sp.os, "geteuid", lambda: 1000)
    with pytest.raises(sp.SlurmError, match="root"):
        sp.SlurmCluster(4, 8).__enter__()
