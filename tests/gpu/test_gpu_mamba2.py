"""The Mamba2 mixer on CUDA (engine/model/layers/mamba2.py): causal_conv1d's kernels with the conv bias against the
torch conv on the same GPU, and the whole layer (its torch SSD on CUDA, with either conv) against the CPU float32
path on the same inputs: a 37-token prefill over several scan chunks, then decode steps in any slot order, rows and
pools alike. The causal_conv1d tests skip where the package does not import (it builds with nvcc)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from engine.cuda import causal_conv
from engine.model.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from engine.model.layers.recurrent_step import RecurrentStep

HAS_CONV = importlib.util.find_spec("causal_conv1d") is not None
SHAPE = Mamba2Shape(
    hidden_size=64, num_heads=8, head_dim=8, n_groups=2, state_size=16, conv_kernel=4, chunk_size=16, eps=1e-5
)
DIM, WIDTH = SHAPE.conv_dim, SHAPE.conv_kernel


def tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


@pytest.mark.skipif(not HAS_CONV, reason="causal_conv1d is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_conv_kernels_add_the_bias_as_the_torch_conv_does(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn(6, DIM, WIDTH - 1, device="cuda", generator=gen).to(dtype)
    weight, bias = (torch.randn(*s, device="cuda", generator=gen).to(dtype) for s in ((DIM, WIDTH), (DIM,)))
    x = torch.randn(9, DIM, device="cuda", generator=gen).to(dtype)
    window = torch.cat([pool[2], x.t()], dim=1).float()
    want = F.silu(F.conv1d(window[None], weight.float()[:, None], bias.float(), groups=DIM)[0]).t()
    got = causal_conv.prefill(x, pool[2], weight, bias=bias)
    torch.testing.assert_close(got.float(), want, atol=tol(dtype), rtol=tol(dtype))
    index = torch.tensor([4, 1], device="cuda")
    rows = x[:2].clone()
    windows = torch.cat([pool[index], rows[:, :, None]], dim=2).float()
    want_update = F.silu((windows * weight.float()).sum(-1) + bias.float())
    got_update = causal_conv.update(rows, pool, weight, index, bias=bias)
    torch.testing.assert_close(got_update.float(), want_update, atol=tol(dtype), rtol=tol(dtype))


def steps(device: str) -> tuple[RecurrentStep, RecurrentStep]:
    slots = [3, 0, 6]
    prefill = RecurrentStep(
        spans=[(0, 37)], slots=[3], captures=[], slot_index=torch.tensor([3], device=device), is_decode=False
    )
    decode = RecurrentStep(
        spans=[(i, 1) for i in range(3)],
        slots=slots,
        captures=[],
        slot_index=torch.tensor(slots, device=device),
        is_decode=True,
    )
    return prefill, decode


def run(layer: Mamba2Mixer, prompt: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype):
    device = prompt.device.type
    conv_shape, state_shape = SHAPE.state_shapes()
    conv = torch.zeros(8, *conv_shape, dtype=dtype, device=device)
    state = torch.zeros(8, *state_shape, device=device)
    prefill, decode = steps(device)
    with torch.inference_mode():
        outs = [layer(prompt, prefill, conv, state)] + [layer(x, decode, conv, state) for x in tokens]
    return torch.cat(outs).float().cpu(), conv.float().cpu(), state.cpu()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_on_cuda_equals_the_cpu_path(monkeypatch, dtype, fused):
    if fused and not HAS_CONV:
        pytest.skip("causal_conv1d is not installed")
    torch.manual_seed(0)
    layer = Mamba2Mixer(SHAPE)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) + (1.0 if name == "norm.weight" else 0.0))
    gen = torch.Generator().manual_seed(2)
    prompt, tokens = torch.randn(37, 64, generator=gen), torch.randn(3, 3, 64, generator=gen)
    want = run(layer.eval(), prompt, tokens, torch.float32)
    monkeypatch.setattr(causal_conv, "runs", lambda device, _use=fused: _use and device.type == "cuda")
    cuda = layer.to("cuda", dtype)
    got = run(cuda, prompt.to("cuda", dtype), tokens.to("cuda", dtype), dtype)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol(dtype) * 20, rtol=tol(dtype) * 20)
