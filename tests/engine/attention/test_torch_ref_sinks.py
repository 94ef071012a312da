"""TorchRefBackend with sink logits against transformers' gpt-oss eager attention on random tensors, over pages:
prefill, chunks on cached KV and batched decode, with and without a sliding window; pages that fell out of the
window are poisoned (NaN) as a window group's NULL page would be, so reading one fails the test."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

from engine.attention.torch_ref import TorchRefBackend

HQ, HK, D = 6, 2, 8


def gpt_oss_attention(sinks: torch.Tensor) -> GptOssAttention:
    config = GptOssConfig(hidden_size=HQ * D, head_dim=D, num_attention_heads=HQ, num_key_value_heads=HK)
    layer = GptOssAttention(config, layer_idx=0).eval()
    layer.sinks.data.copy_(sinks)
    return layer


def reference(
    layer: GptOssAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """q [q_len, HQ, D] at the last q_len positions of k, v [kv_len, HK, D], through transformers' eager
    gpt-oss attention under transformers' own (sliding window) causal mask function."""
    q_len, kv_len = q.shape[0], k.shape[0]
    allowed = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    q_idx = torch.arange(q_len)[:, None] + (kv_len - q_len)
    kv_idx = torch.arange(kv_len)[None, :]
    seen = allowed(0, 0, q_idx, kv_idx)
    additive = torch.zeros(q_len, kv_len).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
    out, _ = eager_attention_forward(
        layer,
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        additive,
        scaling=D**-0.5,
    )
    return out[0]


def run_steps(harness, steps: list[list[tuple[str, int]]], window: int | None, sinks: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = gpt_oss_attention(sinks)
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
        out = backend.run(q, k_cache, v_cache, sinks=sinks)
        plain = backend.run(q, k_cache, v_cache)
        row = 0
        for rid, n in step:
            old_k, old_v = history.get(rid, (k[:0], v[:0]))
            full_k, full_v = torch.cat([old_k, k[row : row + n]]), torch.cat([old_v, v[row : row + n]])
            history[rid] = (full_k, full_v)
            with torch.no_grad():
                ref = reference(layer, q[row : row + n], full_k, full_v, window)
            torch.testing.assert_close(out[row : row + n], ref, atol=1e-5, rtol=1e-5)
            row += n
        # The sinks took a share of every row's attention: without them the output is another one.
        assert not torch.allclose(out, plain, atol=1e-3)
        if window is not None:
            for rid, pages in harness.table.pages.items():
                gone = max(0, harness.table.lengths[rid] - window + 1) // ps
                for page in pages[:gone]:
                    k_cache[page] = float("nan")
                    v_cache[page] = float("nan")


STEPS = [
    [("a", 13), ("b", 1), ("c", 3)],
    [("a", 1), ("b", 1), ("c", 9)],  # decode rows and a chunk on cached KV
    [("c", 1), ("d", 20), ("a", 1), ("b", 1)],
] + [[("a", 1), ("b", 1), ("c", 1), ("d", 1)]] * 6


@pytest.mark.parametrize(("page_size", "window"), [(4, None), (1, None), (4, 8), (3, 5), (4, 1), (16, 64)])
def test_sinks_match_gpt_oss_eager_attention(paged_harness, page_size, window):
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=page_size, num_pages=256)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(1)) * 2
    run_steps(harness, STEPS, window, sinks)


@pytest.mark.parametrize("window", [None, 24])
def test_sinks_on_decode_rows_of_very_different_lengths(paged_harness, window):
    # The decode rows fall into several padded buckets (under a length mask) and one solo row takes no mask.
    lengths = [2, 300, 35, 7, 90, 260, 17]
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=4, num_pages=512)
    names = [f"r{i}" for i in range(len(lengths))]
    prefill = [[(n, length)] for n, length in zip(names, lengths, strict=True)]
    decode = [(n, 1) for n in names]
    sinks = torch.linspace(-3.0, 4.0, HQ)
    run_steps(harness, prefill + [decode, decode[::-1] + [("late", 9)], [("r1", 1)]], window, sinks)
