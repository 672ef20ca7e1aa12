"""Parser and renderer for `nvidia-smi topo -m` dumps, and a closeness ranking of its cells.

Pure functions: `parse_topo(text)` takes the dump as a string (tabs or runs of spaces, `#` comment lines, stray
lines such as the command itself before the header, extra columns such as `CPU Affinity` / `NUMA Affinity` /
`GPU NUMA ID`, NIC rows, the `Legend:` and `NIC Legend:` sections) and returns a `TopoDump`. `render_topo(dump)`
writes it back as a table; `parse_topo(render_topo(d)).matrix == d.matrix` for every dump `d`.

Closeness: `link_rank(cell)` orders cells from far to near: SYS < NODE < PHB < PXB < PIX < NV1 < ... < NV18 < X.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

# Column titles that follow the device columns; matched greedily on whitespace-separated header words.
EXTRA_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")

_DEVICE_RE = re.compile(r"^(?:GPU\d+|NIC\d+|mlx\d+_\d+|[a-z]+\d*_\d+)$")
_NIC_LEGEND_RE = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_NV_RE = re.compile(r"^NV(\d+)$")

# Far to near. Older drivers wrote SOC for SYS and CPU for PHB.
_PCI_RANK = {"SYS": 1, "SOC": 1, "NODE": 2, "PHB": 3, "CPU": 3, "PXB": 4, "PIX": 5}
NV_BASE = 100
SELF_RANK = 10_000


class TopoParseError(ValueError):
    """The text is not a `nvidia-smi topo -m` matrix."""


@dataclass
class TopoDump:
    """One parsed `nvidia-smi topo -m` table.

    devices: the column order of the matrix ("GPU0", ..., "NIC0", ...).
    matrix: row device -> column device -> cell ("X" on the diagonal, "NV18", "PIX", "SYS", ...). Rows absent
        from the dump (partial dumps) are absent here too.
    extras: row device -> extra column title -> raw value ("CPU Affinity" -> "0-47,96-143").
    nic_devices: "NIC0" -> "mlx5_0" from the NIC Legend (empty when the dump has none).
    """

    devices: list[str]
    matrix: dict[str, dict[str, str]]
    extras: dict[str, dict[str, str]] = field(default_factory=dict)
    extra_columns: list[str] = field(default_factory=list)
    nic_devices: dict[str, str] = field(default_factory=dict)
    has_legend: bool = False

    @property
    def gpus(self) -> list[str]:
        return [d for d in self.devices if d.startswith("GPU")]

    @property
    def nics(self) -> list[str]:
        return [d for d in self.devices if not d.startswith("GPU")]

    def cell(self, a: str, b: str) -> str | None:
        """The cell between a and b, from a's row, else b's row (dumps are symmetric); None when neither exists."""
        if a == b:
            return "X"
        value = self.matrix.get(a, {}).get(b)
        if value is None:
            value = self.matrix.get(b, {}).get(a)
        return value

    def cpu_affinity(self, device: str) -> str | None:
        return _na(self.extras.get(device, {}).get("CPU Affinity"))

    def numa_affinity(self, device: str) -> str | None:
        return _na(self.extras.get(device, {}).get("NUMA Affinity"))

    def gpu_numa_id(self, device: str) -> str | None:
        return _na(self.extras.get(device, {}).get("GPU NUMA ID"))

    def numa_node(self, device: str) -> int:
        """First NUMA node of the device's NUMA affinity ("0,3-9" -> 0), -1 when unknown."""
        value = self.numa_affinity(device)
        if value:
            m = re.match(r"^(\d+)", value)
            if m:
                return int(m.group(1))
        return -1

    def nic_device(self, nic: str) -> str:
        """The NIC's device name (mlx5_0); a NIC column already named like a device names itself."""
        if nic in self.nic_devices:
            return self.nic_devices[nic]
        return "" if nic.startswith("NIC") else nic

    def nearest_nics(self, farthest: str = "NODE") -> dict[str, str]:
        """GPU -> its nearest NIC, at most `farthest` away (default NODE: anything closer than SYS; the node agent
        reports a GPU's own NIC only at PXB or closer, with no host bridge on the way).

        Rails: GPUs with equally close NICs are matched to them one GPU per NIC, in device order, where the layout
        allows (DGX A100: GPU0 and GPU1 are PXB to NIC0 and NIC1 -> GPU0 gets NIC0, GPU1 NIC1), as NCCL would use
        them; two GPUs may still share a NIC when it is the only close one.
        """
        limit = link_rank(farthest)
        load: dict[str, int] = {n: 0 for n in self.nics}
        order = {n: i for i, n in enumerate(self.nics)}
        result: dict[str, str] = {}
        for gpu in self.gpus:
            best_rank, best = limit - 1, []
            for nic in self.nics:
                cell = self.cell(gpu, nic)
                if cell is None:
                    continue
                r = link_rank(cell)
                if r < limit:
                    continue
                if r > best_rank:
                    best_rank, best = r, [nic]
                elif r == best_rank:
                    best.append(nic)
            if best:
                pick = min(best, key=lambda n: (load[n], order[n]))
                load[pick] += 1
                result[gpu] = pick
        return result

    def nearest_gpus(self, farthest: str = "NODE") -> dict[str, str]:
        """NIC -> the first GPU that took it in `nearest_nics(farthest)`, else its closest GPU at most `farthest`
        away; none otherwise."""
        limit = link_rank(farthest)
        result: dict[str, str] = {}
        for gpu, nic in self.nearest_nics(farthest).items():
            result.setdefault(nic, gpu)
        for nic in self.nics:
            if nic in result:
                continue
            best_rank, best = limit - 1, None
            for gpu in self.gpus:
                cell = self.cell(nic, gpu)
                if cell is not None and link_rank(cell) > best_rank:
                    best_rank, best = link_rank(cell), gpu
            if best is not None:
                result[nic] = best
        return result


def _na(value: str | None) -> str | None:
    if value is None or value.strip() in {"", "N/A"}:
        return None
    return value


def link_rank(cell: str) -> int:
    """Closeness of a cell: higher is closer. X > NV18 > NV12 > ... > NV1 > PIX > PXB > PHB > NODE > SYS > unknown."""
    cell = cell.strip()
    if cell == "X":
        return SELF_RANK
    m = _NV_RE.match(cell)
    if m:
        return NV_BASE + int(m.group(1))
    return _PCI_RANK.get(cell, 0)


def is_nvlink(cell: str) -> bool:
    return bool(_NV_RE.match(cell.strip()))


def nvlink_count(cell: str) -> int:
    m = _NV_RE.match(cell.strip())
    return int(m.group(1)) if m else 0


def sort_by_closeness(cells: list[str]) -> list[str]:
    """Cells ordered nearest first."""
    return sorted(cells, key=link_rank, reverse=True)


def _split_header(words: list[str]) -> tuple[list[str], list[str]]:
    devices: list[str] = []
    extras: list[str] = []
    i = 0
    while i < len(words) and _DEVICE_RE.match(words[i]):
        devices.append(words[i])
        i += 1
    rest = words[i:]
    while rest:
        for title in EXTRA_COLUMNS:
            parts = title.split()
            if rest[: len(parts)] == parts:
                extras.append(title)
                rest = rest[len(parts) :]
                break
        else:
            # An unknown title: take one word, so at least the device columns stay right.
            extras.append(rest[0])
            rest = rest[1:]
    return devices, extras


def parse_topo(text: str) -> TopoDump:
    """Parse a `nvidia-smi topo -m` dump. Raises TopoParseError when no matrix header is found."""
    devices: list[str] | None = None
    extra_columns: list[str] = []
    matrix: dict[str, dict[str, str]] = {}
    extras: dict[str, dict[str, str]] = {}
    nic_devices: dict[str, str] = {}
    section = "matrix"
    has_legend = False
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped == "Legend:":
            section, has_legend = "legend", True
            continue
        if stripped == "NIC Legend:":
            section = "nic_legend"
            continue
        if section == "nic_legend":
            m = _NIC_LEGEND_RE.match(stripped)
            if m:
                nic_devices[m.group(1)] = m.group(2)
            continue
        if section == "legend":
            continue
        words = stripped.split()
        if devices is None:
            if _DEVICE_RE.match(words[0]) and (len(words) == 1 or words[1] != "X"):
                devices, extra_columns = _split_header(words)
            continue
        name = words[0]
        if name not in devices:
            continue
        cells = words[1 : 1 + len(devices)]
        if len(cells) < len(devices):
            raise TopoParseError(f"row {name} has {len(cells)} cells, expected {len(devices)}")
        matrix[name] = dict(zip(devices, cells, strict=True))
        if matrix[name][name] != "X":
            raise TopoParseError(f"row {name} has {matrix[name][name]!r} on the diagonal, expected X")
        values = words[1 + len(devices) :]
        if values:
            extras[name] = dict(zip(extra_columns, values, strict=False))
    if devices is None:
        raise TopoParseError("no `nvidia-smi topo -m` header row (GPU0 GPU1 ...) found")
    if not matrix:
        raise TopoParseError("no matrix rows found under the header")
    return TopoDump(
        devices=devices,
        matrix=matrix,
        extras=extras,
        extra_columns=extra_columns,
        nic_devices=nic_devices,
        has_legend=has_legend,
    )


LEGEND = """Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks"""


def render_topo(dump: TopoDump, legend: bool = True) -> str:
    """Render the dump as a `nvidia-smi topo -m` table (space-aligned), with legends."""
    width = max([8, *(len(d) + 2 for d in dump.devices)])
    for row in dump.matrix.values():
        width = max(width, *(len(c) + 2 for c in row.values()))
    extra_cols = [c for c in dump.extra_columns if any(c in e for e in dump.extras.values())] or []
    extra_widths = {
        c: max(len(c) + 2, *(len(e.get(c, "") or "N/A") + 2 for e in dump.extras.values())) for c in extra_cols
    }
    header = " " * width + "".join(d.ljust(width) for d in dump.devices)
    header += "".join(c.ljust(extra_widths[c]) for c in extra_cols)
    lines = [header.rstrip()]
    for device in dump.devices:
        if device not in dump.matrix:
            continue
        row = dump.matrix[device]
        cells = "".join((" X " if row[d] == "X" else row[d]).ljust(width) for d in dump.devices)
        extra = dump.extras.get(device, {})
        tail = ""
        if extra:
            tail = "".join((extra.get(c) or "N/A").ljust(extra_widths[c]) for c in extra_cols)
        lines.append((device.ljust(width) + cells + tail).rstrip())
    out = "\n".join(lines) + "\n"
    if legend:
        out += "\n" + LEGEND + "\n"
        if dump.nic_devices:
            out += "\nNIC Legend:\n\n" + "".join(f"  {n}: {dev}\n" for n, dev in dump.nic_devices.items())
    return out


def matrix_from_pairs(devices: list[str], cell: Callable[[str, str], str]) -> dict[str, dict[str, str]]:
    """Build a full matrix from a function cell(a, b) -> str (called for a != b)."""
    return {a: {b: ("X" if a == b else cell(a, b)) for b in devices} for a in devices}
