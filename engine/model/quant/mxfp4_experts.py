"""MXFP4 mixture-of-experts checkpoints as the hub stores gpt-oss (`quant_method: mxfp4`): each expert stack's
`{proj}_blocks` [E, out, in / 32, 16] and `{proj}_scales` [E, out, in / 32] load as stored, then are dequantised
once to the serving dtype on the serving device, as transformers does without its kernels. Nothing else in such a
checkpoint is quantized (its modules_to_not_convert: attention, router, embeddings, lm_head).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.moe import StackedExperts
from engine.model.quant.base import QuantFormat
from engine.model.quant.mxfp4 import GROUP, dequantize_mxfp4

log = logging.getLogger(__name__)
PROJECTIONS = ("gate_up_proj", "down_proj")


class Mxfp4Experts(QuantFormat):
    """The format's hooks into the loader: experts hold blocks and scales while the checkpoint loads."""

    name = "mxfp4"

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
                    raise UnsupportedModel(f"mxfp4: {prefix}.{proj} has {cols} inputs, not a multiple of {GROUP}",
                                           param="model")
                delattr(module, proj)
                for suffix, shape in (("blocks", (experts, rows, cols // GROUP, GROUP // 2)),
                                      ("scales", (experts, rows, cols // GROUP))):
                    module.register_parameter(f"{proj}_{suffix}", nn.Parameter(
                        torch.empty(shape, dtype=torch.uint8, device="meta"), requires_grad=False))
                    kept.add(f"{proj}_{suffix}")
            if kept:
                module.checkpoint_dtypes = frozenset(kept)  # the loader keeps these uint8
                swapped += 1
        if not swapped:
            raise UnsupportedModel("quantization_config says mxfp4 but no expert stack has *_blocks tensors",
                                   param="model")
        return swapped

    def serve(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        """Blocks and scales -> the float [E, out, in] weights the experts run, on the device they were loaded to."""
        stacks = 0
        for module in model.modules():
            if not isinstance(module, StackedExperts) or not getattr(module, "checkpoint_dtypes", None):
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
            stacks += 1
        log.info("MXFP4 experts (%d stacks) dequantised to %s on %s at load: no MXFP4 kernel is used yet",
                 stacks, str(dtype).removeprefix("torch."), device.type)


def read_mxfp4(qc: dict) -> Mxfp4Experts:
    return Mxfp4Experts()
