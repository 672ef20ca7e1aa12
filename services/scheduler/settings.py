"""Scheduler settings. Defaults suit production; the local cluster shortens the timeouts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from phalanx.core.capacity import PLACEMENT_BUDGET_MS
from phalanx.core.fabric import Fabric
from phalanx.core.preemption import PRODUCTION_POLICY, PreemptionPolicy
from phalanx.core.snapshot import ElasticPolicy


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
    # A gang torn down by a failure (node lost, GPU failed, rank lost, launch timeout) is requeued up to this many
    # failed attempts in all, each after a backoff of retry_backoff_s doubling per failure up to retry_backoff_max_s.
    # Preemptions do not count.
    max_attempts: int = 5
    retry_backoff_s: float = 10.0
    retry_backoff_max_s: float = 300.0
    # Preemption (phalanx.core.preemption): minimum runtime before a gang can be preempted, and the grace period a
    # victim gets to checkpoint. While victims checkpoint, the ledger is checked this often for their commit.
    preemption: PreemptionPolicy = PRODUCTION_POLICY
    preemption_poll_s: float = 0.5
    # Elastic gangs (phalanx.core.elastic): a running one below its maximum grows at most once per
    # elastic.grow_interval_s, by a meaningful step, through the checkpoint handshake; None: they never grow.
    elastic: ElasticPolicy | None = ElasticPolicy()
    # EASY backfill behind a blocked head of the queue (phalanx.core.backfill); False: strict order.
    backfill: bool = True
    # Decide at submit (admission_lane.py): a batch of submits on a settled view is decided on its arrivals alone,
    # without a pass over the whole queue. False (--no-admission-lane): every submit waits for a pass, as before
    # issue 35 (the benchmarks' baseline).
    admission_lane: bool = True
    # The status lane (status_lane.py): rank reports, heartbeats and acks reach the ledger in transactions of their
    # own, never behind a cycle. False (--no-status-lane): cycles take them, as before issue 35 (a baseline).
    status_lane: bool = True
    # The accept lane (SchedulerService.submit): a submission that waits for a pass whatever happens is written
    # PENDING by the status lane and answered then, not after the cycles in flight. False (--no-accept-lane): it
    # waits for its cycle, as before issue 35 (a baseline). Needs the status lane.
    accept_lane: bool = True
    # The fence in the pipeline (ledger.fence, PostgreSQL): a leader whose view is its own and whose lease is far
    # from its end decides without waiting for the clock row's lock, and sends the lock, checked by the server (the
    # generation, its lease), first with its closing writes and commit. False (--no-fence-in-pipeline): every cycle
    # waits for the lock first, as before (a baseline).
    fence_in_pipeline: bool = True
    # Bounds of one backfill pass behind a blocked head: at most this many gangs tried (Slurm's bf_max_job_test;
    # 0: no limit) and this much time (ms; 0: none). The gangs not tried wait for a pass whose inputs changed.
    backfill_depth: int = 1000
    backfill_budget_ms: float = 50.0
    # A preemptor keeps what it freed (phalanx.core.claims). False only to show what breaks without it (the live
    # invariant test's check of its own checker): --no-claims.
    claims: bool = True
    # Time budget of each placement's exact search (ms; 0: none); past it the heuristic fill, said in the reason.
    placement_budget_ms: float = PLACEMENT_BUDGET_MS
    # Heartbeats live in memory; the ledger sees them at most this often (other replicas read leases from it).
    heartbeat_persist_interval: float = 5.0
    # Without LISTEN/NOTIFY (SQLite), look at the ledger for other processes' changes this often.
    poll_interval: float = 1.0
    metrics_port: int | None = None
    # Several replicas: one leader schedules and fires timers, holding a lease on the clock row with a fencing
    # epoch (docs/design.md, "Leadership"); the others run commands only. It is renewed every third of the lease
    # and another replica takes over once it runs out. A session idle inside a transaction for
    # max(2, 2 x lease) seconds is ended by PostgreSQL, freeing the clock row a stopped leader held.
    leader_lease_s: float = 5.0
    replica_id: str = ""
    # Where ranks reach the checkpoint coordinator and write their shards (phalanx.train reads them from
    # PHALANX_CHECKPOINT_ADDR / PHALANX_CHECKPOINT_DIR); "" leaves them unset (a job may set them in its env).
    checkpoint_addr: str = ""
    checkpoint_dir: str = ""
    # MIG mode switches on --mig-manage agents (services/scheduler/migmode.py): a GPU whose mode changed less than
    # mig_switch_hold_s ago is not switched again; one whose switch failed is not asked again for
    # mig_switch_backoff_s.
    mig_switch_hold_s: float = 60.0
    mig_switch_backoff_s: float = 60.0
    # Retention (services/scheduler/retention.py): finished jobs stay in `jobs` this long after they finished, then the
    # leader moves them to job_archive (their goodput into goodput_totals); 0: never (--retain-finished).
    retain_finished_s: float = 30 * 86400.0
    # Limits that keep any one caller from exhausting the server (docs/guides/quotas-and-tenants.md, "Limits"):
    # a request or response message at most max_message_bytes; per tenant (per caller with authentication off) at
    # most max_watches WatchJobs streams at once, each buffering at most watch_queue changes (a watcher further
    # behind is ended, RESOURCE_EXHAUSTED); a job spec at most max_replicas replicas, max_command_bytes of command,
    # max_env_vars variables and max_env_bytes of env.
    max_message_bytes: int = 16 * 1024 * 1024
    max_watches: int = 64
    watch_queue: int = 10_000
    max_replicas: int = 100_000
    max_command_bytes: int = 256 * 1024
    max_env_vars: int = 4096
    max_env_bytes: int = 256 * 1024
    # Job arrays (JobSpec.array): indices 0 to max_array_size - 1, so at most that many tasks (Slurm's MaxArraySize)
    max_array_size: int = 10_001
    # The time the cycles decide at (unix seconds): the wall clock. A test gives a clock it moves itself, so that
    # time limits, backoffs, preemption deadlines and leases pass when it says and not when a loaded machine
    # happens to get there (not a command-line flag).
    clock: Callable[[], float] = time.time
