"""gRPC server factory: every service gets the standard health service, reflection and size limits."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 16 * 1024 * 1024

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A fresh process must be able to take over the port of one that was just killed.
    ("grpc.so_reuseport", 0),
]


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    """A request that does not parse (bad wire format, invalid UTF-8 in a string) is INVALID_ARGUMENT with a
    plain message, not grpc's UNKNOWN "Unexpected DecodeError" and a traceback in the log: the handler gets raw
    bytes and parses them itself."""

    def __init__(self) -> None:
        # The wrapped handler of each method, made once: the servicer's handler for a method never changes, and a
        # server answering thousands of agents should not build one per call.
        self._wrapped: dict[Any, Any] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:  # the same handler object (kept alive here): its wrapping
            return cached[1]
        wrapped = self._wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(handler, full_method: str):
        decode = handler.request_deserializer
        method = full_method.rsplit("/", 1)[-1]

        async def parse(raw, context):
            try:
                return decode(raw)
            except Exception as exc:  # DecodeError and friends, whatever the protobuf backend
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request: {str(exc)[:200]}")

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(raw, context):
                return await behavior(await parse(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)
        behavior = handler.unary_stream

        async def streaming(raw, context):
            request = await parse(raw, context)
            async for item in behavior(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(streaming, response_serializer=handler.response_serializer)


class AioServer:
    """A grpc.aio server with health and reflection, bound to `address` (port 0 picks a free port)."""

    def __init__(
        self,
        address: str,
        register: Sequence[Callable[[grpc.aio.Server], None]],
        service_names: Iterable[str],
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        tls=None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        """`tls`: a services.common.auth.ServerTLS (a secure port, mutual when it names a CA); None: plaintext.
        `max_message_bytes`: the largest request (and response) message; a larger one is RESOURCE_EXHAUSTED."""
        options = [
            (k, max_message_bytes if k in ("grpc.max_receive_message_length", "grpc.max_send_message_length") else v)
            for k, v in SERVER_OPTIONS
        ]
        self.server = grpc.aio.server(options=options, interceptors=[DecodeInterceptor(), *interceptors])
        for add in register:
            add(self.server)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        if tls is not None:
            self.port = self.server.add_secure_port(address, tls.credentials())
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind gRPC server to {address}")
        host = address.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float = 2.0) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)

    async def _set_all(self, status) -> None:
        for name in ["", *self.service_names]:
            result = self.health.set(name, status)
            if hasattr(result, "__await__"):
                await result
