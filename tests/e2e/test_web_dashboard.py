"""`phalanx web` in a real browser (issue 21, items 1 and 2; issue 31): Playwright driving Debian's Chromium against the
real dashboard server, itself a client of a real scheduler (authentication on) and checkpoint coordinator with
protocol-level agents. A visitor signs in with their token; every GPU is drawn; a job's GPUs are marked within 2 s of
its submission and freed within 2 s of its cancel, with no reload; its page opens with its committed checkpoints; a
service's replicas are shown with their readiness as it changes (issue 33); a 4,096-node cluster is drawn whole
(virtualized: every leaf placed, the GPUs on screen as elements). How fast that draws is a benchmark:
bench/web_render.py. Screenshots are saved as artifacts (PHALANX_TEST_ARTIFACTS, default test-artifacts/web/).
Without Playwright or Chromium the browser tests skip, or fail where PHALANX_REQUIRE lists chromium
(tests/helpers/required.py). The security tests are in tests/security/test_dashboard.py."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from helpers.waits import eventually, holds
from helpers.web import ADMIN, ALICE, BOB, DashCluster, browser

from db.engine import make_engine
from phalanx.api.v1 import agent_pb2, common_pb2, service_pb2, service_pb2_grpc
from phalanx.client import open_aio_channel
from services.checkpoint_coordinator import store

ROOT = Path(__file__).resolve().parents[2]

# 4,096 nodes (32,768 GPUs) in 128 leaves of 32 under 16 spines, 2,048 jobs of 8 GPUs: for the page's render hook.
SYNTHETIC_4096 = """() => {
  const nodes = [];
  for (let i = 0; i < 4096; i++)
    nodes.push({name: `n${i}`, state: "READY", health: "HEALTHY", path: [`leaf${i >> 5}`, `spine${i >> 8}`],
                gpus: 8, free: 4, releasing: 0, model: "H100", fatal: [], mig: []});
  const jobs = [];
  for (let k = 0; k < 2048; k++)
    jobs.push({id: `j${k}`, name: `j${k}`, state: "RUNNING", tenant: `t${k % 7}`, queue: "default",
               priority: 0, message: "", attempt: 1, submitted_at: 0, gang: "1x8",
               allocations: [{replica: 0, node: `n${k * 2}`, gpus: [0, 1, 2, 3, 4, 5, 6, 7]}]});
  return {version: 1, scheduler: "synthetic", nodes, jobs, queues: [], history: [], error: ""};
}"""


def _artifacts() -> Path:
    out = Path(os.environ.get("PHALANX_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "web"
    out.mkdir(parents=True, exist_ok=True)
    return out


def commit_checkpoint(db_url: str, job_id: str, attempt: int, step: int, world: int) -> None:
    """What every rank's phalanx.train.save does: one shard each; the last one commits."""
    engine = make_engine(db_url)
    try:
        for rank in range(world):
            shard = store.ShardRecord(rank, f"file:///ckpt/{job_id}/{step}/{rank}", 10, f"sha256:{rank}")
            store.report_shard(engine, job_id, attempt, step, world, shard)
    finally:
        engine.dispose()


async def wait_js(page, expression: str, timeout: float) -> None:
    """Poll `expression` in the page until true (page.wait_for_function compiles its predicate with eval, which the
    dashboard's Content-Security-Policy forbids)."""
    deadline = time.monotonic() + timeout
    while not await page.evaluate(expression):
        assert time.monotonic() < deadline, f"not within {timeout} s: {expression}"
        await asyncio.sleep(0.02)


async def sign_in(page, url: str, token: str) -> None:
    await page.goto(url)
    assert page.url.endswith("/login")  # no session yet: the sign-in form
    await page.fill("#token", token)
    async with page.expect_navigation(timeout=10_000):
        await page.click("button[type=submit]")
    assert page.url == url, await page.inner_text("body")


async def test_the_dashboard_draws_the_fabric_and_follows_jobs_live(sqlite_url, tmp_path):
    shots = _artifacts()
    async with DashCluster(sqlite_url, tmp_path, nodes=4) as c, browser() as b:
        client = c.clients[ADMIN]
        page = await b.new_page(viewport={"width": 1400, "height": 900})
        await sign_in(page, c.web.url, ADMIN)
        assert "Phalanx" in await page.title()
        await wait_js(page, "document.querySelectorAll('[data-gpu]').length === 32", 10)
        drawn = await page.eval_on_selector_all("[data-gpu]", "els => els.map(e => e.dataset.gpu)")
        assert sorted(drawn) == sorted(f"{n}/{g}" for n in c.names for g in range(8))  # every GPU, once
        await page.screenshot(path=str(shots / "01-empty.png"), full_page=True)

        job = await client.submit("seen", 2, 4, ["sleep", "60"])
        t0 = time.monotonic()
        await wait_js(page, f"document.querySelectorAll('[data-job=\"{job.id}\"]').length === 8", 2)
        marked = time.monotonic() - t0
        running = await client.get_job(job.id)
        want = {f"{a.node}/{g}" for a in running.allocations for g in a.gpus}
        got = await page.eval_on_selector_all(f'[data-job="{job.id}"]', "els => els.map(e => e.dataset.gpu)")
        assert set(got) == want and marked < 2.0
        await page.screenshot(path=str(shots / "02-running.png"), full_page=True)

        # Two committed checkpoints (steps 100 and 200, a shard per rank): rows on the job's page. The page draws
        # with the job alone: its checkpoints and log tail are held back here (as a slow coordinator or node agent
        # would be) and the page is drawn all the same, with their places waiting; let through, they fill them.
        commit_checkpoint(sqlite_url, job.id, running.attempt, 100, 8)
        commit_checkpoint(sqlite_url, job.id, running.attempt, 200, 8)
        held: list = []
        for part in ("checkpoints", "logs"):
            await page.route(f"**/api/job/{job.id}/{part}", lambda route: held.append(route))
        await page.click(f'[data-job="{job.id}"]')  # the job's page
        await page.wait_for_selector(f'[data-job-page="{job.id}"]', timeout=5_000)
        text = await page.inner_text("#job")
        assert "RUNNING" in text and "productive" in text and "sleep 60" in text
        await wait_js(page, "document.querySelectorAll('#job [data-part]:not([data-loaded])').length === 2", 5)
        assert await page.inner_text('#job [data-part="checkpoints"]') == "loading…"
        await eventually(lambda: holds(lambda: len(held) == 2), timeout=5, what="the page asks for both parts")
        for route in held:
            await route.continue_()
        await page.wait_for_selector(f'[data-checkpoints="{job.id}"]', timeout=5_000)
        await wait_js(page, f"document.querySelector('[data-log=\"{job.id}\"][data-loaded]') !== null", 5)
        rows = await page.eval_on_selector_all(
            f'[data-checkpoints="{job.id}"] tr', "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
        )
        assert sorted((r[0], r[1], r[3]) for r in rows) == [
            ("step 100", f"attempt {running.attempt}", "8 shard(s)"),
            ("step 200", f"attempt {running.attempt}", "8 shard(s)"),
        ], rows
        assert all(r[2].startswith("20") for r in rows), rows  # a commit time, not "-"
        await page.screenshot(path=str(shots / "03-job.png"), full_page=True)

        await client.cancel(job.id)
        await wait_js(page, f"document.querySelectorAll('[data-job=\"{job.id}\"]').length === 0", 2)
        await page.screenshot(path=str(shots / "04-cancelled.png"), full_page=True)

        # Signing out ends the session: the page goes to the sign-in form, the API answers 401.
        await page.click("#sign-out")
        await page.wait_for_url("**/login", timeout=5_000)
        assert (await page.request.get(c.web.url + "api/state")).status == 401


async def test_a_tenant_sees_its_own_jobs_in_the_browser(sqlite_url, tmp_path):
    async with DashCluster(sqlite_url, tmp_path, nodes=2) as c, browser() as b:
        mine = await c.clients[ALICE].submit("alice-run", 1, 4, ["sleep", "60"])
        other = await c.clients[ADMIN].submit("ops-run", 1, 4, ["sleep", "60"])
        page = await b.new_page(viewport={"width": 1400, "height": 900})
        await sign_in(page, c.web.url, ALICE)
        await page.wait_for_selector(f'[data-job-row="{mine.id}"]', timeout=10_000)
        assert await page.query_selector(f'[data-job-row="{other.id}"]') is None
        assert "ops-run" not in await page.inner_text("body")


async def create_service(c: DashCluster, token: str, name: str, replicas: int) -> service_pb2_grpc.ServiceServiceStub:
    """A service of `replicas` one-node replicas (8 GPUs each) with a readiness probe: the protocol-level agents run
    no probe, so each replica is ready when the test says so (its leader's agent reports it, as a real one would)."""
    channel = open_aio_channel(c.scheduler.address, token=token)
    c.channels.append(channel)
    stub = service_pb2_grpc.ServiceServiceStub(channel)
    template = common_pb2.JobSpec(replicas=1, gpus_per_replica=8, command=["sleep", "600"])
    template.ready_probe.command.append("true")
    spec = service_pb2.ServiceSpec(name=name, replicas=replicas, template=template, port=8000)
    await stub.CreateService(service_pb2.CreateServiceRequest(spec=spec))
    return stub


async def report_ready(c: DashCluster, replica: service_pb2.ServiceReplica, attempt: int) -> None:
    leader = next(a for a in c.agents if a.name == replica.nodes[0])
    await leader.stub.ReportReadiness(
        agent_pb2.ReportReadinessRequest(
            node_name=leader.name, agent_instance=leader.instance, job_id=replica.job_id, attempt=attempt, ready=True
        )
    )


async def test_a_service_shows_its_replicas_and_their_readiness_live(sqlite_url, tmp_path):
    """Issue 33: a service of 2 replicas in the services view (revision, ready/desired, each replica's state,
    readiness, node, leader address and job), its replicas' jobs marked in the jobs list, and readiness followed
    live: both replicas become ready with no reload. Another tenant sees none of it."""
    shots = _artifacts()
    async with DashCluster(sqlite_url, tmp_path, nodes=4) as c, browser() as b:
        stub = await create_service(c, ALICE, "chat", 2)
        page = await b.new_page(viewport={"width": 1400, "height": 900})
        await sign_in(page, c.web.url, ALICE)
        await page.wait_for_selector('[data-service="chat"]', timeout=10_000)
        # Both replicas placed (RUNNING, not ready: their probe has not passed yet).
        starting = "[...document.querySelectorAll('[data-replicas=\"chat\"] tr[data-replica]')]"
        await wait_js(page, f"{starting}.filter(r => r.cells[2].textContent.startsWith('STARTING')).length === 2", 10)
        assert await page.inner_text('[data-service-ready="chat"]') == "0/2 ready"
        svc = await stub.GetService(service_pb2.GetServiceRequest(name="chat"))
        jobs = {r.index: r.job_id for r in svc.replicas}
        assert sorted(jobs) == [0, 1]
        for index, job_id in jobs.items():
            await page.wait_for_selector(f'[data-service-of="{job_id}"]', timeout=5_000)
            assert await page.inner_text(f'[data-service-of="{job_id}"]') == f"chat[{index}] not ready"
        await page.screenshot(path=str(shots / "06-service-starting.png"), full_page=True)

        # The leaders' agents report their probes pass: the page follows, replica by replica, with no reload.
        for r in svc.replicas:
            await report_ready(c, r, (await c.clients[ALICE].get_job(r.job_id)).attempt)
        await wait_js(page, "document.querySelector('[data-service-ready=\"chat\"]').textContent === '2/2 ready'", 5)
        rows = await page.eval_on_selector_all(
            '[data-replicas="chat"] tr[data-replica]', "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
        )
        by_index = {int(r[0]): r for r in rows}
        assert sorted(by_index) == [0, 1], rows
        for r in svc.replicas:
            index, revision, state, ready, nodes, leader, job = by_index[r.index]
            assert (revision, ready, job) == ("r1", "ready", r.job_id), by_index[r.index]
            assert state == "READY ready: its readiness probe passes"  # the state, then the replica's message
            assert nodes == r.nodes[0] and leader == "127.0.0.1:8000"
        head = await page.inner_text('[data-service="chat"] .service-head')
        assert "revision 1" in head and "(alice)" in head, head
        for index, job_id in jobs.items():
            await wait_js(
                page,
                f"document.querySelector('[data-service-of=\"{job_id}\"]').textContent === 'chat[{index}] ready'",
                5,
            )
        await page.screenshot(path=str(shots / "07-service-ready.png"), full_page=True)

        # A replica's job page says what it is.
        await page.click(f'[data-replicas="chat"] [data-open="{jobs[1]}"]')
        await page.wait_for_selector(f'[data-job-page="{jobs[1]}"]', timeout=5_000)
        assert "replica 1 of chat, revision 1, READY" in await page.inner_text("#job")

        # Bob (another tenant) sees no service and no replica.
        other = await b.new_page(viewport={"width": 1400, "height": 900})
        await sign_in(other, c.web.url, BOB)
        # (nodes and services come from the same poll: once the GPUs are drawn, so are the services bob may see)
        await wait_js(other, "document.querySelectorAll('[data-gpu]').length === 32", 10)
        assert await other.inner_text("#services") == "no services"
        assert "chat" not in await other.inner_text("body")


async def test_4096_nodes_are_all_drawn(sqlite_url, tmp_path):
    """4,096 nodes (32,768 GPUs) drawn virtualized: every leaf has its place, sized for its nodes, and the nodes on
    screen are elements with their GPUs and jobs; scrolling to the end draws the last node. (How fast: the bench.)"""
    async with DashCluster(sqlite_url, tmp_path, nodes=1) as c, browser() as b:
        page = await b.new_page(viewport={"width": 1400, "height": 900})
        await sign_in(page, c.web.url, ADMIN)
        await page.wait_for_selector("[data-gpu]", timeout=10_000)
        await page.evaluate(
            f"() => {{ window.phalanxLive = false; window.phalanxRender(({SYNTHETIC_4096})()); }}"
        )  # the live stream would draw the real cluster over this one
        leaves = await page.eval_on_selector_all("#fabric .leaf .label", "els => els.map(e => e.textContent)")
        assert len(leaves) == 128 and all(label.endswith("(32 nodes)") for label in leaves)
        assert await page.inner_text("#summary") == "4096 nodes, 32768 GPUs, 16384 held by 2048 job(s)"
        await wait_js(page, "document.querySelectorAll('[data-gpu]').length > 0", 5)
        shown = await page.eval_on_selector_all("[data-gpu]", "els => els.length")
        assert 0 < shown < 32768  # only the leaves on screen hold elements
        held = await page.eval_on_selector_all('[data-job="j0"]', "els => els.map(e => e.dataset.gpu)")
        assert held == [f"n0/{g}" for g in range(8)]  # on screen, with its job
        await page.screenshot(path=str(_artifacts() / "05-4096-nodes.png"))
        # Each leaf scrolled into view draws its 32 nodes with their 8 GPUs each: all 4,096 are drawn, in turn.
        drawn = await page.evaluate(
            """async () => {
              const seen = new Set();
              for (const leaf of document.querySelectorAll('#fabric .leaf')) {
                leaf.scrollIntoView();
                const box = leaf.querySelector('.nodes');
                for (let k = 0; k < 300 && !box.firstChild; k++) await new Promise((r) => requestAnimationFrame(r));
                for (const n of box.querySelectorAll('[data-node]'))
                  if (n.querySelectorAll('[data-gpu]').length === 8) seen.add(n.dataset.node);
              }
              return [...seen];
            }"""
        )
        assert sorted(drawn) == sorted(f"n{i}" for i in range(4096))
        assert await page.query_selector('[data-node="n4095"]') is not None
        assert await page.query_selector('[data-node="n0"]') is None  # scrolled away: dropped


def test_cluster_up_serves_the_dashboard_with_the_cluster(tmp_path):
    """`phalanx cluster up --web-port P` (LocalCluster(web_port=...)): the dashboard comes up with the cluster, its
    page (after signing in: authentication is off here, so with an empty token) and its state, and goes with it."""
    from helpers.web import Visitor

    from phalanx.cli.local_cluster import LocalCluster

    messages: list[str] = []
    cluster = LocalCluster(nodes=2, state_dir=tmp_path / "c", port=0, log=messages.append, web_port=0)
    try:
        cluster.start()
        url = cluster.web.url
        assert any(m.startswith("dashboard at http://127.0.0.1:") for m in messages), messages
        v = Visitor(url)
        assert v._call("/api/state", None, {}, "GET").status == 401  # nothing before signing in
        r = v._call("/login", b"token=", {"Origin": url.rstrip("/")}, "POST")
        assert r.status == 200 and b"<title>Phalanx</title>" in r.body  # redirected to the page
        deadline = time.monotonic() + 10
        while True:
            doc = v._call("/api/state", None, {}, "GET").json()
            if len(doc["nodes"]) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(n["name"] for n in doc["nodes"]) == ["node-01", "node-02"]
    finally:
        cluster.stop()
    assert cluster.web is None
