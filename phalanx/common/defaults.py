"""Defaults that the services and the CLI must agree on."""

from __future__ import annotations

import os
from pathlib import Path

# The embedded ledger of a single-host install: SQLite under $PHALANX_HOME (default ./.phalanx).
DEFAULT_DB_URL = "sqlite:///" + str(Path(os.environ.get("PHALANX_HOME", ".phalanx")) / "phalanx.db")
