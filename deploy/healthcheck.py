"""Container healthcheck: exit 0 when the gRPC server at ADDRESS reports SERVING (grpc.health.v1),
or when an HTTP URL (the gateway's /health) answers 200.

    python deploy/healthcheck.py 127.0.0.1:50051
    python deploy/healthcheck.py http://127.0.0.1:8000/health                             # HTTP
    python deploy/healthcheck.py 127.0.0.1:50051 --ca-cert ca.crt --server-name target   # TLS
    ... --client-cert probe.crt --client-key probe.key                                     # mTLS

Both services serve the standard health service, so one probe fits both. It speaks TLS when the
service does: --ca-cert (or --tls, with the system's roots) verifies the service's certificate,
under --server-name when that certificate names the service rather than 127.0.0.1, and a
client certificate answers a service that requires mTLS. An empty --ca-cert is plaintext, so
that compose files can pass their TLS settings through unchanged. Health needs no bearer token.
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.tls import ClientTls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the gRPC server, or an http:// URL")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the reply")
    parser.add_argument("--tls", action="store_true", help="TLS with the system's roots")
    parser.add_argument("--ca-cert", default="", help="PEM CA bundle that verifies the service; turns TLS on")
    parser.add_argument("--client-cert", default="", help="PEM certificate for a service that requires mTLS")
    parser.add_argument("--client-key", default="", help="PEM private key of --client-cert")
    parser.add_argument("--server-name", default="", help="the name the service's certificate carries")
    args = parser.parse_args()
    if args.address.startswith(("http://", "https://")):
        return _http(args.address, args.timeout)
    try:
        tls = ClientTls.from_flags(args.ca_cert, args.client_cert, args.client_key, enabled=args.tls)
        channel = _channel(args.address, tls, args.server_name)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _http(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            status = reply.status
    except urllib.error.HTTPError as err:
        status = err.code
    except OSError as err:
        print(f"{url}: {err}", file=sys.stderr)
        return 1
    print(f"{url}: HTTP {status}")
    return 0 if status == 200 else 1


def _channel(address: str, tls: ClientTls | None, server_name: str) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, tls.credentials(), options=options)


if __name__ == "__main__":
    sys.exit(main())
