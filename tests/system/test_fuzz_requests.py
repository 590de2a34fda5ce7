"""Generated GenerateRequests, hostile ones included: each ends OK or with a clear status, and the server lives.

Raw bytes go where strings belong by appending wire-format fields to a serialized request: protobuf
merges them in (the last singular value wins, repeated values and sub-messages merge), so the
server sees bytes that need not be UTF-8.
"""
from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fuzzing import fuzz_settings
from tests.support.service_fixtures import PROMPTS, greedy_request, metric, protobuf_field, scrape
from tandem.launch import ServiceProcess
from tandem.v1 import generation_pb2, structured_pb2

METHOD = "/tandem.v1.Generation/Generate"
CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.DEADLINE_EXCEEDED}
CALL_TIMEOUT = 20.0
MAX_MODEL_LEN = 128
U32, U64 = 2**32 - 1, 2**64 - 1


# Where raw bytes may go: (path of field numbers from GenerateRequest down to a string field).
RAW_SLOTS = {
    "request_id": (1,),
    "prompt": (2,),
    "model": (6,),
    "stop": (5, 7),
    "chat.role": (4, 1, 1),
    "chat.content": (4, 1, 2),
    "structured_outputs.regex": (5, 14, 3),
}


def _raw(path: tuple[int, ...], value: bytes) -> bytes:
    payload = value
    for number in reversed(path):
        payload = protobuf_field(number, payload)
    return payload


texts = st.text(max_size=40) | st.text(st.characters(codec="utf-8"), max_size=300)
wild_floats = st.floats(width=32) | st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e-45, 3e38])
huge = st.integers(0, U32)
Constraint = structured_pb2.StructuredOutputs
sane_constraints = st.sampled_from([None, Constraint(regex="[a-z ]{1,8}"), Constraint(json_object=True),
                                    Constraint(choice=structured_pb2.Choices(choices=["yes", "no"]))])
wild_constraints = (st.builds(lambda kind, text: Constraint(**{kind: text}),
                              st.sampled_from(["json", "regex", "grammar"]), texts)
                    | st.lists(texts, max_size=4).map(lambda c: Constraint(choice=structured_pb2.Choices(choices=c)))
                    | st.booleans().map(lambda b: Constraint(json_object=b)))

# Each field has a sane value and a wild one; an example makes at most three fields wild, so that
# both the accepted path and every single rejection get exercised.
SANE = {
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([1.0, 0.9]),
    "min_p": st.sampled_from([0.0, 0.05]),
    "top_k": st.integers(0, 50),
    "max_tokens": st.integers(1, 4),
    "num_speculative_tokens": st.integers(0, 8),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 49_151), max_size=2),
    "model": st.just(""),
    "input": st.sampled_from(["prompt", "ids", "chat"]),
    "role": st.sampled_from(["system", "user", "assistant", "tool"]),
    "structured_outputs": sane_constraints,
}
WILD = {
    "temperature": wild_floats,
    "top_p": wild_floats,
    "min_p": wild_floats,
    "top_k": huge,
    "max_tokens": st.integers(0, 6) | huge,
    "num_speculative_tokens": huge,
    "stop": st.lists(texts, max_size=20),
    "stop_token_ids": st.lists(st.integers(0, 60_000) | huge, max_size=8),
    "model": texts,
    "input": st.sampled_from(["none", "empty-ids", "long-ids"]),
    "role": texts,
    "structured_outputs": wild_constraints,
}


@st.composite
def requests(draw) -> bytes:
    wild = draw(st.sets(st.sampled_from(sorted(WILD)), max_size=3))

    def value(name: str):
        return draw((WILD if name in wild else SANE)[name])

    params = generation_pb2.SamplingParams(
        temperature=value("temperature"), top_p=value("top_p"), min_p=value("min_p"), top_k=value("top_k"),
        max_tokens=value("max_tokens"), stop=value("stop"), stop_token_ids=value("stop_token_ids"),
        ignore_eos=draw(st.booleans()), drafter_invariant=draw(st.booleans()), speculate=draw(st.booleans()),
        num_speculative_tokens=value("num_speculative_tokens"),
    )
    if draw(st.booleans()):
        params.seed = draw(st.integers(0, U64))
    if (constraint := value("structured_outputs")) is not None:
        params.structured_outputs.CopyFrom(constraint)
    request = generation_pb2.GenerateRequest(request_id=draw(texts), model=value("model"), sampling_params=params)
    kind = value("input")
    if kind == "prompt":
        request.prompt = draw(texts.filter(bool))
    elif kind == "ids":
        request.prompt_token_ids.ids.extend(draw(st.lists(st.integers(0, 49_151), min_size=1, max_size=16)))
    elif kind == "long-ids":
        request.prompt_token_ids.ids.extend(draw(st.lists(st.integers(0, U32), min_size=1,
                                                          max_size=MAX_MODEL_LEN + 8)))
    elif kind == "empty-ids":
        request.prompt_token_ids.SetInParent()
    elif kind == "chat":
        for content in draw(st.lists(texts, min_size=1, max_size=3)):
            request.chat.messages.add(role=value("role"), content=content)
    wire = request.SerializeToString()
    for slot in draw(st.lists(st.sampled_from(sorted(RAW_SLOTS)), max_size=2)):
        wire += _raw(RAW_SLOTS[slot], draw(st.binary(max_size=64)))
    return wire


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    draft = ServiceProcess("draft_service", ["--drafter", "ngram", "--threads", "1"],
                           log_path=logs / "draft.log").start()
    target = ServiceProcess("target_service", ["--threads", "2", "--max-model-len", str(MAX_MODEL_LEN),
                                               "--max-num-seqs", "4", "--drafter", draft.address],
                            log_path=logs / "target.log").start()
    try:
        draft.wait_healthy(timeout=300)
        target.wait_healthy(timeout=300)
        yield target
    finally:
        target.kill()
        draft.kill()


def test_undecodable_bytes_are_invalid_argument_not_internal():
    """Bad UTF-8 in a string field made grpc.aio answer UNKNOWN (an uncaught DecodeError), before validation."""
    from target_service.errors import RequestError
    from target_service.front_doors.validation import decode_request

    error = decode_request(generation_pb2.GenerateRequest(request_id="r").SerializeToString()
                           + _raw(RAW_SLOTS["prompt"], b"\xff\xfe"))
    assert isinstance(error, RequestError) and error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert decode_request(greedy_request("hi", 1).SerializeToString()) == greedy_request("hi", 1)


def _status(call) -> grpc.StatusCode:
    try:
        for _ in call:
            pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("examples", [60, pytest.param(10_000, marks=pytest.mark.slow)])
def test_generated_requests_end_cleanly_and_leave_the_server_sound(pair, examples):
    target = pair
    good = greedy_request(PROMPTS[4], 8).SerializeToString()
    seen: dict[str, int] = {}
    with grpc.insecure_channel(target.address) as channel:
        generate = channel.unary_stream(METHOD, request_serializer=lambda wire: wire,
                                        response_deserializer=generation_pb2.GenerateResponse.FromString)

        def tokens(wire: bytes) -> list[int]:
            return [t for response in generate(wire, timeout=CALL_TIMEOUT) for t in response.token_ids]

        reference = tokens(good)

        @fuzz_settings(examples)
        @given(requests())
        def check(wire: bytes) -> None:
            code = _status(generate(wire, timeout=CALL_TIMEOUT))
            seen[code.name] = seen.get(code.name, 0) + 1
            assert code in CLEAR, f"{code.name} for {wire!r:.2000}"
            assert target.process.poll() is None, "the target died"

        check()
        assert tokens(good) == reference, "a fuzzed request changed a later greedy output"
    samples = scrape(target.metrics_url)
    assert metric(samples, "tandem_num_requests_running") == 0
    assert metric(samples, "tandem_num_requests_waiting") == 0
    print("statuses:", seen)
    assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen
