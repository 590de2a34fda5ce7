"""Container healthcheck: exit 0 when the gRPC server at ADDRESS reports SERVING (grpc.health.v1).

    python deploy/healthcheck.py 127.0.0.1:50051

Both services serve the standard health service, so one probe fits both; it needs only grpcio and
grpcio-health-checking, which the project installs anyway.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the reply")
    args = parser.parse_args()
    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
