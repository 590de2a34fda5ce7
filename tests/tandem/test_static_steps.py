"""Static-shape decode and verify steps (the CUDA graph path) equal the dynamic PyTorch decoder.

On CPU the static forward runs eagerly (build_model(cuda_graphs=True)); the same inputs, padding
and cache writes are what a CUDA graph replays. tests/tandem/test_model_gpu.py checks the graphs.
"""
from __future__ import annotations

import pytest
import torch

from tandem.model import torch_decoder
from tandem.model.batch import ForwardBatch, SequenceChunk
from tandem.model.kv_cache import PAGE_SIZE, CacheFullError
from tandem.model.llama import LlamaModel, build_model
from tandem.model.random_weights import SHAPES, random_weights
from tandem.model.slot_attention import INTERPRETED, slot_attention_triton
from tandem.model.static_steps import MAX_STEP_TOKENS, UniformBatch, batch_buckets

ATOL = 1e-4
CPU = torch.device("cpu")


def _pair(shape: str, num_slots: int, max_len: int = 96) -> tuple[LlamaModel, LlamaModel]:
    """(static, dynamic) PyTorch models with the same weights and their own caches."""
    config = SHAPES[shape]
    weights = random_weights(config, seed=7)
    return tuple(build_model(config, weights, dtype=torch.float32, device=CPU, num_slots=num_slots,
                             max_model_len=max_len, backend="torch", cuda_graphs=graphs)
                 for graphs in (True, False))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _both(static: LlamaModel, dynamic: LlamaModel, chunks: list[SequenceChunk]) -> None:
    """Run chunks on both models; logits must agree."""
    torch.testing.assert_close(static.run(chunks), dynamic.run(chunks), atol=ATOL, rtol=ATOL)


def _assert_same_real_slots(static: LlamaModel, dynamic: LlamaModel) -> None:
    """Every real block's K/V equal: padding rows wrote only the spare slot's block, past the pool."""
    for mine, theirs in zip(static.kv_cache.k + static.kv_cache.v, dynamic.kv_cache.k + dynamic.kv_cache.v):
        torch.testing.assert_close(mine[:, : theirs.shape[1]], theirs, atol=ATOL, rtol=ATOL)


def _prefill(static: LlamaModel, dynamic: LlamaModel, lengths: dict[int, int]) -> dict[int, list[int]]:
    """Prompts of ragged lengths per slot, prefilled on both models (the dynamic path)."""
    prompts = {slot: _ids(n, seed=slot) for slot, n in lengths.items()}
    for slot, prompt in prompts.items():
        _both(static, dynamic, [SequenceChunk(slot, 0, prompt)])
    return prompts


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2"])
def test_decode_steps_padded_to_a_bucket_equal_the_dynamic_path(shape):
    static, dynamic = _pair(shape, num_slots=5)
    prompts = _prefill(static, dynamic, {3: 7, 0: 30, 2: 2})  # 3 sequences -> bucket 4
    lengths = {slot: len(p) for slot, p in prompts.items()}
    for step in range(6):
        chunks = [SequenceChunk(slot, n, _ids(1, 100 * step + slot)) for slot, n in lengths.items()]
        _both(static, dynamic, chunks)
        lengths = {slot: n + 1 for slot, n in lengths.items()}
    assert static.decoder.static_steps.steps_run == {(4, 1): 6}
    _assert_same_real_slots(static, dynamic)


def test_verify_steps_with_rollback_equal_the_dynamic_path():
    static, dynamic = _pair("tiny", num_slots=6)
    prompts = _prefill(static, dynamic, {5: 12, 1: 3, 4: 40, 0: 21, 2: 8})  # 5 sequences -> bucket 8
    starts = {slot: len(p) for slot, p in prompts.items()}
    _both(static, dynamic, [SequenceChunk(s, n, _ids(5, s), num_logits=5) for s, n in starts.items()])
    # Each sequence keeps a different number of the 4 drafts; the next verify overwrites the rest.
    starts = {slot: n + 1 + slot % 4 for slot, n in starts.items()}
    _both(static, dynamic, [SequenceChunk(s, n, _ids(5, 10 + s), num_logits=5) for s, n in starts.items()])
    # Two sequences alone: bucket 2, a graph of its own.
    _both(static, dynamic, [SequenceChunk(s, starts[s] + 5, _ids(5, 20 + s), num_logits=5) for s in (4, 1)])
    assert static.decoder.static_steps.steps_run == {(8, 5): 2, (2, 5): 1}
    _assert_same_real_slots(static, dynamic)


def test_a_full_batch_and_a_single_sequence_use_the_smallest_bucket_that_fits():
    static, dynamic = _pair("tiny", num_slots=4)
    prompts = _prefill(static, dynamic, {0: 5, 1: 6, 2: 7, 3: 8})
    _both(static, dynamic, [SequenceChunk(s, len(p), [s + 1]) for s, p in prompts.items()])
    _both(static, dynamic, [SequenceChunk(2, 8, [9])])
    assert static.decoder.static_steps.steps_run == {(4, 1): 1, (1, 1): 1}


def test_prefills_and_mixed_batches_take_the_dynamic_path():
    static, _ = _pair("tiny", num_slots=4)
    decoder = static.decoder
    uniform = [
        [SequenceChunk(0, 3, [1]), SequenceChunk(1, 9, [2])],
        [SequenceChunk(0, 3, [1] * 5, num_logits=5), SequenceChunk(2, 0, [2] * 5, num_logits=5)],
        [SequenceChunk(0, 3, [1] * MAX_STEP_TOKENS, num_logits=MAX_STEP_TOKENS)],
    ]
    dynamic = [
        [SequenceChunk(0, 0, [1] * 5)],  # a prefill: logits at its last token only
        [SequenceChunk(0, 3, [1]), SequenceChunk(1, 9, [2] * 5, num_logits=5)],  # mixed lengths
        [SequenceChunk(0, 3, [1] * 5, num_logits=5), SequenceChunk(1, 9, [2] * 5, num_logits=4)],
        [SequenceChunk(0, 3, [1] * (MAX_STEP_TOKENS + 1), num_logits=MAX_STEP_TOKENS + 1)],
    ]
    assert all(isinstance(static.build_batch(chunks), UniformBatch) for chunks in uniform)
    assert all(isinstance(static.build_batch(chunks), ForwardBatch) for chunks in dynamic)
    assert decoder.static_steps.num_graphs == 0  # nothing is captured on CPU


def test_final_hidden_of_a_uniform_batch_equals_the_dynamic_one():
    static, dynamic = _pair("tiny", num_slots=2)
    _prefill(static, dynamic, {0: 9, 1: 4})
    chunks = [SequenceChunk(0, 9, [7, 8], num_logits=2), SequenceChunk(1, 4, [5, 6], num_logits=2)]
    got = static.final_hidden(static.build_batch(chunks))
    torch.testing.assert_close(got, dynamic.final_hidden(dynamic.build_batch(chunks)), atol=ATOL, rtol=ATOL)


@pytest.mark.skipif(not INTERPRETED, reason="the Triton interpreter runs the kernel on CPU tensors")
def test_static_steps_through_the_triton_kernel_equal_the_dynamic_path(monkeypatch):
    """The whole static forward with the kernel the GPU runs (interpreted), not its reference."""
    monkeypatch.setattr(torch_decoder, "slot_attention", slot_attention_triton)
    static, dynamic = _pair("tiny", num_slots=3)
    prompts = _prefill(static, dynamic, {2: 70, 0: 4, 1: 129 - 70})
    _both(static, dynamic, [SequenceChunk(s, len(p), _ids(1, s)) for s, p in prompts.items()])
    _both(static, dynamic, [SequenceChunk(s, len(p) + 1, _ids(5, s), num_logits=5) for s, p in prompts.items()])
    assert static.decoder.static_steps.steps_run == {(4, 1): 1, (4, 5): 1}


def test_the_spare_slot_is_never_handed_out():
    static, _ = _pair("tiny", num_slots=3)
    cache = static.kv_cache
    assert cache.padding_slot == 3 and cache.block_table(3) == [cache.num_blocks]
    assert cache.k[0].shape[1] == (cache.num_blocks + 1) * PAGE_SIZE
    assert sorted(cache.allocate() for _ in range(3)) == [0, 1, 2]
    with pytest.raises(CacheFullError):
        cache.allocate()
    with pytest.raises(ValueError):
        cache.free(cache.padding_slot)


def test_build_model_chooses_the_static_path():
    config = SHAPES["tiny"]
    weights = random_weights(config)
    kwargs = dict(dtype=torch.float32, device=CPU, num_slots=2, max_model_len=32)
    assert build_model(config, weights, cuda_graphs=True, **kwargs).decoder.static_steps is not None
    plain = build_model(config, weights, backend="torch", **kwargs)
    assert plain.decoder.static_steps is None and plain.kv_cache.padding_slot is None  # off on CPU by default
    with pytest.raises(ValueError, match="PyTorch decoder"):
        build_model(config, weights, backend="native", cuda_graphs=True, **kwargs)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 8]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
