"""``phalanx pool create|list|delete``: the operator's spare pools (issue 34). A pool keeps whole nodes idle in each
domain of a tier for any gang there that loses a node; `list` shows per domain the nodes booked, lent to backfill
jobs with time limits, and missing."""

from __future__ import annotations

import argparse

from . import console, render
from .common import EXIT_OK, Parser, add_json_flag


def pools_table(pools) -> str:
    """One line per domain of each pool: booked, lent (node: borrowers) and missing nodes."""
    if not pools:
        return "no spare pools"
    lines = [f"{'POOL':<16} {'TIER':<8} {'DOMAIN':<14} {'BOOKED':<24} {'LENT':<28} MISSING"]
    for pool in pools:
        for d in pool.domains or ():
            lent = ", ".join(f"{n}: {' '.join(j)}" for n, j in sorted((d.lent or {}).items())) or "-"
            booked = ", ".join(d.booked) or "-"
            lines.append(f"{pool.name:<16} {pool.tier:<8} {d.domain:<14} {booked:<24} {lent:<28} {d.missing}")
        if not pool.domains:
            lines.append(f"{pool.name:<16} {pool.tier:<8} {'-':<14} {'-':<24} {'-':<28} -")
    return "\n".join(lines)


def cmd_pool_create(args: argparse.Namespace) -> int:
    """``phalanx pool create NAME --tier T --per-domain K``: (admin) keep K whole nodes per domain of tier T."""
    with console.client(args) as client:
        pool = client.create_pool(args.name, tier=args.tier, per_domain=args.per_domain)
    console.emit(render.to_json(pool.to_dict()) if args.json else pools_table([pool]))
    return EXIT_OK


def cmd_pool_list(args: argparse.Namespace) -> int:
    with console.client(args) as client:
        pools = client.pools(args.name)
    console.emit(render.to_json([p.to_dict() for p in pools]) if args.json else pools_table(pools))
    return EXIT_OK


def cmd_pool_delete(args: argparse.Namespace) -> int:
    with console.client(args) as client:
        client.delete_pool(args.name)
    console.emit(render.to_json({"deleted": args.name}) if args.json else f"pool {args.name} deleted")
    return EXIT_OK


def register(sub) -> None:
    """Add ``pool`` to the ``phalanx`` subcommands `sub`."""
    p = sub.add_parser("pool", help="spare pools (admin): whole nodes kept idle per domain for any gang")
    p_sub = p.add_subparsers(dest="pool_command", metavar="SUBCOMMAND", parser_class=Parser)
    p_sub.required = True
    pc = p_sub.add_parser("create", help="keep K whole nodes idle in each domain of a tier for any gang there")
    pc.add_argument("name", metavar="NAME")
    pc.add_argument("--tier", required=True, metavar="T", help="the tier of the domains (nvlink, leaf, ...)")
    pc.add_argument("--per-domain", type=int, required=True, metavar="K", help="whole nodes kept per domain")
    add_json_flag(pc)
    pc.set_defaults(func=cmd_pool_create)
    pl = p_sub.add_parser("list", help="the pools, per domain: booked, lent and missing nodes")
    pl.add_argument("name", nargs="?", default="", metavar="NAME")
    add_json_flag(pl)
    pl.set_defaults(func=cmd_pool_list)
    pd = p_sub.add_parser("delete", help="delete a pool (its nodes go back to normal work)")
    pd.add_argument("name", metavar="NAME")
    add_json_flag(pd)
    pd.set_defaults(func=cmd_pool_delete)
