"""Shared fixtures: a real database per test on SQLite and on PostgreSQL; the real parts' closing table.

PostgreSQL comes from PHALANX_TEST_PG (a URL), else 127.0.0.1:5432 (database `test`) when it answers. One
database is created per test session and dropped at the end; each test starts from empty tables. Without a
server the Postgres cases skip with a loud reason, unless PHALANX_REQUIRE_PG=1 or PHALANX_REQUIRE lists `pg` (as in
CI), where they fail (helpers/required.py: `need`).

Every test that needs a real part (PostgreSQL, torch, Chromium, cgroups, network namespaces, the shared data, the
oldest nvidia-ml-py) calls `need(part, missing)`, directly, through a fixture or through a `needs` mark; the run
ends with a table of those parts: how many of their tests ran, skipped (with the first reason) and failed.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import structlog
from helpers import required
from helpers.pg import create_database, drop_database, scratch_database
from helpers.required import need
from sqlalchemy import create_engine, text

from db.engine import normalize_url
from db.migrate import upgrade
from db.models import Base
from phalanx.cli.cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
GROUPS = ("unit", "service", "e2e", "security")
SHARED_DATA = Path(os.environ.get("PHALANX_DATA", ROOT.parent / "shared" / "data"))
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def pytest_configure(config):
    # structlog's default logger prints to whatever sys.stdout is when a logger is made: inside a test that uses
    # capsys, that is capsys's buffer, so an in-process scheduler's line (a slow cycle on a loaded machine) landed in
    # the middle of a CLI's --json output the test parses. Services log to standard error in production
    # (phalanx.common.logging); here they log to the process's own standard error, which pytest captures per test
    # at the file-descriptor level (shown with a failure) and which capsys never sees. The service_logs fixture
    # still routes them to a buffer for the tests that read them.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.__stderr__))


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its group (its folder under tests/); every e2e test is also `slow`."""
    for item in items:
        group = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        if group not in GROUPS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/{{{','.join(GROUPS)}}}")
        item.add_marker(getattr(pytest.mark, group))
        if group == "e2e":
            item.add_marker(pytest.mark.slow)


_TALLY = required.PartTally()  # this process's: the controller's under xdist


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The running test is the one `need` records its parts on; its `needs` marks are checked first."""
    required.start_test(item)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    required.end_test()


def pytest_runtest_logreport(report):
    """In the controller (or the one process without xdist): each report carries the parts its test needed."""
    _TALLY.add(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The closing table: each real part, required or optional here, and what its tests did."""
    if hasattr(config, "workerinput") or config.option.collectonly:  # a worker: the controller prints it
        return
    terminalreporter.section("real parts (helpers/required.py; PHALANX_REQUIRE makes a missing part fail)")
    for line in _TALLY.lines():
        terminalreporter.write_line(line)


def _pg_admin_url() -> str:
    return normalize_url(os.environ.get("PHALANX_TEST_PG", DEFAULT_PG))


def _pg_reachable(url: str) -> str | None:
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
        return None
    except Exception as exc:  # any failure means "no server"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


@pytest.fixture(scope="session")
def _pg_problem() -> str | None:
    """Why PostgreSQL cannot be used (None: it can); asked once per session."""
    admin = _pg_admin_url()
    problem = _pg_reachable(admin)
    return f"PostgreSQL not reachable at {admin} ({problem}); set PHALANX_TEST_PG" if problem else None


@pytest.fixture(scope="session")
def _pg_session_db(_pg_problem):
    """A throwaway PostgreSQL database for this test session, migrated to head (None without a server)."""
    if _pg_problem:
        yield None
        return
    admin = _pg_admin_url()
    url = create_database(admin, f"phalanx_test_{os.getpid()}")
    upgrade(url)
    yield url
    drop_database(url, admin)


@pytest.fixture
def pg_session_url(_pg_problem, _pg_session_db) -> str:
    """The session's PostgreSQL database (not emptied); each test that asks for it needs `pg`."""
    need("pg", _pg_problem)
    assert _pg_session_db is not None
    return _pg_session_db


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


def _truncate_pg(url: str) -> None:
    engine = create_engine(url)
    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables if t.name != "ledger_clock")
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
        conn.execute(text("UPDATE ledger_clock SET generation = 0, leader = '', leader_epoch = 0, leader_until = 0"))
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path, sqlite_template) -> str:
    """A migrated, empty database: each test runs once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        path = tmp_path / "phalanx.db"
        shutil.copy(sqlite_template, path)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("pg_session_url")
    _truncate_pg(url)
    return url


@pytest.fixture
def sqlite_url(tmp_path, sqlite_template) -> str:
    path = tmp_path / "phalanx.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def pg_url(pg_session_url) -> str:
    _truncate_pg(pg_session_url)
    return pg_session_url


@pytest.fixture
def shared_data() -> Path:
    need("data", None if SHARED_DATA.is_dir() else f"shared data not found at {SHARED_DATA} (set PHALANX_DATA)")
    return SHARED_DATA


@pytest.fixture
def trace_data() -> Path:
    """The trace data folder as `phalanx sim` finds it (--data, $PHALANX_DATA, ../shared/data); skips without it."""
    from phalanx.sim.traces import DataNotFound, find_data

    try:
        found = find_data()
    except DataNotFound as exc:
        need("data", f"trace data folder not found: {exc}")
    need("data", None)
    return found


class ServiceLogs:
    """The log lines of the services a test runs in its own process, kept apart from what the test captures."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:  # the services' threads write too
        with self._lock:
            self._lines.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        with self._lock:
            return "".join(self._lines)


@pytest.fixture
def service_logs(capsys):
    """The in-process services (scheduler, coordinator, agents) log with structlog, to the process's standard error
    (pytest_configure): here their lines go to a buffer of their own (the fixture's value), for the tests that read
    what the services logged. The buffer is printed to stderr at teardown: a failure report shows it."""
    old = structlog.get_config()
    logs = ServiceLogs()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=logs))
    yield logs
    structlog.configure(**old)
    sys.stderr.write(logs.text)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db_url(request, tmp_path):
    """An empty database (no tables), on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'old.db'}"
        return
    with scratch_database(request.getfixturevalue("pg_session_url"), "phalanx_mig") as url:
        yield url


# The end-to-end tests on LocalCluster (real processes) share this factory.
@pytest.fixture
def cluster_factory(tmp_path, monkeypatch):
    """`make(nodes, **LocalCluster options)`: a local cluster of real processes under tmp_path, started, and stopped
    at the test's end; no 8-GPU node has a GPU in MIG mode unless `mig_gpus` is given (gangs here need whole nodes)."""
    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    monkeypatch.delenv("PHALANX_DB", raising=False)
    started: list[LocalCluster] = []
    messages: list[str] = []

    def make(nodes: int, **kw) -> LocalCluster:
        kw.setdefault("mig_gpus", 0)
        cluster = LocalCluster(
            nodes=nodes,
            state_dir=tmp_path / "cluster",
            port=0,
            log=messages.append,
            ready_timeout=60,
            restart_agents=False,
            **kw,
        )
        started.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in started:
        cluster.stop()
