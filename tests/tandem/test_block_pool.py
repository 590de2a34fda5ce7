"""The KV pool's blocks: reference counts, the blocks cached under a hash, and which block new KV takes."""
import pytest

from tandem.kv_events import BlocksRemoved, KvEventLog
from tandem.model.block_pool import BlockPool, CacheFullError


def test_new_kv_takes_blocks_that_cache_nothing_then_the_least_recently_freed():
    pool = BlockPool(4)
    a, b, c, d = pool.take(4)
    pool.cache(a, 100)
    pool.cache(b, 200)
    pool.release([b])  # freed first: evicted first
    pool.release([a, c])
    assert pool.num_free == 3 and pool.num_cached == 2
    assert pool.take(1) == [c], "a block that caches nothing goes first"
    assert pool.take(1) == [b] and pool.cached(200) is None and pool.cached(100) == a
    with pytest.raises(CacheFullError, match="2 KV blocks needed, 1 free"):
        pool.take(2)


def test_a_cached_block_found_again_is_held_and_leaves_the_free_blocks():
    pool = BlockPool(2)
    [block] = pool.take(1)
    pool.cache(block, 7)
    pool.release([block])
    assert pool.num_free == 2
    pool.hold(pool.cached(7))
    pool.hold(block)
    assert pool.num_free == 1 and pool.refs(block) == 2
    pool.release([block])
    assert pool.num_free == 1, "still held once"
    assert pool.take(1) != [block]


def test_a_hash_cached_by_two_blocks_stays_cached_until_both_are_evicted():
    """Two slots computed the same prefix in one step: a later slot finds the first block; the hash
    is removed (and recorded so) only with the last block caching it. A block keeps its first hash."""
    pool = BlockPool(3)
    pool.events = KvEventLog()
    a, b, _ = pool.take(3)
    assert pool.cache(a, 1) and not pool.cache(b, 1) and not pool.cache(a, 2)
    assert (pool.cached(1), pool.cached(2), pool.num_cached) == (a, None, 1)
    pool.release([a, b])  # a freed first: evicted first
    assert pool.take(1) == [a] and pool.cached(1) == b and pool.events.take() == []
    assert pool.take(1) == [b] and pool.cached(1) is None and pool.events.take() == [BlocksRemoved([1])]
