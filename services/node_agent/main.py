"""`phalanx-agent`: the node agent's command line.

    phalanx-agent --scheduler 127.0.0.1:7070 --node-name n1 --simulate dgx-h100
    phalanx-agent --discover --simulate dgx-h100 [--json]      # print the topology and exit
    phalanx-agent --discover                                     # real GPUs through NVML

Environment fallbacks: PHALANX_SCHEDULER, PHALANX_NODE_NAME, PHALANX_STATE_DIR, PHALANX_AGENT_ADDRESS,
PHALANX_FABRIC_CLUSTER (simulated NVL72 fabric cluster UUID), PHALANX_FABRIC_CLIQUE (its clique),
PHALANX_ECC_SBE_THRESHOLD, PHALANX_AGENT_TOKEN (the agent's credential, role `node`; ranks never see it: their
environment is built, identity.py), PHALANX_AGENT_TOKEN_FILE, PHALANX_CGROUP_PARENT, PHALANX_RUN_AS,
PHALANX_TLS_CA / PHALANX_TLS_CERT / PHALANX_TLS_KEY (TLS to the scheduler),
PHALANX_MPS_CONTROL (the MPS control program for fractional GPU shares), PHALANX_HOST_CPUS / PHALANX_HOST_MEMORY
(what the agent registers of the host's CPUs and memory). Logs go to standard error; --discover
writes its result on standard output.

Configuration file: `--config FILE` (or PHALANX_AGENT_CONFIG), YAML with the flags' names as keys (`node-name` or
`node_name`), e.g. `scheduler: sched:50051`, `kill-grace: 10`, `health: false`. Precedence: flags, then environment
variables, then the file, then the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from phalanx.api.v1 import agent_pb2
from phalanx.common.flags import Flag, add_flags
from phalanx.common.logging import configure_logging
from phalanx.core.resources import parse_size
from phalanx.core.topo_dump import TopoParseError
from phalanx.profiles import HostProfile, UnknownProfile, list_profiles, load_profile, load_profile_file
from services.common.metrics import serve_metrics

from . import host_resources
from .discovery import DiscoveryError, discover_topology
from .topology import render_topology, topology_to_json

# The flags of `phalanx-agent`, in the order of its --help (tables: data, not code). Those with a variable fall back
# on it where it is set and not empty; every flag of the tables but --discover and --json may be set in the
# configuration file.
CONFIG_FLAG = Flag(
    "--config",
    env="PHALANX_AGENT_CONFIG",
    metavar="FILE",
    help="YAML configuration file with the flags' names as keys (env PHALANX_AGENT_CONFIG); "
    "flags override the environment, which overrides the file",
)


def _as_bool(value: Any) -> bool:
    return _truthy(value)


def _as_list(value: Any) -> list[Any]:
    return list(value or [])


HEAD_FLAGS = (
    Flag(
        "--scheduler",
        env="PHALANX_SCHEDULER",
        ignore_empty=True,
        help="scheduler address host:port, or several replicas' comma-separated (host1:port,host2:port: "
        "tried in turn when one is unreachable) (env PHALANX_SCHEDULER)",
    ),
    Flag(
        "--node-name",
        env="PHALANX_NODE_NAME",
        ignore_empty=True,
        help="this node's name (env PHALANX_NODE_NAME; default: the host name)",
    ),
)

# One or the other (a mutually exclusive group); the help of --simulate lists the shipped profiles.
SOURCE_FLAGS = (
    Flag("--simulate", metavar="PROFILE", help="simulate a host from a shipped profile ({profiles})"),
    Flag(
        "--simulate-from",
        metavar="DUMPFILE",
        help="simulate a host from a `nvidia-smi topo -m` dump or profile file",
    ),
)

FLAGS = (
    Flag(
        "--address",
        env="PHALANX_AGENT_ADDRESS",
        ignore_empty=True,
        help="address ranks use to reach this host, MASTER_ADDR when it hosts rank 0 (env PHALANX_AGENT_ADDRESS; "
        "default: the address of the interface that routes to the scheduler, loopback only when the scheduler "
        "is on loopback)",
    ),
    Flag(
        "--state-dir",
        env="PHALANX_STATE_DIR",
        ignore_empty=True,
        help="state directory (env PHALANX_STATE_DIR; default $PHALANX_HOME/agents/<node-name>, "
        "PHALANX_HOME defaulting to .phalanx)",
    ),
    Flag("--metrics-port", type=int, help="expose Prometheus /metrics on this port"),
    Flag("--kill-grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL of a rank"),
    Flag(
        "--health",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="monitor GPU health (XID events, ECC, lost GPUs, NVLinks, throttling) and send it with the "
        "heartbeats (default on; NVML on a real host, <state-dir>/health.json when simulated)",
    ),
    Flag(
        "--ecc-sbe-threshold",
        env="PHALANX_ECC_SBE_THRESHOLD",
        ignore_empty=True,
        type=int,
        default=100,
        metavar="N",
        help="corrected (single-bit) volatile ECC errors above which a GPU is DEGRADED "
        "(env PHALANX_ECC_SBE_THRESHOLD; default 100)",
    ),
    Flag(
        "--fabric-clique",
        env="PHALANX_FABRIC_CLIQUE",
        ignore_empty=True,
        default="",
        metavar="ID",
        help="simulated hosts with a multi-node NVLink domain (gb200-nvl72): the NVML fabric clique "
        "(the rack) to report (env PHALANX_FABRIC_CLIQUE; default 0)",
    ),
    Flag(
        "--token",
        env="PHALANX_AGENT_TOKEN",
        ignore_empty=True,
        metavar="TOKEN",
        help="this agent's credential, a token of role `node` in the scheduler's tokens file "
        "(env PHALANX_AGENT_TOKEN; needed when the scheduler runs with --tokens)",
    ),
    Flag(
        "--tls-ca",
        env="PHALANX_TLS_CA",
        ignore_empty=True,
        metavar="PEM",
        help="reach the scheduler over TLS, trusting this CA (env PHALANX_TLS_CA)",
    ),
    Flag(
        "--tls-cert",
        env="PHALANX_TLS_CERT",
        ignore_empty=True,
        metavar="PEM",
        help="the agent's client certificate, for mutual TLS (env PHALANX_TLS_CERT)",
    ),
    Flag(
        "--tls-key",
        env="PHALANX_TLS_KEY",
        ignore_empty=True,
        metavar="PEM",
        help="its private key (env PHALANX_TLS_KEY)",
    ),
    Flag(
        "--mps-control",
        env="PHALANX_MPS_CONTROL",
        ignore_empty=True,
        metavar="PATH",
        help="the MPS control program that runs one MPS control daemon per GPU with fractional shares "
        "(--gpu-milli) (env PHALANX_MPS_CONTROL; default: nvidia-cuda-mps-control on PATH, or on a "
        "simulated host a stand-in shipped with Phalanx)",
    ),
    Flag(
        "--simulate-mig",
        env="PHALANX_SIMULATE_MIG",
        ignore_empty=True,
        default="",
        metavar="GPUS",
        help="simulated hosts: the MIG-capable GPUs that are in MIG mode at start: 'all', 'none' or "
        "indexes like 6,7 (env PHALANX_SIMULATE_MIG; default none). A real host reports what NVML "
        "says",
    ),
    Flag(
        "--mig-manage",
        env="PHALANX_MIG_MANAGE",
        ignore_empty=True,
        action=argparse.BooleanOptionalAction,
        default=False,
        coerce=_as_bool,
        help="let the scheduler switch an idle GPU's MIG mode when its queue needs it (NVML "
        "nvmlDeviceSetMigMode, as root; a GPU reset where NVML cannot apply it at once) "
        "(env PHALANX_MIG_MANAGE; default off: MIG mode is the administrator's)",
    ),
    Flag(
        "--token-file",
        env="PHALANX_AGENT_TOKEN_FILE",
        ignore_empty=True,
        metavar="FILE",
        help="read the agent's credential from FILE (env PHALANX_AGENT_TOKEN_FILE); the file must be readable "
        "by the agent alone (mode 600), as must --tls-key",
    ),
    Flag(
        "--cgroup-parent",
        env="PHALANX_CGROUP_PARENT",
        ignore_empty=True,
        metavar="PATH",
        help="the cgroup under which each attempt's ranks get a cgroup of their own (env PHALANX_CGROUP_PARENT; "
        "default: <the agent's own cgroup>/phalanx-<node>, cgroup v2 where the unified hierarchy has the "
        "memory and pids controllers, else the v1 hierarchies)",
    ),
    Flag(
        "--containment",
        choices=("cgroup-v2", "cgroup-v1", "process-group"),
        help="force a kind of containment instead of detecting one (process-group: no cgroups)",
    ),
    Flag(
        "--pids-max",
        type=int,
        default=0,
        metavar="N",
        help="at most N processes per attempt on this host (cgroup pids limit; default 0: no limit)",
    ),
    Flag(
        "--logs-listen",
        env="PHALANX_AGENT_LOGS_LISTEN",
        ignore_empty=True,
        default="",
        metavar="HOST:PORT",
        help="serve the ranks' logs (AgentLogs, for phalanx logs) here; default: on --address, any free port, which "
        "the registration tells the scheduler; 'off': serve none (env PHALANX_AGENT_LOGS_LISTEN)",
    ),
    Flag(
        "--log-max-bytes",
        type=int,
        default=64 * 1024 * 1024,
        metavar="N",
        help="keep each rank's log under N bytes: past it, it is rotated to <log>.1 (the older part is dropped); "
        "0: no bound (default 64 MiB)",
    ),
    Flag(
        "--run-as",
        env="PHALANX_RUN_AS",
        ignore_empty=True,
        metavar="USER",
        help="the Unix user ranks run as, unless their tenant has a unix_user in the scheduler's tokens file (env "
        "PHALANX_RUN_AS; default: nobody for an agent running as root, else the agent's own user). `root` is an "
        "explicit opt-in, logged as a warning",
    ),
    Flag(
        "--pass-env",
        action="append",
        coerce=_as_list,
        metavar="NAME",
        help="give ranks this variable of the agent's environment (repeatable); ranks get PATH, LANG, LC_*, TZ, "
        "their user's HOME/USER/SHELL, TMPDIR, the job's --env and the rank variables, and nothing else",
    ),
    Flag(
        "--self-fence",
        action=argparse.BooleanOptionalAction,
        default=True,
        coerce=_as_bool,
        help="stop every rank when the registration cannot be renewed within the node lease (before the "
        "scheduler requeues their gangs elsewhere), and register again once it can (default on)",
    ),
    Flag(
        "--rank-port-range",
        default="20000-31999",
        metavar="LO-HI",
        help="ports MASTER_PORT is chosen from when this host runs an attempt's rank 0; the scheduler gives each "
        "live attempt its own and the agent checks it is free (default 20000-31999)",
    ),
    Flag(
        "--host-cpus",
        env="PHALANX_HOST_CPUS",
        ignore_empty=True,
        metavar="N",
        help="the CPUs ranks may use on this host, as registered with the scheduler (it reserves each "
        "replica's CPUs from them) (env PHALANX_HOST_CPUS; default: the agent's CPU affinity, capped by its own cgroup's "
        "CPU quota; a simulated host: its profile's)",
    ),
    Flag(
        "--host-memory",
        env="PHALANX_HOST_MEMORY",
        ignore_empty=True,
        metavar="SIZE",
        help="the memory ranks may use on this host, like 512G, as registered with the scheduler (it reserves "
        "each replica's memory from it) (env PHALANX_HOST_MEMORY; default: MemTotal, capped by the agent's own "
        "cgroup's memory limit; a simulated host: its profile's)",
    ),
    Flag("--discover", action="store_true", help="print this host's topology and exit"),
    Flag("--json", action="store_true", help="with --discover: print JSON"),
    Flag("--log-level"),
)

_NOT_IN_FILE = ("discover", "json")

CONFIG_KEYS = {  # file key -> (argparse dest, environment variable or None)
    f.key: (f.dest_name, f.env) for f in (*HEAD_FLAGS, *SOURCE_FLAGS, *FLAGS) if f.key not in _NOT_IN_FILE
}


class ConfigError(ValueError):
    pass


def load_config(path: str | None) -> dict[str, Any]:
    """The YAML configuration file as {argparse dest: value}; {} without a file."""
    if not path:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the configuration file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("_", "-")
        if name not in CONFIG_KEYS:
            raise ConfigError(f"{path}: unknown key {key!r} (known: {', '.join(sorted(CONFIG_KEYS))})")
        out[CONFIG_KEYS[name][0]] = value
    return out


def build_parser(file: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The parser of `phalanx-agent`, its defaults from the environment, then `file` (load_config), then the
    tables'."""
    file = file or {}
    p = argparse.ArgumentParser(prog="phalanx-agent", description="Phalanx node agent")
    add_flags(p, (CONFIG_FLAG,))
    add_flags(p, HEAD_FLAGS, file=file)
    simulate, simulate_from = SOURCE_FLAGS
    simulate = dataclasses.replace(simulate, help=str(simulate.help).format(profiles=", ".join(list_profiles())))
    add_flags(p.add_mutually_exclusive_group(), (simulate, simulate_from), file=file)
    add_flags(p, FLAGS, file=file)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags > environment > configuration file > defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    add_flags(pre, (CONFIG_FLAG,))
    known, _ = pre.parse_known_args(argv)
    try:
        file = load_config(known.config)
    except ConfigError as exc:
        build_parser().error(str(exc))
    if file.get("simulate") and file.get("simulate_from"):
        build_parser().error("the configuration file gives both simulate and simulate-from")
    args = build_parser(file).parse_args(argv)
    if args.simulate and args.simulate_from:  # one from the file, the other from a flag: the flag wins
        if "simulate" in file:
            args.simulate = None
        else:
            args.simulate_from = None
    return args


def build_topology(args, node_name: str, state_dir: Path | None = None) -> tuple[agent_pb2.HostTopology, Any]:
    """(topology, NVML bindings): the real pynvml module on a GPU host (None: the default), a private instance of
    it bound to a simulated NVML library on a simulated one (its MIG state kept in `state_dir`)."""
    fabric = os.environ.get("PHALANX_FABRIC_CLUSTER", "")
    clique = args.fabric_clique
    if args.simulate or args.simulate_from:
        from .simulated import simulated_node  # only a simulated host loads the simulated libraries

        node = simulated_node(
            node_name,
            profile=args.simulate or None,
            dump_file=args.simulate_from or None,
            fabric_cluster_uuid=fabric,
            fabric_clique=clique,
            mig_gpus=args.simulate_mig,
            state_dir=state_dir,
        )
        return node.topology, node.nvml
    if args.simulate_mig not in (None, "", "none"):
        raise ValueError(
            "--simulate-mig is for simulated hosts (--simulate or --simulate-from); a real GPU's MIG "
            "mode is set with nvidia-smi -mig, or by the scheduler under --mig-manage"
        )
    return discover_topology(node_name), None


def host_overrides(args) -> tuple[float | None, int | None]:
    """(--host-cpus, --host-memory) as numbers, None where not given; ValueError naming the flag when malformed."""
    cpus = memory = None
    if args.host_cpus not in (None, ""):
        try:
            cpus = float(args.host_cpus)
        except (TypeError, ValueError):
            cpus = float("nan")
        if not math.isfinite(cpus) or cpus <= 0:
            raise ValueError(f"--host-cpus takes a positive number of CPUs, not {args.host_cpus!r}")
    if args.host_memory not in (None, ""):
        try:
            memory = parse_size(str(args.host_memory))
        except ValueError as exc:
            raise ValueError(f"--host-memory: {exc}") from exc
    return cpus, memory


def host_profile(args) -> HostProfile | None:
    """The profile a simulated host is made from (--simulate / --simulate-from), None for a real host."""
    if args.simulate:
        return load_profile(args.simulate)
    if args.simulate_from:
        return load_profile_file(args.simulate_from)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = configure_logging("node-agent", args.log_level)
    node_name = args.node_name or socket.gethostname()
    try:
        state_dir = None
        if not args.discover:
            from .state import default_state_dir

            state_dir = Path(args.state_dir) if args.state_dir else default_state_dir(node_name)
        topology, nvml = build_topology(args, node_name, state_dir)
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
    from phalanx.client import resolve_tls

    from .agent import AgentConfig, NodeAgent
    from .identity import private_file_problem
    from .state import StateDirLocked

    # The node credential is the agent's alone (ranks get a built environment, identity.py; this is belt and braces).
    os.environ.pop("PHALANX_AGENT_TOKEN", None)
    token = str(args.token or "").strip()
    for path, what in ((args.token_file, "the token file"), (args.tls_key, "the TLS key")):
        if path and (problem := private_file_problem(path, what)):
            print(f"phalanx-agent: {problem}", file=sys.stderr)
            return 2
    if args.token_file and not token:
        token = Path(args.token_file).read_text().strip()
    try:
        low, _, high = str(args.rank_port_range).partition("-")
        ports = (int(low), int(high))
        if not 1024 <= ports[0] <= ports[1] <= 65535:
            raise ValueError
    except ValueError:
        print(
            f"phalanx-agent: --rank-port-range takes LO-HI within 1024-65535, not {args.rank_port_range!r}",
            file=sys.stderr,
        )
        return 2
    bad_env = [n for n in args.pass_env if not n or "=" in n or n.startswith("CUDA_MPS_")]
    if bad_env:
        print(f"phalanx-agent: --pass-env takes variable names (never CUDA_MPS_*), not {bad_env}", file=sys.stderr)
        return 2
    try:
        resources = host_resources.resolve(host_profile(args), *host_overrides(args))
    except (UnknownProfile, TopoParseError, OSError, ValueError) as exc:
        print(f"phalanx-agent: {exc}", file=sys.stderr)
        return 2
    run_as = args.run_as or ("nobody" if os.geteuid() == 0 else None)  # never root unless asked for
    if run_as == "root":
        log.warning("ranks_run_as_root", note="--run-as root: ranks run as root (an explicit opt-in)")
    try:
        tls = resolve_tls(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:
        print(f"phalanx-agent: {exc}", file=sys.stderr)
        return 2
    serve_metrics(args.metrics_port)
    config = AgentConfig(
        scheduler=args.scheduler,
        node_name=node_name,
        topology=topology,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        address=args.address or route_address(args.scheduler, log),
        kill_grace_s=args.kill_grace,
        health_enabled=_truthy(args.health),
        ecc_sbe_threshold=int(args.ecc_sbe_threshold),
        token=token,
        tls=tls,
        mps_control=(str(args.mps_control).strip() or None) if args.mps_control else None,
        nvml=nvml,
        mig_manage=bool(args.mig_manage),
        cgroup_parent=args.cgroup_parent or None,
        containment_kind=args.containment or None,
        pids_max=int(args.pids_max or 0),
        logs_listen=args.logs_listen or "",
        log_max_bytes=int(args.log_max_bytes),
        run_as=run_as,
        pass_env=tuple(dict.fromkeys(args.pass_env)),
        self_fence=_truthy(args.self_fence),
        rank_ports=ports,
        host_cpus=resources.cpus,
        host_memory=resources.memory_bytes,
    )
    try:
        agent = NodeAgent(config)
    except ValueError as exc:
        print(f"phalanx-agent: {exc}", file=sys.stderr)
        return 2

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


def route_address(scheduler: str, log: Any = None) -> str:
    """This host's address on the interface that routes to the (first) scheduler: a UDP socket connected there
    (no packet is sent) is bound to it. Loopback when the scheduler is on loopback; 127.0.0.1 when it cannot be
    found (logged)."""
    target = scheduler.split(",")[0].strip()
    host, _, port = target.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, int(port or 0), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except (OSError, ValueError) as exc:
        if log is not None:
            log.warning("address_not_found", scheduler=target, error=str(exc), using="127.0.0.1")
        return "127.0.0.1"


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


if __name__ == "__main__":
    sys.exit(main())
