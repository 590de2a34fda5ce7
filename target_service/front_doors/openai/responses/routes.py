"""`POST /v1/responses`, `GET /v1/responses/{id}` and `DELETE /v1/responses/{id}` on the OpenAI door."""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp_sse import sse_response

from target_service.errors import RequestError
from target_service.front_doors.openai import tools
from target_service.front_doors.openai.bodies import Logprobs
from target_service.front_doors.openai.errors import ApiError
from target_service.front_doors.openai.pieces import Piece, pieces
from target_service.front_doors.openai.protocol import ProtocolError
from target_service.front_doors.openai.responses import protocol
from target_service.front_doors.openai.responses.output import Event, ResponseMeta, ResponseStream
from target_service.front_doors.openai.responses.protocol import RESPONSES_FIELDS, ParsedItem, ResponsesRequest
from target_service.front_doors.openai.responses.store import ResponseStore, StoredResponse
from target_service.front_doors.serving import SERVER_ABORTED
from target_service.sequence import FinishReason, Output, Sequence
from tandem.v1 import generation_pb2

if TYPE_CHECKING:
    from target_service.front_doors.openai.server import OpenAIServer

log = logging.getLogger(__name__)


class ResponsesApi:
    def __init__(self, server: OpenAIServer, capacity: int):
        self.server = server
        self.store = ResponseStore(capacity)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await self.server.read_body(request, ResponsesRequest)
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            history, items, ours = self._translate(body, self.server.request_id(request, body, response_id))
        except ProtocolError as err:
            raise ApiError.of_protocol_error(protocol.renamed_error(err)) from None
        meta = ResponseMeta(response_id, int(time.time()), self.server.serving.loaded.name, body,
                            stored=body.store and self.store.capacity > 0)
        try:
            async with self.server.serving.session(ours) as session:
                [seq] = samples = session.samples
                stream = ResponseStream(meta, session.tool_choice)
                piece = pieces(Logprobs.chat, seq, self.server.token_text)
                if body.stream:
                    return await self._stream(request, seq, stream, piece, (history, items))
                async for output in self.server.serving.outputs(samples):
                    if output.finish is FinishReason.ABORT:
                        raise ApiError(503, SERVER_ABORTED)
                    _feed(stream, piece, output)
                response = stream.finish(seq)[-1]["response"]
                self._keep(meta, history, items, response)
                return web.json_response(response)
        except RequestError as err:  # only the session's start raises it: nothing was sent yet
            raise ApiError.of_request_error(err, RESPONSES_FIELDS) from None

    def _translate(self, body: ResponsesRequest, request_id: str) -> tuple[
            list[ParsedItem], list[ParsedItem], generation_pb2.GenerateRequest]:
        """The history continued, the input, and the engine's request."""
        protocol.check(body)
        items = protocol.input_items(body)
        history = self._history(body.previous_response_id)
        chat = protocol.chat_request(body, history, items)
        return history, items, tools.chat_request(chat, request_id)

    def _history(self, previous_id: str | None) -> list[ParsedItem]:
        if previous_id is None:
            return []
        stored = self.store.get(previous_id)
        if stored is None:
            kept = ("it was not stored, or has been forgotten (the server keeps the last "
                    f"{self.store.capacity}, --max-stored-responses)" if self.store.capacity
                    else "this server keeps no responses (--max-stored-responses 0)")
            raise ApiError(404, f"Response with id {previous_id!r} not found: {kept}", "previous_response_id",
                           "not_found")
        return list(stored.items)

    def _keep(self, meta: ResponseMeta, history: list[ParsedItem], items: list[ParsedItem],
              response: dict[str, Any]) -> None:
        if meta.stored:
            self.store.put(meta.id, StoredResponse(response, (*history, *protocol.kept(items, response["output"]))))

    async def _stream(self, request: web.Request, seq: Sequence, stream: ResponseStream,
                      piece: Callable[[Output], Piece],
                      conversation: tuple[list[ParsedItem], list[ParsedItem]]) -> web.StreamResponse:
        """OpenAI's events, each with its type as the event's name; no [DONE] ends them (OpenAI sends none).
        A failure once the stream has started is a `response.failed` event."""
        async with sse_response(request, sep="\n", allow_all_methods=True) as sse:
            try:
                await _send(sse, stream, stream.start())
                async for output in self.server.serving.outputs([seq]):
                    if output.finish is FinishReason.ABORT:
                        await _send(sse, stream, [stream.failed(SERVER_ABORTED)])
                        return sse
                    await _send(sse, stream, _feed(stream, piece, output))
                events = stream.finish(seq)
                await _send(sse, stream, events)
                self._keep(stream.meta, *conversation, events[-1]["response"])  # once the client has it all
            except (ConnectionResetError, TimeoutError):
                pass
            except Exception:
                log.exception("%s: the stream failed", seq.request_id)
                with contextlib.suppress(ConnectionResetError, TimeoutError):
                    await _send(sse, stream, [stream.failed("internal error; the server logged it")])
        return sse

    async def retrieve(self, request: web.Request) -> web.Response:
        if request.query.get("stream", "false") != "false":
            raise ApiError(400, "stream: replaying a stored response's events is not supported; leave it unset",
                           "stream", "unsupported_parameter")
        return web.json_response(self._stored(request).body)

    async def delete(self, request: web.Request) -> web.Response:
        stored = self._stored(request)
        self.store.delete(stored.body["id"])
        return web.json_response({"id": stored.body["id"], "object": "response", "deleted": True})

    def _stored(self, request: web.Request) -> StoredResponse:
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id {response_id!r} not found", "response_id", "not_found")
        return stored


def _feed(stream: ResponseStream, piece: Callable[[Output], Piece], output: Output) -> list[Event]:
    text, logprobs = piece(output)
    return stream.feed(text, logprobs["content"] if logprobs else [], last=output.finish is not None)


async def _send(sse: Any, stream: ResponseStream, events: list[Event]) -> None:
    for event in events:
        await sse.send(json.dumps(stream.numbered(event)), event=event["type"])
