"""``python -m db upgrade --db URL``: the ledger's own tool, behind ``phalanx db upgrade``.

The CLI runs it as a process, so that the command line never imports the ledger's code (the layers are checked by
``lint-imports``; see pyproject.toml). On success it prints one JSON line, ``{"db": URL with any password hidden,
"revision": R, "cluster_id": the ledger's identity}``; on failure one ``error: ...`` line on standard error, and
exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m db", description="Phalanx ledger administration.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upgrade", help="apply the migrations (creates a SQLite file if needed)")
    up.add_argument("--db", required=True, metavar="URL", help="database URL")
    args = parser.parse_args(argv)

    from sqlalchemy.engine import make_url

    from .migrate import cluster_id, current, upgrade

    try:
        upgrade(args.db)
        revision = current(args.db)
        identity = cluster_id(args.db)
        shown = make_url(args.db).render_as_string(hide_password=True)
    except Exception as exc:  # any failure (a bad URL, a refused connection): one line, no traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        sys.stderr.write(f"error: {type(exc).__name__}: {first}\n")
        return 1
    print(json.dumps({"db": shown, "revision": revision, "cluster_id": identity}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
