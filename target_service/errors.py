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

    def renamed(self, names: dict[str, str], prefix: str = "") -> RequestError:
        """The same error, its field named as a front door's request names it: the longest of
        `names` that heads the field (up to a `.` or `[`) is replaced by its value; a field that
        none heads gets `prefix`."""
        if not self.field:
            return self
        field = renamed_field(self.field, names, prefix)
        problem = self.message.removeprefix(f"{self.field}: ")
        return RequestError(self.code, f"{field}: {problem}", field)


def renamed_field(field: str, names: dict[str, str], prefix: str = "") -> str:
    """`field` with the longest of `names` that heads it (up to a `.` or `[`) replaced by its value;
    a field that none heads gets `prefix`."""
    heads = [n for n in names if field == n or field.startswith((n + ".", n + "["))]
    if not heads:
        return prefix + field
    head = max(heads, key=len)
    return names[head] + field[len(head):]


def invalid(field: str, problem: str) -> RequestError:
    """INVALID_ARGUMENT whose message names the field to fix."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}", field)
