"""The target's KV cache size and step budget (--kv-cache-tokens, --block-size, --max-num-batched-tokens),
and the flags that choose its numerics and front door (--block-activations, --chat-template, --tool-call-parser)."""
from __future__ import annotations

import pytest
import torch

from target_service.config import TargetConfig, chat_template_source
from tandem.model.llama import build_model
from tandem.model.random_weights import SHAPES, random_weights


@pytest.mark.parametrize("tokens, message", [(1000, "holds less than one sequence of --max-model-len 2048"),
                                             (-16, "--kv-cache-tokens must not be negative")])
def test_a_kv_cache_too_small_for_one_sequence_is_refused(tokens, message):
    with pytest.raises(ValueError, match=message):
        TargetConfig(max_model_len=2048, kv_cache_tokens=tokens)


@pytest.mark.parametrize("size", [8, 24, 0])
def test_a_block_size_that_is_not_a_multiple_of_16_is_refused(size):
    with pytest.raises(ValueError, match=f"--block-size must be a multiple of 16 \\(16, 32, 64, ...\\), got {size}"):
        TargetConfig(block_size=size)


@pytest.mark.parametrize("tokens", [15, 0, -1])
def test_a_step_budget_below_the_prompts_least_share_is_refused(tokens):
    """A step always gives prompts 16 tokens: a smaller budget could not be kept."""
    with pytest.raises(ValueError, match=f"--max-num-batched-tokens must be at least 16, got {tokens}"):
        TargetConfig(max_num_batched_tokens=tokens)


@pytest.mark.parametrize("kv_cache_tokens, block_size, blocks",
                         [(None, 16, 8 * 63), (2000, 16, 125), (2001, 16, 126), (None, 64, 8 * 16), (2001, 64, 32)])
def test_the_pool_holds_every_slot_at_full_length_unless_sized(kv_cache_tokens, block_size, blocks):
    """By default each slot's max_len (1000: 63 blocks of 16, 16 of 64) in whole blocks; a size in
    tokens rounds up to whole blocks."""
    assert TargetConfig(block_size=block_size).block_size == block_size
    config = SHAPES["tiny"]
    model = build_model(config, random_weights(config, seed=0), dtype=torch.float32, device="cpu",
                        num_slots=8, max_model_len=1000, kv_cache_tokens=kv_cache_tokens, block_size=block_size)
    assert model.kv_cache.num_blocks == blocks


def test_a_chat_template_is_a_shipped_name_or_a_file(tmp_path):
    assert "<tool_call>" in chat_template_source("smollm2_tool_use")
    own = tmp_path / "mine.jinja"
    own.write_text("{{ messages[0]['content'] }}")
    assert chat_template_source(str(own)) == own.read_text()
    with pytest.raises(ValueError, match="--chat-template 'smollm3' is neither a file nor a shipped template "
                                         r"\(smollm2_tool_use\)"):
        TargetConfig(chat_template="smollm3")


def test_a_tool_call_parser_is_one_served():
    assert TargetConfig(tool_call_parser="llama3_json").tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="--tool-call-parser 'mistral' is not one of hermes, llama3_json"):
        TargetConfig(tool_call_parser="mistral")


def test_block_activations_are_int16_by_default_or_int8():
    assert TargetConfig().block_activations == "int16"
    assert TargetConfig(block_activations="int8").block_activations == "int8"
    with pytest.raises(ValueError, match="--block-activations must be one of int16, int8, got 'int4'"):
        TargetConfig(block_activations="int4")
