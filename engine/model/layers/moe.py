"""A mixture-of-experts MLP: a router picks top-k experts per token (routing.py: softmax top-k, or DeepSeek's grouped
sigmoid routing), only those experts run, and their outputs are summed with the routing weights (plus a gated shared
expert where the family has one: Qwen2-MoE; ungated shared experts beside the routed ones: DeepSeek-V3, GLM-4.5).

Experts are stacked weights, gate|up fused [E, 2I, H] and down [E, H, I] (transformers 5's in-memory layout),
with optional biases and the family's activation (gpt-oss: clamped SwiGLU over interleaved gate/up, biased
router; Nemotron-H: non-gated experts, up [E, I, H] and relu^2); the per-expert hub tensors
(`experts.{i}.gate_proj.weight`, ...) load into slices of them. Tokens are sorted by
expert so that each active expert runs one matmul over exactly the tokens routed to it.

Two ways to run the sorted tokens, chosen in grouped_mm_runs(): one grouped matmul per projection over all experts
(torch._grouped_mm, its per-expert offsets computed on the device: no host sync, so CUDA graphs can capture it),
or one matmul per active expert, which needs the per-expert counts on the host. The second is for experts held as
modules of their own (int4, CPU-packed bf16, quantized checkpoints) and for devices without the grouped kernel;
capture_blocker() says so, and the engine then runs decode eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.checkpoint import Shard
from engine.model.layers.activation import silu_and_mul
from engine.model.layers.routing import (
    SPARSEMIXER,
    BiasedChoiceRouter,
    Routing,
    ScoreLinear,
    grouped_top_k,
    softmax_top_k,
    sparsemixer_top2,
)


class StackedExperts(nn.Module):
    """E experts' gated MLPs as two stacked weights (and biases, where the family has them); forward runs each
    expert on the tokens routed to it. `activation` maps the gate_up output [T, 2I] to [T, I]. gated False: the
    first weight is up alone [E, I, H] (still named gate_up_proj) and `activation` maps [T, I] to [T, I]."""

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
        gated: bool = True,
    ) -> None:
        super().__init__()
        # activation: on the fused gate|up output: SwiGLU, GeGLU (Gemma 4), or gpt-oss's clamped SwiGLU
        self.num_experts, self.intermediate_size, self.activation = num_experts, intermediate_size, activation
        self.hidden_size, self.gated = hidden_size, gated
        width = (2 if gated else 1) * intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, width, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, width)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        # Set by use_expert_linears (int4, CPU bf16 packing, quantized checkpoints): each expert's (gate_up, down).
        self.linears: nn.ModuleList | None = None
        # Set by a format that keeps the experts packed (MXFP4 on CUDA): runner(self, x, expert_ids, weights)
        # runs the layer from the packed weights, through run_sorted() with weights it dequantised.
        self.runner: Callable[..., torch.Tensor] | None = None

    def checkpoint_shards(self, prefix: str) -> dict[str, Shard]:
        """Hub per-expert tensors ('experts.3.up_proj.weight') -> their expert's slice of the stacked weights.
        The fused names ('experts.gate_up_proj') are our own parameters and need no entry. Experts that hold a
        quantized checkpoint's modules take the tensors those modules name ('experts.3.up_proj.qweight')."""
        if self.linears is not None:
            shards = {}
            for e, pair in enumerate(self.linears):
                for j, module in enumerate(pair):
                    own = getattr(module, "checkpoint_shards", None)
                    if own is not None:
                        shards.update(
                            {f"experts.{e}.{name}": shard for name, shard in own(f"{prefix}.linears.{e}.{j}").items()}
                        )
            return shards
        n, shards = self.intermediate_size, {}
        for e in range(self.num_experts):
            shards[f"experts.{e}.down_proj.weight"] = Shard(param=f"{prefix}.down_proj", index=e)
            if not self.gated:
                shards[f"experts.{e}.up_proj.weight"] = Shard(param=f"{prefix}.gate_up_proj", index=e)
                continue
            shards[f"experts.{e}.gate_proj.weight"] = Shard(param=f"{prefix}.gate_up_proj", index=e, offset=0, size=n)
            shards[f"experts.{e}.up_proj.weight"] = Shard(param=f"{prefix}.gate_up_proj", index=e, offset=n, size=n)
        return shards

    def swap_expert_linears(self, select: Callable[[nn.Linear], bool], make: Callable[[nn.Linear], nn.Module]) -> int:
        """Replaces the stacked weights by one module per expert projection, made from an nn.Linear view of
        it (how quantize_linears_int4 and pack_linears_for_cpu reach the experts); returns how many."""
        if self.linears is not None or not select(_linear(self.down_proj[0])):
            return 0
        self.use_expert_linears(
            [(make(_linear(self.gate_up_proj[e])), make(_linear(self.down_proj[e]))) for e in range(self.num_experts)]
        )
        return 2 * self.num_experts

    def use_expert_linears(self, linears: list[tuple[nn.Module, nn.Module]]) -> None:
        """From now on expert e runs linears[e] = (gate_up [H -> 2I], down [I -> H]) instead of the stacked
        weights, which are dropped."""
        if len(linears) != self.num_experts:
            raise ValueError(f"{len(linears)} experts' linears for {self.num_experts} experts")
        self.linears = nn.ModuleList(nn.ModuleList(pair) for pair in linears)
        del self.gate_up_proj, self.down_proj

    def capture_blocker(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this layer's forward cannot be captured in a CUDA graph on `device`; None: it can."""
        if self.linears is not None:
            return (
                "MoE experts held one module each (quantized or packed) run one matmul per expert with host-side counts"
            )
        if self.runner is not None:
            ask = getattr(self.runner, "capture_blocker", None)
            return ask(device, dtype) if ask is not None else None
        if not grouped_mm_runs(device, dtype):
            return f"no grouped expert matmul for {dtype} on this device (torch._grouped_mm)"
        return None

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids and weights [T, k]. Returns sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""
        if self.runner is not None:
            return self.runner(self, x, expert_ids, weights)
        if self.linears is not None:
            return self.run_sorted(x, expert_ids, weights)
        return self.run_sorted(x, expert_ids, weights, self.gate_up_proj, self.down_proj)

    def run_sorted(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        gate_up: torch.Tensor | None = None,
        down: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """forward() over stacked weights `gate_up` [E, 2I, H] and `down` [E, H, I] (None: the expert linears)."""
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within each
        rows = x.index_select(0, order // k)
        if gate_up is not None and grouped_mm_runs(x.device, x.dtype):
            out = self._grouped(rows, flat.index_select(0, order), gate_up, down)
        else:
            out = self._per_expert(rows, flat, gate_up, down)
        return self.combine(out, order, weights)

    @staticmethod
    def combine(out: torch.Tensor, order: torch.Tensor | None, weights: torch.Tensor) -> torch.Tensor:
        """Expert outputs [T * k, H] (in `order`'s order; None: already in (token, slot) order) -> [T, H], each
        token's k outputs summed with its routing weights."""
        # NOTE: back to (token, slot) order and a sum over the k slots, not index_add_: on CPU that is a
        # scatter_add costing 80 ms a call at one token (measured), and the fixed slot order keeps a token's
        # sum independent of the batch it came in.
        by_token = out
        if order is not None:
            by_token = torch.empty_like(out)
            by_token[order] = out
        k = weights.shape[1]
        return by_token.view(-1, k, out.shape[1]).mul_(weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)

    def _grouped(
        self, rows: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        """rows [N, H] sorted by their expert ids `experts` [N]: two grouped matmuls, offsets found on the device."""
        bounds = torch.arange(1, self.num_experts + 1, device=rows.device, dtype=experts.dtype)
        offsets = torch.searchsorted(experts, bounds).to(torch.int32)  # end row of each expert's tokens
        h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias.index_select(0, experts)
        h = torch._grouped_mm(self.activation(h), down.transpose(1, 2), offs=offsets)
        return h if self.down_proj_bias is None else h + self.down_proj_bias.index_select(0, experts)

    def _per_expert(
        self, rows: torch.Tensor, flat: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor | None
    ) -> torch.Tensor:
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start : start + n] = self._expert(e, rows[start : start + n], gate_up, down)
                start += n
        return out

    def _expert(self, e: int, x: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor | None) -> torch.Tensor:
        up_bias = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
        down_bias = None if self.down_proj_bias is None else self.down_proj_bias[e]
        if gate_up is None:
            up, dn = self.linears[e]
            h = up(x) if up_bias is None else up(x) + up_bias
            h = dn(self.activation(h))
            return h if down_bias is None else h + down_bias
        h = self.activation(F.linear(x, gate_up[e], up_bias))
        return F.linear(h, down[e], down_bias)


class SparseMoE(nn.Module):
    """The MoE MLP of a decoder layer: router `gate`, `experts`, and optionally `shared_expert` (any MLP module) with
    its sigmoid `shared_expert_gate` (Qwen), or ungated `shared_experts` (DeepSeek, GLM). Parameter names follow the
    hub's `mlp.*`."""

    def __init__(
        self,
        *,
        routing: Routing,
        hidden_size: int,
        shared_expert: nn.Module | None = None,
        experts: StackedExperts | None = None,
        shared_experts: nn.Module | None = None,
        gate: ScoreLinear | None = None,
    ) -> None:
        super().__init__()
        self.routing = routing
        if gate is not None:  # a family's own router (ERNIE 4.5 stores its correction bias [1, E])
            self.gate = gate
        elif routing.choice_bias:
            self.gate: ScoreLinear = BiasedChoiceRouter(hidden_size, routing.num_experts)
        else:
            self.gate = ScoreLinear(hidden_size, routing.num_experts, bias=routing.router_bias)
        self.experts = experts or StackedExperts(
            num_experts=routing.num_experts, hidden_size=hidden_size, intermediate_size=routing.intermediate_size
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = ScoreLinear(hidden_size, 1) if shared_expert is not None else None
        self.shared_experts = shared_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], routing weights [T, k] in x's dtype), as transformers computes them: a float32
        softmax over all experts, top-k, renormalised when norm_topk_prob; DeepSeek's grouped_top_k; or
        Phi-3.5-MoE's sparsemixer."""
        r = self.routing
        if r.scoring == SPARSEMIXER:
            ids, weights = sparsemixer_top2(self.gate(x), r.jitter_eps)
        elif r.grouped:
            ids, weights = grouped_top_k(self.gate(x), r, getattr(self.gate, "e_score_correction_bias", None))
        else:
            ids, weights = softmax_top_k(self.gate(x), r.top_k, r.norm_topk_prob)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.shared_experts is not None:
            out += self.shared_experts(x)
        return out


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs experts of `dtype` on `device`: on the CPU in float32 and bfloat16 (torch 2.11
    and later); on CUDA in bfloat16 from Hopper (sm90) on."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear around an existing [out, in] weight (no copy, no init)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear
