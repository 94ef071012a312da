"""The grammar mask of one sampling step: one batched fill of the rows' token bitmasks, one in-place apply.

The bitmask is filled on the CPU (xgrammar's matchers live there) and applied where the logits are, with
the same few vectorised torch ops on every device. NOTE: xgrammar's native CPU kernel costs from 0.2 ms
(rows that allow almost everything) to 25 ms (rows that allow almost nothing) at 64 x 49152 on this
project's CPUs; these ops cost about 1.5 ms either way (bench/RESULTS.md), and on CUDA they need neither
triton nor nvcc.
Ids past the tokenizer's table (padding rows of a larger lm_head) are never allowed by a grammar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sample.structured.matcher import GrammarState

# Threads for the batched fill: one, as the fill runs between forwards that use every core anyway.
FILL_THREADS = 1


def grammar_bitmask(states: list[GrammarState], vocab_size: int) -> torch.Tensor:
    """[len(states), ceil(vocab/32)] int32 on the CPU: bit j of row i set where states[i] allows token j."""
    import xgrammar as xgr

    bitmask = torch.empty((len(states), (vocab_size + 31) // 32), dtype=torch.int32)
    xgr.BatchGrammarMatcher(FILL_THREADS).batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[k], j] = -inf where bit j of bitmask[k] is clear."""
    vocab, device = logits.shape[1], logits.device
    # Bit j of a row is bit j % 8 of its byte j // 8 (the int32 words are little-endian, as on x86, ARM and
    # CUDA): one lookup in a 256 x 8 table unpacks eight tokens per byte.
    table = (
        (
            torch.arange(256, dtype=torch.int32, device=device)[:, None]
            >> torch.arange(8, dtype=torch.int32, device=device)
        )
        & 1
    ) == 0
    packed = bitmask.to(device, non_blocking=True).view(torch.uint8).int()
    blocked = table.index_select(0, packed.flatten()).view(len(rows), -1)[:, :vocab]
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(blocked, float("-inf"))
        return
    index = torch.tensor(rows, device=device)
    logits[index] = logits.index_select(0, index).masked_fill_(blocked, float("-inf"))
