"""Attention within each image of a batch (engine/model/vision/attention.py) against one plain softmax attention per
image: images of one size run as one call and of mixed sizes grouped, with grouped-query heads, a given scale, and
the strided q / k / v a fused q|k|v projection yields."""

from __future__ import annotations

import pytest
import torch

from engine.model.vision.attention import image_attention


def _reference(q, k, v, lengths, scale):
    out, start = [], 0
    for n in lengths:
        qi, ki, vi = (t[start : start + n].transpose(0, 1).float() for t in (q, k, v))  # [heads, n, d]
        ki, vi = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=0) for t in (ki, vi))
        weights = torch.softmax(qi @ ki.transpose(1, 2) * (scale or q.shape[-1] ** -0.5), dim=-1)
        out.append((weights @ vi).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("lengths", [[12], [9, 9, 9], [7, 12, 7, 5, 12, 7]])
@pytest.mark.parametrize(("heads", "kv_heads", "scale"), [(4, 4, None), (4, 2, 1.0)])
def test_each_patch_attends_to_its_own_image_only(lengths, heads, kv_heads, scale):
    torch.manual_seed(0)
    d, total = 16, sum(lengths)
    qkv = torch.randn(total, heads + 2 * kv_heads, d)  # one projection's output, split by views
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    got = image_attention(q, k, v, lengths, scale)
    assert got.shape == (total, heads, d)
    torch.testing.assert_close(got, _reference(q, k, v, lengths, scale), atol=1e-5, rtol=1e-5)


def test_bfloat16_stays_within_its_rounding():
    torch.manual_seed(1)
    lengths = [20, 33, 20]
    q, k, v = (torch.randn(73, 4, 32) for _ in range(3))
    got = image_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), lengths)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _reference(q, k, v, lengths, None), atol=2e-2, rtol=2e-2)
