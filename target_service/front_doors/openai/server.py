"""The OpenAI-compatible HTTP front door (`--http-port`), on aiohttp, on the gRPC server's event loop.

It only translates: a body into the engine's GenerateRequest (protocol.py), the sequence's
outputs into OpenAI's bodies and server-sent events (bodies.py); the Responses API translates into
chat completions (responses/). Admission, validation and
abort are Serving's, as for gRPC. aiohttp was measured against Starlette on uvicorn for this
(bench/http_servers.py, docs/design/front-doors.md): less CPU per streamed event and a shorter first byte.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp_sse import sse_response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from target_service.errors import RequestError
from target_service.front_doors.openai import bodies, protocol, tools
from target_service.front_doors.openai.bodies import Completion
from target_service.front_doors.openai.errors import ApiError
from target_service.front_doors.openai.pieces import Echo, LogprobsOf, Piece, pieces
from target_service.front_doors.openai.protocol import ProtocolError
from target_service.front_doors.openai.responses.routes import ResponsesApi
from target_service.front_doors.serving import SERVER_ABORTED, Serving, Session
from target_service.front_doors.tool_calls import ToolChoice
from target_service.front_doors.validation import prompt_ids_of
from target_service.sequence import FinishReason, Output, Sequence
from tandem.tls import ServerTls
from tandem.v1 import generation_pb2

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers need no token, as on vLLM
REQUEST_ID_HEADER = "X-Request-Id"

@dataclass(frozen=True, slots=True)
class CompletionKind:
    """What differs between chat and text completions."""

    id_prefix: str
    object: str
    chunk_object: str
    # (meta, samples, texts, logprobs, each choice's prompt logprobs, **calling) -> the body not streamed
    whole: Callable[..., dict[str, Any]]
    # (meta, choice index, seq, its pieces, **calling) -> the chunks of each of its outputs
    chunker: Callable[..., Callable[[Output], list[dict[str, Any]]]]
    logprobs: LogprobsOf


def _chat_chunks(meta: Completion, index: int, seq: Sequence, piece: Callable[[Output], Piece],
                 tool_choice: ToolChoice | None = None) -> Callable[[Output], list[dict[str, Any]]]:
    """The role chunk with the first token (as vLLM: it marks the time to first token), a chunk per
    output (with its tokens' logprobs when asked), and the last chunk with why the choice finished.
    The calls an answer makes (tool_choice) are sent as deltas of tool_calls."""
    role_sent = False
    calls = tools.CallStream(tool_choice) if tool_choice is not None else None

    def chunks(output: Output) -> list[dict[str, Any]]:
        nonlocal role_sent
        out = []
        if output.token_ids and not role_sent:
            out.append(bodies.chat_chunk(meta, index, seq, {"role": "assistant", "content": ""}))
            role_sent = True
        text, logprobs = piece(output)
        entries = []
        if calls is not None:
            text, entries = calls.feed(text, last=output.finish is not None)
        delta: dict[str, Any] = {"content": text} if text else {}
        if entries:
            delta["tool_calls"] = entries
        if delta or logprobs is not None:
            out.append(bodies.chat_chunk(meta, index, seq, delta or {"content": ""}, logprobs=logprobs))
        if output.finish is not None:
            called = calls is not None and calls.sent and seq.finish is FinishReason.STOP
            out.append(bodies.chat_chunk(meta, index, seq, {}, finished=True,
                                            reason=tool_choice.finish_reason if called else None))
        return out

    return chunks


def _text_chunks(meta: Completion, index: int, seq: Sequence,
                 piece: Callable[[Output], Piece]) -> Callable[[Output], list[dict[str, Any]]]:
    def chunks(output: Output) -> list[dict[str, Any]]:
        text, logprobs = piece(output)
        out = [bodies.text_chunk(meta, index, seq, text, logprobs=logprobs)] if text or logprobs else []
        if output.finish is not None:
            out.append(bodies.text_chunk(meta, index, seq, "", finished=True))
        return out

    return chunks


CHAT = CompletionKind("chatcmpl", "chat.completion", "chat.completion.chunk", bodies.chat_response, _chat_chunks,
                bodies.Logprobs.chat)
TEXT = CompletionKind("cmpl", "text_completion", "text_completion", bodies.text_response, _text_chunks,
                bodies.Logprobs.text)


def _one_request(translate: Callable[[Any, str], generation_pb2.GenerateRequest], body: Any,
                 request_id: str) -> list[generation_pb2.GenerateRequest]:
    return [translate(body, request_id)]


class OpenAIServer:
    def __init__(self, serving: Serving, registry: CollectorRegistry, token: str, max_body_bytes: int):
        self.serving = serving
        self.registry = registry
        self._token = f"Bearer {token}".encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.started = int(time.time())
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._errors, self._auth])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.responses = ResponsesApi(self, serving.config.max_stored_responses)
        self.responses.add_routes(self.app)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/detokenize", self.detokenize)
        self._runner: web.AppRunner | None = None
        tokenizer = serving.loaded.tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode([token]))

    async def start(self, host: str, port: int, tls: ServerTls | None) -> None:
        """Serves until stop(). A client that disconnects cancels its handler."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=tls.ssl_context() if tls else None)
        await site.start()
        log.info("serving the OpenAI API on http%s://%s:%d", "s" if tls else "", host, port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- middleware --------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        try:
            return await handler(request)
        except ApiError as err:
            return err.response()
        except web.HTTPException as err:  # no such route, a method it does not take
            if err.status < 400:
                raise
            return ApiError(err.status, f"{request.method} {request.path}: {err.reason}").response()
        except Exception:  # a bug must cost this request only, and answer in the shape clients parse
            log.exception("%s %s failed", request.method, request.path)
            return ApiError(500, "internal error; the server logged it").response()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if self._token is not None and request.path not in OPEN_PATHS:
            # aiohttp decodes header bytes with surrogateescape: encode them back the same way.
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(got, self._token):
                raise ApiError(401, "missing or wrong bearer token: send Authorization: Bearer <token>",
                               code="invalid_api_key")
        return await handler(request)

    # ---- generation --------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_body(request, protocol.ChatCompletionRequest)
        renamed = {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {}
        if body.response_format is not None:
            renamed["structured_outputs"] = "response_format"
        renamed.update(tools.tool_fields(body))
        return await self._generate(request, body, functools.partial(_one_request, tools.chat_request), renamed, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_body(request, protocol.CompletionRequest)
        return await self._generate(request, body, protocol.completion_requests, {}, TEXT)

    async def _generate(self, request: web.Request, body: Any,
                        translate: Callable[[Any, str], list[generation_pb2.GenerateRequest]],
                        renamed: dict[str, str], endpoint: CompletionKind) -> web.StreamResponse:
        """translate: the engine requests of a body, one per prompt (a batch of completions: its choices
        are each prompt's samples in turn)."""
        request_id = self.request_id(request, body, uuid.uuid4().hex)
        try:
            ours = translate(body, request_id)
        except ProtocolError as err:
            raise ApiError.of_protocol_error(err) from None
        created = int(time.time())
        meta = Completion(f"{endpoint.id_prefix}-{request_id}", endpoint.object, created, self.serving.loaded.name)
        try:
            async with contextlib.AsyncExitStack() as sessions:
                opened = [await self._session(sessions, one, p if len(ours) > 1 else None, renamed)
                          for p, one in enumerate(ours)]
                groups = [session.samples for session in opened]
                samples = [seq for group in groups for seq in group]
                choice = opened[0].tool_choice  # a chat's answer may call
                calling = {} if choice is None else {"tool_choice": choice}
                per_sample = [pieces(endpoint.logprobs, seq, self.token_text, echo)
                              for group, one in zip(groups, ours) for echo in [self._echo(body, one, group)]
                              for seq in group]
                if not body.stream:
                    return web.json_response(await self._whole(groups, meta, endpoint, per_sample, calling))
                chunk_meta = Completion(meta.id, endpoint.chunk_object, created, meta.model)
                chunkers = [endpoint.chunker(chunk_meta, index, seq, piece, **calling)
                            for index, (seq, piece) in enumerate(zip(samples, per_sample))]
                return await self._stream(request, groups, body.stream_options, chunk_meta, chunkers)
        except RequestError as err:  # only a session's start raises it: nothing was sent yet
            raise ApiError.of_request_error(err, renamed) from None

    async def _session(self, sessions: contextlib.AsyncExitStack, one: generation_pb2.GenerateRequest,
                       p: int | None, renamed: dict[str, str]) -> Session:
        """One engine request's session, held by `sessions`; the refusal of prompt p of a batch names
        that prompt."""
        try:
            return await sessions.enter_async_context(self.serving.session(one))
        except RequestError as err:
            if p is None:
                raise
            raise ApiError.of_request_error(err, {**renamed, "prompt": f"prompt[{p}]",
                                                  "prompt_token_ids": f"prompt[{p}]"}) from None

    @staticmethod
    def request_id(request: web.Request, body: Any, default: str) -> str:
        """The engine's id of a request: the X-Request-Id header's, the body's request_id, or `default`."""
        return request.headers.get(REQUEST_ID_HEADER) or body.request_id or default

    def _echo(self, body: Any, request: generation_pb2.GenerateRequest, samples: list[Sequence]) -> Echo | None:
        """What the samples of a text completion's prompt start with under echo; None for any other request."""
        if not isinstance(body, protocol.CompletionRequest) or not body.echo:
            return None
        prompt_ids = samples[0].prompt_ids
        text = request.prompt if request.HasField("prompt") else self.serving.loaded.tokenizer.decode(prompt_ids)
        return Echo(text, prompt_ids, generate=body.max_tokens != 0)

    async def _whole(self, groups: list[list[Sequence]], meta: Completion, endpoint: CompletionKind,
                     per_sample: list[Callable[[Output], Piece]], calling: dict[str, Any]) -> dict[str, Any]:
        """The body of a request not streamed: a choice per sample, once every sample finished."""
        samples = [seq for group in groups for seq in group]
        outputs = [choice async for choice in self.serving.batch_outputs(groups)]
        if any(output.finish is FinishReason.ABORT for _, output in outputs):
            raise ApiError(503, SERVER_ABORTED)
        parts: list[list[Piece]] = [[] for _ in samples]
        for index, output in outputs:  # in the order they came, as a stream takes them
            parts[index].append(per_sample[index](output))
        texts = ["".join(text for text, _ in mine) for mine in parts]
        logprobs = [bodies.joined([lp for _, lp in mine if lp is not None]) for mine in parts]
        brought = {samples[index].group: output.prompt_logprobs for index, output in outputs
                   if output.prompt_logprobs is not None}  # one sample of each prompt brings them
        prompts = {group[0].group: bodies.prompt_logprobs(self.token_text, group[0].prompt_ids,
                                                          brought.get(group[0].group)) for group in groups}
        return endpoint.whole(meta, samples, texts, logprobs, [prompts[seq.group] for seq in samples], **calling)

    async def read_body(self, request: web.Request, model: type) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the body is larger than the server's limit of {self.max_body_bytes} bytes "
                                "(--max-message-bytes)", code="request_too_large") from None
        try:
            body = protocol.parse_body(model, raw)
        except ProtocolError as err:
            raise ApiError.of_protocol_error(err) from None
        if getattr(body, "model", None) not in (None, "", self.serving.loaded.name):
            raise ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{self.serving.loaded.name}`", "model", "model_not_found")
        return body

    async def _stream(self, request: web.Request, groups: list[list[Sequence]],
                      options: protocol.StreamOptions | None, meta: Completion,
                      chunkers: list[Callable[[Output], list[dict[str, Any]]]]) -> web.StreamResponse:
        """Server-sent events: the chunks of each output (chunkers[i]: choice i's), the usage chunk if
        asked, then [DONE].

        Once the stream has started, nothing can change its status: a client that left or stalled
        ends it quietly (the session aborts the sequence), and any other failure is one error
        event, as an abort by the server is."""
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        samples = [seq for group in groups for seq in group]
        async with sse_response(request, sep="\n", allow_all_methods=True) as sse:
            try:
                async for index, output in self.serving.batch_outputs(groups):
                    if output.finish is FinishReason.ABORT:
                        await sse.send(json.dumps(bodies.error_body(SERVER_ABORTED, "server_error")))
                        break
                    for chunk in chunkers[index](output):
                        if continuous:
                            chunk["usage"] = bodies.usage(samples)
                        await sse.send(json.dumps(chunk))
                else:
                    if include_usage:
                        await sse.send(json.dumps(bodies.usage_chunk(meta, samples)))
                await sse.send("[DONE]")
            except (ConnectionResetError, TimeoutError):
                pass
            except Exception:
                log.exception("%s: the stream failed", samples[0].request_id)
                with contextlib.suppress(ConnectionResetError, TimeoutError):
                    await sse.send(json.dumps(bodies.error_body("internal error; the server logged it",
                                                                   "server_error")))
                    await sse.send("[DONE]")
        return sse

    # ---- the rest ----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        name = self.serving.loaded.name
        card = {"id": name, "object": "model", "created": self.started, "owned_by": "tandem", "root": name,
                "parent": None, "max_model_len": self.serving.config.max_model_len, "permission": []}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.serving.engine.accepting else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        # Off the event loop, which the gRPC server and the step loop share: routers scrape often.
        body = await asyncio.to_thread(generate_latest, self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self.read_body(request, protocol.TokenizeRequest)
        tokenizer = self.serving.loaded.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give prompt or messages, one of them", "prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            if body.add_special_tokens:
                raise ApiError(400, "add_special_tokens: true is not supported with messages; the chat template "
                                    "places the special tokens", "add_special_tokens", "unsupported_parameter")
            try:
                chat = protocol.chat_messages(body.messages)
                ids = prompt_ids_of(generation_pb2.GenerateRequest(chat=chat), tokenizer,
                                    self.serving.loaded.config.vocab_size)
            except ProtocolError as err:
                raise ApiError.of_protocol_error(err) from None
            except RequestError as err:
                raise ApiError.of_request_error(err, {}) from None
        reply = {"count": len(ids), "max_model_len": self.serving.config.max_model_len, "tokens": ids,
                 "token_strs": [tokenizer.backend.id_to_token(i) for i in ids] if body.return_token_strs else None}
        return web.json_response(reply)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self.read_body(request, protocol.DetokenizeRequest)
        vocab = self.serving.loaded.config.vocab_size
        bad = [i for i in body.tokens if not 0 <= i < vocab]
        if bad:
            raise ApiError(400, f"tokens: id {bad[0]} is outside the vocabulary of {vocab}", "tokens", "invalid_value")
        return web.json_response({"prompt": self.serving.loaded.tokenizer.decode(body.tokens)})
