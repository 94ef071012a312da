"""RMSNorm's CPU path is bit-identical to transformers' LlamaRMSNorm, in float32 and in half precision."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.model.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rmsnorm_matches_transformers_bit_for_bit(dtype, rows) -> None:
    torch.manual_seed(rows)
    ours, theirs = RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
    weight = 1 + 0.3 * torch.randn(576)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (3 * torch.randn(rows, 576)).to(dtype)
    assert torch.equal(ours(x.clone()), theirs(x.clone()))
    residual = torch.randn(rows, 576).to(dtype)
    normed, summed = ours.add_forward(x.clone(), residual.clone())
    assert torch.equal(summed, x + residual) and torch.equal(normed, theirs(x + residual))
