"""Prompt lookup: the tokens that followed the most recent earlier occurrence of the sequence's last n tokens.

Per sequence an index of every n-gram (prompt_lookup_min <= n <= prompt_lookup_max) to where it last ended, brought
up to date with the tokens appended since the previous step, so a step costs a few dictionary operations per
sequence whatever its length (the first step indexes the prompt once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.scheduling.sequence import Sequence


@dataclass
class _Index:
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end (exclusive) of its last place
    size: int = 0  # tokens indexed: every n-gram ending at or before `size` is in `ends`


class NgramProposer:
    """vLLM's "ngram" method: num_speculative_tokens, prompt_lookup_min, prompt_lookup_max."""

    name = "ngram"
    deterministic = True

    def __init__(self, num_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.num_tokens, self.lookup_min, self.lookup_max = num_tokens, lookup_min, lookup_max
        self._indexes: dict[int, _Index] = {}

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [
            self.lookup(seq.seq_id, seq.token_ids, min(limit, self.num_tokens))
            for seq, limit in zip(seqs, limits, strict=True)
        ]

    def lookup(self, key: int, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after the latest earlier place of the longest suffix that occurred before."""
        if k <= 0:
            return []
        index = self._indexes.setdefault(key, _Index())
        length = len(tokens)
        if index.size > length:  # not the list indexed (cannot happen to an append-only list): start again
            index = self._indexes[key] = _Index()
        # Index the n-grams ending before the last token's end, so the suffix itself is looked up, not found.
        ends, lo, hi = index.ends, self.lookup_min, self.lookup_max
        for end in range(max(index.size + 1, lo), length):
            for n in range(lo, min(hi, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        index.size = max(index.size, length - 1)
        for n in range(min(hi, length - 1), lo - 1, -1):
            found = ends.get(tuple(tokens[length - n :]))
            if found is not None:
                return tokens[found : min(found + k, length)]
        return []

    def retain(self, live: set[int]) -> None:
        for key in [key for key in self._indexes if key not in live]:
            del self._indexes[key]

    def describe(self) -> dict:
        return {"prompt_lookup_min": self.lookup_min, "prompt_lookup_max": self.lookup_max}
