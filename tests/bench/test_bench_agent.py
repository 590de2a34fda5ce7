"""bench.agent: its rows from what the requests did, and (slow) a real run through the OpenAI door."""
from __future__ import annotations

import pytest

from bench import agent


def _reply(seconds: float, tokens: int, ttft: float, steps: int = 0, accepted: int = 0, cached: int = 0) -> agent.Reply:
    return agent.Reply("text", [], seconds, ttft, {"completion_tokens": tokens, "prompt_tokens": 100,
                                                   "prompt_tokens_details": {"cached_tokens": cached}},
                       {"num_spec_steps": steps, "num_accepted_draft_tokens": accepted} if steps else {})


def test_a_row_judges_a_configuration_by_every_request_against_the_target_alone():
    alone = agent.AgentTally(agent.ALONE, [("call", _reply(1.0, 10, 0.2)), ("answer", _reply(3.0, 90, 0.4))],
                        {"c": ["{}", "a"]})
    pair = agent.AgentTally("suffix", [("call", _reply(1.0, 10, 0.2, steps=4, accepted=6, cached=50)),
                                  ("answer", _reply(1.0, 90, 0.4, steps=30, accepted=60, cached=80))],
                       {"c": ["{}", "a"]})
    row = agent.row(pair, alone)
    assert row["tok_s"] == pytest.approx(50.0) and row["vs_alone"] == pytest.approx(2.0)
    assert row["answers_tok_s"] == pytest.approx(90.0)
    assert row["mal"] == pytest.approx(1 + 66 / 34)
    assert row["cached_share"] == pytest.approx(0.65)
    assert (row["identical"], row["conversations"]) == (1, 1)
    pair.transcripts["c"] = ["{}", "b"]
    assert agent.row(pair, alone)["identical"] == 0
    assert "| suffix | 50.0 | 2.000 |" in agent.markdown([row], 0.0)


def test_an_unknown_drafter_is_refused_before_any_service_starts(capsys):
    with pytest.raises(SystemExit):
        agent.parse_args(["--drafters", "suffix,medusa"])
    assert "unknown medusa" in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_calls_the_tool_and_matches_the_target_alone(tmp_path):
    rows = agent.main(["--drafters", "suffix", "--conversations", "2", "--max-tokens", "12", "--out", str(tmp_path)])
    assert [r["config"] for r in rows] == [agent.ALONE, "suffix", "suffix, speculation off"]
    for r in rows:
        assert r["identical"] == r["conversations"] == 2, r
        assert r["cached_share"] > 0.3, "each turn finds the history's KV in the prefix cache"
    assert rows[1]["mal"] is not None and rows[2]["mal"] is None
