"""TorchRefBackend over FP8 (e4m3) pages: K / k_scale and V / v_scale are stored, and attention equals the float
path run on the values the pages stand for (each K, V rounded through e4m3 and scaled back), with and without a
sliding window and sink logits."""

from __future__ import annotations

import pytest
import torch

from engine.attention.kv_quant import FP8, FP8_MAX, resolve_kv_dtype
from engine.attention.torch_ref import TorchRefBackend
from engine.errors import StartupError

HQ, HK, D = 4, 2, 16
STEPS = [
    [("a", 9), ("b", 1), ("c", 14)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("a", 6), ("b", 1)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 3)],
]


def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 page holding x / scale stands for, in float32."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 3.0)])
def test_fp8_pages_equal_the_float_path_on_the_rounded_values(paged_harness, window, with_sinks, scales):
    k_scale, v_scale = scales
    fp8 = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=64, dtype=FP8)
    ref = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=64)  # same seed: same pages
    gen = torch.Generator().manual_seed(0)
    sinks = torch.randn(HQ, generator=gen) if with_sinks else None
    b8, bf = TorchRefBackend("cpu", window=window), TorchRefBackend("cpu", window=window)
    for step in STEPS:
        batch = [(rid, [0] * n) for rid, n in step]
        _, _, meta8 = fp8.step(batch)
        _, _, metaf = ref.step(batch)
        t = sum(n for _, n in step)
        q = torch.randn(t, HQ, D, generator=gen)
        # K and V of a trained model's size, some past e4m3's range at scale 1 (they saturate, never NaN).
        k, v = torch.randn(t, HK, D, generator=gen) * 40, torch.randn(t, HK, D, generator=gen) * 4
        k[0, 0, 0] = 1e4
        b8.plan(meta8)
        b8.write_kv(k, v, *fp8.kv_caches[0], k_scale=k_scale, v_scale=v_scale)
        out = b8.run(q, *fp8.kv_caches[0], sinks=sinks, k_scale=k_scale, v_scale=v_scale)
        bf.plan(metaf)
        bf.write_kv(rounded(k, k_scale), rounded(v, v_scale), *ref.kv_caches[0])
        expected = bf.run(q, *ref.kv_caches[0], sinks=sinks)
        assert out.dtype == torch.float32 and not out.isnan().any()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The pages hold K / k_scale, byte for byte.
    k_pages = fp8.kv_caches[0][0].view(-1, HK, D)
    slot = int(meta8.slot_mapping[-1])
    assert torch.equal(k_pages[slot].view(torch.uint8), (k[-1] / k_scale).clamp(-448, 448).to(FP8).view(torch.uint8))


def test_fp8_kv_loses_what_e4m3_loses_and_no_more(paged_harness):
    """Against float32 pages on the same inputs: 3 mantissa bits on K and V move this attention by < 5%."""
    fp8 = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=64, dtype=FP8)
    ref = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=64)
    gen = torch.Generator().manual_seed(3)
    step = [("a", 40), ("b", 7)]
    _, _, meta = fp8.step([(r, [0] * n) for r, n in step])
    ref.step([(r, [0] * n) for r, n in step])
    q, k, v = (torch.randn(47, h, D, generator=gen) for h in (HQ, HK, HK))
    outs = []
    for harness in (fp8, ref):
        backend = TorchRefBackend("cpu")
        backend.plan(meta)
        backend.write_kv(k, v, *harness.kv_caches[0])
        outs.append(backend.run(q, *harness.kv_caches[0]))
    drift = (outs[0] - outs[1]).norm() / outs[1].norm()
    assert 1e-3 < drift < 0.05, drift  # it is lossy (not a float copy), and only as lossy as e4m3


def test_kv_cache_dtype_names():
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("fp8", torch.bfloat16) == resolve_kv_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(StartupError, match="unknown KV cache dtype 'int8'"):
        resolve_kv_dtype("int8", torch.bfloat16)
