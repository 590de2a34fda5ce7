"""vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine) on the target's gRPC port, driven with
smg-grpc-proto's own stubs, as the Shepherd Model Gateway drives a vLLM worker."""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import queue
import threading
import zipfile

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from tests.support.service_fixtures import PROMPTS, greedy_request, metric, run_requests, scrape
from tandem.launch import ServiceProcess
from tandem.tokenizer import Tokenizer

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stub(front_doors):
    with grpc.insecure_channel(front_doors.address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def _request(ids: list[int], stream: bool = True, request_id: str = "r",
             **sampling) -> vllm_engine_pb2.GenerateRequest:
    gateway_defaults = dict(top_p=1.0, repetition_penalty=1.0, n=1, skip_special_tokens=True)
    params = vllm_engine_pb2.SamplingParams(**{**gateway_defaults, **sampling})
    return vllm_engine_pb2.GenerateRequest(request_id=request_id, stream=stream, sampling_params=params,
                                           tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids))


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


def _prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The chat prompt's ids as the gateway sends them: it renders the template and tokenizes itself."""
    return tokenizer.encode_chat([{"role": "user", "content": prompt}])


def test_greedy_ids_equal_tandems_streamed_and_not(front_doors, stub, tokenizer):
    for prompt in PROMPTS[:2]:
        [expected] = run_requests(front_doors.address, [greedy_request(prompt, MAX_TOKENS)])
        ids = _prompt_ids(tokenizer, prompt)
        responses = list(stub.Generate(_request(ids, temperature=0.0, max_tokens=MAX_TOKENS), timeout=60))
        chunks = [r.chunk for r in responses if r.HasField("chunk")]
        [complete] = [r.complete for r in responses if r.HasField("complete")]
        assert responses[-1].HasField("complete")
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert all(c.prompt_tokens == len(ids) and c.completion_tokens == len(c.token_ids) for c in chunks)
        assert complete.finish_reason == expected.finish_reason
        assert complete.prompt_tokens == len(ids) and complete.completion_tokens == len(expected.token_ids)
        whole = list(stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=MAX_TOKENS), timeout=60))
        assert len(whole) == 1 and list(whole[0].complete.output_ids) == expected.token_ids


def test_the_complete_message_names_the_stop_that_matched(stub, tokenizer):
    ids = _prompt_ids(tokenizer, PROMPTS[4])
    [by_string] = [r.complete for r in stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=48,
                                                              stop=["lazy"]), timeout=60)]
    assert by_string.finish_reason == "stop" and by_string.matched_stop_str == "lazy"
    free = [r.complete for r in stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=8), timeout=60)]
    third = free[0].output_ids[2]
    [by_token] = [r.complete for r in stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=8,
                                                             stop_token_ids=[third]), timeout=60)]
    assert by_token.matched_token_id == third and list(by_token.output_ids) == list(free[0].output_ids[:3])
    assert free[0].finish_reason == "length" and free[0].WhichOneof("matched_stop") is None


def test_min_tokens_and_include_stop_str_in_output_are_served(front_doors, stub, tokenizer):
    prompt = "Answer with one word: is water wet?"
    [free] = run_requests(front_doors.address, [greedy_request(prompt, 64)])
    [held] = run_requests(front_doors.address, [greedy_request(prompt, 64, min_tokens=len(free.token_ids) + 8)])
    ids = _prompt_ids(tokenizer, prompt)
    [complete] = [r.complete for r in stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=64,
                                                             min_tokens=len(free.token_ids) + 8), timeout=60)]
    assert list(complete.output_ids) == held.token_ids
    stop = free.text[:2]
    [kept] = [r.complete for r in stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=64,
                                                         stop=[stop], include_stop_str_in_output=True), timeout=60)]
    assert complete.finish_reason in ("stop", "length") and kept.finish_reason == "stop"
    assert tokenizer.decode(list(kept.output_ids), skip_special_tokens=True).startswith(stop)


@pytest.fixture(scope="module")
def speculating_stub(shared_drafter, tmp_path_factory):
    """A target of its own that verifies drafts at every step (--sync-speculation): whether a request
    speculates then does not hang on what the shared target's policy learned from other tests' chats."""
    target = ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "512", "--sync-speculation",
                                               "--drafter", shared_drafter.address],
                            log_path=tmp_path_factory.mktemp("sync-target") / "target.log")
    try:
        target.start().wait_healthy().wait_metric("tandem_drafter_connected", 1)
        with grpc.insecure_channel(target.address) as channel:
            yield vllm_engine_pb2_grpc.VllmEngineStub(channel), target
    finally:
        target.kill()


def test_speculation_counts_arrive_in_the_complete_message(speculating_stub, tokenizer):
    stub, target = speculating_stub
    ids = tokenizer.encode("Repeat: " + " ".join(["alpha beta gamma delta"] * 6))
    [complete] = [r.complete for r in stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=48),
                                                    timeout=60)]
    assert complete.spec_draft_tokens >= complete.spec_accepted_tokens > 0
    samples = scrape(target.metrics_url)  # the request's counts are the target's: it served no other
    assert complete.spec_draft_tokens == metric(samples, "tandem_spec_decode_num_draft_tokens_total")
    assert complete.spec_accepted_tokens == metric(samples, "tandem_spec_decode_num_accepted_tokens_total")


def test_structured_output_maps_onto_the_constraint(stub, tokenizer):
    ids = _prompt_ids(tokenizer, "Is the sky blue?")
    choice = vllm_engine_pb2.ChoiceConstraint(choices=["yes", "no"])
    [complete] = [r.complete for r in stub.Generate(_request(ids, stream=False, max_tokens=8, choice=choice),
                                                    timeout=60)]
    text = tokenizer.decode(complete.output_ids, skip_special_tokens=True)
    assert text in ("yes", "no")
    schema = json.dumps({"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]})
    [complete] = [r.complete for r in stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=64,
                                                             json_schema=schema), timeout=60)]
    assert complete.finish_reason == "stop"
    answer = json.loads(tokenizer.decode(complete.output_ids, skip_special_tokens=True))
    assert isinstance(answer["answer"], bool)


@pytest.mark.parametrize("sampling, field", [
    (dict(frequency_penalty=2.5), "sampling_params.frequency_penalty"),
    (dict(presence_penalty=-3.0), "sampling_params.presence_penalty"),
    (dict(repetition_penalty=2.5), "sampling_params.repetition_penalty"),
    (dict(logit_bias={-5: 1.0}), "sampling_params.logit_bias"),
    (dict(logit_bias={10**8: 1.0}), "sampling_params.logit_bias"),
    (dict(logit_bias={5: 101.0}), "sampling_params.logit_bias"),
    (dict(min_tokens=9, max_tokens=4), "sampling_params.min_tokens"),
    (dict(n=999), "sampling_params.n"),
    (dict(logprobs=-1), "sampling_params.logprobs"),
    (dict(logprobs=21), "sampling_params.logprobs"),
    (dict(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),
    (dict(prompt_logprobs=21), "sampling_params.prompt_logprobs"),
    (dict(truncate_prompt_tokens=8), "sampling_params.truncate_prompt_tokens"),
    (dict(structural_tag="{}"), "sampling_params.structural_tag"),
    (dict(temperature=-1.0), "sampling_params.temperature"),
    (dict(top_p=1.5), "sampling_params.top_p"),
    (dict(max_tokens=10**6), "sampling_params.max_tokens"),
    (dict(stop_token_ids=[10**8]), "sampling_params.stop_token_ids"),
    (dict(regex="(unclosed"), "sampling_params.regex"),
    (dict(json_schema="{not json"), "sampling_params.json_schema"),
])
def test_fields_not_served_or_out_of_range_are_invalid_argument_naming_them(stub, sampling, field):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request([1, 2, 3], **sampling), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field), info.value.details()


@pytest.mark.parametrize("request_fields, field", [
    (dict(tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[10**8])), "tokenized.input_ids"),
    (dict(tokenized=vllm_engine_pb2.TokenizedInput()), "tokenized.input_ids"),
    (dict(data_parallel_rank=1), "data_parallel_rank"),
    (dict(kv_transfer_params_json="{}"), "kv_transfer_params_json"),
    (dict(mm_inputs=vllm_engine_pb2.MultimodalInputs()), "mm_inputs"),
])
def test_request_fields_not_served_are_invalid_argument(stub, request_fields, field):
    request = _request([1, 2, 3])
    for name, value in request_fields.items():
        if isinstance(value, (int, str)):
            setattr(request, name, value)
        else:
            getattr(request, name).CopyFrom(value)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field), info.value.details()


def test_a_text_prompt_is_taken_too(stub):
    request = _request([], temperature=0.0, max_tokens=4)
    request.text = "The capital of France is"
    assert [r for r in stub.Generate(request, timeout=60) if r.HasField("complete")]


def test_requests_without_an_id_run_side_by_side(front_doors):
    async def two_at_once():
        async with grpc.aio.insecure_channel(front_doors.address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

            async def one() -> list:
                return [r async for r in stub.Generate(_request([1, 2, 3], request_id="", max_tokens=6))]

            return await asyncio.gather(one(), one())

    for responses in asyncio.run(two_at_once()):
        assert responses[-1].HasField("complete")


def test_a_running_id_is_refused_again_and_an_abort_call_ends_it_cancelled(front_doors):
    async def run_then_abort():
        async with grpc.aio.insecure_channel(front_doors.address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            call = stub.Generate(_request([1, 2, 3, 4], request_id="abort-me", max_tokens=400, ignore_eos=True))
            async for _ in call:
                break
            with pytest.raises(grpc.aio.AioRpcError) as again:
                async for _ in stub.Generate(_request([1, 2, 3], request_id="abort-me", max_tokens=2)):
                    pass
            await stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["abort-me", "never-seen"]))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in call:
                    pass
            return again.value.code(), ended.value.code()

    before = metric(scrape(front_doors.metrics_url), "tandem_request_success_total", finish_reason="abort")
    # CANCELLED, not UNAVAILABLE: a gateway would retry that elsewhere
    assert asyncio.run(run_then_abort()) == (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.CANCELLED)
    samples = scrape(front_doors.metrics_url)
    assert metric(samples, "tandem_request_success_total", finish_reason="abort") == before + 1
    assert metric(samples, "tandem_num_requests_running") == 0 and metric(samples, "tandem_num_requests_waiting") == 0


def test_health_model_server_info_and_loads(front_doors, stub):
    health = stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10)
    assert health.healthy
    info = stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10)
    assert info.is_generation and info.served_model_name == "smollm2-135m" and info.max_context_length == 512
    assert info.vocab_size == 49152 and 2 in info.eos_token_ids and info.architectures == ["LlamaForCausalLM"]
    server = stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=10)
    assert server.max_num_seqs == 8 and server.data_parallel_size == 1 and not server.is_paused
    # the embedded GGUF in its blocks computes in bf16 and keeps its KV in fp16: not vLLM's "auto"
    assert (server.block_size, server.model_dtype, server.kv_cache_dtype) == (16, "bfloat16", "float16")
    loads = stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(include=["core"]), timeout=10)
    [load] = loads.loads
    assert loads.dp_rank_count == 1 and load.max_running_requests == 8 and 0 <= load.token_usage < 1


def test_the_tokenizer_bundle_rebuilds_the_served_tokenizer(stub, tokenizer, tmp_path):
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    bundle = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(bundle).hexdigest()
    zipfile.ZipFile(io.BytesIO(bundle)).extractall(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= {
        p.name for p in tmp_path.iterdir()}
    rebuilt, served = Tokenizer.from_dir(tmp_path), tokenizer
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, café?"}]
    assert rebuilt.encode_chat(chat) == served.encode_chat(chat)
    assert rebuilt.encode("naïve  text\n\tx") == served.encode("naïve  text\n\tx")
    assert rebuilt.eos_token_ids == served.eos_token_ids
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.parametrize("call, request_message", [
    ("Embed", vllm_engine_pb2.EmbedRequest()),
    ("StartProfile", common_pb2.StartProfileRequest()),
    ("StopProfile", common_pb2.StopProfileRequest()),
])
def test_what_is_not_served_is_unimplemented_with_a_reason(stub, call, request_message):
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, call)(request_message, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and info.value.details()


class _Subscription:
    """A KV event stream read on a thread, as the gateway reads it."""

    def __init__(self, stub, start_sequence_number: int = 0):
        request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=start_sequence_number)
        self.call = stub.SubscribeKvEvents(request, timeout=120)
        self.batches: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.put(batch)
        except grpc.RpcError as err:
            self.batches.put(err)

    def next(self, timeout: float = 60) -> common_pb2.KvEventBatch:
        item = self.batches.get(timeout=timeout)
        if isinstance(item, grpc.RpcError):
            raise item
        return item

    def flush(self, stub) -> common_pb2.KvEventBatch:
        """Flush the cache, again until this stream shows the cleared event (the server may take the
        subscription after the first flush); the batch that shows it."""
        while True:
            assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=60), timeout=90).success
            try:
                batch = self.next(timeout=2)
            except queue.Empty:
                continue
            assert [e.WhichOneof("data") for e in batch.events] == ["cleared"]
            return batch

    def stored(self, until: list[int]) -> list[common_pb2.KvBlocksStored]:
        """The stored events, read until their blocks' tokens start with `until`."""
        stored = []
        while [t for e in stored for b in e.blocks for t in b.token_ids][: len(until)] != until:
            stored += [event.stored for event in self.next().events if event.HasField("stored")]
        return stored


def test_kv_events_report_the_blocks_a_prompt_filled_and_a_flush(stub, tokenizer):
    """Subscribed like the gateway, a flush shows as a cleared event; a prompt's full blocks are then
    stored, chained by their parents; a flush when idle forgets them: the prompt finds nothing cached."""
    ids = _prompt_ids(tokenizer, "Name three rivers of Europe and one fact about each of them, please.")
    full = len(ids) // 16 * 16
    events = _Subscription(stub)
    try:
        assert events.flush(stub).sequence_number > 0
        list(stub.Generate(_request(ids, temperature=0.0, max_tokens=4), timeout=60))
        stored = events.stored(ids[:full])
        blocks = [b for e in stored for b in e.blocks]
        assert all(b.block_size == 16 and len(b.token_ids) == 16 for b in blocks)
        assert len({b.block_hash for b in blocks}) == len(blocks) >= full // 16
        assert not stored[0].HasField("parent_block_hash")
        assert [e.parent_block_hash for e in stored[1:]] == [e.blocks[-1].block_hash for e in stored[:-1]]
        [again] = [r.complete for r in stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=4),
                                                      timeout=60)]
        assert again.cached_tokens == (len(ids) - 1) // 16 * 16
        assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=60), timeout=90).success
        while not any(e.HasField("cleared") for e in events.next().events):
            pass  # the second request's batches come first
        [flushed] = [r.complete for r in stub.Generate(_request(ids, stream=False, temperature=0.0, max_tokens=4),
                                                        timeout=60)]
        assert flushed.cached_tokens == 0
    finally:
        events.call.cancel()


@pytest.mark.parametrize("timeout_s", [-1.0, float("nan"), float("inf")])
def test_a_flush_with_a_bad_timeout_is_invalid_argument(stub, timeout_s):
    with pytest.raises(grpc.RpcError) as info:
        stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=timeout_s), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s must be" in info.value.details()


def test_kv_events_resume_after_the_last_batch_applied_or_are_out_of_range(stub, tokenizer):
    events = _Subscription(stub)
    try:
        cursor = events.flush(stub).sequence_number
        list(stub.Generate(_request(_prompt_ids(tokenizer, PROMPTS[3]), temperature=0.0, max_tokens=4), timeout=60))
        following = events.next().sequence_number
    finally:
        events.call.cancel()
    resumed = _Subscription(stub, start_sequence_number=cursor)
    try:
        assert following == cursor + 1 and resumed.next().sequence_number == following
    finally:
        resumed.call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        _Subscription(stub, start_sequence_number=10**9).next()
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE and "subscribe with 0" in info.value.details()


def test_undecodable_bytes_are_invalid_argument(front_doors):
    """Bad UTF-8 in request_id: grpc would answer UNKNOWN without the interceptor."""
    wire = _request([1, 2]).SerializeToString() + b"\x0a\x02\xff\xfe"  # field 1 (request_id), 2 bad bytes
    with grpc.insecure_channel(front_doors.address) as channel:
        call = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate",
                                    request_serializer=lambda raw: raw,
                                    response_deserializer=vllm_engine_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(call(wire, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
