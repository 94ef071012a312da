"""How a mixture-of-experts layer picks each token's experts and weighs them: the family's Routing, read from its
config, and the two schemes the MoE layer runs (moe.py). A softmax over all experts and its top k (Qwen, Mixtral,
OLMoE, gpt-oss, Gemma 4); DeepSeek's (grouped_top_k, DeepSeek-V3 / GLM-4.5): sigmoid or softmax scores, a correction
bias that steers the choice but not the weights, top-k within the best expert groups, and a scaling factor on the
routed experts' weights; Phi-3.5-MoE's sparsemixer (two experts, each weighed by a softmax over the scores near its
own). All are capture-safe: fixed shapes, no host sync. The routers are ScoreLinear projections,
left in float by int4, LoRA and the quantized formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModel

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
SPARSEMIXER = "sparsemixer"  # Routing.scoring of Phi-3.5-MoE (sparsemixer_top2)


@dataclass(frozen=True, kw_only=True)
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
    jitter_eps: float = 0.0  # sparsemixer: the relative distance from the best score within which experts compete

    @property
    def grouped(self) -> bool:
        """Whether DeepSeek's routing (grouped_top_k) runs rather than a softmax top-k."""
        return (
            self.scoring == "sigmoid" or self.group_score is not None or self.choice_bias or self.scaling_factor != 1.0
        )


def check_routing(config: dict) -> None:
    """UnsupportedModel naming the config key of a routing scheme the softmax top-k families do not run."""
    for key, allowed in UNSUPPORTED_ROUTING.items():
        if config.get(key) not in allowed:
            raise UnsupportedModel(
                f"MoE routing {key}={config[key]!r} is not supported (softmax top-k only)", param="model"
            )


def read_grouped_routing(config: dict, *, scoring: str, topk_method: str, norm_topk_prob: bool) -> Routing:
    """DeepSeek-style Routing from a config (n_routed_experts, moe_intermediate_size, n_group, topk_group,
    routed_scaling_factor, n_shared_experts). `scoring`, `topk_method` and `norm_topk_prob` are what the family's
    reference runs where the config leaves the key out; a config key that says otherwise than a reference which
    ignores it (GLM-4.5's router is always sigmoid, noaux_tc) is refused in one line rather than half-served."""
    for key, runs, allowed in (("scoring_func", scoring, SCORING_FUNCS), ("topk_method", topk_method, GROUP_SCORES)):
        if runs not in allowed or config.get(key, runs) != runs:
            raise UnsupportedModel(
                f"MoE routing {key}={config.get(key, runs)!r} is not supported (this family's "
                f"router runs {key}={runs!r})",
                param="model",
            )
    num_experts = config.get("n_routed_experts") or config.get("num_local_experts")
    if not num_experts:
        raise KeyError("n_routed_experts")
    top_k, groups, kept = config["num_experts_per_tok"], config.get("n_group") or 1, config.get("topk_group") or 1
    if num_experts % groups or not 0 < kept <= groups:
        raise UnsupportedModel(
            f"MoE routing n_group={groups}, topk_group={kept} does not split {num_experts} "
            "experts into groups of which some are kept",
            param="model",
        )
    group_score = GROUP_SCORES[topk_method]
    if group_score == "top2_sum" and groups > 1 and num_experts // groups < 2:
        raise UnsupportedModel(
            f"MoE routing noaux_tc scores groups by their two best experts; n_group={groups} "
            f"leaves {num_experts // groups} per group",
            param="model",
        )
    if not 0 < top_k <= (num_experts // groups) * kept:
        raise UnsupportedModel(
            f"num_experts_per_tok={top_k} must be in 1..{(num_experts // groups) * kept} (the "
            "experts of the kept groups)",
            param="model",
        )
    width = config["moe_intermediate_size"]
    return Routing(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        norm_topk_prob=bool(config.get("norm_topk_prob", norm_topk_prob)),
        shared_expert_size=(config.get("n_shared_experts") or 0) * width,
        scoring=scoring,
        group_score=group_score,
        num_groups=groups,
        top_k_groups=kept,
        choice_bias=topk_method == "noaux_tc",
        scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
    )


def softmax_top_k(scores: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], float32 weights [T, k]): a float32 softmax over all experts' scores, its top k,
    renormalised to sum to 1 when `renormalize`."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return ids, weights


def grouped_top_k(
    logits: torch.Tensor, routing: Routing, choice_bias: torch.Tensor | None = None
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


def sparsemixer_top2(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, 2], float32 weights [T, 2]) as Phi-3.5-MoE's sparsemixer routes at inference: the best
    expert, weighed by its share of a softmax over the experts whose scores lie within 2 * jitter_eps (relative to
    the larger magnitude) of it; then the best of the others, weighed alike among the others near it. Unlike a
    top-k softmax the two weights need not sum to 1."""
    scores = logits.float()
    first = scores.argmax(dim=-1, keepdim=True)
    rest = scores.scatter(-1, first, float("-inf"))
    second = rest.argmax(dim=-1, keepdim=True)
    weights = []
    for candidates, best in ((scores, first), (rest, second)):
        top = candidates.gather(-1, best)
        far = (top - scores) / scores.abs().clamp(min=top) > 2 * jitter_eps
        weights.append(torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1).gather(-1, best))
    return torch.cat((first, second), dim=-1), torch.cat(weights, dim=-1)


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
