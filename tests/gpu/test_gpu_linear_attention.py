"""fla's kernels (engine/cuda/linear_attention.py) against the torch delta rule they stand in for
(engine/model/layers/delta_rule.py): chunk_gated_delta_rule against chunked and recurrent token by token, over
lengths inside one chunk and across several; fused_recurrent_gated_delta_rule against decode's step_ row by row, at
several batch sizes and for several steps. All from a nonzero state, key heads shared by value heads (Qwen3.5's 16
key and 32 value heads in miniature), in float32 and bfloat16. A Gated DeltaNet layer's prefill and decode (its
slots in and out of order) on CUDA with fla equal to the ones without."""

from __future__ import annotations

import pytest
import torch

from engine.cuda import causal_conv, linear_attention
from engine.model.layers import delta_rule
from engine.model.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet
from engine.model.layers.recurrent_step import RecurrentStep

pytestmark = pytest.mark.skipif(
    linear_attention.fla_import_error() is not None,
    reason=f"fla does not import: {linear_attention.fla_import_error()}",
)
HK, HV, DK, DV = 2, 4, 64, 32
SHAPE = DeltaNetShape(
    hidden_size=128, num_k_heads=HK, num_v_heads=HV, head_k_dim=DK, head_v_dim=DV, conv_kernel=4, eps=1e-6
)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_fused_recurrent_matches_the_torch_step(batch, dtype):
    """Three decode steps of `batch` sequences, each row's state carried from one step to the next."""
    q, k, v, g, beta, _ = inputs(3 * batch, dtype, seed=batch)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    states = torch.randn(batch, HV, DK, DV, device="cuda", generator=gen) * 0.1
    want_states = delta_rule.held_form(states)  # step_ keeps S / c and log c
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    for t in range(3):
        rows = slice(t * batch, (t + 1) * batch)
        o, states = linear_attention.fused_recurrent_gated_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], states
        )
        assert o.dtype == v.dtype and states.dtype == torch.float32 and o.shape == (batch, HV, DV)
        for i in range(batch):
            j = t * batch + i
            want = delta_rule.step_(q[j], k[j], v[j], g[j], beta[j], want_states[i])
            torch.testing.assert_close(o[i].float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(states, delta_rule.materialise(want_states), atol=tol, rtol=tol)


def deltanet(dtype: torch.dtype = torch.float32) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(SHAPE).cuda()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    return layer.to(dtype)


def pools(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n conv windows (the layer's dtype) and delta-rule states (float32), random: a nonzero state in every slot."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    conv_shape, state_shape = SHAPE.state_shapes()
    return (
        torch.randn(n, *conv_shape, device="cuda", generator=gen).to(dtype),
        torch.randn(n, *state_shape, device="cuda", generator=gen) * 0.1,
    )


def test_a_deltanet_prefill_is_the_same_with_and_without_fla(monkeypatch):
    layer = deltanet()
    x = torch.randn(90, 128, device="cuda")
    outs = []
    for use_fla in (True, False):
        monkeypatch.setattr(linear_attention, "fla_runs", lambda device, _use=use_fla: _use)
        conv, state = (t.zero_() for t in pools(2, torch.float32))
        step = RecurrentStep(
            spans=[(0, 90)], slots=[0], captures=[], slot_index=torch.tensor([0], device="cuda"), is_decode=False
        )
        with torch.inference_mode():
            outs.append((layer(x, step, conv, state), state[0].clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[0], [5, 2, 3], [7, 0, 4, 1, 6, 3, 2, 5]])
def test_a_deltanet_decode_is_the_same_with_and_without_fla(monkeypatch, slots, dtype):
    """Four decode steps of sequences in `slots` (of 10, every one nonzero): the same rows and the same pools with
    fla's fused kernel as with the torch rule; the slots no sequence holds keep their bits on both."""
    monkeypatch.setattr(causal_conv, "runs", lambda device: False)  # the torch conv on both sides
    layer = deltanet(dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = torch.randn(4, len(slots), 128, device="cuda", generator=gen).to(dtype)
    step = RecurrentStep(
        spans=[(i, 1) for i in range(len(slots))],
        slots=slots,
        captures=[],
        slot_index=torch.tensor(slots, device="cuda"),
        is_decode=True,
    )
    results = []
    for use_fla in (True, False):
        monkeypatch.setattr(linear_attention, "fla_runs", lambda device, _use=use_fla: _use)
        conv, state = pools(10, dtype)
        with torch.inference_mode():
            outs = torch.stack([layer(x, step, conv, state) for x in xs])
        results.append((outs, conv, state))
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    (outs, conv, state), (want_outs, want_conv, want_state) = results
    torch.testing.assert_close(outs.float(), want_outs.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(state, want_state, atol=tol, rtol=tol)
    assert torch.equal(conv, want_conv)  # the same torch conv on the same inputs
    idle = [i for i in range(10) if i not in slots]
    fresh_conv, fresh_state = pools(10, dtype)
    assert torch.equal(state[idle], fresh_state[idle]) and torch.equal(conv[idle], fresh_conv[idle])
