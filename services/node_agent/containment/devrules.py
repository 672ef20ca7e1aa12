"""Device rules (cgroup v1 devices hierarchy; on cgroup v2 only on a hybrid host, see V2_DEVICES_NOT_ENFORCED): which
device nodes an attempt's processes may open: the usual /dev/null-like devices, the NVIDIA control devices, its own
GPUs, nvidia-uvm, and only its own MIG instances' nvidia-caps.
"""

from __future__ import annotations

from pathlib import Path

from .base import Limits, _read, _write

# /dev/null, zero, full, random, urandom, tty, ptmx, the pseudo-terminals, nvidiactl and nvidia-modeset.
_V1_ALWAYS_ALLOWED = (
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
    "c 195:255 rwm",
    "c 195:254 rwm",
)


def _proc_device_majors(proc_devices: str) -> dict[str, int]:
    majors: dict[str, int] = {}
    for line in (_read(Path(proc_devices)) or "").splitlines():
        if line.startswith("Block devices"):
            break
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def nvidia_cap_minors(
    instances: list[tuple[int, int, int]], mig_minors: str = "/proc/driver/nvidia-caps/mig-minors"
) -> tuple[int, ...]:
    """The nvidia-caps minors of MIG instances (gpu, GPU instance id, compute instance id): the driver's
    mig-minors file maps "gpu<G>/gi<I>/access" and "gpu<G>/gi<I>/ci<C>/access" to the minor of
    /dev/nvidia-caps/nvidia-cap<minor>; a CUDA process on a MIG device opens both. Missing entries are skipped."""
    table: dict[str, int] = {}
    for line in (_read(Path(mig_minors)) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            table[parts[0]] = int(parts[1])
    found: set[int] = set()
    for gpu, gi, ci in instances:
        for name in (f"gpu{gpu}/gi{gi}/access", f"gpu{gpu}/gi{gi}/ci{ci}/access"):
            if name in table:
                found.add(table[name])
    return tuple(sorted(found))


def device_rules(limits: Limits, proc_devices: str = "/proc/devices") -> list[str]:
    """The v1 devices.allow rules of a group: the usual /dev/null-like devices, nvidiactl and nvidia-modeset, the
    group's /dev/nvidia<minor>, nvidia-uvm (and uvm-tools), and only its own /dev/nvidia-caps/nvidia-cap<minor>."""
    majors = _proc_device_majors(proc_devices)
    rules = [*_V1_ALWAYS_ALLOWED, *(f"c 195:{minor} rwm" for minor in limits.gpu_minors or ())]
    if "nvidia-uvm" in majors:
        rules.append(f"c {majors['nvidia-uvm']}:* rwm")
    if "nvidia-caps" in majors:
        rules += [f"c {majors['nvidia-caps']}:{minor} rwm" for minor in limits.cap_minors]
    return rules


def _device_rules(d: Path, limits: Limits, proc_devices: str) -> None:
    # A devices cgroup can only narrow what its parent allows: deny everything, then allow the list.
    _write(d / "devices.deny", "a")
    for rule in device_rules(limits, proc_devices):
        _write(d / "devices.allow", rule)
