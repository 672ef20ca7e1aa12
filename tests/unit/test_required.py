"""The real parts' contract (tests/helpers/required.py, tests/conftest.py), run on a throwaway copy of the suite's
conftest in a pytest subprocess: a missing part skips, or fails the run (exit code 1) where PHALANX_REQUIRE (or
the older PHALANX_REQUIRE_PG=1) lists it; the closing table counts, per part, the tests that ran, skipped and
failed, also across pytest-xdist workers, and counts a test whose part was here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import required

TESTS = Path(__file__).resolve().parents[1]

TINY = """
import pytest
from helpers.required import need, needs


def test_needs_torch_missing():
    need("torch", "torch is hidden for this test")


@needs("pg", "no server in this test")
def test_needs_pg_missing():
    pass


@pytest.mark.parametrize("i", range(4))
def test_needs_data_present(i):
    need("data", None)


@needs("data", None)
def test_needs_data_by_mark():
    pass


@pytest.mark.xfail(strict=True, reason="a known gap")
def test_needs_data_known_gap():
    need("data", None)
    assert False, "the gap"


def test_needs_nothing():
    pass
"""


def _suite(tmp_path: Path) -> Path:
    """tmp/tests: a copy of the suite's conftest (it finds its groups beside it), its helpers, and TINY."""
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", tests / "conftest.py")
    shutil.copytree(TESTS / "helpers", tests / "helpers", ignore=shutil.ignore_patterns("__pycache__"))
    (tests / "unit" / "test_tiny.py").write_text(TINY)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    needs: a real part\n    unit: unit\n")
    return tests


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[int, dict[str, str], str]:
    tests = _suite(tmp_path)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_REQUIRE", "PYTEST_"))}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), *args],
        cwd=tmp_path,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout + result.stderr
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in required.PARTS and len(words) > 2 and words[1] in ("required", "optional"):
            rows[words[0]] = line
    return result.returncode, rows, out


def test_a_missing_part_skips_and_the_table_says_why(tmp_path):
    code, rows, out = _run(tmp_path, "-p", "no:xdist")
    assert code == 0, out
    assert "optional  ran 0, skipped 1 (torch: torch is hidden for this test)" in rows["torch"], out
    assert "ran 0, skipped 1 (pg: no server in this test)" in rows["pg"], out
    # present: counted as ran, the mark's test too, and the expected failure (it ran; pytest calls it skipped)
    assert rows["data"].endswith("optional  ran 6"), out
    assert "no test selected needs it" in rows["chromium"], out


def test_a_required_missing_part_fails_the_run(tmp_path):
    code, rows, out = _run(tmp_path, "-p", "no:xdist", PHALANX_REQUIRE="torch,data")
    assert code == 1, out
    assert "required  ran 0, FAILED 1 (torch is hidden for this test)" in rows["torch"], out
    assert "required real part 'torch' is missing (PHALANX_REQUIRE)" in out
    assert "optional  ran 0, skipped 1" in rows["pg"], out  # not listed: still a skip
    assert rows["data"].endswith("required  ran 6"), out
    assert "1 failed" in out and "1 skipped" in out


def test_the_older_pg_switch_still_requires_pg(tmp_path):
    code, rows, out = _run(tmp_path, "-p", "no:xdist", "-k", "pg", PHALANX_REQUIRE_PG="1")
    assert code == 1, out
    assert "required  ran 0, FAILED 1 (no server in this test)" in rows["pg"], out


@pytest.mark.slow
def test_the_table_adds_up_the_workers_of_xdist(tmp_path):
    code, rows, out = _run(tmp_path, "-n", "2", PHALANX_REQUIRE="all")
    assert code == 1, out
    assert "required  ran 0, FAILED 1" in rows["torch"] and "required  ran 0, FAILED 1" in rows["pg"], out
    assert rows["data"].endswith("required  ran 6"), out
    assert all("required" in row for row in rows.values()), out
