"""MXFP4 experts run from their packed blocks and scales: each step dequantises, to the activations' dtype, only the
experts it needs, a bounded number at a time, and multiplies with torch's matmuls. Every shape follows the batch
size alone (no per-expert counts on the host), so CUDA graphs capture it.

With fewer (token, slot) pairs than experts (decode), the pairs' own experts are gathered and dequantised, a chunk
of pairs at a time, and each pair runs one batched matrix-vector product. With more, every expert is dequantised
once, a chunk of experts at a time; the pairs, sorted by expert, run two grouped matmuls per chunk, whose first
group also takes the pairs of earlier experts (their rows are discarded) and whose rows past the chunk are left out.
"""

from __future__ import annotations

import torch

from engine.model.layers.moe import StackedExperts, grouped_mm_runs
from engine.model.quant.mxfp4 import GROUP, dequantize_mxfp4

PROJECTIONS = ("gate_up_proj", "down_proj")
# Bytes of dequantised expert weights one step holds at a time (in the serving dtype): gpt-oss-120b's experts are
# about 50 MB each in bfloat16, so 21 at a time.
SCRATCH_BYTES = 1 << 30


def experts_at_a_time(num_experts: int, expert_bytes: int) -> int:
    """How many experts of `expert_bytes` (dequantised, both projections) a step dequantises at once."""
    return max(1, min(num_experts, SCRATCH_BYTES // expert_bytes))


def scratch_bytes(model: torch.nn.Module) -> int:
    """The largest dequantised working set of the model's packed MXFP4 experts (0: none are packed)."""
    return max(
        (
            m.runner.scratch_bytes
            for m in model.modules()
            if isinstance(m, StackedExperts) and isinstance(m.runner, PackedMxfp4)
        ),
        default=0,
    )


class PackedMxfp4:
    """StackedExperts.runner for experts holding `{proj}_blocks` and `{proj}_scales` (uint8)."""

    def __init__(self, experts: StackedExperts, dtype: torch.dtype) -> None:
        elt = torch.empty((), dtype=dtype).element_size()
        per_expert = sum(getattr(experts, f"{p}_scales")[0].numel() * GROUP for p in PROJECTIONS) * elt
        self.chunk = experts_at_a_time(experts.num_experts, per_expert)
        self.scratch_bytes = self.chunk * per_expert

    def capture_blocker(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if grouped_mm_runs(device, dtype):
            return None
        return f"MXFP4 experts past one token per expert need a grouped matmul for {dtype} (torch._grouped_mm)"

    def __call__(
        self, experts: StackedExperts, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if expert_ids.numel() < experts.num_experts:
            return self._gathered(experts, x, expert_ids, weights)
        return self._all_experts(experts, x, expert_ids, weights)

    def _gathered(
        self, experts: StackedExperts, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        rows = x.repeat_interleave(k, dim=0)  # (token, slot) order
        outs = []
        for lo in range(0, flat.numel(), self.chunk):
            ids, part = flat[lo : lo + self.chunk], rows[lo : lo + self.chunk]
            h = experts.activation(_pair_matmul(experts, "gate_up_proj", ids, part))
            outs.append(_pair_matmul(experts, "down_proj", ids, h))
        return experts.combine(torch.cat(outs) if len(outs) > 1 else outs[0], None, weights)

    def _all_experts(
        self, experts: StackedExperts, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        n = experts.num_experts
        if self.chunk >= n or not grouped_mm_runs(x.device, x.dtype):
            # NOTE: without a grouped matmul the per-expert path syncs anyway (capture_blocker says so).
            gate_up, down = (_dequantized(experts, p, slice(0, n), x.dtype) for p in PROJECTIONS)
            return experts.run_sorted(x, expert_ids, weights, gate_up, down)
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = flat.argsort(stable=True)
        sorted_ids = flat.index_select(0, order)
        rows = x.index_select(0, order // k)
        out = torch.zeros_like(rows)
        for lo in range(0, n, self.chunk):
            hi = min(n, lo + self.chunk)
            bounds = torch.arange(lo + 1, hi + 1, device=x.device, dtype=sorted_ids.dtype)
            offsets = torch.searchsorted(sorted_ids, bounds).to(torch.int32)
            local = sorted_ids.clamp(lo, hi - 1)
            h = torch._grouped_mm(
                rows, _dequantized(experts, "gate_up_proj", slice(lo, hi), x.dtype).transpose(1, 2), offs=offsets
            )
            h = _add_bias(experts, "gate_up_proj", h, local)
            h = torch._grouped_mm(
                experts.activation(h),
                _dequantized(experts, "down_proj", slice(lo, hi), x.dtype).transpose(1, 2),
                offs=offsets,
            )
            h = _add_bias(experts, "down_proj", h, local)
            inside = (sorted_ids >= lo) & (sorted_ids < hi)
            out = torch.where(inside.unsqueeze(-1), h, out)
        return experts.combine(out, order, weights)


def _dequantized(experts: StackedExperts, proj: str, which: slice, dtype: torch.dtype) -> torch.Tensor:
    blocks, scales = getattr(experts, f"{proj}_blocks"), getattr(experts, f"{proj}_scales")
    return dequantize_mxfp4(blocks[which], scales[which], dtype)


def _pair_matmul(experts: StackedExperts, proj: str, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """rows [P, in] through expert ids[p]'s `proj` each: [P, out]."""
    blocks, scales = getattr(experts, f"{proj}_blocks"), getattr(experts, f"{proj}_scales")
    w = dequantize_mxfp4(blocks.index_select(0, ids), scales.index_select(0, ids), rows.dtype)
    return _add_bias(experts, proj, torch.bmm(w, rows.unsqueeze(-1)).squeeze(-1), ids)


def _add_bias(experts: StackedExperts, proj: str, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    bias = getattr(experts, f"{proj}_bias")
    return h if bias is None else h + bias.index_select(0, ids)
