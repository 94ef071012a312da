"""The KV side of every sequence across the layer groups: allocate, copy-on-write, share (forks), free, prefix
hits and the sliding of windows, so that the scheduler reasons in per-group page counts.

Every group keeps, per sequence, a page list as long as the computed prefix (so positions line up in one page
table format). In a sliding-window group a page that fell wholly out of the window is swapped for the group's
NULL page (one reserved page past the allocator's, never freed, never read: the backend skips keys outside the
window) and given back after the step; between steps a sequence holds at most ceil(W / page_size) + 1 real
pages there.

A hybrid model's recurrent layers hold a state slot per sequence instead (engine/core/kv/state_cache.py): this
manager gives slots out and back with the pages, captures a snapshot at the last page boundary each step
crosses, and lets a prefix hit stop only at a boundary whose snapshot it has.
"""

from __future__ import annotations

from engine.core.kv.cache import PageAllocator
from engine.core.kv.state_cache import StateSlots
from engine.core.scheduling.sequence import Sequence
from engine.model.kv_spec import KVGroupSpec


class KVCacheManager:
    """One PageAllocator per layer group; group g's NULL page (window groups) is page id num_pages[g]."""

    def __init__(
        self,
        *,
        specs: list[KVGroupSpec],
        num_pages: list[int],
        page_size: int,
        enable_prefix_caching: bool = True,
        state: StateSlots | None = None,
    ) -> None:
        self.specs = specs
        self.state = state  # a hybrid model's recurrent-state slots (None: every layer has pages)
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocators = [PageAllocator(n, enable_prefix_caching) for n in num_pages]
        self.null_pages = [None if s.window is None else n for s, n in zip(specs, num_pages, strict=True)]
        # Free pages an admission must leave in each group, so that running decodes do not preempt at once.
        self.watermark = [n // 100 for n in num_pages]

    @property
    def _slots(self) -> StateSlots:
        assert self.state is not None, "only a hybrid model has recurrent-state slots"
        return self.state

    def _nulls(self, g: int, n: int) -> list[int]:
        """n NULL pages of group g (a full-attention group has none, and is never asked for any)."""
        null = self.null_pages[g]
        return [] if null is None else [null] * n

    @property
    def has_windows(self) -> bool:
        return any(null is not None for null in self.null_pages)

    @property
    def waits_for_choices(self) -> bool:
        """A resumed lead stops at the prompt's full pages for its choices to take them
        (engine/core/scheduling/scheduler.py): past them a window would drop pages they read, or the state at them would
        not be snapshotted."""
        return self.has_windows or self.state is not None

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
        return bool(seq.num_computed_tokens % self.page_size) and self.allocators[g].ref_counts[seq.kv_pages[g][-1]] > 1

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
        if self.state is not None:
            self._plan_state(seq, n)

    def _plan_state(self, seq: Sequence, n: int) -> None:
        """The sequence's state slot (zeros for one that starts now), and a snapshot slot for the last page
        boundary its next n tokens cross."""
        if seq.state_slot is None:
            seq.state_slot = self._slots.take()
        start = seq.num_computed_tokens
        boundary = (start + n) // self.page_size * self.page_size
        if seq.state_capture is not None:
            self._slots.release(seq.state_capture[1])
        seq.state_capture = None
        if boundary > start:
            slot = self._slots.take_snapshot()
            if slot is not None:
                seq.state_capture = (boundary, slot)

    def free(self, seq: Sequence) -> None:
        """Gives back every page the sequence holds and forgets its KV."""
        for g, pages in enumerate(seq.kv_pages):
            self.allocators[g].free(self._real(g, pages))
        if self.state is not None:
            for slot in (seq.state_slot, seq.state_capture[1] if seq.state_capture else None):
                if slot is not None:
                    self.state.release(slot)
            seq.state_slot, seq.state_capture = None, None
        seq.reset()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` goes on from `parent`'s computed prefix, sharing every page."""
        child.kv_pages = [list(pages) for pages in parent.kv_pages]
        child.num_computed_tokens = parent.num_computed_tokens
        child.page_hashes = list(parent.page_hashes)
        for g, pages in enumerate(child.kv_pages):
            self.allocators[g].share(self._real(g, pages))
        if self.state is not None:
            child.state_slot = self.state.take(parent.state_slot)

    def share_prefix(self, lead: Sequence, seq: Sequence, count: int) -> bool:
        """`seq` takes `lead`'s first `count` pages (the same prompt) in every group instead of its own; False
        (and nothing done) when a window group of `lead` has already dropped a page that `seq` would read, or when
        no snapshot of the recurrent state at those pages' end is kept."""
        ps = self.page_size
        firsts = [s.first_needed_page(count * ps, ps) for s in self.specs]
        for g, first in enumerate(firsts):
            if self.null_pages[g] is not None and self.null_pages[g] in lead.kv_pages[g][first:count]:
                return False
        if self.state is not None:
            snapshot = self.state.find(lead.hashes(count, ps)[-1])
            if snapshot is None:
                return False
            if seq.state_slot is not None:
                self.state.release(seq.state_slot)
            seq.state_slot = self.state.take(snapshot)
        for g, pages in enumerate(seq.kv_pages):
            self.allocators[g].free(self._real(g, pages))
        seq.kv_pages = []
        for g, first in enumerate(firsts):
            taken = lead.kv_pages[g][first:count]
            self.allocators[g].share(taken)
            seq.kv_pages.append(self._nulls(g, first) + taken)
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
        snapshot = None  # a hybrid model's recurrent state at the hit's end
        while count:
            if all(
                None not in found[g][spec.first_needed_page(count * ps, ps) : count]
                for g, spec in enumerate(self.specs)
                if spec.window is not None
            ):
                snapshot = None if self.state is None else self.state.find(hashes[count - 1])
                if self.state is None or snapshot is not None:
                    break
            count -= 1
        if not count:
            return
        if snapshot is not None:
            seq.state_slot = self._slots.take(snapshot)
        seq.kv_pages = []
        for g, spec in enumerate(self.specs):
            first = spec.first_needed_page(count * ps, ps)
            taken = [page for page in found[g][first:count] if page is not None]  # all cached: see above
            self.allocators[g].acquire(taken)
            seq.kv_pages.append(self._nulls(g, first) + taken)
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
        if self.state is not None and seq.state_capture is not None:
            self._register_snapshot(seq)

    def trim(self, seq: Sequence) -> None:
        """Gives back the pages past the computed prefix: those that held only a speculative step's rejected tokens
        (their slots in the kept last page are rewritten by the next tokens; only full pages are ever hashed)."""
        keep = -(-seq.num_computed_tokens // self.page_size)
        for g, pages in enumerate(seq.kv_pages):
            if len(pages) > keep:
                self.allocators[g].free(self._real(g, pages[keep:]))
                del pages[keep:]

    def _register_snapshot(self, seq: Sequence) -> None:
        """The state captured at a page boundary joins the prefix cache under that page's hash. Past the prompt a
        sequence keeps only its latest: an earlier decode boundary is of no use to a later turn."""
        assert seq.state_capture is not None, "called for a sequence that captured its state"
        boundary, slot = seq.state_capture
        seq.state_capture = None
        if boundary > seq.num_computed_tokens:  # a speculative step's boundary among its rejected tokens
            self._slots.release(slot)
            return
        h = seq.hashes(boundary // self.page_size, self.page_size)[-1]
        self._slots.register(h, slot)
        if boundary > seq.num_prompt_tokens:
            if seq.state_snapshot is not None and seq.state_snapshot != h:
                self._slots.drop(seq.state_snapshot)
            seq.state_snapshot = h

    def _slide(self, g: int, pages: list[int], first: int) -> None:
        """NULLs pages[:first]. The NULL pages of a list are always a prefix: walk back from `first`."""
        null, gone = self.null_pages[g], []
        assert null is not None, "only a window group slides"
        i = first - 1
        while i >= 0 and pages[i] != null:
            gone.append(pages[i])
            pages[i] = null
            i -= 1
        self.allocators[g].free(gone)

    def _real(self, g: int, pages: list[int]) -> list[int]:
        null = self.null_pages[g]
        return pages if null is None else [p for p in pages if p != null]

    def check(self, seqs: list[Sequence] | None = None) -> None:
        """Asserts every allocator's bookkeeping invariants (tests call this every step); with the live sequences,
        that every state slot is free, a snapshot or held by one of them."""
        for a in self.allocators:
            a.check()
        if self.state is not None and seqs is not None:
            self.state.check(
                [slot for s in seqs for slot in (s.state_slot, (s.state_capture or (0, None))[1]) if slot is not None]
            )
