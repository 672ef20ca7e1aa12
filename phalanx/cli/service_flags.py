"""The flags of ``phalanx service create`` and ``phalanx service update`` that describe a replica (its nodes, GPUs,
command, roles, readiness probe, restart, placement, host resources) and the service (replicas, port, spread,
rollout bounds, autoscaler), their value types, and the :class:`~phalanx.client.ServiceSpec` they make.

Per-role options name a role of ``--roles``: ``--role-command decode='python -m decode --port 9000'`` (a shell-quoted
string), ``--role-env decode:KEY=VALUE``. An unknown role is a usage error (exit 2) that lists the roles.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from phalanx.client import Autoscale, ReadyProbe, Role, ServiceSpec
from phalanx.core.preemption import PRIORITY_CLASSES

from .argtypes import arg_type, bounded, cpus, memory, parse_env, priority
from .common import Parser, UsageError

ROLE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")
START_ORDERS = ("any", "leader-first", "workers-first")
RESTARTS = ("always", "none", "never")


class CommandParser(Parser):
    """A verb whose command follows ``--``: everything after the first ``--`` is the command, verbatim (flags of
    its own included), wherever the verb's positional arguments are (argparse alone would take ``NAME`` and an
    empty command at once, and refuse the words after ``--``)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        words = list(sys.argv[1:] if args is None else args)
        command = None
        if "--" in words:
            at = words.index("--")
            words, command = words[:at], words[at + 1 :]
        parsed, rest = super().parse_known_args(words, namespace)
        if command is not None:
            if not hasattr(parsed, "command"):
                self.error("this command takes no command after --")
            if parsed.command:
                self.error("give the command after -- only")
            parsed.command = command
        return parsed, rest


# -- value types ---------------------------------------------------------------------------------------------------


def parse_roles(text: str) -> list[Role]:
    """``--roles prefill:2,decode:1``: role names and their nodes per replica, in order (the first role's first node
    is the leader)."""
    roles = []
    for part in text.split(","):
        name, sep, count = part.strip().partition(":")
        if not sep or not ROLE_NAME.match(name) or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(
                f"--roles takes NAME:NODES,... (a name of lowercase letters, digits or '-', and at least 1 node), "
                f"got {part.strip()!r}"
            )
        roles.append(Role(name, int(count)))
    names = [r.name for r in roles]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--roles names each role once; repeated: {', '.join(repeated)}")
    return roles


def parse_role_command(text: str) -> tuple[str, list[str]]:
    """``--role-command ROLE=CMD``: a role's command, CMD a shell-quoted string (``decode='python -m decode'``)."""
    role, sep, command = text.partition("=")
    if not sep or not role.strip():
        raise ValueError(f"--role-command takes ROLE='CMD ARGS', got {text!r}")
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"--role-command {role}: {exc} in {command!r}") from None
    if not argv:
        raise ValueError(f"--role-command {role}: the command is empty")
    return role.strip(), argv


def parse_role_env(text: str) -> tuple[str, str, str]:
    """``--role-env ROLE:KEY=VALUE``: a variable of one role's ranks."""
    role, sep, pair = text.partition(":")
    key, eq, value = pair.partition("=")
    if not sep or not role.strip() or not eq or not key:
        raise ValueError(f"--role-env takes ROLE:KEY=VALUE, got {text!r}")
    return role.strip(), key, value


def parse_ready_http(text: str) -> tuple[int, str]:
    """``--ready-http PORT[/PATH]`` (``8000/health``, ``:8000/v1/models``, ``8000``): the leader's port and path
    (default ``/``) whose GET must answer 2xx."""
    port_text, slash, path = text.strip().lstrip(":").partition("/")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"--ready-http takes PORT/PATH with a port of 1-65535, e.g. 8000/health, got {text!r}")
    return int(port_text), "/" + path if slash else "/"


def parse_seconds(text: str) -> float:
    """A number of seconds, 0 or more."""
    try:
        value = float(text.strip().removesuffix("s"))
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise ValueError(f"seconds must be 0 or more, got {text!r}")
    return value


def parse_target(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--target takes a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"--target must be more than 0, got {text!r}")
    return value


roles_type = arg_type(parse_roles)
role_command_type = arg_type(parse_role_command)
role_env_type = arg_type(parse_role_env)
ready_http_type = arg_type(parse_ready_http)
seconds_type = arg_type(parse_seconds)
target_type = arg_type(parse_target)


# -- flags ---------------------------------------------------------------------------------------------------------


def add_template_flags(p: argparse.ArgumentParser, *, update: bool) -> None:
    """The flags of one replica (create and update). On update every flag defaults to None: what is not given is
    kept from the current revision."""
    p.add_argument(
        "--nodes-per-replica",
        type=bounded("--nodes-per-replica", 1),
        default=None,
        metavar="N",
        help="nodes of one replica, a gang placed whole (default: the roles' nodes added up, else 1)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=bounded("--gpus-per-node", 1),
        default=None,
        required=not update,
        metavar="G",
        help="GPUs of each node of a replica",
    )
    p.add_argument(
        "--priority",
        type=priority,
        default=None,
        metavar="P",
        help="an integer (higher wins) or a class name: " + ", ".join(PRIORITY_CLASSES) + " (default 0)",
    )
    p.add_argument("--queue", default=None, metavar="QUEUE", help="the queue of its replicas (default: default)")
    p.add_argument(
        "--roles",
        type=roles_type,
        default=None,
        metavar="NAME:NODES,...",
        help="parts of a replica placed together, in order, e.g. prefill:2,decode:1 (the first role's first node "
        "is the leader)" + ("; replaces the current roles" if update else ""),
    )
    p.add_argument(
        "--role-command",
        type=role_command_type,
        action="append",
        default=None,
        metavar="ROLE='CMD ARGS'",
        help="the command of one role's ranks, a shell-quoted string (repeatable; default: the service's command)",
    )
    p.add_argument(
        "--role-env",
        type=role_env_type,
        action="append",
        default=None,
        metavar="ROLE:KEY=VALUE",
        help="a variable of one role's ranks only (repeatable)",
    )
    p.add_argument(
        "--start-order",
        choices=START_ORDERS,
        default=None,
        help="when a replica's ranks start: all at once (any, the default), the leader first (vLLM, SGLang) or last "
        "(TensorRT-LLM, MPI)",
    )
    _add_probe_flags(p, update=update)
    p.add_argument(
        "--restart",
        choices=RESTARTS,
        default=None,
        help="always (default): a replica that exits or fails restarts whole; none: it stays down, FAILED",
    )
    p.add_argument("--env", action="extend", nargs="+", metavar="K=V", help="environment of every rank (repeatable)")
    if update:
        p.add_argument("--unset-env", action="append", default=None, metavar="K", help="remove a variable (repeatable)")
    p.add_argument("--required-tier", default=None, metavar="TIER", help="each replica fits under one domain of TIER")
    p.add_argument("--preferred-tier", default=None, metavar="TIER", help="best effort: each replica under one domain")
    p.add_argument("--gpu-model", default=None, metavar="MODEL", help="only nodes whose GPU model contains MODEL")
    p.add_argument(
        "--procs-per-node",
        type=bounded("--procs-per-node", 0, 1),
        default=None,
        metavar="0|1",
        help="0: one process per GPU (default); 1: one per node with all its GPUs (vLLM, SGLang, torchrun)",
    )
    p.add_argument("--cpus-per-node", type=cpus, default=None, metavar="N", help="CPUs each node reserves")
    p.add_argument("--memory-per-node", type=memory, default=None, metavar="SIZE", help="memory each node reserves")
    p.add_argument(
        "--max-unavailable",
        type=bounded("--max-unavailable", 0),
        default=None,
        metavar="N",
        help="rolling update: at most N replicas below the count unready at once (default 1)",
    )
    p.add_argument(
        "--max-surge",
        type=bounded("--max-surge", 0),
        default=None,
        metavar="N",
        help="rolling update: at most N replicas started above the count at once (default 0)",
    )


def _add_probe_flags(p: argparse.ArgumentParser, *, update: bool) -> None:
    probe = p.add_mutually_exclusive_group()
    probe.add_argument(
        "--ready-cmd",
        default=None,
        metavar="'CMD ARGS'",
        help="readiness probe: a shell-quoted command run on the leader's node; exit 0 means ready",
    )
    probe.add_argument(
        "--ready-http",
        type=ready_http_type,
        default=None,
        metavar="PORT/PATH",
        help="readiness probe: GET http://LEADER:PORT/PATH answers 2xx, e.g. 8000/health",
    )
    if update:
        probe.add_argument("--no-ready-probe", action="store_true", help="remove the readiness probe")
    p.add_argument("--ready-period", type=seconds_type, default=None, metavar="S", help="between probes (default 2)")
    p.add_argument("--ready-delay", type=seconds_type, default=None, metavar="S", help="before the first probe")
    p.add_argument("--ready-timeout", type=seconds_type, default=None, metavar="S", help="of one probe (default 2)")
    p.add_argument(
        "--ready-failures",
        type=bounded("--ready-failures", 1, 1000),
        default=None,
        metavar="N",
        help="failures in a row that make a ready replica unready (default 3)",
    )


def add_service_flags(p: argparse.ArgumentParser) -> None:
    """The service's own flags (create only): replicas, port, spread, autoscaler."""
    p.add_argument(
        "--replicas",
        type=bounded("--replicas", 1, 10_000),
        default=None,
        metavar="K",
        help="model replicas to keep running (required, except with --max: then --min)",
    )
    p.add_argument(
        "--port",
        type=bounded("--port", 1, 65535),
        default=None,
        metavar="PORT",
        help="the leader's serving port, named by the endpoints (default: the --ready-http port)",
    )
    p.add_argument("--spread-tier", default=None, metavar="TIER", help="replicas in different domains of TIER")
    auto = p.add_argument_group("autoscaler (HPA's rule: --max, --metric and --target turn it on)")
    auto.add_argument("--min", type=bounded("--min", 1), default=None, metavar="N", help="fewest replicas (default 1)")
    auto.add_argument("--max", type=bounded("--max", 1, 10_000), default=None, metavar="N", help="most replicas")
    auto.add_argument("--metric", default=None, metavar="NAME", help="e.g. vllm:num_requests_waiting")
    auto.add_argument("--target", type=target_type, default=None, metavar="X", help="its target per ready replica")
    auto.add_argument(
        "--metrics-port",
        type=bounded("--metrics-port", 1, 65535),
        default=None,
        metavar="P",
        help="scrape each ready leader's metrics on this port (default: none, push them with push-metric)",
    )
    auto.add_argument("--metrics-path", default=None, metavar="PATH", help="default: /metrics")
    auto.add_argument("--scale-down-window", type=seconds_type, default=None, metavar="S", help="default 300 seconds")
    auto.add_argument("--scale-up-window", type=seconds_type, default=None, metavar="S", help="default 0")


# -- specs ---------------------------------------------------------------------------------------------------------


def _with_role_options(roles: Sequence[Role], args: argparse.Namespace) -> list[Role]:
    """Apply --role-command and --role-env to `roles`; a role that is not there is a usage error."""
    by_name = {r.name: r for r in roles}
    known = ", ".join(by_name) or "none (give --roles)"
    for flag, items in (("--role-command", args.role_command or []), ("--role-env", args.role_env or [])):
        for item in items:
            if item[0] not in by_name:
                raise UsageError(f"{flag}: no role named {item[0]!r}; the roles are: {known}")
    for name, argv in args.role_command or []:
        by_name[name] = dataclasses.replace(by_name[name], command=argv)
    for name, key, value in args.role_env or []:
        by_name[name] = dataclasses.replace(by_name[name], env={**by_name[name].env, key: value})
    return [by_name[r.name] for r in roles]


def _probe(args: argparse.Namespace, current: ReadyProbe | None) -> ReadyProbe | None:
    timings = {
        "period_s": args.ready_period,
        "initial_delay_s": args.ready_delay,
        "timeout_s": args.ready_timeout,
        "failure_threshold": args.ready_failures,
    }
    given = {k: v for k, v in timings.items() if v is not None}
    if getattr(args, "no_ready_probe", False):
        if given:
            raise UsageError("--no-ready-probe removes the probe: leave out the --ready-* timings")
        return None
    if args.ready_cmd is not None:
        try:
            argv = shlex.split(args.ready_cmd)
        except ValueError as exc:
            raise UsageError(f"--ready-cmd: {exc}") from None
        if not argv:
            raise UsageError("--ready-cmd: the command is empty")
        return ReadyProbe(command=argv, **given)
    if args.ready_http is not None:
        port, path = args.ready_http
        return ReadyProbe(http_port=port, http_path=path, **given)
    if given:
        if current is None:
            raise UsageError(
                "--ready-period, --ready-delay, --ready-timeout and --ready-failures need --ready-cmd or --ready-http"
            )
        return dataclasses.replace(current, **given)
    return current


def _autoscale(args: argparse.Namespace) -> Autoscale | None:
    extras = (args.min, args.metrics_port, args.metrics_path, args.scale_down_window, args.scale_up_window)
    if args.max is None and args.metric is None and args.target is None:
        if any(v is not None for v in extras):
            raise UsageError("the autoscaler needs --max, --metric and --target")
        return None
    if args.max is None or not args.metric or args.target is None:
        raise UsageError("the autoscaler needs --max, --metric and --target together")
    low = args.min if args.min is not None else 1
    if args.max < low:
        raise UsageError(f"--max {args.max} is below --min {low}")
    if args.metrics_path is not None and not args.metrics_path.startswith("/"):
        raise UsageError(f"--metrics-path must start with '/', got {args.metrics_path!r}")
    return Autoscale(
        min_replicas=low,
        max_replicas=args.max,
        metric=args.metric,
        target=args.target,
        metrics_port=args.metrics_port or 0,
        metrics_path=args.metrics_path or "",
        scale_down_window_s=args.scale_down_window or 0.0,
        scale_up_window_s=args.scale_up_window or 0.0,
    )


def _nodes(args: argparse.Namespace, roles: Sequence[Role], current: int) -> int:
    if args.roles is not None and args.nodes_per_replica is not None:
        total = sum(r.nodes for r in roles)
        if args.nodes_per_replica != total:
            raise UsageError(f"--nodes-per-replica {args.nodes_per_replica}, but --roles add up to {total} nodes")
    if args.nodes_per_replica is not None:
        return int(args.nodes_per_replica)
    return 0 if args.roles is not None else current


def spec_from_args(args: argparse.Namespace) -> ServiceSpec:
    """``phalanx service create``: the spec its flags describe."""
    command = list(args.command or [])
    if not command:
        raise UsageError("a command is required: phalanx service create NAME ... -- CMD ARGS...")
    autoscale = _autoscale(args)
    replicas = args.replicas
    if replicas is None:
        if autoscale is None:
            raise UsageError("--replicas is required (it may be left out with the autoscaler: it starts at --min)")
        replicas = autoscale.min_replicas
    roles = _with_role_options(args.roles or [], args)
    base = ServiceSpec(
        name=args.name,
        replicas=replicas,
        gpus_per_node=args.gpus_per_node,
        port=args.port or 0,
        spread_tier=args.spread_tier or "",
        autoscale=autoscale,
    )
    return _template_changes(base, args, roles, command)


def updated_spec(current: ServiceSpec, args: argparse.Namespace) -> ServiceSpec:
    """``phalanx service update``: the current spec with the given flags' changes (the rest kept)."""
    roles = _with_role_options(args.roles if args.roles is not None else current.roles, args)
    command = list(args.command) if args.command else list(current.command)
    return _template_changes(current, args, roles, command)


def _template_changes(
    base: ServiceSpec, args: argparse.Namespace, roles: list[Role], command: list[str]
) -> ServiceSpec:
    env = dict(base.env)
    env.update(parse_env(args.env))
    for key in getattr(args, "unset_env", None) or []:
        if key not in env:
            raise UsageError(f"--unset-env {key}: the service has no such variable")
        env.pop(key)
    changes: dict[str, Any] = {
        "command": command,
        "env": env,
        "roles": roles,
        "nodes_per_replica": _nodes(args, roles, base.nodes_per_replica),
        "ready_probe": _probe(args, base.ready_probe),
    }
    for flag in ("gpus_per_node", "priority", "queue", "start_order", "required_tier", "preferred_tier", "gpu_model"):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    for flag, field in (
        ("procs_per_node", "procs_per_node"),
        ("cpus_per_node", "cpus_per_node"),
        ("memory_per_node", "memory_per_node"),
        ("restart", "restart"),
        ("max_unavailable", "max_unavailable"),
        ("max_surge", "max_surge"),
    ):
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    if changes.get("restart") == "none":
        changes["restart"] = "never"
    return dataclasses.replace(base, **changes)
