"""Access tokens and the tokens file, shared by the services (which check tokens) and the CLI (which makes them).

The tokens file is a YAML list of entries, each naming a token by its SHA-256 (the token itself is never stored)::

    - {token_sha256: 9f86d0..., tenant: alice, role: user}
    - {token_sha256: 60303a..., tenant: ops, role: admin}
    - {token_sha256: 2c26b4..., tenant: nodes, role: node, node: gpu-017}

A `node` token names the one node it may act as (`node`); see services.common.auth for what each role may call.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger()

ROLES = ("user", "admin", "node", "service")
TOKEN_PREFIX = "phx_"
RANK_TOKEN_PREFIX = "phr_"  # a rank credential (rank_token), never in a tokens file


@dataclass(frozen=True)
class Identity:
    tenant: str
    role: str
    rate_limit: float | None = None  # submissions per second for this tenant (None: the service's default)
    max_pending: int | None = None  # PENDING jobs this tenant may have (None: the service's default)
    unix_user: str = ""  # the Unix user this tenant's ranks run as on the hosts ("": the agents' --run-as)
    node: str = ""  # role node: the one node this credential may register, heartbeat and report as
    # role rank (a rank credential, PHALANX_JOB_TOKEN): the one job and attempt it acts for
    job: str = ""
    attempt: int = 0

    @property
    def admin(self) -> bool:
        return self.role == "admin"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def _rank_mac(key: str, job_id: str, attempt: int) -> str:
    return hmac.new(bytes.fromhex(key), f"rank:{job_id}:{attempt}".encode(), hashlib.sha256).hexdigest()


def rank_token(key: str, job_id: str, attempt: int) -> str:
    """The credential of one attempt's ranks: `phr_<job>_<attempt>_<HMAC-SHA256 under the ledger's rank key>`. It
    names its job and attempt; the checkpoint coordinator checks the MAC and that the attempt is still the job's
    running one, so it expires when the attempt ends, with nothing to store or revoke."""
    return f"{RANK_TOKEN_PREFIX}{job_id}_{attempt}_{_rank_mac(key, job_id, attempt)}"


LOG_CREDENTIAL_PREFIX = "phl_"


def node_logs_key(rank_key: str, node: str) -> str:
    """The key node `node`'s agent checks log credentials with (hex): derived from the ledger's rank key, so each
    agent holds a key of its own and none can mint credentials for another node."""
    return hmac.new(bytes.fromhex(rank_key), f"logs:{node}".encode(), hashlib.sha256).hexdigest()


def log_credential(node_key: str, job_id: str, attempt: int, expires: int) -> str:
    """A credential to read one job attempt's rank logs on one node until `expires` (unix seconds)."""
    mac = hmac.new(bytes.fromhex(node_key), f"{job_id}:{attempt}:{expires}".encode(), hashlib.sha256).hexdigest()
    return f"{LOG_CREDENTIAL_PREFIX}{job_id}_{attempt}_{expires}_{mac}"


def check_log_credential(node_key: str, token: str, job_id: str, attempt: int, now: float) -> str:
    """Why `token` may not read job `job_id` attempt `attempt`'s logs on this node ('' when it may)."""
    if not node_key or not token.startswith(LOG_CREDENTIAL_PREFIX):
        return "no log credential: get one with the scheduler's GetRankLogs (phalanx logs)"
    parts = token[len(LOG_CREDENTIAL_PREFIX) :].rsplit("_", 3)
    if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():
        return "a malformed log credential"
    job, attempt_text, expires_text, mac = parts
    want = hmac.new(
        bytes.fromhex(node_key), f"{job}:{attempt_text}:{expires_text}".encode(), hashlib.sha256
    ).hexdigest()
    if not hmac.compare_digest(mac, want):
        return "a log credential of another node, or forged"
    if (job, int(attempt_text)) != (job_id, attempt):
        return f"the credential is for job {job} attempt {attempt_text}, not job {job_id[:40]} attempt {attempt}"
    if int(expires_text) < now:
        return "the log credential has expired: get a new one (phalanx logs does)"
    return ""


def verify_rank_token(key: str, token: str) -> Identity | None:
    """The identity (role `rank`, its job and attempt) of a well-signed rank credential, else None."""
    if not key or not token.startswith(RANK_TOKEN_PREFIX):
        return None
    job_id, _, rest = token[len(RANK_TOKEN_PREFIX) :].partition("_")
    attempt_text, _, mac = rest.partition("_")
    if not job_id or not attempt_text.isdigit() or len(attempt_text) > 9 or len(mac) != 64:
        return None
    attempt = int(attempt_text)
    if not hmac.compare_digest(mac, _rank_mac(key, job_id, attempt)):
        return None
    return Identity(tenant="", role="rank", job=job_id, attempt=attempt)


def token_entry(token: str, tenant: str, role: str = "user", node: str = "") -> dict[str, str]:
    """The tokens-file entry of `token` (a node token names its node)."""
    check_entry_fields(tenant, role, node)
    entry = {"token_sha256": hash_token(token), "tenant": tenant, "role": role}
    if node:
        entry["node"] = node
    return entry


def entry_line(entry: dict[str, str]) -> str:
    """One tokens-file line (YAML flow mapping) of an entry from token_entry."""
    return "- {" + ", ".join(f"{k}: {v}" for k, v in entry.items()) + "}"


_NODE_NAME = re.compile(r"[A-Za-z0-9._-]{1,253}")


def check_entry_fields(tenant: str, role: str, node: str = "") -> None:
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if not tenant or len(tenant) > 64 or any(c.isspace() or c in "\x00" for c in tenant):
        raise ValueError(f"tenant {tenant[:80]!r} must be 1-64 characters without spaces")
    if node and role != "node":
        raise ValueError(f"only a node token names a node (role {role!r} with node {node[:80]!r})")
    if node and not _NODE_NAME.fullmatch(node):
        raise ValueError(f"node {node[:80]!r} must be 1-253 letters, digits, '.', '_' or '-'")


class TokenFileError(ValueError):
    pass


def parse_tokens(text: str, source: str = "tokens file") -> dict[str, Identity]:
    """{sha256 hex: Identity} from the YAML text of a tokens file. Raises TokenFileError."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TokenFileError(f"{source}: not YAML: {exc}") from exc
    if data is None:
        data = []
    if isinstance(data, dict) and "tokens" in data:
        data = data["tokens"] or []
    if not isinstance(data, list):
        raise TokenFileError(f"{source}: expected a list of {{token_sha256, tenant, role}} entries")
    out: dict[str, Identity] = {}
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise TokenFileError(f"{source}: entry {i} is not a mapping")
        digest = str(entry.get("token_sha256", "")).strip().lower()
        tenant = str(entry.get("tenant", "")).strip()
        role = str(entry.get("role", "user")).strip()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise TokenFileError(f"{source}: entry {i}: token_sha256 must be 64 hex digits")
        try:
            check_entry_fields(tenant, role)
            rate = entry.get("rate_limit")
            pending = entry.get("max_pending")
            rate = None if rate is None else float(rate)
            pending = None if pending is None else int(pending)
            unix_user = str(entry.get("unix_user") or "").strip()
            if unix_user and not _UNIX_USER.fullmatch(unix_user):
                raise ValueError(f"unix_user {unix_user[:40]!r} is not a Unix user name")
            node = str(entry.get("node") or "").strip()
            check_entry_fields(tenant, role, node)
        except (TypeError, ValueError) as exc:
            raise TokenFileError(f"{source}: entry {i}: {exc}") from exc
        if (rate is not None and not (rate > 0 and math.isfinite(rate))) or (pending is not None and pending < 1):
            raise TokenFileError(f"{source}: entry {i}: rate_limit must be > 0 and max_pending >= 1")
        out[digest] = Identity(tenant, role, rate, pending, unix_user, node)
    return out


_UNIX_USER = re.compile(r"[a-z_][a-z0-9_.-]{0,31}\$?")


class TokenStore:
    """The tokens of one or more files, each reloaded when it changes (checked at most every `check_interval`
    seconds). Several files: e.g. the operator's, and the credentials `phalanx cluster up` makes for its own
    processes."""

    def __init__(
        self, path: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], check_interval: float = 1.0
    ) -> None:
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        self.paths = [Path(p) for p in paths]
        self.path = self.paths[0]
        self.check_interval = check_interval
        self._lock = threading.Lock()
        self._signatures: dict[Path, tuple[int, int, int]] = {}
        self._files: dict[Path, dict[str, Identity]] = {}
        for p in self.paths:  # a file that does not load at start is an error for the caller
            self._files[p] = self._load(p)
        self._tokens = self._merged()
        self._next_check = time.monotonic() + check_interval

    @staticmethod
    def _stat(path: Path) -> tuple[int, int, int]:  # (mtime ns, size, inode)
        st = path.stat()
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self, path: Path) -> dict[str, Identity]:
        try:
            signature = self._stat(path)
            text = path.read_text()
        except OSError as exc:
            raise TokenFileError(f"cannot read the tokens file {path}: {exc}") from exc
        tokens = parse_tokens(text, str(path))
        self._signatures[path] = signature
        return tokens

    def _merged(self) -> dict[str, Identity]:
        out: dict[str, Identity] = {}
        for tokens in self._files.values():
            out.update(tokens)
        return out

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        with self._lock:
            if now < self._next_check:
                return
            self._next_check = now + self.check_interval
            changed = False
            for path in self.paths:
                try:
                    if self._stat(path) == self._signatures.get(path):
                        continue
                    self._files[path] = self._load(path)
                    changed = True
                    log.info("tokens_reloaded", path=str(path), tokens=len(self._files[path]))
                except (OSError, TokenFileError) as exc:
                    log.warning("tokens_reload_failed", path=str(path), error=str(exc)[:300])
            if changed:
                self._tokens = self._merged()

    def lookup(self, token: str) -> Identity | None:
        self._maybe_reload()
        if not token:
            return None
        return self._tokens.get(hash_token(token))

    def unix_user(self, tenant: str) -> str:
        """The Unix user a tenant's ranks run as ("" when its entries name none)."""
        self._maybe_reload()
        for identity in self._tokens.values():
            if identity.tenant == tenant and identity.unix_user:
                return identity.unix_user
        return ""

    def __len__(self) -> int:
        return len(self._tokens)
