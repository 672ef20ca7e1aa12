"""Pages of ListJobs and ListNodes: sizes, the byte budget, and the opaque page tokens.

Paging is by key, not by offset: a job page is the jobs strictly older than the previous page's last job in the
listing's order (submitted_at, id descending; index ix_jobs_submitted_at_id), a node page the nodes named after the
previous page's last node. A page costs O(page) with the index, and a job submitted between two pages (it is newer
than every listed job) never shifts an older job into a second page or out of every page.

A token is urlsafe base64 (unpadded) of a small JSON object: {"v": 1, "k": "jobs" or "nodes", "f": the filter's
digest, then the last row's key}. It is opaque to callers; the server checks every part and answers anything else
(not base64 or JSON, another version, another listing, another filter or caller) with INVALID_ARGUMENT
"invalid page token: ...", before it reads anything.

The 16 MiB message cap (services.common.server.MAX_MESSAGE_BYTES): a Job message is bounded by what SubmitJob
accepts (services.scheduler.servicer.validate_spec: command at most 4096 arguments and 256 KiB, env at most
MAX_ENV_VARS variables and 256 KiB, name 253, message and placement text a few KiB), so about 600 KiB at most, plus
its allocations. A page of 1000 such jobs would not fit, so the page size alone is no bound: every page also stops
before the job that would take it over PAGE_BYTES (8 MiB) of serialised messages, and carries a next_page_token
then, however many jobs were asked for. A page is therefore at most 8 MiB, or a single message (which the same
submit limits keep far below 16 MiB): no list call reaches the cap. Nodes use the same budget.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any, TypeVar

from google.protobuf.message import Message

from services.common.errors import InvalidArgument

DEFAULT_JOB_PAGE = 100
MAX_JOB_PAGE = 1000
DEFAULT_NODE_PAGE = 1000
MAX_NODE_PAGE = 5000
PAGE_BYTES = 8 * 1024 * 1024
TOKEN_VERSION = 1
MAX_TOKEN_CHARS = 1024
_FIELD_OVERHEAD = 6  # a repeated message field's tag and length prefix (at most 1 + 5 bytes)

M = TypeVar("M", bound=Message)


def page_size(requested: int, default: int, maximum: int) -> int:
    """The page size a request asks for (`page_size`; 0: `default`); INVALID_ARGUMENT when negative or above
    `maximum`."""
    if requested < 0:
        raise InvalidArgument(f"page_size must not be negative, got {requested}")
    if requested > maximum:
        raise InvalidArgument(f"page_size must be at most {maximum}, got {requested}")
    return requested or default


def job_page_size(requested: int, limit: int) -> int:
    """ListJobs' page size: `page_size` (0: 100, at most 1000), else the deprecated `limit` (no maximum, as before
    page_size existed; 0: the default page)."""
    if limit < 0:
        raise InvalidArgument(f"limit must not be negative, got {limit}")
    if requested == 0 and limit > 0:
        return limit
    return page_size(requested, DEFAULT_JOB_PAGE, MAX_JOB_PAGE)


def fit(messages: Sequence[M], size: int, budget: int | None = None) -> tuple[list[M], bool]:
    """The first messages that make the page: at most `size` of them, and no more than `budget` bytes serialised
    (default PAGE_BYTES; always at least one). `messages` is read with one extra row beyond `size` when the caller
    wants to know whether more follow; returns (page, more follow)."""
    budget = PAGE_BYTES if budget is None else budget
    page: list[M] = []
    total = 0
    for message in messages[:size]:
        cost = message.ByteSize() + _FIELD_OVERHEAD
        if page and total + cost > budget:
            return page, True
        page.append(message)
        total += cost
    return page, len(messages) > len(page)


def filter_digest(*parts: Any) -> str:
    """A short digest of a listing's filter (e.g. its states and the caller's tenant scope), kept in its tokens."""
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()[:16]


def encode(kind: str, digest: str, **key: Any) -> str:
    doc = {"v": TOKEN_VERSION, "k": kind, "f": digest, **key}
    raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(token: str, kind: str, digest: str) -> dict[str, Any]:
    """The key a token of listing `kind` with filter `digest` carries; INVALID_ARGUMENT for anything else."""
    if len(token) > MAX_TOKEN_CHARS:
        raise InvalidArgument(f"invalid page token: longer than {MAX_TOKEN_CHARS} characters")
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=True)
        doc = json.loads(raw)
    except (binascii.Error, ValueError):
        raise InvalidArgument("invalid page token: not a page token this server issued") from None
    if not isinstance(doc, dict) or doc.get("v") != TOKEN_VERSION or not isinstance(doc.get("k"), str):
        raise InvalidArgument("invalid page token: not a page token this server issued")
    if doc["k"] != kind:
        raise InvalidArgument(f"invalid page token: it is a token of another listing ({doc['k'][:16]!r}), not {kind}")
    if doc.get("f") != digest:
        raise InvalidArgument(
            "invalid page token: it was issued for other filters (states) or another caller; pass the filters of "
            "the first page, or start again without a page token"
        )
    return doc


def job_token(job: Any, digest: str) -> str:
    """The token of the page after `job` (a phalanx.v1.Job, the page's last)."""
    return encode("jobs", digest, t=float(job.submitted_at), id=job.id)


def decode_job_token(token: str, digest: str, kind: str = "jobs") -> tuple[float, str]:
    """(submitted_at, id) of the previous page's last job (`kind`: the listing, "jobs" or "goodput")."""
    doc = decode(token, kind, digest)
    at, job_id = doc.get("t"), doc.get("id")
    if (
        isinstance(at, bool)
        or not isinstance(at, (int, float))
        or not math.isfinite(at)
        or not isinstance(job_id, str)
        or not 0 < len(job_id) <= 32
    ):
        raise InvalidArgument("invalid page token: its position is malformed")
    return float(at), job_id


def node_token(node: Any) -> str:
    """The token of the page after `node` (a phalanx.v1.Node, the page's last)."""
    return encode("nodes", "", n=node.name)


def decode_node_token(token: str) -> str:
    """The name of the previous page's last node."""
    name = decode(token, "nodes", "").get("n")
    if not isinstance(name, str) or not 0 < len(name) <= 253:
        raise InvalidArgument("invalid page token: its position is malformed")
    return name
