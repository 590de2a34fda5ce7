"""TLS and mTLS for both links, and the bearer token of client calls: what servers and clients share.

Kept apart from grpc_server.py so that a client (tandem generate, bench) can use it without torch.
"""
from __future__ import annotations

import hmac
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

AUTH_METADATA_KEY = "authorization"
# Health stays open so that load balancers and orchestrator probes work without the token.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A server's certificate and key; with client_ca_file, mTLS: only clients whose cert that CA signed."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    @classmethod
    def from_flags(cls, cert: str, key: str, client_ca: str, prefix: str = "tls") -> "ServerTls | None":
        """None when TLS is off; a ValueError naming the flags when they are half set."""
        if bool(cert) != bool(key):
            raise ValueError(f"--{prefix}-cert and --{prefix}-key must be given together")
        if client_ca and not cert:
            raise ValueError(f"--{prefix}-client-ca (mTLS) needs --{prefix}-cert and --{prefix}-key")
        return cls(cert, key, client_ca) if cert else None

    def credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.client_ca_file) if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificate, key and client CA for an HTTP server (the OpenAI front door)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file:
                context.load_verify_locations(self.client_ca_file)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as err:
            raise ValueError(f"cannot load TLS files ({self.cert_file}, {self.key_file}): {err}") from None
        return context


@dataclass(frozen=True, slots=True)
class ClientTls:
    """How a client checks a server (ca_file; empty uses the system roots) and, for mTLS, proves itself."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def from_flags(cls, ca: str, cert: str, key: str, enabled: bool = False,
                   prefix: str = "") -> "ClientTls | None":
        """None when TLS is off (no file given and not `enabled`)."""
        if bool(cert) != bool(key):
            raise ValueError(f"--{prefix}client-cert and --{prefix}client-key must be given together")
        return cls(ca, cert, key) if (enabled or ca or cert) else None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if self.key_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None,
        )


def read_token(token: str, token_file: str) -> str:
    """The bearer token from a flag or (better: not visible in `ps`) a file; empty means no token."""
    if token and token_file:
        raise ValueError("give a token or a token file, not both")
    return _read(token_file).decode().strip() if token_file else token


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call without `authorization: Bearer <token>`, health checks excepted."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method.startswith(OPEN_METHOD_PREFIXES):
            return True
        for key, value in details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or self._authorized(details):
            return handler
        return _denying_handler(handler)


async def _deny(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` whose every call ends UNAUTHENTICATED."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(_deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
