"""Channels with a bearer token and optional (mutual) TLS, for the SDK, the node agent and phalanx.train.

A target may name several scheduler replicas, comma-separated (``host1:port,host2:port``, as
``PHALANX_SCHEDULER`` may): the channel then uses the first that answers and fails over to the next when it
becomes unreachable (gRPC's pick_first over the list; see :func:`channel_target`).

Environment: ``PHALANX_TOKEN`` (the client's token), ``PHALANX_TLS_CA`` (trust this CA: the channel uses TLS),
``PHALANX_TLS_CERT`` and ``PHALANX_TLS_KEY`` (this client's certificate, for mutual TLS).
"""

from __future__ import annotations

import collections
import ipaddress
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = ["TLSConfig", "resolve_token", "resolve_tls", "open_channel", "open_aio_channel", "auth_metadata",
           "channel_target"]

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


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _SyncAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._md = auth_metadata(token)

    def _details(self, d):
        return _Details(d.method, d.timeout, [*(d.metadata or ()), *self._md], d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def _aio_details(d, md):
    metadata = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()))
    for k, v in md:
        metadata.add(k, v)
    return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._md = auth_metadata(token)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._md), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._md = auth_metadata(token)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
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
MESSAGE_LIMITS = (("grpc.max_receive_message_length", 16 * 1024 * 1024),
                  ("grpc.max_send_message_length", 16 * 1024 * 1024))


def _with_limits(options: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    given = {key for key, _ in options}
    return [*options, *(item for item in MESSAGE_LIMITS if item[0] not in given)]


def open_channel(target: str, options: Sequence[tuple[str, Any]] = (), *, token: str = "",
                 tls: TLSConfig | None = None) -> grpc.Channel:
    """A blocking channel to `target` sending `token` (if any) on every call, over TLS when `tls` is given.
    `target` may list several replicas, comma-separated (:func:`channel_target`)."""
    target, extra = channel_target(target)
    options = _with_limits([*options, *extra])
    if tls is not None:
        channel = grpc.secure_channel(target, tls.credentials(), options=list(options))
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    return grpc.intercept_channel(channel, _SyncAuth(token)) if token else channel


def open_aio_channel(target: str, options: Sequence[tuple[str, Any]] = (), *, token: str = "",
                     tls: TLSConfig | None = None) -> grpc.aio.Channel:
    """The asyncio counterpart of :func:`open_channel`."""
    target, extra = channel_target(target)
    options = _with_limits([*options, *extra])
    interceptors = [_AioUnaryUnary(token), _AioUnaryStream(token)] if token else None
    if tls is not None:
        return grpc.aio.secure_channel(target, tls.credentials(), options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
