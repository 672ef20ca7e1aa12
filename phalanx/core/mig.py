"""MIG (Multi-Instance GPU) profiles and their placement rules, as NVIDIA's MIG User Guide gives them.

A MIG-capable GPU has 8 memory slices and 7 compute slices. A GPU instance of a profile occupies `size` consecutive
memory slices starting at one of the profile's valid start slices (`nvidia-smi mig -lgipp` prints them as
`{0,2,4,6}:2`). Every family uses the same six shapes; only the memory, and so the names, differ:

    shape      compute  memory slices  valid starts     H100/A100 80GB  A100 40GB  H200 141GB  B200 180GB
    1g (small)    1          1         0,1,2,3,4,5,6    1g.10gb         1g.5gb     1g.18gb     1g.23gb
    1g (large)    1          2         0,2,4,6          1g.20gb         1g.10gb    1g.35gb     1g.45gb
    2g            2          2         0,2,4            2g.20gb         2g.10gb    2g.35gb     2g.45gb
    3g            3          4         0,4              3g.40gb         3g.20gb    3g.71gb     3g.90gb
    4g            4          4         0                4g.40gb         4g.20gb    4g.71gb     4g.90gb
    7g            7          8         0                7g.80gb         7g.40gb    7g.141gb    7g.180gb

Slice 7 holds no 1g (small) instance: seven of them fill slices 0-6, and the compute slices (7) run out first.
Within these rules any set of non-overlapping instances is a valid geometry (4g + 3g, 3g + 3g, 2g + 2g + 2g + 1g...),
so a GPU's MIG state is just the bit mask of its used memory slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

MEMORY_SLICES = 8
FULL_MASK = (1 << MEMORY_SLICES) - 1


@dataclass(frozen=True, slots=True)
class MigProfile:
    name: str
    compute: int  # compute slices (the "Ng" of the name)
    size: int  # memory slices
    starts: tuple[int, ...]  # valid start memory slices
    memory_gb: int

    def mask(self, start: int) -> int:
        return ((1 << self.size) - 1) << start


# (compute, memory slices, valid starts) of the six shapes, in the order of the table above.
_SHAPES = (
    (1, 1, (0, 1, 2, 3, 4, 5, 6)),
    (1, 2, (0, 2, 4, 6)),
    (2, 2, (0, 2, 4)),
    (3, 4, (0, 4)),
    (4, 4, (0,)),
    (7, 8, (0,)),
)

# Family -> memory (GB) of each shape, in shape order.
_FAMILIES: dict[str, tuple[int, ...]] = {
    "A100-40GB": (5, 10, 10, 20, 20, 40),
    "A100-80GB": (10, 20, 20, 40, 40, 80),
    "H100-80GB": (10, 20, 20, 40, 40, 80),
    "H100-94GB": (12, 24, 24, 47, 47, 94),
    "H100-96GB": (12, 24, 24, 48, 48, 96),
    "H200-141GB": (18, 35, 35, 71, 71, 141),
    "B200-180GB": (23, 45, 45, 90, 90, 180),
    "GB200-186GB": (23, 47, 47, 93, 93, 186),
}

FAMILIES = tuple(_FAMILIES)


@cache
def family_profiles(family: str) -> dict[str, MigProfile]:
    """The profiles of a family by name, smallest first; empty for an unknown family."""
    memory = _FAMILIES.get(family)
    if memory is None:
        return {}
    return {
        f"{c}g.{gb}gb": MigProfile(f"{c}g.{gb}gb", c, size, starts, gb)
        for (c, size, starts), gb in zip(_SHAPES, memory, strict=True)
    }


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
    if "H200" in name and "GH200" not in name:
        return "H200-141GB"
    if "H100" in name or "H800" in name or "GH200" in name:
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
        return None  # A30 has MIG but only 4 slices; not modelled
    return None


def resolve(profile: str, family: str | None) -> MigProfile | None:
    """The profile `profile` (e.g. "3g.40gb") on a GPU of `family`, or None when that family has no such profile."""
    if family is None:
        return None
    return family_profiles(family).get(profile.lower())


def known_profile(profile: str) -> bool:
    """Whether any family has a profile of this name (what a request may ask for)."""
    return any(profile.lower() in family_profiles(f) for f in _FAMILIES)


def all_profile_names() -> list[str]:
    names: dict[str, None] = {}
    for family in _FAMILIES:
        names.update(dict.fromkeys(family_profiles(family)))
    return sorted(names, key=lambda n: (int(n.split("g.")[0]), float(n.split("g.")[1][:-2])))


def free_starts(used_mask: int, profile: MigProfile) -> list[int]:
    """Start slices where an instance of `profile` fits next to the instances in `used_mask`."""
    return [s for s in profile.starts if not used_mask & profile.mask(s)]


def max_instances(used_mask: int, profile: MigProfile) -> int:
    """How many more instances of `profile` fit. The valid starts are aligned to the profile's size, so the free
    ones never overlap each other and each can be taken."""
    return len(free_starts(used_mask, profile))


def used_slices(mask: int) -> int:
    return bin(mask & FULL_MASK).count("1")
