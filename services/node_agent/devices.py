"""Device glue: what the node agent asks of the host's GPUs besides running processes on them.

- MIG (mig_manager.py): a rank's instances are found or made before it starts and given back when it ends; the
  instances left by an earlier agent process are cleaned up; under --mig-manage a GPU's MIG mode is switched when
  the scheduler asks, and every MIG-capable GPU's mode goes out with each heartbeat.
- MPS (mps.py): a fractional rank's GPU gets its control daemon before the share starts; the daemon is told to quit
  after its last share.
- Health (health.py): polled before every heartbeat; the events wait for an answered heartbeat.
- The topology to register: the discovered one, with each MIG-mode GPU's instances as they are now.

NVML calls take a while, so MIG and MPS work runs in worker threads, tracked in the agent's Background (shutdown
waits for them). The NVML bindings are given (`nvml`): this module never loads a simulated host itself.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

from phalanx.api.v1 import agent_pb2

from . import launcher
from ._background import Background
from .health import HealthMonitor, NodeHealth, NvmlHealthSource, SimulatedHealthSource, event_to_proto, health_to_proto
from .identity import RankUser
from .mig_manager import MigBackend, MigError, MigManager, backend_for
from .mps import CONTROL as MPS_CONTROL
from .mps import MpsManager, strip_mps, write_fake_control
from .state import AgentState, RankRecord

_MODES = {0: agent_pb2.GpuInfo.MIG_MODE_DISABLED, 1: agent_pb2.GpuInfo.MIG_MODE_ENABLED}


class DeviceGlue:
    """MIG, MPS and health for one agent. `topology` is the agent's registered topology (its GPUs' MIG modes are
    kept current here, so that a re-registration sends them)."""

    def __init__(
        self,
        topology: agent_pb2.HostTopology,
        state: AgentState,
        state_dir: Path,
        log: Any,
        background: Background,
        *,
        nvml: Any = None,
        mig_backend: MigBackend | None = None,
        mig_manage: bool = False,
        mig_wait_s: float = 30.0,
        mps_control: str | None = None,
        health_source: object | None = None,
        health_enabled: bool = True,
        ecc_sbe_threshold: int = 100,
    ) -> None:
        self.topology = topology
        self.state = state
        self.log = log
        self.background = background
        self.mig_manage = mig_manage
        self.mig_wait_s = mig_wait_s
        self.mig = MigManager(
            mig_backend or backend_for(topology, nvml),
            topology,
            created=state.mig_created,
            on_change=lambda records: setattr(state, "mig_created", records),
        )
        self.gpu_memory = {g.index: g.memory_mib for g in topology.gpus}
        self.gpu_uuids = {g.index: g.uuid for g in topology.gpus}
        # GPU index -> device minor (/dev/nvidia<minor>), the index where discovery did not say
        self.minors = {g.index: (g.minor_number if g.HasField("minor_number") else g.index) for g in topology.gpus}
        self.mig_switching: set[int] = set()  # GPUs whose MIG mode switch is under way
        self.mig_switch_errors: dict[int, str] = {}  # GPU -> why its last switch failed
        # Fractional shares: one MPS control daemon per GPU that has shares (mps.py).
        control = mps_control or (MPS_CONTROL if topology.profile == "nvml" else write_fake_control(state_dir / "mps"))
        self.mps = MpsManager(state_dir / "mps", control, dict(self.gpu_uuids), log=log)
        # Health: the simulated source exists at once (tests inject into it); NVML's is opened in open_health().
        self.health_enabled = health_enabled
        self.ecc_sbe_threshold = ecc_sbe_threshold
        self.health_source = health_source
        if self.health_source is None and topology.profile != "nvml":
            self.health_source = SimulatedHealthSource(state_dir / "health.json")
        self.health_monitor: HealthMonitor | None = None
        self.health = NodeHealth()
        self.health_events: list = []  # events not yet carried by an answered heartbeat

    # ---------------------------------------------------------------- MIG mode (--mig-manage)

    def mig_mode_status(self) -> list[agent_pb2.MigModeStatus]:
        """In a worker thread: every MIG-capable GPU's mode as NVML has it now, and the last switch's outcome."""
        out = []
        for gpu in self.mig.mig_gpus():
            status = agent_pb2.MigModeStatus(
                gpu=gpu, error=self.mig_switch_errors.get(gpu, ""), switching=gpu in self.mig_switching
            )
            try:
                current, pending = self.mig.backend.mode(gpu)
            except MigError as exc:
                status.error = status.error or str(exc)
                out.append(status)
                continue
            unknown = agent_pb2.GpuInfo.MIG_MODE_UNSUPPORTED  # 0: a mode NVML does not name
            status.current, status.pending = _MODES.get(current, unknown), _MODES.get(pending, unknown)
            if current != pending:
                status.switching = True  # waits for a GPU reset
            self.note_mode(gpu, current)
            out.append(status)
        return out

    def note_mode(self, gpu: int, current: int) -> None:
        """Keep the registered topology's mode of `gpu` what NVML says (a re-registration sends it)."""
        for g in self.topology.gpus:
            if g.index == gpu and current in _MODES:
                g.mig_mode = _MODES[current]

    async def switch_mig_mode(self, req: agent_pb2.SetMigMode) -> None:
        """Switch a GPU's MIG mode when the scheduler asks (only under --mig-manage): reported in the next
        heartbeats as switching, then as the new current mode, or with the error."""
        gpu, enable = req.gpu, req.enable
        if not self.mig_manage:
            self.mig_switch_errors[gpu] = "this agent was not started with --mig-manage"
            self.log.warning("mig_mode_switch_refused", gpu=gpu, reason=self.mig_switch_errors[gpu])
            return
        busy = {g: r.key for r in self.state.ranks.values() if not r.final for g in r.gpus}
        self.mig_switching.add(gpu)
        self.mig_switch_errors.pop(gpu, None)
        self.log.info("mig_mode_switch", gpu=gpu, enable=enable, reason=req.reason)
        try:
            current, _ = await asyncio.to_thread(self.mig.switch_mode, gpu, enable, busy)
            self.note_mode(gpu, current)
        except MigError as exc:
            self.mig_switch_errors[gpu] = str(exc)
            self.log.warning("mig_mode_switch_failed", gpu=gpu, enable=enable, error=str(exc))
        finally:
            self.mig_switching.discard(gpu)

    def clean_up_mig(self) -> None:
        """At start: destroy the MIG instances this agent made that no adopted rank uses (never anyone else's)."""
        destroyed = self.mig.clean_up()
        if destroyed:
            self.log.info("mig_leftovers_destroyed", instances=[f"GPU{g}:{s}+{n}" for g, s, n in destroyed])

    def current_topology(self) -> agent_pb2.HostTopology:
        """The topology to register: the discovered one, with each MIG-mode GPU's instances as they are now, each
        marked `managed` when this agent made it for a rank (anything else is occupied by someone else)."""
        topo = agent_pb2.HostTopology()
        topo.CopyFrom(self.topology)
        if not self.mig.mig_gpus():
            return topo
        found = self.mig.describe()
        for g in topo.gpus:
            if g.mig_mode != agent_pb2.GpuInfo.MIG_MODE_ENABLED or g.index not in found:
                continue
            del g.mig_instances[:]
            for inst, managed in found[g.index]:
                g.mig_instances.add(
                    profile=inst.profile,
                    start=inst.start,
                    size=inst.size,
                    uuid=inst.uuid,
                    managed=managed,
                    gpu_instance_id=inst.gi_id,
                    compute_instance_id=inst.ci_id,
                )
        return topo

    async def log_mig_instances(self) -> None:
        try:
            found = await asyncio.to_thread(self.mig.describe)
        except Exception as exc:  # only a log line
            self.log.warning("mig_instances_unreadable", backend=self.mig.backend.kind, error=repr(exc))
            return
        self.log.info(
            "mig_instances",
            backend=self.mig.backend.kind,
            instances={
                f"GPU{g}": [
                    f"{i.profile}@{i.start}" + (f"={i.uuid}" if i.uuid else "") + ("" if ours else " (not ours)")
                    for i, ours in items
                ]
                for g, items in found.items()
            },
        )

    # ---------------------------------------------------------------- health and heartbeats

    async def open_health(self) -> None:
        if not self.health_enabled:
            return
        if self.health_source is None:
            self.health_source = await asyncio.to_thread(NvmlHealthSource)
        self.health_monitor = HealthMonitor(
            self.health_source, len(self.topology.gpus), sbe_threshold=self.ecc_sbe_threshold
        )

    def close_health(self) -> None:
        if self.health_monitor is not None:
            self.health_monitor.close()

    async def check_health(self) -> None:
        """Poll the health source once; new events queue for the next heartbeat."""
        if self.health_monitor is None:
            return
        try:
            health, events = await asyncio.to_thread(self.health_monitor.check)
        except Exception as exc:  # a broken monitor must not stop heartbeats
            self.log.warning("health_check_failed", error=repr(exc))
            return
        if health.signature() != self.health.signature():
            self.log.warning("health_changed", state=health.state, reason=health.reason, was=self.health.state)
        for e in events:
            self.log.info("health_event", gpu=e.gpu, severity=e.severity, kind=e.kind, code=e.code, reason=e.reason)
        self.health = health
        self.health_events += events

    async def fill_heartbeat(self, req: agent_pb2.HeartbeatRequest) -> int:
        """Put the node's health, its unsent events and (under --mig-manage) the GPUs' MIG modes in a heartbeat;
        the number of events it carries (forgotten once answered: `heartbeat_answered`)."""
        if self.mig_manage and self.mig.mig_gpus():
            req.mig_modes.extend(await asyncio.to_thread(self.mig_mode_status))
        sent = list(self.health_events)
        if self.health_monitor is not None:
            req.health.CopyFrom(health_to_proto(self.health))
            req.events.extend(event_to_proto(e) for e in sent)
        return len(sent)

    def heartbeat_answered(self, events: int) -> None:
        del self.health_events[:events]

    def drain_health(self, req: agent_pb2.HeartbeatRequest) -> None:
        """The draining heartbeat carries the node's health (no events)."""
        if self.health_monitor is not None:
            req.health.CopyFrom(health_to_proto(self.health))

    # ---------------------------------------------------------------- partial GPUs

    async def rank_env(self, rec: RankRecord, env: dict[str, str], user: RankUser) -> dict[str, str]:
        """The rank's environment, for a partial GPU once its MIG instances exist or its GPU's MPS daemon runs.
        Raises MigError/MpsError/ValueError. Only a share gets CUDA_MPS_* variables, the agent's own."""
        env = strip_mps(env)
        if rec.slices and rec.gpu_milli:
            raise ValueError("a rank gets MIG slices or a share of a GPU, not both")
        if rec.slices:
            busy = {
                g: r.key
                for r in self.state.ranks.values()
                if not r.final and not r.slices and r.key != rec.key
                for g in r.gpus
            }
            wanted = [{k: s[k] for k in ("gpu", "profile", "start", "size")} for s in rec.slices]
            fut = asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self.mig.acquire, rec.key, wanted, busy, wait_s=self.mig_wait_s)
            )
            self.background.track(fut)
            try:
                acquired = await asyncio.shield(fut)
            except asyncio.CancelledError:
                # The agent is going away mid-acquisition: give the instances back once they are there.
                def give_back(f: asyncio.Future) -> None:
                    if not f.cancelled() and f.exception() is None:
                        self.release_slices(rec.key, f.result())

                fut.add_done_callback(give_back)
                raise
            rec.slices = acquired
            self.state.save()
            self.log.info(
                "rank_mig_instances",
                rank=rec.key,
                instances=[f"GPU{s['gpu']}:{s['profile']}@{s['start']}={s['uuid']}" for s in acquired],
            )
            return launcher.mig_env(env, [s["uuid"] for s in acquired])
        if rec.gpu_milli:
            if len(rec.gpus) != 1:
                raise ValueError(f"a fractional rank needs exactly one GPU, got {list(rec.gpus)}")
            gpu = rec.gpus[0]
            if gpu not in self.gpu_memory:
                raise ValueError(f"GPU {gpu} does not exist on this host")
            share = launcher.fractional_env(env, gpu, rec.gpu_milli, self.gpu_memory[gpu])
            acquire = functools.partial(self.mps.acquire, rec.key, gpu, user)
            mps_fut = asyncio.get_running_loop().run_in_executor(None, acquire)
            self.background.track(mps_fut)
            try:
                client = await asyncio.shield(mps_fut)
            except asyncio.CancelledError:

                def quit_share(f: asyncio.Future) -> None:
                    if not f.cancelled() and f.exception() is None:
                        self.release_mps(rec.key)

                mps_fut.add_done_callback(quit_share)
                raise
            return {**share, **client}
        return env

    def release_partial(self, rec: RankRecord) -> None:
        """Release the MIG instances of a rank that ended, or its share of its GPU's MPS daemon."""
        self.release_slices(rec.key, [dict(s) for s in rec.slices if s.get("uuid")])
        if rec.gpu_milli:
            self.release_mps(rec.key)

    def release_mps(self, key: str) -> None:
        """In a worker thread: the GPU's MPS daemon is told to quit when this was its last share."""
        if not self.mps.holds(key):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.mps.release(key)
            return
        fut = loop.run_in_executor(None, self.mps.release, key)
        self.background.track(fut)

        def done(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                self.log.error("mps_release_error", rank=key, error=repr(f.exception()))

        fut.add_done_callback(done)

    def release_slices(self, key: str, slices: list[dict]) -> None:
        """In a worker thread (NVML calls take a while); the instances no other rank uses are destroyed."""
        if not slices:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.mig.release(key, slices)
            return
        fut = loop.run_in_executor(None, self.mig.release, key, slices)
        self.background.track(fut)

        def done(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                self.log.error("mig_release_error", rank=key, error=repr(f.exception()))
            elif not f.cancelled() and f.result():
                self.state.save()  # the record of the instances this agent made (mig_created) shrank

        fut.add_done_callback(done)

    def rank_ending(self, rec: RankRecord) -> None:
        """A rank ended whose MIG instances wait for its attempt's container to be empty."""
        if rec.slices:
            self.mig.mark_ending(rec.key)

    def adopt(self, rec: RankRecord) -> None:
        """A live rank of an earlier agent process keeps its MIG instances and its GPU's MPS daemon."""
        if rec.slices:
            self.mig.adopt(rec.key, [s for s in rec.slices if s.get("uuid")])
        if rec.gpu_milli and len(rec.gpus) == 1:
            self.mps.adopt(rec.key, rec.gpus[0])  # its GPU's MPS daemon: kept, not started again

    def stop_unused_mps(self) -> None:
        """MPS daemons an earlier agent left on GPUs that no live share uses any more: stopped (a worker thread)."""
        fut = asyncio.get_running_loop().run_in_executor(None, self.mps.stop_unused)
        self.background.track(fut)

        def stopped(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                self.log.error("mps_cleanup_error", error=repr(f.exception()))

        fut.add_done_callback(stopped)
