"""Node and GPU health: a pure classifier, and a monitor over an NVML or a simulated source.

    faults -> classify() -> NodeHealth(state, per-GPU health with reasons)     (pure, table driven)
    HealthMonitor(source).check() -> (NodeHealth, new events)                    (the agent calls it every beat)

States: HEALTHY; DEGRADED (still schedulable: the scheduler only shows it); FATAL (the GPU is taken out of placement;
a FATAL node, or a node whose GPUs are all FATAL, is unschedulable). Running gangs are not torn down here: that is
the fault-tolerance work; the scheduler only stops placing new work on what is FATAL.

Faults (`Fault.kind`):
- `xid`: an XID event (NVML `nvmlEventSetWait` on `nvmlEventTypeXidCriticalError`), classified by XID_TABLE.
- `ecc_dbe`: volatile uncorrected (double-bit) ECC count > 0 -> FATAL.
- `ecc_sbe`: volatile corrected (single-bit) ECC count above a threshold -> DEGRADED.
- `gpu_lost`: NVML answered NVML_ERROR_GPU_IS_LOST -> FATAL.
- `nvlink_down`: an NVLink that was up at start is no longer active -> DEGRADED.
- `throttle`: clocks event reasons HW slowdown / HW or SW thermal / power brake -> DEGRADED.
- `nvml`: NVML itself failed on the node (node-level) -> FATAL for the node.

Recovery: a condition that is polled (ECC counts, lost GPU, NVLink state, throttling) clears when NVML no longer
shows it. XID events are sticky for the life of the agent process (NVIDIA's resolution for the fatal ones is a GPU
reset or a node reboot, after which the agent restarts); the simulated source clears them when the fault file is
removed. The scheduler follows the next heartbeat either way.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.api.v1 import common_pb2

HEALTHY, DEGRADED, FATAL = "HEALTHY", "DEGRADED", "FATAL"
_RANK = {HEALTHY: 0, DEGRADED: 1, FATAL: 2}
INFO = "INFO"  # an event worth reporting that does not change health (application XIDs)

# XID -> (severity, description). From NVIDIA's XID catalogue ("Analyzing Xid Errors with the Xid Catalog",
# https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, resolution buckets RESET_GPU /
# RESTART_BM / CONTACT_SUPPORT treated as FATAL) and the dynamic page retirement notes
# (https://docs.nvidia.com/deploy/dynamic-page-retirement/). Application-caused XIDs (13, 31, 43, 45, ...) are not
# hardware faults: INFO, reported but not counted. An XID not in the table is DEGRADED (look at it, keep using it).
XID_TABLE: dict[int, tuple[str, str]] = {
    13: (INFO, "graphics engine exception (usually the application)"),
    31: (INFO, "GPU memory page fault (usually the application)"),
    43: (INFO, "GPU stopped processing (the application)"),
    45: (INFO, "preemptive cleanup, due to a previous error"),
    48: (FATAL, "double-bit (uncorrectable) ECC error"),
    61: (DEGRADED, "internal micro-controller breakpoint/warning"),
    62: (DEGRADED, "internal micro-controller halt"),
    63: (DEGRADED, "row remapping / page retirement pending: reset the GPU to apply"),
    64: (FATAL, "row remapping / page retirement failure"),
    74: (FATAL, "NVLink error"),
    79: (FATAL, "GPU has fallen off the bus"),
    92: (DEGRADED, "high single-bit ECC error rate"),
    94: (FATAL, "contained uncorrectable ECC error: reset the GPU"),
    95: (FATAL, "uncontained uncorrectable ECC error"),
    109: (DEGRADED, "context switch timeout"),
    119: (FATAL, "GSP RPC timeout"),
    120: (FATAL, "GSP error"),
    140: (FATAL, "unrecovered ECC error"),
}

# Clocks event ("throttle") reason bits that mean the hardware protects itself (nvmlClocksEventReason*).
THROTTLE_REASONS = {
    0x8: "HW slowdown",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake slowdown",
}

NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10


@dataclass(frozen=True)
class Fault:
    """One observed condition. gpu -1 is the node."""

    gpu: int
    kind: str
    code: int = 0
    detail: str = ""


@dataclass
class GpuHealth:
    state: str = HEALTHY
    reasons: list[str] = field(default_factory=list)


@dataclass
class NodeHealth:
    state: str = HEALTHY
    gpus: dict[int, GpuHealth] = field(default_factory=dict)  # only GPUs that are not HEALTHY
    reason: str = ""

    def fatal_gpus(self) -> set[int]:
        return {i for i, g in self.gpus.items() if g.state == FATAL}

    def signature(self) -> tuple:
        return (self.state, tuple(sorted((i, g.state, tuple(g.reasons)) for i, g in self.gpus.items())), self.reason)


@dataclass(frozen=True)
class Event:
    gpu: int
    severity: str
    kind: str
    code: int
    reason: str
    at: float


def classify_fault(f: Fault, *, sbe_threshold: int = 100) -> tuple[str, str]:
    """(severity, reason) of one fault; severity INFO or HEALTHY for one that does not count."""
    if f.kind == "xid":
        sev, text = XID_TABLE.get(f.code, (DEGRADED, "unclassified XID"))
        return sev, f"XID {f.code}: {text}" + (f" ({f.detail})" if f.detail else "")
    if f.kind == "ecc_dbe":
        return (FATAL, f"{f.code} uncorrectable (double-bit) ECC errors") if f.code > 0 else (HEALTHY, "")
    if f.kind == "ecc_sbe":
        return (
            (DEGRADED, f"{f.code} corrected (single-bit) ECC errors (threshold {sbe_threshold})")
            if f.code > sbe_threshold
            else (HEALTHY, "")
        )
    if f.kind == "gpu_lost":
        return FATAL, "GPU is lost (NVML_ERROR_GPU_IS_LOST)"
    if f.kind == "nvlink_down":
        return DEGRADED, f"NVLink {f.code} is down"
    if f.kind == "throttle":
        names = [n for bit, n in THROTTLE_REASONS.items() if f.code & bit]
        return (DEGRADED, "throttled: " + ", ".join(names)) if names else (HEALTHY, "")
    if f.kind == "nvml":
        return FATAL, f"NVML failed: {f.detail}" if f.detail else "NVML failed"
    return DEGRADED, f"{f.kind} {f.code} {f.detail}".strip()


def classify(faults: Iterable[Fault], gpu_count: int, *, sbe_threshold: int = 100) -> NodeHealth:
    """The node's health from its current faults. A node is FATAL on a node-level fatal fault or when every GPU is
    FATAL; DEGRADED when any GPU is not HEALTHY (one FATAL GPU of eight leaves seven schedulable); else HEALTHY."""
    gpus: dict[int, GpuHealth] = {}
    node_reasons: list[tuple[str, str]] = []
    severity: dict[str, str] = {}
    for f in faults:
        sev, reason = classify_fault(f, sbe_threshold=sbe_threshold)
        if sev in (HEALTHY, INFO):
            continue
        if f.gpu < 0:
            node_reasons.append((sev, reason))
            continue
        g = gpus.setdefault(f.gpu, GpuHealth())
        if reason not in g.reasons:
            g.reasons.append(reason)
            severity[reason] = max(severity.get(reason, HEALTHY), sev, key=_RANK.__getitem__)
        if _RANK[sev] > _RANK[g.state]:
            g.state = sev
    for g in gpus.values():  # the worst reason first
        g.reasons.sort(key=lambda r: -_RANK[severity[r]])
    state = HEALTHY
    if node_reasons:
        state = max((s for s, _ in node_reasons), key=_RANK.__getitem__)
    if gpus:
        state = max(state, DEGRADED, key=_RANK.__getitem__)
    if gpu_count and all(gpus.get(i, GpuHealth()).state == FATAL for i in range(gpu_count)):
        state = FATAL
    parts = [r for _, r in node_reasons]
    parts += [
        f"GPU {i}: {'; '.join(g.reasons)}" for i, g in sorted(gpus.items(), key=lambda kv: (-_RANK[kv[1].state], kv[0]))
    ]
    return NodeHealth(state, gpus, "; ".join(parts))


# ---------------------------------------------------------------------------------------------- sources


class SimulatedHealthSource:
    """Faults injected by hand: `inject(Fault)` / `clear()` in process, or the JSON file `<state_dir>/health.json`
    (for simulated agents run as processes), read on every check:

        [{"gpu": 3, "xid": 79}, {"gpu": 1, "kind": "throttle", "code": 64}, {"gpu": -1, "kind": "nvml"}]

    An entry is `{"gpu": N, "xid": X}` or `{"gpu": N, "kind": K, "code": C, "detail": D}`. The file lists the current
    conditions: removing an entry (or the file) clears it.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    def inject(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def poll(self) -> list[Fault]:
        with self._lock:
            out = list(self._faults)
        if self.path is not None:
            try:
                entries = json.loads(self.path.read_text() or "[]")
            except FileNotFoundError:
                entries = []
            except (OSError, ValueError):
                entries = []  # a half-written file: next check
            for e in entries if isinstance(entries, list) else []:
                if "xid" in e:
                    out.append(Fault(int(e.get("gpu", -1)), "xid", int(e["xid"]), str(e.get("detail", ""))))
                elif "kind" in e:
                    out.append(
                        Fault(int(e.get("gpu", -1)), str(e["kind"]), int(e.get("code", 0)), str(e.get("detail", "")))
                    )
        return out

    def close(self) -> None:
        pass


def _nvml_code(exc: BaseException) -> int | None:
    return getattr(exc, "value", None)


def _address(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class NvmlHealthSource:
    """Faults from NVML (pynvml): XID events from a thread blocked in nvmlEventSetWait (short timeout, so it stops
    promptly), and, on every poll, volatile ECC counts, clocks event reasons and the state of the NVLinks that were
    up when the source started. `nvml` is the pynvml module (or a fake with the same names)."""

    def __init__(self, nvml: Any = None, *, event_timeout_ms: int = 500, max_nvlinks: int = 18) -> None:
        if nvml is None:
            import pynvml  # only on real GPU hosts

            nvml = pynvml
        self.nvml = nvml
        self.event_timeout_ms = event_timeout_ms
        self._handles: list[Any] = []
        self._links: dict[int, list[int]] = {}
        self._xids: list[Fault] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set = None
        self._start_error = ""
        self.max_nvlinks = max_nvlinks
        try:
            self._start()
        except Exception as exc:  # report it as a node fault rather than crash the agent
            self._start_error = str(exc) or type(exc).__name__

    def _const(self, name: str, default: int) -> int:
        return getattr(self.nvml, name, default)

    def _start(self) -> None:
        n = self.nvml
        n.nvmlInit()
        self._handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
        for i, h in enumerate(self._handles):  # links up now; one going down later is a fault
            up = []
            for link in range(self.max_nvlinks):
                try:
                    if n.nvmlDeviceGetNvLinkState(h, link):
                        up.append(link)
                except Exception:  # no such link / no NVLink on this model
                    break
            self._links[i] = up
        try:
            self._event_set = n.nvmlEventSetCreate()
            xid_type = self._const("nvmlEventTypeXidCriticalError", 0x8)
            for h in self._handles:
                try:
                    n.nvmlDeviceRegisterEvents(h, xid_type, self._event_set)
                except Exception:  # not supported on this GPU: polled faults still work
                    pass
            self._thread = threading.Thread(target=self._wait_events, name="nvml-xid-events", daemon=True)
            self._thread.start()
        except Exception:  # events unsupported (e.g. some vGPU): polling only
            self._event_set = None

    def _index_of(self, handle: Any) -> int:
        # pynvml's handles are ctypes pointers: the event's is a new object for the same device, so compare the
        # addresses (== on two ctypes pointers compares the Python objects).
        address = _address(handle)
        for i, h in enumerate(self._handles):
            if h is handle or (address is not None and _address(h) == address):
                return i
        return -1

    def _wait_events(self) -> None:
        n = self.nvml
        while not self._stop.is_set():
            try:
                data = n.nvmlEventSetWait(self._event_set, self.event_timeout_ms)
            except Exception as exc:
                if _nvml_code(exc) != self._const("NVML_ERROR_TIMEOUT", NVML_ERROR_TIMEOUT):
                    self._stop.wait(self.event_timeout_ms / 1000)
                continue
            gpu = self._index_of(getattr(data, "device", None))
            xid = int(getattr(data, "eventData", 0))
            with self._lock:
                self._xids.append(Fault(gpu, "xid", xid))

    def poll(self) -> list[Fault]:
        if self._start_error:
            return [Fault(-1, "nvml", 0, self._start_error)]
        with self._lock:
            faults = list(dict.fromkeys(self._xids))  # sticky for the process's life
        lost = self._const("NVML_ERROR_GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST)
        uncorrected = self._const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        corrected = self._const("NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
        volatile = self._const("NVML_VOLATILE_ECC", 0)
        for i, h in enumerate(self._handles):
            try:
                faults += self._poll_gpu(i, h, uncorrected, corrected, volatile)
            except Exception as exc:
                if _nvml_code(exc) == lost:
                    faults.append(Fault(i, "gpu_lost"))
                else:
                    faults.append(Fault(i, "nvml_query", 0, str(exc)[:200]))
        return faults

    def _poll_gpu(self, i: int, h: Any, uncorrected: int, corrected: int, volatile: int) -> list[Fault]:
        n = self.nvml
        out: list[Fault] = []
        lost = self._const("NVML_ERROR_GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST)

        def optional(fn, *args):
            try:
                return fn(*args)
            except Exception as exc:  # not supported: nothing to say; lost: re-raise
                if _nvml_code(exc) == lost:
                    raise
                return None

        dbe = optional(n.nvmlDeviceGetTotalEccErrors, h, uncorrected, volatile)
        if dbe:
            out.append(Fault(i, "ecc_dbe", int(dbe)))
        sbe = optional(n.nvmlDeviceGetTotalEccErrors, h, corrected, volatile)
        if sbe:
            out.append(Fault(i, "ecc_sbe", int(sbe)))
        get_reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            n, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        reasons = optional(get_reasons, h) if get_reasons else None
        mask = sum(THROTTLE_REASONS) if reasons else 0
        if reasons and int(reasons) & mask:
            out.append(Fault(i, "throttle", int(reasons) & mask))
        for link in self._links.get(i, ()):
            if optional(n.nvmlDeviceGetNvLinkState, h, link) == 0:
                out.append(Fault(i, "nvlink_down", link))
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.event_timeout_ms / 1000 + 1)
        if self._event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self._event_set)
            except Exception:
                pass


# ---------------------------------------------------------------------------------------------- monitor


class HealthMonitor:
    """Polls a source and turns faults into the node's health and the events since the previous check."""

    def __init__(self, source: Any, gpu_count: int, *, sbe_threshold: int = 100) -> None:
        self.source = source
        self.gpu_count = gpu_count
        self.sbe_threshold = sbe_threshold
        self.health = NodeHealth()
        self._seen: dict[tuple[int, str], str] = {}  # (gpu, reason) -> severity, of the current conditions

    def check(self, now: float | None = None) -> tuple[NodeHealth, list[Event]]:
        now = time.time() if now is None else now
        faults = self.source.poll()
        health = classify(faults, self.gpu_count, sbe_threshold=self.sbe_threshold)
        current: dict[tuple[int, str], tuple[str, Fault]] = {}
        for f in faults:
            sev, reason = classify_fault(f, sbe_threshold=self.sbe_threshold)
            if sev != HEALTHY:
                current.setdefault((f.gpu, reason), (sev, f))
        events = [
            Event(f.gpu, sev, f.kind, f.code, reason, now)
            for (gpu, reason), (sev, f) in current.items()
            if (gpu, reason) not in self._seen
        ]
        events += [
            Event(gpu, HEALTHY, "recovered", 0, f"cleared: {reason}", now)
            for (gpu, reason), sev in self._seen.items()
            if (gpu, reason) not in current and sev != INFO
        ]
        self._seen = {k: sev for k, (sev, _) in current.items()}
        self.health = health
        return health, events

    def close(self) -> None:
        self.source.close()


# ---------------------------------------------------------------------------------------------- protobuf


def health_to_proto(health: NodeHealth):
    from phalanx.api.v1 import common_pb2

    pb_state = _pb_states()
    return common_pb2.NodeHealth(
        state=pb_state[health.state],
        gpus=[
            common_pb2.GpuHealth(index=i, state=pb_state[g.state], reasons=g.reasons)
            for i, g in sorted(health.gpus.items())
        ],
        reason=health.reason,
    )


def event_to_proto(e: Event):
    from phalanx.api.v1 import common_pb2

    severity = _pb_states().get(e.severity, common_pb2.HEALTH_STATE_UNSPECIFIED)
    return common_pb2.HealthEvent(gpu=e.gpu, severity=severity, kind=e.kind, code=e.code, reason=e.reason, at=e.at)


def _pb_states() -> dict[str, common_pb2.HealthState]:
    """Health state (or event severity) -> its protobuf HealthState; INFO reports as HEALTHY."""
    from phalanx.api.v1 import common_pb2

    return {
        HEALTHY: common_pb2.HEALTH_STATE_HEALTHY,
        DEGRADED: common_pb2.HEALTH_STATE_DEGRADED,
        FATAL: common_pb2.HEALTH_STATE_FATAL,
        INFO: common_pb2.HEALTH_STATE_HEALTHY,
    }
