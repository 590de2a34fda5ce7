"""GGUF block matrices in the native decoder (csrc/blocks.h): each type against a reference of the
same arithmetic and against the dequantized float matrix, rows independent of their batch, the
embedded GGUF's real tensors, and whole models against the PyTorch decoder on the same weights
(a block model's rows independent of their batch: test_native_decoder.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from bench.greedy import greedy_generate
from bench.greedy_oracle import hf_greedy
from tandem.config import ModelConfig
from tandem.loaders import load_checkpoint
from tandem.model import native
from tests.support.devices import native_builds, needs_native
from tests.support.tiny_gguf import write_k_quant_gguf
from tandem.model.batch import SequenceChunk
from tandem.model.block_matrix import BLOCK_TYPES, LEGACY_TYPES, BlockMatrix
from tandem.model.llama import build_model, dequantized
from tandem.model.random_weights import random_blocks, random_weights
from tandem.quantization import quantize

pytestmark = needs_native
# csrc/blocks.h: an activation block's largest magnitude, quantized, by the weights' kind
XMAX = {native.WEIGHTS_BLOCKS: 32767.0, native.WEIGHTS_BLOCKS_X8: 127.0}
KINDS = pytest.mark.parametrize("kind", list(XMAX), ids=["int16", "int8"])
K_TYPES = [t for t in BLOCK_TYPES if t not in LEGACY_TYPES]


def _gemm(isa, matrix: BlockMatrix, x: torch.Tensor, kind: int = native.WEIGHTS_BLOCKS) -> torch.Tensor:
    table, packed = matrix.groups(isa.group_rows)  # the C struct points into them: keep them alive
    return isa.gemm(x.contiguous(), native.block_matrix(table, *matrix.shape), kind)


def _quantized(x: torch.Tensor, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """x's blocks as blocks.h quantizes them: integers [M, blocks, 32] and scales [M, blocks] (float64)."""
    rows = x.numpy().reshape(x.shape[0], -1, 32)  # [M, blocks, 32] float32
    top = np.abs(rows).max(axis=2)
    xmax = np.float32(XMAX[kind])
    inverse = np.where(top > 0, xmax / np.where(top > 0, top, 1), 0).astype(np.float32)
    q = np.rint(rows * inverse[..., None]).astype(np.float64)  # float32 products, rounded half to even
    return q, (top / xmax).astype(np.float64)


def _same_arithmetic(matrix: BlockMatrix, x: torch.Tensor, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """What blocks.h computes, in float64 from the same int16 or int8 activations and stored scales:
    the result, and the sum of the magnitudes of its terms (what float32 rounding scales with)."""
    q, scale = _quantized(x, kind)
    sums = scale * q.sum(axis=2)
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
        products, offsets = dots * d[None] * scale[:, None], offset[None] * sums[:, None]
        results.append((products + offsets).sum(axis=2))
        magnitudes.append((np.abs(products) + np.abs(offsets)).sum(axis=2))
    return np.concatenate(results, axis=1), np.concatenate(magnitudes, axis=1)


def _activation_error_bound(x: torch.Tensor, weights: torch.Tensor, kind: int) -> torch.Tensor:
    """[M, N]: the most that rounding x to its blocks' integers moves x @ weights.T (half a step
    per element, a step being the block's largest magnitude / XMAX)."""
    _, scale = _quantized(x, kind)
    half_steps = torch.from_numpy(np.repeat(scale / 2, 32, axis=1))  # [M, K]
    return half_steps @ weights.abs().T


@KINDS
@pytest.mark.parametrize("ggml_type", LEGACY_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13])
@pytest.mark.parametrize("out_features, in_features", [(37, 96), (64, 32), (21, 576)])
def test_gemm_is_the_block_arithmetic_and_close_to_the_float_matrix(isa, kind, ggml_type, rows, out_features,
                                                                      in_features):
    matrix = random_blocks(out_features, in_features, ggml_type, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(100 + rows))
    got = _gemm(isa, matrix, x, kind)
    assert got.shape == (rows, -(-out_features // 16) * 16)
    assert torch.equal(got[:, out_features:], torch.zeros_like(got[:, out_features:]))
    want, magnitude = _same_arithmetic(matrix, x, kind)
    assert (np.abs(got[:, :out_features].double().numpy() - want) <= 1e-5 * magnitude + 1e-30).all()
    weights = matrix.dequantize().double()
    dense = x.double() @ weights.T
    bound = _activation_error_bound(x.double(), weights, kind)
    assert ((got[:, :out_features].double() - dense).abs() <= bound * 1.001 + 1e-6).all()


@KINDS
@pytest.mark.parametrize("ggml_type", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_the_largest_weights_and_activations_are_summed_exactly(isa, kind, ggml_type):
    """Every weight at its type's largest integer (Q4: nibble 15, Q8_0: -128 and 127) against rows
    of one value, ±: every activation at ±XMAX, where int8's products summed in int16 (blocks.h,
    nibble_products) come closest to overflowing."""
    matrix = random_blocks(32, 256, ggml_type, seed=1)
    for part in matrix.parts:
        blocks = part.data.reshape(part.data.shape[0], -1, part.data.shape[1] // 8)
        if ggml_type == Q.Q8_0:
            blocks[..., 2:] = np.array([128, 127], dtype=np.uint8)[np.arange(32) % 2]  # int8 -128, 127
        else:
            blocks[..., 4 if ggml_type == Q.Q4_1 else 2:] = 0xFF
    x = torch.tensor([[1.0] * 256, [-1.0] * 256, [0.5, -0.5] * 128])
    got = _gemm(isa, matrix, x, kind)[:, :32].double().numpy()
    want, magnitude = _same_arithmetic(matrix, x, kind)
    assert (np.abs(got - want) <= 1e-5 * magnitude + 1e-30).all()


@KINDS
@pytest.mark.parametrize("ggml_type, values", [(Q.Q4_K, slice(16, 144)), (Q.Q6_K, slice(0, 192))],
                         ids=["Q4_K", "Q6_K"])
def test_the_largest_k_quant_values_are_summed_exactly(isa, kind, ggml_type, values):
    """Every Q4_K nibble 15 (summed in int16 over a window without VNNI, as Q4's) and every Q6_K
    value 63 (its largest vpmaddubsw pairs), against rows at ±XMAX: within the activations'
    rounding of the dequantized product, as any overflow would not be."""
    matrix = random_blocks(32, 512, ggml_type, seed=2)
    for part in matrix.parts:
        part.data.reshape(part.data.shape[0], 2, -1)[..., values] = 0xFF
    x = torch.tensor([[1.0] * 512, [-1.0] * 512, [0.5, -0.5] * 256])
    weights = matrix.dequantize().double()
    dense = x.double() @ weights.T
    got = _gemm(isa, matrix, x, kind)[:, :32].double()
    assert ((got - dense).abs() <= _activation_error_bound(x.double(), weights, kind) * 1.001 + 1e-4).all()


@KINDS
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 9])
@pytest.mark.parametrize("out_features, in_features", [(37, 256), (16, 768)])
def test_k_quant_gemm_is_close_to_the_dequantized_matrix(isa, kind, ggml_type, rows, out_features, in_features):
    """Dequantized by gguf's own reference; the error is the activations' rounding alone."""
    matrix = random_blocks(out_features, in_features, ggml_type, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(100 + rows))
    got = _gemm(isa, matrix, x, kind)
    assert torch.equal(got[:, out_features:], torch.zeros_like(got[:, out_features:]))
    weights = matrix.dequantize().double()
    dense = x.double() @ weights.T
    bound = _activation_error_bound(x.double(), weights, kind)
    assert ((got[:, :out_features].double() - dense).abs() <= bound * 1.001 + 1e-6).all()


@KINDS
def test_a_fused_matrix_may_mix_types_and_rows_do_not_depend_on_their_batch(isa, kind):
    """Parts of every type and of 3 to 13 rows (groups padded inside each part), every row count
    from 1 to 20, at 1 and 3 threads: bit for bit what each part gives alone and what each row
    gives alone."""
    parts = [random_blocks(rows, 256, ggml_type, seed) for seed, (rows, ggml_type) in
             enumerate([(13, Q.Q4_0), (8, Q.Q6_K), (5, Q.Q4_1), (3, Q.Q4_K), (9, Q.Q8_0), (6, Q.Q5_K)])]
    fused = BlockMatrix.cat(parts)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([_gemm(isa, fused, x[i:i + 1], kind) for i in range(20)])
    by_part = torch.cat([_gemm(isa, part, x, kind)[:, :part.shape[0]] for part in parts], dim=1)
    assert torch.equal(alone[:, :44], by_part)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            for rows in range(1, 21):
                assert torch.equal(_gemm(isa, fused, x[:rows], kind), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@KINDS
def test_every_build_gives_the_same_bits(kind):
    """AVX-512 builds multiply two neighbouring groups per vector (csrc/block_kernels.h): the same
    bits as AVX2's one, for every type, whole and partial groups, neighbours of two types, and
    thread ranges that split a pair."""
    parts = [random_blocks(rows, 512, ggml_type, seed) for seed, (rows, ggml_type) in
             enumerate([(24, Q.Q4_0), (16, Q.Q6_K), (40, Q.Q4_1), (13, Q.Q4_K), (32, Q.Q8_0), (8, Q.Q5_K),
                        (16, Q.Q5_K), (21, Q.Q4_0)])]
    fused = BlockMatrix.cat(parts)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            for rows in (1, 5, 11):
                results = {name: _gemm(native.load(name), fused, x[:rows], kind) for name in native_builds()}
                for name, result in results.items():
                    assert torch.equal(result, results["avx2"]), (name, count, rows)
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


def _pair(name: str, quantization: str, block_activations: str = "int16"):
    """The native decoder on block weights, and the PyTorch decoder on the same weights dequantized (fp32)."""
    config = CONFIGS[name]
    weights = quantize(random_weights(config, seed=11), quantization, config, torch.bfloat16, torch.device("cpu"))
    assert weights.in_blocks
    ours = build_model(config, weights, dtype=torch.bfloat16, device=torch.device("cpu"), num_slots=3,
                       max_model_len=100, backend="native", block_activations=block_activations)
    assert ours.decoder.kind == {"int16": native.WEIGHTS_BLOCKS, "int8": native.WEIGHTS_BLOCKS_X8}[block_activations]
    reference = build_model(config, dequantized(weights), dtype=torch.float32, device=torch.device("cpu"),
                            num_slots=3, max_model_len=100, backend="torch")
    return reference, ours


@pytest.mark.parametrize("block_activations", ["int16", "int8"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("quantization", ["q4_0", "q8_0"])
def test_block_models_match_the_pytorch_decoder_on_the_same_weights(isa, name, quantization, block_activations):
    """Prefill, verify, a mixed batch and decode; the embedding rows come from the blocks too. The
    KV cache is fp16 in ours, fp32 in the reference."""
    reference, ours = _pair(name, quantization, block_activations)
    config = CONFIGS[name]
    a, b = _ids(config, 37, 1), _ids(config, 9, 2)
    for chunks in ([SequenceChunk(0, 0, a, num_logits=len(a))], [SequenceChunk(0, 37, [5, 6, 7, 8, 9], num_logits=5)],
                   [SequenceChunk(1, 0, b, num_logits=3), SequenceChunk(0, 42, [1]), SequenceChunk(2, 0, a[:20])]):
        want, got = reference.run(chunks), ours.run(chunks)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)


D32 = ModelConfig("llama", 300, 128, 256, 2, 4, 2, 32, 1e-5, 10000.0, 512, True, False)  # the generic attention path


@pytest.mark.parametrize("config, quantization, dtype, closer", [(CONFIGS["d64-gqa3"], "q4_0", torch.bfloat16, 4),
                                                                 (D32, "none", torch.float32, 4),
                                                                 (D32, "none", torch.bfloat16, 1)],
                         ids=["blocks-d64", "fp32-d32", "bf16-d32"])
def test_an_fp16_kv_cache_holds_the_fp32_values_rounded(isa, config, quantization, dtype, closer):
    """The default for blocks (llama.cpp's choice), and --kv-cache-dtype float16 for float weights:
    the cache holds the fp32 K and V rounded to fp16, and the logits stay nearer the fp32 cache's
    than a bf16 cache's do: `closer` times (7-9 measured) where the matrix inputs are exact or
    int16, while bf16 weights, whose matrix inputs are rounded to bf16 too, leave fp16 only ahead
    (1.3 measured)."""
    weights = quantize(random_weights(config, seed=11), quantization, config, dtype, torch.device("cpu"))
    models = {kv: build_model(config, weights, dtype=dtype, device=torch.device("cpu"), num_slots=1,
                              max_model_len=100, backend="native", kv_cache_dtype=kv)
              for kv in (torch.float16, torch.float32, torch.bfloat16)}
    if weights.in_blocks:
        assert build_model(config, weights, dtype=dtype, device=torch.device("cpu"), num_slots=1,
                           max_model_len=32).kv_cache.k[0].dtype == torch.float16
    prompt = _ids(config, 41, 5)
    logits = {kv: model.run([SequenceChunk(0, 0, prompt, num_logits=len(prompt))]) for kv, model in models.items()}
    rounded, exact = models[torch.float16].kv_cache, models[torch.float32].kv_cache
    for got, want in ((rounded.k[0], exact.k[0]), (rounded.v[0], exact.v[0])):
        assert torch.equal(got, want.to(torch.float16))  # the first layer's K and V, from the same inputs
    fp16_error = (logits[torch.float16] - logits[torch.float32]).abs().max()
    bf16_error = (logits[torch.bfloat16] - logits[torch.float32]).abs().max()
    assert 0 < fp16_error < bf16_error / closer


def test_a_kv_cache_in_another_dtype_than_the_compute_needs_the_native_decoder():
    config = CONFIGS["d64-gqa3"]
    with pytest.raises(ValueError, match="native CPU decoder"):
        build_model(config, random_weights(config, seed=1), dtype=torch.float32, device=torch.device("cpu"),
                    num_slots=1, max_model_len=32, backend="torch", kv_cache_dtype=torch.float16)


def test_a_model_of_k_quants_matches_the_pytorch_decoder(isa):
    """Q4_K_M's mix (Q4_K, with Q6_K for v and the head) and Q5_K, an untied Q6_K embedding whose
    rows come from the blocks; the down projection (384 wide, not a superblock's multiple) in
    Q8_0. An fp32 KV cache on both sides, so that the int16 activations are the difference."""
    config = CONFIGS["d128-untied"]
    weights = random_weights(config, seed=5)
    hidden, heads = config.hidden_size, config.num_heads * config.head_dim
    seeds = iter(range(1000))

    def k_matrix(rows: int, cols: int, ggml_type: Q) -> BlockMatrix:
        return random_blocks(rows, cols, ggml_type, next(seeds))

    kv_width = config.num_kv_heads * config.head_dim
    for layer in weights.layers:  # q|k in Q4_K, v in Q6_K
        layer.qkv = BlockMatrix.cat([k_matrix(heads + kv_width, hidden, Q.Q4_K), k_matrix(kv_width, hidden, Q.Q6_K)])
        layer.o = k_matrix(hidden, heads, Q.Q5_K)
        layer.gate_up = k_matrix(2 * config.intermediate_size, hidden, Q.Q4_K)
        layer.down = BlockMatrix.quantized(layer.down, Q.Q8_0)
    weights.embed = k_matrix(config.vocab_size, hidden, Q.Q6_K)
    weights.lm_head = k_matrix(config.vocab_size, hidden, Q.Q6_K)
    ours, reference = (build_model(config, w, dtype=torch.float32, device=torch.device("cpu"), num_slots=2,
                                   max_model_len=100, backend=backend)
                       for w, backend in ((weights, "native"), (dequantized(weights), "torch")))
    assert ours.decoder.block_types == {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0}
    a = _ids(config, 29, 7)
    for chunks in ([SequenceChunk(0, 0, a, num_logits=len(a))], [SequenceChunk(0, 29, [5, 6, 7], num_logits=3)]):
        want, got = reference.run(chunks), ours.run(chunks)
        torch.testing.assert_close(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory) -> Path:
    return write_k_quant_gguf(tmp_path_factory.mktemp("k") / "tiny-k.gguf")


def test_a_k_quant_gguf_runs_in_its_blocks_as_transformers_reads_it(isa, k_quant_gguf):
    """Q4_K, Q5_K and Q6_K tensors written by gguf's writer: kept in blocks (q and k rows unpermuted
    like the float loader's), and the model's logits and greedy text those of transformers loading
    the same file."""
    from transformers import AutoModelForCausalLM

    config, weights = load_checkpoint(k_quant_gguf, keep_blocks=True)
    _, floats = load_checkpoint(k_quant_gguf)
    assert [p.ggml_type for p in weights.layers[0].qkv.parts] == [Q.Q4_K, Q.Q4_K, Q.Q6_K]
    assert torch.equal(weights.layers[0].qkv.dequantize(), floats.layers[0].qkv)
    model = build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"), num_slots=1,
                        max_model_len=64, backend="native")
    hf = AutoModelForCausalLM.from_pretrained(str(k_quant_gguf.parent), gguf_file=k_quant_gguf.name,
                                              dtype=torch.float32).eval()
    prompt = list(range(3, 40))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    got = model.run([SequenceChunk(0, 0, prompt, num_logits=len(prompt))])
    torch.testing.assert_close(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)
    assert greedy_generate(model, prompt, 16, slot=0) == hf_greedy(hf, prompt, 16)
