"""The Grafana dashboard (deploy/grafana/phalanx.json, issue 21): valid, one datasource variable on every panel, and
every metric it queries exported by the services' /metrics with the labels it filters and groups by.

The PromQL of every target and every `label_values(...)` variable is parsed into the metric names it reads, the
labels of its matchers and groupings, and the label values its matchers name. Then the real scheduler and checkpoint
coordinator run as processes with --metrics-port, a small workload runs through their gRPC APIs (a LiteAgent node, a
queue with a running and a pending job, a checkpoint committed by two ranks through the coordinator's shard
protocol), and both /metrics pages are scraped over HTTP until every queried series exists."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from helpers.ports import reserved_port
from helpers.procs import ServiceProcess
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.testing.lite_agent import LiteAgent
from phalanx.train import Checkpointer
from services.common import metrics

pytestmark = pytest.mark.timeout(60)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "phalanx.json"
DATASOURCE_UID = "${DS_PROMETHEUS}"

# Labels Prometheus adds to every series at scrape time: never in an exposition, always there in a query.
TARGET_LABELS = {"instance", "job"}

AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
RATE_FUNCTIONS = {"rate", "irate", "increase", "resets"}

# What the dashboard must cover (issue 21 item 4), by the metric that carries it.
REQUIRED = {
    "cycle time": "phalanx_scheduler_cycle_seconds_bucket",
    "queue depth per queue": "phalanx_queue_pending_jobs",
    "reservations per second": "phalanx_reservations_total",
    "GPUs allocated per tenant": "phalanx_tenant_gpus_allocated",
    "goodput": "phalanx_goodput_ratio",
    "goodput GPU-seconds": "phalanx_goodput_gpu_seconds",
    "node health": "phalanx_nodes",
    "checkpoint commit latency": "phalanx_checkpoint_commit_seconds_bucket",
}


# ---- reading the dashboard ---------------------------------------------------------------------------------------


@dataclass
class Query:
    """What one PromQL expression reads: metric names, and per name the labels it needs and the label values its
    equality matchers name (label -> values); `rated`: the names read through rate()/increase()."""

    expr: str
    metrics: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    values: dict[str, dict[str, set[str]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(set)))
    rated: set[str] = field(default_factory=set)


_IDENT = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_SELECTOR = re.compile(rf"(?<![\w:.])({_IDENT})?\s*\{{([^}}]*)\}}")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_TOKEN = re.compile(rf"(?<![\w:.$])({_IDENT})(\s*\()?")
_LITERAL_ALTERNATIVES = re.compile(r"[\w.-]+(\|[\w.-]+)*")


def parse_promql(expr: str) -> Query:
    """The metrics, labels and label values of `expr`. A selector's matchers belong to its metric; the labels of
    `by (...)`, `on (...)` and the like to every metric of the expression (the dashboard groups one metric family
    per expression, so that this holds)."""
    q = Query(expr)
    s = re.sub(r"\[[^\]]*\]", " ", expr)  # range and subquery durations ([5m], [$__rate_interval])
    selectors: list[tuple[str, str]] = []

    def take_selector(m: re.Match) -> str:
        selectors.append((m.group(1) or "", m.group(2)))
        return f" {m.group(1) or ''} "

    s = _SELECTOR.sub(take_selector, s)
    grouping: set[str] = set()
    for m in _GROUPING.finditer(s):
        grouping |= {label.strip() for label in m.group(2).split(",") if label.strip()}
    s = _GROUPING.sub(" ", s)
    s = re.sub(r'"(?:[^"\\]|\\.)*"', " ", s)  # string arguments (label_replace, count_values)
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)  # Grafana variables outside strings
    for m in _TOKEN.finditer(s):
        name, call = m.group(1), m.group(2)
        if call or name in KEYWORDS or name in AGGREGATIONS:
            continue
        q.metrics.add(name)
    for m in re.finditer(rf"\b(?:{'|'.join(RATE_FUNCTIONS)})\s*\(\s*({_IDENT})", s):
        q.rated.add(m.group(1))
    for name, body in selectors:
        if not name:  # {__name__="..."}: not used by this dashboard
            raise AssertionError(f"a selector without a metric name in {expr!r}")
        for label, op, value in _MATCHER.findall(body):
            q.labels[name].add(label)
            if op in ("=", "=~") and "$" not in value and _LITERAL_ALTERNATIVES.fullmatch(value):
                q.values[name][label] |= set(value.split("|"))
    for name in q.metrics:
        q.labels[name] |= grouping
    return q


def parse_label_values(query: str) -> Query:
    """A Grafana `label_values(metric{...}, label)` (or `label_values(label)`) variable query."""
    m = re.fullmatch(r"\s*label_values\s*\((.*)\)\s*", query)
    assert m, f"not a label_values() query: {query!r}"
    head, _, label = m.group(1).rpartition(",")
    label = label.strip()
    if not head.strip():
        return Query(query)  # any metric with that label: nothing to check
    q = parse_promql(head)
    for name in q.metrics:
        q.labels[name].add(label)
    return q


def all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(all_panels(panel.get("panels", [])))
    return out


def dashboard_queries(dash: dict) -> list[Query]:
    queries = []
    for panel in all_panels(dash["panels"]):
        for target in panel.get("targets", []):
            assert target.get("expr"), f"panel {panel['title']!r} has a target without a PromQL expression"
            queries.append(parse_promql(target["expr"]))
    for var in dash.get("templating", {}).get("list", []):
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        assert query.strip().startswith("label_values"), f"variable {var['name']}: {query!r}"
        queries.append(parse_label_values(query))
    return queries


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_promql_reader_finds_metrics_labels_and_values():
    q = parse_promql('histogram_quantile(0.99, sum by (le) (rate(phalanx_x_seconds_bucket{a="1"}[$__rate_interval])))')
    assert q.metrics == {"phalanx_x_seconds_bucket"} and q.rated == {"phalanx_x_seconds_bucket"}
    assert q.labels["phalanx_x_seconds_bucket"] == {"le", "a"} and q.values["phalanx_x_seconds_bucket"]["a"] == {"1"}
    q = parse_promql(
        'sum(max by (state, health) (phalanx_nodes)) - (sum(phalanx_nodes{state="READY", health=~"A|B"}) or '
        'vector(0)) / max(phalanx_other{q=~"$queue"}) * 1e3'
    )
    assert q.metrics == {"phalanx_nodes", "phalanx_other"} and not q.rated
    assert q.labels["phalanx_nodes"] == {"state", "health"}
    assert q.values["phalanx_nodes"] == {"state": {"READY"}, "health": {"A", "B"}}
    assert "q" in q.labels["phalanx_other"] and "q" not in q.values["phalanx_other"]
    q = parse_label_values("label_values(phalanx_queue_pending_jobs, queue)")
    assert q.metrics == {"phalanx_queue_pending_jobs"} and q.labels["phalanx_queue_pending_jobs"] == {"queue"}


def test_the_dashboard_is_valid_with_unique_ids_and_a_datasource_on_every_panel(dashboard):
    assert dashboard["uid"] == "phalanx-overview" and "Phalanx" in dashboard["title"]
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    panels = all_panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, p["title"]
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["type"] in ("timeseries", "stat", "bargauge", "gauge", "table") and p["targets"], p["title"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == DATASOURCE_UID, v["name"]
    # every Grafana variable a query names is defined
    text = json.dumps([t["expr"] for p in panels for t in p.get("targets", [])])
    used = set(re.findall(r"\$\{?(\w+)", text)) - {"__rate_interval", "__interval", "__range"}
    assert used <= variables.keys(), used - variables.keys()
    queried = set().union(*(q.metrics for q in dashboard_queries(dashboard)))
    missing = {topic: name for topic, name in REQUIRED.items() if name not in queried}
    assert not missing, f"the dashboard does not cover {missing}"


def test_a_label_set_that_drops_out_reads_zero():
    registry = CollectorRegistry()
    gauge = Gauge("phalanx_test_depth", "test", ["queue"], registry=registry)
    metrics.set_groups(gauge, {("a",): 3, ("b",): 1})
    metrics.set_groups(gauge, {("b",): 2})
    assert registry.get_sample_value("phalanx_test_depth", {"queue": "a"}) == 0
    assert registry.get_sample_value("phalanx_test_depth", {"queue": "b"}) == 2


# ---- the services' /metrics --------------------------------------------------------------------------------------


def free_port() -> int:
    return reserved_port()


@dataclass
class Exposition:
    """One /metrics page: per sample name its family's type, the label names and label values of its samples,
    and the sum of its samples' values."""

    types: dict[str, str] = field(default_factory=dict)
    declared: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    values: dict[str, dict[str, set[str]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(set)))
    totals: dict[tuple[str, tuple], float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Exposition:
        e = cls()
        for family in text_string_to_metric_families(text):
            e.declared.add(family.name)
            for sample in family.samples:
                e.types[sample.name] = family.type
                e.labels[sample.name] |= set(sample.labels)
                for label, value in sample.labels.items():
                    e.values[sample.name][label].add(value)
                e.totals[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return e

    def value(self, name: str, **labels: str) -> float | None:
        return self.totals.get((name, tuple(sorted(labels.items()))))

    def merge(self, other: Exposition) -> Exposition:
        out = Exposition(dict(self.types), self.declared | other.declared)
        for src in (self, other):
            out.types.update(src.types)
            for name, labels in src.labels.items():
                out.labels[name] |= labels
            for name, by_label in src.values.items():
                for label, values in by_label.items():
                    out.values[name][label] |= values
        return out


def problems(queries: list[Query], page: Exposition) -> list[str]:
    """What the dashboard queries that the page does not export: a name with no series, a label no series of it
    has, a label value no series of it has, a rate() over a gauge."""
    out = []
    for q in queries:
        for name in sorted(q.metrics):
            if name not in page.types:
                declared = any(name.startswith(family) for family in page.declared)
                out.append(f"{name}: {'declared but no series yet' if declared else 'not exported'} ({q.expr})")
                continue
            missing = q.labels[name] - page.labels[name] - TARGET_LABELS
            if missing:
                out.append(f"{name}: no series has label(s) {sorted(missing)} ({q.expr})")
            for label, values in q.values[name].items():
                absent = values - page.values[name][label]
                if absent:
                    out.append(f"{name}: no series has {label} in {sorted(absent)} ({q.expr})")
            if name in q.rated and page.types[name] not in ("counter", "histogram", "summary"):
                out.append(f"{name}: rate() over a {page.types[name]} ({q.expr})")
    return out


def scrape(port: int) -> Exposition:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return Exposition.parse(reply.read().decode())


async def test_every_metric_the_dashboard_queries_is_exported_by_the_services(dashboard, db_url, tmp_path):
    queries = dashboard_queries(dashboard)
    sched_metrics, coord_metrics, coord_port = free_port(), free_port(), free_port()

    def scheduler() -> ServiceProcess:
        args = ["--db", db_url, "--listen", "127.0.0.1:0", "--metrics-port", str(sched_metrics)]
        return ServiceProcess("services.scheduler.main", args, tmp_path / "scheduler.log")

    def coordinator() -> ServiceProcess:
        args = ["--db", db_url, "--listen", f"127.0.0.1:{coord_port}", "--metrics-port", str(coord_metrics)]
        return ServiceProcess(
            "services.checkpoint_coordinator.main",
            args,
            tmp_path / "checkpointd.log",
            announce="checkpoint coordinator at",
        )

    procs: list[ServiceProcess] = []
    agent = channel = None
    try:
        procs.append(await asyncio.to_thread(scheduler))
        procs.append(await asyncio.to_thread(coordinator))
        agent = LiteAgent(procs[0].address, "node-0", gpus=8)
        await agent.start()
        channel = grpc.aio.insecure_channel(procs[0].address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        spec = scheduler_pb2.QueueSpec(name="research")
        spec.quotas.add(flavor="*", gpus=4)
        await stub.SetQueue(scheduler_pb2.SetQueueRequest(spec=spec))

        async def submit(name: str) -> common_pb2.Job:
            job = common_pb2.JobSpec(
                name=name, replicas=2, gpus_per_replica=2, procs_per_replica=1, command=["run"], queue="research"
            )
            return await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=job, request_id=name))

        running = await submit("trainer")
        waiting = await submit("waiter")  # beyond the queue's 4 GPUs: stays pending
        deadline = time.monotonic() + 15
        while (job := await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=running.id))).state != (
            common_pb2.JOB_STATE_RUNNING
        ):
            assert time.monotonic() < deadline, f"the job did not start: {job.state} {job.message}"
            await asyncio.sleep(0.05)
        assert (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=waiting.id))).state == common_pb2.JOB_STATE_PENDING

        def save(rank: int) -> bool:
            env = {
                "PHALANX_JOB_ID": running.id,
                "PHALANX_ATTEMPT": str(job.attempt),
                "WORLD_SIZE": "2",
                "RANK": str(rank),
                "PHALANX_CHECKPOINT_ADDR": f"127.0.0.1:{coord_port}",
                "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            }
            ckpt = Checkpointer(env, timeout=10.0)
            try:
                return ckpt.save(1, {"step": 1, "rank": rank}).committed
            finally:
                ckpt.close()

        assert not await asyncio.to_thread(save, 0)
        assert await asyncio.to_thread(save, 1)  # the last rank's shard commits it

        # The scheduler refreshes its gauges at most twice a second and goodput every 10 s: scrape until every
        # queried series is there.
        deadline = time.monotonic() + 15
        while True:
            sched, coord = await asyncio.gather(
                asyncio.to_thread(scrape, sched_metrics), asyncio.to_thread(scrape, coord_metrics)
            )
            found = problems(queries, sched.merge(coord))
            ready = (
                sched.value("phalanx_queue_pending_jobs", queue="research") == 1
                and sched.value("phalanx_tenant_gpus_allocated", tenant="-") == 4
                and sched.value("phalanx_nodes", state="READY", health="HEALTHY") == 1
            )
            if (not found and ready) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert not found, "the dashboard queries what /metrics does not export:\n" + "\n".join(found)
        assert ready, "the scheduler's gauges by queue, tenant and node state do not show the workload"
        # the coordinator observed the commit, from the first rank's begin to the last rank's shard
        assert coord.value("phalanx_checkpoint_commit_seconds_count") == 1
        assert 0 < (coord.value("phalanx_checkpoint_commit_seconds_sum") or 0) < 10
    finally:
        if channel is not None:
            await channel.close()
        if agent is not None:
            await agent.stop()
        for proc in reversed(procs):
            await asyncio.to_thread(proc.terminate)
