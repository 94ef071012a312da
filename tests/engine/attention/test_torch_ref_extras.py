"""TorchRefBackend with Gemma's attention extras (a scale of its own, logit soft-capping), with and without a
sliding window, against dense attention computed directly in float64: prefills, a chunk on cached KV, and decode
rows of very different lengths (several padded buckets)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_ref import TorchRefBackend

HQ, HK, D = 4, 2, 8


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, soft_cap: float | None, window: int | None
) -> torch.Tensor:
    """q [q_len, HQ, D] at the last q_len positions of k, v [kv_len, HK, D], as transformers' eager Gemma path."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    pos = torch.arange(q_len)[:, None] + (kv_len - q_len)
    cols = torch.arange(kv_len)[None, :]
    seen = cols <= pos if window is None else (cols <= pos) & (cols > pos - window)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize(
    ("scale", "soft_cap", "window"), [(0.5, 2.0, None), (0.5, 2.0, 6), (0.2, None, None), (None, 1.5, 5)]
)
def test_extras_prefill_chunks_and_decode_buckets(paged_harness, scale, soft_cap, window):
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=4, num_pages=512)
    backend = TorchRefBackend("cpu", window=window, scale=scale, soft_cap=soft_cap)
    k_cache, v_cache = harness.kv_caches[0]
    gen = torch.Generator().manual_seed(0)
    lengths = {"a": 2, "b": 150, "c": 35, "d": 7}
    steps = [[(r, n)] for r, n in lengths.items()] + [[("a", 1), ("c", 11), ("b", 1)]]
    steps += [[(r, 1) for r in lengths]] * 3 + [[("d", 1), ("late", 9), ("b", 1)]]
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in steps:
        _, _, meta = harness.step([(rid, [0] * n) for rid, n in step])
        t = sum(n for _, n in step)
        # Scores of several units: the soft-cap bends them.
        q, k, v = (3 * torch.randn(t, h, D, generator=gen) for h in (HQ, HK, HK))
        backend.plan(meta)
        backend.write_kv(k, v, k_cache, v_cache)
        out = backend.run(q, k_cache, v_cache)
        row = 0
        for rid, n in step:
            old_k, old_v = history.get(rid, (k[:0], v[:0]))
            full_k, full_v = torch.cat([old_k, k[row : row + n]]), torch.cat([old_v, v[row : row + n]])
            history[rid] = (full_k, full_v)
            ref = dense_attention(
                q[row : row + n], full_k, full_v, D**-0.5 if scale is None else scale, soft_cap, window
            )
            torch.testing.assert_close(out[row : row + n].double(), ref, atol=1e-5, rtol=1e-5)
            if soft_cap is not None:  # the cap matters on these scores
                uncapped = dense_attention(q[row : row + n], full_k, full_v, scale or D**-0.5, None, window)
                assert n == 1 or (uncapped - ref).abs().max() > 1e-3
            row += n
