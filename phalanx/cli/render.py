"""Human-readable output of the ``phalanx`` CLI: aligned tables, job details, watch lines, and JSON."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from phalanx.client import CheckpointResult, Goodput, GoodputReport, Job, Node
from phalanx.core.preemption import priority_name
from phalanx.core.resources import describe, format_cpus, human_size

from .graph_render import array_cell, graph_lines, table_state

__all__ = [
    "table",
    "format_age",
    "format_time",
    "job_nodes",
    "job_service",
    "jobs_table",
    "JobsTableStream",
    "next_page_hint",
    "jobs_json_stream",
    "nodes_table",
    "job_detail",
    "goodput_unit",
    "format_gpu_time",
    "goodput_report",
    "checkpoint_result",
    "watch_line",
    "to_json",
]


def to_json(obj: Any, *, lines: bool = False) -> str:
    """Serialise a result for ``--json``: indented, or one compact line (``lines=True``, for JSON lines)."""
    if lines:
        return json.dumps(obj, separators=(",", ":"), sort_keys=False)
    return json.dumps(obj, indent=2, sort_keys=False)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Render rows as a left-aligned table with two spaces between columns (no trailing spaces).

    Args:
        headers: Column titles.
        rows: One sequence of cells per row; cells are turned into strings.

    Returns:
        The table, lines joined with newlines, without a final newline.
    """
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def format_age(seconds: float) -> str:
    """Compact age: ``42s``, ``5m``, ``3h``, ``2d``; ``-`` for a negative or unknown age."""
    if seconds < 0:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def format_time(ts: float) -> str:
    """A unix time as ISO 8601 UTC (seconds), or ``-`` when 0 (never)."""
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def job_nodes(job: Job, limit: int = 3) -> str:
    """Distinct nodes of a job's allocations (a running job's), at most ``limit`` named then ``+N``; ``-`` when none
    (a job that is not running holds no GPUs)."""
    nodes = list(job.nodes)
    if not nodes:
        return "-"
    shown = ",".join(nodes[:limit])
    return shown if len(nodes) <= limit else f"{shown},+{len(nodes) - limit}"


JOB_COLUMNS = ("ID", "NAME", "STATE", "PRI", "GANG", "NODES", "AGE", "SERVICE")


def job_service(job: Job) -> str:
    """The SERVICE cell: ``-`` for a plain job; for a service's replica, the service, ``#index``, ``rREVISION``, and
    ``ready`` or ``not-ready`` while it runs (``llm#0 r2 ready``)."""
    if not job.service:
        return "-"
    cell = f"{job.service}#{job.service_replica} r{job.service_revision}"
    if job.state.value == "RUNNING":
        cell += " ready" if job.ready else " not-ready"
    return cell


def _job_rows(jobs: Sequence[Job], now: float | None) -> list[tuple[Any, ...]]:
    now = time.time() if now is None else now
    return [
        (
            j.id,
            j.name,
            table_state(j),
            j.priority,
            f"{j.replicas}x{j.mig_profile}"
            if j.mig_profile
            else f"{j.replicas}x{j.gpu_milli}m"
            if j.gpu_milli
            else f"{j.min_replicas}:{j.replicas}x{j.gpus_per_replica}"  # an elastic gang: MIN:MAX
            if j.min_replicas
            else f"{j.replicas}x{j.gpus_per_replica}",
            array_cell(j) or job_nodes(j),
            format_age(now - j.submitted_at) if j.submitted_at else "-",
            job_service(j),
        )
        for j in jobs
    ]


def jobs_table(jobs: Sequence[Job], now: float | None = None) -> str:
    """The ``phalanx jobs`` table: ID NAME STATE PRI GANG NODES AGE SERVICE (GANG is ``replicas x gpus``; SERVICE
    names the service a replica belongs to, see :func:`job_service`)."""
    return table(JOB_COLUMNS, _job_rows(jobs, now))


class JobsTableStream:
    """The ``phalanx jobs --all`` table, a page at a time as the pages arrive: the header with the first page, and
    columns that only widen (a later page's wider cell widens its column from there on)."""

    def __init__(self) -> None:
        self.widths = [0] * len(JOB_COLUMNS)
        self.started = False

    def page(self, jobs: Sequence[Job], now: float | None = None) -> str:
        """The page's lines (the header first, on the first page), without a final newline; "" for an empty
        page after the first."""
        cells = [["" if c is None else str(c) for c in row] for row in _job_rows(jobs, now)]
        if not self.started:
            cells.insert(0, list(JOB_COLUMNS))
            self.started = True
        for row in cells:
            self.widths = [max(w, len(c)) for w, c in zip(self.widths, row)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, self.widths)).rstrip() for row in cells)


def next_page_hint(command: str, token: str) -> str:
    """The last line of a page of ``phalanx jobs`` when more follow: the command that prints the next page."""
    return f"next page: {command} --page-token {token}"


def jobs_json_stream(pages: Iterable[Sequence[Job]]) -> Iterator[str]:
    """``phalanx jobs --all --json`` a page at a time: chunks that together are exactly
    ``to_json({"jobs": [every job's to_dict()], "next_page_token": ""})``, each page's jobs as soon as it arrives
    (nothing before the first page has arrived, so that a first call that fails prints nothing)."""
    it = iter(pages)
    head = next(it, ())
    yield '{\n  "jobs": ['
    first = True
    for jobs in itertools.chain([head], it):
        for job in jobs:
            text = to_json(job.to_dict()).replace("\n", "\n    ")
            yield ("\n    " if first else ",\n    ") + text
            first = False
    yield ("]" if first else "\n  ]") + ',\n  "next_page_token": ""\n}\n'


def nodes_table(nodes: Sequence[Node], now: float | None = None) -> str:
    """The ``phalanx nodes`` table: NAME STATE GPUS FREE CPUS MEMORY HEALTH MODEL PROFILE FABRIC HEARTBEAT MESSAGE.

    CPUS and MEMORY are the host's free and total (``free/total``; ``-`` when its agent did not report them).

    MESSAGE says why: the state's message (e.g. why a node is LOST), then the health reason of a node that is not
    HEALTHY (e.g. ``GPU 3: XID 79: GPU has fallen off the bus``), the GPUs in MIG mode (``MIG mode: GPU 7``) and the
    node's strikes (ranks its host could not set up)."""
    now = time.time() if now is None else now
    rows = [
        (
            n.name,
            n.state.value,
            n.gpus,
            n.free_gpus,
            f"{format_cpus(round(n.free_cpus * 1000))}/{format_cpus(round(n.cpus * 1000))}" if n.cpus else "-",
            f"{human_size(n.free_memory_bytes)}/{human_size(n.memory_bytes)}" if n.memory_bytes else "-",
            n.health if n.health not in ("", "UNSPECIFIED") else "-",
            n.gpu_model or "-",
            n.profile or "-",
            "/".join(n.fabric_path) or "-",
            format_age(now - n.last_heartbeat) if n.last_heartbeat else "-",
            "; ".join(
                m
                for m in (
                    n.message,
                    n.health_reason if n.health not in ("HEALTHY", "") else "",
                    f"MIG mode: GPU {','.join(map(str, n.mig_gpus))}" if n.mig_gpus else "",
                    _mig_switches(n),
                    f"{n.strikes} strike(s)" if n.strikes else "",
                )
                if m
            ),
        )
        for n in nodes
    ]
    return table(
        [
            "NAME",
            "STATE",
            "GPUS",
            "FREE",
            "CPUS",
            "MEMORY",
            "HEALTH",
            "MODEL",
            "PROFILE",
            "FABRIC",
            "HEARTBEAT",
            "MESSAGE",
        ],
        rows,
    )


def _mig_switches(n: Node) -> str:
    """MESSAGE's part on MIG mode switches (--mig-manage): the GPUs switching, and those waiting for a GPU reset."""
    switching = [str(g["index"]) for g in n.gpu_details if g.get("mig_switching")]
    pending = [f"{g['index']}->{g['mig_mode_pending']}" for g in n.gpu_details if g.get("mig_mode_pending")]
    return "; ".join(
        m
        for m in (
            f"MIG switching: GPU {','.join(switching)}" if switching else "",
            f"MIG mode after a GPU reset: GPU {', '.join(pending)}" if pending else "",
        )
        if m
    )


def _gang(job: Job) -> str:
    if job.mig_profile:
        gang = f"{job.replicas} x MIG {job.mig_profile}"
    elif job.gpu_milli:
        gang = f"{job.replicas} x {job.gpu_milli}/1000 GPU"
    else:
        gang = f"{job.replicas} x {job.gpus_per_replica} GPUs"
    host = describe(round(job.cpus_per_replica * 1000), job.memory_per_replica)
    return f"{gang}, each with {host}" if host else gang


def _alloc_gpus(a) -> str:
    """``0,1`` for whole GPUs; ``3:3g.40gb@4`` for a MIG instance (GPU:profile@start slice); ``3:250m`` for a
    share of 250 thousandths."""
    if a.slices:
        return ",".join(f"{s.gpu}:{s.profile}@{s.start}" for s in a.slices)
    if a.gpu_milli:
        return ",".join(f"{g}:{a.gpu_milli}m" for g in a.gpus)
    return ",".join(str(g) for g in a.gpus)


def job_detail(job: Job) -> str:
    """A ``key: value`` view of one job (``phalanx job``, ``submit``, ``cancel``)."""
    lines = [
        ("id", job.id),
        ("name", job.name),
        ("state", job.state.value),
        ("message", job.message or "-"),
        ("priority", job.priority),
        ("gang", _gang(job)),
        ("procs/replica", job.procs_per_replica),
        ("command", " ".join(job.command) or "-"),
        ("attempt", job.attempt),
        ("submitted", format_time(job.submitted_at)),
        ("started", format_time(job.started_at)),
        ("finished", format_time(job.finished_at)),
    ]
    if job.state.value in ("SUCCEEDED", "FAILED", "CANCELLED"):  # a running or waiting job has no exit code yet
        lines.insert(lines.index(("attempt", job.attempt)) + 1, ("exit code", job.exit_code))
    if job.gpu_model:
        lines.insert(6, ("gpu model", job.gpu_model))
    if job.service:
        readiness = ", ready" if job.ready else (", not ready" if job.state.value == "RUNNING" else "")
        lines.insert(
            2, ("service", f"{job.service}, replica {job.service_replica}, revision {job.service_revision}" + readiness)
        )
    if job.min_replicas:
        now = f"runs with {job.current_replicas}" if job.current_replicas else "not running"
        lines.insert(6, ("elastic", f"{job.min_replicas} to {job.replicas} replicas; {now}"))
    if job.failures or job.preemptions:
        lines.append(("failures", job.failures))
        lines.append(("preemptions", job.preemptions))
    if job.preempted_by == job.id:  # an elastic gang's own grow (phalanx.core.elastic)
        lines.append(
            ("growing", f"checkpointing to restart bigger, by {format_time(job.preempt_deadline)} at the latest")
        )
    elif job.preempted_by:
        lines.append(
            (
                "preempting",
                f"for {job.preempted_by}, stopped by {format_time(job.preempt_deadline)} at "
                "the latest (sooner once its checkpoint is in)",
            )
        )
    if job.claim is not None:
        c = job.claim
        where = ", ".join(c.nodes[:6]) + (f" and {len(c.nodes) - 6} more" if len(c.nodes) > 6 else "")
        lines.append(
            (
                "claim",
                f"{c.gpus} GPU(s) on {where} since {format_time(c.since)}, freed by {', '.join(c.victims) or '-'}; "
                "no gang of lower priority may take them",
            )
        )
        lines.append(("waits for", c.waits_for or "nothing: it starts at the next scheduling pass"))
    if job.not_before and job.state.value == "PENDING":
        lines.append(("retry backoff", f"until {format_time(job.not_before)}"))
    if job.restore:
        lines.append(("restore", job.restore))
    if job.struck_nodes:
        lines.append(("struck nodes", f"{', '.join(job.struck_nodes)} (avoided while it fits elsewhere)"))
    if job.segment:
        lines.append(("segments", _segments(job)))
    if job.spares_per_segment:
        lines.extend(_spares(job))
    elif job.swaps:  # a gang without spares of its own that took a spare pool's node (the last swap names the pool)
        lines.append(("swaps", f"{job.swaps}, the last at {format_time(job.last_swap_at)}: {job.last_swap}"))
    lines += graph_lines(job)
    if job.placement:
        p = job.placement
        lines.append(
            (
                "placement",
                f"tier={p.get('tier', '')} domains={p.get('domains', 0)} "
                f"score={p.get('score', 0):g} {p.get('reason', '')}".rstrip(),
            )
        )
    width = max(len(k) for k, _ in lines) + 1
    out = [f"{(k + ':').ljust(width)} {v}" for k, v in lines]
    if job.allocations:
        out.append("allocations:")
        out.extend(
            "  " + line
            for line in table(
                ["REPLICA", "NODE", "GPUS"],
                [(a.replica, a.node, _alloc_gpus(a)) for a in job.allocations],
            ).splitlines()
        )
    if job.goodput is not None:
        out.extend(_goodput_section(job.goodput))
    return "\n".join(out)


def _spares(job: Job) -> list[tuple[str, str]]:
    """``spares: 1 per segment: node-2 (nvl-0, segment 0), missing (nvl-1, segment 1)`` and the swaps made."""
    where = [f"{s.node or 'missing'} ({s.domain}, segment {s.segment})" for s in job.spares]
    out = [("spares", f"{job.spares_per_segment} per segment" + (": " + ", ".join(where) if where else ""))]
    if job.swaps:
        out.append(("swaps", f"{job.swaps}, the last at {format_time(job.last_swap_at)}: {job.last_swap}"))
    return out


def _segments(job: Job) -> str:
    """``4 x 18 replicas, each in one nvlink: nvl-0 (replicas 0-17), nvl-1 (18-35), ...`` (the domains once placed)."""
    s = job.segment
    tier = job.segment_tier or "nvlink domain (else leaf)"
    head = f"{job.replicas // s if s else 0} x {s} replicas, each in one {tier}"
    if not job.segment_domains:
        return head
    where = [f"{d} ({i * s}-{i * s + s - 1})" for i, d in enumerate(job.segment_domains)]
    return f"{head}: " + ", ".join(where)


# -- goodput -------------------------------------------------------------------------------------------------------

GOODPUT_CATEGORIES = ("allocated", "productive", "rollback", "restart", "waiting")


def goodput_unit(values: Iterable[float]) -> str:
    """``GPU-h`` when any value reaches a GPU-hour, else ``GPU-s``: one unit for a whole view."""
    return "GPU-h" if any(v >= 3600.0 for v in values) else "GPU-s"


def format_gpu_time(seconds: float, unit: str) -> str:
    """GPU-seconds in ``unit`` (``GPU-h``: two decimals; ``GPU-s``: one)."""
    return f"{seconds / 3600.0:.2f}" if unit == "GPU-h" else f"{seconds:.1f}"


def format_ratio(g: Goodput) -> str:
    """The goodput ratio as a percentage, ``-`` while nothing was allocated."""
    return f"{g.ratio * 100:.1f}%" if g.allocated > 0 else "-"


def _goodput_section(g: Goodput) -> list[str]:
    unit = goodput_unit(getattr(g, c) for c in GOODPUT_CATEGORIES)
    out = [f"goodput: {format_ratio(g)} (productive / allocated)"]
    out.extend(
        "  " + line
        for line in table(
            ["CATEGORY", unit], [(c, format_gpu_time(getattr(g, c), unit)) for c in GOODPUT_CATEGORIES]
        ).splitlines()
    )
    return out


def goodput_report(report: GoodputReport) -> str:
    """``phalanx goodput``: the cluster totals, then a table of the listed jobs (newest first)."""
    values = [getattr(report.cluster, c) for c in GOODPUT_CATEGORIES]
    values += [getattr(j.goodput, c) for j in report.jobs for c in GOODPUT_CATEGORIES]
    unit = goodput_unit(values)
    c = report.cluster
    jobs = f"{report.job_count} job{'s' if report.job_count != 1 else ''}"
    out = [f"cluster: goodput {format_ratio(c)} over {jobs} (GPU time in {unit})"]
    out.extend(
        "  " + line
        for line in table(
            [name.upper() for name in GOODPUT_CATEGORIES],
            [[format_gpu_time(getattr(c, name), unit) for name in GOODPUT_CATEGORIES]],
        ).splitlines()
    )
    for title, groups in (("TENANT", report.tenants), ("QUEUE", report.queues)):
        if not groups:
            continue
        out.append("")
        out.append(f"by {title.lower()}:")
        out.extend(
            "  " + line
            for line in table(
                [title, "JOBS", *(name.upper() for name in GOODPUT_CATEGORIES), "GOODPUT"],
                [
                    (
                        g.name or "-",
                        g.job_count,
                        *(format_gpu_time(getattr(g.goodput, name), unit) for name in GOODPUT_CATEGORIES),
                        format_ratio(g.goodput),
                    )
                    for g in groups
                ],
            ).splitlines()
        )
    if report.jobs:
        out.append("")
        out.append(
            table(
                ["ID", "NAME", "STATE", "ATTEMPTS", *(name.upper() for name in GOODPUT_CATEGORIES), "GOODPUT"],
                [
                    (
                        j.job_id,
                        j.name,
                        j.state.value,
                        j.attempts,
                        *(format_gpu_time(getattr(j.goodput, name), unit) for name in GOODPUT_CATEGORIES),
                        format_ratio(j.goodput),
                    )
                    for j in report.jobs
                ],
            )
        )
        if report.next_page_token:
            out.append(f"(more jobs: --page-token {report.next_page_token}, with the same --since)")
        elif len(report.jobs) < report.job_count:
            out.append(f"({len(report.jobs)} of {report.job_count} jobs listed; --limit N for more)")
    return "\n".join(out)


def checkpoint_result(result: CheckpointResult, asked: str | None = None) -> str:
    """``phalanx checkpoint``: what was requested, of which job, and when. ``asked``: the reason given, when an
    earlier request (with another reason) is still outstanding and kept instead."""
    job = result.job
    line = (
        f"checkpoint requested: job {job.id} ({job.name}, {job.state.value}, attempt {job.attempt}), "
        f"reason {result.reason!r}, at {format_time(result.requested_at)}"
    )
    if asked is not None and asked != result.reason:
        line += " (an earlier request, still outstanding)"
    return line


def watch_line(job: Job, now: float | None = None) -> str:
    """One line per change in ``phalanx watch``: the time the change happened (the scheduler's commit), id, name,
    state, attempt, nodes, message."""
    now = (job.changed_at or time.time()) if now is None else now
    stamp = datetime.fromtimestamp(now, tz=UTC).strftime("%H:%M:%S")
    parts = [stamp, job.id, job.name, job.state.value, f"attempt={job.attempt}", f"nodes={job_nodes(job)}"]
    if job.terminal and job.state.value != "CANCELLED":
        parts.append(f"exit_code={job.exit_code}")
    if job.message:
        parts.append(job.message)
    return " ".join(parts)


def watch_table(jobs: Sequence[Job]) -> Any:
    """``phalanx watch`` on a terminal: a rich table of the watched jobs, redrawn in place at each change."""
    from rich.table import Table

    t = Table(title="phalanx watch", title_justify="left", expand=False)
    for column in ("CHANGED", "ID", "NAME", "STATE", "ATTEMPT", "NODES", "MESSAGE"):
        t.add_column(column, overflow="fold")
    for job in jobs:
        when = datetime.fromtimestamp(job.changed_at, tz=UTC).strftime("%H:%M:%S") if job.changed_at else "-"
        t.add_row(when, job.id, job.name, job.state.value, str(job.attempt), job_nodes(job), job.message or "")
    return t


def queues_table(queues: Sequence[Any]) -> str:
    """`phalanx queue`: one block per queue: quotas and use per flavor, share, and pending jobs by position."""
    out = []
    for q in queues:
        head = (
            f"queue {q.name}" + (f" (cohort {q.cohort})" if q.cohort else "") + f", weight {q.weight:g}, "
            f"share {q.share:.1%}, {q.running} running, {len(q.pending)} pending, "
            f"priorities up to {priority_name(q.max_priority)}"
        )
        if q.tenants:
            head += f"; tenants: {', '.join(q.tenants)}"
        out.append(head)
        used = {u["flavor"]: u for u in q.usage}
        rows = []
        for quota in q.quotas:
            u = used.pop(quota["flavor"], {"gpus": 0.0, "mig_slices": 0, "borrowing": False})
            limit = "-" if quota["borrow_limit"] is None else f"{quota['borrow_limit']:g}"
            rows.append(
                [
                    quota["flavor"],
                    f"{u['gpus']:g}/{quota['gpus']:g}",
                    limit,
                    f"{u['mig_slices']}/{quota['mig_slices']}",
                    "yes" if u["borrowing"] else "",
                ]
            )
        for flavor, u in used.items():
            rows.append([flavor or "(any)", f"{u['gpus']:g}", "-", str(u["mig_slices"]), ""])
        if rows:
            out.append(
                "  "
                + table(["FLAVOR", "GPUS USED/QUOTA", "BORROW LIMIT", "MIG SLICES", "BORROWING"], rows).replace(
                    "\n", "\n  "
                )
            )
        elif not q.quotas:
            out.append("  no quota: unlimited")
        for p in q.pending:
            out.append(f"  #{p['position']:<4} {p['job_id']}  {p['name']}  priority {p['priority']}: {p['message']}")
    return "\n".join(out)
