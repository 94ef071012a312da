"""The optional causal_conv1d package's kernels (engine/cuda/causal_conv.py) against the torch conv they stand in
for: decode's update in place on a pool's slots (in and out of order, the other slots untouched) and prefill from a
sequence's window, in float32 and bfloat16; and a Gated DeltaNet layer's prefill and decode with them equal to the
ones without. Skipped where the package does not import (it is not in the requirements: it builds with nvcc)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from engine.cuda import causal_conv

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("causal_conv1d") is None,
    reason="causal_conv1d is not installed (optional: pip install causal-conv1d builds it with nvcc)",
)
DIM, WIDTH = 64, 4


def tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def test_the_probe_finds_it_working():
    assert causal_conv.probe_error(torch.cuda.current_device()) is None
    assert causal_conv.runs(torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[0], [5, 2, 3], [7, 0, 4, 1, 6, 3, 2, 5]])
def test_update_matches_the_torch_conv_in_place(slots, dtype):
    gen = torch.Generator(device="cuda").manual_seed(len(slots))
    pool = torch.randn(10, DIM, WIDTH - 1, device="cuda", generator=gen).to(dtype)
    weight = torch.randn(DIM, WIDTH, device="cuda", generator=gen).to(dtype)
    index = torch.tensor(slots, device="cuda")
    want_pool = pool.clone()
    for _ in range(3):
        x = torch.randn(len(slots), DIM, device="cuda", generator=gen).to(dtype)
        window = torch.cat([want_pool[index], x[:, :, None]], dim=2)
        want_pool[index] = window[:, :, 1:]
        want = F.silu((window.float() * weight.float()).sum(-1))
        got = causal_conv.update(x, pool, weight, index)
        torch.testing.assert_close(got.float(), want, atol=tol(dtype), rtol=tol(dtype))
    assert torch.equal(pool, want_pool)  # the windows at `slots` shifted, every other slot as it was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 5, 70])
def test_prefill_matches_the_torch_conv_from_a_window(length, dtype):
    gen = torch.Generator(device="cuda").manual_seed(length)
    before = torch.randn(DIM, WIDTH - 1, device="cuda", generator=gen).to(dtype)
    weight = torch.randn(DIM, WIDTH, device="cuda", generator=gen).to(dtype)
    x = torch.randn(length, DIM, device="cuda", generator=gen).to(dtype)
    window = torch.cat([before, x.t()], dim=1).float()
    want = F.silu(F.conv1d(window[None], weight.float()[:, None], groups=DIM)[0]).t()
    got = causal_conv.prefill(x, before, weight)
    assert got.shape == (length, DIM) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol(dtype), rtol=tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deltanet_layer_is_the_same_with_and_without_it(monkeypatch, dtype):
    """A 37-token prefill into slot 3, then three decode steps of slots [3, 0, 6]: the same rows and pools."""
    from engine.model.layers.recurrent_step import RecurrentStep
    from tests.gpu.test_gpu_linear_attention import deltanet, pools

    layer = deltanet(dtype)
    gen = torch.Generator(device="cuda").manual_seed(2)
    prompt = torch.randn(37, 128, device="cuda", generator=gen).to(dtype)
    steps = torch.randn(3, 3, 128, device="cuda", generator=gen).to(dtype)
    slots = [3, 0, 6]
    prefill = RecurrentStep(
        spans=[(0, 37)], slots=[3], captures=[], slot_index=torch.tensor([3], device="cuda"), is_decode=False
    )
    decode = RecurrentStep(
        spans=[(i, 1) for i in range(3)],
        slots=slots,
        captures=[],
        slot_index=torch.tensor(slots, device="cuda"),
        is_decode=True,
    )
    results = []
    for fused in (True, False):
        monkeypatch.setattr(causal_conv, "runs", lambda device, _use=fused: _use)
        conv, state = pools(8, dtype)
        with torch.inference_mode():
            outs = [layer(prompt, prefill, conv, state)] + [layer(x, decode, conv, state) for x in steps]
        results.append((torch.cat(outs), conv, state))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tol(dtype) * 20, rtol=tol(dtype) * 20)
