"""StackedExperts on CUDA: the grouped path (torch._grouped_mm, sm90 and later, bfloat16) against the per-expert
path on the same tensors, with and without biases (gpt-oss), and a decode-sized forward captured in a CUDA graph
and replayed on new routing."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers import moe
from engine.model.layers.moe import StackedExperts, grouped_mm_runs
from tests.gpu.conftest import replay_experts_on_new_routing

DT = torch.bfloat16


def experts(bias: bool) -> StackedExperts:
    torch.manual_seed(0)
    layer = StackedExperts(num_experts=8, hidden_size=256, intermediate_size=128, bias=bias).to("cuda", DT)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.05)
    return layer


def per_expert(layer: StackedExperts, *args) -> torch.Tensor:
    saved = moe.grouped_mm_runs
    moe.grouped_mm_runs = lambda device, dtype: False
    try:
        return layer(*args)
    finally:
        moe.grouped_mm_runs = saved


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(tokens, 8, device="cuda", generator=gen)
    weights, ids = scores.softmax(-1).topk(2, dim=-1)
    return ids, weights


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_grouped_experts_match_the_per_expert_path(bias, tokens):
    if not grouped_mm_runs(torch.device("cuda"), DT):
        pytest.skip("torch._grouped_mm needs sm90 or later for bfloat16")
    layer = experts(bias)
    x = torch.randn(tokens, 256, device="cuda", dtype=DT)
    ids, weights = routing(tokens, 1)
    torch.testing.assert_close(layer(x, ids, weights), per_expert(layer, x, ids, weights), atol=2e-2, rtol=2e-2)


def test_grouped_experts_replay_in_a_cuda_graph():
    if not grouped_mm_runs(torch.device("cuda"), DT):
        pytest.skip("torch._grouped_mm needs sm90 or later for bfloat16")
    layer = experts(False)
    x = torch.randn(16, 256, device="cuda", dtype=DT)
    ids, weights = routing(16, 2)
    out = replay_experts_on_new_routing(layer, x, ids, weights, *routing(16, 3))
    with torch.inference_mode():
        torch.testing.assert_close(out, per_expert(layer, x, ids, weights), atol=2e-2, rtol=2e-2)
