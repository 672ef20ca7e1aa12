"""MIG (Multi-Instance GPU) profiles and their placement rules, as NVIDIA's MIG User Guide gives them.

A MIG-capable GPU has a family's number of memory slices and compute slices (`family_slices`): 8 and 7 on A100,
H100, H200, GH200, B200 and GB200; 4 and 4 on A30. A GPU instance of a profile occupies `size` consecutive memory
slices starting at one of the profile's valid start slices (`nvidia-smi mig -lgipp` prints them as `{0,2,4,6}:2`).
The 8-slice families share one layout; only the memory, and so the names, differ:

    shape       compute  memory  valid starts    -lgip id  max  NVML GI profile (pynvml)   NVML CI profile
    1g (small)     1       1     0,1,2,3,4,5,6      19      7   ..._PROFILE_1_SLICE        ..._PROFILE_1_SLICE
    1g+me          1       1     0,1,2,3,4,5,6      20      1   ..._PROFILE_1_SLICE_REV1   ..._PROFILE_1_SLICE
    1g (large)     1       2     0,2,4,6            15      4   ..._PROFILE_1_SLICE_REV2   ..._PROFILE_1_SLICE_REV1
    2g             2       2     0,2,4              14      3   ..._PROFILE_2_SLICE        ..._PROFILE_2_SLICE
    3g             3       4     0,4                 9      2   ..._PROFILE_3_SLICE        ..._PROFILE_3_SLICE
    4g             4       4     0                   5      1   ..._PROFILE_4_SLICE        ..._PROFILE_4_SLICE
    7g             7       8     0                   0      1   ..._PROFILE_7_SLICE        ..._PROFILE_7_SLICE

    shape       A100 40GB  A100/H100 80GB  H100 94GB  H100 96GB,  H200 141GB  GH200 144GB  B200 180GB  GB200 186GB
                                                      GH200 96GB
    1g (small)  1g.5gb     1g.10gb         1g.12gb    1g.12gb     1g.18gb     1g.18gb      1g.23gb     1g.23gb
    1g+me       1g.5gb+me  1g.10gb+me      1g.12gb+me 1g.12gb+me  1g.18gb+me  1g.18gb+me   1g.23gb+me  1g.23gb+me
    1g (large)  1g.10gb    1g.20gb         1g.24gb    1g.24gb     1g.35gb     1g.36gb      1g.45gb     1g.47gb
    2g          2g.10gb    2g.20gb         2g.24gb    2g.24gb     2g.35gb     2g.36gb      2g.45gb     2g.47gb
    3g          3g.20gb    3g.40gb         3g.47gb    3g.48gb     3g.71gb     3g.72gb      3g.90gb     3g.93gb
    4g          4g.20gb    4g.40gb         4g.47gb    4g.48gb     4g.71gb     4g.72gb      4g.90gb     4g.93gb
    7g          7g.40gb    7g.80gb         7g.94gb    7g.96gb     7g.141gb    7g.144gb     7g.180gb    7g.186gb

A30 24GB has 4 memory and 4 compute slices:

    profile     compute  memory  valid starts  -lgip id  max  NVML GI profile            NVML CI profile
    1g.6gb         1       1     0,1,2,3          14      4   ..._PROFILE_1_SLICE        ..._PROFILE_1_SLICE
    1g.6gb+me      1       1     0,1,2,3          21      1   ..._PROFILE_1_SLICE_REV1   ..._PROFILE_1_SLICE
    2g.12gb        2       2     0,2               5      2   ..._PROFILE_2_SLICE        ..._PROFILE_2_SLICE
    2g.12gb+me     2       2     0,2               6      1   ..._PROFILE_2_SLICE_REV1   ..._PROFILE_2_SLICE
    4g.24gb        4       4     0                 0      1   ..._PROFILE_4_SLICE        ..._PROFILE_4_SLICE

("..." is NVML_GPU_INSTANCE / NVML_COMPUTE_INSTANCE; the -lgip id is what `nvidia-smi mig -lgip` prints and what
NVML's profile info reports as `id`; the NVML constant is what `nvmlDeviceGetGpuInstanceProfileInfo` takes.)

Slice 7 of an 8-slice GPU holds no 1g (small) instance: seven of them fill slices 0-6, and the compute slices (7)
run out first. Within these rules any set of non-overlapping instances is a valid geometry (4g + 3g, 3g + 3g,
2g + 2g + 2g + 1g...), so a GPU's MIG state is the bit mask of its used memory slices, plus one more bit:

Media extensions. A `+me` profile has the same compute and memory slices and the same valid starts as its base
profile, and adds the GPU's media engines (NVJPG, OFA; the guide: "A single 1g profile can include media
extensions"), so at most ONE `+me` instance exists per GPU. `MigProfile.mask` of a `+me` profile therefore includes
`MEDIA_BIT` (bit 8, above every family's slices); the state mask carries it while a `+me` instance holds the media
engines, and every overlap test (`free_starts`, the capacity ledger) then refuses a second one. The full-GPU
profiles (7g, A30's 4g.24gb) own the media engines too, but they take every slice, so no bit is needed for them.
`family_profiles` lists a family's base profiles (the shapes above, as before); `family_table` lists every profile,
`+me` included; `resolve`, `known_profile` and `all_profile_names` cover both.

Sources (checked against each table above):
- NVIDIA, "NVIDIA Multi-Instance GPU User Guide", section "Supported MIG Profiles" (tables "GPU Instance Profiles
  on A30 / A100 / H100 / H200 / B200", the H100 80GB, 94GB and "H100 96GB product (H100 on GH200)" tables: names,
  fractions, instance counts, `+me` variants), https://docs.nvidia.com/datacenter/tesla/mig-user-guide/
  supported-mig-profiles.html (r580 and later editions); and its section "Getting Started with MIG" > "List GPU Instance
  Profiles" (`nvidia-smi mig -lgipp` on A100: profile IDs 19, 20, 15, 14, 9, 5, 0 and their placements),
  https://docs.nvidia.com/datacenter/tesla/mig-user-guide/getting-started-with-mig.html.
- The guide has no table of its own for GB200 or for GH200 144GB HBM3e (its "Supported GPUs" table lists GB200
  186GB with 7 instances). Their names come from `nvidia-smi mig -lgip` output posted by NVIDIA engineers in
  NVIDIA/mig-parted#139 (GH200 144G HBM3e: 1g.18gb 19, 1g.18gb+me 20, 1g.36gb 15, 2g.36gb 14) and
  NVIDIA/mig-parted#227 (GB200 production boards: 1g.23gb 19, 1g.23gb+me 20, 1g.47gb 15, 2g.47gb 14), and from
  mig-parted's deployments/systemd/config-default.yaml (3g.72gb, 4g.72gb, 7g.144gb; 3g.93gb, 4g.93gb, 7g.186gb,
  and every instance count), https://github.com/NVIDIA/mig-parted. Profile IDs of the other GPUs: -lgip output in
  NVIDIA/mig-parted#120 (H200, all seven), #166 and #187 (B200), NVIDIA/gpu-operator#900 (H100 NVL 94GB) and a
  published GH200 96GB log (Slurm MIG notes linking github.com/kf-cuanschutz/NVIDIA_Grace_Hopper_benchmarking_logs_,
  all seven: 19, 20, 15, 14, 9, 5, 0); A30's IDs and placements (14 {0,1,2,3}:1, 21 {0,1,2,3}:1, 5 {0,2}:2,
  6 {0,2}:2, 0 {0}:4) from published A30 `nvidia-smi mig -lgip` / `-lgipp` output.
- NVML constants: the names in the installed pynvml (nvidia-ml-py); the 1g (large) CI profile is the one
  `nvidia-smi mig -cgi 15 -C` reports creating on H100 80GB and GH200 ("... using profile MIG 1g.20gb (ID  7)",
  7 = NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1).

Not confirmed, so modelled as stated: the -lgip IDs 9, 5, 0 of 3g/4g/7g on B200, GB200 and GH200 144GB (the posted
outputs seen were cut after 2g; every 8-slice GPU whose full output was seen uses 9, 5, 0); the CI profile of the
1g (large) profile on GPUs other than H100/GH200 (taken to be the same). GB200 pre-production boards reported other
names (1g.24gb, 3g.95gb, ...; mig-parted#175, fixed for production boards in #228): not modelled. Newer guides also
list `-me`, `+gfx` and `+me.all` profiles, but only for RTX PRO Blackwell (GB20X) and Thor, none for the families
here, so they are left out; the guide lists a 2g `+me` profile only for A30.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

MEMORY_SLICES = 8  # memory slices of an 8-slice family (A100 ... GB200), and of an unknown one
COMPUTE_SLICES = 7  # compute slices of an 8-slice family
FULL_MASK = (1 << MEMORY_SLICES) - 1
# In a GPU's MIG state mask while a `+me` instance holds the GPU's media engines (one per GPU): above every slice.
MEDIA_BIT = 1 << MEMORY_SLICES

# NVML's GPU-instance and compute-instance profile constants (nvml.h; pynvml defines the same names with the same
# values), so the core maps between names and values without importing pynvml.
NVML_GI_PROFILES: dict[str, int] = {
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE": 0,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE": 1,
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE": 2,
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE": 3,
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE": 4,
    "NVML_GPU_INSTANCE_PROFILE_8_SLICE": 5,
    "NVML_GPU_INSTANCE_PROFILE_6_SLICE": 6,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1": 7,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1": 8,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2": 9,
}
NVML_CI_PROFILES: dict[str, int] = {
    "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE": 0,
    "NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE": 1,
    "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE": 2,
    "NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE": 3,
    "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE": 4,
    "NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE": 5,
    "NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE": 6,
    "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1": 7,
}


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile of a family.

    The NVML fields (defaults: not recorded) are what a simulated NVML and the NVML backend need: `nvml_gi_profile`
    the pynvml constant of the GPU-instance profile (NVML_GPU_INSTANCE_PROFILE_*, what
    nvmlDeviceGetGpuInstanceProfileInfo takes), `profile_id` the ID `nvidia-smi mig -lgip` prints (the profile
    info's `id`, what `nvidia-smi mig -cgi` takes), `max_count` how many instances of it one GPU holds at most,
    `media` whether it is a `+me` profile (at most one per GPU, see MEDIA_BIT), `nvml_ci_profile` the compute-instance
    profile (NVML_COMPUTE_INSTANCE_PROFILE_*) that covers the whole GPU instance.
    """

    name: str
    compute: int  # compute slices (the "Ng" of the name)
    size: int  # memory slices
    starts: tuple[int, ...]  # valid start memory slices
    memory_gb: int
    nvml_gi_profile: str = ""
    profile_id: int = -1
    max_count: int = 0
    media: bool = False
    nvml_ci_profile: str = ""

    def mask(self, start: int) -> int:
        """What an instance at `start` takes of a GPU's MIG state: its memory slices, and MEDIA_BIT for `+me`."""
        return self.slice_mask(start) | (MEDIA_BIT if self.media else 0)

    def slice_mask(self, start: int) -> int:
        """The memory slices alone of an instance at `start`."""
        return ((1 << self.size) - 1) << start

    @property
    def nvml_gi_value(self) -> int:
        """The value of `nvml_gi_profile` (-1 when not recorded)."""
        return NVML_GI_PROFILES.get(self.nvml_gi_profile, -1)

    @property
    def nvml_ci_value(self) -> int:
        """The value of `nvml_ci_profile` (-1 when not recorded)."""
        return NVML_CI_PROFILES.get(self.nvml_ci_profile, -1)


# The six base shapes (compute slices, memory slices) of the 8-slice layout, in the order of the tables above.
# core.shares' workload mix indexes them (`shape_profile`); a family lacking a shape (A30) has None there.
SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 2), (3, 4), (4, 4), (7, 8))

# A family's rows: (name suffix, compute, memory slices, valid starts, max count, -lgip profile id,
# NVML GPU-instance profile, NVML compute-instance profile), as in the tables of the module docstring.
_Row = tuple[str, int, int, tuple[int, ...], int, int, str, str]
_EIGHT_SLICES: tuple[_Row, ...] = (
    ("", 1, 1, (0, 1, 2, 3, 4, 5, 6), 7, 19, "1_SLICE", "1_SLICE"),
    ("+me", 1, 1, (0, 1, 2, 3, 4, 5, 6), 1, 20, "1_SLICE_REV1", "1_SLICE"),
    ("", 1, 2, (0, 2, 4, 6), 4, 15, "1_SLICE_REV2", "1_SLICE_REV1"),
    ("", 2, 2, (0, 2, 4), 3, 14, "2_SLICE", "2_SLICE"),
    ("", 3, 4, (0, 4), 2, 9, "3_SLICE", "3_SLICE"),
    ("", 4, 4, (0,), 1, 5, "4_SLICE", "4_SLICE"),
    ("", 7, 8, (0,), 1, 0, "7_SLICE", "7_SLICE"),
)
_A30_SLICES: tuple[_Row, ...] = (
    ("", 1, 1, (0, 1, 2, 3), 4, 14, "1_SLICE", "1_SLICE"),
    ("+me", 1, 1, (0, 1, 2, 3), 1, 21, "1_SLICE_REV1", "1_SLICE"),
    ("", 2, 2, (0, 2), 2, 5, "2_SLICE", "2_SLICE"),
    ("+me", 2, 2, (0, 2), 1, 6, "2_SLICE_REV1", "2_SLICE"),
    ("", 4, 4, (0,), 1, 0, "4_SLICE", "4_SLICE"),
)

# Family -> (compute slices, memory slices, rows, memory (GB) of each row, in row order).
_FAMILIES: dict[str, tuple[int, int, tuple[_Row, ...], tuple[int, ...]]] = {
    "A100-40GB": (7, 8, _EIGHT_SLICES, (5, 5, 10, 10, 20, 20, 40)),
    "A100-80GB": (7, 8, _EIGHT_SLICES, (10, 10, 20, 20, 40, 40, 80)),
    "H100-80GB": (7, 8, _EIGHT_SLICES, (10, 10, 20, 20, 40, 40, 80)),
    "H100-94GB": (7, 8, _EIGHT_SLICES, (12, 12, 24, 24, 47, 47, 94)),
    "H100-96GB": (7, 8, _EIGHT_SLICES, (12, 12, 24, 24, 48, 48, 96)),
    "H200-141GB": (7, 8, _EIGHT_SLICES, (18, 18, 35, 35, 71, 71, 141)),
    "B200-180GB": (7, 8, _EIGHT_SLICES, (23, 23, 45, 45, 90, 90, 180)),
    "GB200-186GB": (7, 8, _EIGHT_SLICES, (23, 23, 47, 47, 93, 93, 186)),
    "A30-24GB": (4, 4, _A30_SLICES, (6, 6, 12, 12, 24)),
    "GH200-96GB": (7, 8, _EIGHT_SLICES, (12, 12, 24, 24, 48, 48, 96)),
    "GH200-144GB": (7, 8, _EIGHT_SLICES, (18, 18, 36, 36, 72, 72, 144)),
}

FAMILIES = tuple(_FAMILIES)


@cache
def family_table(family: str) -> dict[str, MigProfile]:
    """Every profile of a family by name, `+me` variants included, in the order of NVIDIA's table (each `+me`
    after its base); empty for an unknown family."""
    entry = _FAMILIES.get(family)
    if entry is None:
        return {}
    _, _, rows, memory = entry
    table: dict[str, MigProfile] = {}
    for (suffix, c, size, starts, count, pid, gi, ci), gb in zip(rows, memory, strict=True):
        name = f"{c}g.{gb}gb{suffix}"
        table[name] = MigProfile(
            name,
            c,
            size,
            starts,
            gb,
            nvml_gi_profile=f"NVML_GPU_INSTANCE_PROFILE_{gi}",
            profile_id=pid,
            max_count=count,
            media=suffix == "+me",
            nvml_ci_profile=f"NVML_COMPUTE_INSTANCE_PROFILE_{ci}",
        )
    return table


@cache
def family_profiles(family: str) -> dict[str, MigProfile]:
    """The base profiles of a family by name (no `+me` variants: those are in `family_table`), smallest first;
    empty for an unknown family."""
    return {name: p for name, p in family_table(family).items() if not p.media}


def family_slices(family: str | None) -> tuple[int, int]:
    """(compute slices, memory slices) of a family's GPU: (4, 4) on A30, (7, 8) on the others and when unknown."""
    entry = _FAMILIES.get(family) if family else None
    return (entry[0], entry[1]) if entry else (COMPUTE_SLICES, MEMORY_SLICES)


def full_mask(family: str | None) -> int:
    """The mask of all of a family's memory slices (0xF on A30, 0xFF on the 8-slice families)."""
    return (1 << family_slices(family)[1]) - 1


def shape_profile(family: str | None, shape: int) -> MigProfile | None:
    """The family's base profile of SHAPES[shape], or None when the family has none of that shape."""
    if family is None:
        return None
    return next((p for p in family_profiles(family).values() if (p.compute, p.size) == SHAPES[shape]), None)


def profile_for_nvml(family: str | None, gi_profile: str | int) -> MigProfile | None:
    """The family's profile of a pynvml GPU-instance profile constant, by name ("NVML_GPU_INSTANCE_PROFILE_1_SLICE"
    or its tail "1_SLICE") or by value (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1); None when it has none."""
    if family is None:
        return None
    if isinstance(gi_profile, str):
        name = gi_profile if gi_profile.startswith("NVML_") else f"NVML_GPU_INSTANCE_PROFILE_{gi_profile}"
        return next((p for p in family_table(family).values() if p.nvml_gi_profile == name), None)
    return next((p for p in family_table(family).values() if p.nvml_gi_value == gi_profile), None)


def profile_by_id(family: str | None, profile_id: int) -> MigProfile | None:
    """The family's profile whose `nvidia-smi mig -lgip` ID is `profile_id`; None when it has none."""
    if family is None:
        return None
    return next((p for p in family_table(family).values() if p.profile_id == profile_id), None)


def is_media(profile: str) -> bool:
    """Whether a profile name is a `+me` (media extensions) profile."""
    return profile.lower().endswith("+me")


@cache
def mig_family(gpu_model: str, memory_mib: int = 0) -> str | None:
    """The MIG family of a GPU from its NVML name (and memory where the name does not say), or None when it has
    no MIG (L40S, V100, consumer cards...)."""
    name = gpu_model.upper().replace("-", " ")
    gb = memory_mib / 1024 if memory_mib else 0
    if "GB200" in name:
        return "GB200-186GB"
    if "B200" in name:
        return "B200-180GB"
    if "GH200" in name:
        # "NVIDIA GH200 480GB" (480GB is the Grace CPU's LPDDR5X; the GPU has 96GB HBM3) or "NVIDIA GH200 144G
        # HBM3e" (144GB HBM3e): the name or the GPU memory tells them apart.
        if "144G" in name or "HBM3E" in name or gb >= 120:
            return "GH200-144GB"
        return "GH200-96GB"
    if "H200" in name:
        return "H200-141GB"
    if "H100" in name or "H800" in name:
        if "NVL" in name or 90 <= gb < 95 or "94GB" in name:
            return "H100-94GB"
        if "96GB" in name or gb >= 95:
            return "H100-96GB"
        return "H100-80GB"
    if "A100" in name or "A800" in name:
        if "40GB" in name or (gb and gb < 60):
            return "A100-40GB"
        return "A100-80GB"
    if "A30" in name.split():
        return "A30-24GB"
    return None


def parse_gpu_indexes(text: str, count: int) -> frozenset[int]:
    """GPU indexes as flags give them (`phalanx place --mig-gpus`, `phalanx-agent --simulate-mig`): "all", "none"
    or "" (none), or a comma list of indexes below `count` ("6,7"). ValueError names the bad part."""
    spec = text.strip().lower()
    if spec in ("", "none"):
        return frozenset()
    if spec == "all":
        return frozenset(range(count))
    out = set()
    for part in spec.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= count:
            raise ValueError(
                f"{part!r} is not a GPU index 0-{count - 1} (give `all`, `none` or a comma list such as 6,7)"
            )
        out.add(int(part))
    return frozenset(out)


def resolve(profile: str, family: str | None) -> MigProfile | None:
    """The profile `profile` (e.g. "3g.40gb", "1g.10gb+me") on a GPU of `family`, or None when that family has no
    such profile."""
    if family is None:
        return None
    return family_table(family).get(profile.lower())


def known_profile(profile: str) -> bool:
    """Whether any family has a profile of this name (what a request may ask for)."""
    return any(profile.lower() in family_table(f) for f in _FAMILIES)


_NAME = re.compile(r"^(\d+)g\.(\d+)gb(.*)$")


def _name_key(name: str) -> tuple[int, int, str]:
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else (1 << 30, 0, name)


def all_profile_names() -> list[str]:
    """Every profile name of every family (`+me` variants included), by compute slices, then memory."""
    names: dict[str, None] = {}
    for family in _FAMILIES:
        names.update(dict.fromkeys(family_table(family)))
    return sorted(names, key=_name_key)


def free_starts(used_mask: int, profile: MigProfile) -> list[int]:
    """Start slices where an instance of `profile` fits next to the instances in `used_mask`: none for a `+me`
    profile while the mask holds MEDIA_BIT (another `+me` instance has the media engines)."""
    return [s for s in profile.starts if not used_mask & profile.mask(s)]


def max_instances(used_mask: int, profile: MigProfile) -> int:
    """How many more instances of `profile` fit. The valid starts are aligned to the profile's size, so the free
    ones never overlap each other and each can be taken; a `+me` profile fits once at most (one set of media
    engines per GPU), and no profile more often than its `max_count`."""
    n = len(free_starts(used_mask, profile))
    if profile.media:
        n = min(n, 1)
    return min(n, profile.max_count) if profile.max_count else n


def used_slices(mask: int) -> int:
    """Memory slices in use in a MIG state mask (MEDIA_BIT is not a slice)."""
    return bin(mask & FULL_MASK).count("1")


def free_slices(mask: int, family: str | None) -> int:
    """Memory slices of a GPU of `family` that the MIG state mask leaves free."""
    return family_slices(family)[1] - used_slices(mask & full_mask(family))
