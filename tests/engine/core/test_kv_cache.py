"""The page pool, the reference-counted allocator and the prefix cache (chained hashes, LRU eviction)."""

from __future__ import annotations

import pytest
import torch

from engine.core.kv.cache import PageAllocator, PagePool, page_hash


def chain(token_pages: list[list[int]]) -> list[bytes]:
    hashes, parent = [], None
    for tokens in token_pages:
        parent = page_hash(parent, tokens)
        hashes.append(parent)
    return hashes


def test_pool_layout_and_page_copy():
    pool = PagePool(
        num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, device="cpu"
    )
    assert len(pool.kv_caches) == 3
    for k, v in pool.kv_caches:
        assert k.shape == v.shape == (5, 4, 2, 8) and k.dtype == torch.bfloat16 and k.is_contiguous()
    assert pool.nbytes == PagePool.bytes_per_page(3, 4, 2, 8, torch.bfloat16) * 5 == 3 * 2 * 5 * 4 * 2 * 8 * 2
    for layer, (k, v) in enumerate(pool.kv_caches):
        k[1].fill_(layer + 1)
        v[1].fill_(-(layer + 1))
        k[3].fill_(0)
        v[3].fill_(0)
    pool.copy_pages([1], [3])
    for layer, (k, v) in enumerate(pool.kv_caches):
        assert torch.all(k[3] == layer + 1) and torch.all(v[3] == -(layer + 1))


def test_allocate_share_free_counts():
    alloc = PageAllocator(6)
    a = alloc.allocate(4)
    assert len(set(a)) == 4 and alloc.num_free == 2
    alloc.share(a[:2])
    alloc.free(a)
    assert alloc.num_free == 4  # the two shared pages still have an owner
    alloc.free(a[:2])
    assert alloc.num_free == 6
    alloc.check()
    with pytest.raises(MemoryError):
        alloc.allocate(7)
    with pytest.raises(RuntimeError):
        alloc.free([a[0]])


def test_hash_names_the_whole_prefix():
    h1 = chain([[1, 2], [3, 4]])
    h2 = chain([[9, 9], [3, 4]])
    assert h1[1] != h2[1]  # same page tokens, different prefix
    assert chain([[1, 2], [3, 4]]) == h1


def test_prefix_hit_and_partial_match():
    alloc = PageAllocator(8)
    hashes = chain([[1, 2], [3, 4], [5, 6]])
    pages = alloc.allocate(3)
    for p, h in zip(pages, hashes, strict=True):
        alloc.register(p, h)
    # A second owner of the same prefix shares the pages while the first still holds them.
    assert alloc.lookup(hashes[:2]) == pages[:2]
    assert alloc.ref_counts[pages[0]] == 2
    # A prompt that diverges in its second page only hits the first.
    other = chain([[1, 2], [7, 7], [5, 6]])
    assert alloc.lookup(other) == pages[:1]
    alloc.check()


def test_freed_cached_pages_survive_until_evicted_lru():
    alloc = PageAllocator(4)
    first = chain([[1], [2]])
    second = chain([[7], [8]])
    a = alloc.allocate(2)
    b = alloc.allocate(2)
    for p, h in zip(a + b, first + second, strict=True):
        alloc.register(p, h)
    alloc.free(a)  # freed first: evicted first
    alloc.free(b)
    assert alloc.num_free == 4 and alloc.num_cached == 4
    # Both prefixes still hit after being freed.
    assert alloc.lookup(first) == a
    alloc.free(a)
    (new,) = alloc.allocate(1)
    # `a` went back to the LRU after `b`, so b's tail page (freed before its head) goes first.
    assert new == b[1]
    assert alloc.lookup(second) == b[:1]
    assert alloc.lookup(first) == a
    alloc.check()


def test_uncached_pages_are_used_before_evicting():
    alloc = PageAllocator(3)
    (p,) = alloc.allocate(1)
    alloc.register(p, chain([[1]])[0])
    alloc.free([p])
    taken = alloc.allocate(2)
    assert p not in taken and alloc.num_cached == 1
    alloc.allocate(1)
    assert alloc.num_cached == 0  # evicted only when nothing else was free
    alloc.check()


def test_disabled_prefix_cache_never_hits():
    alloc = PageAllocator(2, enable_prefix_caching=False)
    (p,) = alloc.allocate(1)
    h = chain([[1]])
    alloc.register(p, h[0])
    assert alloc.lookup(h) == [] and alloc.num_cached == 0
