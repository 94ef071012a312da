"""The gated delta rule on CUDA through flash-linear-attention's Triton kernels (fla-core), for Gated DeltaNet
layers (Qwen3.5, Qwen3-Next): chunk_gated_delta_rule for prefill, fused_recurrent_gated_delta_rule for decode. The
torch rule in engine/model/layers/delta_rule.py is the reference the GPU tests hold them to, and what runs where
fla does not. fla is imported lazily: it needs Triton, which a CPU build of torch does not have.
"""

from __future__ import annotations

import torch

from engine.cuda import causal_conv, ssd_scan
from engine.cuda.kernels import import_error


def fla_import_error() -> Exception | None:
    """None when fla's gated delta rule import, else the error raised."""
    return import_error("fla.ops.gated_delta_rule")


def fla_runs(device: torch.device) -> bool:
    """Whether the delta rule of a recurrent layer on `device` (prefill and decode) goes through fla's kernels."""
    return device.type == "cuda" and fla_import_error() is None


def describe(device: torch.device, kind: str = "gated_deltanet") -> str:
    """For the start-up log: which gated delta rule (kind "gated_deltanet") or SSD scan ("mamba2") and which conv a
    hybrid model runs on `device`."""
    if kind == "mamba2":
        return f"Mamba2: {ssd_scan.describe(device)}; {causal_conv.describe(device)}"
    if fla_runs(device):
        rule = (
            "delta rule through fla (chunk_gated_delta_rule for prefill, fused_recurrent_gated_delta_rule for decode)"
        )
    else:
        reason = "not on CUDA" if device.type != "cuda" else f"fla does not import: {fla_import_error()}"
        rule = f"delta rule in torch ({reason})"
    return f"Gated DeltaNet: {rule}; {causal_conv.describe(device)}"


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence from `state`, as engine.model.layers.delta_rule.chunked: q, k [T, Hk, Dk] (normalised and q
    scaled inside), v [T, Hv, Dv], g (log decay) and beta [T, Hv], state [Hv, Dk, Dv] float32. Returns
    (o [T, Hv, Dv] in v's dtype, the float32 state after the last token)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel

    o, final = kernel(
        q=q[None],
        k=k[None],
        v=v[None],
        g=g.float()[None],
        beta=beta.to(v.dtype)[None],
        scale=q.shape[-1] ** -0.5,
        initial_state=state.float()[None].contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o[0].to(v.dtype), final[0].float()


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences (decode), as engine.model.layers.delta_rule.step_ row by row: q, k [B, Hk, Dk],
    v [B, Hv, Dv], g and beta [B, Hv], states [B, Hv, Dk, Dv] float32 (the rows' states, gathered: fla-core 0.6.0
    reads and writes a state per batch row, with no slot indices into a pool). Returns (o [B, Hv, Dv] in v's
    dtype, the float32 states after the token). Capturable in a CUDA graph once compiled (no autotuning, no sync)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as kernel

    # NOTE: by keyword: the recurrent rule's fifth parameter is gk (a per-key decay), not beta as in the chunk rule.
    o, final = kernel(
        q=q[:, None],
        k=k[:, None],
        v=v[:, None],
        g=g.float()[:, None],
        beta=beta.to(v.dtype)[:, None],
        scale=q.shape[-1] ** -0.5,
        initial_state=states,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o[:, 0].to(v.dtype), final
