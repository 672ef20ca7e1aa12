"""``phalanx cluster up``: a local cluster of processes (phalanx.cli.local_cluster.LocalCluster) supervised until
SIGINT/SIGTERM, and the start-up and signal handling that ``phalanx demo`` shares."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from phalanx.core.preemption import LOCAL_POLICY

from . import render
from .common import UsageError
from .local_cluster import (
    DEFAULT_DEMO_STATE_DIR,
    DEFAULT_PORT,
    DEFAULT_PROFILE,
    DEFAULT_STATE_DIR,
    ClusterError,
    LocalCluster,
    ManagedProcess,
    free_port_pair,
    node_names,
)

__all__ = [
    "ClusterError",
    "LocalCluster",
    "ManagedProcess",
    "DEFAULT_STATE_DIR",
    "DEFAULT_DEMO_STATE_DIR",
    "DEFAULT_PORT",
    "free_port_pair",
    "node_names",
    "register",
]


class StopOnSignal:
    """While active, the first SIGINT or SIGTERM sets ``event`` and raises KeyboardInterrupt in the main thread;
    later ones only set the event, so the clean stop that follows is not interrupted. Restores the handlers."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, _frame) -> None:
        first = not self.event.is_set()
        self.signum = signum
        self.event.set()
        if first:
            raise KeyboardInterrupt

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def check(self) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt


def print_ready(cluster: LocalCluster) -> None:
    from phalanx.client import Client

    with Client(cluster.address, **cluster.client_options()) as client:
        nodes = client.nodes()
    mine = set(cluster.node_names)
    print(f"scheduler at {cluster.address}", flush=True)
    print(f"checkpoint coordinator at {cluster.checkpoint_address}", flush=True)
    print(render.nodes_table([n for n in nodes if n.name in mine]), flush=True)
    if cluster.tokens is not None:
        print(f"authentication on (tokens file {cluster.tokens}): clients need PHALANX_TOKEN", flush=True)
    if cluster.pki is not None:
        pki = cluster.pki
        print(
            f"mutual TLS: export PHALANX_TLS_CA={pki.ca} PHALANX_TLS_CERT={pki.client_cert} "
            f"PHALANX_TLS_KEY={pki.client_key}",
            flush=True,
        )


def cluster_from_args(args: argparse.Namespace, state_dir: Path, **extra) -> LocalCluster:
    return LocalCluster(
        nodes=args.nodes,
        profile=getattr(args, "profile", DEFAULT_PROFILE),
        state_dir=state_dir,
        db_url=getattr(args, "db", None),
        port=args.port,
        fabric=getattr(args, "fabric", None),
        metrics_port_base=getattr(args, "metrics_port_base", None),
        restart_agents=getattr(args, "restart_agents", False),
        restart_delay=getattr(args, "restart_delay", 2.0),
        ready_timeout=getattr(args, "ready_timeout", 60.0),
        min_runtime=getattr(args, "min_runtime", LOCAL_POLICY.min_runtime_s),
        preemption_grace=getattr(args, "preemption_grace", LOCAL_POLICY.grace_period_s),
        tokens=getattr(args, "tokens", None),
        tls=getattr(args, "tls", False),
        mig_gpus=getattr(args, "mig_gpus", None),
        mig_manage=getattr(args, "mig_manage", False),
        run_as=getattr(args, "run_as", None),
        web_port=getattr(args, "web_port", None),
        **extra,
    )


def start_or_report(cluster: LocalCluster, stopper: StopOnSignal) -> bool:
    """Start the cluster; on failure print ``error: ...`` and return False. Ctrl-C while starting stops it."""

    try:
        cluster.start()
    except ClusterError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return False
    except KeyboardInterrupt:
        raise
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    if stopper.event.is_set():
        cluster.stop()
        raise KeyboardInterrupt
    return True


# -- phalanx cluster up ----------------------------------------------------------------------------------------


def cmd_cluster_up(args: argparse.Namespace) -> int:
    """``phalanx cluster up``: run a local cluster until SIGINT/SIGTERM (exit 0)."""

    if args.nodes < 1:
        raise UsageError("--nodes must be at least 1")
    cluster = cluster_from_args(args, Path(args.state_dir))
    with StopOnSignal() as stopper:
        try:
            if not start_or_report(cluster, stopper):
                return 1
            print_ready(cluster)
            cluster.log("running; Ctrl-C (SIGINT) or SIGTERM stops every process")
            rc = cluster.wait(stopper.event)
        except KeyboardInterrupt:
            rc = 0
        finally:
            cluster.stop()
    if rc:
        sys.stderr.write(f"error: {cluster.failed_service.name} exited; the cluster was stopped\n")  # type: ignore[union-attr]
        return 1
    cluster.log("stopped")
    return 0


# -- phalanx demo ----------------------------------------------------------------------------------------------


def add_common_flags(p: argparse.ArgumentParser, *, nodes: int, state_dir: Path) -> None:
    p.add_argument("--nodes", type=int, default=nodes, metavar="N", help=f"simulated nodes (default {nodes})")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        metavar="PORT",
        help=f"scheduler port on 127.0.0.1; the checkpoint coordinator takes PORT+1 "
        f"(default {DEFAULT_PORT}; 0 picks free ports)",
    )
    p.add_argument(
        "--state-dir",
        default=str(state_dir),
        metavar="DIR",
        help=f"ledger, fabric, logs and agent state (default {state_dir})",
    )
    p.add_argument(
        "--metrics-port-base",
        type=int,
        default=None,
        metavar="N",
        help="serve Prometheus metrics: scheduler N, coordinator N+1, agent i N+2+i (default: off)",
    )
    p.add_argument(
        "--ready-timeout", type=float, default=60.0, metavar="S", help="seconds for every node to be READY (default 60)"
    )
    p.add_argument(
        "--mig-gpus",
        type=int,
        default=None,
        metavar="N",
        help="the last N GPUs of the LAST node start in MIG mode (only MIG jobs go there, and MIG jobs "
        "only there); default 1 when the profile's GPUs have MIG, else 0",
    )


def register(subparsers) -> None:
    """Add ``cluster up`` and ``demo`` to the ``phalanx`` CLI."""
    p = subparsers.add_parser("cluster", help="run a local cluster of processes (no Docker)")
    sub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", parser_class=type(p))
    sub.required = True
    up = sub.add_parser(
        "up",
        help="start scheduler, checkpoint coordinator and N simulated agents; supervise until Ctrl-C",
        description="Run a scheduler, a checkpoint coordinator and one simulated node agent per node as local "
        "processes, wait until every node is READY, then supervise them until SIGINT/SIGTERM. "
        "An agent that dies is a node failure: it is logged and the cluster keeps running.",
    )
    up.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        metavar="P",
        help=f"simulated host profile of every node (default {DEFAULT_PROFILE})",
    )
    up.add_argument(
        "--fabric",
        default=None,
        metavar="FILE",
        help="fabric file (Slurm topology.conf or YAML); default: generated, 4 nodes per leaf "
        "(gb200-nvl72: NVLink domains of 18 nodes from the agents' cliques, 36 nodes per leaf)",
    )
    up.add_argument("--db", default=None, metavar="URL", help="ledger URL (default: sqlite:///STATE_DIR/phalanx.db)")
    up.add_argument(
        "--min-runtime",
        type=float,
        default=LOCAL_POLICY.min_runtime_s,
        metavar="S",
        help=f"seconds a gang runs before it can be preempted (default {LOCAL_POLICY.min_runtime_s:g}; production 600)",
    )
    up.add_argument(
        "--preemption-grace",
        type=float,
        default=LOCAL_POLICY.grace_period_s,
        metavar="S",
        help=f"seconds a preempted gang gets to checkpoint (default {LOCAL_POLICY.grace_period_s:g}; production 120)",
    )
    up.add_argument(
        "--tokens",
        default=None,
        metavar="FILE",
        help="authentication on: the tokens file (`phalanx token new` makes entries), reloaded when it "
        "changes; the cluster's own processes get credentials of their own",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS between every process: a CA and certificates are generated under "
        "STATE_DIR/tls (clients: PHALANX_TLS_CA, PHALANX_TLS_CERT, PHALANX_TLS_KEY)",
    )
    up.add_argument(
        "--mig-manage",
        action="store_true",
        help="start every agent with --mig-manage: the scheduler switches idle GPUs into MIG mode when a "
        "MIG job finds none with room, and back out when whole-GPU jobs need them (held 10 s after "
        "a switch; a failed switch is retried after 10 s)",
    )
    up.add_argument(
        "--run-as",
        metavar="USER",
        help="the Unix user every agent runs ranks as (phalanx-agent --run-as; default: you, who start the cluster)",
    )
    up.add_argument(
        "--web-port",
        type=int,
        default=None,
        metavar="P",
        help="serve the live dashboard (phalanx web) on 127.0.0.1:P with the cluster (default: off)",
    )
    up.add_argument("--restart-agents", action="store_true", help="restart an agent that dies")
    up.add_argument(
        "--restart-delay", type=float, default=2.0, metavar="S", help="seconds before such a restart (default 2)"
    )
    add_common_flags(up, nodes=4, state_dir=DEFAULT_STATE_DIR)
    up.set_defaults(func=cmd_cluster_up)
