"""Errors of the OpenAI door, in OpenAI's shape."""
from __future__ import annotations

import grpc
from aiohttp import web

from target_service.errors import RequestError
from target_service.front_doors.openai import bodies
from target_service.front_doors.openai.protocol import ProtocolError

_STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                   405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
# The engine's field names where OpenAI's differ: a chat's messages, a prompt of token ids.
_OPENAI_FIELDS = {"chat.messages": "messages", "chat": "messages", "prompt_token_ids": "prompt", "input": "prompt"}


class ApiError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        error_type = _TYPE_OF_STATUS.get(self.status, "server_error")
        return web.json_response(bodies.error_body(self.message, error_type, self.param, self.code),
                                 status=self.status)

    @classmethod
    def of_request_error(cls, err: RequestError, renamed: dict[str, str]) -> ApiError:
        """The engine's refusal, its field named as this request named it."""
        status = _STATUS_OF_CODE.get(err.code, 500)
        err = err.renamed({**_OPENAI_FIELDS, **renamed})
        return cls(status, err.message, err.field or None, "invalid_value" if status == 400 and err.field else None)

    @classmethod
    def of_protocol_error(cls, err: ProtocolError) -> ApiError:
        """A body we cannot translate: a 400 naming the field."""
        return cls(400, str(err), err.param, err.code)
