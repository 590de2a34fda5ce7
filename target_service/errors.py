"""Errors that end one request with a gRPC status, never the server."""
from __future__ import annotations

import grpc


class RequestError(Exception):
    """field: the request field to fix, when one is at fault; front doors name it in their own terms."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


def invalid(field: str, problem: str) -> RequestError:
    """INVALID_ARGUMENT whose message names the field to fix."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}", field)
