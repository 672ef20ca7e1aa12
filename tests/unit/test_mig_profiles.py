"""The MIG profile tables of phalanx.core.mig against NVIDIA's MIG User Guide ("Supported MIG Profiles") and the
`nvidia-smi mig -lgip` IDs, the one-`+me`-instance-per-GPU rule, and A30's 4-slice geometry through the core's
placement (place_gang / ClusterCapacity.reserve)."""

from __future__ import annotations

import pynvml
import pytest

from phalanx.core import mig
from phalanx.core.capacity import CapacityError, ClusterCapacity, shape_key
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import place_gang
from phalanx.core.quota import demand
from phalanx.core.shares import _free_capacity, fragmentation

A30 = ("NVIDIA A30", 24576)
H100 = ("NVIDIA H100 80GB HBM3", 81559)

ALL = (0, 1, 2, 3, 4, 5, 6)
# NVIDIA's tables, written out: (name, compute slices, memory slices, valid starts, -lgip profile id, max count,
# NVML GPU-instance profile tail, NVML compute-instance profile tail).
EIGHT = [
    # 1g (small), 1g+me, 1g (large), 2g, 3g, 4g, 7g
    (1, 1, ALL, 19, 7, "1_SLICE", "1_SLICE"),
    (1, 1, ALL, 20, 1, "1_SLICE_REV1", "1_SLICE"),
    (1, 2, (0, 2, 4, 6), 15, 4, "1_SLICE_REV2", "1_SLICE_REV1"),
    (2, 2, (0, 2, 4), 14, 3, "2_SLICE", "2_SLICE"),
    (3, 4, (0, 4), 9, 2, "3_SLICE", "3_SLICE"),
    (4, 4, (0,), 5, 1, "4_SLICE", "4_SLICE"),
    (7, 8, (0,), 0, 1, "7_SLICE", "7_SLICE"),
]
NAMES = {
    "A100-40GB": ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
    "A100-80GB": ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "H100-80GB": ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "H100-94GB": ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
    "H100-96GB": ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
    "GH200-96GB": ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
    "GH200-144GB": ["1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"],
    "H200-141GB": ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
    "B200-180GB": ["1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"],
    "GB200-186GB": ["1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"],
}
TABLES = {family: [(n, *row) for n, row in zip(names, EIGHT, strict=True)] for family, names in NAMES.items()}
TABLES["A30-24GB"] = [
    ("1g.6gb", 1, 1, (0, 1, 2, 3), 14, 4, "1_SLICE", "1_SLICE"),
    ("1g.6gb+me", 1, 1, (0, 1, 2, 3), 21, 1, "1_SLICE_REV1", "1_SLICE"),
    ("2g.12gb", 2, 2, (0, 2), 5, 2, "2_SLICE", "2_SLICE"),
    ("2g.12gb+me", 2, 2, (0, 2), 6, 1, "2_SLICE_REV1", "2_SLICE"),
    ("4g.24gb", 4, 4, (0,), 0, 1, "4_SLICE", "4_SLICE"),
]


def mig_node(name: str, model=H100, gpus: int = 1) -> NodeCapacity:
    """A node whose GPUs all serve MIG instances: in MIG mode where the core models MIG mode (NodeCapacity has
    `mig_gpus`), else simply free."""
    extra = {"mig_gpus": frozenset(range(gpus))} if "mig_gpus" in NodeCapacity.__dataclass_fields__ else {}
    return NodeCapacity(name, gpus, set(range(gpus)), True, ("leaf0", "spine0"), None, *model, **extra)


def place(cap: ClusterCapacity, job: str, profile: str, replicas: int = 1):
    p = place_gang(cap, GangRequest(job, replicas, 1, mig_profile=profile))
    if isinstance(p, Placement):
        cap.reserve(p)
    return p


def used(cap: ClusterCapacity, node: str = "a", gpu: int = 0) -> int:
    return cap.nodes[node].mig.get(gpu, 0)


# ---- the tables ---------------------------------------------------------------------------------------------------


def test_every_family_is_modelled():
    assert set(mig.FAMILIES) == set(TABLES)


@pytest.mark.parametrize("family", sorted(TABLES))
def test_family_table_matches_nvidias(family):
    got = [
        (p.name, p.compute, p.size, p.starts, p.profile_id, p.max_count, p.nvml_gi_profile, p.nvml_ci_profile)
        for p in mig.family_table(family).values()
    ]
    want = [
        (n, c, s, st, pid, cnt, f"NVML_GPU_INSTANCE_PROFILE_{gi}", f"NVML_COMPUTE_INSTANCE_PROFILE_{ci}")
        for n, c, s, st, pid, cnt, gi, ci in TABLES[family]
    ]
    assert got == want
    table = mig.family_table(family)
    assert [n for n, p in table.items() if p.media] == [n for n, *_ in TABLES[family] if n.endswith("+me")]
    # family_profiles keeps listing the base profiles only, in the same order.
    assert list(mig.family_profiles(family)) == [n for n, *_ in TABLES[family] if not n.endswith("+me")]
    # A +me profile has its base profile's slices and starts.
    for p in table.values():
        if p.media:
            base = next(b for b in table.values() if not b.media and (b.compute, b.size) == (p.compute, p.size))
            assert (p.starts, p.memory_gb) == (base.starts, base.memory_gb) and p.max_count == 1
    # The memory in the name is the profile's memory_gb, and -lgip IDs are unique within a family.
    assert all(p.name.split("g.")[1].startswith(f"{p.memory_gb}gb") for p in table.values())
    assert len({p.profile_id for p in table.values()}) == len(table)


def test_a30_geometry_and_slice_counts():
    assert mig.family_slices("A30-24GB") == (4, 4)
    assert mig.full_mask("A30-24GB") == 0xF
    for family in sorted(set(TABLES) - {"A30-24GB"}):
        assert mig.family_slices(family) == (7, 8) and mig.full_mask(family) == 0xFF
    assert mig.family_slices(None) == (mig.COMPUTE_SLICES, mig.MEMORY_SLICES) == (7, 8)
    # Every profile fits inside its family's slices.
    for family in TABLES:
        compute, memory = mig.family_slices(family)
        for p in mig.family_table(family).values():
            assert p.compute <= compute and all(s + p.size <= memory for s in p.starts)
    assert mig.free_slices(0b0101, "A30-24GB") == 2 and mig.free_slices(0b0101, "H100-80GB") == 6


def test_nvml_constants_are_pynvmls():
    for name, value in {**mig.NVML_GI_PROFILES, **mig.NVML_CI_PROFILES}.items():
        assert getattr(pynvml, name) == value
    for family in TABLES:
        for p in mig.family_table(family).values():
            assert p.nvml_gi_value == getattr(pynvml, p.nvml_gi_profile)
            assert p.nvml_ci_value == getattr(pynvml, p.nvml_ci_profile)


def test_lookups_by_nvml_constant_and_profile_id():
    h100 = mig.family_table("H100-80GB")
    assert mig.profile_for_nvml("H100-80GB", "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1") is h100["1g.10gb+me"]
    assert mig.profile_for_nvml("H100-80GB", pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2) is h100["1g.20gb"]
    assert mig.profile_for_nvml("H100-80GB", "7_SLICE") is h100["7g.80gb"]
    assert mig.profile_for_nvml("H100-80GB", "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1") is None  # no 2g+me there
    a30 = mig.family_table("A30-24GB")
    assert mig.profile_for_nvml("A30-24GB", pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1) is a30["2g.12gb+me"]
    assert mig.profile_for_nvml("A30-24GB", pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE) is a30["4g.24gb"]
    assert mig.profile_for_nvml("A30-24GB", pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE) is None
    assert mig.profile_for_nvml(None, "1_SLICE") is None
    assert mig.profile_by_id("A30-24GB", 21) is a30["1g.6gb+me"]
    assert mig.profile_by_id("GH200-96GB", 20).name == "1g.12gb+me"
    assert mig.profile_by_id("A30-24GB", 19) is None


def test_resolve_and_known_names_cover_the_me_profiles():
    p = mig.resolve("1g.10gb+me", "H100-80GB")
    assert p is not None and p.media and p.size == 1 and p.profile_id == 20
    assert mig.resolve("1G.6GB+ME", "A30-24GB").name == "1g.6gb+me"
    assert mig.resolve("2g.20gb+me", "H100-80GB") is None  # only A30 has a 2g +me profile
    assert mig.resolve("1g.6gb", "H100-80GB") is None and mig.resolve("3g.40gb", "A30-24GB") is None
    assert mig.known_profile("2g.12gb+me") and mig.known_profile("7g.144gb") and not mig.known_profile("1g.10gb-me")
    names = mig.all_profile_names()
    assert {"1g.5gb+me", "1g.6gb", "4g.24gb", "1g.36gb", "7g.144gb", "7g.186gb"} <= set(names)
    assert names.index("1g.5gb") < names.index("1g.5gb+me") < names.index("1g.6gb") < names.index("2g.10gb")
    assert names[-1] == "7g.186gb"


@pytest.mark.parametrize(
    "model, memory, family",
    [
        ("NVIDIA A30", 24576, "A30-24GB"),
        ("NVIDIA GH200 480GB", 97871, "GH200-96GB"),
        ("NVIDIA GH200 480GB", 0, "GH200-96GB"),
        ("NVIDIA GH200 144G HBM3e", 146_432, "GH200-144GB"),
        ("NVIDIA GH200 144G HBM3e", 0, "GH200-144GB"),
        ("NVIDIA GH200", 146_432, "GH200-144GB"),  # no size in the name: the memory says
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H100 PCIe", 81559, "H100-80GB"),
        ("NVIDIA H100 NVL", 95830, "H100-94GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA H200 NVL", 143771, "H200-141GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", 40960, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA B200", 183359, "B200-180GB"),
        ("NVIDIA GB200", 189471, "GB200-186GB"),
        ("NVIDIA A10", 23028, None),
        ("NVIDIA L40S", 46068, None),
        ("Tesla V100-SXM2-32GB", 32768, None),
    ],
)
def test_mig_family_from_real_nvml_names(model, memory, family):
    assert mig.mig_family(model, memory) == family


def test_shapes_of_the_workload_mix_per_family():
    assert [mig.shape_profile("H100-80GB", s).name for s in range(len(mig.SHAPES))] == [
        "1g.10gb",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    ]
    assert [getattr(mig.shape_profile("A30-24GB", s), "name", None) for s in range(len(mig.SHAPES))] == [
        "1g.6gb",
        None,
        "2g.12gb",
        None,
        "4g.24gb",
        None,
    ]
    assert mig.shape_profile(None, 0) is None


# ---- one +me instance per GPU ----------------------------------------------------------------------------------


def test_me_masks_carry_the_media_bit():
    p = mig.family_table("H100-80GB")
    me, small = p["1g.10gb+me"], p["1g.10gb"]
    assert me.mask(3) == 0b1000 | mig.MEDIA_BIT and me.slice_mask(3) == 0b1000 and small.mask(3) == 0b1000
    assert mig.MEDIA_BIT & mig.FULL_MASK == 0 and mig.used_slices(me.mask(3)) == 1
    rep = ReplicaPlacement(0, "a", (0,), mig_profile="1g.10gb+me", mig_start=3, mig_size=1)
    assert rep.mig_mask == me.mask(3)
    assert ReplicaPlacement(0, "a", (0,), mig_profile="1g.10gb", mig_start=3, mig_size=1).mig_mask == 0b1000


def test_mask_functions_allow_one_me_instance_per_gpu():
    p = mig.family_table("H100-80GB")
    me, small = p["1g.10gb+me"], p["1g.10gb"]
    assert mig.free_starts(0, me) == list(ALL) and mig.max_instances(0, me) == 1
    taken = me.mask(0)
    assert mig.free_starts(taken, me) == [] and mig.max_instances(taken, me) == 0
    assert mig.free_starts(taken, small) == [1, 2, 3, 4, 5, 6] and mig.max_instances(taken, small) == 6
    assert mig.free_starts(taken, p["2g.20gb"]) == [2, 4]
    a30 = mig.family_table("A30-24GB")
    # On A30 the 1g and the 2g +me profiles share the one set of media engines.
    assert mig.free_starts(a30["1g.6gb+me"].mask(0), a30["2g.12gb+me"]) == []
    assert mig.free_starts(a30["2g.12gb+me"].mask(2), a30["1g.6gb+me"]) == []
    assert mig.free_starts(a30["2g.12gb+me"].mask(2), a30["1g.6gb"]) == [0, 1]


def test_placement_puts_at_most_one_me_instance_on_a_gpu():
    cap = ClusterCapacity([mig_node("a", gpus=1)])
    first = place(cap, "me1", "1g.10gb+me")
    assert isinstance(first, Placement) and first.replicas[0].mig_profile == "1g.10gb+me"
    assert used(cap) & mig.MEDIA_BIT
    second = place(cap, "me2", "1g.10gb+me")
    assert not isinstance(second, Placement)  # the GPU's media engines are taken, though 6 slices are free
    plain = place(cap, "plain", "1g.10gb")
    assert isinstance(plain, Placement) and plain.replicas[0].gpus == (0,)
    assert mig.used_slices(used(cap)) == 2
    # Released, the media engines are free again.
    cap.release_placement(first)
    assert not used(cap) & mig.MEDIA_BIT
    assert isinstance(place(cap, "me3", "1g.10gb+me"), Placement)


def test_me_replicas_spread_one_per_gpu():
    cap = ClusterCapacity([mig_node("a", gpus=2)])
    p = place(cap, "two", "1g.10gb+me", replicas=2)
    assert isinstance(p, Placement)
    assert sorted(r.gpus[0] for r in p.replicas) == [0, 1]
    assert not isinstance(place(cap, "third", "1g.10gb+me"), Placement)
    cap2 = ClusterCapacity([mig_node("a", gpus=1)])
    assert not isinstance(place(cap2, "two", "1g.10gb+me", replicas=2), Placement)  # all or none
    assert used(cap2) == 0


def test_the_ledger_refuses_a_second_me_instance_on_a_gpu():
    cap = ClusterCapacity([mig_node("a", gpus=1)])
    me = [
        ReplicaPlacement(i, "a", (0,), mig_profile="1g.10gb+me", mig_start=s, mig_size=1) for i, s in enumerate((0, 3))
    ]
    with pytest.raises(CapacityError):
        cap.reserve(Placement("j", tuple(me), "node", 1, 0.0, ""))
    assert used(cap) == 0  # all or nothing
    cap.reserve(Placement("j1", (me[0],), "node", 1, 0.0, ""))
    with pytest.raises(CapacityError):
        cap.reserve(Placement("j2", (me[1],), "node", 1, 0.0, ""))
    plain = ReplicaPlacement(0, "a", (0,), mig_profile="1g.10gb", mig_start=3, mig_size=1)
    cap.reserve(Placement("j3", (plain,), "node", 1, 0.0, ""))
    assert used(cap) == 0b1001 | mig.MEDIA_BIT


# ---- A30: 4 memory slices --------------------------------------------------------------------------------------


def test_four_1g_6gb_fill_an_a30():
    cap = ClusterCapacity([mig_node("a", A30, gpus=1)])
    got = [place(cap, f"j{i}", "1g.6gb") for i in range(4)]
    assert all(isinstance(p, Placement) for p in got)
    assert sorted(p.replicas[0].mig_start for p in got) == [0, 1, 2, 3]
    assert used(cap) == 0xF
    assert not isinstance(place(cap, "fifth", "1g.6gb"), Placement)
    assert shape_key(cap.nodes["a"]) is None  # a full A30 offers nothing


def test_a30_2g_never_starts_at_1_and_4g_needs_an_empty_gpu():
    a30 = mig.family_table("A30-24GB")
    assert mig.free_starts(0, a30["2g.12gb"]) == [0, 2]
    assert mig.free_starts(a30["1g.6gb"].mask(2), a30["2g.12gb"]) == [0]
    assert mig.free_starts(a30["1g.6gb"].mask(0), a30["2g.12gb"]) == [2]
    assert mig.free_starts(a30["1g.6gb"].mask(3), a30["4g.24gb"]) == []
    cap = ClusterCapacity([mig_node("a", A30, gpus=1)])
    one = ReplicaPlacement(0, "a", (0,), mig_profile="1g.6gb", mig_start=0, mig_size=1)
    cap.reserve(Placement("one", (one,), "node", 1, 0.0, ""))
    two = place(cap, "two", "2g.12gb")
    assert isinstance(two, Placement) and two.replicas[0].mig_start == 2  # slices 1-2 are no valid 2g placement
    assert not isinstance(place(cap, "four", "4g.24gb"), Placement)
    assert isinstance(place(cap, "other", "1g.6gb"), Placement) and used(cap) == 0xF
    empty = ClusterCapacity([mig_node("b", A30, gpus=1)])
    four = place(empty, "four", "4g.24gb")
    assert isinstance(four, Placement) and four.replicas[0].mig_start == 0 and four.replicas[0].mig_size == 4
    assert used(empty, "b") == 0xF


def test_the_ledger_keeps_a30_instances_inside_its_four_slices():
    cap = ClusterCapacity([mig_node("a", A30, gpus=1)])
    for start, size, profile in ((3, 2, "2g.12gb"), (4, 1, "1g.6gb")):
        rep = ReplicaPlacement(0, "a", (0,), mig_profile=profile, mig_start=start, mig_size=size)
        with pytest.raises(CapacityError):
            cap.reserve(Placement("x", (rep,), "node", 1, 0.0, ""))
    # The same slices are fine on an 8-slice GPU.
    h100 = ClusterCapacity([mig_node("a", H100, gpus=1)])
    h100.reserve(
        Placement(
            "x", (ReplicaPlacement(0, "a", (0,), mig_profile="1g.10gb", mig_start=4, mig_size=1),), "node", 1, 0.0, ""
        )
    )


def test_a30_me_profiles_share_the_media_engines_in_placement():
    cap = ClusterCapacity([mig_node("a", A30, gpus=1)])
    assert isinstance(place(cap, "me2", "2g.12gb+me"), Placement)
    assert not isinstance(place(cap, "me1", "1g.6gb+me"), Placement)
    assert isinstance(place(cap, "plain", "1g.6gb"), Placement)


def test_a30_capacity_counts_quarters_and_fragmentation_is_finite():
    assert _free_capacity(0, (0b0001,), (), 4) == 0.75
    assert _free_capacity(0, (0b0001,), ()) == 7 / 8  # the 8-slice default
    model, memory = A30
    for migs in ((0,), (0b0001,), (0b0011,), (0b0111,)):
        f = fragmentation((model, memory, 1, 0, migs, ()))
        assert 0 <= f <= _free_capacity(0, migs, (), 4)


def test_quota_counts_me_instances_by_their_compute_slices():
    assert demand(GangRequest("j", 3, 1, mig_profile="1g.10gb+me")) == (0.0, 3)
    assert demand(GangRequest("j", 2, 1, mig_profile="2g.12gb+me")) == (0.0, 4)


def test_gpu_equivalents_count_a_gpus_own_compute_slices():
    from services.scheduler.state import gpu_equivalents

    assert gpu_equivalents(1, 1, "2g.12gb") == 2 / 4  # A30: 4 compute slices
    assert gpu_equivalents(1, 1, "3g.40gb") == 3 / 7
    assert gpu_equivalents(2, 1, "1g.10gb+me") == 2 / 7


@pytest.mark.parametrize(
    "text,count,want",
    [("all", 4, {0, 1, 2, 3}), ("none", 8, set()), ("", 8, set()), ("6, 7", 8, {6, 7}), ("0", 1, {0})],
)
def test_parse_gpu_indexes(text, count, want):
    assert mig.parse_gpu_indexes(text, count) == frozenset(want)


@pytest.mark.parametrize("text", ["8", "x", "1,,2", "-1"])
def test_parse_gpu_indexes_refuses(text):
    with pytest.raises(ValueError, match="is not a GPU index 0-7"):
        mig.parse_gpu_indexes(text, 8)
