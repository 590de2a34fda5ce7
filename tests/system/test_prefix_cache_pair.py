"""Prefix caching under speculation, on the synchronous model pair: a conversation's next turn finds
the previous turn's KV in the target's slot, prefills only the rest, and its greedy output is the
whole prefill's (a request with prompt_logprobs prefills every position), with and without speculation."""
from __future__ import annotations

from tandem.v1 import generation_pb2
from tests.support.service_fixtures import run_requests

QUESTION = "Name a colour of the sea."
FOLLOW_UP = "And one of the sky?"


def _chat(messages: list[tuple[str, str]], **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in messages]),
        sampling_params=generation_pb2.SamplingParams(temperature=0.0, max_tokens=24, **sampling))


def test_the_next_turn_reuses_the_last_ones_kv_and_gives_the_same_tokens(model_pair):
    address = model_pair[1].address
    [first] = run_requests(address, [_chat([("user", QUESTION)])])
    turn = [("user", QUESTION), ("assistant", first.text), ("user", FOLLOW_UP)]
    [cached] = run_requests(address, [_chat(turn)])
    whole, alone = run_requests(address, [_chat(turn, prompt_logprobs=0), _chat(turn, speculate=False)])
    assert cached.cached_tokens >= first.prompt_tokens, "the first turn's prompt was prefilled again"
    assert whole.cached_tokens == 0
    assert cached.token_ids == whole.token_ids == alone.token_ids
    assert cached.accepted_tokens > 0, "speculation ran on top of the cached prefix"
