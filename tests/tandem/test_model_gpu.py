"""The model checks on CUDA in bf16: transformers parity on tiny checkpoints, cache correctness on a
random model of Llama-3.2-1B's shape (checkpoints cannot travel to the GPU machine), and CUDA graphs
of decode and verify steps against the same model without them."""
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
def weights_1b():
    return random_weights(SHAPES["llama-3.2-1b"], seed=0, dtype=torch.bfloat16, device=CUDA)


@pytest.fixture(scope="module")
def model_1b(weights_1b):
    """Every step on the dynamic path, which the cache tests below were written for."""
    return build_model(SHAPES["llama-3.2-1b"], weights_1b, dtype=torch.bfloat16, device=CUDA, num_slots=4,
                       max_model_len=512, cuda_graphs=False)


@pytest.fixture(scope="module")
def graphed_1b(weights_1b):
    """The same weights (shared, not copied) with CUDA graphs for decode and verify: CUDA's default."""
    return build_model(SHAPES["llama-3.2-1b"], weights_1b, dtype=torch.bfloat16, device=CUDA, num_slots=4,
                       max_model_len=512)


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


# Per logits row, ||graphed - eager|| / ||eager||. Measured on CPU in bf16 on this random 1B: 0.016
# from rounding alone; a query one position off gives 0.14, one key missing from its context 0.15.
# (Elementwise tolerances do not fit: the tied, unscaled embedding makes logits of std ~45.)
GRAPHED_REL_ERROR = 0.05


def _on_both(graphed, eager, chunks: list[SequenceChunk]) -> None:
    got, want = graphed.run(chunks), eager.run(chunks)  # [rows, vocab]
    error = (got - want).norm(dim=1) / want.norm(dim=1)
    assert float(error.max()) < GRAPHED_REL_ERROR, error.tolist()


def test_graphed_decode_and_verify_equal_the_eager_path(graphed_1b, model_1b):
    prompts = {2: _ids(17, 6), 0: _ids(40, 7), 3: _ids(5, 8)}  # 3 sequences: padded to bucket 4
    for slot, prompt in prompts.items():
        _on_both(graphed_1b, model_1b, [SequenceChunk(slot, 0, prompt)])
    lengths = {slot: len(p) for slot, p in prompts.items()}
    for step in range(3):
        _on_both(graphed_1b, model_1b, [SequenceChunk(s, n + step, _ids(1, 10 * step + s)) for s, n in lengths.items()])
    verify = [SequenceChunk(s, n + 3, _ids(5, 50 + s), num_logits=5) for s, n in lengths.items()]
    _on_both(graphed_1b, model_1b, verify)
    runner = graphed_1b.decoder.static_steps
    assert runner.use_graphs and runner.steps_run[(4, 1)] >= 3 and runner.steps_run[(4, 5)] >= 1
    assert model_1b.decoder.static_steps is None


def test_graphs_replay_as_positions_move_and_are_captured_once(graphed_1b, model_1b):
    prompt = _ids(60, 9)
    _on_both(graphed_1b, model_1b, [SequenceChunk(1, 0, prompt)])
    _on_both(graphed_1b, model_1b, [SequenceChunk(1, 60, [prompt[-1]])])
    runner = graphed_1b.decoder.static_steps
    graphs, replays = runner.num_graphs, runner.steps_run[(1, 1)]
    for position in range(61, 61 + 24):  # across a 64-key block edge of the attention kernel
        _on_both(graphed_1b, model_1b, [SequenceChunk(1, position, _ids(1, position))])
    for start in range(85, 85 + 4 * 5, 5):
        _on_both(graphed_1b, model_1b, [SequenceChunk(1, start, _ids(5, start), num_logits=5)])
    assert runner.steps_run[(1, 1)] == replays + 24
    assert runner.num_graphs <= graphs + 1  # the verify graph (1, 5), if no earlier test captured it
