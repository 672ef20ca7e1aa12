"""Job dependencies (Slurm's afterok / afternotok / afterany): when a dependency is met, when it never can be, what
a waiting job says, and whether a new edge would close a cycle. Pure: the servicer, the cycle and tests share it.

A dependency is a dict ``{"job_id", "condition", "met"}`` as the ledger's ``jobs.after`` JSON keeps it; ``met`` is
set once the job it names ended in a state the condition accepts, and a job waits while any is not met.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

OK, NOTOK, ANY = "ok", "notok", "any"
CONDITIONS = (OK, NOTOK, ANY)
FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
MAX_DEPENDENCIES = 64  # of one job; Slurm has no fixed limit, this keeps one submission's checks cheap

# What each condition accepts, among the final states
_ACCEPTS = {OK: frozenset({"SUCCEEDED"}), NOTOK: frozenset({"FAILED", "CANCELLED"}), ANY: frozenset(FINAL_STATES)}
_WAITS_FOR = {OK: "succeed", NOTOK: "fail", ANY: "end"}


def normalize(condition: str) -> str:
    """The condition's canonical name ("" is "ok"); ValueError for a name that is none of ok, notok, any."""
    name = condition.strip().lower() or OK
    if name not in CONDITIONS:
        raise ValueError(f"dependency condition {condition[:20]!r} must be ok, notok or any")
    return name


def outcome(condition: str, state: str) -> bool | None:
    """For a dependency on a job in `state`: True once met, False once it never can be, None while it may be."""
    if state not in FINAL_STATES:
        return None
    return state in _ACCEPTS[normalize(condition)]


def unmet(after: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The dependencies a job still waits for."""
    return [d for d in after if not d.get("met")]


def waiting_message(after: Sequence[Mapping[str, Any]]) -> str:
    """What a job held by its dependencies says ("" when none holds it)."""
    left = unmet(after)
    if not left:
        return ""
    first = left[0]
    text = f"waits for job {first['job_id']} to {_WAITS_FOR[normalize(str(first.get('condition', '')))]}"
    if len(left) > 1:
        text += f" (and {len(left) - 1} more dependencies)"
    return text


def failure_reason(job_id: str, condition: str, state: str) -> str:
    """Why a dependent job failed: its dependency ended in a state that can never meet its condition."""
    want = {OK: "succeed", NOTOK: "fail or be cancelled", ANY: "end"}[normalize(condition)]
    return (
        f"dependency_failed: job {job_id} ended {state}, and this job needed it to {want} (after{normalize(condition)})"
    )


def resolve(after: Sequence[Mapping[str, Any]], states: Mapping[str, str]) -> tuple[list[dict[str, Any]], str | None]:
    """Apply the final `states` (job id -> state) of the jobs it names to a dependency list: the list with the met
    ones marked, and the reason it can never run (None while it still can)."""
    out: list[dict[str, Any]] = []
    reason = None
    for dep in after:
        entry = dict(dep)
        state = states.get(str(dep["job_id"]))
        if not entry.get("met") and state is not None:
            verdict = outcome(str(dep.get("condition", "")), state)
            if verdict:
                entry["met"] = True
            elif verdict is False and reason is None:
                reason = failure_reason(str(dep["job_id"]), str(dep.get("condition", "")), state)
        out.append(entry)
    return out, reason


def find_cycle(start: Iterable[str], target: str, edges: Callable[[str], Iterable[str]]) -> list[str] | None:
    """A path from one of `start` back to `target` following `edges` (job -> the jobs it waits for), or None. A
    job waiting on `start` closes a cycle when such a path exists (target itself among start included)."""
    parent: dict[str, str | None] = {}
    stack: list[str] = []
    for s in start:
        if s not in parent:
            parent[s] = None
            stack.append(s)
    while stack:
        node = stack.pop()
        if node == target:
            path = [node]
            while (prev := parent[path[-1]]) is not None:
                path.append(prev)
            return path[::-1]
        for nxt in edges(node):
            if nxt not in parent:
                parent[nxt] = node
                stack.append(nxt)
    return None
