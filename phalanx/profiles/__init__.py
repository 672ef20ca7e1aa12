"""Simulated host profiles shipped with Phalanx: `nvidia-smi topo -m` tables plus GPU model and memory.

Each profile is a `<name>.txt` file in this package: `# key: value` header comments (profile, gpu_model,
memory_mib, host_memory, optional host_cpus / nvlink_domain / nvlink_domain_size) followed by the matrix in
`nvidia-smi topo -m` form.
A profile with a `# base: <profile>` header and no matrix reuses that shipped profile's matrix and headers (its own
headers win): `gb200-nvl72` is the `gb200-nvl72-tray` tray, simulated as racks of 18 trays in one NVLink domain.

    from phalanx.profiles import load_profile, list_profiles
    p = load_profile("dgx-h100")
    p.gpu_model, p.memory_mib, p.gpu_count, p.dump.matrix["GPU0"]["NIC0"]   # 'NVIDIA H100 80GB HBM3', 81559, 8, 'PIX'
    p.host_cpus, p.host_memory                                               # 192, 2199023255552 (2T)

Host resources (what a simulated agent registers as its CPUs and memory, RegisterNodeRequest.cpus / memory_bytes):
`host_cpus` is the `# host_cpus: N` header when given, else the number of logical CPUs in the union of the
matrix's "CPU Affinity" ranges (0-47,96-143 and 48-95,144-191 -> 192); `host_memory` is the `# host_memory: SIZE`
header in bytes (binary units as phalanx.core.resources.parse_size reads them: 2T, 960G, 512G). Either is 0 when
the profile does not say (a bare dump has no host_memory header; one without a CPU Affinity column, no CPUs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from phalanx.core.resources import parse_size
from phalanx.core.topo_dump import TopoDump, parse_topo

_HEADER_RE = re.compile(r"^#\s*([a-z_]+)\s*:\s*(.+?)\s*$")


class UnknownProfile(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


@dataclass(frozen=True)
class HostProfile:
    name: str
    gpu_model: str
    memory_mib: int
    dump: TopoDump
    description: str = ""
    meta: dict[str, str] = field(default_factory=dict)  # every `# key: value` header
    text: str = ""

    @property
    def gpu_count(self) -> int:
        return len(self.dump.gpus)

    @property
    def nvlink_domain(self) -> str:
        """ "nvl72" for a GB200 NVL72 tray, else ""."""
        return self.meta.get("nvlink_domain", "")

    @property
    def nvlink_domain_nodes(self) -> int:
        """Hosts of this profile in one multi-node NVLink domain (18 for a GB200 NVL72 tray: 72 GPUs / 4), else 1."""
        if not self.nvlink_domain or not self.gpu_count:
            return 1
        try:
            size = int(self.meta.get("nvlink_domain_size", "0"))
        except ValueError:
            return 1
        return max(1, size // self.gpu_count)

    @property
    def host_cpus(self) -> int:
        """Logical CPUs of the host: the `host_cpus` header, else those the GPUs' CPU Affinity ranges cover; 0 when
        neither says."""
        if "host_cpus" in self.meta:
            return int(self.meta["host_cpus"])
        return len(affinity_cpus(self.dump))

    @property
    def host_memory(self) -> int:
        """The host's memory in bytes (the `host_memory` header, e.g. 2T); 0 when the profile does not say."""
        value = self.meta.get("host_memory", "")
        return parse_size(value) if value else 0


def parse_cpu_list(text: str) -> set[int]:
    """A Linux CPU list ("0-47,96-143", "3", "0-3,8") -> its CPU numbers; ValueError when it is not one."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list like 0-47,96-143")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{text!r} is not a CPU list like 0-47,96-143 ({part} runs backwards)")
        cpus.update(range(first, last + 1))
    return cpus


def affinity_cpus(dump: TopoDump) -> set[int]:
    """The logical CPUs in the union of the matrix's CPU Affinity column (N/A and unreadable cells skipped)."""
    cpus: set[int] = set()
    for device in dump.devices:
        value = dump.cpu_affinity(device)
        if value:
            try:
                cpus |= parse_cpu_list(value)
            except ValueError:
                continue
    return cpus


def parse_profile(text: str, name: str = "") -> HostProfile:
    """Parse a profile file's text (also works on a bare `nvidia-smi topo -m` dump: model and memory unknown)."""
    meta: dict[str, str] = {}
    description = ""
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if not s.startswith("#"):
            break
        m = _HEADER_RE.match(s)
        if m:
            meta[m.group(1)] = m.group(2)
        elif not description and "profile" not in s.lower():
            description = s.lstrip("# ").rstrip(".")
    for key, check in (("host_cpus", _count), ("host_memory", parse_size)):
        if key in meta:
            try:
                check(meta[key])
            except ValueError as exc:
                raise ValueError(
                    f"profile {meta.get('profile', name)!r}: bad {key} header {meta[key]!r}: {exc}"
                ) from exc
    if "base" in meta:
        if meta["base"] == meta.get("profile", name):
            raise ValueError(f"profile {meta['base']!r} names itself as its base")
        base = load_profile(meta["base"])
        body = "\n".join(line for line in base.text.splitlines() if not line.lstrip().startswith("#"))
        text = text.rstrip("\n") + "\n" + body.lstrip("\n")
        meta = {**{k: v for k, v in base.meta.items() if k != "profile"}, **meta}
        dump = base.dump
    else:
        dump = parse_topo(text)
    return HostProfile(
        name=meta.get("profile", name),
        gpu_model=meta.get("gpu_model", "NVIDIA GPU (simulated)"),
        memory_mib=int(meta.get("memory_mib", "0")),
        dump=dump,
        description=description,
        meta=meta,
        text=text,
    )


def _count(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise ValueError("not a positive whole number")
    return int(text)


def _files():
    return resources.files(__name__)


def list_profiles() -> list[str]:
    """Names of the shipped profiles, sorted ("dgx-a100", "dgx-h100", ...)."""
    return sorted(p.name[:-4] for p in _files().iterdir() if p.name.endswith(".txt"))


def load_profile(name: str) -> HostProfile:
    """Load a shipped profile by name; raises UnknownProfile (a KeyError) listing the known names."""
    resource = _files().joinpath(f"{name}.txt")
    if not resource.is_file():
        raise UnknownProfile(f"unknown host profile {name!r}; known: {', '.join(list_profiles())}")
    return parse_profile(resource.read_text(encoding="utf-8"), name=name)


def load_profile_file(path: str | Path) -> HostProfile:
    """A profile (or raw `nvidia-smi topo -m` dump) from any file."""
    path = Path(path)
    return parse_profile(path.read_text(encoding="utf-8"), name=path.stem)


__all__ = [
    "HostProfile",
    "UnknownProfile",
    "affinity_cpus",
    "list_profiles",
    "load_profile",
    "load_profile_file",
    "parse_cpu_list",
    "parse_profile",
]
