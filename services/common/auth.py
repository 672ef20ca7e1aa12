"""Authentication, authorization and per-tenant limits for the gRPC services.

Off unless configured: a service started without `--tokens FILE` accepts every call, as before.

The tokens file is a YAML list of entries, each naming a token by its SHA-256 (the token itself is never stored)::

    - {token_sha256: 9f86d0..., tenant: alice, role: user}
    - {token_sha256: 60303a..., tenant: ops, role: admin}
    - {token_sha256: 2c26b4..., tenant: node-01, role: node}
    - {token_sha256: fcde2b..., tenant: ranks, role: service, rate_limit: 50, max_pending: 5000}

Roles: `user` (the job API, its own tenant's jobs only), `admin` (every job, and cluster operations such as
draining nodes), `node` (node agents: the NodeService only) and `service` (the cluster's own processes and the
ranks it launches: the checkpoint coordinator). `rate_limit` and `max_pending` on an entry override the service's
`--rate-limit` / `--max-pending` for that entry's tenant.

Callers send `authorization: Bearer <token>` metadata. No token or an unknown one: UNAUTHENTICATED; a role the
method does not admit: PERMISSION_DENIED. The file is reloaded when it changes (its mtime, size or inode, checked
at most once a second), so tokens rotate without a restart; a removed token stops working at the next check. A file
that no longer parses is logged and the previous tokens stay in force.
"""

from __future__ import annotations

import argparse
import contextvars
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from phalanx.common.tokens import RANK_TOKEN_PREFIX, Identity, TokenStore, verify_rank_token

log = structlog.get_logger()

METADATA_KEY = "authorization"


_IDENTITY: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("phalanx_identity", default=None)


def current_identity() -> Identity | None:
    """The authenticated caller of the RPC being handled; None when authentication is off."""
    return _IDENTITY.get()


def tenant_scope() -> str | None:
    """The tenant whose jobs the caller may see: None for everything (authentication off, or an admin)."""
    ident = _IDENTITY.get()
    if ident is None or ident.admin:
        return None
    return ident.tenant


# ---- the audit trail ---------------------------------------------------------------------------------------------
# One structured log line (event `audit`, logger phalanx.audit) per admin action and per denied call, with who
# called (tenant, role), the method, the object and why. Filter the logs on event == "audit".

audit_log = structlog.get_logger("phalanx.audit")


def _who(ident: Identity | None) -> dict[str, str]:
    if ident is None:
        return {"tenant": "", "role": "none"}
    out = {"tenant": ident.tenant, "role": ident.role}
    if ident.node:
        out["node"] = ident.node
    return out


def audit_denied(method: str, obj: str, reason: str, ident: Identity | None = None, **extra: object) -> None:
    """A call refused for who made it (UNAUTHENTICATED, PERMISSION_DENIED, or NOT_FOUND hiding another tenant's
    object)."""
    who = _who(ident or current_identity())
    audit_log.warning("audit", outcome="denied", method=method, object=obj, reason=reason, **who, **extra)


def audit_admin(method: str, obj: str, detail: str = "") -> None:
    """An admin's change (a drain, a queue edit, another tenant's job cancelled, ...). Nothing when the caller is
    not an admin or authentication is off (every caller is an admin then; the services log their changes anyway)."""
    ident = current_identity()
    if ident is None or not ident.admin:
        return
    audit_log.info("audit", outcome="done", method=method, object=obj, reason=detail, **_who(ident))


# ---- authorization policy -------------------------------------------------------------------------------------

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
SCHEDULER = "/phalanx.v1.Scheduler/"
NODE_SERVICE = "/phalanx.v1.NodeService/"
SERVICES = "/phalanx.v1.ServiceService/"  # serving fleets: a user reaches only its own tenant's services
CHECKPOINT = "/phalanx.v1.CheckpointCoordinator/"
ADMIN_METHODS = frozenset(
    {
        SCHEDULER + "DrainNode",
        SCHEDULER + "UndrainNode",
        SCHEDULER + "SetQueue",
        SCHEDULER + "DeleteQueue",
        SCHEDULER + "CreatePool",
        SCHEDULER + "DeletePool",
    }
)


def allowed_roles(method: str) -> frozenset[str]:
    """Which roles may call `method` (a full gRPC method name); empty: nobody."""
    if method in ADMIN_METHODS:
        return frozenset({"admin"})
    if method.startswith(SCHEDULER) or method.startswith(SERVICES):
        return frozenset({"user", "admin"})
    if method.startswith(NODE_SERVICE):
        return frozenset({"node"})
    if method.startswith(CHECKPOINT):
        # Which jobs each may touch is the coordinator's check, call by call (its servicer's _authorize).
        return frozenset({"service", "admin", "user", "rank"})
    return frozenset()


def check_node_caller(name: str, method: str, peer_cn: str | None = None, known_nodes=()) -> None:
    """A NodeService call names `name`: its caller must be that node. A node token acts only as the node its
    tokens-file entry names (one that names none is refused: make one with `phalanx token new --role node --node
    NAME`). With mutual TLS, a client certificate whose CN is another node's name acts only as that node (a
    certificate whose CN names no node, such as a cluster-wide client certificate, leaves it to the token). Refusals
    raise PermissionDenied, after one audit line."""
    from .errors import PermissionDenied

    ident = current_identity()
    why = ""
    if ident is not None and ident.role == "node":
        if not ident.node:
            why = (
                f"this node token (tenant {ident.tenant!r}) names no node, so it may act as none: make one with "
                "`phalanx token new --role node --node NAME`"
            )
        elif ident.node != name:
            why = f"the credential of node {ident.node!r} may not act as node {name[:80]!r}"
    if not why and peer_cn and peer_cn != name and peer_cn in known_nodes:
        why = f"the TLS certificate of node {peer_cn!r} may not act as node {name[:80]!r}"
    if why:
        audit_denied(method, f"node/{name[:80]}", why)
        raise PermissionDenied(why)


def peer_common_name(context) -> str | None:
    """The CN of the caller's TLS client certificate (mutual TLS), else None."""
    try:
        names = context.auth_context().get("x509_common_name") or []
    except Exception:  # not a TLS channel, or a context without auth data
        return None
    if not names:
        return None
    value = names[0]
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key.lower() == METADATA_KEY:
            value = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = value.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def _refuse(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - an async generator

    return _same_kind(handler, unary, streaming)


def _same_kind(handler, unary_fn, stream_fn) -> grpc.RpcMethodHandler:
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_fn, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary_fn, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream_fn, **kw)
    return grpc.unary_unary_rpc_method_handler(unary_fn, **kw)


def _behavior(handler):
    return handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary


def _with_identity(handler: grpc.RpcMethodHandler, ident: Identity) -> grpc.RpcMethodHandler:
    """The handler, run with `ident` as the current identity (each RPC runs in its own task and context)."""
    behavior = _behavior(handler)

    async def unary(request, context):
        _IDENTITY.set(ident)
        return await behavior(request, context)

    async def streaming(request, context):
        _IDENTITY.set(ident)
        async for item in behavior(request, context):
            yield item

    return _same_kind(handler, unary, streaming)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call but health and reflection; sets the caller's identity for the servicer."""

    def __init__(self, store: TokenStore, rank_key: str = "") -> None:
        self.store = store
        self.rank_key = rank_key  # given: rank credentials (PHALANX_JOB_TOKEN) signed with it are accepted too

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if not token:
            audit_denied(method, "", "no credential")
            return _refuse(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                "no credential: send 'authorization: Bearer <token>' (the CLI reads $PHALANX_TOKEN)",
            )
        ident = self.store.lookup(token)
        if ident is None and self.rank_key and token.startswith(RANK_TOKEN_PREFIX):
            ident = verify_rank_token(self.rank_key, token)
        if ident is None:
            audit_denied(method, "", "unknown or revoked token")
            return _refuse(handler, grpc.StatusCode.UNAUTHENTICATED, "unknown or revoked token")
        if ident.role not in allowed_roles(method):
            why = f"role {ident.role!r} (tenant {ident.tenant!r}) may not call {method.rsplit('/', 1)[-1]}"
            audit_denied(method, "", why, ident)
            return _refuse(handler, grpc.StatusCode.PERMISSION_DENIED, why)
        return _with_identity(handler, ident)


# ---- per-tenant limits ------------------------------------------------------------------------------------------

DEFAULT_MAX_PENDING = 10_000


class TenantLimits:
    """A submission rate limit (token bucket: `rate` per second, bursts of `burst`) and a cap on PENDING jobs,
    per tenant. Either is off when None; an identity's own limits (from the tokens file) win."""

    def __init__(self, rate: float | None = None, burst: float | None = None, max_pending: int | None = None) -> None:
        self.rate = rate
        self.burst = burst
        self.max_pending = max_pending
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill)

    def enabled(self, ident: Identity | None) -> bool:
        return bool(self.rate or self.max_pending or (ident and (ident.rate_limit or ident.max_pending)))

    def pending_cap(self, ident: Identity | None) -> int | None:
        if ident is not None and ident.max_pending is not None:
            return ident.max_pending
        return self.max_pending

    def take(self, ident: Identity | None, now: float | None = None) -> float:
        """Take one submission from the caller's bucket: 0 when allowed, else seconds until one is free."""
        rate = ident.rate_limit if ident is not None and ident.rate_limit is not None else self.rate
        if not rate:
            return 0.0
        tenant = ident.tenant if ident is not None else ""
        burst = max(1.0, self.burst if self.burst is not None else rate)
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(tenant, (burst, now))
        tokens = min(burst, tokens + (now - last) * rate)
        if tokens < 1.0:
            self._buckets[tenant] = (tokens, now)
            return (1.0 - tokens) / rate
        self._buckets[tenant] = (tokens - 1.0, now)
        return 0.0


# ---- TLS --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerTLS:
    cert: str  # PEM files
    key: str
    ca: str = ""  # given: clients must present a certificate signed by this CA (mutual TLS)

    def credentials(self) -> grpc.ServerCredentials:
        cert, key = Path(self.cert).read_bytes(), Path(self.key).read_bytes()
        ca = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def server_tls(cert: str | None, key: str | None, ca: str | None) -> ServerTLS | None:
    """ServerTLS from the --tls-cert/--tls-key/--tls-ca flags; None when no certificate is given."""
    if not cert and not key:
        if ca:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together")
    for path in (cert, key, ca):
        if path and not Path(path).is_file():
            raise ValueError(f"TLS file {path} does not exist")
    return ServerTLS(cert, key, ca or "")


def add_security_flags(p: argparse.ArgumentParser, env_prefix: str) -> None:
    """--tokens and --tls-cert/--tls-key/--tls-ca, shared by the scheduler and the checkpoint coordinator."""
    env = os.environ.get(f"{env_prefix}_TOKENS")
    p.add_argument(
        "--tokens",
        action="append",
        default=[env] if env else None,
        metavar="FILE",
        help=f"authentication on: a YAML list of {{token_sha256, tenant, role}} entries (`phalanx token "
        f"new` makes them), reloaded when it changes; repeatable (env {env_prefix}_TOKENS; "
        f"default: off)",
    )
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    p.add_argument(
        "--tls-ca", default=None, metavar="PEM", help="mutual TLS: clients must present a certificate signed by this CA"
    )


def security_from_args(args: argparse.Namespace) -> tuple[TokenStore | None, ServerTLS | None]:
    """The token store and TLS settings of the flags; ValueError (TokenFileError) when they are unusable."""
    tokens = TokenStore(args.tokens) if args.tokens else None
    return tokens, server_tls(args.tls_cert, args.tls_key, args.tls_ca)
