"""Pages of ListJobs and ListNodes against the real scheduler (in-process, with tokens) on SQLite and PostgreSQL:
order, tokens, the last page's empty token, bad sizes and tokens, filters (PREEMPTING included) and the tenant
scope before paging, the byte budget, the SDK's page calls and iterators (sync and async), and `phalanx jobs`'s
--limit / --page-token / --all / --json. Jobs and nodes are written straight into the ledger (the scheduler reads
listings from the ledger; rows written after it started are not in its view, so it leaves them alone)."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import grpc
import pytest
from sqlalchemy import insert, inspect

from db.engine import make_engine
from db.models import Allocation, Gpu, Job, Node
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.cli import jobs as cli_jobs
from phalanx.cli import main as cli_module
from phalanx.client import AsyncClient, Client, InvalidArgumentError
from phalanx.client._channel import open_aio_channel
from phalanx.common.tokens import TokenStore, hash_token
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler import ledger, paging
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(60)

TOKENS = {
    "admin": ("tok-admin", "ops", "admin"),
    "alice": ("tok-alice", "alice", "user"),
    "bob": ("tok-bob", "bob", "user"),
    "node": ("tok-node", "nodes", "node", "node-0"),
}
BASE = time.time() - 50_000  # every written job is older than one submitted during a test


class Scheduler:
    """The scheduler with tokens (admin sees every job, a user its tenant's), and a raw stub per caller; with
    `agent`, one 8-GPU node (node-0) registered, so that jobs can be submitted."""

    def __init__(self, db_url: str, tmp_path, agent: bool = False) -> None:
        self.with_agent = agent
        self.agent: LiteAgent | None = None
        self.db_url = db_url
        self.tokens_path = tmp_path / "tokens.yaml"
        self.tokens_path.write_text(
            "".join(
                f"- {{token_sha256: {hash_token(e[0])}, tenant: {e[1]}, role: {e[2]}"
                + (f", node: {e[3]}}}\n" if len(e) > 3 else "}\n")
                for e in TOKENS.values()
            )
        )
        self.settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0"]))

    async def __aenter__(self):
        self.scheduler = await serve(self.settings, tokens=TokenStore(self.tokens_path, check_interval=60))
        self.address = self.scheduler.address
        if self.with_agent:
            self.agent = LiteAgent(self.address, "node-0", token="tok-node")
            await self.agent.start()
        self.channels = {k: open_aio_channel(self.address, token=v[0]) for k, v in TOKENS.items()}
        self.stubs = {k: scheduler_pb2_grpc.SchedulerStub(ch) for k, ch in self.channels.items()}
        self.admin = AsyncClient(self.address, token="tok-admin", retries=0)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.admin.close()
        if self.agent is not None:
            await self.agent.stop()
        for ch in self.channels.values():
            await ch.close()
        await self.scheduler.stop()

    async def list_jobs(self, who: str = "admin", **fields) -> scheduler_pb2.ListJobsResponse:
        return await self.stubs[who].ListJobs(scheduler_pb2.ListJobsRequest(**fields), timeout=10)

    async def list_nodes(self, **fields) -> scheduler_pb2.ListNodesResponse:
        return await self.stubs["admin"].ListNodes(scheduler_pb2.ListNodesRequest(**fields), timeout=10)


def job_row(i: int, *, state: str = "SUCCEEDED", at: float | None = None, **kw) -> dict:
    """A job row; `at` defaults to groups of three jobs per submit time, so that ties are ordered by id. Every row
    has the same keys (one multi-row insert)."""
    for key, default in (("preempted_by", ""), ("preempt_deadline", 0.0), ("tenant", ""), ("attempt", 0)):
        kw.setdefault(key, default)
    return dict(
        id=f"{i:012x}",
        name=f"job-{i}",
        state=state,
        replicas=1,
        gpus_per_replica=1,
        command=kw.pop("command", ["true"]),
        submitted_at=BASE + (i // 3) * 0.25 if at is None else at,
        finished_at=time.time() if state in ("SUCCEEDED", "FAILED", "CANCELLED") else 0.0,
        **kw,
    )


def write(db_url: str, table, rows: list[dict]) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        if rows:
            conn.execute(insert(table), rows)
    engine.dispose()


def newest_first(rows: list[dict]) -> list[str]:
    return [r["id"] for r in sorted(rows, key=lambda r: (r["submitted_at"], r["id"]), reverse=True)]


async def pages(list_page, **fields) -> list[list[str]]:
    """Every page's ids (job ids or node names), following the tokens until one is "" (the last page)."""
    out, token = [], ""
    while True:
        response = await list_page(page_token=token, **fields)
        items = response.jobs if hasattr(response, "jobs") else response.nodes
        out.append([getattr(x, "id", "") or x.name for x in items])
        token = response.next_page_token
        if not token:
            return out
        assert len(out) < 1000, "the tokens never end"


async def invalid(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    return err.value.details()


# -- jobs ------------------------------------------------------------------------------------------------------


def test_the_ledger_has_the_index_job_pages_read_by(db_url):
    """Revision 0017: jobs (submitted_at, id), the listing's order and key."""
    engine = make_engine(db_url)
    indexes = {i["name"]: i["column_names"] for i in inspect(engine).get_indexes("jobs")}
    engine.dispose()
    assert indexes["ix_jobs_submitted_at_id"] == ["submitted_at", "id"]


async def test_2500_jobs_through_pages_each_once_in_order_with_a_submit_between_pages(db_url, tmp_path):
    """No page is near the message cap and every job comes exactly once, newest first, even with a job submitted
    between two pages (it is newer than the walk's first page, so it shows in a new walk, not in this one)."""
    states = ["SUCCEEDED", "FAILED", "CANCELLED", "PREEMPTED"]
    rows = [job_row(i, state=states[i % 4]) for i in range(2500)]
    expected = newest_first(rows)
    async with Scheduler(db_url, tmp_path, agent=True) as s:
        write(db_url, Job, rows)  # after the start: rows the scheduler never loaded, so it leaves them be
        first = await s.list_jobs(page_size=1000)
        seen = [j.id for j in first.jobs]
        submitted = await s.admin.submit("between-pages", 1, 1, ["run"])
        token = first.next_page_token
        sizes = [len(first.jobs)]
        while token:
            page = await s.list_jobs(page_size=1000, page_token=token)
            assert page.ByteSize() < paging.PAGE_BYTES
            seen += [j.id for j in page.jobs]
            sizes.append(len(page.jobs))
            token = page.next_page_token
        assert sizes == [1000, 1000, 500]
        assert seen == expected and len(set(seen)) == 2500 and submitted.id not in seen
        # a new walk starts with the new job; the default page is the newest 100
        default = await s.list_jobs()
        assert [j.id for j in default.jobs] == [submitted.id, *expected[:99]] and default.next_page_token
        rest = await s.list_jobs(page_token=default.next_page_token)
        assert [j.id for j in rest.jobs] == expected[99:199]
        # the SDK: async iterator over every page, the page call, and list_jobs as before (the first page)
        got = [j.id async for j in s.admin.iter_jobs(page_size=700)]
        assert got == [submitted.id, *expected]
        jobs, token = await s.admin.list_jobs_page(page_size=3)
        assert [j.id for j in jobs] == [submitted.id, *expected[:2]] and token
        jobs, token = await s.admin.list_jobs_page(page_size=3, page_token=token)
        assert [j.id for j in jobs] == expected[2:5]
        assert [j.id for j in await s.admin.list_jobs()] == [submitted.id, *expected[:99]]
        assert [j.id for j in await s.admin.list_jobs(limit=5)] == [submitted.id, *expected[:4]]

        def sync_walk():
            with Client(s.address, token="tok-admin", timeout=10) as c:
                every = [j.id for j in c.iter_jobs(["SUCCEEDED", "FAILED"], page_size=333)]
                page, next_token = c.list_jobs_page("CANCELLED", page_size=2)
                return every, [j.id for j in page], next_token, [j.id for j in c.list_jobs("FAILED", limit=3)]

        every, cancelled, next_token, failed = await asyncio.to_thread(sync_walk)
        wanted = {r["id"]: r["state"] for r in rows}
        assert every == [i for i in expected if wanted[i] in ("SUCCEEDED", "FAILED")] and len(every) == 1250
        assert cancelled == [i for i in expected if wanted[i] == "CANCELLED"][:2] and next_token
        assert failed == [i for i in expected if wanted[i] == "FAILED"][:3]


async def test_the_deprecated_limit_is_one_page_of_that_many_without_the_page_maximum(db_url, tmp_path):
    rows = [job_row(i) for i in range(1205)]
    expected = newest_first(rows)
    async with Scheduler(db_url, tmp_path) as s:
        write(db_url, Job, rows)
        big = await s.list_jobs(limit=1200)
        assert [j.id for j in big.jobs] == expected[:1200] and big.next_page_token
        rest = await s.list_jobs(page_token=big.next_page_token)  # the token goes on where the limit stopped
        assert [j.id for j in rest.jobs] == expected[1200:] and rest.next_page_token == ""
        both = await s.list_jobs(limit=1200, page_size=4)  # page_size wins
        assert [j.id for j in both.jobs] == expected[:4]
        exact = await s.list_jobs(limit=1205)
        assert len(exact.jobs) == 1205 and exact.next_page_token == ""


async def test_bad_page_sizes_and_tokens_are_invalid_argument(db_url, tmp_path):
    rows = [job_row(i) for i in range(5)]
    async with Scheduler(db_url, tmp_path) as s:
        write(db_url, Job, rows)
        assert await invalid(s.list_jobs(page_size=-1)) == "page_size must not be negative, got -1"
        assert await invalid(s.list_jobs(page_size=1001)) == "page_size must be at most 1000, got 1001"
        assert await invalid(s.list_jobs(limit=-3)) == "limit must not be negative, got -3"
        assert await invalid(s.list_nodes(page_size=5001)) == "page_size must be at most 5000, got 5001"
        assert await invalid(s.list_nodes(page_size=-2)) == "page_size must not be negative, got -2"
        page = await s.list_jobs(page_size=2)
        token = page.next_page_token
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        assert raw["v"] == 1 and raw["k"] == "jobs" and raw["id"] == page.jobs[-1].id

        def forge(**changes) -> str:
            return base64.urlsafe_b64encode(json.dumps({**raw, **changes}).encode()).decode()

        bad = {
            "not base64 !": "not a page token this server issued",
            base64.urlsafe_b64encode(b"not json").decode(): "not a page token this server issued",
            base64.urlsafe_b64encode(b"[1, 2]").decode(): "not a page token this server issued",
            forge(v=2): "not a page token this server issued",
            forge(t="yesterday"): "its position is malformed",
            forge(id=7): "its position is malformed",
            "x" * 2000: "longer than 1024 characters",
        }
        for value, reason in bad.items():
            assert await invalid(s.list_jobs(page_token=value)) == f"invalid page token: {reason}", value
        # a token of another listing, filter or caller
        node_token = paging.node_token(common_pb2.Node(name="gpu-000"))
        assert (await invalid(s.list_jobs(page_token=node_token))).startswith(
            "invalid page token: it is a token of another listing"
        )
        assert (await invalid(s.list_nodes(page_token=token))).startswith(
            "invalid page token: it is a token of another listing"
        )
        other_filter = s.list_jobs(page_token=token, states=[common_pb2.JOB_STATE_SUCCEEDED])
        assert (await invalid(other_filter)).startswith("invalid page token: it was issued for other filters")
        assert (await invalid(s.list_jobs("alice", page_token=token))).startswith(
            "invalid page token: it was issued for other filters (states) or another caller"
        )
        with pytest.raises(InvalidArgumentError, match="invalid page token"):
            await s.admin.list_jobs_page(page_token="garbage")
        # nothing else happened: the same token still gives the next page, and the ledger holds the same jobs
        again = await s.list_jobs(page_size=2, page_token=token)
        assert [j.id for j in again.jobs] == newest_first(rows)[2:4]
        assert len((await s.list_jobs()).jobs) == 5


async def test_state_filters_and_preempting_apply_before_paging(db_url, tmp_path):
    """Every page but the last is full of matching jobs; PREEMPTING is a RUNNING job with a preemptor (SQL, not a
    filter after the read), RUNNING includes those."""
    rows = []
    for i in range(60):
        kind = i % 5
        if kind == 0:
            rows.append(job_row(i, state="RUNNING", preempted_by="abcdef012345", preempt_deadline=time.time() + 3600))
        elif kind == 1:
            rows.append(job_row(i, state="RUNNING"))
        elif kind == 2:
            rows.append(job_row(i, state="PENDING"))
        else:
            rows.append(job_row(i, state="SUCCEEDED"))
    order = newest_first(rows)
    by_id = {r["id"]: r for r in rows}
    preempting = [i for i in order if by_id[i].get("preempted_by")]
    running = [i for i in order if by_id[i]["state"] == "RUNNING"]
    S = common_pb2
    async with Scheduler(db_url, tmp_path) as s:
        write(db_url, Job, rows)
        got = await pages(s.list_jobs, page_size=5, states=[S.JOB_STATE_PREEMPTING])
        assert [len(p) for p in got] == [5, 5, 2] and sum(got, []) == preempting
        got = await pages(s.list_jobs, page_size=5, states=[S.JOB_STATE_RUNNING])
        assert [len(p) for p in got] == [5, 5, 5, 5, 4] and sum(got, []) == running
        got = await pages(s.list_jobs, page_size=7, states=[S.JOB_STATE_PREEMPTING, S.JOB_STATE_SUCCEEDED])
        wanted = [i for i in order if i in preempting or by_id[i]["state"] == "SUCCEEDED"]
        assert sum(got, []) == wanted and all(len(p) == 7 for p in got[:-1])
        got = await pages(s.list_jobs, page_size=4, states=[S.JOB_STATE_RUNNING, S.JOB_STATE_PREEMPTING])
        assert sum(got, []) == running
        page = await s.list_jobs(states=[S.JOB_STATE_PREEMPTING])
        assert {j.state for j in page.jobs} == {S.JOB_STATE_PREEMPTING} and page.next_page_token == ""
        page = await s.list_jobs(states=[S.JOB_STATE_RUNNING])
        assert {j.state for j in page.jobs} == {S.JOB_STATE_RUNNING, S.JOB_STATE_PREEMPTING}
        # the filter's order does not matter to its tokens
        first = await s.list_jobs(page_size=2, states=[S.JOB_STATE_SUCCEEDED, S.JOB_STATE_PENDING])
        second = await s.list_jobs(
            page_size=2, states=[S.JOB_STATE_PENDING, S.JOB_STATE_SUCCEEDED], page_token=first.next_page_token
        )
        both = [i for i in order if by_id[i]["state"] in ("PENDING", "SUCCEEDED")]
        assert [j.id for j in (*first.jobs, *second.jobs)] == both[:4]


async def test_the_tenant_scope_applies_before_paging(db_url, tmp_path):
    rows = [job_row(i, tenant="alice" if i % 3 else "bob") for i in range(45)]
    order = newest_first(rows)
    tenant = {r["id"]: r["tenant"] for r in rows}
    async with Scheduler(db_url, tmp_path) as s:
        write(db_url, Job, rows)
        alice = await pages(lambda **f: s.list_jobs("alice", **f), page_size=7)
        assert [len(p) for p in alice] == [7, 7, 7, 7, 2]
        assert sum(alice, []) == [i for i in order if tenant[i] == "alice"]
        bob = await pages(lambda **f: s.list_jobs("bob", **f), page_size=7)
        assert sum(bob, []) == [i for i in order if tenant[i] == "bob"] and [len(p) for p in bob] == [7, 7, 1]
        admin = await pages(s.list_jobs, page_size=20)
        assert sum(admin, []) == order


async def test_a_page_stops_at_the_byte_budget_and_says_where_the_rest_start(db_url, tmp_path, monkeypatch):
    """However many jobs a page asks for, it stays under the byte budget (at least one job) and has a token."""
    rows = [job_row(i, command=["x" * 10_000]) for i in range(30)]
    monkeypatch.setattr(paging, "PAGE_BYTES", 64 * 1024)
    async with Scheduler(db_url, tmp_path) as s:
        write(db_url, Job, rows)
        seen, token, sizes = [], "", []
        while True:
            page = await s.list_jobs(page_size=1000, page_token=token)
            assert page.ByteSize() <= 64 * 1024 + 64
            seen += [j.id for j in page.jobs]
            sizes.append(len(page.jobs))
            token = page.next_page_token
            if not token:
                break
        assert seen == newest_first(rows) and len(sizes) > 1 and max(sizes) == 6
        monkeypatch.setattr(paging, "PAGE_BYTES", 100)  # a single job larger than the budget still comes
        page = await s.list_jobs(page_size=10)
        assert len(page.jobs) == 1 and page.next_page_token


async def test_submit_refuses_an_environment_too_large_for_a_small_job_message(db_url, tmp_path):
    async with Scheduler(db_url, tmp_path, agent=True) as s:
        with pytest.raises(
            InvalidArgumentError,
            match=r"env is too large: at most 4096 variables \(--max-env-vars\) and 262144 bytes \(--max-env-bytes\)",
        ):
            await s.admin.submit("big-env", 1, 1, ["run"], env={"A": "x" * (256 * 1024)})
        with pytest.raises(InvalidArgumentError, match="env is too large"):
            await s.admin.submit("many-env", 1, 1, ["run"], env={f"V{i}": "" for i in range(4097)})
        ok = await s.admin.submit("fine-env", 1, 1, ["run"], env={"A": "x" * 1000})
        assert [j.id for j in await s.admin.list_jobs()] == [ok.id]


# -- nodes -----------------------------------------------------------------------------------------------------


def write_nodes(db_url: str, count: int) -> list[str]:
    """`count` nodes of 2 GPUs, written in an order unlike their names; the node named gpu-017 has GPU 1 held by a
    running job. Returns the names in name order."""
    names = [f"gpu-{i:03d}" for i in range(count)]
    order = names[1::2] + names[0::2]
    now = time.time()
    write(
        db_url,
        Node,
        [
            dict(id=k + 1, name=n, state="READY", gpus=2, registered_at=now, last_heartbeat=now)
            for k, n in enumerate(order)
        ],
    )
    node_id = {n: k + 1 for k, n in enumerate(order)}
    write(
        db_url,
        Gpu,
        [
            dict(id=2 * node_id[n] + g, node_id=node_id[n], index=g, uuid=f"GPU-{n}-{g}", name="H100")
            for n in names
            for g in (0, 1)
        ],
    )
    held = "gpu-017"
    if held in node_id:
        write(db_url, Job, [job_row(1, state="RUNNING", attempt=1)])
        write(
            db_url,
            Allocation,
            [
                dict(
                    job_id=f"{1:012x}",
                    attempt=1,
                    replica=0,
                    node_id=node_id[held],
                    gpu_id=2 * node_id[held] + 1,
                    gpu_index=1,
                    reserved_at=now,
                )
            ],
        )
    return names


async def test_nodes_come_in_pages_by_name_and_each_page_reads_only_its_nodes(
    db_url, tmp_path, monkeypatch, capsys, service_logs
):
    async with Scheduler(db_url, tmp_path) as s:
        names = write_nodes(db_url, 25)
        got = await pages(s.list_nodes, page_size=10)
        assert got == [names[:10], names[10:20], names[20:]]
        page = await s.list_nodes(page_size=10)
        assert page.next_page_token and [n.name for n in page.nodes] == names[:10]
        second = await s.list_nodes(page_size=10, page_token=page.next_page_token)
        held = next(n for n in second.nodes if n.name == "gpu-017")
        assert held.free_gpus == 1 and [g.uuid for g in held.gpu_details] == ["GPU-gpu-017-0", "GPU-gpu-017-1"]
        assert all(n.free_gpus == 2 and len(n.gpu_details) == 2 for n in second.nodes if n.name != "gpu-017")
        everything = await s.list_nodes()
        assert [n.name for n in everything.nodes] == names and everything.next_page_token == ""
        # the SDK: nodes() follows every page, iter_nodes too
        monkeypatch.setattr(paging, "DEFAULT_NODE_PAGE", 4)
        assert [n.name for n in await s.admin.nodes()] == names
        assert [n.name async for n in s.admin.iter_nodes(page_size=6)] == names
        nodes, token = await s.admin.list_nodes_page(page_size=24)
        assert [n.name for n in nodes] == names[:24] and token
        nodes, token = await s.admin.list_nodes_page(page_size=24, page_token=token)
        assert [n.name for n in nodes] == names[24:] and token == ""

        def sync_nodes():
            with Client(s.address, token="tok-admin", timeout=10) as c:
                return [n.name for n in c.nodes()], [n.name for n in c.iter_nodes(page_size=11)]

        assert await asyncio.to_thread(sync_nodes) == (names, names)
        # `phalanx nodes` shows every node, following the pages
        code, out, err = await _cli(capsys, s.address, "nodes", "--json")
        assert code == 0, err
        assert [n["name"] for n in json.loads(out)] == names
    # the ledger reads of one page: its nodes, their allocations and GPUs only
    engine = make_engine(db_url)
    with engine.connect() as conn:
        rows = ledger.read_nodes(conn, after="gpu-014", limit=3)
        assert [r["name"] for r, _, _ in rows] == ["gpu-015", "gpu-016", "gpu-017"]
        assert [used for _, used, _ in rows] == [0, 0, 1]
        ids = [r["id"] for r, _, _ in rows]
        gpus = ledger.read_node_gpus(conn, ids)
        assert set(gpus) == set(ids) and [g["held"] for g in gpus[ids[2]]] == [False, True]
        assert ledger.read_node_gpus(conn, []) == {}
        assert len(ledger.read_node_gpus(conn)) == 25 and len(ledger.read_nodes(conn)) == 25
    engine.dispose()


# -- the CLI ---------------------------------------------------------------------------------------------------


async def _cli(capsys, address: str, *argv: str) -> tuple[int, str, str]:
    """main(argv) in a worker thread (its client is synchronous, the scheduler runs on this loop); the scheduler's
    logs go to a buffer of their own (service_logs), so stdout and stderr are the CLI's alone."""
    capsys.readouterr()
    code = await asyncio.to_thread(
        cli_module.main, ["--scheduler", address, "--token", "tok-admin", "--timeout", "10", *argv]
    )
    out, err = capsys.readouterr()
    return code, out, err


async def test_cli_jobs_pages_limit_page_token_all_and_json(db_url, tmp_path, monkeypatch, capsys, service_logs):
    rows = [job_row(i, state="FAILED" if i % 4 == 0 else "SUCCEEDED") for i in range(230)]
    order = newest_first(rows)
    failed = [r["id"] for r in rows if r["state"] == "FAILED"]
    failed = [i for i in order if i in set(failed)]

    async def cli(*argv):
        return await _cli(capsys, s.address, *argv)

    def ids_of(table: str) -> list[str]:
        return [line.split()[0] for line in table.splitlines()[1:] if line and not line.startswith("next page:")]

    async with Scheduler(db_url, tmp_path) as s:
        write(db_url, Job, rows)
        # one page of 100 by default; its last line names the next page, which prints the next 100
        code, out, err = await cli("jobs")
        assert code == 0, err
        lines = out.rstrip("\n").splitlines()
        assert lines[0].split() == ["ID", "NAME", "STATE", "PRI", "GANG", "NODES", "AGE", "SERVICE"]
        assert ids_of(out) == order[:100]
        assert lines[-1].startswith("next page: phalanx jobs --page-token ")
        token = lines[-1].rsplit(" ", 1)[1]
        code, out, err = await cli("jobs", "--page-token", token)
        assert code == 0 and ids_of(out) == order[100:200]
        code, out, err = await cli("jobs", "--page-token", out.rstrip("\n").splitlines()[-1].rsplit(" ", 1)[1])
        assert code == 0 and ids_of(out) == order[200:] and "next page:" not in out
        # --limit, --state and the hint that repeats them
        code, out, err = await cli("jobs", "--state", "failed", "--limit", "5")
        assert code == 0 and ids_of(out) == failed[:5]
        hint = out.rstrip("\n").splitlines()[-1]
        assert hint.startswith("next page: phalanx jobs --state FAILED --limit 5 --page-token ")
        code, out, err = await cli(*hint.split()[3:])
        assert code == 0 and ids_of(out) == failed[5:10]
        # --json: one object, the page and its token; the token goes on from there
        code, out, err = await cli("jobs", "--limit", "7", "--json")
        doc = json.loads(out)
        assert code == 0 and set(doc) == {"jobs", "next_page_token"} and doc["next_page_token"]
        assert [j["id"] for j in doc["jobs"]] == order[:7]
        code, out, err = await cli("jobs", "--limit", "7", "--page-token", doc["next_page_token"], "--json")
        assert [j["id"] for j in json.loads(out)["jobs"]] == order[7:14]
        code, out, err = await cli("jobs", "--state", "FAILED", "--json")
        doc = json.loads(out)
        assert [j["id"] for j in doc["jobs"]] == failed and doc["next_page_token"] == ""
        # --all follows every page (pages of 40 here), printed as they arrive: the whole as one document
        monkeypatch.setattr(cli_jobs, "ALL_PAGE_SIZE", 40)
        calls = []
        real = Client.list_jobs_page

        def counted(self, *a, **kw):
            calls.append(kw.get("page_token", ""))
            return real(self, *a, **kw)

        monkeypatch.setattr(Client, "list_jobs_page", counted)
        code, out, err = await cli("jobs", "--all", "--json")
        assert code == 0 and len(calls) == 6 and calls[0] == ""
        doc = json.loads(out)
        assert [j["id"] for j in doc["jobs"]] == order and doc["next_page_token"] == ""
        code, out, err = await cli("jobs", "--all")
        assert code == 0 and ids_of(out) == order and "next page:" not in out
        assert sum(1 for line in out.splitlines() if line.startswith("ID ")) == 1
        code, out, err = await cli("jobs", "--all", "--state", "FAILED", "--json")
        assert [j["id"] for j in json.loads(out)["jobs"]] == failed
        # usage errors (exit 2) and a bad token (exit 1, the scheduler's message)
        calls.clear()
        code, out, err = await cli("jobs", "--all", "--limit", "5")
        assert code == 2 and out == "" and "--limit and --all cannot be used together" in err
        for bad in ("0", "1001", "-1"):
            code, out, err = await cli("jobs", "--limit", bad)
            assert code == 2 and out == "" and "--limit must be 1 to 1000" in err
        assert calls == []
        code, out, err = await cli("jobs", "--page-token", "nonsense", "--json")
        assert code == 1 and out == ""
        assert err.startswith("error: INVALID_ARGUMENT: invalid page token: not a page token this server issued")
        code, out, err = await cli("jobs", "--all", "--page-token", "nonsense", "--json")
        assert code == 1 and out == "" and "invalid page token" in err
