"""The ``phalanx`` command line: submit, list, inspect, cancel, checkpoint and watch jobs; serving fleets (services);
GPU-time accounting (goodput); list, drain and undrain nodes; make tokens; migrate the database.

This is a stable contract that scripts depend on:

* standard output carries only the command's result (with ``--json``: exactly one JSON document, or one JSON
  object per line for ``watch --json``); logs and errors go to standard error;
* exit codes: 0 success, 1 an RPC or runtime error (stderr ``error: <CODE_NAME>: <message>``), 2 a usage error
  (bad flags, reserved flags that are not supported yet), 130 interrupted.

This module holds the global flags, the dispatch and the error handling. Each group of verbs is a module of its own
with a ``register(sub)`` that adds its subcommands: ``jobs`` (submit, jobs, job, cancel, checkpoint), ``services``
(service, services, apply), ``observe``
(goodput, nodes, watch, web, logs), ``admin`` (node, queue, quota, token), ``database`` (db), ``cluster`` and
``demo`` (a local cluster), ``place`` and ``sim`` (offline tools). They share ``common`` (exit codes, the parser
class), ``argtypes`` (flag value types) and ``console`` (output and the scheduler client).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from phalanx import __version__
from phalanx.client import DEFAULT_TARGET, DEFAULT_TIMEOUT, PhalanxError, RPCError

from . import admin, console, database, jobs, observe, pools, services
from .admin import (
    cmd_node_drain,
    cmd_node_undrain,
    cmd_queue,
    cmd_quota_delete,
    cmd_quota_set,
    cmd_token_new,
    parse_quota,
)
from .argtypes import parse_cpus, parse_duration, parse_keep_checkpoints, parse_memory
from .common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, Parser, UsageError
from .database import cmd_db_prune, cmd_db_upgrade
from .jobs import (
    GPU_SUBMIT_FLAGS,
    RESERVED_SUBMIT_FLAGS,
    TIER_SUBMIT_FLAGS,
    cmd_cancel,
    cmd_checkpoint,
    cmd_job,
    cmd_jobs,
    cmd_submit,
)
from .observe import cmd_goodput, cmd_logs, cmd_nodes, cmd_watch, cmd_web

# The command handlers live in one module per group of verbs (jobs, observe, admin, database, and cluster, demo,
# place, sim); their names stay importable from here.
__all__ = [
    "main",
    "build_parser",
    "UsageError",
    "RESERVED_SUBMIT_FLAGS",
    "TIER_SUBMIT_FLAGS",
    "GPU_SUBMIT_FLAGS",
    "cmd_cancel",
    "cmd_checkpoint",
    "cmd_db_prune",
    "cmd_db_upgrade",
    "cmd_goodput",
    "cmd_job",
    "cmd_jobs",
    "cmd_logs",
    "cmd_node_drain",
    "cmd_node_undrain",
    "cmd_nodes",
    "cmd_queue",
    "cmd_quota_delete",
    "cmd_quota_set",
    "cmd_submit",
    "cmd_token_new",
    "cmd_watch",
    "cmd_web",
    "parse_cpus",
    "parse_duration",
    "parse_keep_checkpoints",
    "parse_memory",
    "parse_quota",
]


def build_parser() -> argparse.ArgumentParser:
    """Build the ``phalanx`` argument parser (subcommands set ``func``, which returns an exit code)."""
    # allow_abbrev=False: argparse matches abbreviations over the whole command line, so a verb's own flag that is a
    # prefix of these global ones (`phalanx cluster up --tls`) was refused as "ambiguous" before the verb saw it.
    parser = Parser(
        prog="phalanx",
        description="Phalanx GPU-cluster control plane: jobs, services, nodes, database.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    parser.add_argument(
        "--scheduler",
        metavar="ADDR",
        default=None,
        help=f"scheduler host:port (default: $PHALANX_SCHEDULER, else {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"deadline of each call, retries included (default: {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--token", default=None, metavar="TOKEN", help="bearer token sent with every call (default: $PHALANX_TOKEN)"
    )
    parser.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="reach the scheduler over TLS, trusting this CA (default: $PHALANX_TLS_CA)",
    )
    parser.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="client certificate for mutual TLS (default: $PHALANX_TLS_CERT)"
    )
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="its private key (default: $PHALANX_TLS_KEY)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on standard error")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    # The order of the verbs in `phalanx --help` is the order they are added in.
    jobs.register(sub)  # submit, jobs, job, cancel, checkpoint
    services.register(sub)  # service (create, get, endpoints, update, ...), services, apply
    observe.register(sub)  # goodput, nodes, watch, web, logs
    admin.register(sub)  # node, queue, quota, token
    pools.register(sub)  # pool create, list, delete
    database.register(sub)  # db
    try:  # POSIX only (fcntl, process groups)
        from . import cluster, demo
    except ImportError:
        pass
    else:
        cluster.register(sub)
        demo.register(sub)
    from . import fabric_export, place, sim

    place.register(sub)
    fabric_export.register(sub)
    sim.register(sub)
    return parser


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Split ``... submit ... -- CMD ARGS`` at the first ``--``, so that CMD may contain anything."""
    if "--" not in argv:
        return argv, None
    idx = argv.index("--")
    if "submit" not in argv[:idx]:
        return argv, None
    return argv[:idx], argv[idx + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: Arguments without the program name; defaults to ``sys.argv[1:]``.

    Returns:
        The exit code: 0 success, 1 error, 2 usage error, 130 interrupted.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    args_list, command = _split_command(args_list)
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if command is not None:
        if getattr(args, "command", None):
            console.error("give the command after -- only")
            return EXIT_USAGE
        args.command = command
    if getattr(args, "func", None) in (cmd_db_upgrade, cmd_db_prune) and args.db is None:
        args.db = database.default_db_url()
    if args.verbose:
        from phalanx.common.logging import configure_logging

        configure_logging("phalanx-cli", "DEBUG").debug("cli", argv=args_list, scheduler=args.scheduler)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except UsageError as exc:
        console.error(str(exc))
        return EXIT_USAGE
    except RPCError as exc:
        console.error(f"{exc.code_name}: {exc.message}")
        return EXIT_ERROR
    except PhalanxError as exc:
        console.error(str(exc))
        return EXIT_ERROR
    except KeyboardInterrupt:
        console.error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `phalanx jobs | head`); nothing more to say.
        try:
            sys.stdout = open(os.devnull, "w")  # silence the flush at exit
        except OSError:
            pass
        return EXIT_ERROR
    except Exception as exc:  # e.g. a database error in `db upgrade`: one line, no traceback
        if args.verbose:
            raise
        console.error(f"{type(exc).__name__}: {exc}")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
