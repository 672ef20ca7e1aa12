"""Multi-node NVLink domains (GB200 NVL72) as the lowest fabric tier: the fabric YAML, `Fabric.node_path` (declared
domain, else the agent's NVML fabric clique, else the node itself), the placement core over it, the scheduler with
agents that report cliques, the `gb200-nvl72` profile, `phalanx place` and `phalanx cluster up` with it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually

from phalanx.api.v1 import scheduler_pb2
from phalanx.cli.main import main as cli_main
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import (
    Fabric,
    FabricError,
    default_fabric,
    group_nvlink_domains,
    load_fabric,
    nvlink_domain_key,
    parse_fabric_yaml,
    parse_slurm_tree,
    to_slurm_tree,
    with_nvlink_domains,
)
from phalanx.core.model import GangRequest, NodeCapacity
from phalanx.core.placement import Unplaceable, place_gang
from phalanx.profiles import list_profiles, load_profile
from phalanx.testing.lite_agent import LiteAgent
from services.node_agent.simulated import simulated_topology
from services.scheduler.settings import SchedulerSettings

CLUSTER_UUID = "3f2a9c41-7d55-4e0b-9b1e-0c8d2f6a1b77"

# 2 GB200 NVL72 racks (36 trays) under one leaf, plus 4 DGX hosts under a second leaf.
NVL72_YAML = """\
tiers: [leaf, spine]
nvlink_domains:
  nvl0: "gb[001-018]"
  nvl1: ["gb[019-030]", "gb[031-036]"]
switches:
  spine0:
    leaf0: ["gb[001-036]"]
    leaf1: ["dgx[1-4]"]
"""


# -- the fabric YAML -----------------------------------------------------------------------------------------------


def test_yaml_nvlink_domains_add_the_lowest_tier():
    fabric = parse_fabric_yaml(NVL72_YAML)
    assert fabric.has_nvlink
    assert fabric.tiers == ("nvlink", "leaf", "spine")
    assert fabric.switch_tiers == ("leaf", "spine")
    assert fabric.path("gb001") == ("nvl0", "leaf0", "spine0")
    assert fabric.path("gb018") == ("nvl0", "leaf0", "spine0")
    assert fabric.path("gb019") == fabric.path("gb036") == ("nvl1", "leaf0", "spine0")
    # a node in no declared domain is its own NVLink domain (its NVSwitch)
    assert fabric.path("dgx1") == ("dgx1", "leaf1", "spine0")
    assert fabric.switch_path("gb001") == ("leaf0", "spine0")
    assert dict(fabric.nvlink_domains)["gb030"] == "nvl1" and "dgx1" not in fabric.nvlink_domains
    assert len(fabric.paths) == 40


def test_yaml_nvlink_auto_and_round_trips():
    auto = parse_fabric_yaml("nvlink_domains: auto\nswitches:\n  spine0:\n    leaf0: [n1, n2]\n    leaf1: [n3]\n")
    assert auto.tiers == ("nvlink", "leaf", "spine")
    assert auto.nvlink_domains == {}
    assert auto.path("n1") == ("n1", "leaf0", "spine0")
    assert parse_fabric_yaml("nvlink_domains: {}\nswitches: {leaf0: [n1]}").nvlink_domains == {}
    # `nvlink` in `tiers` is tolerated when it comes first
    assert parse_fabric_yaml("tiers: [nvlink, leaf]\nnvlink_domains: auto\nswitches: {leaf0: [n1]}").tiers == (
        "nvlink",
        "leaf",
    )
    for fabric in (auto, parse_fabric_yaml(NVL72_YAML)):
        assert parse_fabric_yaml(fabric.to_yaml()) == fabric
    # domains only, no switches: the domain is the only tier
    flat = parse_fabric_yaml('nvlink_domains: {rack0: "t[1-2]"}')
    assert flat.tiers == ("nvlink",) and flat.path("t2") == ("rack0",)
    assert parse_fabric_yaml(flat.to_yaml()) == flat


def test_plain_fabrics_are_unchanged():
    plain = parse_fabric_yaml("tiers: [leaf, spine]\nswitches: {spine0: {leaf0: [n1]}}")
    assert not plain.has_nvlink and plain.nvlink_domains is None
    assert plain.tiers == ("leaf", "spine") and plain.switch_tiers == plain.tiers
    assert plain.node_path("n1", CLUSTER_UUID, "0") == ("leaf0", "spine0") == plain.switch_path("n1")
    assert "nvlink" not in plain.to_yaml()
    assert parse_slurm_tree("SwitchName=s0 Nodes=a[1-2]").node_path("a1", CLUSTER_UUID, "1") == ("s0",)
    # Slurm tree syntax has no NVLink tier: writing one out keeps the switches only
    nvl = parse_fabric_yaml(NVL72_YAML)
    assert dict(parse_slurm_tree(to_slurm_tree(nvl)).paths) == {n: nvl.switch_path(n) for n in nvl.paths}


@pytest.mark.parametrize(
    "text, words",
    [
        # a domain across two leaves
        ('nvlink_domains: {nvl0: "n[1-3]"}\nswitches: {leaf0: ["n[1-2]"], leaf1: [n3]}', "spans two leaves"),
        # a node in two domains
        ('nvlink_domains: {a: "n[1-2]", b: "n[2-3]"}\nswitches: {leaf0: ["n[1-3]"]}', "two NVLink domains"),
        ('nvlink_domains: {a: "n[1-2]", b: ["n1"]}', "two NVLink domains"),
        ('nvlink_domains: {a: ["n1", "n1"]}', "listed twice"),
        # a member the switches do not name
        ('nvlink_domains: {a: "x[1-2]"}\nswitches: {leaf0: [n1]}', "switches do not name"),
        ("nvlink_domains: [n1, n2]", "auto` or a mapping"),
        ("nvlink_domains: sometimes", "auto` or a mapping"),
        ("nvlink_domains: {a: []}", "must list its nodes"),
        ('nvlink_domains: {a: "n[3-1]"}', "bad range"),
        ('nvlink_domains: {n2: "n1"}\nswitches: {leaf0: ["n[1-2]"]}', "has the name of node"),
        # the tier name is reserved
        ("tiers: [nvlink, leaf]\nswitches: {leaf0: [n1]}", "needs `nvlink_domains:`"),
        ("tiers: [leaf, nvlink]\nnvlink_domains: auto\nswitches: {s: {leaf0: [n1]}}", "leave it out of `tiers`"),
    ],
)
def test_bad_nvlink_yaml_is_a_clear_fabric_error(text, words):
    with pytest.raises(FabricError, match=re.escape(words)):
        parse_fabric_yaml(text)


def test_load_fabric_reads_nvlink_yaml(tmp_path):
    path = tmp_path / "nvl.yaml"
    path.write_text(NVL72_YAML)
    assert load_fabric(path) == parse_fabric_yaml(NVL72_YAML)


# -- node_path: declared, else the agent's clique, else the node ---------------------------------------------------


def test_nvlink_domain_key_from_nvml_fabric_info():
    assert nvlink_domain_key(CLUSTER_UUID, "3") == "nvl-3f2a9c41-3"
    assert nvlink_domain_key(CLUSTER_UUID, "") == "nvl-3f2a9c41"
    assert nvlink_domain_key("", "3") == ""
    assert nvlink_domain_key("00000000-0000-0000-0000-000000000000", "0") == ""


def test_node_path_prefers_declared_then_clique_then_node():
    fabric = parse_fabric_yaml(NVL72_YAML)
    # declared wins over what the agent reports
    assert fabric.node_path("gb005", CLUSTER_UUID, "7") == ("nvl0", "leaf0", "spine0")
    # undeclared: the clique, under the node's switches
    assert fabric.node_path("dgx2", CLUSTER_UUID, "7") == ("nvl-3f2a9c41-7", "leaf1", "spine0")
    # nothing reported: its own NVSwitch
    assert fabric.node_path("dgx2") == ("dgx2", "leaf1", "spine0") == fabric.path("dgx2")
    # a node the fabric does not name: the domain only (it sits under the root)
    assert fabric.node_path("stranger", CLUSTER_UUID, "1") == ("nvl-3f2a9c41-1",)
    assert fabric.node_path("stranger") == ("stranger",)
    auto = with_nvlink_domains(default_fabric(["a", "b"]), None)
    assert auto.node_path("a", CLUSTER_UUID, "0") == ("nvl-3f2a9c41-0", "leaf0", "spine0")


def test_group_nvlink_domains_simulates_racks_per_leaf_and_keeps_declared_ones():
    names = [f"t{i:02d}" for i in range(1, 41)]
    grouped = group_nvlink_domains(default_fabric(names, nodes_per_leaf=20), 18, prefix="nvl72")
    domains = {}
    for node in names:
        domains.setdefault(grouped.path(node)[0], []).append(node)
    # leaf0 holds t01-t20: a rack of 18 and one of 2; leaf1 likewise; no domain crosses a leaf
    assert sorted(len(v) for v in domains.values()) == [2, 2, 18, 18]
    assert domains["nvl72-0"] == names[:18] and domains["nvl72-1"] == names[18:20]
    assert grouped.tiers == ("nvlink", "leaf", "spine")
    declared = group_nvlink_domains(parse_fabric_yaml(NVL72_YAML), 18)
    assert declared.path("gb001")[0] == "nvl0" and declared.path("gb036")[0] == "nvl1"
    assert {declared.path(f"dgx{i}")[0] for i in range(1, 5)} == {"nvl-0"}
    with pytest.raises(FabricError, match="already has an NVLink tier"):
        with_nvlink_domains(declared)


# -- the placement core over NVLink domains ------------------------------------------------------------------------


def _capacity(fabric: Fabric, gpus: int = 4) -> ClusterCapacity:
    return ClusterCapacity(NodeCapacity(n, gpus, set(range(gpus)), True, fabric.path(n)) for n in sorted(fabric.paths))


def _domains(fabric: Fabric, placement) -> set[str]:
    return {fabric.path(r.node)[0] for r in placement.replicas}


TWO_RACKS = """\
tiers: [leaf, spine]
nvlink_domains: {nvl0: "gb[001-018]", nvl1: "gb[019-036]"}
switches: {spine0: {leaf0: ["gb[001-036]"]}}
"""


def test_a_small_gang_stays_inside_one_nvlink_domain():
    fabric = parse_fabric_yaml(TWO_RACKS)
    placement = place_gang(_capacity(fabric), GangRequest("small", 4, 4), fabric.tiers)
    assert placement.tier == "nvlink"
    assert len(_domains(fabric, placement)) == 1


def test_a_rack_sized_gang_takes_exactly_one_whole_rack():
    fabric = parse_fabric_yaml(TWO_RACKS)
    cap = _capacity(fabric)
    placement = place_gang(cap, GangRequest("rack", 18, 4), fabric.tiers)
    assert placement.tier == "nvlink"
    (domain,) = _domains(fabric, placement)
    assert sorted(r.node for r in placement.replicas) == sorted(n for n in fabric.paths if fabric.path(n)[0] == domain)
    assert all(len(r.gpus) == 4 for r in placement.replicas)
    # with one rack partly busy, the 18 x 4 gang goes to the whole other one
    cap.reserve(place_gang(cap, GangRequest("busy", 1, 4), fabric.tiers))
    again = place_gang(cap, GangRequest("rack2", 18, 4), fabric.tiers)
    assert again.tier == "nvlink" and len(_domains(fabric, again)) == 1


def test_a_gang_larger_than_a_rack_spans_two_domains_under_one_leaf():
    fabric = parse_fabric_yaml(TWO_RACKS)
    placement = place_gang(_capacity(fabric), GangRequest("wide", 20, 4), fabric.tiers)
    assert placement.tier == "leaf"
    assert _domains(fabric, placement) == {"nvl0", "nvl1"}
    # it fills one rack and puts the rest in the other, rather than splitting evenly
    counts = sorted(sum(1 for r in placement.replicas if fabric.path(r.node)[0] == d) for d in ("nvl0", "nvl1"))
    assert counts == [2, 18]
    required = place_gang(_capacity(fabric), GangRequest("wide", 20, 4, required_tier="nvlink"), fabric.tiers)
    assert isinstance(required, Unplaceable) and "under one nvlink" in required.reason


# -- the gb200-nvl72 profile ---------------------------------------------------------------------------------------


def test_gb200_nvl72_profile_reuses_the_tray_and_says_18_per_domain():
    assert "gb200-nvl72" in list_profiles()
    rack, tray = load_profile("gb200-nvl72"), load_profile("gb200-nvl72-tray")
    assert rack.name == "gb200-nvl72" and rack.gpu_count == 4
    assert rack.dump.matrix == tray.dump.matrix
    assert (rack.gpu_model, rack.memory_mib) == (tray.gpu_model, tray.memory_mib)
    assert rack.nvlink_domain == "nvl72" and rack.nvlink_domain_nodes == 18
    assert load_profile("dgx-h100").nvlink_domain_nodes == 1
    a = simulated_topology("node-01", "gb200-nvl72", fabric_clique="0")
    b = simulated_topology("node-19", "gb200-nvl72", fabric_clique="1")
    assert a.fabric_cluster_uuid == b.fabric_cluster_uuid != ""
    assert (a.fabric_clique, b.fabric_clique) == ("0", "1")
    assert a.profile == "gb200-nvl72" and len(a.gpus) == 4


def test_agent_flag_sets_the_fabric_clique():
    from services.node_agent.main import build_parser, build_topology

    args = build_parser().parse_args(["--simulate", "gb200-nvl72", "--fabric-clique", "2", "--discover"])
    topo, _ = build_topology(args, "tray-40")
    assert topo.fabric_clique == "2" and topo.fabric_cluster_uuid


# -- the scheduler: agents report cliques --------------------------------------------------------------------------


class _Scheduler(LiteCluster):
    """A scheduler and 4-GPU GB200 LiteAgents, each reporting its NVML fabric clique ("" for none)."""

    def __init__(self, db_url: str, fabric: Fabric, cliques: dict[str, str]) -> None:
        super().__init__(
            SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=fabric),
            lambda address: [
                LiteAgent(
                    address,
                    n,
                    gpus=4,
                    model="NVIDIA GB200",
                    memory_mib=189471,
                    fabric_cluster_uuid=CLUSTER_UUID if c else "",
                    fabric_clique=c,
                )
                for n, c in cliques.items()
            ],
        )

    async def paths(self) -> dict[str, tuple[str, ...]]:
        nodes = await self.stub.ListNodes(scheduler_pb2.ListNodesRequest())
        return {n.name: tuple(n.fabric_path) for n in nodes.nodes}


@pytest.mark.slow
async def test_scheduler_places_a_required_nvlink_gang_inside_one_clique(db_url):
    # 9 trays under one leaf: t1-t4 report clique 0, t5-t8 clique 1, t9 reports none (its own domain); the fabric
    # declares t8 and t9 as a domain of their own, which wins over what t8 reports.
    names = [f"t{i}" for i in range(1, 10)]
    fabric = with_nvlink_domains(default_fabric(names, nodes_per_leaf=16), {"t8": "rackX", "t9": "rackX"})
    cliques = {n: ("0" if i < 4 else "1" if i < 8 else "") for i, n in enumerate(names)}
    async with _Scheduler(db_url, fabric, cliques) as s:
        paths = await s.paths()
        assert paths["t1"] == ("nvl-3f2a9c41-0", "leaf0", "spine0")
        assert paths["t5"] == paths["t7"] == ("nvl-3f2a9c41-1", "leaf0", "spine0")
        assert paths["t8"] == paths["t9"] == ("rackX", "leaf0", "spine0")
        # 3 x 4 GPUs under one NVLink domain: one clique, never across
        first = await s.submit("a", 3, 4, required_tier="nvlink")
        job = await eventually(lambda: s.running(first.id), what="gang a running")
        assert job.placement.tier == "nvlink"
        assert len({paths[a.node][0] for a in job.allocations}) == 1
        # the next one cannot share the busy clique (1 tray left there) and takes the other whole
        second = await s.submit("b", 3, 4, required_tier="nvlink")
        job2 = await eventually(lambda: s.running(second.id), what="gang b running")
        assert len({paths[a.node][0] for a in job2.allocations}) == 1
        used = {paths[a.node][0] for a in [*job.allocations, *job2.allocations]}
        assert used == {"nvl-3f2a9c41-0", "nvl-3f2a9c41-1"}
        # 5 trays under one NVLink domain: no domain has that many, ever
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.submit("too-wide", 5, 4, required_tier="nvlink")
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "required_tier=nvlink" in info.value.details()
        # "nvlink" is one of the tier names this scheduler accepts; an unknown one is still refused
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.submit("bad", 1, 4, required_tier="rack")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nvlink" in info.value.details()


# -- phalanx place ---------------------------------------------------------------------------------------------------


def _place(tmp_path: Path, capsys, fabric_text: str, fabric_name: str, *requests: dict) -> list[dict]:
    fabric = tmp_path / fabric_name
    fabric.write_text(fabric_text)
    reqs = tmp_path / "req.jsonl"
    reqs.write_text("".join(json.dumps(r) + "\n" for r in requests))
    code = cli_main(["place", "--fabric", str(fabric), "--profile", "gb200-nvl72", "--requests", str(reqs), "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return [json.loads(line) for line in out.splitlines()]


def test_place_cli_groups_gb200_trays_into_racks(tmp_path, capsys):
    # a plain Slurm tree of 36 trays under one leaf: the profile makes them 2 racks of 18
    tree = "SwitchName=leaf0 Nodes=gb[001-036]\nSwitchName=spine0 Switches=leaf0\n"
    lines = _place(
        tmp_path,
        capsys,
        tree,
        "topology.conf",
        {"name": "small", "replicas": 4, "gpus_per_replica": 4},
        {"name": "rack", "replicas": 18, "gpus_per_replica": 4, "required_tier": "nvlink"},
        {"name": "too-wide", "replicas": 15, "gpus_per_replica": 4, "required_tier": "nvlink"},
        {"release": "small"},
        {"name": "wide", "replicas": 20, "gpus_per_replica": 4},
        {"name": "rack2", "replicas": 18, "gpus_per_replica": 4, "required_tier": "nvlink"},
    )
    small, rack, too_wide, _, wide, rack2, summary = lines
    assert small["placed"] and small["cost"]["tier"] == "nvlink"
    assert small["cost"]["leaves"] == 1 and small["cost"]["spine_crossings"] == 0  # leaf switches, not domains
    racks = {n: (int(n[2:]) - 1) // 18 for n in (f"gb{i:03d}" for i in range(1, 37))}
    assert len({racks[a["node"]] for a in small["allocations"]}) == 1
    assert rack["placed"] and rack["cost"]["tier"] == "nvlink"
    assert {racks[a["node"]] for a in rack["allocations"]} == {1 - racks[small["allocations"][0]["node"]]}
    assert len({a["node"] for a in rack["allocations"]}) == 18
    # 14 trays are left, all in the first rack: 15 do not fit
    assert not too_wide["placed"] and "holds 14" in too_wide["reason"]
    # after the release only the first rack (18 trays) is free: 20 do not fit, a rack-sized gang takes it whole
    assert not wide["placed"]
    assert rack2["placed"] and rack2["cost"]["tier"] == "nvlink"
    assert rack2["cost"]["leaves"] == 1
    assert {racks[a["node"]] for a in rack2["allocations"]} == {racks[small["allocations"][0]["node"]]}
    assert summary["summary"]["placed"] == 3


def test_place_cli_declared_domains_win(tmp_path, capsys):
    yaml_text = """\
tiers: [leaf]
nvlink_domains: {small: "gb[001-004]"}
switches: {leaf0: ["gb[001-022]"]}
"""
    lines = _place(
        tmp_path,
        capsys,
        yaml_text,
        "fabric.yaml",
        {"name": "four", "replicas": 4, "gpus_per_replica": 4, "required_tier": "nvlink"},
        {"name": "rack", "replicas": 18, "gpus_per_replica": 4, "required_tier": "nvlink"},
        {"name": "more", "replicas": 1, "gpus_per_replica": 4, "required_tier": "nvlink"},
    )
    four, rack, more, _ = lines
    assert sorted(a["node"] for a in four["allocations"]) == [f"gb{i:03d}" for i in range(1, 5)]
    assert sorted(a["node"] for a in rack["allocations"]) == [f"gb{i:03d}" for i in range(5, 23)]
    assert not more["placed"]


# -- phalanx cluster up --profile gb200-nvl72 ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_local_cluster_of_gb200_trays_has_racks_of_18(tmp_path, monkeypatch):
    from phalanx.cli.cluster import LocalCluster
    from phalanx.client import Client, JobState

    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    monkeypatch.delenv("PHALANX_FABRIC_CLUSTER", raising=False)
    monkeypatch.delenv("PHALANX_FABRIC_CLIQUE", raising=False)
    state_dir = tmp_path / "cluster"
    messages: list[str] = []
    with LocalCluster(
        nodes=19, profile="gb200-nvl72", state_dir=state_dir, port=0, log=messages.append, ready_timeout=90
    ) as cluster:
        fabric = load_fabric(state_dir / "topology.yaml")
        assert fabric.tiers == ("nvlink", "leaf", "spine") and fabric.nvlink_domains == {}
        assert not (state_dir / "topology.conf").exists()
        with Client(cluster.address, timeout=10) as client:
            nodes = {n.name: n for n in client.nodes()}
            assert len(nodes) == 19 and all(n.gpus == 4 and n.profile == "gb200-nvl72" for n in nodes.values())
            domains = {name: tuple(n.fabric_path)[0] for name, n in nodes.items()}
            first = {domains[f"node-{i:02d}"] for i in range(1, 19)}
            assert len(first) == 1 and domains["node-19"] not in first
            assert domains["node-19"].startswith("nvl-") and domains["node-19"].endswith("-1")
            assert all(tuple(n.fabric_path)[1:] == ("leaf0", "spine0") for n in nodes.values())
            job = client.submit("in-rack", 2, 4, ["true"], required_tier="nvlink")
            done = client.wait(job.id, timeout=60)
            assert done.state is JobState.SUCCEEDED, done
            assert done.placement["tier"] == "nvlink"
            import sqlite3  # a finished job shows no allocations: where it ran is in the ledger's history

            with sqlite3.connect(state_dir / "phalanx.db") as conn:
                ran_on = {
                    n
                    for (n,) in conn.execute(
                        "SELECT DISTINCT n.name FROM allocations a JOIN nodes n ON n.id = a.node_id WHERE a.job_id = ?",
                        (job.id,),
                    )
                }
            assert len(ran_on) == 2 and len({domains[n] for n in ran_on}) == 1
