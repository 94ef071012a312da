"""TorchRefBackend with a sliding window against dense windowed attention computed directly, with every page
that fell wholly out of the window poisoned (NaN), as a window group's NULL page would be: it must never be read."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.torch_ref import TorchRefBackend

HQ, HK, D = 4, 2, 8


def dense_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """q [q_len, HQ, D] at the last q_len positions of k, v [kv_len, HK, D]; key j is seen from position i when
    i - window < j <= i (transformers' sliding window); float64 math."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    pos = torch.arange(q_len)[:, None] + (kv_len - q_len)
    cols = torch.arange(kv_len)[None, :]
    scores = scores.masked_fill(~((cols <= pos) & (cols > pos - window)), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_window_steps(harness, steps: list[list[tuple[str, int]]], window: int) -> None:
    gen = torch.Generator().manual_seed(0)
    backend = TorchRefBackend("cpu", window=window)
    k_cache, v_cache = harness.kv_caches[0]
    ps = harness.page_size
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in steps:
        _, _, meta = harness.step([(rid, [0] * n) for rid, n in step])
        t = sum(n for _, n in step)
        q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HK, HK))
        backend.plan(meta)
        backend.write_kv(k, v, k_cache, v_cache)
        out = backend.run(q, k_cache, v_cache)
        row = 0
        for rid, n in step:
            old_k, old_v = history.get(rid, (k[:0], v[:0]))
            full_k, full_v = torch.cat([old_k, k[row : row + n]]), torch.cat([old_v, v[row : row + n]])
            history[rid] = (full_k, full_v)
            ref = dense_window_attention(q[row : row + n], full_k, full_v, window)
            torch.testing.assert_close(out[row : row + n].double(), ref, atol=1e-5, rtol=1e-5)
            row += n
        for rid, pages in harness.table.pages.items():
            # What the engine would swap for its NULL page: no later query of rid can see these.
            gone = max(0, harness.table.lengths[rid] - window + 1) // ps
            for page in pages[:gone]:
                k_cache[page] = float("nan")
                v_cache[page] = float("nan")


@pytest.mark.parametrize(("page_size", "window"), [(4, 8), (4, 6), (3, 5), (1, 2), (4, 1), (16, 64)])
def test_window_prefill_chunks_and_decode(paged_harness, page_size, window):
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=page_size, num_pages=256)
    steps = [
        [("a", 13), ("b", 1), ("c", 3)],
        [("a", 1), ("b", 1), ("c", 9)],  # decode rows and a chunk on cached KV longer than the window
        [("c", 1), ("d", 20), ("a", 1), ("b", 1)],
    ] + [[("a", 1), ("b", 1), ("c", 1), ("d", 1)]] * 9
    run_window_steps(harness, steps, window)


def test_window_decode_rows_of_very_different_lengths(paged_harness):
    # Lengths past and short of the window in one decode step: the buckets are cut by what each row sees.
    lengths = [2, 300, 35, 7, 90, 260, 17]
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=4, num_pages=512)
    names = [f"r{i}" for i in range(len(lengths))]
    prefill = [[(n, length)] for n, length in zip(names, lengths, strict=True)]
    decode = [(n, 1) for n in names]
    run_window_steps(harness, prefill + [decode, decode[::-1] + [("late", 9)], decode], window=24)
