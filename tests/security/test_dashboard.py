"""The dashboard's security (issue 31, items 1, 2 and 6), against a real scheduler with authentication on, a real
checkpoint coordinator, protocol-level agents and the real `phalanx web` server; the browser tests drive Debian's
Chromium with Playwright.

Threats, each with its tests:

- An anonymous network visitor (no token, or a guessed/forged cookie) controls the requests it sends: paths,
  cookies, headers, forms. It must reach no cluster data (nodes, jobs, logs, checkpoints) and no session, and must
  not be able to make a signed-in visitor's browser act (CSRF on sign-out, a forged sign-in from another origin) or
  frame the page. A dashboard bound beyond loopback must not hand it tokens or cookies in clear.
  -> test_an_anonymous_visitor_reaches_no_data, test_a_forged_cookie_is_refused,
     test_state_changing_requests_need_the_csrf_token, test_a_sign_in_from_another_origin_is_refused,
     test_every_response_carries_the_security_headers, test_beyond_loopback_it_needs_tls_or_insecure,
     test_over_tls_the_cookie_is_secure (and HSTS)
- A tenant (a user token) controls its own jobs and services: names, commands, queues, and what its ranks print. It
  must see only what its token allows: not another tenant's job names, messages, logs, checkpoints or services
  (nor their replicas' jobs), through any endpoint;
  its session must end when it expires or its token is revoked; and its markup must never run in another
  visitor's (an admin's) browser.
  -> test_a_tenant_sees_only_its_own_jobs_through_every_endpoint, test_an_expired_session_is_refused,
     test_a_revoked_token_ends_its_sessions, test_hostile_markup_in_every_field_shows_as_text
- A malicious node agent controls what it reports: its node name, GPU model, the messages of the ranks it fails,
  and rank log lines. Node names the scheduler refuses never reach the page; the rest shows as text.
  -> test_a_hostile_node_name_is_refused_at_registration, test_hostile_markup_in_every_field_shows_as_text
- The dashboard itself must not lend its own credential: it holds none, never falls back to $PHALANX_TOKEN for a
  visitor, and no response carries a token other than the visitor's session cookie.
  -> test_the_servers_environment_token_is_never_used_or_shown
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest
from helpers.clock import FakeClock
from helpers.waits import eventually
from helpers.web import ADMIN, ALICE, BOB, DashCluster, Visitor, browser

from phalanx.api.v1 import common_pb2, service_pb2, service_pb2_grpc
from phalanx.client import open_aio_channel
from phalanx.testing.lite_agent import LiteAgent

ENDPOINTS = ("/api/state", "/api/session", "/api/events", "/api/job/0123456789ab", "/")


async def test_an_anonymous_visitor_reaches_no_data(sqlite_url, tmp_path):
    async with DashCluster(sqlite_url, tmp_path) as c:
        await c.clients[ALICE].submit("secret-name", 1, 1, ["sleep", "60"])
        anon = c.visitor()
        for path in (
            "/api/state",
            "/api/session",
            "/api/events",
            "/api/job/0123456789ab",
            "/api/job/0123456789ab/checkpoints",
            "/api/job/0123456789ab/logs",
            "/api/nope",
        ):
            r = await anon.get(path)
            assert r.status == 401, (path, r.status)
            assert "sign in" in r.json()["error"] and "secret-name" not in r.text and "node-0" not in r.text
        page = await anon.get("/")
        assert page.url.endswith("/login") and b"Sign in" in page.body  # redirected to the sign-in form
        assert (await anon.get("/index.html")).url.endswith("/login")
        assert (await anon.get("/app.js")).status == 200  # the code is public; the data is not
        assert (await anon.post("/logout", origin="self")).status == 401
        # Signing in needs a token the scheduler accepts: none, a wrong one, a node's.
        for token in ("", "tok-guess", "tok-node-node-0"):
            r = await anon.sign_in(token)
            assert r.status == 401 and "refused this token" in r.text and not anon.cookie(), (token, r.status)


async def test_a_forged_cookie_is_refused(sqlite_url, tmp_path):
    async with DashCluster(sqlite_url, tmp_path) as c:
        alice = c.visitor()
        assert (await alice.sign_in(ALICE)).status == 200 and alice.cookie()
        real = alice.cookie()
        for forged in ("x", real[:-1] + ("A" if real[-1] != "A" else "B"), "", real + "x", "../" + real):
            r = await c.visitor().get("/api/state", {"Cookie": f"phalanx-session={forged}"})
            assert r.status == 401, forged
            assert (await c.visitor().get("/", {"Cookie": f"phalanx-session={forged}"})).url.endswith("/login")
        assert (await c.visitor().get("/api/state", {"Cookie": f"phalanx-session={real}"})).status == 200


async def test_an_expired_session_is_refused(sqlite_url, tmp_path):
    # The sessions' own clock, moved by the test: a loaded host's slow sign-in cannot expire the session first.
    clock = FakeClock()
    async with DashCluster(sqlite_url, tmp_path, session_ttl_s=60.0, clock=clock.time) as c:
        alice = c.visitor()
        await alice.sign_in(ALICE)
        assert (await alice.get("/api/state")).status == 200
        cookie = {"Cookie": f"phalanx-session={alice.cookie()}"}  # sent after the browser would have dropped it
        clock.advance(59.0)
        assert (await c.visitor().get("/api/state", cookie)).status == 200  # not yet
        clock.advance(1.5)
        r = await c.visitor().get("/api/state", cookie)
        assert r.status == 401 and "sign in" in r.json()["error"]
        assert (await c.visitor().get("/api/job/0123456789ab", cookie)).status == 401
        assert not c.web.sessions.by_id and not c.web.sessions.models  # its model stopped with it


async def test_a_revoked_token_ends_its_sessions(sqlite_url, tmp_path):
    async with DashCluster(sqlite_url, tmp_path) as c:
        alice, bob = c.visitor(), c.visitor()
        await alice.sign_in(ALICE)
        await bob.sign_in(BOB)
        assert (await alice.get("/api/state")).status == 200
        c.write_tokens(without=(ALICE,))  # the operator removes alice's token

        async def refused():
            return (await alice.get("/api/state")).status == 401

        await eventually(refused, timeout=10, what="alice's session ends")
        assert (await alice.get("/api/job/0123456789ab")).status == 401
        assert (await bob.get("/api/state")).status == 200  # bob's token still stands
        assert (await alice.sign_in(ALICE)).status == 401


async def test_a_tenant_sees_only_its_own_jobs_through_every_endpoint(sqlite_url, tmp_path):
    async with DashCluster(sqlite_url, tmp_path, nodes=1) as c:
        mine = await c.clients[ALICE].submit("alice-job", 1, 8, ["sleep", "60"])
        # bob's: one running elsewhere is impossible on one node, so one pending behind alice's (in the queue view)
        theirs = await c.clients[BOB].submit("bob-secret-job", 1, 8, ["echo", "bob-secret-command"])
        alice, bob, admin = c.visitor(), c.visitor(), c.visitor()
        for v, t in ((alice, ALICE), (bob, BOB), (admin, ADMIN)):
            assert (await v.sign_in(t)).status == 200

        async def sees_both():
            doc = (await admin.get("/api/state")).json()
            return {j["id"] for j in doc["jobs"]} >= {mine.id, theirs.id} and doc

        doc = await eventually(sees_both, timeout=10, what="the admin sees both jobs")
        assert any(p["name"] == "bob-secret-job" for q in doc["queues"] for p in q.get("pending", []))

        async def alice_sees_hers():
            doc = (await alice.get("/api/state")).json()
            return mine.id in {j["id"] for j in doc["jobs"]} and doc

        doc = await eventually(alice_sees_hers, timeout=10, what="alice sees her job")
        text = json.dumps(doc)
        assert theirs.id not in text and "bob-secret" not in text
        r = await alice.get(f"/api/job/{theirs.id}")
        assert r.status == 404 and "bob-secret" not in r.text
        # the event stream's first state, read raw
        events = await asyncio.to_thread(_first_event, c.web.url, alice.cookie())
        assert mine.id in events and theirs.id not in events and "bob-secret" not in events
        # and bob sees his, not hers, including his own job page with its command
        r = await bob.get(f"/api/job/{theirs.id}")
        assert r.status == 200 and r.json()["spec"]["command"] == ["echo", "bob-secret-command"]
        r = await bob.get(f"/api/job/{mine.id}")
        assert r.status == 404 and "alice-job" not in r.text
        # the job page's parts (checkpoints, log tail) ask for the job with the visitor's token first: the same 404
        for part in ("checkpoints", "logs"):
            r = await alice.get(f"/api/job/{theirs.id}/{part}")
            assert r.status == 404 and "bob-secret" not in r.text, (part, r.status, r.text)
            r = await bob.get(f"/api/job/{theirs.id}/{part}")
            assert r.status == 200 and part in r.json(), (part, r.text)
        for path in (f"/api/job/{mine.id}/nope", f"/api/job/{mine.id}/logs/x", "/api/job//logs"):
            assert (await alice.get(path)).status == 404, path

        # Services: bob's service (and its replica's job) reach bob and the admin, never alice.
        channel = open_aio_channel(c.scheduler.address, token=BOB)
        c.channels.append(channel)
        template = common_pb2.JobSpec(replicas=1, gpus_per_replica=1, command=["sleep", "600"])
        await service_pb2_grpc.ServiceServiceStub(channel).CreateService(
            service_pb2.CreateServiceRequest(
                spec=service_pb2.ServiceSpec(name="bob-secret-svc", replicas=1, template=template)
            )
        )

        async def sees_the_service(v: Visitor):
            doc = (await v.get("/api/state")).json()
            return [s for s in doc["services"] if s["name"] == "bob-secret-svc"] and doc

        for v in (bob, admin):
            doc = await eventually(lambda v=v: sees_the_service(v), timeout=10, what="bob's service in the state")
            [svc] = [s for s in doc["services"] if s["name"] == "bob-secret-svc"]
            assert svc["tenant"] == "bob" and len(svc["replicas"]) == 1
        replica_job = svc["replicas"][0]["job_id"]
        # two more of alice's polls (each adds a point of history): she has listed services since it was created
        polls = len((await alice.get("/api/state")).json()["history"])

        async def polled_twice():
            doc = (await alice.get("/api/state")).json()
            return len(doc["history"]) >= polls + 2 and doc

        doc = await eventually(polled_twice, timeout=10, what="alice's state, polled again")
        assert doc["services"] == [] and "bob-secret" not in json.dumps(doc) and replica_job not in json.dumps(doc)


def _first_event(url: str, sid: str) -> str:
    import urllib.request

    req = urllib.request.Request(url + "api/events", headers={"Cookie": f"phalanx-session={sid}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        lines = []
        while True:
            line = r.readline().decode()
            if line.startswith("data: "):
                return line
            lines.append(line)


async def test_state_changing_requests_need_the_csrf_token(sqlite_url, tmp_path):
    async with DashCluster(sqlite_url, tmp_path) as c:
        alice = c.visitor()
        await alice.sign_in(ALICE)
        csrf = (await alice.get("/api/session")).json()["csrf"]
        for headers in ({}, {"X-CSRF-Token": ""}, {"X-CSRF-Token": csrf[:-1]}, {"X-CSRF-Token": "x" * len(csrf)}):
            r = await alice.post("/logout", headers=headers)
            assert r.status == 403 and "X-CSRF-Token" in r.json()["error"], headers
            assert (await alice.get("/api/state")).status == 200  # still signed in
        other = c.visitor()
        await other.sign_in(ALICE)  # another session of the same token: its CSRF token is its own
        r = await alice.post("/logout", headers={"X-CSRF-Token": (await other.get("/api/session")).json()["csrf"]})
        assert r.status == 403
        r = await alice.post("/logout", headers={"X-CSRF-Token": csrf})
        assert r.status == 200 and r.json() == {"signed_out": True}
        assert (await alice.get("/api/state")).status == 401
        assert (await other.get("/api/state")).status == 200
        for method in ("PUT", "DELETE", "PATCH"):
            r = await asyncio.to_thread(alice._call, "/api/state", b"", {}, method)
            assert r.status == 405


async def test_a_sign_in_from_another_origin_is_refused(sqlite_url, tmp_path):
    """Login CSRF: a page elsewhere posting its own token into the dashboard would sign the visitor in as it."""
    async with DashCluster(sqlite_url, tmp_path) as c:
        v = c.visitor()
        from urllib.parse import urlencode

        form = urlencode({"token": ALICE}).encode()
        for origin in ("http://evil.example", "null", None):
            r = await v.post("/login", form, origin=origin)
            assert r.status == 403 and "Origin" in r.text and not v.cookie(), origin
        for site in ("cross-site", "same-site", "none"):  # what a browser says of a post from elsewhere
            r = await v.post("/login", form, headers={"Sec-Fetch-Site": site})
            assert r.status == 403 and not v.cookie(), site
        assert (await v.post("/login", b"token=" + b"a" * 9000)).status == 400


async def test_every_response_carries_the_security_headers(sqlite_url, tmp_path):
    async with DashCluster(sqlite_url, tmp_path) as c:
        v = c.visitor()
        seen = [await v.get(p) for p in ("/login", "/app.js", "/style.css", "/nope", "/api/state", "/a/b")]
        seen.append(await v.sign_in("wrong"))
        seen.append(await v.post("/login", b"", origin="http://evil.example"))
        await v.sign_in(ALICE)
        seen += [await v.get(p) for p in ("/", "/api/state", "/api/session", "/api/job/0123456789ab")]
        seen.append(await v.post("/logout"))
        for r in seen:
            csp = r.headers.get("Content-Security-Policy", "")
            assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, (r.url, r.status)
            assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
            assert r.headers.get("X-Content-Type-Options") == "nosniff"
            assert r.headers.get("Referrer-Policy") == "no-referrer"
            assert r.headers.get("Strict-Transport-Security") is None  # plain HTTP on loopback: not a promise to keep
        cookie = next(r for r in seen if r.url.endswith("/") and r.status == 200)
        assert cookie.status == 200
        # the session cookie as sent at sign-in
        raw = await asyncio.to_thread(_sign_in_raw, c.web.url, ALICE)
        assert "HttpOnly" in raw and "SameSite=Strict" in raw and "Max-Age=" in raw and "Secure" not in raw


def _sign_in_raw(url: str, token: str, context=None) -> str:
    """The Set-Cookie header of a sign-in, without following its redirect."""
    import http.client
    from urllib.parse import urlencode, urlparse

    u = urlparse(url)
    conn = (
        http.client.HTTPSConnection(u.hostname, u.port, context=context, timeout=10)
        if u.scheme == "https"
        else http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    )
    body = urlencode({"token": token})
    conn.request(
        "POST",
        "/login",
        body,
        {"Origin": url.rstrip("/"), "Content-Type": "application/x-www-form-urlencoded"},
    )
    r = conn.getresponse()
    assert r.status == 303, r.status
    out = r.getheader("Set-Cookie") or ""
    conn.close()
    return out


def test_beyond_loopback_it_needs_tls_or_insecure(tmp_path):
    from phalanx.web.server import InsecureBind, WebServer

    for host in ("0.0.0.0", "::"):
        with pytest.raises(InsecureBind, match="--tls-cert and --tls-key, or --insecure"):
            WebServer("127.0.0.1:1", host=host)
    with pytest.raises(InsecureBind, match="both"):
        WebServer("127.0.0.1:1", host="0.0.0.0", tls_cert="x.pem")
    WebServer("127.0.0.1:1", host="localhost").stop()
    WebServer("127.0.0.1:1", host="0.0.0.0", insecure=True).stop()
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli.main", "web", "--host", "0.0.0.0", "--port", "0", "--scheduler", "x:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "refusing to serve the dashboard on 0.0.0.0 over plain HTTP" in out.stderr, out


async def test_over_tls_the_cookie_is_secure(sqlite_url, tmp_path):
    import ssl

    pytest.importorskip("cryptography")
    from phalanx.cli.certs import generate_local_pki

    pki = generate_local_pki(tmp_path / "tls")
    async with DashCluster(
        sqlite_url, tmp_path, host="0.0.0.0", tls_cert=str(pki.server_cert), tls_key=str(pki.server_key)
    ) as c:
        url = c.web.url.replace("0.0.0.0", "localhost")
        assert url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        raw = await asyncio.to_thread(_sign_in_raw, url, ALICE, ctx)
        assert raw.startswith("__Host-phalanx-session=") and "Secure" in raw and "HttpOnly" in raw
        sid = raw.split(";")[0].split("=", 1)[1]

        def state() -> tuple[int, str | None]:
            import urllib.request

            req = urllib.request.Request(url + "api/state", headers={"Cookie": f"__Host-phalanx-session={sid}"})
            with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
                return r.status, r.headers.get("Strict-Transport-Security")

        assert await asyncio.to_thread(state) == (200, "max-age=31536000")  # and browsers keep to HTTPS


async def test_the_servers_environment_token_is_never_used_or_shown(sqlite_url, tmp_path, monkeypatch):
    """The process serving the dashboard has an admin token in its environment (an operator's shell): a visitor who
    signs in without a token gets nothing from it, and no response to a signed-in tenant carries it."""
    monkeypatch.setenv("PHALANX_TOKEN", ADMIN)
    async with DashCluster(sqlite_url, tmp_path) as c:
        job = await c.clients[ALICE].submit("alice-job", 1, 1, ["sleep", "60"])
        anon = c.visitor()
        assert (await anon.sign_in("")).status == 401  # not signed in as the environment's admin
        alice = c.visitor()
        seen = [await alice.sign_in(ALICE)]
        await eventually(lambda: _has_job(alice, job.id), timeout=10, what="alice's job on her dashboard")
        for path in ("/", "/login", "/app.js", "/api/state", "/api/session", f"/api/job/{job.id}", "/nope"):
            seen.append(await alice.get(path))
        seen.append(await alice.post("/logout"))  # refused: no CSRF header
        events = await asyncio.to_thread(_first_event, c.web.url, alice.cookie())
        for r in seen:
            assert ADMIN not in r.text and ADMIN not in json.dumps(r.headers), r.url
            assert ALICE not in r.text  # nor the visitor's own token
        assert ADMIN not in events and ALICE not in events


async def _has_job(v: Visitor, job_id: str) -> bool:
    return job_id in {j["id"] for j in (await v.get("/api/state")).json()["jobs"]}


async def test_a_hostile_node_name_is_refused_at_registration(sqlite_url, tmp_path):
    async with DashCluster(sqlite_url, tmp_path) as c:
        name = "<img src=x onerror=alert(1)>"
        with pytest.raises(ValueError, match="letters, digits"):  # no node token can name it
            c.write_tokens(extra=(("tok-node-bad", "nodes", "node", name),))
        bad = LiteAgent(c.scheduler.address, name, token="tok-node-node-0")  # another node's token
        with pytest.raises(grpc.RpcError) as refused:
            await bad.start()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
        admin = c.visitor()
        await admin.sign_in(ADMIN)
        await asyncio.sleep(0.5)
        assert "onerror" not in (await admin.get("/api/state")).text


HOSTILE = '<img src=x onerror="window.__pwned(\'{0}\')"><script>window.__pwned("{0}")</script>'


def _hostile(what: str) -> str:
    return HOSTILE.format(what)


async def test_hostile_markup_in_every_field_shows_as_text(sqlite_url, tmp_path):
    """Markup in every field a tenant or an agent controls runs no script and shows as the text it is, in an admin's
    browser: first from the real scheduler (a job's name and command, a rank's failure message), then, for the
    fields the scheduler's own checks refuse today (node and queue names, fabric paths) and the rank log lines (no
    agent log server here), from the dashboard's API answered by the test with the same markup."""
    async with DashCluster(sqlite_url, tmp_path, nodes=1) as c:
        c.agents[0].setup_failure = _hostile("message")
        job = await c.clients[ALICE].submit(_hostile("job-name"), 1, 1, ["echo", _hostile("command")])
        # A service (its name is refused unless [a-z0-9-]) whose replica's rank fails with the agent's message.
        channel = open_aio_channel(c.scheduler.address, token=ALICE)
        c.channels.append(channel)
        template = common_pb2.JobSpec(replicas=1, gpus_per_replica=1, command=["sleep", "600"])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await service_pb2_grpc.ServiceServiceStub(channel).CreateService(
                service_pb2.CreateServiceRequest(
                    spec=service_pb2.ServiceSpec(name=_hostile("service"), replicas=1, template=template)
                )
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await service_pb2_grpc.ServiceServiceStub(channel).CreateService(
            service_pb2.CreateServiceRequest(spec=service_pb2.ServiceSpec(name="web", replicas=1, template=template))
        )
        async with browser() as b:
            page = await b.new_page(viewport={"width": 1400, "height": 900})
            calls: list[str] = []
            dialogs: list[str] = []
            await page.expose_function("__pwned", lambda what: calls.append(what))
            page.on("dialog", lambda d: (dialogs.append(d.message), asyncio.ensure_future(d.dismiss())))
            await _sign_in_in_browser(page, c.web.url, ADMIN)

            # Every field at once, through the dashboard's own API answered with hostile values.
            await page.route("**/api/state", lambda r: r.fulfill(json=_hostile_state(job.id)))
            await page.route("**/api/events", lambda r: r.abort())
            await page.route(f"**/api/job/{job.id}", lambda r: r.fulfill(json=_hostile_job(job.id)))
            await page.route(
                f"**/api/job/{job.id}/checkpoints", lambda r: r.fulfill(json={"checkpoints": _hostile("checkpoints")})
            )
            await page.route(
                f"**/api/job/{job.id}/logs",
                lambda r: r.fulfill(json={"logs": [f"[rank 0] {_hostile('log-line')}", _hostile("log-line")]}),
            )
            await page.goto(c.web.url + f"#/job/{job.id}")
            await page.reload()  # a new hash alone loads nothing
            await page.wait_for_selector("#queues table", timeout=5_000)
            await page.wait_for_selector("#services table", timeout=5_000)
            await page.wait_for_selector("#job table", timeout=5_000)
            await page.wait_for_selector('#job [data-part="log"][data-loaded]', timeout=5_000)
            await page.wait_for_selector('#job [data-part="checkpoints"][data-loaded]', timeout=5_000)
            await page.hover("#fabric .gpu")
            await asyncio.sleep(0.5)  # an onerror would have fired by now
            assert calls == [] and dialogs == [], (calls, dialogs)
            body = await page.inner_text("body")
            for what in (
                "queue",
                "cohort",
                "pending-name",
                "pending-message",
                "job-name",
                "tenant",
                "message",
                "spine",
                "leaf",
                "log-line",
                "command",
                "node",
                "restore",
                "checkpoints",
                "service",
                "service-tenant",
                "service-message",
                "autoscaler",
                "metric",
                "gang",
                "replica-state",
                "replica-message",
                "leader",
            ):
                assert _hostile(what) in body, what  # the markup, as text
            titles = await page.eval_on_selector_all("[data-node]", "els => els.map(e => e.title).join(' ')")
            assert _hostile("node") in titles
            badge = await page.eval_on_selector_all("#jobs .badge", "els => els.map(e => e.title).join(' ')")
            assert _hostile("service") in badge and _hostile("replica-state") in badge
            assert await page.evaluate("document.querySelectorAll('main img, main script').length") == 0

            # The real scheduler's values: the job's name and command, the failure message its agent reports.
            await page.unroute("**/api/state")
            await page.unroute("**/api/events")
            await page.unroute(f"**/api/job/{job.id}")
            await page.reload()
            await page.wait_for_selector(f'[data-job-row="{job.id}"]', timeout=10_000)

            async def message_shown():
                await page.click(f'[data-open="{job.id}"]')
                await page.wait_for_selector(f'[data-job-page="{job.id}"]', timeout=5_000)
                return _hostile("message") in await page.inner_text("#job")

            await eventually(message_shown, timeout=15, what="the rank's failure message on the job page")

            async def replica_message_shown():
                return _hostile("message") in await page.inner_text('[data-replicas="web"]')

            await eventually(
                replica_message_shown, timeout=15, what="the replica's failure message in the services view"
            )
            text = await page.inner_text("#job")
            for what in ("job-name", "command", "message"):
                assert _hostile(what) in text, what
            assert _hostile("job-name") in await page.inner_text("#jobs")
            assert await page.evaluate("document.querySelectorAll('main img, main script').length") == 0
            await asyncio.sleep(0.5)
            assert calls == [] and dialogs == [], (calls, dialogs)


async def _sign_in_in_browser(page, url: str, token: str) -> None:
    await page.goto(url)
    assert page.url.endswith("/login")
    await page.fill("#token", token)
    async with page.expect_navigation(timeout=10_000):
        await page.click("button[type=submit]")
    assert page.url == url, (page.url, await page.inner_text("body"))


def _hostile_state(job_id: str) -> dict:
    h = _hostile
    return {
        "version": 1,
        "scheduler": h("scheduler"),
        "error": "",
        "history": [],
        "nodes": [
            {
                "name": h("node"),
                "state": "READY",
                "health": h("health"),
                "path": [h("leaf"), h("spine")],
                "gpus": 8,
                "free": 7,
                "releasing": 0,
                "model": h("model"),
                "fatal": [],
                "mig": [],
            },
        ],
        "jobs": [
            {
                "id": job_id,
                "name": h("job-name"),
                "state": "RUNNING",
                "tenant": h("tenant"),
                "queue": h("queue"),
                "priority": 0,
                "message": h("message"),
                "attempt": 1,
                "submitted_at": 0,
                "gang": "1x1",
                "allocations": [{"replica": 0, "node": h("node"), "gpus": [0]}],
                "service": _hostile_replica(),
            },
            {
                "id": "0123456789ab",
                "name": h("job-name"),
                "state": "PENDING",
                "tenant": h("tenant"),
                "queue": "q",
                "priority": 0,
                "message": h("message"),
                "attempt": 0,
                "submitted_at": 0,
                "gang": "1x1",
                "allocations": [],
            },
        ],
        "serving": True,
        "services": [
            {
                "name": h("service"),
                "tenant": h("service-tenant"),
                "revision": 1,
                "desired": 2,
                "ready": 1,
                "message": h("service-message"),
                "autoscaler": h("autoscaler"),
                "autoscale": {"min": 1, "max": 4, "metric": h("metric"), "target": 2.0},
                "gang": h("gang"),
                "created_at": 0,
                "replicas": [
                    {
                        "index": 0,
                        "revision": 1,
                        "state": h("replica-state"),
                        "ready": True,
                        "nodes": [h("node")],
                        "leader": h("leader"),
                        "job_id": job_id,
                        "message": h("replica-message"),
                        "surge": True,
                    },
                ],
            },
        ],
        "queues": [
            {
                "name": h("queue"),
                "cohort": h("cohort"),
                "usage": [],
                "quotas": [],
                "share": 0,
                "pending": [
                    {
                        "position": 1,
                        "job_id": "0123456789ab",
                        "name": h("pending-name"),
                        "message": h("pending-message"),
                    }
                ],
            },
        ],
    }


def _hostile_job(job_id: str) -> dict:
    h = _hostile
    return {
        "id": job_id,
        "name": h("job-name"),
        "state": "RUNNING",
        "tenant": h("tenant"),
        "queue": h("queue"),
        "priority": 0,
        "message": h("message"),
        "attempt": 1,
        "submitted_at": 0,
        "started_at": 0,
        "finished_at": 0,
        "gang": "1x1",
        "allocations": [{"replica": 0, "node": h("node"), "gpus": [0]}],
        "spec": {"replicas": 1, "gpus_per_replica": 1, "command": ["sh", "-c", h("command")]},
        "failures": 0,
        "preemptions": 0,
        "restore": h("restore"),
        "goodput": None,
        "placement": None,
        "service": _hostile_replica(),
    }


def _hostile_replica() -> dict:
    return {
        "service": _hostile("service"),
        "replica": 0,
        "revision": 1,
        "ready": False,
        "state": _hostile("replica-state"),
    }
