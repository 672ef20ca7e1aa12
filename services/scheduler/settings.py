"""Scheduler settings. Defaults suit production; the local cluster shortens the timeouts."""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.core.fabric import Fabric


@dataclass(frozen=True)
class SchedulerSettings:
    db_url: str
    listen: str = "127.0.0.1:50051"
    fabric: Fabric = field(default_factory=Fabric)
    heartbeat_interval: float = 2.0
    # A node whose agent has not heartbeated for this long is lost. After a (re)start every node gets this long
    # to reconnect first.
    lease_timeout: float = 15.0
    # A gang whose ranks are not all running this long after its reservation is torn down whole and requeued.
    launch_timeout: float = 60.0
    max_attempts: int = 5
    # Heartbeats live in memory; the ledger sees them at most this often (other replicas read leases from it).
    heartbeat_persist_interval: float = 5.0
    # Without LISTEN/NOTIFY (SQLite), look at the ledger for other processes' changes this often.
    poll_interval: float = 1.0
    metrics_port: int | None = None
    replica_id: str = ""
    # Where ranks reach the checkpoint coordinator and write their shards (phalanx.train reads them from
    # PHALANX_CHECKPOINT_ADDR / PHALANX_CHECKPOINT_DIR); "" leaves them unset (a job may set them in its env).
    checkpoint_addr: str = ""
    checkpoint_dir: str = ""
