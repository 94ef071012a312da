"""Paged KV cache: the per-layer K/V page pools, a reference-counted page allocator and the prefix cache.

A full page is immutable once written, so it can be shared: by the children of one request (n, best_of,
beams) and, through the prefix cache, by later requests whose tokens hash to the same chain of pages.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

import torch

from engine.model.kv_spec import KVGroupSpec, LatentKV


def page_hash(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    """Chained hash of one full page: it names the page's tokens and every token before them; `extra` names what
    else the page's KV depends on (the digests of the images whose soft tokens it holds).

    NOTE: a cryptographic hash, so that a crafted prompt cannot collide with another user's prefix.
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def adapter_salt(adapter: str | None) -> bytes | None:
    """The seed of the hash chains of an adapter's requests, so that its KV (computed with its weights) is never
    shared with the base model's or another adapter's; None for the base model, whose hashes stay as they were."""
    return None if adapter is None else hashlib.blake2b(b"lora:" + adapter.encode(), digest_size=16).digest()


class PagePool:
    """The KV pages of every layer, allocated once: K and V per layer as [pages, page_size, kv_heads, head_dim]."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        zero_last: bool = False,
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        # One allocation: a page of every layer is copied in one indexing op (copy-on-write of forks).
        # NOTE: torch.empty, not zeros: backends read only written slots, and untouched CPU memory stays
        # out of the resident set until used.
        self.data = torch.empty(
            (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [(layer[0], layer[1]) for layer in self.data]
        if zero_last:
            # A window group's NULL page: never read, but finite, so that no masked-out key can bring in a NaN.
            self.data[:, :, -1].zero_()

    @classmethod
    def for_group(
        cls, group: KVGroupSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> PagePool:
        """The pool of one KV layer group; a window group's has one page more than its allocator: its NULL page."""
        if group.latent is not None:
            return LatentPagePool(
                num_layers=len(group.layers),
                num_pages=num_pages,
                page_size=page_size,
                latent=group.latent,
                dtype=dtype,
                device=device,
            )
        window = group.window is not None
        return cls(
            num_layers=len(group.layers),
            num_pages=num_pages + window,
            page_size=page_size,
            num_kv_heads=group.num_kv_heads,
            head_dim=group.head_dim,
            dtype=dtype,
            device=device,
            zero_last=window,
        )

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copies whole pages src[i] -> dst[i] in every layer, K and V."""
        if src:
            device = self.data.device
            self.data[:, :, torch.tensor(dst, device=device)] = self.data[:, :, torch.tensor(src, device=device)]


class LatentPagePool(PagePool):
    """An MLA group's pages: per layer one [pages, page_size, kv_lora_rank + rope_dim] row store, seen as the pair
    (ckv [pages, page_size, kv_lora_rank], kpe [pages, page_size, rope_dim]) that FlashInfer's MLA wrapper takes.

    NOTE: one allocation shaped as PagePool's with a single K/V slot and head, so copy_pages and nbytes hold."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        latent: LatentKV,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.data = torch.empty((num_layers, 1, num_pages, page_size, 1, latent.width), dtype=dtype, device=device)
        rank = latent.kv_lora_rank
        self.kv_caches = [(layer[0, :, :, 0, :rank], layer[0, :, :, 0, rank:]) for layer in self.data]


class PageAllocator:
    """Page ids with reference counts; full pages registered under their chained hash form the prefix cache.

    A page whose count drops to zero goes back to the free list, or, when it is cached, to an LRU of
    evictable pages that a prefix hit can revive. Allocation takes never-cached pages first, then evicts
    the least recently freed cached page.
    """

    def __init__(self, num_pages: int, enable_prefix_caching: bool = True) -> None:
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # page hash -> page id
        self._page_hash: list[bytes | None] = [None] * num_pages

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now (free plus evictable cached pages)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise MemoryError(f"asked for {count} KV pages, {self.num_free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                digest = self._page_hash[page]
                assert digest is not None, "an evictable page is a cached one"
                del self._cached[digest]
                self._page_hash[page] = None
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more owner for each page (a forked child)."""
        for page in pages:
            self.ref_counts[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page; the last page is released first, so a prefix outlives its tail."""
        for page in reversed(pages):
            count = self.ref_counts[page] - 1
            if count < 0:
                raise RuntimeError(f"KV page {page} freed more often than allocated")
            self.ref_counts[page] = count
            if count == 0:
                if self._page_hash[page] is not None:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def probe(self, hashes: list[bytes]) -> list[int | None]:
        """The cached page of each hash (None where there is none), taking nothing: see acquire()."""
        if not self.enable_prefix_caching:
            return [None] * len(hashes)
        return [self._cached.get(h) for h in hashes]

    def acquire(self, pages: list[int]) -> None:
        """One more reference to each cached page that probe() found (reviving evictable ones)."""
        for page in pages:
            if self.ref_counts[page] == 0:
                del self._evictable[page]
            self.ref_counts[page] += 1

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `hashes`, each with one more reference taken."""
        pages: list[int] = []
        for page in self.probe(hashes):
            if page is None:
                break
            pages.append(page)
        self.acquire(pages)
        return pages

    def register(self, page: int, h: bytes) -> None:
        """Offers a just-filled page to the prefix cache (a page with the same hash already there wins)."""
        if self.enable_prefix_caching and h not in self._cached and self._page_hash[page] is None:
            self._cached[h] = page
            self._page_hash[page] = h

    def check(self) -> None:
        """Asserts the bookkeeping invariants (tests call this every step)."""
        used = sum(1 for c in self.ref_counts if c > 0)
        assert used + self.num_free == self.num_pages, (used, self.num_free, self.num_pages)
        assert all(self.ref_counts[p] == 0 for p in self._free)
        assert all(self.ref_counts[p] == 0 and self._page_hash[p] is not None for p in self._evictable)
        assert all(self._page_hash[p] == h for h, p in self._cached.items())
