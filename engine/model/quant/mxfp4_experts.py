"""MXFP4 mixture-of-experts checkpoints as the hub stores gpt-oss (`quant_method: mxfp4`): each expert stack's
`{proj}_blocks` [E, out, in / 32, 16] and `{proj}_scales` [E, out, in / 32] load as stored. Nothing else in such a
checkpoint is quantized (its modules_to_not_convert: attention, router, embeddings, lm_head).

On CUDA the experts stay packed (4.25 bits a weight: gpt-oss-120b's experts in about 61 GB instead of 230) and each
step dequantises only what it runs (engine/model/quant/mxfp4_packed.py). On the CPU they are dequantised once to the
serving dtype at load, as transformers does without its kernels: there, dequantising every step costs more than the
matmuls it feeds.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.errors import StartupError, UnsupportedModel
from engine.model.checkpoint import Source
from engine.model.layers.moe import StackedExperts
from engine.model.quant.base import QuantFormat
from engine.model.quant.mxfp4 import GROUP, dequantize_mxfp4
from engine.model.quant.mxfp4_packed import PROJECTIONS, PackedMxfp4

log = logging.getLogger(__name__)
# Devices whose experts stay MXFP4 in memory.
PACKED_DEVICES = ("cuda",)


class Mxfp4Experts(QuantFormat):
    """The format's hooks into the loader: experts hold blocks and scales while the checkpoint loads."""

    name = "mxfp4"

    def check_shard(self, args: object, size: int) -> None:
        """A rank holds whole blocks of 32: its columns of each expert's down_proj input must be a multiple of 32
        (gate|up is split by output rows, which cuts no block)."""
        width = args.routing.intermediate_size
        if width // size % GROUP:
            raise StartupError(
                f"tensor_parallel_size={size} would cut the experts' MXFP4 blocks of {GROUP}: their "
                f"{width} intermediate columns leave {width // size} to a rank",
                param="tensor_parallel_size",
            )

    def swap(self, model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> int:
        """Each expert stack whose checkpoint has `{proj}_blocks` holds uint8 blocks and scales instead of its
        float weight; returns how many stacks. UnsupportedModel when the checkpoint has none."""
        rename = getattr(model, "checkpoint_name", lambda n: n)
        ours = {rename(n) for n in shapes}
        swapped = 0
        for prefix, module in model.named_modules():
            if not isinstance(module, StackedExperts):
                continue
            kept = set()
            for proj in PROJECTIONS:
                if f"{prefix}.{proj}_blocks" not in ours:
                    continue
                experts, rows, cols = getattr(module, proj).shape
                if cols % GROUP:
                    raise UnsupportedModel(
                        f"mxfp4: {prefix}.{proj} has {cols} inputs, not a multiple of {GROUP}", param="model"
                    )
                delattr(module, proj)
                _block_sources(getattr(model, "checkpoint_sources", None), f"{prefix}.{proj}")
                for suffix, shape in (
                    ("blocks", (experts, rows, cols // GROUP, GROUP // 2)),
                    ("scales", (experts, rows, cols // GROUP)),
                ):
                    module.register_parameter(
                        f"{proj}_{suffix}",
                        nn.Parameter(torch.empty(shape, dtype=torch.uint8, device="meta"), requires_grad=False),
                    )
                    kept.add(f"{proj}_{suffix}")
            if kept:
                module.checkpoint_dtypes = frozenset(kept)  # the loader keeps these uint8
                swapped += 1
        if not swapped:
            raise UnsupportedModel(
                "quantization_config says mxfp4 but no expert stack has *_blocks tensors", param="model"
            )
        return swapped

    def serve(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        """On a PACKED_DEVICES device, each expert stack keeps its blocks and scales and runs through PackedMxfp4;
        elsewhere they become the float [E, out, in] weights the experts run, on the device they were loaded to."""
        stacks = [m for m in model.modules() if isinstance(m, StackedExperts) and getattr(m, "checkpoint_dtypes", None)]
        packed = device.type in PACKED_DEVICES
        for module in stacks:
            if packed:
                module.runner = PackedMxfp4(module, dtype)
                continue
            for proj in PROJECTIONS:
                blocks = getattr(module, f"{proj}_blocks", None)
                if blocks is None:
                    continue
                weight = dequantize_mxfp4(blocks, getattr(module, f"{proj}_scales"), dtype)
                delattr(module, f"{proj}_blocks")
                delattr(module, f"{proj}_scales")
                setattr(module, proj, nn.Parameter(weight, requires_grad=False))
            module.checkpoint_dtypes = frozenset()
        if packed and stacks:
            log.info(
                "MXFP4 experts (%d stacks) stay MXFP4 on %s: a step dequantises to %s the experts it routes to "
                "(all of them, %d at a time, from %d tokens x top-k up); no fused MXFP4 kernel is used",
                len(stacks),
                device.type,
                str(dtype).removeprefix("torch."),
                stacks[0].runner.chunk,
                stacks[0].num_experts,
            )
        else:
            log.info(
                "MXFP4 experts (%d stacks) dequantised to %s on %s at load (faster there than per step)",
                len(stacks),
                str(dtype).removeprefix("torch."),
                device.type,
            )


def read_mxfp4(qc: dict) -> Mxfp4Experts:
    return Mxfp4Experts()


def _block_sources(sources: dict[str, Source] | None, name: str) -> None:
    """A tensor-parallel shard's part of a float stack as the hub stores it ([E, in, out], gpt-oss) -> the same part
    of its blocks and scales ([E, out, in / 32, ...]): the output rows as they are, the inputs in whole blocks."""
    float_source = None if sources is None else sources.get(name)
    if float_source is None:
        return
    if float_source.dim == 2:
        part = Source(1, float_source.spans)
    else:
        part = Source(2, tuple((start // GROUP, n // GROUP) for start, n in float_source.spans))
    for suffix in ("blocks", "scales"):
        sources[f"{name}_{suffix}"] = part
