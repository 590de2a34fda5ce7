"""Structured output on real services over loopback: valid output, lossless under speculation, bad input.

Every output of the bench's JSON-extraction schemas (nested objects, enums, arrays, numbers,
strings with patterns) parses and validates with jsonschema, greedy and sampled, with and without
speculation, under the model drafter and the n-gram drafter; greedy output is token-identical with
and without speculation; a chi-square test compares the sampled distribution over a choice grammar
with and without speculation; a hostile drafter's forbidden drafts are rejected.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from concurrent import futures

import grpc
import jsonschema
import pytest
from scipy import stats

from bench.prompt_set import load_json_prompts
from tests.support.pairs import restart_drafter, start_pair
from tests.support.service_fixtures import call_error, greedy_request, metric, run_requests, scrape, target_with_drafter
from tandem.launch import ServiceProcess
from tandem.runtime import load_tokenizer
from tandem.v1 import drafter_pb2, drafter_pb2_grpc, generation_pb2, structured_pb2

MAX_TOKENS = 400
JSON_PROMPTS = load_json_prompts()
CHOICES = ["dark red paint", "dark green paint", "light blue paint", "light grey paint", "warm yellow paint"]

# ngram_pair and model_pair (tests/system/conftest.py) take both cores: the long JSON outputs take half the time.


def _json_request(prompt, speculate: bool, temperature: float, seed: int) -> generation_pb2.GenerateRequest:
    """Sampled with speculation, in drafter-invariant mode: its tokens are then the target alone's
    for the same seed, so the test checks exactly the outputs it validated alone. In the default
    mode only their distribution is the same (the choice chi-square below tests that), and an
    unlucky draw may run whitespace up to MAX_TOKENS, which the JSON grammar allows."""
    request = greedy_request(prompt.messages[0][1], MAX_TOKENS, speculate=speculate, seed=seed,
                             drafter_invariant=speculate and temperature > 0,
                             structured_outputs=structured_pb2.StructuredOutputs(json=json.dumps(prompt.schema)))
    request.sampling_params.temperature = temperature
    return request


def _accepted(target: ServiceProcess) -> float:
    return metric(scrape(target.metrics_url), "tandem_spec_decode_num_accepted_tokens_total")


def _check_valid(results, temperature: float) -> None:
    for prompt, result in zip(JSON_PROMPTS, results):
        context = f"{prompt.id} T={temperature}: {result.text!r}"
        assert result.finish_reason == "stop", context
        jsonschema.validate(json.loads(result.text), prompt.schema)


def _json_runs(target: ServiceProcess, speculate: bool) -> dict[float, list]:
    """Every JSON prompt, greedy and sampled, each its own seed."""
    return {temperature: run_requests(target.address, [_json_request(p, speculate, temperature, seed=i)
                                                       for i, p in enumerate(JSON_PROMPTS)])
            for temperature in (0.0, 0.8)}


@pytest.fixture(scope="module")
def json_alone(ngram_pair) -> dict[float, list]:
    """The target alone's outputs. Both pairs' targets serve the same model in the same dtype, and a
    row's logits do not depend on its batch, so one run serves as the reference for both."""
    return _json_runs(ngram_pair[1], speculate=False)


def test_every_output_of_the_target_alone_validates(json_alone):
    for temperature, results in json_alone.items():
        _check_valid(results, temperature)


# The model drafter's run is a long one (-m slow): its grammar-fitted drafts are also checked by the
# unit tests in tests/tandem/test_structured_outputs.py and verified by the choice test below.
@pytest.mark.parametrize("pair", [pytest.param("model_pair", marks=pytest.mark.slow), "ngram_pair"])
def test_speculation_gives_the_validated_outputs_of_the_target_alone(pair, request, json_alone):
    """Greedy, and sampled in drafter-invariant mode: token for token the outputs validated alone."""
    _, target = request.getfixturevalue(pair)
    before = _accepted(target)
    for temperature, results in _json_runs(target, speculate=True).items():
        assert [r.token_ids for r in results] == [r.token_ids for r in json_alone[temperature]], temperature
    assert _accepted(target) > before, "no draft was accepted: speculation did not run"


def _outside_strings(text: str) -> str:
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_compact_json_has_no_whitespace_and_the_drafter_fast_forwards_it(ngram_pair):
    """disable_any_whitespace: outputs validate with no whitespace outside strings, greedy speculation is
    token-identical, and drafts are accepted (the grammar's forced keys and punctuation)."""
    _, target = ngram_pair

    def request(prompt, speculate: bool) -> generation_pb2.GenerateRequest:
        return greedy_request(prompt.messages[0][1], MAX_TOKENS, speculate=speculate,
                              structured_outputs=structured_pb2.StructuredOutputs(
                                  json=json.dumps(prompt.schema), disable_any_whitespace=True))

    prompts = JSON_PROMPTS[:4]
    alone = run_requests(target.address, [request(p, False) for p in prompts])
    speculative = run_requests(target.address, [request(p, True) for p in prompts])
    for prompt, a, s in zip(prompts, alone, speculative):
        assert s.token_ids == a.token_ids, prompt.id
        jsonschema.validate(json.loads(s.text), prompt.schema)
        assert not re.search(r"\s", _outside_strings(s.text)), s.text
    assert sum(s.accepted_tokens for s in speculative) > 0


def _choice_request(seed: int, speculate: bool) -> generation_pb2.GenerateRequest:
    # A plain prompt, 12 tokens where the chat template makes 40: 600 prefills are most of the test's time.
    return generation_pb2.GenerateRequest(
        prompt="Which paint should I buy for my kitchen wall? Answer:",
        sampling_params=generation_pb2.SamplingParams(
            temperature=1.0, seed=seed, max_tokens=16, speculate=speculate,
            structured_outputs=structured_pb2.StructuredOutputs(choice=structured_pb2.Choices(choices=CHOICES))))


def test_sampled_choices_follow_the_same_distribution_with_speculation(model_pair):
    """Chi-square on the choice made, target alone against speculation (drafts verified at every step)."""
    _, target = model_pair
    samples = 300
    before = scrape(target.metrics_url)
    alone = run_requests(target.address, [_choice_request(seed, False) for seed in range(samples)])
    speculative = run_requests(target.address, [_choice_request(10_000 + seed, True) for seed in range(samples)])
    after = scrape(target.metrics_url)
    counts = [Counter(r.text for r in results) for results in (alone, speculative)]
    assert set(counts[0]) | set(counts[1]) <= set(CHOICES)
    assert len(counts[0]) >= 3, f"too few choices sampled to compare distributions: {counts[0]}"
    table = [[c[choice] for choice in CHOICES if counts[0][choice] + counts[1][choice]] for c in counts]
    _, p_value, _, _ = stats.chi2_contingency(table)
    assert p_value > 0.001, (counts, p_value)
    verified = metric(after, "tandem_spec_decode_num_draft_tokens_total") - metric(
        before, "tandem_spec_decode_num_draft_tokens_total")
    accepted = sum(r.accepted_tokens for r in speculative)
    assert 0 < accepted < verified, "drafts were not both accepted and rejected"


class ForbiddenDrafter(drafter_pb2_grpc.DrafterServicer):
    """Proposes digits after every prefix, which a schema of letters forbids."""

    def __init__(self, fingerprint: str, digits: list[int]):
        self.fingerprint = fingerprint
        self.digits = digits

    def Info(self, request, context):
        return drafter_pb2.DrafterInfo(model="forbidden", vocab_size=49152, tokenizer_fingerprint=self.fingerprint,
                                       max_k=4, kind="ngram", probs_top_k=1)

    def Speculate(self, request_iterator, context):
        lengths = {}
        for update in request_iterator:
            for opened in update.opens:
                lengths[opened.seq_id] = len(opened.prompt_ids)
            for extended in update.extends:
                lengths[extended.seq_id] = extended.start + len(extended.token_ids)
            yield drafter_pb2.DraftProposals(proposals=[
                drafter_pb2.DraftProposal(seq_id=seq_id, base_len=length, token_ids=self.digits)
                for seq_id, length in lengths.items()])


def test_drafts_the_grammar_forbids_are_rejected(tmp_path, smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    digits = tokenizer.encode("1234", add_special_tokens=False)[:4]
    schema = {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{3,8}$"}},
              "required": ["word"], "additionalProperties": False}
    constraint = structured_pb2.StructuredOutputs(json=json.dumps(schema))
    drafter = ForbiddenDrafter(tokenizer.fingerprint, digits)
    with target_with_drafter(drafter, tmp_path, "--sync-speculation") as target:
        requests = [greedy_request("Give me a word, as JSON.", 40, speculate=speculate, structured_outputs=constraint)
                    for speculate in (False, True)]
        before = scrape(target.metrics_url)
        alone, speculative = run_requests(target.address, requests)
        after = scrape(target.metrics_url)
    assert speculative.token_ids == alone.token_ids
    jsonschema.validate(json.loads(speculative.text), schema)
    assert speculative.draft_tokens > 0 and speculative.accepted_tokens == 0
    assert metric(after, "tandem_spec_decode_num_draft_tokens_total") > metric(
        before, "tandem_spec_decode_num_draft_tokens_total")


@pytest.mark.parametrize("constraint, field", [
    (structured_pb2.StructuredOutputs(json="{not json"), "structured_outputs.json"),
    (structured_pb2.StructuredOutputs(json='{"type": "objectx"}'), "structured_outputs.json"),
    (structured_pb2.StructuredOutputs(regex="a(b"), "structured_outputs.regex"),
    (structured_pb2.StructuredOutputs(grammar="start: foo"), "structured_outputs.grammar"),
    (structured_pb2.StructuredOutputs(choice=structured_pb2.Choices()), "structured_outputs.choice.choices"),
    (structured_pb2.StructuredOutputs(json_object=False), "structured_outputs.json_object"),
])
def test_bad_constraints_get_invalid_argument_and_harm_no_other_request(ngram_pair, constraint, field):
    _, target = ngram_pair
    good = greedy_request("Count to three.", 8, structured_outputs=structured_pb2.StructuredOutputs(regex="[0-9 ]+"))
    with futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_requests, target.address, [good])
        err = call_error(target.address, greedy_request("Hi", 8, structured_outputs=constraint))
        [result] = running.result()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field + ":"), err.details()
    assert result.token_ids and set(result.text) <= set("0123456789 ")


def test_a_constraint_that_compiles_too_slowly_gets_invalid_argument(tmp_path):
    target = ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "256",
                                               "--grammar-compile-timeout", "0.0001"],
                            log_path=tmp_path / "target.log").start().wait_healthy()
    try:
        err = call_error(target.address, greedy_request("Hi", 8, structured_outputs=structured_pb2.StructuredOutputs(
            json=json.dumps(JSON_PROMPTS[0].schema))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs.json: took longer than 0.0001 s to compile" in err.details()
        [ok] = run_requests(target.address, [greedy_request("Hi", 4)])
        assert ok.token_ids
    finally:
        target.kill()


def test_the_drafter_refuses_a_constraint_it_cannot_read(model_pair):
    """A malformed constraint in an Open is refused (answered with nothing) and counted, like any bad Open."""
    draft, _ = model_pair
    with grpc.insecure_channel(draft.address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        bad = drafter_pb2.SequenceOpen(seq_id=1, prompt_ids=[1, 2, 3], k=2, constrained_from=9,
                                       structured_outputs=structured_pb2.StructuredOutputs(regex="[0-9]"))
        [answer] = [m for _, m in zip(range(1), stub.Speculate(iter([drafter_pb2.TargetUpdate(opens=[bad])]),
                                                                   timeout=30))]
    assert [p.token_ids for p in answer.proposals] == [[]]
    assert metric(scrape(draft.metrics_url), "tandem_draft_invalid_updates_total", reason="bad_constraint") >= 1


def test_tandem_generate_takes_a_schema_file_a_regex_or_choices(ngram_pair, tmp_path, capsys):
    from tandem.cli import main

    _, target = ngram_pair
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(JSON_PROMPTS[2].schema))
    grammar = tmp_path / "yes_no.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    runs = [(["--json-schema", str(schema)], lambda out: jsonschema.validate(json.loads(out), JSON_PROMPTS[2].schema)),
            (["--regex", "[0-9]{2}-[a-z]{2}"], lambda out: _assert_matches(r"[0-9]{2}-[a-z]{2}", out)),
            (["--choice", "left", "--choice", "right"], lambda out: _assert_in(out, ("left", "right"))),
            (["--json-schema", str(schema), "--disable-any-whitespace"],
             lambda out: _assert_matches(r"\S+", _outside_strings(out))),
            (["--grammar", str(grammar)], lambda out: _assert_in(out, ("yes", "no")))]
    for flags, check in runs:
        with pytest.raises(SystemExit) as code:
            main(["generate", JSON_PROMPTS[2].messages[0][1], "--chat", "--target", target.address,
                  "--max-tokens", "200", *flags])
        out, err = capsys.readouterr()
        assert code.value.code == 0, err
        check(out.strip())
    with pytest.raises(SystemExit) as code:
        main(["generate", "Hi", "--target", target.address, "--json-schema", str(tmp_path / "missing.json")])
    assert code.value.code == 2 and "missing.json" in capsys.readouterr().err


def _assert_matches(pattern: str, text: str) -> None:
    assert re.fullmatch(pattern, text), text


def _assert_in(text: str, allowed: tuple[str, ...]) -> None:
    assert text in allowed, text


def test_constrained_requests_survive_a_drafter_restart_and_speculate_again(tmp_path_factory, ngram_pair):
    """The drafter dies mid-generation and comes back: the target reopens the running sequences with
    their constraint and constrained_from (the prompt's end, before the tokens committed so far), and
    the new drafter drafts them under the grammar. Output equals the target alone's throughout: the
    other pair's target, the same model without the slow steps, gives it."""
    # The requests must outlast the drafter's restart, which takes 5 s on a slow machine: 150 words at
    # 80 ms a step, and a backoff capped low, so that the target finds the new drafter at once.
    constraint = structured_pb2.StructuredOutputs(regex="([a-z]{1,8} ){150}")
    [reference] = run_requests(ngram_pair[1].address, [greedy_request("Name some animals.", 300, speculate=False,
                                                                      structured_outputs=constraint)])
    draft, target = start_pair(tmp_path_factory, "constrained-restart", ["--drafter", "ngram"],
                               ["--min-step-ms", "80", "--reconnect-max-seconds", "0.3"])
    try:
        results = []
        worker = threading.Thread(target=lambda: results.extend(run_requests(
            target.address, [greedy_request("Name some animals.", 300, structured_outputs=constraint)] * 2)))
        worker.start()
        time.sleep(0.5)
        draft = restart_drafter(draft, target)
        before = _accepted(target)
        worker.join(300)
        assert [r.token_ids for r in results] == [reference.token_ids] * 2
        assert reference.finish_reason == "stop" and re.fullmatch("([a-z]{1,8} ){150}", reference.text)
        assert _accepted(target) > before, "the reopened constrained sequences were not drafted again"
        assert metric(scrape(draft.metrics_url), "tandem_draft_invalid_updates_total", reason="bad_constraint") == 0
    finally:
        target.kill()
        draft.kill()
