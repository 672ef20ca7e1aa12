"""The value types of the ``phalanx`` flags: durations, bounded whole numbers, CPUs, memory sizes, priorities, times,
``KEY=VALUE`` pairs and job states. A bad value is a usage error (exit code 2) that names the flag.

Shared by the command modules; it imports none of them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from datetime import UTC, datetime

from phalanx.client import JobState
from phalanx.core.preemption import parse_priority
from phalanx.core.resources import cpu_milli, parse_size

from .common import UsageError


def parse_duration(text: str) -> float:
    """Seconds from "90", "90s", "30m", "2h", "1d", "1:30" (M:SS), "1:30:00" (H:MM:SS) or "2-00:00:00" (Slurm's
    D-HH:MM:SS). ValueError with the accepted forms otherwise."""
    value = text.strip().lower()
    forms = "seconds, 30m, 2h, 1d, H:MM:SS or D-HH:MM:SS"
    try:
        if value and value[-1] in "smhd" and value[:-1].replace(".", "", 1).isdigit():
            seconds = float(value[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[value[-1]]
        elif ":" in value or "-" in value:
            days, _, clock = value.rpartition("-")
            parts = [float(p) for p in clock.split(":")]
            if len(parts) > 3 or any(p < 0 for p in parts) or (days and not days.isdigit()):
                raise ValueError
            seconds = sum(p * 60**i for i, p in enumerate(reversed(parts))) + (int(days) * 86400 if days else 0)
        else:
            seconds = float(value)
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a duration: give {forms}") from None
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{text!r}: a time limit must be more than 0 seconds")
    return seconds


def arg_type(parse):
    """An argparse `type` from a parser that raises ValueError: a bad value is a usage error (exit code 2)."""

    def convert(value: str):
        try:
            return parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


duration = arg_type(parse_duration)


MAX_KEEP_CHECKPOINTS = 10_000  # the scheduler's limit on JobSpec.keep_checkpoints


def parse_keep_checkpoints(text: str) -> int:
    """``--keep-checkpoints``: a whole number of checkpoints, 1 to 10000."""
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number of checkpoints") from None
    if not 1 <= value <= MAX_KEEP_CHECKPOINTS:
        raise ValueError(f"--keep-checkpoints must be 1 to {MAX_KEEP_CHECKPOINTS}, got {value}")
    return value


keep_checkpoints = arg_type(parse_keep_checkpoints)


def parse_cpus(text: str) -> float:
    """``--cpus-per-replica``: a count of CPUs, fractions to a thousandth (0.5, 8)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number of CPUs") from None
    if value <= 0:
        raise ValueError(f"--cpus-per-replica must be more than 0, got {text.strip()}")
    cpu_milli(value)
    return value


def parse_memory(text: str) -> str:
    """``--memory-per-replica``: a size with a binary unit (512M, 64G); sent as given, checked here first."""
    parse_size(text)
    return text.strip()


def bounded(name: str, low: int, high: int | None = None):
    """An argparse type: a whole number from `low` (to `high`), else a usage error (exit 2) naming the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"{name} takes a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"{low} to {high}" if high is not None else f"at least {low}"
            raise ValueError(f"{name} must be {bound}, got {value}")
        return value

    parse.__name__ = name
    return arg_type(parse)


def parse_replicas(text: str) -> tuple[int, int]:
    """``--replicas``: "N" (exactly N: (0, N)) or "MIN:MAX" (an elastic gang: (MIN, MAX), MIN <= MAX, both >= 1).
    ValueError naming the flag otherwise."""
    low, colon, high = text.strip().partition(":")
    try:
        values = (int(low), int(high)) if colon else (0, int(low))
    except ValueError:
        raise ValueError(f"--replicas takes a whole number N or a range MIN:MAX, got {text!r}") from None
    if not colon and values[1] < 1:
        raise ValueError(f"--replicas must be at least 1, got {values[1]}")  # (as for any whole-number flag)
    if colon and min(values) < 1:
        raise ValueError(f"--replicas MIN:MAX must both be at least 1, got {text!r}")
    if values[0] > values[1]:
        raise ValueError(f"--replicas MIN:MAX wants MIN <= MAX, got {text!r}")
    return values


replicas = arg_type(parse_replicas)

cpus = arg_type(parse_cpus)

memory = arg_type(parse_memory)

priority = arg_type(parse_priority)  # ``--priority``: an integer or a class name


def parse_env(pairs: Sequence[str] | None) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def parse_states(values: Sequence[str] | None) -> list[JobState]:
    states: list[JobState] = []
    for value in values or ():
        for part in value.split(","):
            if part.strip():
                try:
                    states.append(JobState.parse(part))
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
    return states


def parse_since(value: str | None, flag: str = "--since") -> float:
    """``--since`` (or `flag`): unix seconds, or an ISO 8601 time (UTC unless it says otherwise); None or "" is 0
    (all)."""
    if value is None or not value.strip():
        return 0.0
    text = value.strip()
    try:
        since = float(text)
    except ValueError:
        try:
            when = datetime.fromisoformat(text)  # 3.11: any ISO 8601 form, "Z" included
        except ValueError:
            raise UsageError(f"{flag} expects unix seconds or an ISO 8601 time, got {value!r}") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        since = when.timestamp()
    if not math.isfinite(since) or since < 0:
        raise UsageError(f"{flag} must be a time at or after 1970-01-01, got {value!r}")
    return since
