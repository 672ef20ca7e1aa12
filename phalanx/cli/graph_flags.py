"""The job-graph flags of ``phalanx submit``: ``--after JOB[:ok|notok|any]`` (repeatable, or a comma list) and
``--array SPEC`` (Slurm's --array syntax). The scheduler checks the jobs named and the spec's limits; what is
checked here is only what a person typed."""

from __future__ import annotations

import argparse
from typing import Any

from phalanx.core.arrays import ArrayError, parse_array
from phalanx.core.dependencies import CONDITIONS

from .common import UsageError


def add_graph_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--after",
        action="append",
        default=None,
        metavar="JOB[:ok|notok|any]",
        help="start only after job JOB succeeded (ok, the default), failed or was cancelled (notok), or ended "
        "(any); repeatable, or a comma list. A dependency that can no longer be met fails this job",
    )
    p.add_argument(
        "--array",
        default=None,
        metavar="SPEC",
        help="submit an array of tasks, Slurm's syntax: 0-99 (indices), 1,3,5-7, 0-99:2 (every 2nd); %%N runs at "
        "most N at once (0-99%%8). Each task gets PHALANX_ARRAY_TASK_ID",
    )


def parse_after(values: list[str] | None) -> list[tuple[str, str]]:
    """``--after`` values as (job id, condition) pairs; UsageError for an empty id or an unknown condition."""
    out: list[tuple[str, str]] = []
    for value in values or ():
        for item in value.split(","):
            job_id, _, condition = item.strip().partition(":")
            condition = condition.strip().lower() or "ok"
            if not job_id.strip():
                raise UsageError(f"--after {value!r}: a job id is missing (JOB or JOB:ok|notok|any)")
            if condition not in CONDITIONS:
                raise UsageError(f"--after {item.strip()!r}: the condition must be ok, notok or any")
            out.append((job_id.strip(), condition))
    return out


def graph_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Client.submit`` arguments of the graph flags."""
    array = (args.array or "").strip()
    if args.array is not None:
        try:
            parse_array(array, max_size=1 << 62)  # the syntax here; the scheduler applies its --max-array-size
        except ArrayError as exc:
            raise UsageError(f"--array: {exc}") from None
    return {"after": parse_after(args.after), "array": array}
