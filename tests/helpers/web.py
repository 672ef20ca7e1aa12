"""The dashboard (`phalanx web`) against real servers, for tests/e2e/test_web_dashboard.py and
tests/security/test_dashboard.py: a scheduler with authentication on (a tokens file), a checkpoint coordinator
with the same tokens, protocol-level agents with node tokens, and the WebServer; visitors as urllib openers with
their own cookie jars, or Playwright driving Debian's Chromium (`browser()`, which calls need("chromium", ...))."""

from __future__ import annotations

import asyncio
import contextlib
import http.cookiejar
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from helpers.required import need
from helpers.tokens import write_tokens

from phalanx.client import AsyncClient
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.checkpoint_coordinator.main import serve as serve_coordinator
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

ADMIN = "tok-admin-0123456789abcdef"  # long enough that finding it in a response is no accident
ALICE = "tok-alice-0123456789abcdef"
BOB = "tok-bob-0123456789abcdef"
NODE_TOKEN = "tok-node-{}"


def chromium_path() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)


@contextlib.asynccontextmanager
async def browser():
    """A Playwright Chromium (Debian's binary), or the test skips (fails where PHALANX_REQUIRE lists chromium)."""
    path = chromium_path()
    need("chromium", None if path else "no Chromium (apt-get install chromium)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        need("chromium", "playwright is not installed (pip install playwright)")
        raise
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            await b.close()


class Visitor:
    """A browser-less visitor: its own cookie jar; every call runs in a thread (the scheduler shares the loop)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def _call(self, path: str, data: bytes | None, headers: dict[str, str], method: str | None) -> Response:
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with self.opener.open(req, timeout=10) as r:
                return Response(r.status, dict(r.headers.items()), r.read(), r.url)
        except urllib.error.HTTPError as e:
            return Response(e.code, dict(e.headers.items()), e.read(), e.url)

    async def get(self, path: str, headers: dict[str, str] | None = None) -> Response:
        return await asyncio.to_thread(self._call, path, None, headers or {}, "GET")

    async def post(
        self, path: str, data: bytes = b"", headers: dict[str, str] | None = None, origin: str | None = "self"
    ) -> Response:
        h = dict(headers or {})
        if origin == "self":
            h["Origin"] = self.url
        elif origin is not None:
            h["Origin"] = origin
        return await asyncio.to_thread(self._call, path, data, h, "POST")

    async def sign_in(self, token: str) -> Response:
        from urllib.parse import urlencode

        r = await self.post("/login", urlencode({"token": token}).encode())
        return r

    def cookie(self) -> str:
        return next((c.value for c in self.jar), "")


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, url: str) -> None:
        self.status, self.headers, self.body, self.url = status, headers, body, url

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class DashCluster:
    """Scheduler (tokens: admin, alice, bob, one node token per node), coordinator, agents and the dashboard."""

    def __init__(self, db_url: str, tmp_path: Path, nodes: int = 2, **web: Any) -> None:
        self.db_url, self.tmp_path, self.web_kw = db_url, tmp_path, web
        self.names = [f"node-{i}" for i in range(nodes)]
        self.tokens_path = tmp_path / "tokens.yaml"
        self.write_tokens()

    def write_tokens(self, without: tuple[str, ...] = (), extra: tuple[tuple[str, str, str, str], ...] = ()) -> None:
        entries = [*extra, (ADMIN, "ops", "admin", ""), (ALICE, "alice", "user", ""), (BOB, "bob", "user", "")]
        entries += [(NODE_TOKEN.format(n), "nodes", "node", n) for n in self.names]
        tmp = self.tokens_path.with_suffix(".tmp")
        write_tokens(tmp, [e for e in entries if e[0] not in without])
        tmp.replace(self.tokens_path)

    async def __aenter__(self) -> DashCluster:
        from phalanx.common.tokens import TokenStore
        from phalanx.web.server import WebServer

        self.store = TokenStore(self.tokens_path, check_interval=0.1)
        settings = SchedulerSettings(db_url=self.db_url, listen="127.0.0.1:0", fabric=default_fabric(self.names))
        self.scheduler = await serve(settings, tokens=self.store)
        self.coordinator = await serve_coordinator(self.db_url, "127.0.0.1:0", tokens=self.store, sweep_interval=0)
        self.agents = [LiteAgent(self.scheduler.address, n, token=NODE_TOKEN.format(n)) for n in self.names]
        for agent in self.agents:
            await agent.start()
        self.web = WebServer(
            self.scheduler.address, poll_s=0.3, checkpoint=self.coordinator.address, **self.web_kw
        ).start()
        self.clients = {t: AsyncClient(self.scheduler.address, token=t, retries=0) for t in (ADMIN, ALICE, BOB)}
        self.channels: list[Any] = []  # a test's own gRPC channels (the ServiceService's), closed with the cluster
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.web.stop()
        for c in self.clients.values():
            await c.close()
        for channel in self.channels:
            await channel.close()
        for agent in self.agents:
            await agent.stop()
        await self.coordinator.stop(0)
        await self.scheduler.stop()

    def visitor(self) -> Visitor:
        return Visitor(self.web.url)
