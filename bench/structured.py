"""Structured output with and without speculation: the JSON-extraction prompts, each under its schema.

    python -m bench.structured [--drafters suffix+model ngram model] [--max-tokens 256] [--dtype bfloat16]

For each drafter it starts a draft service and a target (one thread each, as deployed), warms both
up, then sends the 8 prompts of bench/prompts/json_extraction.jsonl one at a time, greedy, six
ways: without a constraint, under the prompt's schema, and under it as compact JSON
(disable_any_whitespace, whose forced keys and punctuation the drafter fast-forwards), each by the
target alone and by the async pair. It prints tokens/s of each, the pair ÷ alone ratio of each,
the mean acceptance length, the share of steps that found no usable draft (misses), how many
outputs were identical to the target alone's and how many constrained ones validate.

Then the mean acceptance length along the same tokens, the schema's outputs, replayed on fresh
draft services (bench/drafter_mal.py) with the sequence opened without and with the schema: what
the constraint does to drafting itself, apart from the outputs it changes. Then, from the
target's metrics, its mean decode step with and without the schema (the cost of masking on the
step) and the time its mask thread spent per step, and the schemas' compile time on a fresh
compiler.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import jsonschema

from bench.drafter_mal import Case
from bench.drafter_mal import measure as measure_mal
from bench.prompt_set import JsonPrompt, load_json_prompts
from bench.serve import DRAFTERS
from tandem.client import GenerationResult, generate
from tandem.launch import ServiceProcess
from tandem.metrics_scrape import Sample, metric, scrape
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from tandem.runtime import load_tokenizer, tokenizer_path
from tandem.structured import Constraint, GrammarCompiler
from tandem.v1 import generation_pb2, generation_pb2_grpc, structured_pb2

K = 4  # the target's default draft tokens per step
# Without a constraint; under the prompt's schema; under it as compact JSON (disable_any_whitespace).
CONSTRAINTS = ("none", "schema", "compact")


@dataclass(frozen=True, slots=True)
class Run:
    """One pass over the prompts: their results, wall seconds, and the target's metrics around it."""

    results: list[GenerationResult]
    seconds: float
    before: list[Sample]
    after: list[Sample]

    @property
    def tok_s(self) -> float:
        return sum(len(r.token_ids) for r in self.results) / self.seconds

    def delta(self, name: str, **labels: str) -> float:
        return metric(self.after, name, **labels) - metric(self.before, name, **labels)

    @property
    def mal(self) -> float:
        steps = self.delta("tandem_spec_decode_num_drafts_total")
        return 1 + self.delta("tandem_spec_decode_num_accepted_tokens_total") / max(1.0, steps)

    @property
    def miss_share(self) -> float:
        """The share of a speculating sequence's steps that had no usable draft."""
        steps, misses = self.delta("tandem_spec_decode_num_drafts_total"), self.delta("tandem_draft_miss_total")
        return misses / max(1.0, steps + misses)


def _request(ids: list[int], prompt: JsonPrompt, constraint: str, speculate: bool,
             max_tokens: int) -> generation_pb2.GenerateRequest:
    """constraint: one of CONSTRAINTS."""
    params = generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, speculate=speculate)
    if constraint != "none":
        params.structured_outputs.CopyFrom(structured_pb2.StructuredOutputs(
            json=json.dumps(prompt.schema), disable_any_whitespace=constraint == "compact"))
    return generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds(ids=ids), sampling_params=params)


async def _one_at_a_time(address: str, requests: list[generation_pb2.GenerateRequest]) -> list[GenerationResult]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [await generate(stub, request) for request in requests]


def run(target: ServiceProcess, requests: list[generation_pb2.GenerateRequest]) -> Run:
    before = scrape(target.metrics_url)
    began = time.perf_counter()
    results = asyncio.run(_one_at_a_time(target.address, requests))
    seconds = time.perf_counter() - began
    return Run(results, seconds, before, scrape(target.metrics_url))


def valid(prompts: list[JsonPrompt], results: list[GenerationResult]) -> int:
    count = 0
    for prompt, result in zip(prompts, results):
        try:
            jsonschema.validate(json.loads(result.text), prompt.schema)
            count += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return count


def measure(drafter: str, args: argparse.Namespace, prompts: list[JsonPrompt], ids: list[list[int]],
            logs: Path) -> None:
    draft_model = args.draft_model if "model" in drafter else args.model
    draft = ServiceProcess("draft_service", ["--model", draft_model, "--drafter", drafter, "--threads", "1"],
                           log_path=logs / f"draft-{drafter}.log").start()
    target = ServiceProcess("target_service", ["--model", args.model, "--dtype", args.dtype, "--threads", "1",
                                               "--drafter", draft.address], log_path=logs / f"target-{drafter}.log").start()
    runs: dict[tuple[str, bool], Run] = {}
    try:
        draft.wait_healthy(300)
        target.wait_healthy(300)
        target.wait_metric("tandem_drafter_connected", 1.0)
        warm = [_request(i, p, c, s, 32) for i, p in zip(ids[:2], prompts[:2]) for c in CONSTRAINTS
                for s in (False, True)]
        asyncio.run(_one_at_a_time(target.address, warm))
        for constraint in CONSTRAINTS:
            for speculate in (False, True):
                requests = [_request(i, p, constraint, speculate, args.max_tokens) for i, p in zip(ids, prompts)]
                runs[constraint, speculate] = run(target, requests)
    finally:
        target.terminate(10)
        draft.terminate(10)
    same_text = replay_under_constraints(drafter, draft_model, prompts, ids, runs["schema", False].results, logs)
    for constraint in CONSTRAINTS:
        alone, pair = runs[constraint, False], runs[constraint, True]
        same = sum(a.token_ids == p.token_ids for a, p in zip(alone.results, pair.results))
        validity = "-" if constraint == "none" else f"{valid(prompts, pair.results)}/{len(prompts)}"
        print(f"| {drafter} | {constraint} | {alone.tok_s:.1f} | {pair.tok_s:.1f} | "
              f"{pair.tok_s / alone.tok_s:.2f} | {pair.mal:.2f} | {pair.miss_share:.0%} | {same}/{len(prompts)} | "
              f"{validity} |", flush=True)
    print(f"|   | same text (the constrained outputs, replayed on the drafter): MAL {same_text[False]:.2f} opened "
          f"without the schema, {same_text[True]:.2f} with it | | | | | | | |", flush=True)
    free, alone = runs["none", False], runs["schema", False]
    masks = alone.delta("tandem_grammar_mask_seconds_sum") / max(1.0, alone.delta("tandem_grammar_mask_seconds_count"))
    step, free_step = decode_step(alone), decode_step(free)
    print(f"|   | target alone, decode step: {step * 1e3:.2f} ms constrained, {free_step * 1e3:.2f} ms without "
          f"({step / free_step - 1:+.1%}); the mask thread's work: {masks * 1e6:.0f} us a step | | | | | | | |", flush=True)


def replay_under_constraints(drafter: str, draft_model: str, prompts: list[JsonPrompt], ids: list[list[int]],
                             outputs: list[GenerationResult], logs: Path) -> dict[bool, float]:
    """MAL along the same tokens (the target's constrained outputs), the drafter told of the schema or not.

    Each on a fresh draft service without the suffix drafter's shared cache, which would otherwise
    hold these very outputs and copy them."""
    cases = [Case("json", prompt_ids, result.token_ids) for prompt_ids, result in zip(ids, outputs)]
    schemas = [structured_pb2.StructuredOutputs(json=json.dumps(p.schema)) for p in prompts]
    mal = {}
    for told in (False, True):
        draft = ServiceProcess("draft_service", ["--model", draft_model, "--drafter", drafter, "--threads", "1",
                                                 "--suffix-cache-tokens", "0"],
                               log_path=logs / f"replay-{drafter}-{told}.log").start()
        try:
            draft.wait_healthy(300)
            mal[told] = asyncio.run(measure_mal(draft.address, cases, K, schemas if told else None))["all"]
        finally:
            draft.terminate(10)
    return mal


def decode_step(run: Run) -> float:
    """Mean seconds of the run's decode steps."""
    return run.delta("tandem_step_duration_seconds_sum", kind="decode") / max(
        1.0, run.delta("tandem_step_duration_seconds_count", kind="decode"))


def compile_times(model: str, prompts: list[JsonPrompt]) -> list[float]:
    """Seconds to compile each schema on a fresh compiler (no cache), with its first mask."""
    tokenizer = load_tokenizer(tokenizer_path(model))
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    return [compiler.compile(Constraint("json", json.dumps(p.schema))).compile_seconds for p in prompts]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=["suffix+model", "ngram", "model"])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    args = parser.parse_args(argv)
    prompts = load_json_prompts()
    tokenizer = load_tokenizer(tokenizer_path(args.model))
    ids = [tokenizer.encode_chat(p.as_dicts()) for p in prompts]
    times = compile_times(args.model, prompts)
    logs = Path(tempfile.mkdtemp(prefix="tandem-structured-"))
    print(f"{args.model} {args.dtype}, 1 + 1 threads, {len(prompts)} JSON-extraction prompts, greedy, "
          f"{args.max_tokens} max tokens, one at a time (logs: {logs})")
    print(f"schema compile times (fresh compiler, first mask included): mean {statistics.mean(times) * 1e3:.1f} ms, "
          f"max {max(times) * 1e3:.1f} ms")
    print("| drafter | constraint | alone tok/s | pair tok/s | pair / alone | MAL | misses | identical | valid |")
    print("|---|---|---|---|---|---|---|---|---|")
    for drafter in args.drafters:
        measure(drafter, args, prompts, ids, logs)


if __name__ == "__main__":
    main()
