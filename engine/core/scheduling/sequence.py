"""Per-request state: a SequenceGroup (one request) owns one Sequence per choice, sample or beam.

A group starts with one sequence that runs the prompt; the other choices join it at the first sampled
token, sharing every prompt page (the partial last page is copied when a child first writes into it). The
scheduler alone sets a sequence's pages and computed length (Scheduler.fork, allocate, free).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.kv.cache import page_hash
from engine.core.output.pooling import PoolingParams
from engine.core.output.state import OutputState

if TYPE_CHECKING:
    from engine.core.images.intake import ImageSpan
    from engine.outputs import PositionLogprobs
    from engine.sample.beam_search import BeamSearch
    from engine.sample.params import SamplingParams


@dataclass(eq=False, kw_only=True)
class Sequence:
    """One token stream and the KV pages that hold its computed prefix (the scheduler's side), and its
    output_state (the output processor's side)."""

    seq_id: int
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    index: int = 0  # the choice index this sequence reports as
    # One page list per KV layer group (empty: holds no pages), all as long as the computed prefix; a sliding-window
    # group has its NULL page where a page fell out of the window (engine/core/kv/manager.py).
    kv_pages: list[list[int]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in `kv_pages`
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the first full pages
    # A hybrid model's recurrent state (engine/core/kv/state_cache.py): the sequence's slot, the (page boundary,
    # slot) of the snapshot its scheduled step captures, and the hash its latest decode-time snapshot went under.
    state_slot: int | None = None
    state_capture: tuple[int, int] | None = None
    state_snapshot: bytes | None = None
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Seeds the page hash chain: KV computed under a LoRA adapter is only ever shared with the same adapter.
    cache_salt: bytes | None = None
    # (start, end, digest) of the prompt's images: a page holding any of their soft tokens hashes their digests too
    # (an image's tokens see each other both ways, so the whole image shapes every one of its pages' KV).
    image_keys: tuple[tuple[int, int, bytes], ...] = ()
    output_state: OutputState = field(default_factory=OutputState)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def pages(self) -> list[int]:
        """The first layer group's pages (a full-attention model's only group)."""
        return self.kv_pages[0] if self.kv_pages else []

    @property
    def prefill_target(self) -> int:
        """Where this sequence's prefill ends: the whole prompt for a fresh one (then it samples), all but
        the last token for one resumed after preemption (which then rejoins its group's decode steps)."""
        return self.num_tokens if not self.output_token_ids else self.num_tokens - 1

    @property
    def in_decode(self) -> bool:
        return self.num_computed_tokens == self.num_tokens - 1

    def append(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def hashes(self, count: int, page_size: int) -> list[bytes]:
        """The chained hashes of the first `count` full pages (computed once, kept across preemption)."""
        for i in range(len(self.page_hashes), count):
            parent = self.page_hashes[i - 1] if i else self.cache_salt
            lo, hi = i * page_size, (i + 1) * page_size
            extra = b"".join(d for start, end, d in self.image_keys if start < hi and end > lo)
            self.page_hashes.append(page_hash(parent, self.token_ids[lo:hi], extra))
        return self.page_hashes[:count]

    def fork(self, seq_id: int) -> Sequence:
        """A copy of this sequence's tokens and output so far, with no pages: Scheduler.fork gives it its
        parent's, after the step (the pages' one owner)."""
        return Sequence(
            seq_id=seq_id,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            index=self.index,
            output_token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            cache_salt=self.cache_salt,
            image_keys=self.image_keys,
            output_state=self.output_state.fork(),
        )

    def reset(self) -> None:
        """Forget the KV (preemption by recompute): the caller has freed the pages."""
        self.kv_pages = []
        self.num_computed_tokens = 0


@dataclass(eq=False, kw_only=True)
class SequenceGroup:
    """One request: its parameters, its sequences and what it has reported so far."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding request (engine/core/output/pooling.py)
    seqs: list[Sequence]
    arrival: int
    eos_token_ids: set[int] = field(default_factory=set)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    beam: BeamSearch | None = None
    adapter: int | None = None  # the LoRA adapter's slot (None: the base model)
    forked: bool = False  # the choices run on their own (always true with one choice)
    num_cached_tokens: int = 0  # prompt tokens the first admission found in the prefix cache
    admitted: bool = False
    waited_steps: int = 0  # steps spent in the waiting queue (the priority policy's aging)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # they go out once, with the first output
    images: list[ImageSpan] = field(default_factory=list)  # the prompt's images, in prompt order

    def __post_init__(self) -> None:
        self.forked = self.forked or (len(self.seqs) == 1 and self.beam is None)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    def fork_choices(self) -> list[tuple[Sequence, Sequence]]:
        """The first token is in: every other choice goes on from the lead's prompt. Returns the (lead, choice)
        pairs for Scheduler.fork, which gives each choice the lead's pages."""
        self.forked = True
        return [(self.seqs[0], child) for child in self.seqs[1:]]

    def whole_images(self, start: int, n: int) -> int:
        """The longest chunk <= n from `start` that ends outside every whole image span (a span's tokens see each
        other both ways, so a chunk never ends inside one; it may start inside one after a prefix hit). A causal
        model's span may be cut: the runner keeps its image's encoding until the rest is prefilled. A bidirectional
        encoder's prompt is one such span: it runs whole or waits."""
        if isinstance(self.params, PoolingParams) and self.params.config.whole_prompt:
            return n if start + n >= len(self.prompt_token_ids) else 0
        for span in self.images:
            if span.whole and span.start < start + n < span.end:
                return max(0, span.start - start)
        return n

    @property
    def running(self) -> list[Sequence]:
        """The sequences that hold or need KV pages now."""
        if not self.forked:
            return self.seqs[:1]
        return [s for s in self.seqs if not s.finished]

    @property
    def num_seats(self) -> int:
        """Batch slots this group takes against max_num_seqs (all its choices, even before they fork)."""
        return self.params.num_sequences if not self.forked else len(self.running)

    @property
    def finished(self) -> bool:
        return self.forked and all(s.finished for s in self.seqs)

    @property
    def sampling(self) -> SamplingParams:
        """The parameters of a request that samples (every one but an embedding request)."""
        assert not isinstance(self.params, PoolingParams), "an embedding request samples nothing"
        return self.params

    @property
    def pooling(self) -> PoolingParams:
        """The parameters of an embedding request."""
        assert isinstance(self.params, PoolingParams), "only an embedding request pools"
        return self.params

    @property
    def pools(self) -> bool:
        """An embedding request: its prompt's hidden states are pooled, nothing is sampled."""
        return isinstance(self.params, PoolingParams)

    @property
    def skips_prefix_cache(self) -> bool:
        """Every prompt row must run: for its prompt logprobs, or for a pooling that reads them all."""
        return self.needs_prompt_logprobs or (isinstance(self.params, PoolingParams) and self.params.needs_every_row)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: the prefix cache is skipped until they are all known."""
        return self.prompt_logprobs is not None and any(p is None for p in self.prompt_logprobs[1:])
