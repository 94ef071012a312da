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
from tests.paging import PageTable

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
    table: PageTable = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.num_layers, 2, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        self.data = {name: torch.full(shape, self.fill, dtype=self.dtype, device="cuda") for name in self.pools}
        self.caches = {name: [(layer[0], layer[1]) for layer in data] for name, data in self.data.items()}
        free = list(range(1, self.num_pages))
        random.Random(0).shuffle(free)
        self.table = PageTable(self.page_size, free)

    @property
    def pages(self) -> dict[str, list[int]]:
        return self.table.pages

    @property
    def lengths(self) -> dict[str, int]:
        return self.table.lengths

    def share(self, src: str, dst: str, num_pages: int) -> None:
        """dst starts with src's first num_pages (full) pages: a prefix-cache hit."""
        assert self.lengths[src] >= num_pages * self.page_size
        self.pages[dst] = list(self.pages[src][:num_pages])
        self.lengths[dst] = num_pages * self.page_size

    def used_pages(self) -> set[int]:
        return {p for pages in self.pages.values() for p in pages}

    def step(self, batch: list[tuple[str, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """batch: (request, number of new tokens). Returns positions and the step's metadata (on CUDA)."""
        return self.table.step(batch, device="cuda")


@pytest.fixture
def gpu_pager() -> type[GpuPager]:
    return GpuPager


@pytest.fixture(scope="session")
def tiny_llama_checkpoint():
    """tiny_llama_checkpoint(path, num_q_heads=8, num_kv_heads=2, head_dim=64, ...) -> path of a random-weight
    Llama checkpoint with a word-level tokenizer (bench/gpu/random_model.py)."""
    return _tiny_checkpoint


def _tiny_checkpoint(
    path: Path,
    *,
    kind: str = "llama",
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    layers: int = 2,
    vocab: int = 512,
    seed: int = 0,
) -> Path:
    from bench.gpu.random_model import make_config, save_random_checkpoint

    config = make_config(
        kind,
        hidden_size=num_q_heads * head_dim,
        intermediate_size=2 * num_q_heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=kind == "qwen2",
    )
    return save_random_checkpoint(config, path, torch.bfloat16, seed, logit_scale=3.0)


def replay_experts_on_new_routing(
    layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, new_ids: torch.Tensor, new_weights: torch.Tensor
) -> torch.Tensor:
    """An MoE experts layer's forward captured in a CUDA graph (after one warm-up run outside it), then replayed
    with the routing tensors overwritten by new_ids / new_weights; returns the graph's output."""
    with torch.inference_mode():
        layer(x, ids, weights)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, ids, weights)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
    return out
