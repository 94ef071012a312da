"""A torch dispatch mode that fails on what CUDA graph capture refuses: host syncs (`.item()`, `.tolist()`,
`bool(tensor)`, which reach aten._local_scalar_dense) and ops whose output shape depends on tensor values
(nonzero, masked_select, unique, bincount, repeat_interleave without output_size). It runs on the CPU, so a
decode step can be held to capture's rules without a GPU."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Packets refused whatever their arguments.
REFUSED = {
    aten._local_scalar_dense: "a host sync (.item(), .tolist() or a Python branch on a tensor value)",
    aten.item: "a host sync (.item())",
    aten.is_nonzero: "a Python branch on a tensor value",
    aten.equal: "a host sync (torch.equal)",
    aten.nonzero: "an output shape that depends on tensor values (nonzero)",
    aten.masked_select: "an output shape that depends on tensor values (masked_select)",
    aten.bincount: "a host sync (bincount sizes its output from the largest value)",
    aten._unique2: "an output shape that depends on tensor values (unique)",
    aten.unique_dim: "an output shape that depends on tensor values (unique)",
    aten.unique_consecutive: "an output shape that depends on tensor values (unique_consecutive)",
}


class CaptureRefused(AssertionError):
    """An op that CUDA graph capture would refuse ran under CaptureGuard."""


class CaptureGuard(TorchDispatchMode):
    """Raises CaptureRefused on the first refused op; `seen` counts the ops that ran."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in REFUSED:
            raise CaptureRefused(f"{func}: {REFUSED[packet]}")
        if packet is aten.repeat_interleave and func._overloadname != "self_int" and kwargs.get("output_size") is None:
            raise CaptureRefused(f"{func}: repeat_interleave over a tensor of repeats without output_size")
        self.seen += 1
        return func(*args, **kwargs)
