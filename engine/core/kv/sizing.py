"""Sizing the KV cache across layer groups from one byte budget.

A sliding-window group never needs more than max_num_seqs * (ceil(W / page_size) + 2) + ceil(max_num_batched_tokens
/ page_size) pages (every sequence's window, a page more each for the step, and one step's prefill chunks); the
full-attention groups share the rest, each with the same page count (their page lists are the same length). A
model whose layers are all full attention has one group and gets budget // page_bytes pages, as before groups.
"""

from __future__ import annotations

import torch

from engine.model.kv_spec import KVGroupSpec


def page_bytes(groups: list[KVGroupSpec], page_size: int, dtype: torch.dtype) -> list[int]:
    """Bytes of one page of each group (K and V, or an MLA group's latent rows, of every layer in it)."""
    elt = torch.empty((), dtype=dtype).element_size()
    return [len(g.layers) * page_size * g.values_per_token * elt for g in groups]


def window_caps(
    groups: list[KVGroupSpec], page_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> list[int | None]:
    """The most pages each group can use at once (None: a full-attention group, unbounded)."""
    chunk = -(-max_num_batched_tokens // page_size)
    return [None if (w := g.window_pages(page_size)) is None else max_num_seqs * (w + 1) + chunk for g in groups]


def pages_for_budget(budget: int, sizes: list[int], caps: list[int | None]) -> int:
    """The largest page count n with sum over groups of min(cap, n) * page bytes <= budget: the full groups'
    count (a window group takes min(cap, n)). Groups whose cap is below n are held at their cap, in turns."""
    capped: set[int] = set()
    while True:
        fixed = sum((caps[g] or 0) * sizes[g] for g in capped)  # the capped groups all have a cap
        rest = sum(size for g, size in enumerate(sizes) if g not in capped)
        if not rest:
            return max(c for c in caps if c is not None)
        n = max(0, budget - fixed) // rest
        more = {g for g, c in enumerate(caps) if c is not None and g not in capped and c < n}
        if not more:
            return n
        capped |= more


def group_pages(caps: list[int | None], pages: int) -> list[int]:
    """Each group's page count when the full groups get `pages`."""
    return [pages if cap is None else min(cap, pages) for cap in caps]


def pages_for_one_sequence(
    caps: list[int | None], groups: list[KVGroupSpec], page_size: int, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """The page count a group must have for one sequence of max_model_len to run alone."""
    full = -(-max_model_len // page_size)
    if any(cap is None for cap in caps):
        return full
    chunk = -(-max_num_batched_tokens // page_size)
    return min(full, max((g.window_pages(page_size) or 0) + 1 for g in groups) + chunk)  # all windowed here
