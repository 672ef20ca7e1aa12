"""`phalanx-scheduler --db URL --listen HOST:PORT`: the scheduler service as its own process."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, service_pb2, service_pb2_grpc
from phalanx.common.defaults import DEFAULT_DB_URL
from phalanx.common.flags import Flag, add_flags
from phalanx.common.logging import configure_logging
from phalanx.common.tokens import TokenFileError, TokenStore
from phalanx.core.capacity import PLACEMENT_BUDGET_MS
from phalanx.core.fabric import Fabric, FabricError, load_fabric
from phalanx.core.preemption import PRODUCTION_POLICY, PreemptionPolicy
from phalanx.core.snapshot import ElasticPolicy
from services.common import gcwatch
from services.common.auth import (
    DEFAULT_MAX_PENDING,
    AuthInterceptor,
    ServerTLS,
    TenantLimits,
    add_security_flags,
    security_from_args,
)
from services.common.metrics import serve_metrics
from services.common.server import AioServer

from .retention import DEFAULT_RETAIN_FINISHED_S, parse_retain
from .service import SchedulerService
from .servicer import NodeServicer, SchedulerServicer
from .serving.controller import ServiceController
from .serving.servicer import ServiceServicer
from .settings import SchedulerSettings


class RunningScheduler:
    def __init__(self, service: SchedulerService, server: AioServer, controller: ServiceController) -> None:
        self.service = service
        self.server = server
        self.controller = controller
        self.address = server.address
        self.port = server.port

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        await self.controller.stop()
        await self.service.stop()


async def serve(
    settings: SchedulerSettings,
    *,
    tokens: TokenStore | None = None,
    limits: TenantLimits | None = None,
    tls: ServerTLS | None = None,
) -> RunningScheduler:
    """Start a scheduler replica in this event loop. The database must be migrated (`phalanx db upgrade`).

    `tokens`: authentication on (services.common.auth); `limits`: per-tenant submission limits; `tls`: serve TLS.
    """
    service = SchedulerService(settings)
    if tokens is not None:
        service.state.unix_user = tokens.unix_user  # the tenants' Unix users, for their launches
    await service.start()
    service.state.rank_key = await asyncio.to_thread(_rank_key, service.engine)
    controller = ServiceController(service)
    server = AioServer(
        settings.listen,
        [
            lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(service, limits), s),
            lambda s: agent_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(service), s),
            lambda s: service_pb2_grpc.add_ServiceServiceServicer_to_server(ServiceServicer(service, controller), s),
        ],
        [
            scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name,
            agent_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
            service_pb2.DESCRIPTOR.services_by_name["ServiceService"].full_name,
        ],
        interceptors=[AuthInterceptor(tokens, service.state.rank_key)] if tokens is not None else [],
        tls=tls,
        max_message_bytes=settings.max_message_bytes,
    )
    await server.start()
    controller.start()
    return RunningScheduler(service, server, controller)


def _rank_key(engine) -> str:
    from db.migrate import ensure_rank_key

    with engine.begin() as conn:
        return ensure_rank_key(conn)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _retain_finished(text: str) -> float:
    try:
        return parse_retain(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The flags of `phalanx-scheduler`, in the order of its --help (a table: data, not code).
FLAGS = (
    Flag(
        "--db",
        env="PHALANX_DB",
        default=DEFAULT_DB_URL,
        help="ledger URL: sqlite:///path or postgresql://... (env PHALANX_DB)",
    ),
    Flag(
        "--listen",
        env="PHALANX_SCHEDULER_LISTEN",
        default="127.0.0.1:50051",
        help="gRPC address to serve on (port 0 picks a free one)",
    ),
    Flag("--fabric", help="fabric description: Slurm topology.conf (tree syntax) or Phalanx YAML"),
    Flag("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port"),
    Flag("--lease-timeout", type=float, default=15.0, help="seconds without heartbeat before a node is lost"),
    Flag("--heartbeat-interval", type=float, default=2.0),
    Flag(
        "--launch-timeout",
        type=float,
        default=60.0,
        help="seconds for every rank of a gang to start before it is torn down and requeued",
    ),
    Flag(
        "--no-backfill",
        dest="backfill",
        action="store_false",
        help="strict queue order: nothing starts ahead of a blocked head (default: EASY backfill on "
        "declared time limits)",
    ),
    Flag(
        "--no-admission-lane",
        dest="admission_lane",
        action="store_false",
        help="decide every submit in a pass over the whole queue (default: a submit strictly ahead of the pending "
        "queue, on a settled view, is decided at once on its own: docs/architecture/admission-path.md)",
    ),
    Flag(
        "--no-status-lane",
        dest="status_lane",
        action="store_false",
        help="let cycles take rank reports, heartbeats and acks (default: the status lane records them in "
        "transactions of their own, never behind a decision: docs/architecture/admission-path.md)",
    ),
    Flag(
        "--no-accept-lane",
        dest="accept_lane",
        action="store_false",
        help="answer every submission after the cycle that takes it (default: one that waits for a pass whatever "
        "happens is written PENDING and answered at once: docs/architecture/admission-path.md)",
    ),
    Flag(
        "--no-fence-in-pipeline",
        dest="fence_in_pipeline",
        action="store_false",
        help="every cycle waits for the ledger's clock row lock before deciding (default, on PostgreSQL: a leader "
        "whose view is its own sends the lock, checked by the server, with its writes and commit: "
        "docs/architecture/admission-path.md)",
    ),
    Flag(
        "--no-claims",
        dest="claims",
        action="store_false",
        help="for testing only: preemptors keep no claim on what their victims free (the scheduler before claims, "
        "whose preempted gangs can take their GPUs back ahead of their preemptor)",
    ),
    Flag(
        "--backfill-depth",
        type=int,
        default=1000,
        metavar="N",
        help="look at most at N gangs behind a blocked head in one pass, tried or passed over (Slurm's "
        "bf_max_job_test; 0: no limit; default 1000)",
    ),
    Flag(
        "--backfill-budget-ms",
        type=float,
        default=50.0,
        metavar="MS",
        help="stop trying gangs behind a blocked head after MS milliseconds of a pass (0: no limit; default 50)",
    ),
    Flag(
        "--placement-budget-ms",
        type=float,
        default=PLACEMENT_BUDGET_MS,
        metavar="MS",
        help="time budget of each gang placement's exact search; past it the heuristic fill, said in the "
        f"placement reason (0: none; default {PLACEMENT_BUDGET_MS:g})",
    ),
    Flag(
        "--max-attempts",
        type=int,
        default=5,
        help="failed attempts (node lost, GPU failed, rank lost, launch timeout) before a gang is FAILED; "
        "preemptions do not count",
    ),
    Flag(
        "--retry-backoff",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a gang waits before its first retry after a failure; doubles per failure",
    ),
    Flag("--retry-backoff-max", type=float, default=300.0, metavar="S", help="cap of the retry backoff"),
    Flag(
        "--min-runtime",
        type=float,
        default=PRODUCTION_POLICY.min_runtime_s,
        metavar="S",
        help="seconds after its start during which a gang cannot be preempted",
    ),
    Flag(
        "--preemption-grace",
        type=float,
        default=PRODUCTION_POLICY.grace_period_s,
        metavar="S",
        help="seconds a preempted gang gets to commit a checkpoint before it is stopped",
    ),
    Flag(
        "--elastic-grow-interval",
        type=float,
        default=ElasticPolicy().grow_interval_s,
        metavar="S",
        help="an elastic gang (--replicas MIN:MAX) grows at most once per this many seconds of its attempt",
    ),
    Flag(
        "--elastic-grow-step",
        type=float,
        default=ElasticPolicy().min_fraction,
        metavar="F",
        help="an elastic gang grows only by at least this fraction of its size (or up to its maximum)",
    ),
    Flag(
        "--elastic-grace",
        type=float,
        default=ElasticPolicy().grace_period_s,
        metavar="S",
        help="seconds a growing elastic gang gets to commit a checkpoint before it restarts at the bigger size",
    ),
    Flag(
        "--checkpoint-coordinator",
        env="PHALANX_CHECKPOINT_ADDR",
        default="",
        metavar="ADDR",
        help="host:port of the checkpoint coordinator, given to ranks as "
        "PHALANX_CHECKPOINT_ADDR (default: $PHALANX_CHECKPOINT_ADDR; unset: none)",
    ),
    Flag(
        "--checkpoint-dir",
        env="PHALANX_CHECKPOINT_DIR",
        default="",
        metavar="DIR",
        help="checkpoint store shared by the ranks, given to them as PHALANX_CHECKPOINT_DIR",
    ),
    Flag(
        "--leader-lease",
        type=float,
        default=5.0,
        metavar="S",
        help="leadership lease: one replica schedules while it renews this lease (every third of it); "
        "another takes over once it runs out",
    ),
    Flag(
        "--replica-id",
        env="PHALANX_REPLICA_ID",
        default="",
        metavar="ID",
        help="this replica's name in the ledger's leadership row and logs (default: random; env "
        "PHALANX_REPLICA_ID). Every replica needs its own",
    ),
    Flag(
        "--mig-switch-hold",
        type=float,
        default=60.0,
        metavar="S",
        help="agents started with --mig-manage: a GPU whose MIG mode changed less than S seconds ago is "
        "not switched again (no flapping between MIG and whole-GPU work)",
    ),
    Flag(
        "--mig-switch-backoff",
        type=float,
        default=60.0,
        metavar="S",
        help="agents started with --mig-manage: a GPU whose MIG mode switch failed is not asked again for S seconds",
    ),
    Flag(
        "--retain-finished",
        type=_retain_finished,
        default=DEFAULT_RETAIN_FINISHED_S,
        metavar="DURATION",
        help="keep finished jobs in the ledger's jobs table this long after they finished (seconds, or 30d, 12h, "
        "90m), then move them to job_archive with their goodput (docs/operations/retention.md); 0 or forever: keep them "
        "there (default 30d)",
    ),
)


def _limit(flag: str, default: int, what: str) -> Flag:
    """A flag of the "limits" group: a whole number >= 1, from PHALANX_SCHEDULER_<FLAG> by default."""
    env = "PHALANX_SCHEDULER_" + flag[2:].upper().replace("-", "_")
    return Flag(
        flag, env=env, type=_positive_int, default=default, metavar="N", help=f"{what} (env {env}; default {default})"
    )


LIMIT_FLAGS = (
    _limit("--max-message-bytes", 16 * 1024 * 1024, "the largest request or response message (RESOURCE_EXHAUSTED)"),
    _limit("--max-watches", 64, "WatchJobs streams one tenant (one caller, authentication off) may hold open"),
    _limit("--watch-queue", 10_000, "changes buffered per watch stream; a watcher further behind is ended"),
    _limit("--max-replicas", 100_000, "replicas of one job"),
    _limit("--max-command-bytes", 256 * 1024, "bytes of one job's command"),
    _limit("--max-env-vars", 4096, "variables of one job's --env"),
    _limit("--max-env-bytes", 256 * 1024, "bytes of one job's --env"),
    _limit("--max-array-size", 10_001, "tasks of one job array: its indices are 0 to N-1 (Slurm's MaxArraySize)"),
)

TENANT_LIMIT_FLAGS = (
    Flag(
        "--rate-limit",
        type=float,
        default=None,
        metavar="N",
        help="per-tenant submissions per second (RESOURCE_EXHAUSTED beyond; default: off, or 100 with "
        "--tenant-limits); a tokens-file entry's rate_limit overrides it for its tenant",
    ),
    Flag(
        "--rate-burst",
        type=float,
        default=None,
        metavar="N",
        help="submissions a tenant may send at once before the rate limit applies (default: 2 x rate)",
    ),
    Flag(
        "--max-pending",
        type=int,
        default=None,
        metavar="N",
        help=f"per-tenant cap on PENDING jobs (default: off, or {DEFAULT_MAX_PENDING} with "
        "--tenant-limits); a tokens-file entry's max_pending overrides it for its tenant",
    ),
    Flag(
        "--tenant-limits",
        action="store_true",
        help=f"turn on the per-tenant limits with generous defaults (100 submissions/s, bursts of 200, "
        f"{DEFAULT_MAX_PENDING} pending jobs)",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `phalanx-scheduler`: the flags above, the limits, --upgrade-db, the security flags
    (services.common.auth) and the per-tenant limits; environment variables as the flags say."""
    p = argparse.ArgumentParser(prog="phalanx-scheduler", description="Run a Phalanx scheduler replica.")
    add_flags(p, FLAGS)
    add_flags(
        p.add_argument_group("limits", "what one caller may ask of the server (docs/guides/quotas-and-tenants.md)"),
        LIMIT_FLAGS,
    )
    p.add_argument("--upgrade-db", action="store_true", help="apply migrations before starting")
    add_security_flags(p, env_prefix="PHALANX_SCHEDULER")
    add_flags(p, TENANT_LIMIT_FLAGS)
    return p


def limits_from_args(args: argparse.Namespace) -> TenantLimits:
    rate, pending = args.rate_limit, args.max_pending
    if args.tenant_limits:
        rate = 100.0 if rate is None else rate
        pending = DEFAULT_MAX_PENDING if pending is None else pending
    if (
        (rate is not None and not rate > 0)
        or (pending is not None and pending < 1)
        or (args.rate_burst is not None and args.rate_burst < 1)
    ):
        raise ValueError("--rate-limit must be > 0, --rate-burst and --max-pending at least 1")
    burst = args.rate_burst if args.rate_burst is not None else (2 * rate if rate else None)
    return TenantLimits(rate=rate, burst=burst, max_pending=pending)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = configure_logging("scheduler")
    # The writer thread gives up the GIL on every database round trip; a short switch interval gets it back
    # quickly from the gRPC threads, which otherwise adds milliseconds to every reservation.
    sys.setswitchinterval(0.0005)
    try:
        fabric = load_fabric(args.fabric) if args.fabric else Fabric()
    except FabricError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not 0.1 <= args.leader_lease <= 3600 or len(args.replica_id) > 64:
        print("error: --leader-lease must be within 0.1-3600 s and --replica-id at most 64 characters", file=sys.stderr)
        return 2
    if (
        args.max_attempts < 1
        or min(args.retry_backoff, args.retry_backoff_max, args.min_runtime, args.preemption_grace) < 0
    ):
        print(
            "error: --max-attempts must be >= 1; --retry-backoff, --retry-backoff-max, --min-runtime and "
            "--preemption-grace must be >= 0",
            file=sys.stderr,
        )
        return 2
    if not (
        0 <= args.elastic_grow_interval <= 86400
        and 0 <= args.elastic_grow_step <= 10
        and 0 <= args.elastic_grace <= 86400
    ):
        print(
            "error: --elastic-grow-interval and --elastic-grace must be within 0-86400 s, --elastic-grow-step 0-10",
            file=sys.stderr,
        )
        return 2
    if not (0 <= args.mig_switch_hold <= 86400 and 0 <= args.mig_switch_backoff <= 86400):
        print("error: --mig-switch-hold and --mig-switch-backoff must be within 0-86400 s", file=sys.stderr)
        return 2
    try:
        tokens, tls = security_from_args(args)
        limits = limits_from_args(args)
    except (TokenFileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.upgrade_db:
        from db.migrate import upgrade

        upgrade(args.db)
    settings = SchedulerSettings(
        db_url=args.db,
        listen=args.listen,
        fabric=fabric,
        lease_timeout=args.lease_timeout,
        heartbeat_interval=args.heartbeat_interval,
        launch_timeout=args.launch_timeout,
        max_attempts=args.max_attempts,
        metrics_port=args.metrics_port,
        retry_backoff_s=args.retry_backoff,
        retry_backoff_max_s=args.retry_backoff_max,
        backfill=args.backfill,
        admission_lane=args.admission_lane,
        status_lane=args.status_lane,
        accept_lane=args.accept_lane,
        fence_in_pipeline=args.fence_in_pipeline,
        claims=args.claims,
        backfill_depth=args.backfill_depth,
        backfill_budget_ms=args.backfill_budget_ms,
        placement_budget_ms=args.placement_budget_ms,
        preemption=PreemptionPolicy(min_runtime_s=args.min_runtime, grace_period_s=args.preemption_grace),
        elastic=ElasticPolicy(
            grow_interval_s=args.elastic_grow_interval,
            min_fraction=args.elastic_grow_step,
            grace_period_s=args.elastic_grace,
        ),
        checkpoint_addr=args.checkpoint_coordinator,
        checkpoint_dir=args.checkpoint_dir,
        leader_lease_s=args.leader_lease,
        replica_id=args.replica_id,
        mig_switch_hold_s=args.mig_switch_hold,
        mig_switch_backoff_s=args.mig_switch_backoff,
        retain_finished_s=args.retain_finished,
        max_message_bytes=args.max_message_bytes,
        max_watches=args.max_watches,
        watch_queue=args.watch_queue,
        max_replicas=args.max_replicas,
        max_command_bytes=args.max_command_bytes,
        max_env_vars=args.max_env_vars,
        max_env_bytes=args.max_env_bytes,
        max_array_size=args.max_array_size,
    )
    serve_metrics(args.metrics_port)
    gcwatch.install()

    async def run() -> None:
        running = await serve(settings, tokens=tokens, limits=limits, tls=tls)
        log.info(
            "scheduler_listening",
            address=running.address,
            db=settings.db_url.split("@")[-1],
            authentication=tokens is not None,
            tls=tls is not None,
            replica=running.service.settings.replica_id,
            leader=running.service.leading,
        )
        print(f"scheduler at {running.address}", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("scheduler_stopping")
        await running.stop()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
