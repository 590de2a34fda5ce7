"""The model checks on CUDA in bf16: transformers parity on tiny checkpoints, and cache correctness
on a random model of Llama-3.2-1B's shape (checkpoints cannot travel to the GPU machine)."""
from __future__ import annotations

import pytest
import torch

from tandem.loaders import load_checkpoint
from tandem.model.batch import SequenceChunk
from tandem.model.llama import build_model
from tandem.model.random_weights import SHAPES, random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
BF16_ATOL = 0.15  # logits of O(1..10): bf16 keeps about 3 significant digits through 16 layers


def test_tiny_llama_matches_transformers_in_bf16(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)).eval()
    hf.save_pretrained(tmp_path)
    config, weights = load_checkpoint(tmp_path)
    ours = build_model(config, weights, dtype=torch.bfloat16, device=CUDA, num_slots=1, max_model_len=64)
    ids = list(range(3, 40))
    got = ours.run([SequenceChunk(0, 0, ids, num_logits=len(ids))])
    with torch.no_grad():
        want = hf.to(CUDA, torch.bfloat16)(torch.tensor([ids], device=CUDA)).logits[0].float()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


@pytest.fixture(scope="module")
def model_1b():
    config = SHAPES["llama-3.2-1b"]
    weights = random_weights(config, seed=0, dtype=torch.bfloat16, device=CUDA)
    return build_model(config, weights, dtype=torch.bfloat16, device=CUDA, num_slots=4, max_model_len=512)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_incremental_decode_equals_full_recompute(model_1b):
    ids = _ids(40, 0)
    full = model_1b.run([SequenceChunk(3, 0, ids, num_logits=40)])
    steps = [model_1b.run([SequenceChunk(0, 0, ids[:30])])]
    steps += [model_1b.run([SequenceChunk(0, i, [ids[i]])]) for i in range(30, 40)]
    torch.testing.assert_close(torch.cat(steps), full[29:], atol=BF16_ATOL, rtol=0.05)


def test_mixed_batch_with_verification_equals_each_alone(model_1b):
    a, b = _ids(20, 1), _ids(33, 2)
    model_1b.run([SequenceChunk(1, 0, b[:28])])
    mixed = model_1b.run([SequenceChunk(0, 0, a), SequenceChunk(1, 28, b[28:], num_logits=5)])
    alone_a = model_1b.run([SequenceChunk(2, 0, a)])
    alone_b = model_1b.run([SequenceChunk(3, 0, b, num_logits=5)])
    torch.testing.assert_close(mixed, torch.cat([alone_a, alone_b]), atol=BF16_ATOL, rtol=0.05)


def test_rollback_then_decode_equals_never_having_seen_rejected_tokens(model_1b):
    prefix, rejected, accepted = _ids(25, 3), _ids(4, 4), _ids(3, 5)
    model_1b.run([SequenceChunk(0, 0, prefix)])
    model_1b.run([SequenceChunk(0, 25, rejected, num_logits=4)])
    got = model_1b.run([SequenceChunk(0, 25, accepted, num_logits=3)])
    want = model_1b.run([SequenceChunk(1, 0, prefix + accepted, num_logits=3)])
    torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=0.05)
