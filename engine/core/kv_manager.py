"""The KV side of every sequence across the layer groups: allocate, copy-on-write, share (forks), free, prefix
hits and the sliding of windows, so that the scheduler reasons in per-group page counts.

Every group keeps, per sequence, a page list as long as the computed prefix (so positions line up in one page
table format). In a sliding-window group a page that fell wholly out of the window is swapped for the group's
NULL page (one reserved page past the allocator's, never freed, never read: the backend skips keys outside the
window) and given back after the step; between steps a sequence holds at most ceil(W / page_size) + 1 real
pages there.
"""

from __future__ import annotations

from engine.core.kv_cache import PageAllocator
from engine.core.sequence import Sequence
from engine.model.kv_spec import KVGroupSpec


class KVCacheManager:
    """One PageAllocator per layer group; group g's NULL page (window groups) is page id num_pages[g]."""

    def __init__(
        self, specs: list[KVGroupSpec], num_pages: list[int], page_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.specs = specs
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocators = [PageAllocator(n, enable_prefix_caching) for n in num_pages]
        self.null_pages = [None if s.window is None else n for s, n in zip(specs, num_pages, strict=True)]
        # Free pages an admission must leave in each group, so that running decodes do not preempt at once.
        self.watermark = [n // 100 for n in num_pages]

    @property
    def has_windows(self) -> bool:
        return any(null is not None for null in self.null_pages)

    @property
    def num_free(self) -> list[int]:
        return [a.num_free for a in self.allocators]

    def has_room(self, need: list[int], reserve: list[int] | None = None) -> bool:
        reserve = reserve or [0] * len(need)
        return all(n + r <= a.num_free for n, r, a in zip(need, reserve, self.allocators, strict=True))

    def _lists(self, seq: Sequence) -> list[list[int]]:
        if not seq.kv_pages:
            seq.kv_pages = [[] for _ in self.specs]
        return seq.kv_pages

    def _copies_last(self, g: int, seq: Sequence) -> bool:
        """The sequence's partly filled last page in group g is shared: its next token writes into a copy."""
        return bool(seq.num_computed_tokens % self.page_size) and self.allocators[g].ref_counts[
            seq.kv_pages[g][-1]] > 1

    def needed(self, seq: Sequence, n: int) -> list[int]:
        """Pages each group must hand out for the sequence's next n tokens."""
        ps = self.page_size
        total = -(-(seq.num_computed_tokens + n) // ps)
        if not seq.kv_pages:
            return [total] * len(self.specs)
        return [total - len(pages) + self._copies_last(g, seq) for g, pages in enumerate(seq.kv_pages)]

    def fit(self, seq: Sequence, n: int) -> int:
        """The largest chunk <= n that every group's free pages can hold."""
        ps, c = self.page_size, seq.num_computed_tokens
        for g, a in enumerate(self.allocators):
            held = len(seq.kv_pages[g]) if seq.kv_pages else 0
            free = a.num_free - (self._copies_last(g, seq) if seq.kv_pages else 0)
            n = min(n, (held + free) * ps - c)
        return max(0, n)

    def allocate(self, seq: Sequence, n: int, copies: list[tuple[int, int, int]]) -> None:
        """Pages for the next n tokens in every group; a shared partly filled last page is copied first
        ((group, src, dst) into `copies`, which the runner applies before the step)."""
        total = -(-(seq.num_computed_tokens + n) // self.page_size)
        for g, pages in enumerate(self._lists(seq)):
            a = self.allocators[g]
            if pages and self._copies_last(g, seq):
                (copy,) = a.allocate(1)
                copies.append((g, pages[-1], copy))
                a.free([pages[-1]])
                pages[-1] = copy
            if total > len(pages):
                pages += a.allocate(total - len(pages))

    def free(self, seq: Sequence) -> None:
        """Gives back every page the sequence holds and forgets its KV."""
        for g, pages in enumerate(seq.kv_pages):
            self.allocators[g].free(self._real(g, pages))
        seq.reset()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` goes on from `parent`'s computed prefix, sharing every page."""
        child.kv_pages = [list(pages) for pages in parent.kv_pages]
        child.num_computed_tokens = parent.num_computed_tokens
        child.page_hashes = list(parent.page_hashes)
        for g, pages in enumerate(child.kv_pages):
            self.allocators[g].share(self._real(g, pages))

    def share_prefix(self, lead: Sequence, seq: Sequence, count: int) -> bool:
        """`seq` takes `lead`'s first `count` pages (the same prompt) in every group instead of its own; False
        (and nothing done) when a window group of `lead` has already dropped a page that `seq` would read."""
        ps = self.page_size
        firsts = [s.first_needed_page(count * ps, ps) for s in self.specs]
        for g, first in enumerate(firsts):
            if self.null_pages[g] is not None and self.null_pages[g] in lead.kv_pages[g][first:count]:
                return False
        for g, pages in enumerate(seq.kv_pages):
            self.allocators[g].free(self._real(g, pages))
        seq.kv_pages = []
        for g, first in enumerate(firsts):
            taken = lead.kv_pages[g][first:count]
            self.allocators[g].share(taken)
            seq.kv_pages.append([self.null_pages[g]] * first + taken)
        seq.num_computed_tokens = count * ps
        return True

    def lookup(self, seq: Sequence) -> None:
        """Takes the cached pages of the sequence's longest prefix that every group can serve (leaving at least
        one token to run). A window group needs only the pages inside the window of the hit's end."""
        if not self.enable_prefix_caching:
            return
        ps = self.page_size
        hashes = seq.hashes((seq.num_tokens - 1) // ps, ps)
        found = [a.probe(hashes) for a in self.allocators]
        count = len(hashes)
        for g, spec in enumerate(self.specs):
            if spec.window is None:
                count = next((i for i, page in enumerate(found[g][:count]) if page is None), count)
        while count and not all(
            None not in found[g][spec.first_needed_page(count * ps, ps) : count]
            for g, spec in enumerate(self.specs) if spec.window is not None
        ):
            count -= 1
        if not count:
            return
        seq.kv_pages = []
        for g, spec in enumerate(self.specs):
            first = spec.first_needed_page(count * ps, ps)
            taken = found[g][first:count]
            self.allocators[g].acquire(taken)
            seq.kv_pages.append([self.null_pages[g]] * first + taken)
        seq.num_computed_tokens = count * ps

    def commit(self, seq: Sequence, old: int, new: int) -> None:
        """The sequence's KV now covers `new` tokens (it covered `old`): newly full pages join the prefix
        cache, then the pages that fell out of a window are given back."""
        ps = self.page_size
        seq.num_computed_tokens = new
        if self.enable_prefix_caching and new // ps > old // ps:
            hashes = seq.hashes(new // ps, ps)
            for g, pages in enumerate(seq.kv_pages):
                for i in range(old // ps, new // ps):
                    self.allocators[g].register(pages[i], hashes[i])
        for g, spec in enumerate(self.specs):
            if spec.window is not None:
                self._slide(g, seq.kv_pages[g], spec.first_needed_page(new, ps))

    def _slide(self, g: int, pages: list[int], first: int) -> None:
        """NULLs pages[:first]. The NULL pages of a list are always a prefix: walk back from `first`."""
        null, gone = self.null_pages[g], []
        i = first - 1
        while i >= 0 and pages[i] != null:
            gone.append(pages[i])
            pages[i] = null
            i -= 1
        self.allocators[g].free(gone)

    def _real(self, g: int, pages: list[int]) -> list[int]:
        null = self.null_pages[g]
        return pages if null is None else [p for p in pages if p != null]

    def check(self) -> None:
        """Asserts every allocator's bookkeeping invariants (tests call this every step)."""
        for a in self.allocators:
            a.check()
