"""What :class:`DSpineClient` and :class:`AsyncDSpineClient` share: options, the channel, call metadata,
the stub method of a call and the retry state of each call. The two faces only call and sleep."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from dspine.protos.dspine.v1 import dspine_pb2_grpc as pb_grpc

from ..client_errors import Unavailable
from .calls import UnaryCall
from .requests import build_generate_request
from .retry import NO_RETRY, Attempts, Deadline, RetryPolicy
from .spans import ClientSpan, trace_metadata
from .streams import StreamCall


class ClientCore:
    """Keyword options: ``token`` (bearer), ``tls``, ``root_certificates``, ``tls_server_name``,
    ``timeout`` (default deadline of a call, retries included), ``retry`` (:class:`RetryPolicy`),
    ``max_message_bytes``, ``options`` (more gRPC channel options), ``application`` (the Ray Serve
    application to call)."""

    _channels: Any = grpc  # the module whose channels a face opens: grpc or grpc.aio

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, tls_server_name: str | None = None,
                 timeout: float | None = None, retry: RetryPolicy = RetryPolicy(),
                 max_message_bytes: int = 64 * 1024 * 1024, options: Sequence[tuple[str, object]] = (),
                 application: str | None = None):
        self.target = target
        self.timeout = timeout
        self.retry = retry
        self._auth = [("authorization", f"Bearer {token}")] if token else []
        # Ray Serve routes by this metadata key once a cluster runs more than one application.
        self._auth += [("application", application)] if application else []
        channel_options = [("grpc.max_receive_message_length", max_message_bytes),
                           ("grpc.max_send_message_length", max_message_bytes), *options]
        if tls_server_name:
            channel_options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls or root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = self._channels.secure_channel(target, credentials, options=channel_options)
        else:
            self._channel = self._channels.insecure_channel(target, options=channel_options)
        self._stub = pb_grpc.DSpineStub(self._channel)
        self._health_stub = None

    def _metadata(self, extra: Sequence[tuple[str, str]] = (), span: ClientSpan | None = None
                  ) -> list[tuple[str, str]]:
        return [*self._auth, *trace_metadata(span), *extra]

    def _attempts(self, timeout: float | None, retried: bool = True) -> Attempts:
        deadline = Deadline(self.timeout if timeout is None else timeout)
        return Attempts(self.retry if retried else NO_RETRY, deadline, self.target)

    def _method(self, call: UnaryCall):
        """The stub method that runs ``call`` (looked up per call: tests replace stub methods)."""
        if call.service == "health":
            if self._health_stub is None:
                from grpc_health.v1 import health_pb2_grpc

                self._health_stub = health_pb2_grpc.HealthStub(self._channel)
            return getattr(self._health_stub, call.rpc)
        return getattr(self._stub, call.rpc)

    def _invoke(self, call: UnaryCall, attempt: Attempts, metadata: Sequence[tuple[str, str]], span: ClientSpan):
        """Start one try of ``call`` (its result, or an awaitable of it on grpc.aio)."""
        return self._method(call)(call.request, timeout=attempt.timeout, metadata=self._metadata(metadata, span))

    def _stream(self, prompt: str | None, timeout: float | None, metadata: Sequence[tuple[str, str]],
                options: Mapping[str, Any]) -> StreamCall:
        request = build_generate_request(prompt, **options)
        span = ClientSpan("GenerateStream")
        md = self._metadata(metadata, span)
        return StreamCall(lambda remaining: self._stub.GenerateStream(request, timeout=remaining, metadata=md),
                          self._attempts(timeout), span)

    def _not_ready(self, timeout: float | None) -> Unavailable:
        return Unavailable(f"could not connect to {self.target} within {timeout}s")
