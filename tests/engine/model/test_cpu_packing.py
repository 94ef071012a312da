"""bf16 linears packed for oneDNN on the CPU: inline for a small model, on a thread of its own after load for a
large one (engine.model.layers.linear.PACK_IN_BACKGROUND_WEIGHTS), with the same logits once it is done, and a
model half packed (as a forward sees it while the thread runs) within bf16 rounding of a packed one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.model.layers.linear as linear
from engine.model.layers.linear import PackedLinear
from engine.model.loader import load_model
from tests.engine.model.family_parity import Pages

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU has no bf16 oneDNN: nothing is packed",
)
PROMPTS = [("a", [5, 9, 13, 2, 7, 40, 41]), ("b", [3, 4])]


def logits(model, spec) -> torch.Tensor:
    with torch.inference_mode():
        return Pages(spec.kv_groups, dtype=torch.bfloat16).run(model, PROMPTS).float()


def linears(model) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]


def test_a_small_model_is_packed_before_load_returns(tiny_model_path):
    model, _ = load_model(str(tiny_model_path), torch.bfloat16, CPU)
    assert model.cpu_packing.is_set()
    assert all(isinstance(m, PackedLinear) for m in linears(model))


def test_a_large_model_is_packed_after_load_to_the_same_logits(tiny_model_path, monkeypatch):
    inline, spec = load_model(str(tiny_model_path), torch.bfloat16, CPU)
    monkeypatch.setattr(linear, "PACK_IN_BACKGROUND_WEIGHTS", 0)
    late, _ = load_model(str(tiny_model_path), torch.bfloat16, CPU)
    assert late.cpu_packing.wait(timeout=300)
    assert all(isinstance(m, PackedLinear) for m in linears(late))
    assert torch.equal(logits(late, spec), logits(inline, spec))


def test_a_half_packed_model_runs_within_bf16_rounding(tiny_model_path, monkeypatch):
    packed, spec = load_model(str(tiny_model_path), torch.bfloat16, CPU)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    half, _ = load_model(str(tiny_model_path), torch.bfloat16, CPU)
    monkeypatch.undo()
    plain = [
        (parent, name, child)
        for parent in half.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    assert plain
    for parent, name, child in plain[::2]:
        setattr(parent, name, PackedLinear(child))
    want, got = logits(packed, spec), logits(half, spec)
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item(), rtol=0)
