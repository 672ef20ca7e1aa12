"""Tokens files for tests, written with the same entries `phalanx token new` prints (phalanx.common.tokens)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from phalanx.common.tokens import entry_line, token_entry


def write_tokens(path: Path, entries: Iterable[tuple[str, str, str, str]]) -> Path:
    """(token, tenant, role, node or "") each."""
    path.write_text("".join(entry_line(token_entry(t, tenant, role, node)) + "\n" for t, tenant, role, node in entries))
    return path
