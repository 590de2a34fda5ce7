"""A response's output items, and the events that stream them, built as its one sequence's outputs come.

Text goes into a `message` item with one `output_text` part; each call the answer makes (tools.py's
CallStream reads them, as chat completions stream them) is a `function_call` item. Streamed, the
events are OpenAI's, in OpenAI's order: `response.created` and `response.in_progress`, then per item
`response.output_item.added`, its content (`response.content_part.added`, `response.output_text.delta`
... `.done`, `response.content_part.done`; or `response.function_call_arguments.delta` ... `.done`)
and `response.output_item.done`, and last `response.completed`, or `response.incomplete` when
max_output_tokens cut the answer. The body not streamed is the last event's response, so both agree.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from target_service.front_doors.openai.responses.protocol import Item, ResponsesRequest
from target_service.front_doors.openai.tools import CallStream
from target_service.front_doors.tool_calls import ToolChoice
from target_service.sequence import FinishReason, Sequence

Event = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What the response object repeats of its request."""

    id: str
    created_at: int
    model: str
    request: ResponsesRequest
    stored: bool  # store asked, and the server keeps responses

    def body(self, status: str, output: list[Item], **extra: Any) -> dict[str, Any]:
        request = self.request
        fmt = request.text.format if request.text is not None and request.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None, "incomplete_details": None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": None, "metadata": request.metadata or {}, "model": self.model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": request.service_tier or "default",
            "store": self.stored, "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": _shown_choice(request), "tools": request.tools or [],
            "top_logprobs": request.top_logprobs or 0, "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled", "usage": None, "user": request.user, **extra}


def _shown_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def usage(seq: Sequence) -> dict[str, Any]:
    prompt, output = len(seq.prompt_ids), seq.num_generated
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": seq.cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output}


@dataclass(slots=True)
class _Open:
    """The item being written: its place in the output."""

    index: int
    item: Item
    text: str = ""  # a message's, until its part is done
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class ResponseStream:
    """One response's output as it grows, and its events (numbered from 0 as they are sent)."""

    meta: ResponseMeta
    choice: ToolChoice | None  # the request's tools may be called
    output: list[Item] = field(default_factory=list, init=False)
    _open: _Open | None = field(default=None, init=False)  # the item being written
    _calls: CallStream | None = field(default=None, init=False)
    _number: int = field(default=0, init=False)  # the next sent event's sequence_number

    def __post_init__(self) -> None:
        if self.choice is not None:
            self._calls = CallStream(self.choice)

    def start(self) -> list[Event]:
        response = self.meta.body("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, text: str, logprobs: list[dict[str, Any]], last: bool) -> list[Event]:
        """The events for this much more of the answer (`logprobs`: its tokens', for text); `last`: it ended."""
        entries: list[dict[str, Any]] = []
        if self._calls is not None:
            text, entries = self._calls.feed(text, last)
        events = self._text(text, logprobs) if text or logprobs else []
        for entry in entries:
            if "id" in entry:
                events += self._close("completed")
                events += self._open_call(entry["id"], entry["function"]["name"])
            events += self._arguments(entry["function"]["arguments"])
        return events

    def finish(self, seq: Sequence) -> list[Event]:
        """The events that close the answer: its open item, then the whole response."""
        events = [] if self.output else self._text("", [])  # an empty answer is an empty message
        cut = seq.finish is FinishReason.LENGTH
        events += self._close("incomplete" if cut else "completed")
        extra: dict[str, Any] = {"usage": usage(seq)}
        if cut:
            extra["incomplete_details"] = {"reason": "max_output_tokens"}
        status = "incomplete" if cut else "completed"
        return [*events, self._event(f"response.{status}", response=self.meta.body(status, self.output, **extra))]

    def failed(self, message: str) -> Event:
        """The last event of a stream the server could not finish."""
        body = self.meta.body("failed", self.output, error={"code": "server_error", "message": message})
        return self._event("response.failed", response=body)

    def numbered(self, event: Event) -> Event:
        """The event with its sequence_number, given as it is sent: events built but never sent (a
        step that failed midway) leave no gap before the next."""
        event["sequence_number"] = self._number
        self._number += 1
        return event

    def _event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "sequence_number": None, **fields}

    def _added(self, item: Item) -> list[Event]:
        self._open = _Open(len(self.output), item)
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=self._open.index, item=dict(item))]

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        events = []
        if self._open is None or self._open.item["type"] != "message":
            events += self._close("completed")
            events += self._added({"id": item_id("msg"), "type": "message", "status": "in_progress",
                                   "role": "assistant", "content": []})
            events.append(self._event("response.content_part.added", **self._where(), part=_part("", [])))
        self._open.text += text
        self._open.logprobs += logprobs
        if text or logprobs:
            events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs))
        return events

    def _open_call(self, call_id: str, name: str) -> list[Event]:
        return self._added({"id": item_id("fc"), "type": "function_call", "status": "in_progress",
                            "call_id": call_id, "name": name, "arguments": ""})

    def _arguments(self, delta: str) -> list[Event]:
        if not delta:
            return []
        self._open.item["arguments"] += delta
        return [self._event("response.function_call_arguments.delta", **self._where(content=False), delta=delta)]

    def _close(self, status: str) -> list[Event]:
        if self._open is None:
            return []
        item = self._open.item
        is_message = item["type"] == "message"
        where = self._where(content=is_message)
        events = []
        if is_message:
            part = _part(self._open.text, self._open.logprobs)
            events += [self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
                       self._event("response.content_part.done", **where, part=part)]
            item["content"] = [part]
        else:
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["arguments"]))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=self._open.index, item=item))
        self._open = None
        return events

    def _where(self, content: bool = True) -> dict[str, Any]:
        """Where an event's item is; `content`: in its one content part (a message's)."""
        where = {"item_id": self._open.item["id"], "output_index": self._open.index}
        return {**where, "content_index": 0} if content else where


def _part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
