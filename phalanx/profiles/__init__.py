"""Simulated host profiles shipped with Phalanx: `nvidia-smi topo -m` tables plus GPU model and memory.

Each profile is a `<name>.txt` file in this package: `# key: value` header comments (profile, gpu_model,
memory_mib, optional nvlink_domain / nvlink_domain_size) followed by the matrix in `nvidia-smi topo -m` form.
A profile with a `# base: <profile>` header and no matrix reuses that shipped profile's matrix and headers (its own
headers win): `gb200-nvl72` is the `gb200-nvl72-tray` tray, simulated as racks of 18 trays in one NVLink domain.

    from phalanx.profiles import load_profile, list_profiles
    p = load_profile("dgx-h100")
    p.gpu_model, p.memory_mib, p.gpu_count, p.dump.matrix["GPU0"]["NIC0"]   # 'NVIDIA H100 80GB HBM3', 81559, 8, 'PIX'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

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


__all__ = ["HostProfile", "UnknownProfile", "list_profiles", "load_profile", "load_profile_file", "parse_profile"]
