"""Channels with a bearer token and optional (mutual) TLS, for the SDK, the node agent and phalanx.train.

A target may name several scheduler replicas, comma-separated (``host1:port,host2:port``, as
``PHALANX_SCHEDULER`` may): the channel then uses the first that answers and fails over to the next when it
becomes unreachable (gRPC's pick_first over the list; see :func:`channel_target`).

Environment: ``PHALANX_TOKEN`` (the client's token), ``PHALANX_TLS_CA`` (trust this CA: the channel uses TLS),
``PHALANX_TLS_CERT`` and ``PHALANX_TLS_KEY`` (this client's certificate, for mutual TLS).

Retries of UNAVAILABLE are gRPC's own (``open_channel(..., retries=N)``: a ``retryPolicy`` in the channel's service
config, built by :func:`retry_service_config`), not loops around the calls; see :func:`retry_options` for what
gRPC does and does not retry.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import os
import random
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

_Req = TypeVar("_Req")  # what an interceptor passes on: a request message, or a streaming call's request iterator
_Call = TypeVar("_Call")  # what the continuation returns: the call (a future), or the response iterator

__all__ = [
    "TLSConfig",
    "resolve_token",
    "resolve_tls",
    "open_channel",
    "open_aio_channel",
    "auth_metadata",
    "channel_target",
    "retry_service_config",
    "retry_options",
    "effective_retries",
    "MAX_RETRIES",
    "BACKOFF_INITIAL",
    "BACKOFF_MAX",
    "backoff_delay",
]

ENV_TOKEN = "PHALANX_TOKEN"
ENV_TLS_CA = "PHALANX_TLS_CA"
ENV_TLS_CERT = "PHALANX_TLS_CERT"
ENV_TLS_KEY = "PHALANX_TLS_KEY"


@dataclass(frozen=True)
class TLSConfig:
    """PEM files: the CA that signed the server's certificate, and this client's own certificate and key."""

    ca: str
    cert: str = ""
    key: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        ca = Path(self.ca).read_bytes() if self.ca else None
        cert = Path(self.cert).read_bytes() if self.cert else None
        key = Path(self.key).read_bytes() if self.key else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def resolve_token(token: str | None) -> str:
    """The argument, else ``$PHALANX_TOKEN``, else "" (no credential)."""
    return (token if token is not None else os.environ.get(ENV_TOKEN, "")).strip()


def resolve_tls(ca: str | None = None, cert: str | None = None, key: str | None = None) -> TLSConfig | None:
    """TLS settings from the arguments, else ``$PHALANX_TLS_CA/CERT/KEY``; None (plaintext) without a CA."""
    ca = ca or os.environ.get(ENV_TLS_CA, "")
    cert = cert or os.environ.get(ENV_TLS_CERT, "")
    key = key or os.environ.get(ENV_TLS_KEY, "")
    if not ca:
        return None
    if bool(cert) != bool(key):
        raise ValueError("a TLS client certificate needs both its certificate and its key")
    return TLSConfig(ca, cert, key)


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


# grpcio ships no type information (no py.typed, no stubs installed), so mypy sees its classes as Any: this module
# may subclass them (pyproject.toml turns disallow_subclassing_any off for it alone).
class _Details(
    collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _SyncAuth(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._md = auth_metadata(token)

    def _details(self, d: grpc.ClientCallDetails) -> _Details:
        return _Details(
            d.method,
            d.timeout,
            [*(d.metadata or ()), *self._md],
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, _Req], _Call],
        client_call_details: grpc.ClientCallDetails,
        request: _Req,
    ) -> _Call:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.ClientCallDetails, _Req], _Call],
        client_call_details: grpc.ClientCallDetails,
        request: _Req,
    ) -> _Call:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, _Req], _Call],
        client_call_details: grpc.ClientCallDetails,
        request_iterator: _Req,
    ) -> _Call:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(
        self,
        continuation: Callable[[grpc.ClientCallDetails, _Req], _Call],
        client_call_details: grpc.ClientCallDetails,
        request_iterator: _Req,
    ) -> _Call:
        return continuation(self._details(client_call_details), request_iterator)


def _aio_details(d: grpc.aio.ClientCallDetails, md: Sequence[tuple[str, str]]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()))
    for k, v in md:
        metadata.add(k, v)
    return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._md = auth_metadata(token)

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, _Req], Awaitable[_Call]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: _Req,
    ) -> _Call:
        return await continuation(_aio_details(client_call_details, self._md), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._md = auth_metadata(token)

    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, _Req], Awaitable[_Call]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: _Req,
    ) -> _Call:
        return await continuation(_aio_details(client_call_details, self._md), request)


def _split_host_port(entry: str) -> tuple[str, str]:
    if entry.startswith("["):  # [v6]:port
        host, _, port = entry[1:].partition("]")
        return host, port.lstrip(":")
    host, _, port = entry.rpartition(":")
    return host, port


def channel_target(target: str) -> tuple[str, list[tuple[str, Any]]]:
    """A gRPC target (and channel options) for `target`; a comma-separated list of host:port becomes one channel
    over all of them, ``ipv4:a:p,b:p`` (or ``ipv6:``), whose default pick_first policy uses the first address
    that connects and moves on when it fails. Host names are resolved here, once. A single address is kept as is.
    """
    entries = [t.strip() for t in target.split(",") if t.strip()]
    if len(entries) <= 1:
        return (entries[0] if entries else target), []
    addresses: list[tuple[int, str]] = []
    for entry in entries:
        host, port = _split_host_port(entry)
        if not port.isdigit():
            raise ValueError(f"scheduler address {entry!r} must be host:port")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except OSError:
                continue  # unresolvable now: the other replicas still serve
            ip = ipaddress.ip_address(infos[0][4][0])
        addresses.append((ip.version, f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"))
    if not addresses:
        return entries[0], []
    version = addresses[0][0]
    same = [a for v, a in addresses if v == version]  # one URI holds one address family
    options: list[tuple[str, Any]] = []
    first_host, first_port = _split_host_port(entries[0])
    try:
        ipaddress.ip_address(first_host)
    except ValueError:  # keep the name as the authority (TLS checks the certificate against it)
        options.append(("grpc.default_authority", f"{first_host}:{first_port}"))
    return f"ipv{version}:" + ",".join(same), options


# Every channel has message size limits (the servers' too: services/common/server.py), unless the caller set them.
MESSAGE_LIMITS = (
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
)


def _with_limits(options: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    given = {key for key, _ in options}
    return [*options, *(item for item in MESSAGE_LIMITS if item[0] not in given)]


# -- retries: gRPC's retry policy ---------------------------------------------------------------------------------

# gRPC core caps retryPolicy.maxAttempts at 5 (MAX_MAX_RETRY_ATTEMPTS in src/core/client_channel/
# retry_service_config.cc; grpcio 1.85 has no channel argument to raise it: a larger value is clamped, with an
# error line in the log). So a call is retried at most 4 times; more is clamped here, without that log line.
MAX_ATTEMPTS = 5
MAX_RETRIES = MAX_ATTEMPTS - 1
RETRY_INITIAL_BACKOFF = 0.1
RETRY_MAX_BACKOFF = 2.0
RETRY_BACKOFF_MULTIPLIER = 2.0
_GRPC_JITTER = 0.2  # gRPC's retry backoff jitter: each delay is its nominal value +-20%


def effective_retries(retries: int) -> int:
    """The retries gRPC will make for `retries` asked: 0 for <= 0, at most :data:`MAX_RETRIES` (4)."""
    return min(MAX_RETRIES, max(0, int(retries)))


def _duration(seconds: float) -> str:
    return f"{max(seconds, 0.001):.3f}s"  # a protobuf JSON Duration; gRPC wants it > 0


def retry_service_config(
    retries: int,
    *,
    initial_backoff: float = RETRY_INITIAL_BACKOFF,
    max_backoff: float = RETRY_MAX_BACKOFF,
    multiplier: float = RETRY_BACKOFF_MULTIPLIER,
    budget: float | None = None,
) -> str | None:
    """The JSON service config that makes gRPC retry UNAVAILABLE `retries` times (clamped to 0..4, see
    :data:`MAX_RETRIES`) on every method of the channel, or None for no retries.

    The n-th retry waits ``min(max_backoff, initial_backoff * multiplier**(n-1))``, +-20% (gRPC's jitter). With a
    `budget` (the calls' deadline, in seconds, which covers every attempt) the backoffs are scaled down so that
    they add up to at most half of it: the last attempt then still fits in the deadline, and a call that keeps
    failing ends with its UNAVAILABLE rather than a DEADLINE_EXCEEDED.
    """
    retries = effective_retries(retries)
    if retries == 0:
        return None
    waits = [min(max_backoff, initial_backoff * multiplier**n) for n in range(retries)]
    worst = sum(waits) * (1 + _GRPC_JITTER)
    if budget is not None and budget > 0 and worst > budget / 2:
        scale = budget / 2 / worst
        initial_backoff, max_backoff = initial_backoff * scale, max_backoff * scale
    policy = {
        "maxAttempts": retries + 1,
        "initialBackoff": _duration(initial_backoff),
        "maxBackoff": _duration(max(max_backoff, initial_backoff)),
        "backoffMultiplier": multiplier,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    # An empty name is the channel's default method config: every service and method on it.
    return json.dumps({"methodConfig": [{"name": [{}], "retryPolicy": policy}]})


BACKOFF_INITIAL = 0.1  # seconds: the first pause before a watch re-opens a stream that broke, then doubling
BACKOFF_MAX = 2.0


def backoff_delay(attempt: int, initial: float = BACKOFF_INITIAL, cap: float = BACKOFF_MAX) -> float:
    """Exponential backoff with jitter: about ``initial * 2**attempt``, capped, scaled by a random 0.5..1 (the pause
    before a watch re-opens a stream that broke; single calls are retried by gRPC's policy)."""
    growth: float = 2**attempt  # int ** int is typed Any: an int, or a float for a negative attempt
    return min(cap, initial * growth) * random.uniform(0.5, 1.0)


def retry_options(
    retries: int, *, budget: float | None = None, backoff: tuple[float, float] | None = None
) -> list[tuple[str, Any]]:
    """Channel options for :func:`retry_service_config` (``grpc.service_config``; none for 0 retries), with
    `backoff` = (initial, max) seconds (default 0.1, 2) and the deadline `budget`.

    What gRPC then does (grpcio 1.85, gRFC A6): a call that fails with UNAVAILABLE, including a connection
    refused or a pick while every address is down, is sent again after the backoff, to whatever address the
    channel picks then (with a replica list, pick_first's next one once the first is down), with the same
    request message and metadata (each retry adds ``grpc-previous-rpc-attempts``): an idempotency key in the
    request (SubmitJob's request_id) is the same in every attempt. The
    call's deadline covers every attempt. A call is retried only until the server has sent response headers
    or a message (gRPC then commits to that attempt): a streaming call (WatchJobs) is retried when opening it
    fails, never once its stream has delivered; reconnecting a live stream is the caller's session logic. A
    request larger than the channel's retry buffer (``grpc.per_rpc_retry_buffer_size``, 256 KiB) is not
    retried. The config also turns off service configs from DNS (``grpc.service_config_disable_resolution``),
    so this policy is the one that applies; ``grpc.enable_retries`` is set to 1 (gRPC's default).
    """
    initial, cap = backoff or (RETRY_INITIAL_BACKOFF, RETRY_MAX_BACKOFF)
    config = retry_service_config(retries, initial_backoff=initial, max_backoff=cap, budget=budget)
    if config is None:
        return []
    return [("grpc.enable_retries", 1), ("grpc.service_config", config), ("grpc.service_config_disable_resolution", 1)]


def _channel_options(
    options: Sequence[tuple[str, Any]],
    extra: list[tuple[str, Any]],
    retries: int | None,
    budget: float | None,
    backoff: tuple[float, float] | None,
) -> list[tuple[str, Any]]:
    merged = [*options, *extra]
    if retries is not None:
        given = {key for key, _ in merged}
        merged += [item for item in retry_options(retries, budget=budget, backoff=backoff) if item[0] not in given]
    return _with_limits(merged)


def open_channel(
    target: str,
    options: Sequence[tuple[str, Any]] = (),
    *,
    token: str = "",
    tls: TLSConfig | None = None,
    retries: int | None = None,
    retry_budget: float | None = None,
    retry_backoff: tuple[float, float] | None = None,
) -> grpc.Channel:
    """A blocking channel to `target` sending `token` (if any) on every call, over TLS when `tls` is given.
    `target` may list several replicas, comma-separated (:func:`channel_target`).

    `retries`: gRPC retries every call on the channel that fails with UNAVAILABLE this many times (clamped to
    0..4), `retry_backoff` = (initial, max) seconds apart (default 0.1, 2; doubling), scaled down to fit half
    of `retry_budget` (the calls' deadline) when given: :func:`retry_service_config`, :func:`retry_options`.
    None (the default) leaves the channel without a retry policy. Options the caller gives take precedence."""
    target, extra = channel_target(target)
    options = _channel_options(options, extra, retries, retry_budget, retry_backoff)
    if tls is not None:
        channel = grpc.secure_channel(target, tls.credentials(), options=list(options))
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    return grpc.intercept_channel(channel, _SyncAuth(token)) if token else channel


def open_aio_channel(
    target: str,
    options: Sequence[tuple[str, Any]] = (),
    *,
    token: str = "",
    tls: TLSConfig | None = None,
    retries: int | None = None,
    retry_budget: float | None = None,
    retry_backoff: tuple[float, float] | None = None,
) -> grpc.aio.Channel:
    """The asyncio counterpart of :func:`open_channel`."""
    target, extra = channel_target(target)
    options = _channel_options(options, extra, retries, retry_budget, retry_backoff)
    interceptors = [_AioUnaryUnary(token), _AioUnaryStream(token)] if token else None
    if tls is not None:
        return grpc.aio.secure_channel(target, tls.credentials(), options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
