"""The autoscaler's inputs: a service's Autoscale message as the pure rule's policy (phalanx.core.autoscale), and
the metric values, pushed through the API (PushMetric) or scraped from each ready leader's Prometheus endpoint.

Scraping is I/O and runs off the scheduling cycle, in the controller's thread pool; the cycle never waits on a
server. A value older than `STALE_AFTER_S` is dropped, so a leader that stopped answering stops counting.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import structlog
from prometheus_client.parser import text_string_to_metric_families

from phalanx.api.v1 import service_pb2
from phalanx.core.autoscale import AutoscalePolicy

log = structlog.get_logger()

STALE_AFTER_S = 60.0
DEFAULT_DOWN_WINDOW_S = 300.0
DEFAULT_PERIOD_S = 5.0


def policy_of(a: service_pb2.Autoscale) -> AutoscalePolicy:
    """The pure rule's policy from the API's message, with HPA's defaults for what it leaves 0."""
    down = a.scale_down_window_s
    return AutoscalePolicy(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        metric=a.metric,
        target=a.target,
        tolerance=a.tolerance or 0.1,
        scale_up_window_s=max(0.0, a.scale_up_window_s),
        scale_down_window_s=DEFAULT_DOWN_WINDOW_S if down == 0 else max(0.0, down),
    )


def period_of(a: service_pb2.Autoscale) -> float:
    return a.period_s or DEFAULT_PERIOD_S


def parse_metric(text: str, metric: str) -> float | None:
    """The value of `metric` in a Prometheus text exposition: the sum over its samples (a gauge with per-model
    labels adds up); None when it is absent. vLLM's names carry a colon (`vllm:num_requests_waiting`), which the
    text format allows."""
    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric and math.isfinite(sample.value):
                total += sample.value
                seen = True
    return total if seen else None


def scrape(url: str, metric: str, timeout: float = 2.0) -> float | None:
    """GET a Prometheus endpoint and read one metric (None: unreachable, or the metric is absent)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read(4 << 20).decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        log.debug("metric_scrape_failed", url=url, error=str(exc))
        return None
    try:
        return parse_metric(body, metric)
    except ValueError as exc:
        log.info("metric_parse_failed", url=url, error=str(exc))
        return None


@dataclass
class MetricBook:
    """The latest value of each service's metric per replica (-1: the service as a whole), with when it came.
    Written by PushMetric and by scrapes, read by the controller; one lock, held only around dict updates."""

    values: dict[str, dict[int, tuple[str, float, float]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, service: str, replica: int, metric: str, value: float, at: float | None = None) -> None:
        with self.lock:
            self.values.setdefault(service, {})[replica] = (metric, value, time.time() if at is None else at)

    def forget(self, service: str) -> None:
        with self.lock:
            self.values.pop(service, None)

    def per_replica(self, service: str, metric: str, ready: list[int], now: float) -> list[float]:
        """The values the rule averages: each ready replica's own (scraped or pushed), or, for a service-wide push,
        its total spread over the ready replicas (at least one)."""
        with self.lock:
            got = dict(self.values.get(service, {}))
        fresh = {r: v for r, (m, v, at) in got.items() if m == metric and now - at <= STALE_AFTER_S}
        whole = fresh.pop(-1, None)
        if whole is not None:
            return [whole / max(1, len(ready))] * max(1, len(ready))
        return [fresh[r] for r in ready if r in fresh]
