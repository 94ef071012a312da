"""fla's chunk_gated_delta_rule (engine/cuda/linear_attention.py) against the torch delta rule it stands in for
(engine/model/layers/delta_rule.py: chunked, and recurrent token by token), from a nonzero state, over lengths
inside one chunk and across several, key heads shared by value heads (Qwen3.5's 16 key and 32 value heads in
miniature), in float32 and bfloat16; and a Gated DeltaNet layer's prefill on CUDA with fla equal to the one
without."""

from __future__ import annotations

import pytest
import torch

from engine.cuda import linear_attention
from engine.model.layers import delta_rule

pytestmark = pytest.mark.skipif(linear_attention.fla_import_error() is not None,
                                reason=f"fla does not import: {linear_attention.fla_import_error()}")
HK, HV, DK, DV = 2, 4, 64, 32


def inputs(length: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(length, HK, DK, device="cuda", generator=gen).to(dtype)
    k = torch.randn(length, HK, DK, device="cuda", generator=gen).to(dtype)
    v = torch.randn(length, HV, DV, device="cuda", generator=gen).to(dtype)
    g = -torch.rand(length, HV, device="cuda", generator=gen) * 0.5  # log decay in (-0.5, 0]
    beta = torch.rand(length, HV, device="cuda", generator=gen).to(dtype)
    state = torch.randn(HV, DK, DV, device="cuda", generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 17, 64, 200])
def test_fla_matches_the_torch_rule(length, dtype):
    q, k, v, g, beta, state = inputs(length, dtype)
    o, final = linear_attention.chunk_gated_delta_rule(q, k, v, g, beta, state.clone())
    want_o, want_state = delta_rule.chunked(q, k, v, g, beta, state.clone())
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert o.dtype == v.dtype and final.dtype == torch.float32
    torch.testing.assert_close(o.float(), want_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(final, want_state, atol=tol, rtol=tol)
    if length <= 17:
        rec_o, rec_state = delta_rule.recurrent(q, k, v, g, beta, state.clone())
        torch.testing.assert_close(o.float(), rec_o.float(), atol=tol, rtol=tol)


def test_a_deltanet_prefill_is_the_same_with_and_without_fla(monkeypatch):
    from engine.model.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet
    from engine.model.layers.recurrent_step import RecurrentStep

    shape = DeltaNetShape(hidden_size=128, num_k_heads=HK, num_v_heads=HV, head_k_dim=DK, head_v_dim=DV,
                          conv_kernel=4, eps=1e-6)
    torch.manual_seed(0)
    layer = GatedDeltaNet(shape).cuda()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    (conv_shape, state_shape) = shape.state_shapes()
    x = torch.randn(90, 128, device="cuda")
    outs = []
    for use_fla in (True, False):
        monkeypatch.setattr(linear_attention, "fla_runs", lambda device, _use=use_fla: _use)
        conv = torch.zeros(2, *conv_shape, device="cuda")
        state = torch.zeros(2, *state_shape, device="cuda")
        step = RecurrentStep([(0, 90)], [0], [], torch.tensor([0], device="cuda"), False)
        with torch.inference_mode():
            outs.append((layer(x, step, conv, state), state[0].clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=2e-3, rtol=2e-3)
