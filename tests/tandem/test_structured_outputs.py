"""Structured output in-process: constraints, compiling and caching, masks, the target's sequence, the drafter.

The services, speculation and losslessness under a grammar are in test_structured_pair.py.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from bench.prompt_set import load_json_prompts
from draft_service.drafter import DraftJob, DraftSequence, Drafted, make_drafted
from tandem_kernels.sampling import Sampling
from draft_service.grammars import DraftGrammars, SequenceGrammar, cut
from draft_service.metrics import DraftMetrics
from draft_service.drafters.model import ModelDrafter
from tandem_kernels.bitmask import allowed_tokens
from tandem_kernels.compression import encode, unpack
from target_service.sequence import RequestOptions, Sequence
from target_service.stops import StopChecker
from tandem.detokenizer import IncrementalDetokenizer
from tandem.runtime import load_model, load_tokenizer
from tandem.structured import Constraint, ConstraintError, GrammarCompiler, GrammarLimits, TokenMasker
from tandem.structured.constraint import MAX_CHOICES, MAX_SPEC_CHARS
from tandem.v1 import structured_pb2

VOCAB = 49152
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


def _allowed(compiler, matcher) -> set[int]:
    bitmask = TokenMasker(VOCAB).fill([(matcher, [])])
    return set(allowed_tokens(bitmask, VOCAB)[0].nonzero().flatten().tolist())


# ---- constraints as the wire carries them ------------------------------------------------------

@pytest.mark.parametrize("message", [
    structured_pb2.StructuredOutputs(json=json.dumps(PERSON)),
    structured_pb2.StructuredOutputs(json_object=True),
    structured_pb2.StructuredOutputs(regex="[0-9]{3}"),
    structured_pb2.StructuredOutputs(grammar='start: "a" | "b"'),
    structured_pb2.StructuredOutputs(choice=structured_pb2.Choices(choices=["yes", "no"])),
])
def test_each_kind_round_trips_and_is_keyed_by_content(message):
    constraint = Constraint.from_proto(message)
    assert constraint.to_proto() == message
    assert Constraint.from_proto(constraint.to_proto()).key == constraint.key


def test_no_constraint_is_none():
    assert Constraint.from_proto(structured_pb2.StructuredOutputs()) is None


@pytest.mark.parametrize("message, field, problem", [
    (structured_pb2.StructuredOutputs(json=" "), "structured_outputs.json", "must not be empty"),
    (structured_pb2.StructuredOutputs(regex="a" * (MAX_SPEC_CHARS + 1)), "structured_outputs.regex", "at most"),
    (structured_pb2.StructuredOutputs(json_object=False), "structured_outputs.json_object", "set it to true"),
    (structured_pb2.StructuredOutputs(choice=structured_pb2.Choices()), "structured_outputs.choice.choices",
     "at least one"),
    (structured_pb2.StructuredOutputs(choice=structured_pb2.Choices(choices=["a", ""])),
     "structured_outputs.choice.choices", "choice 1 is empty"),
    (structured_pb2.StructuredOutputs(choice=structured_pb2.Choices(choices=["x"] * (MAX_CHOICES + 1))),
     "structured_outputs.choice.choices", "at most"),
])
def test_constraints_past_the_limits_name_their_field(message, field, problem):
    with pytest.raises(ConstraintError) as err:
        Constraint.from_proto(message)
    assert err.value.field == field and problem in err.value.problem


# ---- compiling ------------------------------------------------------------------------------

@pytest.mark.parametrize("constraint, problem", [
    (Constraint("json", "{not json"), "is not valid JSON"),
    (Constraint("json", "[1, 2]"), "must be a JSON object"),
    (Constraint("json", '{"type": "objectx"}'), "objectx"),
    (Constraint("json", '{"type": "integer", "minimum": 5, "maximum": 3}'), "Unsatisfiable"),
    (Constraint("regex", "a(b"), "unclosed group"),
    (Constraint("regex", r"[^\s\S]"), "allows no output"),
    (Constraint("grammar", "start: foo"), "unknown name"),
    (Constraint("grammar", 'root ::= "a" [0-9'), "is not valid GBNF"),
])
def test_invalid_constraints_are_refused_with_the_reason(compiler, constraint, problem):
    with pytest.raises(ConstraintError) as err:
        compiler.compile(constraint)
    assert err.value.field == constraint.field
    assert problem in err.value.problem


def test_a_grammar_over_the_size_limit_is_refused(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB, GrammarLimits(max_grammar_size=50))
    choices = tuple(f"option number {i}" for i in range(200))
    with pytest.raises(ConstraintError) as err:
        small.compile(Constraint("choice", choices))
    assert err.value.field == "structured_outputs.choice"


def test_compiled_grammars_are_cached_by_content_with_a_bound(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, GrammarLimits(cache_size=2))
    first = compiler.compile(Constraint("regex", "[0-9]+"))
    assert compiler.compile(Constraint("regex", "[0-9]+")) is first
    compiler.compile(Constraint("regex", "[a-z]+"))
    compiler.compile(Constraint("regex", "[A-Z]+"))
    assert compiler.cached(Constraint("regex", "[0-9]+")) is None, "the least recently used one stays cached"
    assert compiler.compile(Constraint("regex", "[0-9]+")) is not first


def test_each_sequence_gets_its_own_matcher(compiler, tokenizer):
    compiled = compiler.compile(Constraint("choice", ("yes", "no")))
    one, two = compiled.matcher(), compiled.matcher()
    assert one.consume_tokens(tokenizer.encode("yes", add_special_tokens=False))
    assert one.is_stopped() and not two.is_stopped()


def _accepts(compiler, tokenizer, schema: dict, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    matcher = compiler.compile(Constraint("json", json.dumps(schema))).matcher()
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("schema, text, accepted", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1, "b": 2}', False),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     '{"a": 1, "b": 2}', True),
    ({"type": "object"}, '{"b": 2}', True),
    ({"type": "array", "items": {"type": "object", "properties": {"name": {"const": "f"}}}},
     '[{"name": "f", "description": "x"}]', False),
    ({"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
     '{"properties": {"x": 1}}', True),
    ({"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
     '{"properties": {"x": 1, "y": 2}}', False),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, '{"a": 1, "b": 2}', True),
])
def test_objects_that_list_properties_allow_no_others_as_vllms_default_backend(compiler, tokenizer, schema, text,
                                                                               accepted):
    """xgrammar's strict mode, which vLLM uses by default, for objects that list properties; an object
    without properties, and an allOf's branches, stay open."""
    assert _accepts(compiler, tokenizer, schema, text) is accepted


def test_gbnf_and_lark_give_the_same_language(compiler, tokenizer):
    gbnf = compiler.compile(Constraint("grammar", 'root ::= "id-" [0-9] [0-9]')).matcher()
    lark = compiler.compile(Constraint("grammar", 'start: "id-" /[0-9]/ /[0-9]/')).matcher()
    for text, ok in (("id-42", True), ("id-4x", False)):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert (gbnf.validate_tokens(ids) == len(ids)) is ok
        assert (lark.validate_tokens(ids) == len(ids)) is ok


# ---- masks ----------------------------------------------------------------------------------

def test_masks_at_each_draft_equal_stepping_the_grammar_by_hand(compiler, tokenizer):
    compiled = compiler.compile(Constraint("json", json.dumps(PERSON)))
    drafts = tokenizer.encode('{"name": "Al', add_special_tokens=False)
    matcher = compiled.matcher()
    bitmask = TokenMasker(VOCAB).fill([(matcher, drafts)])  # [len(drafts) + 1, W]
    assert matcher.validate_tokens(drafts) == len(drafts), "the matcher is back where it began"
    by_hand = compiled.matcher()
    for row, token in enumerate([*drafts, None]):
        assert set(allowed_tokens(bitmask[row : row + 1], VOCAB)[0].nonzero().flatten().tolist()) == _allowed(
            compiler, by_hand)
        if token is not None:
            assert by_hand.consume_token(token)


def test_rows_after_a_forbidden_draft_allow_everything(compiler, tokenizer):
    matcher = compiler.compile(Constraint("regex", "[0-9]+")).matcher()
    digit, letter = tokenizer.encode("7", add_special_tokens=False)[0], tokenizer.encode("x", add_special_tokens=False)[0]
    bitmask = TokenMasker(VOCAB).fill([(matcher, [digit, letter, digit])])
    allowed = allowed_tokens(bitmask, VOCAB)  # [4, V]
    assert not allowed[1, letter], "the second draft is forbidden"
    assert allowed[2].all() and allowed[3].all()
    assert allowed[0, digit] and not allowed[0, letter]


# ---- the target's sequence ----------------------------------------------------------------------

def _sequence(tokenizer, matcher, ignore_eos: bool = False) -> Sequence:
    options = RequestOptions(sampling=Sampling(), max_tokens=50, stop=(), stop_token_ids=frozenset(),
                             ignore_eos=ignore_eos, skip_special_tokens=True, speculate=True, num_speculative_tokens=4)
    eos = frozenset() if ignore_eos else tokenizer.eos_token_ids
    return Sequence(seq_id=1, request_id="r", prompt_ids=[1, 2], options=options, arrival=0.0,
                    detokenizer=IncrementalDetokenizer(tokenizer, skip_special_tokens=True, context_ids=[1, 2]),
                    stops=StopChecker((), eos), grammar=matcher)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_complete_grammar_ends_the_sequence_at_its_last_token(compiler, tokenizer, ignore_eos):
    matcher = compiler.compile(Constraint("regex", "[0-9]{3}")).matcher()
    seq = _sequence(tokenizer, matcher, ignore_eos)
    digits = tokenizer.encode("123", add_special_tokens=False)
    output, finish = seq.commit([*digits, 5, 6], num_accepted=0, max_len=100)
    assert finish is not None and finish.value == "stop"
    assert output.token_ids == digits and output.text == "123"


def test_a_grammar_that_may_go_on_does_not_end_the_sequence(compiler, tokenizer):
    seq = _sequence(tokenizer, compiler.compile(Constraint("regex", "[0-9]+")).matcher())
    _, finish = seq.commit(tokenizer.encode("12", add_special_tokens=False), num_accepted=0, max_len=100)
    assert finish is None


# ---- the drafter ----------------------------------------------------------------------------

def test_a_cut_draft_sends_the_first_rows_of_its_q_prime():
    q = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(1)), dim=1)
    compressed = encode(q, 8)
    draft = Drafted((1, 1), 3, [int(t) for t in compressed.ids[:, 0]], compressed, recovered_guesses=[[]] * 5)
    cut(draft, 2)
    message = draft.to_proto()
    assert len(message.token_ids) == 2 and message.probs_top_k == 8
    sent = unpack(message.probs, 2, 8, 300)
    assert torch.equal(sent.ids, compressed.ids[:2].int()) and torch.equal(sent.fixed, compressed.fixed[:2])


def _constrained(compiler, key, tokens, constraint, sampling=Sampling()) -> DraftSequence:
    sequence = DraftSequence(key, list(tokens), sampling, 4, constraint=constraint, constrained_from=len(tokens))
    DraftGrammars(compiler).open(sequence)
    return sequence


def test_lookup_drafts_are_cut_at_the_first_forbidden_token(compiler, tokenizer):
    prompt = tokenizer.encode("Give a number:", add_special_tokens=False)
    sequence = _constrained(compiler, (1, 1), prompt, Constraint("regex", "[0-9]+"),
                            Sampling(temperature=1.0, seed=3))
    digits, letters = tokenizer.encode("42", add_special_tokens=False), tokenizer.encode("ab", add_special_tokens=False)
    job = DraftJob(sequence, list(prompt))
    q = torch.zeros(len(digits) + len(letters), VOCAB)
    q[torch.arange(q.shape[0]), torch.tensor(digits + letters)] = 1.0
    draft = make_drafted(job, digits + letters, encode(q, 4))
    [kept] = DraftGrammars.constrain([draft], {sequence.key: sequence})
    assert kept.token_ids == digits
    assert unpack(kept.to_proto().probs, len(digits), 4, VOCAB).ids[:, 0].tolist() == digits


def test_a_constrained_pre_draft_that_assumes_a_forbidden_token_is_dropped(compiler, tokenizer):
    prompt = tokenizer.encode("Number:", add_special_tokens=False)
    sequence = _constrained(compiler, (1, 2), prompt, Constraint("regex", "[0-9]+"))
    letter = tokenizer.encode("x", add_special_tokens=False)
    digit = tokenizer.encode("5", add_special_tokens=False)
    predraft = make_drafted(DraftJob(sequence, prompt + letter, num_assumed=1), digit, None)
    assert DraftGrammars.constrain([predraft], {sequence.key: sequence}) == []


def test_the_grammar_follows_the_committed_tokens_through_rollbacks(compiler, tokenizer):
    grammar = SequenceGrammar(compiler.compile(Constraint("regex", "(ab)+")), start=1)
    a, b = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("b", add_special_tokens=False)
    grammar.settle([9, *a, *b, *a])
    assert grammar.cursor([9, *a, *b, *a]) is not None
    grammar.settle([9, *a])  # the target rolled back
    assert grammar.fit([9, *a], [*b, *a, *b], 3) == (3, [])
    assert grammar.fit([9, *a], [*a], 1)[0] == 0


@pytest.fixture(scope="module")
def model_drafter(smollm2_path):
    loaded = load_model(str(smollm2_path), num_slots=4, max_model_len=256)
    return ModelDrafter(loaded.model, 16, DraftMetrics("smollm2"))


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, seed=7)])
def test_the_model_drafter_drafts_only_what_the_grammar_allows(model_drafter, compiler, tokenizer, sampling):
    """Unconstrained, the drafter would start a sentence; constrained, every draft follows the schema."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Who is Ada Lovelace? Answer in one sentence."}])
    free = DraftSequence((3, 1), list(prompt), sampling, 6)
    constrained = _constrained(compiler, (3, 2), prompt, Constraint("json", json.dumps(PERSON)), sampling)
    constrained.k = 6
    for sequence in (free, constrained):
        model_drafter.open(sequence.key)
    try:
        drafts = model_drafter.draft([DraftJob(free, list(prompt)), DraftJob(constrained, list(prompt))])
        by_key = {d.key: d for d in drafts}
        matcher = compiler.compile(constrained.constraint).matcher()
        assert matcher.validate_tokens(by_key[free.key].token_ids) == 0, "the unconstrained draft breaks the schema"
        assert len(by_key[constrained.key].token_ids) == 6
        assert matcher.validate_tokens(by_key[constrained.key].token_ids) == 6
        if sampling.needs_draft_probs:  # q' puts no mass where the grammar forbids
            message = by_key[constrained.key].to_proto()
            sent = unpack(message.probs, 6, message.probs_top_k, VOCAB)
            walker = compiler.compile(constrained.constraint).matcher()
            for row, token in enumerate(by_key[constrained.key].token_ids):
                assert set(sent.ids[row][sent.fixed[row].int() > 0].tolist()) <= _allowed(compiler, walker)
                assert walker.consume_token(token)
    finally:
        for sequence in (free, constrained):
            model_drafter.close(sequence.key)


@pytest.mark.parametrize("prompt", load_json_prompts(), ids=lambda p: p.id)
def test_the_bench_schemas_accept_their_reference_answers_token_by_token(compiler, tokenizer, prompt):
    """Each hand-written answer validates with jsonschema, and its grammar takes its tokens and may end there."""
    jsonschema.validate(prompt.reference, prompt.schema)
    matcher = compiler.compile(Constraint("json", json.dumps(prompt.schema))).matcher()
    tokens = tokenizer.encode(json.dumps(prompt.reference), add_special_tokens=False)
    assert matcher.validate_tokens(tokens) == len(tokens)
    assert matcher.consume_tokens(tokens) and matcher.is_accepting()
    missing_field = {k: v for k, v in prompt.reference.items() if k != prompt.schema["required"][0]}
    tokens = tokenizer.encode(json.dumps(missing_field), add_special_tokens=False)
    fresh = compiler.compile(Constraint("json", json.dumps(prompt.schema))).matcher()
    assert not (fresh.consume_tokens(tokens) and fresh.is_accepting()), "an answer without a required field"


def test_a_tokenizer_llguidance_cannot_read_refuses_constraints_but_loads(tmp_path):
    """A word-level tokenizer without a decoder: the services still serve, constrained requests get a reason."""
    from tests.support.tiny_checkpoint import write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny", seed=1)
    compiler = GrammarCompiler(load_tokenizer(folder), 32)
    with pytest.raises(ConstraintError) as err:
        compiler.compile(Constraint("regex", "t1"))
    assert "does not support structured output" in err.value.problem


def test_suffix_in_front_hands_a_draft_the_grammar_would_cut_to_the_model(model_drafter, compiler, tokenizer):
    """The copy ' one two' repeats, so the suffix drafter is sure of it; under a digits-only grammar the
    masked model drafts instead, and the unconstrained twin still gets the suffix draft."""
    from draft_service.drafters.suffix import SuffixDrafter, SuffixFrontDrafter
    from tandem.suffix_index import SuffixParams

    front = SuffixFrontDrafter(SuffixDrafter(SuffixParams(), 0), model_drafter, confidence=0.5)
    prompt = tokenizer.encode(" one two three" * 6, add_special_tokens=False)
    free = DraftSequence((4, 1), list(prompt), Sampling(), 3)
    constrained = _constrained(compiler, (4, 2), prompt, Constraint("regex", "[0-9]+"))
    constrained.k = 3
    for sequence in (free, constrained):
        front.open(sequence.key)
    try:
        drafts = {d.key: d for d in front.draft([DraftJob(free, list(prompt)), DraftJob(constrained, list(prompt))])}
    finally:
        for sequence in (free, constrained):
            front.close(sequence.key)
    assert tokenizer.decode(drafts[free.key].token_ids) == " one two three"
    assert drafts[constrained.key].token_ids
    assert tokenizer.decode(drafts[constrained.key].token_ids).isdigit()


def test_compact_json_is_its_own_constraint_and_only_for_json():
    compact = Constraint.from_proto(structured_pb2.StructuredOutputs(json=json.dumps(PERSON),
                                                                     disable_any_whitespace=True))
    assert compact.compact and compact.to_proto().disable_any_whitespace
    assert compact.key != Constraint("json", json.dumps(PERSON)).key
    with pytest.raises(ConstraintError) as err:
        Constraint.from_proto(structured_pb2.StructuredOutputs(regex="a", disable_any_whitespace=True))
    assert err.value.field == "structured_outputs.disable_any_whitespace"


def test_compact_json_allows_no_whitespace_between_tokens(compiler, tokenizer):
    matcher = compiler.compile(Constraint("json", json.dumps(PERSON), compact=True)).matcher()
    spaced = tokenizer.encode('{ "name"', add_special_tokens=False)
    assert matcher.validate_tokens(spaced) < len(spaced)
    tight = tokenizer.encode('{"name":"Al","age":3}', add_special_tokens=False)
    assert matcher.validate_tokens(tight) == len(tight)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, seed=5)])
def test_lookup_drafts_are_extended_with_the_tokens_the_grammar_forces(compiler, tokenizer, sampling):
    """Compact JSON forces '{"name":"' at the start: an empty lookup draft becomes the tokens of it that
    llguidance is sure of (it stops where the tokenization could still go several ways)."""
    prompt = tokenizer.encode("Extract the person.", add_special_tokens=False)
    sequence = _constrained(compiler, (5, 1), prompt, Constraint("json", json.dumps(PERSON), compact=True),
                            sampling)
    sequence.k = 8
    [draft] = DraftGrammars.constrain([make_drafted(DraftJob(sequence, list(prompt)), [], None)],
                                      {sequence.key: sequence})
    text = tokenizer.decode(draft.token_ids)
    assert text.startswith('{"name') and '{"name":"'.startswith(text)
    assert len(draft.recovered_guesses) == len(draft.token_ids)
    if sampling.needs_draft_probs:
        sent = unpack(draft.to_proto().probs, len(draft.token_ids), 1, VOCAB)
        assert draft.to_proto().probs_top_k == 1 and sent.ids[:, 0].tolist() == draft.token_ids
    else:
        assert draft.to_proto().probs == b""


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, seed=9)])
def test_the_model_drafter_drafts_forced_text_in_the_grammars_tokens(model_drafter, compiler, tokenizer, sampling):
    """Where compact JSON forces '{"name', the drafter proposes llguidance's tokens of it, with q' = 1 there."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Who is Ada Lovelace? Answer as JSON."}])
    constraint = Constraint("json", json.dumps(PERSON), compact=True)
    forced = compiler.compile(constraint).matcher().compute_ff_tokens()
    assert forced, "compact JSON forces its opening"
    sequence = _constrained(compiler, (6, 1), prompt, constraint, sampling)
    sequence.k = len(forced)
    model_drafter.open(sequence.key)
    try:
        [draft] = model_drafter.draft([DraftJob(sequence, list(prompt))])
    finally:
        model_drafter.close(sequence.key)
    assert draft.token_ids == forced
    if sampling.needs_draft_probs:
        sent = unpack(draft.to_proto().probs, len(forced), draft.to_proto().probs_top_k, VOCAB)
        assert sent.ids[:, 0].tolist() == forced and sent.fixed[:, 0].int().tolist() == [1 << 15] * len(forced)


def test_the_ngram_lookup_skips_occurrences_whose_continuation_the_grammar_forbids():
    from draft_service.drafters.ngram import lookup

    tokens = [1, 2, 7, 8, 1, 2, 9, 9, 1, 2]  # "1 2" was followed by 9 most recently, by 7 before
    assert lookup(tokens, 2, 1, 2) == [9, 9]
    assert lookup(tokens, 2, 1, 2, allowed=lambda token: token != 9) == [7, 8]
    assert lookup(tokens, 2, 1, 2, allowed=lambda token: False) == []


def test_the_ngram_drafter_finds_a_continuation_its_grammar_allows(compiler, tokenizer):
    from draft_service.drafters.ngram import NgramDrafter

    [is_, dot, x] = [tokenizer.encode(t, add_special_tokens=False)[0] for t in (" is", ".", "x")]
    digits = tokenizer.encode("42", add_special_tokens=False)
    prompt = [is_, *digits, dot, is_, x, dot, is_]  # " is" was followed by 42, then more recently by x
    sequence = _constrained(compiler, (7, 1), prompt, Constraint("regex", "[0-9]+"))
    free = DraftSequence((7, 2), list(prompt), Sampling(), 4)
    drafts = {d.key: d for d in NgramDrafter(1, 4).draft([DraftJob(sequence, list(prompt)),
                                                          DraftJob(free, list(prompt))])}
    assert drafts[sequence.key].token_ids[0] == digits[0]
    assert drafts[free.key].token_ids[0] == x, "unconstrained, the most recent occurrence wins"
