"""Mamba2's SSD scan on CUDA through fla-core's simple-GLA kernels: chunk_simple_gla for prefill,
fused_recurrent_simple_gla for decode. Their rule, S_t = exp(g_t) S_{t-1} + k_t v_t^T and o_t = scale q_t^T S_t with
one log decay per head and token, is the SSD's with q = C, k = B (each group's repeated for its heads), v = dt x,
g = dt A and scale 1; fla's V-first state [H, V, K] is the SSM state [H, P, N] as a slot holds it. The torch rule in
engine/model/layers/ssd.py is the reference the GPU tests hold them to, and what runs where fla does not. fla is
imported lazily: it needs Triton, which a CPU build of torch does not have.
"""

from __future__ import annotations

import torch

from engine.cuda.kernels import import_error


def fla_import_error() -> Exception | None:
    """None when fla's simple-GLA kernels import, else the error raised."""
    return import_error("fla.ops.simple_gla")


def fla_runs(device: torch.device) -> bool:
    """Whether the SSD scan of a Mamba2 layer on `device` (prefill and decode) goes through fla's kernels."""
    return device.type == "cuda" and fla_import_error() is None


def describe(device: torch.device) -> str:
    """For the start-up log: which SSD scan a Mamba2 layer runs on `device`."""
    if fla_runs(device):
        return "SSD scan through fla (chunk_simple_gla for prefill, fused_recurrent_simple_gla for decode)"
    reason = "not on CUDA" if device.type != "cuda" else f"fla does not import: {fla_import_error()}"
    return f"SSD scan in torch (float32; {reason})"


def gla_inputs(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, g) of the SSD's x [..., H, P], dt [..., H], a [H], b and c [..., G, N], all float32: the scan runs
    in float32 as the torch rule does (fla keeps its per-chunk states in the inputs' dtype)."""
    heads = x.shape[-2]
    q, k = (m.float().repeat_interleave(heads // m.shape[-2], dim=-2) for m in (c, b))
    dtf = dt.float()
    return q, k, x.float() * dtf[..., None], dtf * a.float()


def chunked(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence from `state`, as engine.model.layers.ssd.chunked: x [T, H, P]; dt [T, H] (after softplus and
    clamp); a [H] (A = -exp(A_log)); b, c [T, G, N]; state [H, P, N]. Returns (y [T, H, P] float32, no D skip, the
    float32 state after the last token). fla's own chunk (64 tokens) tiles the scan: the model's chunk_size is the
    torch rule's, and the result does not depend on it."""
    from fla.ops.simple_gla import chunk_simple_gla as kernel

    q, k, v, g = gla_inputs(x, dt, a, b, c)
    y, final = kernel(
        q=q[None],
        k=k[None],
        v=v[None],
        g=g[None],
        scale=1.0,
        initial_state=state.float()[None].contiguous(),
        output_final_state=True,
        state_v_first=True,
    )
    return y[0].float(), final[0]


def step(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of R rows, as engine.model.layers.ssd.step_ (decode): x [R, H, P]; dt [R, H]; b, c [R, G, N];
    states [R, H, P, N] float32 (the rows' states, gathered: fla reads and writes a state per batch row, with no slot
    indices into a pool). Returns (y [R, H, P] float32, the float32 states after the token, a new tensor). One
    kernel reads each state once and writes it once, in float32 (the torch step scales it, adds an outer product and
    reads it back). Capturable in a CUDA graph once a first call has compiled and autotuned it (num_warps, keyed on
    the head sizes, not the rows: the graph runner's warm-up does), with no host sync; the kernel writes a new
    tensor, so autotuning's repeated runs leave its inputs as they were."""
    from fla.ops.simple_gla import fused_recurrent_simple_gla as kernel

    q, k, v, g = gla_inputs(x, dt, a, b, c)
    y, final = kernel(
        q=q[:, None],
        k=k[:, None],
        v=v[:, None],
        g=g[:, None],
        scale=1.0,
        initial_state=states,
        output_final_state=True,
        state_v_first=True,
    )
    return y[:, 0], final
