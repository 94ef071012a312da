"""A mixture-of-experts MLP: a router picks top-k experts per token, only those experts run, and their outputs
are summed with the routing weights (plus a gated shared expert where the family has one: Qwen2-MoE; ungated shared
experts beside the routed ones: DeepSeek-V3, GLM-4.5).

Two routing schemes: a softmax over all experts and its top k (Qwen, Mixtral, OLMoE, gpt-oss), and DeepSeek's
(grouped_top_k): sigmoid or softmax scores, a correction bias that steers the choice but not the weights, top-k
within the best expert groups, and a scaling factor on the routed experts' weights. Both are capture-safe: fixed
shapes, no host sync.

Experts are stacked weights, gate|up fused [E, 2I, H] and down [E, H, I] (transformers 5's in-memory layout),
with optional biases and the family's activation (gpt-oss: clamped SwiGLU over interleaved gate/up, biased
router); the per-expert hub tensors (`experts.{i}.gate_proj.weight`, ...) load into slices of them. Tokens are sorted by
expert so that each active expert runs one matmul over exactly the tokens routed to it.

Two ways to run the sorted tokens, chosen in grouped_mm_runs(): one grouped matmul per projection over all experts
(torch._grouped_mm, its per-expert offsets computed on the device: no host sync, so CUDA graphs can capture it),
or one matmul per active expert, which needs the per-expert counts on the host. The second is for experts held as
modules of their own (int4, CPU-packed bf16, quantized checkpoints) and for devices without the grouped kernel;
capture_blocker() says so, and the engine then runs decode eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.checkpoint import Shard
from engine.model.layers.activation import silu_and_mul

# Config keys of routing schemes the softmax top-k families do not run -> the values they do (None: key absent).
# DeepSeek-style families read these keys themselves (read_grouped_routing).
UNSUPPORTED_ROUTING: dict[str, tuple] = {
    "scoring_func": (None, "softmax"),  # DeepSeek-V3 / GLM-4.5: sigmoid scores
    "topk_method": (None, "greedy"),  # DeepSeek: group_limited_greedy, noaux_tc
    "n_group": (None, 1),  # grouped top-k
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "moe_layer_freq": (None, 1),
    "first_k_dense_replace": (None, 0),
    "n_shared_experts": (None, 0),
}
# DeepSeek's top-k methods -> how a group of experts is scored for the choice of groups.
GROUP_SCORES = {"noaux_tc": "top2_sum", "group_limited_greedy": "max", "greedy": None}
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """How a family routes: `num_experts` experts of width `intermediate_size`, `top_k` per token, the chosen
    probabilities renormalised to sum to 1 when `norm_topk_prob` (Mixtral always: a softmax over the chosen k).

    The DeepSeek fields (grouped_top_k runs them when `scoring` is sigmoid, a group score is set, or the weights
    are scaled): `group_score` "top2_sum" (noaux_tc: a group scores the sum of its two best biased scores) or "max"
    (group_limited_greedy), the best `top_k_groups` of `num_groups` groups kept; `choice_bias`: the router holds
    e_score_correction_bias, added to the scores for the choice only; `scaling_factor` (routed_scaling_factor) on
    the routed weights."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    # A dense expert every token runs: Qwen2-MoE's under a sigmoid gate (shared_expert), DeepSeek's and GLM's
    # n_shared_experts * moe_intermediate_size wide and ungated (shared_experts).
    shared_expert_size: int = 0
    router_bias: bool = False  # gpt-oss: the router is a linear with a bias
    scoring: str = "softmax"
    group_score: str | None = None
    num_groups: int = 1
    top_k_groups: int = 1
    choice_bias: bool = False
    scaling_factor: float = 1.0

    @property
    def grouped(self) -> bool:
        """Whether DeepSeek's routing (grouped_top_k) runs rather than a softmax top-k."""
        return (self.scoring != "softmax" or self.group_score is not None or self.choice_bias
                or self.scaling_factor != 1.0)


def check_routing(config: dict) -> None:
    """UnsupportedModel naming the config key of a routing scheme the softmax top-k families do not run."""
    for key, allowed in UNSUPPORTED_ROUTING.items():
        if config.get(key) not in allowed:
            raise UnsupportedModel(f"MoE routing {key}={config[key]!r} is not supported (softmax top-k only)",
                                   param="model")


def read_grouped_routing(config: dict, *, scoring: str, topk_method: str, norm_topk_prob: bool) -> Routing:
    """DeepSeek-style Routing from a config (n_routed_experts, moe_intermediate_size, n_group, topk_group,
    routed_scaling_factor, n_shared_experts). `scoring`, `topk_method` and `norm_topk_prob` are what the family's
    reference runs where the config leaves the key out; a config key that says otherwise than a reference which
    ignores it (GLM-4.5's router is always sigmoid, noaux_tc) is refused in one line rather than half-served."""
    for key, runs, allowed in (("scoring_func", scoring, SCORING_FUNCS), ("topk_method", topk_method, GROUP_SCORES)):
        if runs not in allowed or config.get(key, runs) != runs:
            raise UnsupportedModel(f"MoE routing {key}={config.get(key, runs)!r} is not supported (this family's "
                                   f"router runs {key}={runs!r})", param="model")
    num_experts = config.get("n_routed_experts") or config.get("num_local_experts")
    if not num_experts:
        raise KeyError("n_routed_experts")
    top_k, groups, kept = config["num_experts_per_tok"], config.get("n_group") or 1, config.get("topk_group") or 1
    if num_experts % groups or not 0 < kept <= groups:
        raise UnsupportedModel(f"MoE routing n_group={groups}, topk_group={kept} does not split {num_experts} "
                               "experts into groups of which some are kept", param="model")
    group_score = GROUP_SCORES[topk_method]
    if group_score == "top2_sum" and groups > 1 and num_experts // groups < 2:
        raise UnsupportedModel(f"MoE routing noaux_tc scores groups by their two best experts; n_group={groups} "
                               f"leaves {num_experts // groups} per group", param="model")
    if not 0 < top_k <= (num_experts // groups) * kept:
        raise UnsupportedModel(f"num_experts_per_tok={top_k} must be in 1..{(num_experts // groups) * kept} (the "
                               "experts of the kept groups)", param="model")
    width = config["moe_intermediate_size"]
    return Routing(num_experts, top_k, width, norm_topk_prob=bool(config.get("norm_topk_prob", norm_topk_prob)),
                   shared_expert_size=(config.get("n_shared_experts") or 0) * width, scoring=scoring,
                   group_score=group_score, num_groups=groups, top_k_groups=kept,
                   choice_bias=topk_method == "noaux_tc",
                   scaling_factor=float(config.get("routed_scaling_factor") or 1.0))


def softmax_top_k(scores: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], float32 weights [T, k]): a float32 softmax over all experts' scores, its top k,
    renormalised to sum to 1 when `renormalize`."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return ids, weights


def grouped_top_k(logits: torch.Tensor, routing: Routing, choice_bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], float32 weights [T, k]) by DeepSeek's routing, op for op as transformers' DeepSeek-V3 /
    GLM-4.5 (noaux_tc) and DeepSeek-V2 (group_limited_greedy) routers compute it, so that ties fall alike: scores
    (sigmoid or softmax of the float32 logits), plus `choice_bias` [E] for the choice; the groups ranked by their
    two best (or their best) choice scores and all but the best top_k_groups masked out; the top k of what is left
    chosen; their unbiased scores as weights, renormalised when norm_topk_prob, times the scaling factor. Fixed
    shapes throughout: a CUDA graph captures it."""
    r = routing
    logits = logits.float()
    scores = logits.sigmoid() if r.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if choice_bias is None else scores + choice_bias.float()
    if r.group_score is not None and r.num_groups > 1:
        groups = choice.view(-1, r.num_groups, r.num_experts // r.num_groups)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1) if r.group_score == "top2_sum" else groups.amax(dim=-1)
        kept = torch.topk(group_scores, k=r.top_k_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(groups).reshape(-1, r.num_experts)
        # NOTE: -inf as noaux_tc masks, 0 as group_limited_greedy does (its softmax scores are all above 0).
        choice = choice.masked_fill(expert_mask == 0, float("-inf") if r.group_score == "top2_sum" else 0.0)
    ids = torch.topk(choice, k=r.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if r.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * r.scaling_factor


class ScoreLinear(nn.Module):
    """A projection to a few scores (the router, the shared expert's gate). Not an nn.Linear on purpose: int4 and
    LoRA leave it alone, because routing decisions are sensitive to its precision."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class BiasedChoiceRouter(ScoreLinear):
    """DeepSeek-V3's and GLM-4.5's router: float32 logits from a float32 weight, and the e_score_correction_bias
    that grouped_top_k adds to the scores for the choice. Both stay float32 in any serving dtype (transformers keeps
    them so): a bf16 bias would move which experts a token picks."""

    checkpoint_dtypes = True  # the loader keeps these float32 parameters' dtype

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(out_features, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class StackedExperts(nn.Module):
    """E experts' gated MLPs as two stacked weights (and biases, where the family has them); forward runs each
    expert on the tokens routed to it. `activation` maps the gate_up output [T, 2I] to [T, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul) -> None:
        super().__init__()
        # activation: on the fused gate|up output: SwiGLU, GeGLU (Gemma 4), or gpt-oss's clamped SwiGLU
        self.num_experts, self.intermediate_size, self.activation = num_experts, intermediate_size, activation
        self.hidden_size = hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
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
                        shards.update({f"experts.{e}.{name}": shard
                                       for name, shard in own(f"{prefix}.linears.{e}.{j}").items()})
            return shards
        n, shards = self.intermediate_size, {}
        for e in range(self.num_experts):
            shards[f"experts.{e}.gate_proj.weight"] = Shard(f"{prefix}.gate_up_proj", index=e, offset=0, size=n)
            shards[f"experts.{e}.up_proj.weight"] = Shard(f"{prefix}.gate_up_proj", index=e, offset=n, size=n)
            shards[f"experts.{e}.down_proj.weight"] = Shard(f"{prefix}.down_proj", index=e)
        return shards

    def swap_expert_linears(self, select: Callable[[nn.Linear], bool], make: Callable[[nn.Linear], nn.Module]
                            ) -> int:
        """Replaces the stacked weights by one module per expert projection, made from an nn.Linear view of
        it (how quantize_linears_int4 and pack_linears_for_cpu reach the experts); returns how many."""
        if self.linears is not None or not select(_linear(self.down_proj[0])):
            return 0
        self.use_expert_linears([(make(_linear(self.gate_up_proj[e])), make(_linear(self.down_proj[e])))
                                 for e in range(self.num_experts)])
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
            return "MoE experts held one module each (quantized or packed) run one matmul per expert with host-side counts"
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

    def run_sorted(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                   gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None) -> torch.Tensor:
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

    def _grouped(self, rows: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                 ) -> torch.Tensor:
        """rows [N, H] sorted by their expert ids `experts` [N]: two grouped matmuls, offsets found on the device."""
        bounds = torch.arange(1, self.num_experts + 1, device=rows.device, dtype=experts.dtype)
        offsets = torch.searchsorted(experts, bounds).to(torch.int32)  # end row of each expert's tokens
        h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias.index_select(0, experts)
        h = torch._grouped_mm(self.activation(h), down.transpose(1, 2), offs=offsets)
        return h if self.down_proj_bias is None else h + self.down_proj_bias.index_select(0, experts)

    def _per_expert(self, rows: torch.Tensor, flat: torch.Tensor, gate_up: torch.Tensor | None,
                    down: torch.Tensor | None) -> torch.Tensor:
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start : start + n] = self._expert(e, rows[start : start + n], gate_up, down)
                start += n
        return out

    def _expert(self, e: int, x: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor | None
                ) -> torch.Tensor:
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

    def __init__(self, routing: Routing, hidden_size: int, shared_expert: nn.Module | None = None,
                 experts: StackedExperts | None = None, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.routing = routing
        if routing.choice_bias:
            self.gate: ScoreLinear = BiasedChoiceRouter(hidden_size, routing.num_experts)
        else:
            self.gate = ScoreLinear(hidden_size, routing.num_experts, bias=routing.router_bias)
        self.experts = experts or StackedExperts(routing.num_experts, hidden_size, routing.intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = ScoreLinear(hidden_size, 1) if shared_expert is not None else None
        self.shared_experts = shared_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], routing weights [T, k] in x's dtype), as transformers computes them: a float32
        softmax over all experts, top-k, renormalised when norm_topk_prob; or DeepSeek's grouped_top_k."""
        r = self.routing
        if r.grouped:
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
