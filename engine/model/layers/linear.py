"""Linear layers: several checkpoint matrices stacked in one (FusedLinear), and for CPU serving bf16 weights
pre-packed for oneDNN and weight-only int4 (GGUF Q4_1's layout)."""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
from typing import Any

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.checkpoint import Shard

log = logging.getLogger(__name__)
# Packing runs at about 200 M weights a second on two cores (14 s for a 3B model's linears), longer than reading
# them. Past this many weights the linears are packed on a thread of their own once the model is loaded, one at a
# time, while the first requests run on the plain bf16 weights (1.2-2.5x slower at batch 1, the same results up to
# bf16 rounding).
PACK_IN_BACKGROUND_WEIGHTS = 256 << 20


class FusedLinear(nn.Linear):
    """A Linear whose output rows are several checkpoint matrices stacked (q|k|v or gate|up)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def checkpoint_shards(self, prefix: str) -> dict[str, Shard]:
        """'q_proj.weight' (a sibling of this module in the checkpoint) -> rows of our stacked weight."""
        kinds = ("weight", "bias") if self.bias is not None else ("weight",)
        return {
            f"{name}.{kind}": Shard(param=f"{prefix}.{kind}", offset=offset, size=size)
            for name, (offset, size) in self.shard_offsets.items()
            for kind in kinds
        }


class PatchKernelLinear(nn.Linear):
    """A convolution whose kernel covers exactly the patch it reads (stride = kernel, a vision tower's patch
    embedding): one matrix over the flattened patch (channels outermost), held as a Linear so that a bf16 CPU packs
    it with the others; the checkpoint's kernel [out, in, *kernel] is loaded as its rows."""

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple[int, ...], bias: bool = True) -> None:
        super().__init__(in_channels * math.prod(kernel), out_channels, bias=bias)
        self.kernel_shape = (out_channels, in_channels, *kernel)

    def checkpoint_shards(self, prefix: str) -> dict[str, Shard]:
        name = prefix.rsplit(".", 1)[-1]
        shards = {f"{name}.weight": Shard(param=f"{prefix}.weight", shape=self.kernel_shape)}
        if self.bias is not None:
            shards[f"{name}.bias"] = Shard(param=f"{prefix}.bias")
        return shards


class PackedLinear(nn.Module):
    """A CPU bf16 Linear whose weight is pre-packed for oneDNN (AMX / AVX512-BF16).

    NOTE: a plain bf16 F.linear hands oneDNN the row-major weight, which it reorders on every call;
    at batch 1 that reorder costs more than the matmul itself.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # NOTE: packed for a batch of 64; on this kind of CPU that layout runs batch 1 no slower than a
        # batch-1 packing while larger batches avoid a re-layout per call (measured 1.3-1.5x faster steps).
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 64))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears_for_cpu(model: nn.Module) -> threading.Event:
    """Swaps every bf16 nn.Linear of a CPU model for a PackedLinear (none when the CPU has no bf16 oneDNN).
    Returns an event set once every linear is packed: at once, or, when the linears hold more than
    PACK_IN_BACKGROUND_WEIGHTS weights, by a daemon thread that swaps them one at a time in model order (each swap is
    one attribute assignment, so a forward running meanwhile sees either module whole). Stacked MoE experts change
    how their layer runs when packed, so they are always packed before this returns."""
    done = threading.Event()
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        done.set()
        return done
    stacked = sum(m.swap_expert_linears(_packable, PackedLinear) for m in _expert_stacks(model))
    targets = _linears(model, _packable)
    weights = sum(child.weight.numel() for _, _, child in targets)
    if weights <= PACK_IN_BACKGROUND_WEIGHTS:
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear(child))
        done.set()
        return done

    stop = threading.Event()

    def pack() -> None:
        started = time.perf_counter()
        try:
            for parent, name, child in targets:
                if stop.is_set():
                    return
                setattr(parent, name, PackedLinear(child))
            log.info(
                "packed %d bf16 linears (%d M weights) for oneDNN in %.1f s after load",
                len(targets),
                weights >> 20,
                time.perf_counter() - started,
            )
        finally:
            done.set()

    log.info(
        "packing %d bf16 linears (%d M weights, %d expert projections packed already) for oneDNN in the "
        "background: requests until it ends run on the unpacked weights",
        len(targets),
        weights >> 20,
        stacked,
    )
    thread = threading.Thread(target=pack, name="onednn-pack", daemon=True)
    thread.start()

    def end_at_exit() -> None:
        # NOTE: a daemon thread still inside a oneDNN call when the interpreter finalises aborts the process.
        stop.set()
        thread.join()

    atexit.register(end_at_exit)
    return done


# GGUF Q4_1's block: a 4-bit code per weight, and a scale and a minimum per 32 consecutive input weights.
INT4_GROUP = 32
# The group sizes torch's CPU int4 kernel takes.
INT4_KERNEL_GROUPS = (32, 64, 128, 256)


class Int4Linear(nn.Module):
    """Weight-only 4-bit Linear on CPU through torch's int4 kernel: per group of `group` inputs,
    w = (code - 8) * scale + zero (codes 0..15).

    from_linear() quantizes a float Linear in GGUF Q4_1's layout; engine.model.quant repacks AWQ, GPTQ and
    compressed-tensors checkpoints into this one (their w = (code - z) * s is zero = (8 - z) * s here).
    """

    def __init__(
        self,
        *,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        n, k = codes.shape
        if n % 16 or k % group or group not in INT4_KERNEL_GROUPS:
            raise UnsupportedModel(
                f"int4 needs layers whose output size is a multiple of 16 and input size a multiple of the group "
                f"({', '.join(map(str, INT4_KERNEL_GROUPS))}); this model has a {k} -> {n} layer in groups of {group}",
                param="quantization",
            )
        self.in_features, self.out_features, self.group = k, n, group
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        # The kernel reads [k / group, n, 2] (scale, zero) in the activation dtype.
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> Int4Linear:
        """Q4_1's quantizer: per group of 32 inputs, the smallest weight at code 0 and the largest at code 15.

        NOTE: so the weights of a checkpoint dequantized from Q4_1 (the default model) come back as exactly
        their original codes, and int4 serves that model as it was published rather than approximating it.
        """
        w = linear.weight.detach().float()
        n, k = w.shape
        if k % INT4_GROUP:
            raise UnsupportedModel(
                f"int4 needs layers whose output size is a multiple of 16 and input size a multiple of "
                f"{INT4_GROUP}; this model has a {k} -> {n} layer",
                param="quantization",
            )
        groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
        codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32).view(n, k)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(codes=codes, scale=scale, zero=low + 8 * scale, group=INT4_GROUP, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)
        return y if self.bias is None else y.add_(self.bias)


def quantize_linears_int4(model: nn.Module, dtype: torch.dtype) -> int:
    """Swaps the nn.Linear layers under `model` for Int4Linear; returns how many."""
    return _swap_linears(model, lambda child: True, lambda child: Int4Linear.from_linear(child, dtype))


def _packable(linear: nn.Linear) -> bool:
    return linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu"


def _linears(model: nn.Module, select) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of every nn.Linear under `model` that `select` takes."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and select(child)
    ]


def _swap_linears(model: nn.Module, select, make) -> int:
    targets = _linears(model, select)
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    # Modules that stack linears (MoE experts) swap each of theirs the same way.
    return len(targets) + sum(m.swap_expert_linears(select, make) for m in _expert_stacks(model))


def _expert_stacks(model: nn.Module) -> list[Any]:
    """The modules that stack linears (MoE experts), each with its own `swap_expert_linears(select, make)`."""
    return [m for m in model.modules() if hasattr(m, "swap_expert_linears")]
