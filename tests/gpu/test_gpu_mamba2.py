"""The Mamba2 mixer on CUDA (engine/model/layers/mamba2.py): causal_conv1d's kernels with the conv bias against the
torch conv on the same GPU, and the whole layer (its torch SSD on CUDA, with either conv) against the CPU float32
path on the same inputs: a 37-token prefill over several scan chunks, then decode steps in any slot order, rows and
pools alike; fla's SSD (engine/cuda/ssd_scan.py) against the torch rule, prefill over lengths inside one of fla's
64-token chunks and across several, decode for several steps of several rows, and the whole layer with fla against
the one without; a decode step replayed from a CUDA graph on other slots, and a tiny Nemotron-H served with graphs as
eagerly. The causal_conv1d tests skip where the package does not import (it builds with nvcc), the fla ones where fla
does not."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from engine.cuda import causal_conv, ssd_scan
from engine.model.layers import ssd
from engine.model.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from engine.model.layers.recurrent_step import RecurrentStep

HAS_CONV = importlib.util.find_spec("causal_conv1d") is not None
NO_FLA = pytest.mark.skipif(
    ssd_scan.fla_import_error() is not None, reason=f"fla does not import: {ssd_scan.fla_import_error()}"
)
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
    monkeypatch.setattr(ssd_scan, "fla_runs", lambda device: False)  # the torch SSD; fla's below, to its tolerance
    cuda = layer.to("cuda", dtype)
    got = run(cuda, prompt.to("cuda", dtype), tokens.to("cuda", dtype), dtype)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol(dtype) * 20, rtol=tol(dtype) * 20)


HEADS, HEAD_DIM, GROUPS, STATE = 8, 16, 2, 32  # groups shared by heads, as Nemotron-H's 8 groups by 128 heads


def scan_inputs(length: int, dtype: torch.dtype, seed: int = 0):
    """x [T, H, P], dt [T, H] (softplus-like, in (0.05, 0.55)), a [H] < 0, b, c [T, G, N] in `dtype` (dt and a
    float32, as the mixer gives them)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(length, HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype)
    dt = 0.05 + 0.5 * torch.rand(length, HEADS, device="cuda", generator=gen)
    a = -(0.1 + torch.rand(HEADS, device="cuda", generator=gen))
    b, c = (torch.randn(length, GROUPS, STATE, device="cuda", generator=gen).to(dtype) for _ in range(2))
    return x, dt, a, b, c


def assert_near(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Equal to `tol` of want's largest magnitude: fla's chunk kernels multiply float32 in TF32 on the tensor cores
    (Triton's default), where the torch rule multiplies in full float32."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=tol)


# Both sides scan the same inputs upcast to float32, so bfloat16 inputs add no error of their own: one tolerance.
SCAN_TOL = 5e-3


@NO_FLA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 13, 192, 150])  # one token, inside one 64-token chunk, three, not a multiple
def test_fla_prefill_matches_the_torch_rule(length, dtype):
    x, dt, a, b, c = scan_inputs(length, dtype)
    state = torch.randn(HEADS, HEAD_DIM, STATE, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    y, final = ssd_scan.chunked(x, dt, a, b, c, state.clone())
    want_y, want_state = ssd.chunked(x, dt, a, b, c, state.clone(), 16)
    assert_near(y, want_y, SCAN_TOL)
    assert_near(final, want_state, SCAN_TOL)
    if length <= 13:
        rec_y, rec_state = ssd.recurrent(x, dt, a, b, c, state.clone())
        assert_near(y, rec_y, SCAN_TOL)
        assert_near(final, rec_state, SCAN_TOL)


@NO_FLA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_fla_decode_matches_the_torch_step(batch, dtype):
    """Three decode steps of `batch` rows, each row's state carried from one step to the next."""
    x, dt, a, b, c = scan_inputs(3 * batch, dtype, seed=batch)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    states = torch.randn(batch, HEADS, HEAD_DIM, STATE, device="cuda", generator=gen)
    want_states = states.clone()
    for t in range(3):
        rows = slice(t * batch, (t + 1) * batch)
        y, states = ssd_scan.step(x[rows], dt[rows], a, b[rows], c[rows], states)
        want = ssd.step_(x[rows], dt[rows], a, b[rows], c[rows], want_states)
        assert states.dtype == torch.float32 and y.shape == (batch, HEADS, HEAD_DIM)
        # the fused recurrent kernel multiplies elementwise in float32: no TF32 here
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(states, want_states, atol=1e-4, rtol=1e-4)


@NO_FLA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_is_the_same_with_and_without_fla(monkeypatch, dtype):
    """A 150-token prompt prefilled in two steps (100 tokens, then 50 from the state the first left), then three
    decode steps of three sequences in slots out of order, with fla's scan and with the torch rule's, on one GPU."""
    torch.manual_seed(0)
    layer = Mamba2Mixer(SHAPE)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) + (1.0 if name == "norm.weight" else 0.0))
    layer = layer.to("cuda", dtype).eval()
    gen = torch.Generator(device="cuda").manual_seed(2)
    prompt = torch.randn(150, 64, device="cuda", generator=gen).to(dtype)
    tokens = torch.randn(3, 3, 64, device="cuda", generator=gen).to(dtype)
    slots = [3, 0, 6]
    prefills = [
        RecurrentStep(
            spans=[(0, n)], slots=[3], captures=[], slot_index=torch.tensor([3], device="cuda"), is_decode=False
        )
        for n in (100, 50)
    ]
    decode = RecurrentStep(
        spans=[(i, 1) for i in range(3)],
        slots=slots,
        captures=[],
        slot_index=torch.tensor(slots, device="cuda"),
        is_decode=True,
    )
    results = []
    for use_fla in (True, False):
        monkeypatch.setattr(ssd_scan, "fla_runs", lambda device, _use=use_fla: _use)
        conv_shape, state_shape = SHAPE.state_shapes()
        conv = torch.zeros(8, *conv_shape, dtype=dtype, device="cuda")
        state = 0.1 * torch.randn(8, *state_shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
        with torch.inference_mode():
            outs = [layer(prompt[:100], prefills[0], conv, state), layer(prompt[100:], prefills[1], conv, state)]
            outs += [layer(x, decode, conv, state) for x in tokens]
        results.append((torch.cat(outs).float(), state))
    (got, got_state), (want, want_state) = results
    tol = 2e-2 if dtype == torch.float32 else 8e-2  # the gated norm and out_proj after the scan, in the layer's dtype
    assert_near(got, want, tol)
    assert_near(got_state, want_state, SCAN_TOL)


def test_a_mamba2_decode_step_replays_from_a_graph_on_other_slots():
    """One decode step captured over a static slot buffer (padding rows on the scratch slot) and replayed on other
    slots gives the eager step's rows and pools, bit for bit."""
    torch.manual_seed(0)
    layer, scratch = Mamba2Mixer(SHAPE).to("cuda", torch.bfloat16).eval(), 9
    conv_shape, state_shape = SHAPE.state_shapes()
    gen = torch.Generator(device="cuda").manual_seed(1)
    conv = torch.randn(10, *conv_shape, device="cuda", generator=gen).to(torch.bfloat16)
    state = torch.randn(10, *state_shape, device="cuda", generator=gen)
    x = torch.zeros(4, 64, device="cuda", dtype=torch.bfloat16)  # static, as the graph runner's buffers
    index = torch.full((4,), scratch, device="cuda")
    step = RecurrentStep.graphed(index)
    with torch.inference_mode():
        for _ in range(2):  # warm-up outside the graph
            layer(x, step, conv, state)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, step, conv, state)
        want_conv, want_state = conv.clone(), state.clone()
        for slots in ([2, 7, 0], [0, 1, 2, 3], [5]):
            rows = torch.randn(len(slots), 64, device="cuda", generator=gen).to(torch.bfloat16)
            want = layer(rows, RecurrentStep.graphed(torch.tensor(slots, device="cuda")), want_conv, want_state)
            x[: len(slots)].copy_(rows)
            index[: len(slots)].copy_(torch.tensor(slots))
            index[len(slots) :].fill_(scratch)  # padding rows: the scratch slot
            graph.replay()
            torch.testing.assert_close(out[: len(slots)], want, atol=0, rtol=0)
    held = list(range(scratch))
    assert torch.equal(conv[held], want_conv[held]) and torch.equal(state[held], want_state[held])


def test_a_nemotron_h_model_decodes_under_cuda_graphs_as_eagerly(tmp_path):
    """A tiny random Nemotron-H (Mamba2, attention of 8 q / 2 kv heads of 64, relu^2 MLP and experts) served with
    graphs gives the eager engine's tokens; second turns hit snapshots that replayed decode steps took."""
    from bench.gpu.random_model import save_word_tokenizer
    from tests.engine.model.mamba_checkpoints import build_nemotron_h_checkpoint
    from tests.gpu.test_gpu_hybrid_graphs import serve

    path = tmp_path / "nemotron_h"
    build_nemotron_h_checkpoint(path, head_dim=64, num_attention_heads=8, num_key_value_heads=2)
    save_word_tokenizer(path, 128)
    eager_first, eager_second, eager_replays = serve(path, enforce_eager=True)
    first, second, replays = serve(path, enforce_eager=False)
    assert eager_replays == 0 and replays > 0, "decode steps did not replay CUDA graphs"
    assert first == eager_first
    assert second == eager_second
    for r, (_, cached) in second.items():
        assert cached > int(r[1:]) and cached % 16 == 0, (r, cached)
