"""The administration verbs of ``phalanx``: ``node drain|undrain``, ``queue``, ``quota set|delete`` and ``token new``."""

from __future__ import annotations

import argparse

from . import console, render
from .argtypes import priority
from .common import EXIT_OK, Parser, UsageError, add_json_flag


def cmd_node_drain(args: argparse.Namespace) -> int:
    """``phalanx node drain NAME``: (admin) take a node out of placement until undrained."""
    with console.client(args) as client:
        node = client.drain_node(args.node_name, reason=args.reason or "")
    console.emit(render.to_json(node.to_dict()) if args.json else render.nodes_table([node]))
    return EXIT_OK


def cmd_node_undrain(args: argparse.Namespace) -> int:
    """``phalanx node undrain NAME``: (admin) put a drained node back (READY if its agent is alive)."""
    with console.client(args) as client:
        node = client.undrain_node(args.node_name)
    console.emit(render.to_json(node.to_dict()) if args.json else render.nodes_table([node]))
    return EXIT_OK


def cmd_queue(args: argparse.Namespace) -> int:
    """``phalanx queue [QUEUE]``: quotas, use, share and pending jobs (in serving order) of every queue."""
    with console.client(args) as client:
        queues = client.queues(args.name)
    console.emit(render.to_json([q.to_dict() for q in queues]) if args.json else render.queues_table(queues))
    return EXIT_OK


def parse_quota(text: str) -> tuple[str, dict[str, float]]:
    """``FLAVOR=GPUS[,borrow=N][,mig=N]`` -> (flavor, {"gpus", "borrow_limit", "mig_slices"})."""
    flavor, sep, rest = text.partition("=")
    parts = rest.split(",") if sep else []
    if not flavor.strip() or not parts:
        raise UsageError(f"--quota {text!r}: give FLAVOR=GPUS[,borrow=N][,mig=N], e.g. H100=64,borrow=16")
    out: dict[str, float] = {}
    try:
        out["gpus"] = float(parts[0])
        for part in parts[1:]:
            key, _, value = part.partition("=")
            name = {"borrow": "borrow_limit", "mig": "mig_slices"}.get(key.strip())
            if name is None or not value:
                raise ValueError
            out[name] = float(value)
    except ValueError:
        raise UsageError(f"--quota {text!r}: give FLAVOR=GPUS[,borrow=N][,mig=N] with numbers") from None
    return flavor.strip(), out


def cmd_quota_set(args: argparse.Namespace) -> int:
    """``phalanx quota set QUEUE --quota H100=64,borrow=16 ...``: (admin) create or replace a queue."""
    quotas: dict[str, dict[str, float]] = {}
    specs = list(args.quota) + ([f"*={args.gpus}"] if args.gpus is not None else [])
    for text in specs:
        flavor, quota = parse_quota(text)
        if flavor in quotas:
            raise UsageError(f"--quota: flavor {flavor!r} is given twice")
        quotas[flavor] = quota
    with console.client(args) as client:
        queue = client.set_queue(
            args.queue,
            quotas,
            cohort=args.cohort,
            weight=args.weight,
            tenants=args.tenant,
            max_priority=args.max_priority,
        )
    console.emit(render.to_json(queue.to_dict()) if args.json else render.queues_table([queue]))
    return EXIT_OK


def cmd_quota_delete(args: argparse.Namespace) -> int:
    with console.client(args) as client:
        client.delete_queue(args.queue)
    console.emit(render.to_json({"deleted": args.queue}) if args.json else f"queue {args.queue} deleted")
    return EXIT_OK


def cmd_token_new(args: argparse.Namespace) -> int:
    """``phalanx token new --tenant T [--role R] [--node NAME]``: a new token and its tokens-file entry (only the
    entry, with the token's SHA-256, goes in the scheduler's file; the token itself is shown once). A node token
    names the one node it may act as."""
    from phalanx.common.tokens import entry_line, new_token, token_entry

    if args.role == "node" and not args.node:
        raise UsageError("a node token names the node it acts as: --node NAME")
    token = new_token()
    try:
        entry = token_entry(token, args.tenant, args.role, args.node or "")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        console.emit(render.to_json({"token": token, "entry": entry}))
    else:
        console.emit(
            f"token: {token}\n"
            f"# add this entry to the tokens file (--tokens FILE); give the token to its user as PHALANX_TOKEN\n"
            f"{entry_line(entry)}"
        )
    return EXIT_OK


# -- parser ----------------------------------------------------------------------------------------------------


def register(sub) -> None:
    """Add ``node``, ``queue``, ``quota`` and ``token`` to the ``phalanx`` subcommands `sub`."""
    p = sub.add_parser("node", help="node administration (admin): drain, undrain")
    node_sub = p.add_subparsers(dest="node_command", metavar="SUBCOMMAND", parser_class=Parser)
    node_sub.required = True
    dr = node_sub.add_parser("drain", help="take a node out of placement (stays drained across agent restarts)")
    dr.add_argument("node_name", metavar="NAME")
    dr.add_argument("--reason", default=None, metavar="TEXT", help="why, shown as the node's message")
    add_json_flag(dr)
    dr.set_defaults(func=cmd_node_drain)
    un = node_sub.add_parser("undrain", help="put a drained node back (READY if its agent is alive)")
    un.add_argument("node_name", metavar="NAME")
    add_json_flag(un)
    un.set_defaults(func=cmd_node_undrain)

    p = sub.add_parser("queue", help="queues: quotas, usage, fair share, pending jobs in serving order")
    p.add_argument("name", nargs="?", default="", metavar="QUEUE")
    add_json_flag(p)
    p.set_defaults(func=cmd_queue)

    p = sub.add_parser("quota", help="queue quotas (admin): set, delete")
    q_sub = p.add_subparsers(dest="quota_command", metavar="SUBCOMMAND", parser_class=Parser)
    q_sub.required = True
    qs = q_sub.add_parser("set", help="create or replace a queue's quotas, cohort, weight and tenants")
    qs.add_argument("queue", metavar="QUEUE")
    qs.add_argument(
        "--quota",
        action="append",
        default=[],
        metavar="FLAVOR=GPUS[,borrow=N][,mig=N]",
        help="nominal GPUs of a flavor (a GPU model such as H100, or '*' for any), optionally a "
        "borrowing limit and MIG compute slices; repeat for several flavors, in preference order",
    )
    qs.add_argument("--gpus", type=float, default=None, metavar="N", help="shorthand for --quota '*=N'")
    qs.add_argument("--cohort", default="", metavar="C", help="queues of one cohort lend each other idle quota")
    qs.add_argument("--weight", type=float, default=1.0, metavar="W", help="fair-share weight (default 1)")
    qs.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="T",
        help="a tenant allowed to submit to it (repeat; default: anyone)",
    )
    qs.add_argument(
        "--max-priority",
        type=priority,
        default=0,
        metavar="P",
        help="the highest priority its jobs may ask for unless an admin submits them: an integer or a class "
        "(best-effort, batch, default, high, critical); default 0 (default), so high and critical must be granted",
    )
    add_json_flag(qs)
    qs.set_defaults(func=cmd_quota_set)
    qd = q_sub.add_parser("delete", help="remove a queue (refused while it has pending or running jobs)")
    qd.add_argument("queue", metavar="QUEUE")
    add_json_flag(qd)
    qd.set_defaults(func=cmd_quota_delete)

    p = sub.add_parser("token", help="authentication tokens")
    tok_sub = p.add_subparsers(dest="token_command", metavar="SUBCOMMAND", parser_class=Parser)
    tok_sub.required = True
    tn = tok_sub.add_parser("new", help="print a new token and its tokens-file entry")
    tn.add_argument("--tenant", required=True, metavar="T", help="the tenant the token acts for")
    tn.add_argument(
        "--role",
        default="user",
        choices=["user", "admin", "node", "service"],
        help="user (its tenant's jobs), admin (every job, node drain), node (agents), service "
        "(cluster processes and ranks: the checkpoint coordinator); default user",
    )
    tn.add_argument(
        "--node",
        default=None,
        metavar="NAME",
        help="with --role node (required there): the one node the token may register, heartbeat and report as",
    )
    add_json_flag(tn)
    tn.set_defaults(func=cmd_token_new)
