"""How ``phalanx jobs`` and ``phalanx job`` show job graphs: an array as one line with its tasks' progress (its
tasks listed with ``--expand``), and a job's dependencies and array."""

from __future__ import annotations

from collections.abc import Sequence

from phalanx.client import Job

_WAITS = {"ok": "to succeed", "notok": "to fail", "any": "to end"}


def group_arrays(jobs: Sequence[Job], expand: bool) -> list[Job]:
    """The jobs of a table: an array's tasks are left out (its own line sums them up) unless `expand`."""
    return list(jobs) if expand else [j for j in jobs if not j.array_parent]


def table_state(job: Job) -> str:
    """The STATE cell: an array whose tasks run shows RUNNING (its own row stays PENDING until they all end)."""
    if job.array is not None and job.state.value == "PENDING" and job.array.active:
        return "RUNNING"
    return job.state.value


def array_cell(job: Job) -> str:
    """The NODES cell of an array's line: its progress ("20 tasks: 3 running, 10 done, 7 waiting"); "" otherwise."""
    return job.array.summary() if job.array is not None else ""


def graph_lines(job: Job) -> list[tuple[str, str]]:
    """The ``key: value`` lines of ``phalanx job`` about its dependencies and its array."""
    lines: list[tuple[str, str]] = []
    if job.after:
        pending = {d.job_id for d in job.waiting_for}
        lines.append(
            (
                "after",
                ", ".join(
                    f"{d.job_id}:{d.condition} ({'waiting' if d.job_id in pending else 'met'})" for d in job.after
                ),
            )
        )
    if job.array is not None:
        lines.append(("array", f"{job.array_spec}: {job.array.summary()}"))
    if job.array_parent:
        lines.append(("array task", f"{job.array_task} of array {job.array_parent}"))
    return lines
