"""`phalanx-agent`: the node agent's command line.

    phalanx-agent --scheduler 127.0.0.1:7070 --node-name n1 --simulate dgx-h100
    phalanx-agent --discover --simulate dgx-h100 [--json]      # print the topology and exit
    phalanx-agent --discover                                     # real GPUs through NVML

Environment fallbacks: PHALANX_SCHEDULER, PHALANX_NODE_NAME, PHALANX_STATE_DIR, PHALANX_AGENT_ADDRESS,
PHALANX_FABRIC_CLUSTER (simulated NVL72 fabric cluster UUID), PHALANX_FABRIC_CLIQUE (its clique). Logs go to
standard error; --discover writes its result on standard output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

from phalanx.api.v1 import agent_pb2
from phalanx.profiles import UnknownProfile, list_profiles
from phalanx.core.topo_dump import TopoParseError
from services.common.logging import configure_logging
from services.common.metrics import serve_metrics

from .discovery import DiscoveryError, discover_topology
from .simulated import simulated_topology
from .topology import render_topology, topology_to_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx-agent", description="Phalanx node agent")
    p.add_argument("--scheduler", default=os.environ.get("PHALANX_SCHEDULER"),
                   help="scheduler address host:port (env PHALANX_SCHEDULER)")
    p.add_argument("--node-name", default=os.environ.get("PHALANX_NODE_NAME"),
                   help="this node's name (env PHALANX_NODE_NAME; default: the host name)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--simulate", metavar="PROFILE",
                     help=f"simulate a host from a shipped profile ({', '.join(list_profiles())})")
    src.add_argument("--simulate-from", metavar="DUMPFILE",
                     help="simulate a host from a `nvidia-smi topo -m` dump or profile file")
    p.add_argument("--address", default=os.environ.get("PHALANX_AGENT_ADDRESS", "127.0.0.1"),
                   help="address ranks use to reach this host (default 127.0.0.1)")
    p.add_argument("--state-dir", default=os.environ.get("PHALANX_STATE_DIR"),
                   help="state directory (env PHALANX_STATE_DIR; default $PHALANX_HOME/agents/<node-name>, PHALANX_HOME defaulting to .phalanx)")
    p.add_argument("--metrics-port", type=int, default=None, help="expose Prometheus /metrics on this port")
    p.add_argument("--kill-grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL of a rank")
    p.add_argument("--fabric-clique", default=os.environ.get("PHALANX_FABRIC_CLIQUE", ""), metavar="ID",
                   help="simulated hosts with a multi-node NVLink domain (gb200-nvl72): the NVML fabric clique "
                        "(the rack) to report (env PHALANX_FABRIC_CLIQUE; default 0)")
    p.add_argument("--discover", action="store_true", help="print this host's topology and exit")
    p.add_argument("--json", action="store_true", help="with --discover: print JSON")
    p.add_argument("--log-level", default=None)
    return p


def build_topology(args, node_name: str) -> agent_pb2.HostTopology:
    fabric = os.environ.get("PHALANX_FABRIC_CLUSTER", "")
    clique = args.fabric_clique
    if args.simulate:
        return simulated_topology(node_name, profile=args.simulate, fabric_cluster_uuid=fabric, fabric_clique=clique)
    if args.simulate_from:
        return simulated_topology(node_name, dump_file=args.simulate_from, fabric_cluster_uuid=fabric,
                                  fabric_clique=clique)
    return discover_topology(node_name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = configure_logging("node-agent", args.log_level)
    node_name = args.node_name or socket.gethostname()
    try:
        topology = build_topology(args, node_name)
    except DiscoveryError as exc:
        print(f"phalanx-agent: GPU discovery failed: {exc}", file=sys.stderr)
        return 2
    except (UnknownProfile, TopoParseError, OSError, ValueError) as exc:
        print(f"phalanx-agent: {exc}", file=sys.stderr)
        return 2
    if args.discover:
        if args.json:
            print(json.dumps(topology_to_json(topology), indent=2))
        else:
            print(render_topology(topology), end="")
        return 0
    if not args.scheduler:
        print("phalanx-agent: --scheduler (or PHALANX_SCHEDULER) is required", file=sys.stderr)
        return 2
    from .agent import AgentConfig, NodeAgent
    from .state import StateDirLocked

    serve_metrics(args.metrics_port)
    config = AgentConfig(
        scheduler=args.scheduler,
        node_name=node_name,
        topology=topology,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        address=args.address,
        kill_grace_s=args.kill_grace,
    )
    agent = NodeAgent(config)

    async def _run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.request_stop)
        await agent.run()

    try:
        asyncio.run(_run())
    except StateDirLocked as exc:
        print(f"phalanx-agent: {exc}", file=sys.stderr)
        return 1
    log.info("exit", code=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
