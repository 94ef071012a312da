"""DeepSeek-style routing in the MoE layer held to transformers' own router modules on scores chosen to be hard: ties
(within and across groups), a group that holds the best single expert but loses on its two best, a correction bias
that changes the choice but not the weights, and many random tokens. GLM-4.5's router (sigmoid, noaux_tc) and
DeepSeek-V2's (softmax, group_limited_greedy); the config read by read_grouped_routing as the families read it."""

from __future__ import annotations

import pytest
import torch

from engine.errors import UnsupportedModel
from engine.model.layers.moe import SparseMoE
from engine.model.layers.routing import read_grouped_routing

SIGMOID, SOFTMAX = ("sigmoid", "noaux_tc"), ("softmax", "group_limited_greedy")


def routers(
    scheme: tuple[str, str],
    *,
    experts: int,
    top_k: int,
    groups: int,
    kept: int,
    norm: bool = True,
    scale: float = 2.5,
    bias: torch.Tensor | None = None,
) -> tuple[torch.nn.Module, SparseMoE]:
    """transformers' router and our SparseMoE over the same config, each router weight the identity (hidden size =
    experts), so that a hidden state is the router logits it gives."""
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    shape = dict(
        hidden_size=experts,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=kept,
        routed_scaling_factor=scale,
        moe_intermediate_size=8,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    scoring, method = scheme
    if scheme == SIGMOID:
        config = tf.Glm4MoeConfig(**shape, norm_topk_prob=norm)
        theirs = Glm4MoeTopkRouter(config)
    else:
        config = tf.DeepseekV2Config(**shape, topk_method=method, norm_topk_prob=False)
        theirs = DeepseekV2TopkRouter(config)
    routing = read_grouped_routing(config.to_dict(), scoring=scoring, topk_method=method, norm_topk_prob=norm)
    ours = SparseMoE(routing=routing, hidden_size=experts)
    with torch.no_grad():
        for router in (theirs, ours.gate):
            router.weight.copy_(torch.eye(experts))
        if routing.choice_bias:
            bias = torch.zeros(experts) if bias is None else bias
            theirs.e_score_correction_bias.copy_(bias)
            ours.gate.e_score_correction_bias.copy_(bias)
    return theirs, ours


def choices(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts in ascending order, with their weights (the order top-k lists them in is not
    part of the result)."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def route_both(
    theirs: torch.nn.Module, ours: SparseMoE, logits: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        _, their_weights, their_ids = theirs(logits)
        our_ids, our_weights = ours.route(logits)
    return choices(their_ids, their_weights), choices(our_ids, our_weights)


def assert_same_choice(theirs: torch.nn.Module, ours: SparseMoE, logits: torch.Tensor) -> torch.Tensor:
    """Both routers choose the same experts with the same weights for every token; returns the chosen ids."""
    (their_ids, their_weights), (our_ids, our_weights) = route_both(theirs, ours, logits)
    assert torch.equal(our_ids, their_ids)
    torch.testing.assert_close(our_weights, their_weights, atol=0, rtol=1e-6)
    return our_ids


@pytest.mark.parametrize("scheme", [SIGMOID, SOFTMAX])
def test_ties_fall_as_in_transformers(scheme):
    """Every score equal, groups tied on their scores, and ties straddling the k-th place."""
    theirs, ours = routers(scheme, experts=8, top_k=3, groups=4, kept=2)
    logits = torch.tensor(
        [
            [0.0] * 8,
            [1.0] * 8,
            [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0],
            [2.0, 0.5, 0.5, 2.0, 0.5, 0.5, 0.5, 0.5],
            [0.0, 3.0, 3.0, 0.0, 3.0, 0.0, 0.0, 3.0],
        ]
    )
    assert_same_choice(theirs, ours, logits)


@pytest.mark.parametrize("scheme", [SIGMOID, SOFTMAX])
def test_many_random_tokens_route_as_in_transformers(scheme):
    gen = torch.Generator().manual_seed(0)
    for groups, kept, top_k in ((1, 1, 4), (4, 2, 3), (8, 3, 2), (2, 1, 1)):
        bias = torch.randn(16, generator=gen) * 0.3
        theirs, ours = routers(scheme, experts=16, top_k=top_k, groups=groups, kept=kept, bias=bias)
        assert_same_choice(theirs, ours, torch.randn(64, 16, generator=gen) * 2)


def test_a_group_holding_the_best_expert_is_dropped_when_its_two_best_sum_lower():
    """noaux_tc ranks groups by their two best scores: group 0 holds the best expert (0.95) but sums 1.0 against
    groups 1 and 2's 1.2 and 1.1, so none of its experts is chosen."""
    theirs, ours = routers(SIGMOID, experts=8, top_k=2, groups=4, kept=2)
    scores = torch.tensor([[0.95, 0.05, 0.6, 0.6, 0.55, 0.55, 0.1, 0.1]])
    ids = assert_same_choice(theirs, ours, torch.logit(scores))
    assert set(ids[0].tolist()) <= {2, 3, 4, 5} and 0 not in ids[0].tolist()


def test_group_limited_greedy_ranks_groups_by_their_best_expert():
    """DeepSeek-V2 ranks groups by their best softmax score: group 0's lone best expert keeps it, group 1's two
    seconds do not."""
    theirs, ours = routers(SOFTMAX, experts=8, top_k=2, groups=4, kept=2)
    logits = torch.tensor([[3.0, -2.0, 2.0, 2.0, 2.5, -2.0, -2.0, -2.0]])
    ids = assert_same_choice(theirs, ours, logits)
    assert ids[0].tolist() == [0, 4]


def test_the_correction_bias_changes_the_choice_not_the_weights():
    """Expert 3's bias lifts it over expert 1 in the choice; its weight is its own unbiased score, renormalised
    with expert 0's and scaled."""
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    theirs, ours = routers(SIGMOID, experts=8, top_k=2, groups=1, kept=1, scale=2.5, bias=bias)
    scores = torch.tensor([[0.9, 0.8, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1]])
    ids = assert_same_choice(theirs, ours, torch.logit(scores))
    assert ids[0].tolist() == [0, 3]
    _, weights = choices(*ours.route(torch.logit(scores)))
    torch.testing.assert_close(weights[0], torch.tensor([0.9, 0.2]) / 1.1 * 2.5)
    with torch.no_grad():
        ours.gate.e_score_correction_bias.zero_()
    assert choices(*ours.route(torch.logit(scores)))[0][0].tolist() == [0, 1]


def test_routing_runs_in_float32_in_a_bf16_model():
    """The router's weight and bias stay float32 and the weights come back in the activations' dtype."""
    theirs, ours = routers(SIGMOID, experts=8, top_k=2, groups=4, kept=2)
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    ids, weights = ours.route(logits.bfloat16())
    assert ours.gate.weight.dtype == ours.gate.e_score_correction_bias.dtype == torch.float32
    assert weights.dtype == torch.bfloat16
    assert torch.equal(choices(ids, weights)[0], route_both(theirs, ours, logits.bfloat16().float())[0][0])


@pytest.mark.parametrize(
    "change,named",
    [
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (dict(topk_method="greedy"), "topk_method='greedy'"),
        (dict(n_group=3), "n_group=3"),
        (dict(n_group=2, topk_group=3), "topk_group=3"),
        (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok=3"),
    ],
)
def test_a_routing_the_family_does_not_run_is_refused_in_one_line(change, named):
    config = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8, **change}
    with pytest.raises(UnsupportedModel, match=named) as err:
        read_grouped_routing(config, scoring="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
    assert "\n" not in str(err.value)
