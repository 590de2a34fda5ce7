"""The native CPU decoder against the PyTorch decoder: same logits, rows independent of their batch.

Every instruction-set build this CPU can run is tested (AMX, AVX-512 with BF16, AVX-512 with VNNI, AVX-512, AVX2).
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tandem.config import ModelConfig
from tandem.model import native
from tests.support.devices import needs_native
from tandem.model.batch import SequenceChunk
from tandem.model.llama import build_model
from tandem.model.random_weights import SHAPES, random_weights
from tandem.quantization import quantize

pytestmark = needs_native

# head_dim 64 and 128 take the specialized attention kernels; "tiny" (16) the generic one.
CONFIGS = {
    "tiny": SHAPES["tiny"],
    "tiny-qwen2": SHAPES["tiny-qwen2"],
    "d64-gqa3": ModelConfig("llama", 300, 192, 320, 2, 3, 1, 64, 1e-5, 10000.0, 512, True, False),
    "d128-untied": ModelConfig("llama", 200, 256, 384, 2, 4, 2, 128, 1e-5, 10000.0, 512, False, False),
}


def _models(name: str, dtype: torch.dtype, max_len: int = 100, slots: int = 3):
    config = CONFIGS[name]
    weights = random_weights(config, seed=11)
    return [build_model(config, weights, dtype=dtype, device=torch.device("cpu"), num_slots=slots,
                        max_model_len=max_len, backend=backend) for backend in ("torch", "native")]


def _kind(dtype: torch.dtype) -> int:
    return native.WEIGHTS_BF16 if dtype == torch.bfloat16 else native.WEIGHTS_F32


def _ids(config: ModelConfig, n: int, seed: int) -> list[int]:
    return torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _scenario(config: ModelConfig) -> list[list[SequenceChunk]]:
    """Prefill past one K block, verify, a mixed batch (prefill + decode + verify), decode near the end."""
    a, b = _ids(config, 37, 1), _ids(config, 9, 2)
    return [
        [SequenceChunk(0, 0, a, num_logits=len(a))],
        [SequenceChunk(0, 37, [5, 6, 7, 8, 9], num_logits=5)],
        [SequenceChunk(1, 0, b, num_logits=3), SequenceChunk(0, 42, [1]), SequenceChunk(2, 0, a[:20])],
        [SequenceChunk(2, 20, a[20:37], num_logits=17), SequenceChunk(1, 9, [4, 4], num_logits=2)],
        [SequenceChunk(0, 43, b * 6, num_logits=2)],  # reaches 97 of 100 positions (112 allocated)
    ]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_logits_match_the_pytorch_decoder(isa, name):
    reference, ours = _models(name, torch.float32)
    assert ours.native and not reference.native
    for chunks in _scenario(CONFIGS[name]):
        want, got = reference.run(chunks), ours.run(chunks)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_logits_are_as_close_to_fp32_as_the_pytorch_bf16_path(isa, name):
    """Both bf16 paths approximate the fp32 model; ours keeps the residual stream in fp32."""
    truth, _ = _models(name, torch.float32)
    reference, ours = _models(name, torch.bfloat16)
    for chunks in _scenario(CONFIGS[name]):
        exact = truth.run(chunks)
        ours_error = (ours.run(chunks) - exact).abs().max().item()
        torch_error = (reference.run(chunks) - exact).abs().max().item()
        assert ours_error <= max(1.5 * torch_error, 0.05 * exact.abs().max().item())


@pytest.mark.parametrize("dtype, quantization", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                                 (torch.bfloat16, "q4_0"), (torch.bfloat16, "q8_0")])
def test_a_row_does_not_depend_on_its_batch_or_the_thread_count(isa, dtype, quantization):
    """Bit for bit: greedy output with speculation stays identical to the target alone only if a
    position's logits are the same in a decode step, a verify step or a batch of others. Block
    weights (csrc/blocks.h) too."""
    config = CONFIGS["d64-gqa3"]
    weights = quantize(random_weights(config, seed=11), quantization, config, dtype, torch.device("cpu"))
    model = build_model(config, weights, dtype=dtype, device=torch.device("cpu"), num_slots=3, max_model_len=100,
                        backend="native")
    prompt, other = _ids(config, 30, 3), _ids(config, 25, 4)
    model.run([SequenceChunk(0, 0, prompt)])
    model.run([SequenceChunk(1, 0, other)])
    drafts = [7, 8, 9, 10]
    alone = torch.cat([model.run([SequenceChunk(0, 30 + i, [token])]) for i, token in enumerate(drafts)])
    verified = model.run([SequenceChunk(0, 30, drafts, num_logits=4)])
    batched = model.run([SequenceChunk(1, 25, [3]), SequenceChunk(0, 30, drafts, num_logits=4),
                         SequenceChunk(2, 0, prompt[:12])])[1:5]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        threaded = model.run([SequenceChunk(0, 30, drafts, num_logits=4)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, verified)
    assert torch.equal(alone, batched)
    assert torch.equal(alone, threaded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_hidden_then_logits_equals_forward(isa, dtype):
    _, model = _models("d128-untied", dtype)
    chunks = [SequenceChunk(0, 0, _ids(CONFIGS["d128-untied"], 21, 5), num_logits=4)]
    hidden = model.final_hidden(model.build_batch(chunks))
    assert hidden.shape == (4, 256)
    assert torch.equal(model.logits(hidden), model.run(chunks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 40])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (100, 300), (48, 1000)])
def test_gemm_matches_f_linear(isa, dtype, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    packed = native.pack(weight)
    got = isa.gemm(x.contiguous(), native.packed_matrix(packed, out_features), _kind(dtype))
    want = F.linear(x.double(), weight.double())
    assert got.shape == (rows, -(-out_features // 16) * 16)
    torch.testing.assert_close(got[:, :out_features].double(), want, atol=1e-4 * want.abs().max().item(), rtol=0)
    assert torch.equal(got[:, out_features:], torch.zeros_like(got[:, out_features:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_do_not_depend_on_how_many_share_the_call(isa, dtype):
    """Bit for bit, every row count from a decode's 1 to past two blocks of widened rows (the
    AVX2 bf16 path widens x ten rows at a time and tiles them by five), and at 1 and 3 threads."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(112, 192, generator=gen).to(dtype)  # 7 panels: two-panel tiles and a lone one
    x = torch.randn(23, 192, generator=gen).to(dtype)
    packed = native.pack(weight)  # the matrix points into it: keep it alive
    matrix = native.packed_matrix(packed, 112)
    alone = torch.cat([isa.gemm(x[i:i + 1].contiguous(), matrix, _kind(dtype)) for i in range(23)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            for rows in range(1, 24):
                got = isa.gemm(x[:rows].contiguous(), matrix, _kind(dtype))
                assert torch.equal(got, alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_every_build_this_cpu_runs_compiles():
    """A build that fails to compile makes load() fall back, and the tests marked needs_native skip
    where none is left: here it fails instead."""
    for isa in native.runnable_isas():
        assert native._build(isa).exists(), isa.name


def test_a_cpu_without_the_instructions_gets_no_build(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    native.load.cache_clear()
    try:
        assert native.runnable_isas() == [] and native.load() is None
        config = CONFIGS["tiny"]
        model = build_model(config, random_weights(config), dtype=torch.float32, device=torch.device("cpu"),
                            num_slots=1, max_model_len=32)
        assert not model.native
        with pytest.raises(ValueError, match="native CPU decoder"):
            build_model(config, random_weights(config), dtype=torch.float32, device=torch.device("cpu"),
                        num_slots=1, max_model_len=32, backend="native")
    finally:
        native.load.cache_clear()


def test_tandem_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("TANDEM_NATIVE", "0")
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


def test_argmax_is_torch_argmax_ties_and_nan_included(isa):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 1000, generator=gen)
    rows[1, :] = 3.0  # all tied: the first index
    rows[2, 17] = rows[2, 900] = 50.0  # a tie across vector lanes and the tail
    rows[3, 999] = 60.0  # the maximum in the scalar tail
    rows[4, :] = float("-inf")
    rows[5, 40] = float("nan")  # NaN counts as the maximum, as in torch
    rows[6, 998] = float("nan")
    rows[7, 16] = rows[7, 0] = 70.0
    rows[8, 5] = float("inf")
    assert isa.argmax(rows) == rows.argmax(dim=1).tolist()
    wide = torch.randn(3, 49152, generator=gen)
    assert isa.argmax(wide[:, :49151]) == wide[:, :49151].argmax(dim=1).tolist()


@pytest.mark.parametrize("name", ["tiny", "d64-gqa3"])
def test_captured_layer_inputs_match_the_pytorch_decoder(isa, name):
    """The features an EAGLE-style drafter reads: the residual stream entering chosen layers, at every
    token of mixed batches, fp32 in both decoders; capturing leaves the logits as they were."""
    reference, ours = _models(name, torch.float32)
    plain, _ = _models(name, torch.float32)
    layers = (0, 1)
    for chunks in _scenario(CONFIGS[name]):
        want_logits, want = reference.forward_capturing(reference.build_batch(chunks), layers)
        got_logits, got = ours.forward_capturing(ours.build_batch(chunks), layers)
        assert got.shape == (sum(len(c.token_ids) for c in chunks), 2, CONFIGS[name].hidden_size)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(got_logits, want_logits, atol=2e-4, rtol=1e-4)
        assert torch.equal(want_logits, plain.run(chunks))
    first = _scenario(CONFIGS[name])[0]
    embedded = F.embedding(torch.tensor(first[0].token_ids), random_weights(CONFIGS[name], seed=11).embed)
    _, fresh = _models(name, torch.float32)
    torch.testing.assert_close(fresh.forward_capturing(fresh.build_batch(first), (0,))[1][:, 0], embedded)


def test_capture_layers_are_checked():
    _, model = _models("tiny", torch.float32)
    batch = model.build_batch([SequenceChunk(0, 0, [1, 2, 3])])
    for layers in ((), (1, 0), (0, 0), (0, CONFIGS["tiny"].num_layers)):
        with pytest.raises(ValueError, match="capture layers"):
            model.forward_capturing(batch, layers)
