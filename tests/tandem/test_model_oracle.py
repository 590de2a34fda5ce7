"""Our runtime against HF transformers on the embedded SmolLM2 GGUF: same logits, same greedy text."""
from __future__ import annotations

import pytest
import torch

from bench.greedy import greedy_generate
from bench.greedy_oracle import hf_greedy
from tandem.model.batch import SequenceChunk
from tandem.model import native
from tandem.model.llama import build_model
from tandem.runtime import load_model
from tests.support.devices import needs_native

CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Explain in two sentences why the sky is blue during the day and red at "
                                "sunset, then name three colours that appear in a rainbow and say which "
                                "one has the longest wavelength. Keep the answer short, friendly and "
                                "suitable for a curious ten-year-old reader."},
]


@pytest.fixture(scope="module")
def chat_prompt_ids(hf_smollm2_tokenizer) -> list[int]:
    """A 64-token chat prompt, tokenized by transformers so that only the model is under test."""
    ids = hf_smollm2_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) >= 64, len(ids)
    return list(ids[-64:])


@pytest.fixture(scope="module")
def model(smollm2_checkpoint):
    config, weights = smollm2_checkpoint
    return build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"),
                       num_slots=2, max_model_len=256)


def test_logits_match_transformers(model, hf_smollm2, chat_prompt_ids):
    ours = model.run([SequenceChunk(slot=0, start=0, token_ids=chat_prompt_ids, num_logits=64)])
    with torch.no_grad():
        theirs = hf_smollm2(torch.tensor([chat_prompt_ids])).logits[0].float()
    assert ours.shape == theirs.shape == (64, 49152)
    assert (ours - theirs).abs().max().item() <= 1e-3


@pytest.fixture(scope="module")
def hf_greedy_tokens(hf_smollm2, chat_prompt_ids) -> list[int]:
    return hf_greedy(hf_smollm2, chat_prompt_ids, 64)


def test_greedy_continuation_is_token_identical(model, hf_greedy_tokens, chat_prompt_ids):
    assert greedy_generate(model, chat_prompt_ids, max_new_tokens=64) == hf_greedy_tokens


@needs_native
def test_the_gguf_run_in_its_own_blocks_keeps_the_greedy_text(smollm2_path, hf_greedy_tokens, chat_prompt_ids):
    """Q4_1 and Q8_0 matrices multiplied as stored, with int16 activations: transformers dequantizes
    the same file to fp32, and the text is the same."""
    loaded = load_model(str(smollm2_path), num_slots=1, max_model_len=256)
    assert loaded.model.decoder.kind == native.WEIGHTS_BLOCKS
    assert greedy_generate(loaded.model, chat_prompt_ids, max_new_tokens=64) == hf_greedy_tokens
