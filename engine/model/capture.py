"""Whether a loaded model's decode step can be captured in a CUDA graph: a module that cannot (it needs a host
sync or a shape that depends on tensor values) has a capture_blocker(device, dtype) that says why."""

from __future__ import annotations

import torch
from torch import nn


def capture_blocker(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """The first reason a module of `model` gives for not being capturable; None: every module can be."""
    for module in model.modules():
        ask = getattr(module, "capture_blocker", None)
        reason = ask(device, dtype) if ask is not None and module is not model else None
        if reason is not None:
            return reason
    return None
