"""GPU tests: FlashInfer kernels and the CUDA engine path. Every test here is skipped, with the reason shown,
unless CUDA is available and flashinfer imports (pip install -r requirements-cuda.txt, or bench/gpu/check.sh).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.attention.base import AttentionMetadata

HERE = Path(__file__).resolve().parent


@functools.cache
def gpu_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "GPU tests need CUDA: torch.cuda.is_available() is False on this machine"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # a broken CUDA build raises more than ImportError
        return f"GPU tests need flashinfer (pip install -r requirements-cuda.txt): {type(exc).__name__}: {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(skip)


@dataclass
class GpuPager:
    """KV pools (one per name, identical start) and a page allocator that builds step metadata on the GPU.

    Pages are handed out shuffled, never page 0 (CUDA-graph capture scribbles there); share() lets a
    request start on another request's full pages, as the prefix cache does.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    num_pages: int = 256
    dtype: torch.dtype = torch.bfloat16
    pools: tuple[str, ...] = ("ref", "test")
    fill: float = 7.0  # unwritten slots hold this, so stray writes and stray reads both show
    caches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(init=False)
    pages: dict[str, list[int]] = field(init=False, default_factory=dict)
    lengths: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        shape = (self.num_layers, 2, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        self.data = {name: torch.full(shape, self.fill, dtype=self.dtype, device="cuda") for name in self.pools}
        self.caches = {name: [(layer[0], layer[1]) for layer in data] for name, data in self.data.items()}
        self.free = list(range(1, self.num_pages))
        random.Random(0).shuffle(self.free)

    def share(self, src: str, dst: str, num_pages: int) -> None:
        """dst starts with src's first num_pages (full) pages: a prefix-cache hit."""
        assert self.lengths[src] >= num_pages * self.page_size
        self.pages[dst] = list(self.pages[src][:num_pages])
        self.lengths[dst] = num_pages * self.page_size

    def used_pages(self) -> set[int]:
        return {p for pages in self.pages.values() for p in pages}

    def step(self, batch: list[tuple[str, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """batch: (request, number of new tokens). Returns positions and the step's metadata (on CUDA)."""
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
            return torch.tensor(values, dtype=torch.int32, device="cuda")

        meta = AttentionMetadata(
            qo_indptr=i32(qo), kv_indptr=i32(kv), kv_indices=i32(indices), kv_last_page_len=i32(last),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
            page_size=self.page_size, is_decode=all(n == 1 for _, n in batch),
        )
        return torch.tensor(positions, device="cuda"), meta


@pytest.fixture
def gpu_pager() -> type[GpuPager]:
    return GpuPager


@pytest.fixture(scope="session")
def tiny_llama_checkpoint():
    """tiny_llama_checkpoint(path, num_q_heads=8, num_kv_heads=2, head_dim=64, ...) -> path of a random-weight
    Llama checkpoint with a word-level tokenizer (bench/gpu/random_model.py)."""
    return _tiny_checkpoint


def _tiny_checkpoint(path: Path, *, kind: str = "llama", num_q_heads: int = 8, num_kv_heads: int = 2,
                     head_dim: int = 64, layers: int = 2, vocab: int = 512, seed: int = 0) -> Path:
    from bench.gpu.random_model import make_config, save_random_checkpoint

    config = make_config(
        kind, hidden_size=num_q_heads * head_dim, intermediate_size=2 * num_q_heads * head_dim,
        num_hidden_layers=layers, num_attention_heads=num_q_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, vocab_size=vocab, max_position_embeddings=1024, rms_norm_eps=1e-6,
        tie_word_embeddings=kind == "qwen2",
    )
    return save_random_checkpoint(config, path, torch.bfloat16, seed, logit_scale=3.0)
