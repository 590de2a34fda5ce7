"""GGUF block matrices in the native decoder (csrc/blocks.h): each type against a reference of the
same arithmetic and against the dequantized float matrix, rows independent of their batch, the
embedded GGUF's real tensors, and whole models against the PyTorch decoder on the same weights
(a block model's rows independent of their batch: test_native_decoder.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from tandem.config import ModelConfig
from tandem.loaders import load_checkpoint
from tandem.model import native
from tests.support.devices import needs_native
from tandem.model.batch import SequenceChunk
from tandem.model.block_matrix import BLOCK_TYPES, BlockMatrix
from tandem.model.llama import build_model, dequantized
from tandem.model.random_weights import random_weights
from tandem.quantization import quantize

pytestmark = needs_native
XMAX = 32767.0  # csrc/blocks.h: an activation block's largest magnitude, quantized


def _random_blocks(rows: int, cols: int, ggml_type: Q, seed: int) -> BlockMatrix:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return BlockMatrix.quantized(weight, ggml_type)


def _gemm(isa, matrix: BlockMatrix, x: torch.Tensor) -> torch.Tensor:
    table, packed = matrix.groups()  # the C struct points into them: keep them alive
    return isa.gemm(x.contiguous(), native.block_matrix(table, *matrix.shape), native.WEIGHTS_BLOCKS)


def _same_arithmetic(matrix: BlockMatrix, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """What blocks.h computes, in float64 from the same int16 activations and stored scales: the
    result, and the sum of the magnitudes of its terms (what float32 rounding scales with)."""
    rows = x.numpy().reshape(x.shape[0], -1, 32)  # [M, blocks, 32] float32
    top = np.abs(rows).max(axis=2)
    scale = top / np.float32(XMAX)
    inverse = np.where(top > 0, np.float32(XMAX) / np.where(top > 0, top, 1), 0).astype(np.float32)
    q = np.rint(rows * inverse[..., None]).astype(np.float64)  # float32 products, rounded half to even
    sums = scale.astype(np.float64) * q.sum(axis=2)
    results, magnitudes = [], []
    for part in matrix.parts:
        size = part.data.shape[1] // (matrix.cols // 32)
        blocks = part.data.reshape(part.data.shape[0], -1, size)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, blocks]
        values = gguf_dequantize(part.data, part.ggml_type).astype(np.float64).reshape(*d.shape, 32)
        if part.ggml_type == Q.Q4_1:
            offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        else:
            offset = np.zeros_like(d)
        integers = np.round((values - offset[..., None]) / np.where(d == 0, 1, d)[..., None])  # qw (- 8)
        if part.ggml_type == Q.Q4_0:
            integers, offset = integers + 8, -8 * d
        dots = np.einsum("nbk,mbk->mnb", integers, q)  # exact
        products, offsets = dots * d[None] * scale.astype(np.float64)[:, None], offset[None] * sums[:, None]
        results.append((products + offsets).sum(axis=2))
        magnitudes.append((np.abs(products) + np.abs(offsets)).sum(axis=2))
    return np.concatenate(results, axis=1), np.concatenate(magnitudes, axis=1)


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13])
@pytest.mark.parametrize("out_features, in_features", [(37, 96), (64, 32), (21, 576)])
def test_gemm_is_the_block_arithmetic_and_close_to_the_float_matrix(isa, ggml_type, rows, out_features,
                                                                      in_features):
    matrix = _random_blocks(out_features, in_features, ggml_type, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(100 + rows))
    got = _gemm(isa, matrix, x)
    assert got.shape == (rows, -(-out_features // 16) * 16)
    assert torch.equal(got[:, out_features:], torch.zeros_like(got[:, out_features:]))
    want, magnitude = _same_arithmetic(matrix, x)
    assert (np.abs(got[:, :out_features].double().numpy() - want) <= 1e-5 * magnitude + 1e-30).all()
    dense = x.double() @ matrix.dequantize().double().T
    torch.testing.assert_close(got[:, :out_features].double(), dense, atol=1e-3 * dense.abs().max().item(), rtol=0)


def test_a_fused_matrix_may_mix_types_and_rows_do_not_depend_on_their_batch(isa):
    """Parts of 13, 8 and 5 rows (groups padded inside each part), every row count from 1 to 20, at
    1 and 3 threads: bit for bit what each part gives alone and what each row gives alone."""
    parts = [_random_blocks(13, 64, Q.Q4_0, 1), _random_blocks(8, 64, Q.Q8_0, 2), _random_blocks(5, 64, Q.Q4_1, 3)]
    fused = BlockMatrix.cat(parts)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([_gemm(isa, fused, x[i:i + 1]) for i in range(20)])
    by_part = torch.cat([_gemm(isa, part, x)[:, :part.shape[0]] for part in parts], dim=1)
    assert torch.equal(alone[:, :26], by_part)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            for rows in range(1, 21):
                assert torch.equal(_gemm(isa, fused, x[:rows]), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_the_embedded_gguf_keeps_its_blocks_and_they_multiply_as_the_dequantized_tensors(isa, smollm2_path,
                                                                                        smollm2_checkpoint):
    config, blocks = load_checkpoint(smollm2_path, keep_blocks=True)
    _, floats = smollm2_checkpoint
    assert blocks.lm_head is blocks.embed  # tied
    assert [p.ggml_type for p in blocks.embed.parts] == [Q.Q8_0]
    assert {p.ggml_type for layer in blocks.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
            for p in m.parts} == {Q.Q4_1}
    for got, want in ((blocks.layers[0].qkv, floats.layers[0].qkv), (blocks.layers[7].down, floats.layers[7].down),
                      (blocks.embed, floats.embed)):
        assert torch.equal(got.dequantize(), want)  # q and k rows unpermuted as the float loader does
        x = torch.randn(3, got.shape[1], generator=torch.Generator().manual_seed(0))
        dense = x.double() @ want.double().T
        product = _gemm(isa, got, x)[:, :got.shape[0]].double()
        torch.testing.assert_close(product, dense, atol=1e-3 * dense.abs().max().item(), rtol=0)


CONFIGS = {  # widths multiples of 32; head_dim 64 and 128; tied and untied embeddings
    "d64-gqa3": ModelConfig("llama", 300, 192, 320, 2, 3, 1, 64, 1e-5, 10000.0, 512, True, False),
    "d128-untied": ModelConfig("llama", 200, 256, 384, 2, 4, 2, 128, 1e-5, 10000.0, 512, False, False),
}


def _ids(config: ModelConfig, n: int, seed: int) -> list[int]:
    return torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pair(name: str, quantization: str):
    """The native decoder on block weights, and the PyTorch decoder on the same weights dequantized (fp32)."""
    config = CONFIGS[name]
    weights = quantize(random_weights(config, seed=11), quantization, config, torch.bfloat16, torch.device("cpu"))
    assert weights.in_blocks
    ours = build_model(config, weights, dtype=torch.bfloat16, device=torch.device("cpu"), num_slots=3,
                       max_model_len=100, backend="native")
    reference = build_model(config, dequantized(weights), dtype=torch.float32, device=torch.device("cpu"),
                            num_slots=3, max_model_len=100, backend="torch")
    return reference, ours


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("quantization", ["q4_0", "q8_0"])
def test_block_models_match_the_pytorch_decoder_on_the_same_weights(isa, name, quantization):
    """Prefill, verify, a mixed batch and decode; the embedding rows come from the blocks too. The
    KV cache is bf16 in ours, fp32 in the reference: that is most of the difference."""
    reference, ours = _pair(name, quantization)
    config = CONFIGS[name]
    a, b = _ids(config, 37, 1), _ids(config, 9, 2)
    for chunks in ([SequenceChunk(0, 0, a, num_logits=len(a))], [SequenceChunk(0, 37, [5, 6, 7, 8, 9], num_logits=5)],
                   [SequenceChunk(1, 0, b, num_logits=3), SequenceChunk(0, 42, [1]), SequenceChunk(2, 0, a[:20])]):
        want, got = reference.run(chunks), ours.run(chunks)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)
