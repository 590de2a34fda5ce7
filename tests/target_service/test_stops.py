"""Stop strings cut where vLLM cuts: not before min_tokens, and with the string kept on request."""
from __future__ import annotations

from target_service.stops import StopChecker


def _run(checker: StopChecker, deltas: list[str], min_tokens: int = 0) -> tuple[str, bool]:
    """The text sent for these per-token deltas, and whether a stop string ended it."""
    sent = []
    for generated, delta in enumerate(deltas, start=1):
        text, stopped = checker.add_text(delta, generated > min_tokens)
        sent.append(text)
        if stopped:
            return "".join(sent), True
    return "".join(sent) + checker.flush(), False


TOKENS = [" is", " Lee", ",", " and", " I", "'m", " a", " stud", "ent"]


def test_a_stop_string_cuts_the_text_before_it():
    assert _run(StopChecker(("e",), frozenset()), TOKENS) == (" is L", True)


def test_before_min_tokens_no_stop_string_counts_and_after_only_new_text_is_searched():
    """vLLM's example: the "e"s of " Lee" come within the first 5 tokens; the one of "ent" ends it."""
    assert _run(StopChecker(("e",), frozenset()), TOKENS, min_tokens=5) == (" is Lee, and I'm a stud", True)


def test_a_stop_string_across_the_min_tokens_boundary_counts():
    """It ends in the first token past min_tokens, though it began before."""
    assert _run(StopChecker(("I'm",), frozenset()), TOKENS, min_tokens=5) == (" is Lee, and ", True)


def test_include_stop_str_in_output_keeps_the_matched_string():
    checker = StopChecker(("stud", "e"), frozenset(), include_stop_str=True)
    assert _run(checker, TOKENS) == (" is Le", True) and checker.matched == "e"
    assert _run(StopChecker(("stud",), frozenset(), include_stop_str=True), TOKENS) == (" is Lee, and I'm a stud", True)


def test_without_a_stop_string_all_text_is_sent():
    assert _run(StopChecker(("zz",), frozenset()), TOKENS, min_tokens=3) == ("".join(TOKENS), False)
