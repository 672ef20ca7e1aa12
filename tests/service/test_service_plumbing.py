"""What every service promises: health, reflection, metrics, URL handling, and a complete `pip install .`."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers.procs import start_scheduler

from db.engine import normalize_url
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "url, expected",
    [
        ("postgresql://u@h:5432/db", "postgresql+psycopg://u@h:5432/db"),
        ("postgres://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
        ("sqlite:///x.db", "sqlite:///x.db"),
    ],
)
def test_both_postgres_url_forms_use_psycopg3(url, expected):
    assert normalize_url(url) == expected


async def test_scheduler_serves_health_and_reflection(sqlite_url):
    running = await serve(SchedulerSettings(db_url=sqlite_url, listen="127.0.0.1:0"))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "phalanx.v1.Scheduler", "phalanx.v1.NodeService"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = set()
            async for reply in replies:
                names |= {s.name for s in reply.list_services_response.service}
                break
            assert {"phalanx.v1.Scheduler", "phalanx.v1.NodeService", "grpc.health.v1.Health"} <= names
    finally:
        await running.stop()


@pytest.mark.slow
def test_metrics_are_off_by_default_and_served_with_metrics_port(sqlite_url, tmp_path):
    from helpers.ports import reserved_port

    port = reserved_port()
    proc = start_scheduler(sqlite_url, tmp_path / "s.log", "--metrics-port", str(port))
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for name in (
            "phalanx_queue_depth",
            "phalanx_gpus_free",
            "phalanx_gpus_allocated",
            "phalanx_reservation_latency_seconds",
            "phalanx_rpcs_total",
        ):
            assert name in body
    finally:
        proc.terminate()


@pytest.mark.slow
def test_pip_install_of_a_clean_checkout_ships_everything(tmp_path):
    """`pip wheel .` from a copy of the tracked files: generated protobuf code, migrations and profiles inside."""
    src = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        if name.startswith("phalanx/api/v1/") or not (ROOT / name).is_file():
            continue
        dest = src / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((ROOT / name).read_bytes())
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("phalanx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "phalanx/api/v1/scheduler_pb2.py",
        "phalanx/api/v1/agent_pb2_grpc.py",
        "migrations/env.py",
        "migrations/versions/0001_initial_ledger.py",
        "phalanx/profiles/dgx-h100.txt",
        "services/scheduler/main.py",
        "db/models.py",
    ):
        assert expected in names, expected
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for script in ("phalanx =", "phalanx-scheduler =", "phalanx-agent =", "phalanx-checkpointd ="):
        assert script in text


async def test_a_unary_handler_is_cut_at_the_servers_deadline(monkeypatch):
    """The server's own deadline: a handler that hangs gets DEADLINE_EXCEEDED with a message, whatever the client
    asked for."""
    import asyncio as _asyncio

    import grpc as _grpc

    from services.common import rpc

    monkeypatch.setattr(rpc, "SERVER_DEADLINE_S", 0.2)

    class Slow:
        @rpc.unary
        async def Hang(self, request, context):
            await _asyncio.sleep(5)

    class Context:
        async def abort(self, code, details):
            raise _grpc.aio.AbortError(code, details)

    try:
        await Slow().Hang(None, Context())
    except _grpc.aio.AbortError as exc:
        assert exc.args[0] == _grpc.StatusCode.DEADLINE_EXCEEDED and "0.2s limit" in exc.args[1]
    else:
        raise AssertionError("the hanging handler was not cut")
