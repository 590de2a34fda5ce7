"""The target service alone, as a real process: greedy output, bad input, cancellation, metrics."""
from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import torch

from tests.support.service_fixtures import PROMPTS, call_error, greedy_request, metric, run_requests, scrape, timed_responses
from bench.greedy import greedy_generate
from tandem.launch import ServiceProcess
from tandem.model.llama import build_model
from tandem.runtime import load_tokenizer
from tandem.v1 import generation_pb2, generation_pb2_grpc

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    log = tmp_path_factory.mktemp("target") / "target.log"
    service = ServiceProcess("target_service", ["--threads", "2", "--max-model-len", "512", "--max-queue", "4",
                                                "--dtype", "float32"],  # as the reference loop
                             log_path=log).start()
    try:
        yield service.wait_healthy()
    finally:
        service.kill()


@pytest.fixture(scope="module")
def reference(smollm2_checkpoint, smollm2_path):
    """Greedy continuations from the plain reference loop, in this process."""
    config, weights = smollm2_checkpoint
    model = build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"), num_slots=1,
                        max_model_len=512)
    tokenizer = load_tokenizer(smollm2_path)

    def continuation(prompt: str) -> list[int]:
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return greedy_generate(model, ids, MAX_TOKENS, stop_token_ids=tokenizer.eos_token_ids)

    return continuation


def test_greedy_output_equals_the_reference_loop(target, reference):
    prompts = PROMPTS[:3]
    results = run_requests(target.address, [greedy_request(p, MAX_TOKENS) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference(prompt), prompt
        assert result.finish_reason in ("stop", "length")
        assert result.text


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=2.0), "min_p"),
        (dict(stop=[""]), "stop[0]"),
    ],
)
def test_bad_sampling_parameters_are_invalid_argument(target, params, field):
    request = generation_pb2.GenerateRequest(prompt="hi", sampling_params=generation_pb2.SamplingParams(**params))
    err = call_error(target.address, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()


@pytest.mark.parametrize("temperature", [1e-40, 9e-6])
def test_temperatures_below_1e_5_are_greedy(target, reference, temperature):
    """logits / 1e-40 overflows: such a request must be greedy, not a stream of NaN draws."""
    request = greedy_request(PROMPTS[0], MAX_TOKENS, seed=5)
    request.sampling_params.temperature = temperature
    [result] = run_requests(target.address, [request])
    assert result.token_ids == reference(PROMPTS[0])
    assert result.text


def test_bad_prompts_are_invalid_argument_and_the_next_request_works(target, reference):
    cases = [
        (generation_pb2.GenerateRequest(prompt=""), "prompt"),
        (generation_pb2.GenerateRequest(), "input"),
        (generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds(ids=[1] * 600)), "max_model_len"),
        (generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds(ids=[10**6])), "vocabulary"),
        (generation_pb2.GenerateRequest(prompt="hi", model="gpt-9"), "model"),
        (generation_pb2.GenerateRequest(chat=generation_pb2.ChatMessages()), "chat.messages"),
    ]
    for request, words in cases:
        err = call_error(target.address, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert words in err.details()
    [result] = run_requests(target.address, [greedy_request(PROMPTS[0], MAX_TOKENS)])
    assert result.token_ids == reference(PROMPTS[0])


def test_stop_strings_and_max_tokens(target, reference):
    full = run_requests(target.address, [greedy_request(PROMPTS[0], MAX_TOKENS)])[0]
    stop = full.text.split()[2]  # a word from the middle of the greedy answer
    stopped, short = run_requests(target.address, [
        greedy_request(PROMPTS[0], MAX_TOKENS, stop=[stop]),
        greedy_request(PROMPTS[0], 3),
    ])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:3]


def test_a_request_that_ends_on_its_prefill_token_ends_before_the_next_decode(target):
    """Its last message must not wait for the step that decodes the requests already running."""

    async def scenario():
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            running: list[float] = []

            async def read_running():
                async for _ in stub.Generate(greedy_request(PROMPTS[1], 40, ignore_eos=True)):
                    running.append(time.monotonic())

            reader = asyncio.create_task(read_running())
            while not running:
                await asyncio.sleep(0.005)
            short = await timed_responses(stub, greedy_request(PROMPTS[0], 1))
            await reader
            return short, running

    short, running = asyncio.run(scenario())
    (token_at, token), (ended_at, last) = short
    assert len(token.token_ids) == 1 and last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert [t for t in running if token_at < t < ended_at] == [], "a decode step ran before the last message"


def test_cancelled_stream_frees_the_sequence(target):
    async def cancel_midway():
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(greedy_request(PROMPTS[1], 200, ignore_eos=True))
            async for _ in call:
                break
            call.cancel()

    asyncio.run(cancel_midway())
    deadline = time.monotonic() + 30
    while metric(scrape(target.metrics_url), "tandem_num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    samples = scrape(target.metrics_url)
    assert metric(samples, "tandem_num_requests_running") == 0
    assert metric(samples, "tandem_request_success_total", finish_reason="abort") >= 1


def test_counters_agree_with_what_the_client_saw(target):
    before = scrape(target.metrics_url)
    results = run_requests(target.address, [greedy_request(p, 8) for p in PROMPTS[3:5]])
    after = scrape(target.metrics_url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("tandem_generation_tokens_total") == sum(len(r.token_ids) for r in results)
    assert delta("tandem_prompt_tokens_total") == sum(r.prompt_tokens for r in results)
    assert delta("tandem_request_success_total") == len(results)
    assert delta("tandem_time_to_first_token_seconds_count") == len(results)


def test_full_queue_is_resource_exhausted(target):
    """8 running + 4 waiting fit (--max-queue 4); the rest of 20 concurrent requests are refused."""

    async def flood():
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one():
                try:
                    async for _ in stub.Generate(greedy_request(PROMPTS[0], 64, ignore_eos=True)):
                        pass
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as err:
                    return err.code(), err.details()

            return await asyncio.gather(*(one() for _ in range(20)))

    outcomes = asyncio.run(flood())
    refused = [o for o in outcomes if o != grpc.StatusCode.OK]
    assert refused, "no request was refused"
    assert all(code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-queue" in details for code, details in refused)
    assert outcomes.count(grpc.StatusCode.OK) >= 12


DRAINED_TOKENS = 200


def test_sigterm_drains_running_requests_and_refuses_new_ones(tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    service = ServiceProcess("target_service", ["--threads", "2", "--max-model-len", "512", "--grace-seconds", "60"],
                             log_path=tmp_path / "target.log").start().wait_healthy()
    try:
        async def scenario():
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                # Long enough to outlast the checks below on a fast CPU (40 tokens took under 0.5 s).
                call = stub.Generate(greedy_request(PROMPTS[1], DRAINED_TOKENS, ignore_eos=True))
                first = await call.read()
                service.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                try:
                    await stub.Generate(greedy_request(PROMPTS[0], 4)).read()
                    refused = None
                except grpc.aio.AioRpcError as err:
                    refused = err.code()
                tokens, finish = list(first.token_ids), 0
                while (response := await call.read()) is not grpc.aio.EOF:
                    tokens.extend(response.token_ids)
                    finish = response.finish_reason
                return health.status, refused, tokens, finish

        status, refused, tokens, finish = asyncio.run(scenario())
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert refused == grpc.StatusCode.UNAVAILABLE
        assert len(tokens) == DRAINED_TOKENS and finish == generation_pb2.FINISH_REASON_LENGTH
        assert service.process.wait(60) == 0
    finally:
        service.kill()


def test_a_drain_aborts_waiting_requests_without_prefilling_them(tmp_path):
    """One slot: a request waits behind a long one; past the grace period the drain aborts both."""
    service = ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "512", "--max-num-seqs", "1",
                                                "--grace-seconds", "1"], log_path=tmp_path / "target.log")
    service.start().wait_healthy()
    try:
        async def scenario():
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                running = stub.Generate(greedy_request(PROMPTS[1], 400, ignore_eos=True))
                await running.read()
                waiting = asyncio.create_task(timed_responses(stub, greedy_request(PROMPTS[0], 16)))
                while metric(scrape(service.metrics_url), "tandem_num_requests_waiting") < 1:
                    await asyncio.sleep(0.02)
                service.process.send_signal(signal.SIGTERM)
                while (response := await running.read()) is not grpc.aio.EOF:
                    running_last = response
                return running_last, [response for _, response in await waiting]

        running_last, waiting = asyncio.run(scenario())
        assert running_last.finish_reason == generation_pb2.FINISH_REASON_ABORT
        assert [list(r.token_ids) for r in waiting] == [[]], "the drain prefilled a request it had aborted"
        assert waiting[-1].finish_reason == generation_pb2.FINISH_REASON_ABORT
        assert service.process.wait(60) == 0
    finally:
        service.kill()


def test_stop_token_ids_end_the_sequence_at_that_token(target):
    full = run_requests(target.address, [greedy_request(PROMPTS[0], MAX_TOKENS)])[0]
    stop_id = full.token_ids[3]
    [stopped] = run_requests(target.address, [greedy_request(PROMPTS[0], MAX_TOKENS, stop_token_ids=[stop_id])])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


def test_reflection_and_model_info(target):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(target.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        services = {s.name for s in reply.list_services_response.service}
        info = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest())
    assert {"tandem.v1.Generation", "grpc.health.v1.Health"} <= services
    assert info.model == "smollm2-135m" and info.vocab_size == 49152 and info.max_model_len == 512
    assert not info.drafter_connected
