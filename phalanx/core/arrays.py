"""Job arrays in Slurm's ``--array`` syntax: which task indices an array has and how many may run at once.

``"0-99"`` is the indices 0 to 99; ``"1,3,5-7"`` a list of indices and ranges; ``"0-99:2"`` every second index of
a range; a trailing ``"%8"`` allows at most 8 tasks at once (no limit without it). Indices are 0 or more and below
the scheduler's maximum array size (Slurm's MaxArraySize: 10001 by default, so 0-10000), and so is their number.
Pure: the servicer checks the syntax with it before anything is written, the cycle reads the indices back from the
array's spec when it starts tasks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_MAX_ARRAY_SIZE = 10_001  # Slurm's MaxArraySize default: indices 0-10000
MAX_SPEC_CHARS = 1024

_RANGE = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?\Z")


class ArrayError(ValueError):
    """An array spec that cannot be parsed or is over the limits; the message says why, for a person."""


@dataclass(frozen=True)
class ArraySpec:
    """A parsed array: its indices (sorted, each once), the most tasks at once (0: no limit) and the spec text."""

    indices: tuple[int, ...]
    limit: int
    text: str

    @property
    def size(self) -> int:
        return len(self.indices)


def parse_array(text: str, max_size: int = DEFAULT_MAX_ARRAY_SIZE) -> ArraySpec:
    """Parse ``text`` ("0-99%8", "1,3,5-7", "0-99:2%4"); ArrayError when it is malformed, empty, or has an index
    at or above ``max_size`` (the scheduler's --max-array-size)."""
    return _parse(text.strip(), max_size)


@lru_cache(maxsize=256)
def _parse(text: str, max_size: int) -> ArraySpec:
    if not text:
        raise ArrayError("the array spec is empty (e.g. 0-99, 1,3,5-7 or 0-99%8)")
    if len(text) > MAX_SPEC_CHARS:
        raise ArrayError(f"the array spec is {len(text)} characters; at most {MAX_SPEC_CHARS}")
    body, _, limit_text = text.partition("%")
    limit = 0
    if limit_text or text.endswith("%"):
        if not limit_text.isdigit() or int(limit_text) < 1:
            raise ArrayError(f"array {text!r}: after '%' comes the most tasks at once, a number of 1 or more")
        limit = int(limit_text)
    indices: set[int] = set()
    for item in body.split(","):
        item = item.strip()
        match = _RANGE.match(item)
        if match is None:
            raise ArrayError(
                f"array {text[:80]!r}: {item[:40]!r} is not an index, a range A-B or a stepped range A-B:S "
                "(indices are numbers of 0 or more)"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        step = int(match.group(3)) if match.group(3) is not None else 1
        if last < first:
            raise ArrayError(f"array {text[:80]!r}: range {item!r} ends before it starts")
        if step < 1:
            raise ArrayError(f"array {text[:80]!r}: the step of {item!r} must be 1 or more")
        if last >= max_size:
            raise ArrayError(
                f"array {text[:80]!r}: index {last} is over the maximum array size: indices must be 0-{max_size - 1} "
                f"(the scheduler's --max-array-size is {max_size})"
            )
        indices.update(range(first, last + 1, step))
    return ArraySpec(tuple(sorted(indices)), limit, text)


def task_name(name: str, index: int) -> str:
    """A task's job name: the array's name and its index, as Slurm shows them ("train[7]")."""
    return f"{name}[{index}]"


def task_env(array_id: str, index: int, spec: ArraySpec) -> dict[str, str]:
    """The variables each rank of a task gets: Phalanx's and, for scripts written for Slurm, its names."""
    values = {
        "ARRAY_TASK_ID": str(index),
        "ARRAY_JOB_ID": array_id,
        "ARRAY_TASK_COUNT": str(spec.size),
        "ARRAY_TASK_MIN": str(spec.indices[0]),
        "ARRAY_TASK_MAX": str(spec.indices[-1]),
    }
    return {f"{prefix}_{key}": value for prefix in ("PHALANX", "SLURM") for key, value in values.items()}
