"""`phalanx-checkpointd`: the checkpoint coordinator process, and `serve()` to run it in-process."""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys

import structlog

from db.engine import make_engine
from phalanx.api.v1 import checkpoint_pb2_grpc
from phalanx.common.defaults import DEFAULT_DB_URL
from phalanx.common.flags import Flag, add_flags
from phalanx.common.logging import configure_logging
from phalanx.common.tokens import TokenFileError, TokenStore
from services.common.auth import (
    AuthInterceptor,
    ServerTLS,
    add_security_flags,
    security_from_args,
)
from services.common.metrics import serve_metrics
from services.common.server import AioServer

from . import retention as retention_policy
from . import store
from .confine import StorageRoot
from .retention import DEFAULT_FINISHED, DEFAULT_KEEP_CHECKPOINTS, FINISHED_POLICIES, Retention
from .servicer import SERVICE_NAME, CheckpointCoordinatorServicer

DEFAULT_LISTEN = "127.0.0.1:50052"
DEFAULT_SWEEP_S = 5.0
log = structlog.get_logger(service="checkpointd")


class CheckpointServer:
    """A started coordinator: `.address` is host:port actually bound; `await .stop()` shuts it down."""

    def __init__(
        self,
        server: AioServer,
        engine,
        sweeper: asyncio.Task | None = None,
        servicer: CheckpointCoordinatorServicer | None = None,
    ) -> None:
        self._server = server
        self._engine = engine
        self._sweeper = sweeper
        self._servicer = servicer
        self.address = server.address
        self.port = server.port

    async def settle(self, timeout: float | None = None) -> None:
        """Wait for the retention passes that commits started (they run in the background)."""
        if self._servicer is not None:
            await self._servicer.settle(timeout)

    async def stop(self, grace: float = 2.0) -> None:
        try:
            if self._sweeper is not None:
                self._sweeper.cancel()
                try:
                    await self._sweeper
                except asyncio.CancelledError:
                    pass
            await self._server.stop(grace)
            await self.settle(max(grace, 1.0))
        finally:
            self._engine.dispose()

    async def wait_for_termination(self) -> None:
        await self._server.server.wait_for_termination()


async def _sweep(engine, interval: float, retention: Retention | None = None) -> None:
    """Every `interval` seconds: abort PENDING checkpoints past their deadline (or of a superseded attempt), then
    the retention pass (retention.py: aborted checkpoints' shards, committed ones beyond what a job keeps, finished
    jobs' policy)."""
    while True:
        await asyncio.sleep(interval)
        try:
            aborted = await asyncio.to_thread(store.abort_expired, engine)
        except Exception as exc:  # a failed sweep is retried at the next tick
            log.warning("checkpoint_sweep_failed", error=str(exc))
            continue
        if aborted:
            log.info("checkpoints_aborted", count=aborted)
        if retention is None:
            continue
        try:
            deleted = await asyncio.to_thread(retention.sweep, engine)
        except Exception as exc:  # retried at the next tick
            log.warning("checkpoint_retention_failed", error=str(exc)[:500])
            continue
        if deleted:
            log.info(
                "checkpoint_retention_swept", deleted=len(deleted), bytes_freed=sum(d.bytes_freed for d in deleted)
            )


async def serve(
    db_url: str,
    listen: str = DEFAULT_LISTEN,
    sweep_interval: float = DEFAULT_SWEEP_S,
    *,
    advertise: str | None = None,
    checkpoint_dir: str = "",
    tokens: TokenStore | None = None,
    tls: ServerTLS | None = None,
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS,
    finished_checkpoints: str = DEFAULT_FINISHED,
    checkpoint_root: str = "",
) -> CheckpointServer:
    """Start a coordinator on `listen` (port 0 picks a free port) against a migrated database.

    Every `sweep_interval` seconds (0: never) it aborts the PENDING checkpoints whose deadline passed. It records
    its address (`advertise`, default: the bound address, a wildcard host replaced by this host's name) and the
    checkpoint directory ranks should use in the ledger's service_endpoints, where a scheduler started without
    --checkpoint-coordinator finds them. `tokens`: authentication on (servicer._authorize: an admin or service
    anything, a user its tenant's jobs, a rank credential its own job and attempt);
    `tls`: serve TLS (mutual when it names a CA).

    Retention (retention.py): after each commit, and in every sweep, it keeps the newest `keep_checkpoints` (>= 1)
    complete committed checkpoints of each job (a job's own keep_checkpoints > 0 overrides it) and deletes the
    older ones and aborted ones; finished jobs follow `finished_checkpoints` ("keep", "latest" or "delete"). Only
    files of file:// shards inside the job's own directory are deleted (none without a checkpoint_dir).

    `checkpoint_root` (default: `checkpoint_dir`): every shard must lie under `<root>/<tenant>/<job>/`
    (`<root>/<job>/` for a job without a tenant; confine.py), else INVALID_ARGUMENT. Neither given: shard
    locations are not confined (logged as a warning).
    """
    root_text = checkpoint_root or checkpoint_dir
    root = StorageRoot.parse(root_text) if root_text else None
    if root is None:
        log.warning("checkpoint_locations_unconfined", note="give --checkpoint-root (or --checkpoint-dir)")
    retention = Retention(
        checkpoint_dir,
        retention_policy.validate_keep(keep_checkpoints),
        retention_policy.validate_finished(finished_checkpoints),
    )
    engine = make_engine(db_url)
    try:
        servicer = CheckpointCoordinatorServicer(engine, retention, root)
        rank_key = await asyncio.to_thread(_rank_key, engine) if tokens is not None else ""
        server = AioServer(
            listen,
            [lambda s: checkpoint_pb2_grpc.add_CheckpointCoordinatorServicer_to_server(servicer, s)],
            [SERVICE_NAME],
            interceptors=[AuthInterceptor(tokens, rank_key)] if tokens is not None else [],
            tls=tls,
        )
        await server.start()
        address = advertise or _reachable(server.address)
        await asyncio.to_thread(store.advertise, engine, address, checkpoint_dir)
    except BaseException:
        engine.dispose()
        raise
    sweeper = asyncio.create_task(_sweep(engine, sweep_interval, retention)) if sweep_interval > 0 else None
    return CheckpointServer(server, engine, sweeper, servicer)


def _rank_key(engine) -> str:
    from db.migrate import ensure_rank_key

    with engine.begin() as conn:
        return ensure_rank_key(conn)


def _reachable(address: str) -> str:
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


async def _run(
    db_url: str,
    listen: str,
    log,
    sweep_interval: float = DEFAULT_SWEEP_S,
    advertise: str | None = None,
    checkpoint_dir: str = "",
    tokens: TokenStore | None = None,
    tls: ServerTLS | None = None,
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS,
    finished_checkpoints: str = DEFAULT_FINISHED,
    checkpoint_root: str = "",
) -> None:
    server = await serve(
        db_url,
        listen,
        sweep_interval,
        advertise=advertise,
        checkpoint_dir=checkpoint_dir,
        tokens=tokens,
        tls=tls,
        keep_checkpoints=keep_checkpoints,
        finished_checkpoints=finished_checkpoints,
        checkpoint_root=checkpoint_root,
    )
    log.info(
        "checkpointd_started",
        address=server.address,
        keep_checkpoints=keep_checkpoints,
        finished_checkpoints=finished_checkpoints,
        checkpoint_dir=checkpoint_dir,
    )
    print(f"checkpoint coordinator at {server.address}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("checkpointd_stopping")
    await server.stop()
    log.info("checkpointd_stopped")


def _keep_checkpoints(text: str) -> int:
    try:
        return retention_policy.validate_keep(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a whole number of checkpoints, 1 to {retention_policy.MAX_KEEP_CHECKPOINTS}"
        ) from None


def _finished_policy(text: str) -> str:
    try:
        return retention_policy.validate_finished(text.strip().lower())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(FINISHED_POLICIES)}") from None


# The flags of `phalanx-checkpointd`, in the order of its --help (a table: data, not code); the security flags
# (services.common.auth) follow them.
FLAGS = (
    Flag("--db", env="PHALANX_DB", default=DEFAULT_DB_URL, help="database URL (env PHALANX_DB)"),
    Flag(
        "--listen",
        env="PHALANX_CHECKPOINTD_LISTEN",
        default=DEFAULT_LISTEN,
        help="gRPC listen address host:port (env PHALANX_CHECKPOINTD_LISTEN)",
    ),
    Flag(
        "--sweep-interval",
        type=float,
        default=DEFAULT_SWEEP_S,
        help="seconds between sweeps that abort checkpoints past their deadline and apply the "
        "retention policy (0: never)",
    ),
    Flag(
        "--advertise",
        env="PHALANX_CHECKPOINTD_ADVERTISE",
        ignore_empty=True,
        metavar="HOST:PORT",
        help="the address ranks reach this coordinator at, recorded in the ledger for schedulers "
        "started without --checkpoint-coordinator (default: the bound address)",
    ),
    Flag(
        "--checkpoint-dir",
        env="PHALANX_CHECKPOINT_DIR",
        default="",
        metavar="DIR",
        help="the checkpoint directory ranks should write to, recorded beside the address "
        "(env PHALANX_CHECKPOINT_DIR); retention deletes only files inside it",
    ),
    Flag(
        "--checkpoint-root",
        env="PHALANX_CHECKPOINT_ROOT",
        default="",
        metavar="URI",
        help="the storage root it owns (file:///ckpt, /ckpt, s3://bucket/ckpt): every shard must lie under "
        "<root>/<tenant>/<job>/ (<root>/<job>/ without a tenant), else INVALID_ARGUMENT (env "
        "PHALANX_CHECKPOINT_ROOT; default: --checkpoint-dir; neither: not confined)",
    ),
    Flag(
        "--keep-checkpoints",
        env="PHALANX_CHECKPOINTD_KEEP_CHECKPOINTS",
        type=_keep_checkpoints,
        default=DEFAULT_KEEP_CHECKPOINTS,
        metavar="K",
        help="keep the newest K complete committed checkpoints of each job and delete the older ones "
        f"(K >= 1, default {DEFAULT_KEEP_CHECKPOINTS}; a job's own --keep-checkpoints overrides "
        "it; env PHALANX_CHECKPOINTD_KEEP_CHECKPOINTS)",
    ),
    Flag(
        "--finished-checkpoints",
        env="PHALANX_CHECKPOINTD_FINISHED_CHECKPOINTS",
        type=_finished_policy,
        default=DEFAULT_FINISHED,
        metavar="{" + ",".join(FINISHED_POLICIES) + "}",
        help="a finished job's checkpoints: keep (default: its newest K, as while it ran), latest "
        "(only its newest one) or delete (all of them) "
        "(env PHALANX_CHECKPOINTD_FINISHED_CHECKPOINTS)",
    ),
    Flag("--metrics-port", type=int, default=None, help="expose Prometheus /metrics on this port"),
    Flag("--metrics-host", default="127.0.0.1", help="address for the metrics endpoint"),
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `phalanx-checkpointd`: the flags above and the security flags."""
    parser = argparse.ArgumentParser(prog="phalanx-checkpointd", description="Phalanx checkpoint coordinator")
    add_flags(parser, FLAGS)
    add_security_flags(parser, env_prefix="PHALANX_CHECKPOINTD")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = configure_logging("checkpointd")
    try:
        tokens, tls = security_from_args(args)
    except (TokenFileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    serve_metrics(args.metrics_port, args.metrics_host)
    try:
        asyncio.run(
            _run(
                args.db,
                args.listen,
                log,
                args.sweep_interval,
                args.advertise,
                args.checkpoint_dir,
                tokens,
                tls,
                args.keep_checkpoints,
                args.finished_checkpoints,
                args.checkpoint_root,
            )
        )
    except OSError as exc:
        log.error("checkpointd_failed", error=str(exc))
        return 1
    except ValueError as exc:  # a --checkpoint-root that names no storage
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
