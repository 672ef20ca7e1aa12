"""`phalanx-scheduler --db URL --listen HOST:PORT`: the scheduler service as its own process."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from db.engine import DEFAULT_DB_URL
from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from phalanx.core.fabric import Fabric, FabricError, load_fabric
from phalanx.core.preemption import PRODUCTION_POLICY, PreemptionPolicy
from services.common.logging import configure_logging
from services.common.metrics import serve_metrics
from services.common.server import AioServer

from .service import SchedulerService
from .servicer import NodeServicer, SchedulerServicer
from .settings import SchedulerSettings


class RunningScheduler:
    def __init__(self, service: SchedulerService, server: AioServer) -> None:
        self.service = service
        self.server = server
        self.address = server.address
        self.port = server.port

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        await self.service.stop()


async def serve(settings: SchedulerSettings) -> RunningScheduler:
    """Start a scheduler replica in this event loop. The database must be migrated (`phalanx db upgrade`)."""
    service = SchedulerService(settings)
    await service.start()
    server = AioServer(
        settings.listen,
        [
            lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(service), s),
            lambda s: agent_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(service), s),
        ],
        [
            scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name,
            agent_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
        ],
    )
    await server.start()
    return RunningScheduler(service, server)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx-scheduler", description="Run a Phalanx scheduler replica.")
    p.add_argument("--db", default=os.environ.get("PHALANX_DB", DEFAULT_DB_URL),
                   help="ledger URL: sqlite:///path or postgresql://... (env PHALANX_DB)")
    p.add_argument("--listen", default=os.environ.get("PHALANX_SCHEDULER_LISTEN", "127.0.0.1:50051"),
                   help="gRPC address to serve on (port 0 picks a free one)")
    p.add_argument("--fabric", help="fabric description: Slurm topology.conf (tree syntax) or Phalanx YAML")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--lease-timeout", type=float, default=15.0, help="seconds without heartbeat before a node is lost")
    p.add_argument("--heartbeat-interval", type=float, default=2.0)
    p.add_argument("--launch-timeout", type=float, default=60.0,
                   help="seconds for every rank of a gang to start before it is torn down and requeued")
    p.add_argument("--max-attempts", type=int, default=5,
                   help="failed attempts (node lost, GPU failed, rank lost, launch timeout) before a gang is FAILED; "
                        "preemptions do not count")
    p.add_argument("--retry-backoff", type=float, default=10.0, metavar="S",
                   help="seconds a gang waits before its first retry after a failure; doubles per failure")
    p.add_argument("--retry-backoff-max", type=float, default=300.0, metavar="S", help="cap of the retry backoff")
    p.add_argument("--min-runtime", type=float, default=PRODUCTION_POLICY.min_runtime_s, metavar="S",
                   help="seconds after its start during which a gang cannot be preempted")
    p.add_argument("--preemption-grace", type=float, default=PRODUCTION_POLICY.grace_period_s, metavar="S",
                   help="seconds a preempted gang gets to commit a checkpoint before it is stopped")
    p.add_argument("--checkpoint-coordinator", default=os.environ.get("PHALANX_CHECKPOINT_ADDR", ""),
                   metavar="ADDR", help="host:port of the checkpoint coordinator, given to ranks as "
                                        "PHALANX_CHECKPOINT_ADDR (default: $PHALANX_CHECKPOINT_ADDR; unset: none)")
    p.add_argument("--checkpoint-dir", default=os.environ.get("PHALANX_CHECKPOINT_DIR", ""), metavar="DIR",
                   help="checkpoint store shared by the ranks, given to them as PHALANX_CHECKPOINT_DIR")
    p.add_argument("--upgrade-db", action="store_true", help="apply migrations before starting")
    return p


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
    if args.max_attempts < 1 or min(args.retry_backoff, args.retry_backoff_max, args.min_runtime,
                                     args.preemption_grace) < 0:
        print("error: --max-attempts must be >= 1; --retry-backoff, --retry-backoff-max, --min-runtime and "
              "--preemption-grace must be >= 0", file=sys.stderr)
        return 2
    if args.upgrade_db:
        from db.migrate import upgrade

        upgrade(args.db)
    settings = SchedulerSettings(
        db_url=args.db, listen=args.listen, fabric=fabric, lease_timeout=args.lease_timeout,
        heartbeat_interval=args.heartbeat_interval, launch_timeout=args.launch_timeout,
        max_attempts=args.max_attempts, metrics_port=args.metrics_port,
        retry_backoff_s=args.retry_backoff, retry_backoff_max_s=args.retry_backoff_max,
        preemption=PreemptionPolicy(min_runtime_s=args.min_runtime, grace_period_s=args.preemption_grace),
        checkpoint_addr=args.checkpoint_coordinator, checkpoint_dir=args.checkpoint_dir,
    )
    serve_metrics(args.metrics_port)

    async def run() -> None:
        running = await serve(settings)
        log.info("scheduler_listening", address=running.address, db=settings.db_url.split("@")[-1])
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
