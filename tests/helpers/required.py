"""The real parts the suite needs, and what a test does when one is missing.

A test (or fixture) that needs a real part calls `need(part, missing)`: `missing` is None when the part is here,
else the reason it is not. A missing part skips the test with that reason, unless the part is listed in
PHALANX_REQUIRE (comma-separated, as `.ci/run` sets it, or "all"), where it fails the test: in CI a skipped real part
is a failure, never a quiet green. PHALANX_REQUIRE_PG=1 (the older switch) means "pg" is required.

A whole module or test that needs a part says so with a mark, `pytestmark = needs("torch", torch_missing())` or
`@needs("data", ...)`: tests/conftest.py calls `need` for it at the start of each test's setup.

`need` is called whether the part is here or not, and records the part on the running test (its report's
`user_properties`, which pytest-xdist carries from the workers to the controller): the closing table
(tests/conftest.py, `summary_lines`) reports, per part, how many tests that needed it ran, skipped and failed.

Parts: see PARTS. "cgroup-v2" (a cgroup2 mount with controllers: real v2 semantics) is not in .ci/run's list, as
CI's hosts are hybrid (cgroup v1 controllers); the v2 code runs there against a model of the kernel's rules.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

PARTS = ("pg", "torch", "chromium", "cgroup", "cgroup-v2", "netns", "data", "oldest-nvml")
PROPERTY = "phalanx.need"  # user_properties entry: (PROPERTY, (part, missing or ""))

_current: pytest.Item | None = None


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
    """Go on when `missing` is None (the part is here); else skip with the reason, or fail when it is required.
    Either way the part is recorded on the running test, for the closing table."""
    assert part in PARTS, f"unknown real part {part!r}: add it to PARTS"
    if _current is not None:
        entry = (PROPERTY, (part, missing or ""))
        if entry not in _current.user_properties:
            _current.user_properties.append(entry)
    if missing is None:
        return
    if is_required(part):
        pytest.fail(f"required real part {part!r} is missing (PHALANX_REQUIRE): {missing}", pytrace=False)
    pytest.skip(f"{part}: {missing}")


def needs(part: str, missing: str | None) -> pytest.MarkDecorator:
    """A mark: the test (or every test of a module, as `pytestmark`) calls need(part, missing) before its setup."""
    assert part in PARTS, f"unknown real part {part!r}: add it to PARTS"
    return pytest.mark.needs(part, missing)


# ---- probes: why a part is missing (None when it is here) ---------------------------------------------------------


def torch_missing() -> str | None:
    """torch with torch.distributed.checkpoint (scripts/test installs the CPU build)."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (scripts/test installs the phalanx[torch] extra)"
    from phalanx.train import torch_dcp

    if not torch_dcp.available():
        return "torch is installed but torch.distributed.checkpoint is not importable"
    return None


def data_missing(path: Path, what: str = "the shared data") -> str | None:
    """The shared data folder (../shared/data, or $PHALANX_DATA) or a part of it."""
    if path.exists():
        return None
    return f"{what} not found at {path} (set PHALANX_DATA to the shared data folder)"


# ---- the runner's side: tests/conftest.py's hooks call these ------------------------------------------------------


def start_test(item: pytest.Item) -> None:
    """Before a test's setup: it is the running test, and its `needs` marks are checked (closest first)."""
    global _current
    _current = item
    for mark in reversed(list(item.iter_markers("needs"))):
        need(*mark.args)


def end_test() -> None:
    global _current
    _current = None


class PartTally:
    """Per part, the outcome of each test that needed it, from the test reports (in the controller under xdist)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, dict[str, tuple[str, str]]] = {p: {} for p in PARTS}

    def add(self, report: pytest.TestReport) -> None:
        parts = [value for key, value in report.user_properties if key == PROPERTY]
        if not parts:
            return
        for part, missing in parts:
            tests = self.outcomes.setdefault(part, {})
            previous = tests.get(report.nodeid, ("", ""))
            if report.failed:
                outcome = ("failed", missing or _reason(report))
            elif hasattr(report, "wasxfail"):  # an expected failure ran (pytest reports it as skipped)
                outcome = ("ran", "")
            elif report.skipped:
                outcome = ("skipped", _reason(report))
            elif report.when == "call":
                outcome = ("ran", "")
            else:
                continue
            if _RANK[outcome[0]] >= _RANK.get(previous[0], -1):
                tests[report.nodeid] = outcome

    def lines(self) -> list[str]:
        required = required_parts()
        out = []
        width = max(map(len, self.outcomes))
        for part, tests in self.outcomes.items():
            counts: dict[str, int] = {}
            first: dict[str, str] = {}
            for outcome, why in tests.values():
                counts[outcome] = counts.get(outcome, 0) + 1
                first.setdefault(outcome, why)
            cells = [f"ran {counts.get('ran', 0)}"]
            if counts.get("skipped"):
                cells.append(f"skipped {counts['skipped']} ({first['skipped']})")
            if counts.get("failed"):
                why = first["failed"]
                cells.append(f"FAILED {counts['failed']}" + (f" ({why})" if why else ""))
            if not tests:
                cells = ["no test selected needs it"]
            flag = "required" if part in required else "optional"
            out.append(f"{part:<{width}}  {flag:<8}  " + ", ".join(cells))
        return out


_RANK = {"ran": 0, "skipped": 1, "failed": 2}


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, "Skipped: reason")
        text = str(longrepr[2])
        return text.removeprefix("Skipped: ")
    text = str(getattr(report, "longreprtext", "") or longrepr or "")
    return text.strip().splitlines()[-1][:200] if text.strip() else ""
