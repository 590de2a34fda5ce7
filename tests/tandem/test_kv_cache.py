"""Cache correctness: incremental = full recompute, mixed batches = each alone, rollback = never seen."""
from __future__ import annotations

import os

import pytest
import torch

from tandem.model.batch import SequenceChunk
from tandem.model.kv_cache import PAGE_SIZE, CacheFullError, KVCache
from tandem.model.llama import build_model
from tandem.model.random_weights import SHAPES, random_weights

ATOL = 1e-4


@pytest.fixture(params=[(shape, backend) for shape in ("tiny", "tiny-qwen2") for backend in ("torch", "auto", "static")],
                ids=lambda p: "-".join(p))
def model(request):
    """The PyTorch decoder, the native CPU decoder where this CPU runs it, and the PyTorch decoder
    with static-shape decode and verify steps (the CUDA graph path, run eagerly)."""
    shape, backend = request.param
    config = SHAPES[shape]
    static = backend == "static"
    return build_model(config, random_weights(config, seed=3), dtype=torch.float32,
                       device=torch.device("cpu"), num_slots=4, max_model_len=128,
                       backend="torch" if static else backend, cuda_graphs=static)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _full(model, ids: list[int], slot: int = 3) -> torch.Tensor:
    return model.run([SequenceChunk(slot=slot, start=0, token_ids=ids, num_logits=len(ids))])


def test_incremental_decode_equals_full_recompute(model):
    ids = _tokens(24, 0)
    full = _full(model, ids)
    steps = [model.run([SequenceChunk(slot=0, start=0, token_ids=ids[:10])])]
    steps += [model.run([SequenceChunk(slot=0, start=i, token_ids=[ids[i]])]) for i in range(10, 24)]
    torch.testing.assert_close(torch.cat(steps), full[9:], atol=ATOL, rtol=ATOL)


def test_mixed_batch_equals_each_sequence_alone(model):
    """Slot 0 prefills, slot 1 decodes one token, slot 2 verifies 5 tokens: all in one forward."""
    a, b, c = _tokens(13, 1), _tokens(20, 2), _tokens(17, 3)
    model.run([SequenceChunk(slot=1, start=0, token_ids=b[:19])])
    model.run([SequenceChunk(slot=2, start=0, token_ids=c[:12])])
    mixed = model.run([
        SequenceChunk(slot=0, start=0, token_ids=a),
        SequenceChunk(slot=1, start=19, token_ids=b[19:]),
        SequenceChunk(slot=2, start=12, token_ids=c[12:], num_logits=5),
    ])
    assert mixed.shape[0] == 1 + 1 + 5
    torch.testing.assert_close(mixed[0], _full(model, a)[-1], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(mixed[1], _full(model, b)[-1], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(mixed[2:], _full(model, c)[-5:], atol=ATOL, rtol=ATOL)


def test_rollback_then_decode_equals_never_having_seen_rejected_tokens(model):
    prefix, rejected, accepted = _tokens(15, 4), _tokens(4, 5), _tokens(3, 6)
    model.run([SequenceChunk(slot=0, start=0, token_ids=prefix)])
    model.run([SequenceChunk(slot=0, start=15, token_ids=rejected, num_logits=4)])
    # Roll back to length 15 by writing from position 15 again: nothing is copied or cleared.
    got = model.run([SequenceChunk(slot=0, start=15, token_ids=accepted, num_logits=3)])
    want = _full(model, prefix + accepted)[-3:]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def test_chunk_past_the_cache_is_refused(model):
    with pytest.raises(ValueError, match="cache holds 128"):
        model.run([SequenceChunk(slot=0, start=120, token_ids=_tokens(9, 7))])


def _positions(cache: KVCache, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a slot's reserved positions as [heads, positions, head_dim], read through its block
    table whatever the K layout."""
    pool = cache.pool_index([slot], len(cache.block_table(slot)) * PAGE_SIZE)[0]
    k, v = cache.k[layer], cache.v[layer][:, pool]
    if cache.transposed_keys:  # [heads, blocks, head_dim, block] -> [positions, heads, head_dim]
        return k[:, pool // PAGE_SIZE, :, pool % PAGE_SIZE].transpose(0, 1), v
    return k[:, pool], v


def _scrambled(transposed_keys: bool, num_blocks: int | None = None) -> KVCache:
    """Three slots of 20 positions whose blocks interleave (slot 2 first, then 0, 1, 0, 2, 1)."""
    cache = KVCache(SHAPES["tiny"], num_slots=3, max_len=20, dtype=torch.float32, device=torch.device("cpu"),
                    transposed_keys=transposed_keys, num_blocks=num_blocks)
    for slot, length in ((2, 10), (0, 5), (1, 16), (0, 20), (2, 20), (1, 20)):
        cache.reserve(slot, length)
    return cache


@pytest.mark.parametrize("transposed_keys", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("start, end", [(0, 13), (0, 0), (3, 10), (5, 17), (8, 16), (2, 3), (0, 20)])
def test_copy_positions_copies_exactly_that_range(transposed_keys, start, end):
    cache = _scrambled(transposed_keys)
    generator = torch.Generator().manual_seed(0)
    for tensor in cache.k + cache.v:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    layers = range(SHAPES["tiny"].num_layers)
    before = [_positions(cache, layer, 2) for layer in layers]
    other = [t.clone() for t in _positions(cache, 0, 1)]
    cache.copy_positions(source=0, dest=2, start=start, end=end)
    inside = torch.zeros(cache.positions, dtype=torch.bool)
    inside[start:end] = True
    for layer in layers:
        for source, copied, old in zip(_positions(cache, layer, 0), _positions(cache, layer, 2), before[layer]):
            assert torch.equal(copied[:, inside], source[:, inside])
            assert torch.equal(copied[:, ~inside], old[:, ~inside])
    assert all(torch.equal(t, old) for t, old in zip(_positions(cache, 0, 1), other))


def test_blocks_come_from_the_pool_and_go_back_past_what_a_freed_slot_keeps():
    cache = KVCache(SHAPES["tiny"], num_slots=2, max_len=64, dtype=torch.float32, device=torch.device("cpu"),
                    num_blocks=5)
    slot = cache.allocate()
    cache.reserve(slot, 1)
    cache.reserve(slot, 16)  # still one block
    assert cache.num_free_blocks == 4
    cache.reserve(slot, 40)
    assert cache.num_free_blocks == 2 and cache.block_tables[slot, :3].tolist() == cache.block_table(slot)
    assert cache.usage == 3 / 5
    other = cache.allocate()
    with pytest.raises(CacheFullError, match="3 KV blocks needed, 2 free"):
        cache.reserve(other, 48)
    assert cache.num_free_blocks == 2  # a refused reserve takes nothing
    cache.free(slot, keep=17)  # positions 0..16: two blocks stay with the slot
    assert cache.num_free_blocks == 3 and len(cache.block_table(slot)) == 2
    cache.reserve(other, 48)
    assert cache.num_free_blocks == 0 and cache.usage == 3 / 5  # the freed slot's kept blocks are not in use
    with pytest.raises(ValueError, match="do not fit"):
        cache.reserve(other, 65)


def test_copy_positions_refuses_bad_slots_and_ranges():
    cache = KVCache(SHAPES["tiny"], num_slots=2, max_len=8, dtype=torch.float32, device=torch.device("cpu"))
    for source, dest, start, end in ((0, 0, 0, 4), (0, 2, 0, 4), (0, 1, 5, 4), (0, 1, 0, 9), (-1, 1, 0, 4)):
        with pytest.raises(ValueError):
            cache.copy_positions(source, dest, start, end)


def test_a_copied_prefix_continues_like_the_original(model):
    """Both K layouts, as each decoder reads them: slot 2 gets slot 0's prefix, then both run the same tokens."""
    prefix, more = _tokens(21, 8), _tokens(5, 9)
    model.run([SequenceChunk(slot=0, start=0, token_ids=prefix)])
    model.run([SequenceChunk(slot=2, start=0, token_ids=_tokens(30, 10))])  # stale entries that must not show
    model.kv_cache.copy_positions(source=0, dest=2, start=0, end=len(prefix))
    original = model.run([SequenceChunk(slot=0, start=len(prefix), token_ids=more, num_logits=5)])
    copy = model.run([SequenceChunk(slot=2, start=len(prefix), token_ids=more, num_logits=5)])
    assert torch.equal(copy, original)


def test_interleaved_blocks_read_like_contiguous_ones(model):
    """Two sequences decoding in one batch take blocks in turn, so neither's blocks are consecutive:
    every path reads through the block tables and gives each one's logits as a fresh slot does."""
    a, b = _tokens(40, 11), _tokens(40, 12)
    model.run([SequenceChunk(slot=0, start=0, token_ids=a[:10])])
    model.run([SequenceChunk(slot=1, start=0, token_ids=b[:10])])
    steps = [model.run([SequenceChunk(slot=0, start=i, token_ids=[a[i]]), SequenceChunk(slot=1, start=i, token_ids=[b[i]])])
             for i in range(10, 40)]
    assert model.kv_cache.contiguous_start(0, 40) is None
    torch.testing.assert_close(torch.stack([s[0] for s in steps]), _full(model, a)[10:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(torch.stack([s[1] for s in steps]), _full(model, b, slot=2)[10:], atol=ATOL, rtol=ATOL)
    alone = model.run([SequenceChunk(slot=0, start=39, token_ids=[a[39]])])  # one sequence, scattered blocks
    torch.testing.assert_close(alone[0], steps[-1][0], atol=ATOL, rtol=ATOL)


def test_a_shared_prefix_continues_like_the_original(model):
    """Slot 2 shares slot 0's two full blocks and copies its partial third; each then writes only its
    own blocks, so each continues as a fresh slot with the same tokens does."""
    prefix, more, other = _tokens(37, 13), _tokens(5, 14), _tokens(5, 15)
    kv = model.kv_cache
    model.run([SequenceChunk(slot=0, start=0, token_ids=prefix)])
    model.run([SequenceChunk(slot=2, start=0, token_ids=_tokens(30, 10))])  # blocks of its own, replaced
    kv.share_prefix(source=0, dest=2, length=len(prefix))
    assert kv.block_table(2)[:2] == kv.block_table(0)[:2] and kv.block_table(2)[2] != kv.block_table(0)[2]
    assert [kv.pool.refs(b) for b in kv.block_table(2)[:3]] == [2, 2, 1]
    model.run([SequenceChunk(slot=2, start=len(prefix), token_ids=other)])
    original = model.run([SequenceChunk(slot=0, start=len(prefix), token_ids=more, num_logits=5)])
    fresh = _full(model, prefix + more, slot=1)[len(prefix):]
    torch.testing.assert_close(original, fresh, atol=ATOL, rtol=ATOL)
    shared = model.run([SequenceChunk(slot=2, start=len(prefix), token_ids=more, num_logits=5)])
    assert torch.equal(shared, original)


def test_a_shared_block_goes_back_to_the_pool_when_its_last_holder_frees_it():
    cache = KVCache(SHAPES["tiny"], num_slots=2, max_len=64, dtype=torch.float32, device=torch.device("cpu"),
                    num_blocks=4)
    a, b = cache.allocate(), cache.allocate()
    cache.reserve(a, 20)
    cache.share_prefix(a, b, 20)
    assert cache.num_free_blocks == 1 and cache.usage == 3 / 4  # one shared block, a tail each
    cache.free(a)
    assert cache.num_free_blocks == 2 and cache.pool.refs(cache.block_table(b)[0]) == 1
    cache.free(b)
    assert cache.num_free_blocks == 4


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_block_of_several_pages_reads_like_blocks_of_one(backend):
    """--block-size 64: each block is four consecutive pages, which every path reads as it reads
    blocks of 16. Two sequences decoding in turn, and a third sharing the first's prefix, give the
    logits they give with blocks of 16."""
    config = SHAPES["tiny"]
    weights = random_weights(config, seed=3)
    logits = []
    for block_size in (16, 64):
        model = build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"), num_slots=4,
                            max_model_len=192, backend=backend, kv_cache_tokens=4 * 192, block_size=block_size)
        a, b = _tokens(150, 21), _tokens(150, 22)
        model.run([SequenceChunk(slot=0, start=0, token_ids=a[:70]), SequenceChunk(slot=1, start=0, token_ids=b[:5])])
        steps = [model.run([SequenceChunk(slot=0, start=i, token_ids=[a[i]]),
                            SequenceChunk(slot=1, start=i - 65, token_ids=[b[i - 65]])]) for i in range(70, 150)]
        model.kv_cache.share_prefix(source=0, dest=2, length=140)
        shared = model.run([SequenceChunk(slot=2, start=140, token_ids=a[140:150], num_logits=10)])
        logits.append((torch.stack(steps), shared))
        assert model.kv_cache.block_tables.shape[1] == 192 // 16
    torch.testing.assert_close(logits[1][0], logits[0][0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(logits[1][1], logits[0][1], atol=ATOL, rtol=ATOL)


def test_a_block_is_block_size_positions_of_consecutive_pages():
    cache = KVCache(SHAPES["tiny"], num_slots=2, max_len=100, dtype=torch.float32, device=torch.device("cpu"),
                    num_blocks=3, block_size=48)
    assert (cache.max_blocks, cache.positions, cache.v[0].shape[1]) == (3, 144, 3 * 48)
    slot = cache.allocate()
    cache.reserve(slot, 49)
    [first, second] = cache.block_table(slot)
    assert cache.block_tables[slot, :6].tolist() == [first * 3, first * 3 + 1, first * 3 + 2,
                                                      second * 3, second * 3 + 1, second * 3 + 2]
    assert cache.num_free_blocks == 1 and cache.blocks_for(96) == 2
    for size in (8, 24, 0):
        with pytest.raises(ValueError, match="multiple of 16"):
            KVCache(SHAPES["tiny"], 1, 64, torch.float32, torch.device("cpu"), block_size=size)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux's /proc")
def test_a_cpu_pool_takes_memory_only_for_the_blocks_written():
    """A CPU server's pool is sized for the worst case; until a sequence writes a block, it costs no
    resident memory (and it still reads as zeros)."""
    config = SHAPES["llama-3.2-1b"]  # 16 layers x 2 x 8 KV heads x 64: 32 KB per position in bf16
    before = _resident_bytes()
    cache = KVCache(config, num_slots=8, max_len=2048, dtype=torch.bfloat16, device=torch.device("cpu"))
    pool = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert pool == 8 * 2048 * 32 * 1024
    assert _resident_bytes() - before < pool / 50
    cache.v[3][:, : 4 * PAGE_SIZE] = 1.0  # one slot's first four pages of one layer
    assert _resident_bytes() - before < pool / 50
    assert cache.k[3].count_nonzero() == 0 and cache.v[3].count_nonzero() == 8 * 4 * PAGE_SIZE * 64
