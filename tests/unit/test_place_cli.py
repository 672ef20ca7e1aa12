"""`phalanx place`, the offline what-if tool: JSON line shapes, one-pass semantics, releases, required_tier,
cost fields, fabric syntaxes, per-line errors and command errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.required import data_missing, need

from phalanx.cli.main import main

DUMP = Path("/work/shared/data/topologies/hgx_h100_sxm_8gpu_8nic_sglang30401.txt")

# 8 nodes, 2 per leaf, 2 leaves per spine, one core.
TREE = """\
SwitchName=leaf0 Nodes=n[01-02]
SwitchName=leaf1 Nodes=n[03-04]
SwitchName=leaf2 Nodes=n[05-06]
SwitchName=leaf3 Nodes=n[07-08]
SwitchName=spine0 Switches=leaf[0-1]
SwitchName=spine1 Switches=leaf[2-3]
SwitchName=core Switches=spine[0-1]
"""

YAML = """\
tiers: [leaf, spine, core]
switches:
  core:
    spine0:
      leaf0: ["n[01-02]"]
      leaf1: ["n[03-04]"]
    spine1:
      leaf2: ["n[05-06]"]
      leaf3: ["n[07-08]"]
"""

TOP_KEYS = ["name", "placed", "allocations", "cost", "reason", "segments"]


def req(name: str, replicas: int, gpus: int, **extra) -> dict:
    return {"name": name, "replicas": replicas, "gpus_per_replica": gpus, **extra}


def write_requests(tmp_path: Path, *lines) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture
def tree(tmp_path) -> Path:
    path = tmp_path / "topology.conf"
    path.write_text(TREE)
    return path


def place(capsys, fabric, requests, profile="dgx-h100", as_json=True, mig_gpus=None, malformed=False):
    """Run `phalanx place`; `malformed`: some request line is wrong, so it exits 1 (after placing the others)
    and says which line on stderr."""
    argv = ["place", "--fabric", str(fabric), "--profile", str(profile), "--requests", str(requests)]
    argv += ["--mig-gpus", mig_gpus] if mig_gpus else []
    code = main(argv + (["--json"] if as_json else []))
    cap = capsys.readouterr()
    if malformed:
        assert code == 1 and "malformed request line(s); the first: line " in cap.err, cap.err
    else:
        assert code == 0, cap.err
        assert cap.err == ""
    if not as_json:
        return cap.out
    return [json.loads(line) for line in cap.out.splitlines()]


def by_name(lines) -> dict[str, dict]:
    return {line["name"]: line for line in lines if "name" in line}


def test_json_lines_have_exactly_the_documented_shapes(capsys, tmp_path, tree):
    lines = place(capsys, tree, write_requests(tmp_path, req("a", 2, 8), req("huge", 9, 8), {"release": "a"}))
    assert len(lines) == 4
    placed, refused, release, summary = lines
    assert list(placed) == TOP_KEYS and list(refused) == TOP_KEYS
    assert placed["placed"] is True and placed["reason"] == ""
    assert placed["allocations"] == [
        {"replica": 0, "node": placed["allocations"][0]["node"], "gpus": list(range(8))},
        {"replica": 1, "node": placed["allocations"][1]["node"], "gpus": list(range(8))},
    ]
    assert set(placed["cost"]) == {"tier", "leaves", "leaf_crossings", "spine_crossings", "rails", "rail_changes"}
    assert refused["placed"] is False and refused["allocations"] == [] and refused["cost"] is None
    assert refused["reason"]
    assert release == {"release": "a"}
    assert summary == {"summary": {"requests": 2, "placed": 1, "not_placed": 1, "gpus_allocated": 16}}


def test_one_pass_a_refused_request_is_not_retried_after_a_release(capsys, tmp_path, tree):
    lines = place(
        capsys,
        tree,
        write_requests(
            tmp_path,
            req("all", 8, 8),
            req("late", 1, 8),
            {"release": "all"},
            req("after", 1, 8),
        ),
    )
    got = by_name(lines)
    assert got["all"]["placed"] is True
    assert got["late"]["placed"] is False  # decided at its line, never retried
    assert got["after"]["placed"] is True  # the release freed capacity for later lines
    assert [line.get("name") for line in lines[:-1]] == ["all", "late", None, "after"]
    assert lines[-1]["summary"] == {"requests": 3, "placed": 2, "not_placed": 1, "gpus_allocated": 72}


def test_release_frees_exactly_the_released_gpus(capsys, tmp_path, tree):
    lines = place(
        capsys,
        tree,
        write_requests(
            tmp_path,
            req("x", 4, 8),
            req("y", 4, 8),
            req("z", 1, 8),
            {"release": "x"},
            req("z2", 4, 8),
            req("z3", 1, 1),
        ),
    )
    got = by_name(lines)
    assert got["x"]["placed"] and got["y"]["placed"] and not got["z"]["placed"]
    x_nodes = {a["node"] for a in got["x"]["allocations"]}
    assert {a["node"] for a in got["z2"]["allocations"]} == x_nodes
    assert got["z3"]["placed"] is False


def test_releasing_an_unknown_name_is_a_no_op(capsys, tmp_path, tree):
    lines = place(capsys, tree, write_requests(tmp_path, req("a", 8, 8), {"release": "never-placed"}, req("b", 1, 1)))
    assert lines[1] == {"release": "never-placed"}
    assert by_name(lines)["b"]["placed"] is False
    assert lines[-1]["summary"]["placed"] == 1


def test_required_tier_refuses_without_reserving_and_accepts_when_it_fits(capsys, tmp_path, tree):
    lines = place(
        capsys,
        tree,
        write_requests(
            tmp_path,
            req("wide", 4, 8, required_tier="leaf"),  # a leaf holds only 2 nodes
            req("leafy", 2, 8, required_tier="leaf"),
            req("spiny", 4, 8, required_tier="spine", preferred_tier="leaf"),
            req("rest", 2, 8),  # refusal reserved nothing: the last 2 nodes are free
        ),
    )
    got = by_name(lines)
    assert got["wide"]["placed"] is False and "required_tier leaf" in got["wide"]["reason"]
    assert got["wide"]["allocations"] == [] and got["wide"]["cost"] is None
    assert got["leafy"]["placed"] is True and got["leafy"]["cost"]["tier"] == "leaf"
    assert got["spiny"]["placed"] is True and got["spiny"]["cost"]["tier"] == "spine"
    assert got["rest"]["placed"] is True
    assert lines[-1]["summary"]["gpus_allocated"] == 64


def test_an_unknown_tier_is_a_per_line_error(capsys, tmp_path, tree):
    lines = place(
        capsys, tree, write_requests(tmp_path, req("r", 1, 8, required_tier="rack"), req("ok", 1, 8)), malformed=True
    )
    got = by_name(lines)
    assert got["r"]["placed"] is False and "line 1" in got["r"]["reason"] and "rack" in got["r"]["reason"]
    assert got["ok"]["placed"] is True


def base(cost: dict) -> dict:
    """The cost keys every fabric has figures for (rails only on rail-optimized fabrics)."""
    assert cost["rails"] == [] and cost["rail_changes"] == 0  # these fabrics are not rail-optimized
    return {k: cost[k] for k in ("tier", "leaves", "spine_crossings")}


def test_cost_counts_leaves_and_spine_crossings_of_the_ring(capsys, tmp_path, tree):
    lines = place(
        capsys,
        tree,
        write_requests(
            tmp_path,
            req("one", 2, 4),
            {"release": "one"},
            req("leaf", 2, 8),
            {"release": "leaf"},
            req("spine", 4, 8),
            {"release": "spine"},
            req("core", 6, 8),
        ),
    )
    got = by_name(lines)
    assert base(got["one"]["cost"]) == {"tier": "node", "leaves": 1, "spine_crossings": 0}
    assert base(got["leaf"]["cost"]) == {"tier": "leaf", "leaves": 1, "spine_crossings": 0}
    assert base(got["spine"]["cost"]) == {"tier": "spine", "leaves": 2, "spine_crossings": 0}
    core = got["core"]
    nodes = [a["node"] for a in sorted(core["allocations"], key=lambda a: a["replica"])]
    leaf_of = {f"n{i:02d}": f"leaf{(i - 1) // 2}" for i in range(1, 9)}
    spine_of = {n: f"spine{(i - 1) // 4}" for i, n in enumerate(sorted(leaf_of), 1)}
    ring = sum(spine_of[a] != spine_of[b] for a, b in zip(nodes, nodes[1:] + nodes[:1]))
    assert base(core["cost"]) == {"tier": "core", "leaves": len({leaf_of[n] for n in nodes}), "spine_crossings": ring}
    # 4 nodes of one spine and 2 of the other, in rank order: one crossing each way round the ring
    assert core["cost"]["leaves"] == 3 and core["cost"]["spine_crossings"] == 2


def test_tree_and_yaml_fabrics_give_identical_json(capsys, tmp_path, tree):
    yaml_path = tmp_path / "fabric.yaml"
    yaml_path.write_text(YAML)
    requests = write_requests(
        tmp_path,
        req("a", 3, 8),
        req("b", 2, 4, required_tier="leaf"),
        req("c", 4, 8),
        {"release": "a"},
        req("d", 5, 8),
        req("e", 1, 2),
    )
    from_tree = place(capsys, tree, requests)
    from_yaml = place(capsys, yaml_path, requests)
    assert from_tree == from_yaml
    assert by_name(from_tree)["c"]["placed"] is True


def test_block_fabrics_work_too(capsys, tmp_path):
    conf = tmp_path / "blocks.conf"
    conf.write_text("BlockName=b1 Nodes=n[01-02]\nBlockName=b2 Nodes=n[03-04]\nBlockSizes=2,4\n")
    got = by_name(place(capsys, conf, write_requests(tmp_path, req("a", 2, 8), req("b", 2, 8))))
    assert base(got["a"]["cost"]) == {"tier": "block", "leaves": 1, "spine_crossings": 0}
    assert got["b"]["placed"] is True


@pytest.mark.parametrize(
    "line, words",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"replicas": 1, "gpus_per_replica": 1}), "missing 'name'"),
        (json.dumps({"name": "m", "gpus_per_replica": 1}), "missing 'replicas'"),
        (json.dumps(req("m", 0, 8)), "'replicas' must be positive"),
        (json.dumps(req("m", 1, -2)), "'gpus_per_replica' must be positive"),
        (json.dumps(req("m", "2", 8)), "'replicas' must be an integer"),
        (json.dumps(req("m", 1.5, 8)), "'replicas' must be an integer"),
        (json.dumps(req("m", 1, 8, priority="high")), "'priority' must be an integer"),
        (json.dumps(req("m", 1, 8, gpu_count=3)), "unknown field"),
        (json.dumps({"release": 3}), "release"),
    ],
)
def test_a_malformed_line_is_refused_with_its_line_number_and_the_run_goes_on(capsys, tmp_path, tree, line, words):
    lines = place(
        capsys, tree, write_requests(tmp_path, req("first", 1, 8), "", line, req("last", 1, 8)), malformed=True
    )
    assert len(lines) == 4
    bad = lines[1]
    assert list(bad) == TOP_KEYS and bad["placed"] is False and bad["cost"] is None
    assert bad["reason"].startswith("line 3:") and words in bad["reason"]
    assert lines[2]["name"] == "last" and lines[2]["placed"] is True
    assert lines[3]["summary"] == {"requests": 3, "placed": 2, "not_placed": 1, "gpus_allocated": 16}


def test_mig_and_gpu_milli_requests_are_placed_and_released(capsys, tmp_path, tree):
    lines = place(
        capsys,
        tree,
        write_requests(
            tmp_path,
            {"name": "m1", "replicas": 1, "mig": "3g.40gb"},
            {"name": "m2", "replicas": 1, "mig": "4g.40gb", "gpus_per_replica": 1},
            {"name": "s1", "replicas": 2, "gpu_milli": 500},
            {"release": "m1"},
            {"name": "m3", "replicas": 1, "mig": "3g.40gb"},
        ),
        mig_gpus="7",
    )
    m1, m2, s1, _, m3, summary = lines
    assert m1["placed"] and m1["allocations"][0]["slices"] == [{"gpu": 7, "profile": "3g.40gb", "start": 4, "size": 4}]
    # the 4g goes next to the 3g on the same GPU (slices 0-3), not onto a fresh GPU
    assert m2["allocations"][0]["gpus"] == m1["allocations"][0]["gpus"]
    assert m2["allocations"][0]["slices"][0]["start"] == 0
    assert [a["gpu_milli"] for a in s1["allocations"]] == [500, 500]
    assert len({(a["node"], a["gpus"][0]) for a in s1["allocations"]}) == 1  # two halves share one GPU
    assert s1["allocations"][0]["gpus"] != [7]  # not the GPU in MIG mode
    assert "slices" not in s1["allocations"][0] and "gpu_milli" not in m1["allocations"][0]
    assert m3["allocations"][0]["slices"][0]["start"] == 4  # the released instance's place is reused
    assert summary["summary"]["placed"] == 4
    assert "fragmentation" in m1["reason"] or m1["reason"] == ""


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"mig": "9g.99gb"}, "'mig' must be a MIG profile"),
        ({"gpu_milli": 1000}, "'gpu_milli' must be an integer 1-999"),
        ({"mig": "1g.10gb", "gpu_milli": 5}, "not both"),
    ],
)
def test_bad_partial_requests_are_refused_per_line(capsys, tmp_path, tree, extra, words):
    lines = place(capsys, tree, write_requests(tmp_path, req("m", 1, 1, **extra), req("ok", 1, 1)), malformed=True)
    assert lines[0]["placed"] is False and words in lines[0]["reason"] and lines[0]["reason"].startswith("line 1:")
    assert lines[1]["placed"] is True


def test_mig_requests_go_only_to_the_gpus_in_mig_mode(capsys, tmp_path, tree):
    requests = write_requests(tmp_path, {"name": "m", "replicas": 1, "mig": "1g.10gb"}, req("w", 1, 8))
    m, w, _ = place(capsys, tree, requests)  # no --mig-gpus: no GPU is in MIG mode
    assert m["placed"] is False and "no GPU is in MIG mode" in m["reason"] and w["placed"] is True
    m, w, _ = place(capsys, tree, requests, mig_gpus="6,7")
    assert m["placed"] and m["allocations"][0]["gpus"][0] in (6, 7)
    assert w["placed"] is False and "GPU(s) in MIG mode take only MIG instances" in w["reason"]  # 6 whole per node
    code = main(
        ["place", "--fabric", str(tree), "--profile", "dgx-h100", "--requests", str(requests), "--mig-gpus", "8"]
    )
    assert code == 2 and "is not a GPU index 0-7" in capsys.readouterr().err


def test_mig_on_a_profile_without_mig_says_why(capsys, tmp_path, tree):
    lines = place(
        capsys, tree, write_requests(tmp_path, {"name": "m", "replicas": 1, "mig": "1g.10gb"}), profile="pcie-2numa"
    )
    assert lines[0]["placed"] is False and "no node here has MIG-capable GPUs" in lines[0]["reason"]


def test_human_output_shows_mig_instances(capsys, tmp_path, tree):
    code = main(
        [
            "place",
            "--fabric",
            str(tree),
            "--profile",
            "dgx-h100",
            "--mig-gpus",
            "7",
            "--requests",
            str(write_requests(tmp_path, {"name": "m", "replicas": 1, "mig": "1g.10gb"})),
        ]
    )
    out = capsys.readouterr().out
    assert (
        code == 0 and "m  PLACED  1 x MIG 1g.10gb" in out and ":1g.10gb@6]" in out
    )  # the end of the GPU: slices 0-5 stay whole for 2g-4g


def test_a_name_that_holds_a_placement_cannot_be_placed_again(capsys, tmp_path, tree):
    lines = place(
        capsys,
        tree,
        write_requests(tmp_path, req("a", 1, 8), req("a", 1, 8), {"release": "a"}, req("a", 1, 8)),
        malformed=True,
    )
    assert [line.get("placed") for line in lines[:-1]] == [True, False, None, True]
    assert "already holds" in lines[1]["reason"]


def test_an_empty_requests_file_is_valid(capsys, tmp_path, tree):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert place(capsys, tree, empty) == [
        {"summary": {"requests": 0, "placed": 0, "not_placed": 0, "gpus_allocated": 0}}
    ]
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n   \n")
    assert place(capsys, tree, blank)[-1]["summary"]["requests"] == 0
    assert "0 request(s)" in place(capsys, tree, empty, as_json=False)


def test_human_output_has_a_line_per_request_and_a_summary(capsys, tmp_path, tree):
    out = place(
        capsys, tree, write_requests(tmp_path, req("a", 2, 4), req("b", 9, 8), {"release": "a"}), as_json=False
    ).splitlines()
    assert len(out) == 4
    assert out[0].startswith("a  PLACED") and "[0-3][4-7]" in out[0] and "tier=node" in out[0]
    assert "leaves=1" in out[0] and "spine_crossings=0" in out[0]
    assert out[1].startswith("b  NOT PLACED") and "needs 9 x 8" in out[1]
    assert out[2].startswith("release a")
    assert out[3] == "2 request(s): 1 placed, 1 not placed, 8 GPUs allocated (8 nodes x 8 GPUs)"


def test_a_topology_dump_as_profile_gives_its_gpu_count(capsys, tmp_path, tree):
    need("data", data_missing(DUMP, "the topology dump"))
    lines = place(capsys, tree, write_requests(tmp_path, req("full", 8, 8), req("more", 1, 1)), profile=DUMP)
    assert lines[0]["placed"] is True and all(a["gpus"] == list(range(8)) for a in lines[0]["allocations"])
    assert lines[1]["placed"] is False
    assert lines[-1]["summary"]["gpus_allocated"] == 64


@pytest.mark.parametrize(
    "which, words",
    [
        ("fabric", "fabric file"),
        ("requests", "requests file"),
        ("profile", "does not exist"),
        ("bad_fabric", "cannot read fabric"),
        ("unknown_profile", "unknown host profile"),
    ],
)
def test_command_errors_go_to_stderr_with_exit_code_2(capsys, tmp_path, tree, which, words):
    requests = write_requests(tmp_path, req("a", 1, 1))
    bad = tmp_path / "bad.conf"
    bad.write_text("SwitchName=s0 Switches=nope\n")
    args = {"fabric": str(tree), "profile": "dgx-h100", "requests": str(requests)}
    missing = str(tmp_path / "missing.txt")
    if which == "bad_fabric":
        args["fabric"] = str(bad)
    elif which == "unknown_profile":
        args["profile"] = "no-such-profile"
    else:
        args[which] = missing
    code = main(
        ["place", "--fabric", args["fabric"], "--profile", args["profile"], "--requests", args["requests"], "--json"]
    )
    cap = capsys.readouterr()
    assert code == 2
    assert cap.out == ""
    assert cap.err.startswith("error: ") and words in cap.err


def test_segmented_requests_keep_each_segment_in_one_nvlink_domain(tmp_path, capsys):
    fabric = tmp_path / "topology.conf"
    fabric.write_text(
        "SwitchName=leaf0 Nodes=gb[001-036]\nSwitchName=leaf1 Nodes=gb[037-072]\nSwitchName=s Switches=leaf[0-1]\n"
    )
    requests = write_requests(
        tmp_path,
        req("llm", 36, 4, segment=18),
        req("bad", 6, 4, segment=4),
        req("tiers", 4, 4, segment=2, segment_tier="rack"),
    )
    llm, bad, tiers, _ = place(capsys, fabric, requests, profile="gb200-nvl72", malformed=True)
    assert llm["placed"] and len(llm["segments"]) == 2
    nodes = [a["node"] for a in sorted(llm["allocations"], key=lambda a: a["replica"])]
    for i, domain in enumerate(llm["segments"]):
        block = nodes[18 * i : 18 * i + 18]
        # 18 trays of 4 GPUs in one NVLink domain: the profile groups 18 consecutive trays of a leaf into one
        assert len(set(block)) == 18 and len({(int(n[2:]) - 1) // 18 for n in block}) == 1 and domain
    assert not bad["placed"] and "'segment' 4 does not divide 'replicas' 6" in bad["reason"]
    assert not tiers["placed"] and "unknown segment_tier" in tiers["reason"]
