"""The vision towers' bfloat16 check, shared by the families' parity tests: our tower loaded in bfloat16 as a bf16
CPU serves it (its linears packed for oneDNN, their GELU, gate and residual steps fused into the matmuls) against
transformers' float32 tower on the same weights, held to transformers' own bfloat16 run of it: a random tiny tower
amplifies rounding (transformers' bf16 features are a few percent off its float32 ones), so a fixed bound would
test rounding, not the code."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.model.layers.linear import PackedLinear
from engine.model.loader import load_model

# ours may be this much further from float32 than transformers' own bfloat16 run is (rounding at other places)
MARGIN = 1.5


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    a = torch.cat([t.float().flatten() for t in got])
    b = torch.cat([t.float().flatten() for t in want])
    return ((a - b).norm() / b.norm()).item()


def bf16_tower(path: Path, tower: str) -> nn.Module:
    """The checkpoint loaded in bfloat16 on the CPU; where the CPU packs bf16 linears, every linear of `tower` (the
    attribute holding it) is packed, so that the check covers the fused path."""
    model, _ = load_model(str(path), torch.bfloat16, torch.device("cpu"))
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert model.cpu_packing.wait(timeout=300)
        kinds = {type(m) for m in getattr(model, tower).modules() if isinstance(m, (nn.Linear, PackedLinear))}
        assert kinds == {PackedLinear}, kinds
    return model


def check_bf16_tower(ours: list[torch.Tensor], hf: nn.Module, features: Callable, inputs: dict) -> tuple[float, float]:
    """ours: our bfloat16 tower's features; features(hf_model, inputs) -> transformers' per-image features.
    Asserts ours is within MARGIN of transformers' bfloat16 error from its float32 features; returns both errors."""
    with torch.no_grad():
        want = features(hf, inputs)
        half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
        theirs = features(copy.deepcopy(hf).to(torch.bfloat16), half)
    assert all(t.dtype == torch.bfloat16 for t in ours)
    error, reference = relative_error(ours, want), relative_error(theirs, want)
    assert error < MARGIN * reference, (error, reference)
    return error, reference
