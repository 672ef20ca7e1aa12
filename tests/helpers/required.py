"""The real parts the suite needs, and what a test does when one is missing.

A test (or fixture) that needs a real part calls `need(part, missing)`: `missing` is None when the part is here,
else the reason it is not. A missing part skips the test with that reason, unless the part is listed in
PHALANX_REQUIRE (comma-separated, as `.ci/run` sets it, or "all"), where it fails the test: in CI a skipped real part
is a failure, never a quiet green. PHALANX_REQUIRE_PG=1 (the older switch) means "pg" is required.

Parts: see PARTS. The closing table (tests/conftest.py) reports, per part, whether its tests ran.
"""

from __future__ import annotations

import os

import pytest

PARTS = ("pg", "torch", "chromium", "cgroup", "netns", "data", "oldest-nvml")


def required_parts() -> set[str]:
    raw = os.environ.get("PHALANX_REQUIRE", "")
    parts = {p.strip() for p in raw.split(",") if p.strip()}
    if "all" in parts:
        parts = set(PARTS)
    if os.environ.get("PHALANX_REQUIRE_PG") == "1":
        parts.add("pg")
    return parts


def is_required(part: str) -> bool:
    return part in required_parts()


def need(part: str, missing: str | None) -> None:
    """Go on when `missing` is None (the part is here); else skip with the reason, or fail when it is required."""
    assert part in PARTS, f"unknown real part {part!r}: add it to PARTS"
    if missing is None:
        return
    if is_required(part):
        pytest.fail(f"required real part {part!r} is missing (PHALANX_REQUIRE): {missing}", pytrace=False)
    pytest.skip(f"{part}: {missing}")
