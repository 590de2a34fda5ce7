"""The packed CPU linear against F.linear: same products, same rows, same model outputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.model import cpu_gemm
from tandem.model.batch import SequenceChunk
from tandem.model.linear import PackedLinear, make_linear
from tandem.model.llama import build_model
from tandem.model.random_weights import SHAPES, random_weights

gemm = cpu_gemm.load()
pytestmark = pytest.mark.skipif(gemm is None, reason="no AVX2/FMA CPU or no gcc")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 9, 16, 70])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (100, 300), (48, 1000)])
def test_packed_linear_matches_f_linear(dtype, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    linear = make_linear(weight, bias)
    assert isinstance(linear, PackedLinear)
    got = linear(x)
    want = F.linear(x.double(), weight.double(), bias.double())
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tol = (1e-5 if dtype == torch.float32 else 2e-2) * want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_are_the_weight_rows(dtype):
    weight = torch.randn(100, 24).to(dtype)
    ids = torch.tensor([0, 7, 8, 15, 16, 99, 3])
    assert torch.equal(make_linear(weight).rows(ids), weight[ids])


def test_threads_split_panels_without_changing_results():
    weight = torch.randn(1000, 200)
    x = torch.randn(11, 200)
    packed = cpu_gemm.pack(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm(x, packed)
        torch.set_num_threads(3)
        three = gemm(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2"])
def test_model_logits_match_the_f_linear_backend(shape):
    config = SHAPES[shape]
    weights = random_weights(config, seed=5)
    models = [build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"), num_slots=3,
                          max_model_len=64, linear_backend=backend) for backend in ("torch", "auto")]
    ids = [(7 * i) % config.vocab_size for i in range(20)]
    batches = [
        [SequenceChunk(0, 0, ids, num_logits=len(ids))],
        [SequenceChunk(0, 20, [5, 6, 7, 8, 9], num_logits=5)],
        [SequenceChunk(1, 0, ids[:9], num_logits=3), SequenceChunk(0, 25, [1])],
    ]
    for chunks in batches:
        torch_logits, packed_logits = (m.run(chunks) for m in models)
        assert (torch_logits - packed_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("slots", [(0, 1, 2), (2, 0, 1)])  # consecutive slots are views; others gather
def test_batched_decode_matches_one_sequence_at_a_time(slots):
    config = SHAPES["tiny"]
    model = build_model(config, random_weights(config, seed=6), dtype=torch.float32, device=torch.device("cpu"),
                        num_slots=3, max_model_len=64)
    prompts = {slot: [(slot * 31 + 5 * i) % config.vocab_size for i in range(8 + 3 * slot)] for slot in slots}
    singles = [model.run([SequenceChunk(s, 0, prompts[s] + [9])]) for s in slots]
    for s in slots:
        model.run([SequenceChunk(s, 0, prompts[s])])
    batched = model.run([SequenceChunk(s, len(prompts[s]), [9]) for s in slots])
    assert (batched - torch.cat(singles)).abs().max().item() <= 1e-4
