"""Responses kept in memory for `previous_response_id` and `GET /v1/responses/{id}`."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from target_service.front_doors.openai.responses.protocol import ParsedItem


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as it was sent
    # the conversation through it, text alone: the history it continued, its input, its output
    items: tuple[ParsedItem, ...]


class ResponseStore:
    """At most `capacity` responses, the least recently used forgotten first.

    A response keeps its whole conversation, so that one forgotten does not break those that continue
    it; the items are shared with the response it continued, not copied."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)
