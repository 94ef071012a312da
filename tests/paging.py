"""A page table for attention tests: pages per request and one step's metadata, in FlashInfer's CSR layout.

Used by tests/engine (CPU) and tests/gpu (CUDA); it imports only torch, so both collect without CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionMetadata


@dataclass
class PageTable:
    """Hands out pages from the end of `free` as requests grow; step() builds the step's metadata."""

    page_size: int
    free: list[int]
    pages: dict[str, list[int]] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)

    def step(
        self, batch: list[tuple[str, int]], device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """batch: (request id, number of new tokens) per request, in order. Returns positions and metadata."""
        positions, slots = [], []
        qo, kv, indices, last = [0], [0], [], []
        for rid, n in batch:
            start = self.lengths.get(rid, 0)
            pages = self.pages.setdefault(rid, [])
            end = start + n
            while len(pages) * self.page_size < end:
                pages.append(self.free.pop())
            slots += [pages[p // self.page_size] * self.page_size + p % self.page_size for p in range(start, end)]
            positions += range(start, end)
            self.lengths[rid] = end
            qo.append(qo[-1] + n)
            indices += pages
            kv.append(len(indices))
            last.append(end - (len(pages) - 1) * self.page_size)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        meta = AttentionMetadata(
            qo_indptr=i32(qo),
            kv_indptr=i32(kv),
            kv_indices=i32(indices),
            kv_last_page_len=i32(last),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            page_size=self.page_size,
            is_decode=all(n == 1 for _, n in batch),
        )
        return torch.tensor(positions, device=device), meta
