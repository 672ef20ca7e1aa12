"""The serving verbs of ``phalanx``: ``service`` (create, get, endpoints, update, scale, rollback, delete,
push-metric), ``services`` (the list) and ``apply -f`` (a spec file, checked against its published schema).

A service is K replicas of a model server, each a gang of N nodes x G GPUs: ``phalanx service create llm --replicas
2 --nodes-per-replica 2 --gpus-per-node 8 --ready-http 8000/health -- vllm serve ...``. Exit codes are those of every
verb: 1 for an error the scheduler answers (``error: INVALID_ARGUMENT: ...``), 2 for a bad command line or spec file
(nothing is sent).
"""

from __future__ import annotations

import argparse
import sys

from phalanx.client import Service, ServiceSpecError, load_service_spec

from . import console, render, service_render
from .argtypes import bounded
from .common import EXIT_OK, UsageError, add_json_flag
from .service_flags import CommandParser, add_service_flags, add_template_flags, spec_from_args, updated_spec


def _show(service: Service, as_json: bool) -> None:
    console.emit(render.to_json(service.to_dict()) if as_json else service_render.service_detail(service))


def cmd_service_create(args: argparse.Namespace) -> int:
    """``phalanx service create NAME ... -- CMD``: create a service and print it."""
    spec = spec_from_args(args)
    with console.client(args) as client:
        service = client.create_service(spec)
    _show(service, args.json)
    return EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    """``phalanx apply -f FILE``: create the service of a spec file, or roll it to the file (``-`` reads standard
    input). A file that does not match the schema is a usage error (exit 2) listing every problem; nothing is sent.
    ``--check`` only checks the file and prints the spec as the scheduler would get it."""
    try:
        if args.file == "-":
            spec = load_service_spec("<stdin>", text=sys.stdin.read())
        else:
            spec = load_service_spec(args.file)
    except ServiceSpecError as exc:
        problems = "\n".join(f"  {p}" for p in exc.problems)
        count = len(exc.problems)
        raise UsageError(f"{exc.source}: {count} problem{'s' if count > 1 else ''}:\n{problems}") from None
    if args.check:
        console.emit(
            render.to_json(spec.to_dict()) if args.json else f"{args.file}: a valid spec of service {spec.name}"
        )
        return EXIT_OK
    with console.client(args) as client:
        service = client.apply_service(spec)
    _show(service, args.json)
    return EXIT_OK


def cmd_service_get(args: argparse.Namespace) -> int:
    """``phalanx service get NAME``: the service, its replicas and revisions."""
    with console.client(args) as client:
        service = client.get_service(args.name)
    _show(service, args.json)
    return EXIT_OK


def cmd_services(args: argparse.Namespace) -> int:
    """``phalanx services``: every service; ``--json`` prints an array of service objects."""
    with console.client(args) as client:
        services = client.list_services()
    if args.json:
        console.emit(render.to_json([s.to_dict() for s in services]))
    else:
        console.emit(service_render.services_table(services))
    return EXIT_OK


def cmd_service_endpoints(args: argparse.Namespace) -> int:
    """``phalanx service endpoints NAME``: the ready replicas' leader addresses; ``--watch``: a line (a JSON array
    with ``--json``) now and at each change, until interrupted or the service is deleted."""
    with console.client(args) as client:
        if not args.watch:
            endpoints = client.get_service(args.name).endpoints
            if args.json:
                console.emit(render.to_json(service_render.endpoints_json(endpoints)))
            else:
                console.emit(service_render.endpoints_table(endpoints))
            return EXIT_OK
        stream = client.watch_endpoints(args.name)
        try:
            for endpoints in stream:
                if args.json:
                    console.emit(render.to_json(service_render.endpoints_json(endpoints), lines=True))
                else:
                    console.emit(service_render.endpoints_line(args.name, endpoints))
        finally:
            stream.close()
    sys.stderr.write(f"service {args.name} was deleted\n")
    return EXIT_OK


def cmd_service_update(args: argparse.Namespace) -> int:
    """``phalanx service update NAME [flags] [-- CMD]``: a new revision, the current template with the given
    changes (a flag left out keeps its value; ``--env`` adds or replaces variables), rolled out replica by replica."""
    with console.client(args) as client:
        current = client.get_service(args.name)
        if current.spec is None:  # pragma: no cover - the scheduler always answers the spec
            raise UsageError(f"service {args.name} has no spec")
        spec = updated_spec(current.spec, args)
        service = client.update_service(args.name, spec)
    if service.revision == current.revision:
        sys.stderr.write(f"note: the template is unchanged: service {args.name} stays at revision {service.revision}\n")
    _show(service, args.json)
    return EXIT_OK


def cmd_service_scale(args: argparse.Namespace) -> int:
    """``phalanx service scale NAME K``: set the replica count."""
    with console.client(args) as client:
        service = client.scale_service(args.name, args.replicas)
    _show(service, args.json)
    return EXIT_OK


def cmd_service_rollback(args: argparse.Namespace) -> int:
    """``phalanx service rollback NAME [--revision N]``: back to the revision before (or N), as a new revision."""
    with console.client(args) as client:
        service = client.rollback_service(args.name, args.revision or 0)
    _show(service, args.json)
    return EXIT_OK


def cmd_service_delete(args: argparse.Namespace) -> int:
    """``phalanx service delete NAME``: stop every replica and remove the service."""
    with console.client(args) as client:
        service = client.delete_service(args.name)
    _show(service, args.json)
    return EXIT_OK


def cmd_service_push_metric(args: argparse.Namespace) -> int:
    """``phalanx service push-metric NAME METRIC VALUE [--replica I]``: a value for the autoscaler."""
    try:
        value = float(args.value)
    except ValueError:
        raise UsageError(f"VALUE must be a number, got {args.value!r}") from None
    with console.client(args) as client:
        client.push_metric(args.name, args.metric, value, replica=args.replica)
    pushed = {"service": args.name, "metric": args.metric, "value": value, "replica": args.replica}
    if args.json:
        console.emit(render.to_json(pushed))
    else:
        where = "the whole service" if args.replica is None else f"replica {args.replica}"
        console.emit(f"pushed {args.metric}={value:g} to service {args.name} ({where})")
    return EXIT_OK


# -- parser ----------------------------------------------------------------------------------------------------


def register(sub) -> None:
    """Add ``service``, ``services`` and ``apply`` to the ``phalanx`` subcommands `sub`."""
    p = sub.add_parser("service", help="serving fleets: create, get, endpoints, update, scale, rollback, delete")
    verbs = p.add_subparsers(dest="service_command", metavar="SUBCOMMAND", parser_class=CommandParser)
    verbs.required = True

    c = verbs.add_parser(
        "create",
        help="create a service: K replicas, each a gang of N nodes x G GPUs",
        usage="phalanx service create NAME --replicas K [--nodes-per-replica N] --gpus-per-node G [options] -- CMD...",
    )
    c.add_argument("name", metavar="NAME", help="lowercase letters, digits or '-'; replicas are NAME-0, NAME-1...")
    add_service_flags(c)
    add_template_flags(c, update=False)
    add_json_flag(c)
    c.add_argument("command", nargs="*", metavar="CMD", help="the command, after --")
    c.set_defaults(func=cmd_service_create)

    g = verbs.add_parser("get", help="a service: its replicas (state, readiness, nodes, leader) and revisions")
    g.add_argument("name", metavar="NAME")
    add_json_flag(g)
    g.set_defaults(func=cmd_service_get)

    e = verbs.add_parser("endpoints", help="the ready replicas' leader addresses (--watch: at each change)")
    e.add_argument("name", metavar="NAME")
    e.add_argument("--watch", action="store_true", help="a line now and at each change, until Ctrl-C")
    add_json_flag(e)
    e.set_defaults(func=cmd_service_endpoints)

    u = verbs.add_parser(
        "update",
        help="a new revision (rolled out replica by replica): the flags given change the current template",
        usage="phalanx service update NAME [options] [-- CMD...]",
    )
    u.add_argument("name", metavar="NAME")
    add_template_flags(u, update=True)
    add_json_flag(u)
    u.add_argument("command", nargs="*", metavar="CMD", help="the new command, after -- (default: unchanged)")
    u.set_defaults(func=cmd_service_update)

    s = verbs.add_parser("scale", help="set a service's replica count")
    s.add_argument("name", metavar="NAME")
    s.add_argument("replicas", type=bounded("K", 0, 10_000), metavar="K")
    add_json_flag(s)
    s.set_defaults(func=cmd_service_scale)

    r = verbs.add_parser("rollback", help="back to the previous revision (or --revision N), as a new revision")
    r.add_argument("name", metavar="NAME")
    r.add_argument("--revision", type=bounded("--revision", 1), default=None, metavar="N")
    add_json_flag(r)
    r.set_defaults(func=cmd_service_rollback)

    d = verbs.add_parser("delete", help="stop every replica and remove the service")
    d.add_argument("name", metavar="NAME")
    add_json_flag(d)
    d.set_defaults(func=cmd_service_delete)

    m = verbs.add_parser("push-metric", help="give the autoscaler a metric value (instead of scraping)")
    m.add_argument("name", metavar="NAME")
    m.add_argument("metric", metavar="METRIC")
    m.add_argument("value", metavar="VALUE")
    m.add_argument("--replica", type=bounded("--replica", 0), default=None, metavar="I", help="default: the service")
    add_json_flag(m)
    m.set_defaults(func=cmd_service_push_metric)

    p = sub.add_parser("services", help="list services: revision, ready/desired replicas, what each waits for")
    add_json_flag(p)
    p.set_defaults(func=cmd_services)

    p = sub.add_parser("apply", help="create a service from a spec file (YAML or JSON), or roll it to the file")
    p.add_argument("-f", "--file", required=True, metavar="FILE", help="the spec file; - reads standard input")
    p.add_argument("--check", action="store_true", help="only check the file against the schema; send nothing")
    add_json_flag(p)
    p.set_defaults(func=cmd_apply)


__all__ = [
    "register",
    "cmd_apply",
    "cmd_services",
    "cmd_service_create",
    "cmd_service_get",
    "cmd_service_endpoints",
    "cmd_service_update",
    "cmd_service_scale",
    "cmd_service_rollback",
    "cmd_service_delete",
    "cmd_service_push_metric",
]
