"""Slurm hostlist expressions: `node[01-04,07],gpu-a` <-> a list of names."""

from __future__ import annotations

import re

_BRACKET = re.compile(r"\[([^\]]+)\]")


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist (`dgx[001-003,010]`, `a,b`, `rack[1-2]-n[1-2]`) into names, in order.

    Raises ValueError on a malformed expression.
    """
    names: list[str] = []
    for part in _split_top_level(expr.strip()):
        if part:
            names.extend(_expand_one(part))
    return names


def _split_top_level(expr: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append("".join(current))
    return [p.strip() for p in parts]


def _expand_one(part: str) -> list[str]:
    match = _BRACKET.search(part)
    if not match:
        return [part]
    prefix, suffix = part[: match.start()], part[match.end() :]
    out = []
    for item in match.group(1).split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"bad range {item!r} in hostlist {part!r}")
            width = len(lo)
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        else:
            if not item:
                raise ValueError(f"empty item in hostlist {part!r}")
            values = [item]
        for value in values:
            out.extend(_expand_one(prefix + value + suffix))
    return out


_NUMBERED = re.compile(r"(.*?)(\d+)\Z")


def compress_hostlist(names: list[str]) -> str:
    """The shortest Slurm hostlist of `names` this writes, in their order (`expand_hostlist` gives them back):
    consecutive names of one prefix become one bracket of ranges (`gb[001-018]`, `n[1-3,7]`)."""
    groups: list[tuple[str, list[list[str]]]] = []  # (prefix, runs as [first digits, last digits])
    for name in names:
        match = _NUMBERED.match(name)
        if match is None or "[" in name or "," in name:
            groups.append((name, []))
            continue
        prefix, digits = match.groups()
        if groups and groups[-1][1] and groups[-1][0] == prefix:
            run = groups[-1][1][-1]
            if int(digits) == int(run[1]) + 1 and str(int(digits)).zfill(len(run[0])) == digits:
                run[1] = digits
            else:
                groups[-1][1].append([digits, digits])
        else:
            groups.append((prefix, [[digits, digits]]))
    out = []
    for prefix, runs in groups:
        if not runs:
            out.append(prefix)
        elif len(runs) == 1 and runs[0][0] == runs[0][1]:
            out.append(prefix + runs[0][0])
        else:
            out.append(prefix + "[" + ",".join(lo if lo == hi else f"{lo}-{hi}" for lo, hi in runs) + "]")
    return ",".join(out)
