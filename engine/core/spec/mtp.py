"""MTP proposes: the multi-token-prediction head a Qwen3.5 / Qwen3-Next checkpoint ships (mtp.*, the model
engine/model/models/qwen3_5_mtp.py) reads the target's final hidden states and guesses k tokens, run by
engine/core/spec/head.py as an EAGLE-3 head is; each of its own steps is fed its previous row's normed output.
The head is read from the target's own folder: there is nothing else to fetch or bake."""

from __future__ import annotations

import logging

import torch

from engine.config import SpeculativeConfig
from engine.core.scheduling.step import StepResult
from engine.core.spec.head import HeadProposer
from engine.core.spec.proposer import Target
from engine.errors import StartupError
from engine.model.checkpoint import safetensors_files, tensor_shapes
from engine.model.loader import load_part
from engine.model.models.qwen3_5_mtp import PREFIX, MtpHead, has_experts, head_args

log = logging.getLogger(__name__)


def mtp_tensor_names(model_path: str) -> set[str]:
    """The checkpoint's mtp.* tensor names, from its files' headers."""
    return {name for name in tensor_shapes(safetensors_files(model_path)) if name.startswith(PREFIX)}


class MtpProposer(HeadProposer):
    """vLLM's "mtp" method for Qwen3.5 / Qwen3-Next: num_speculative_tokens steps of the checkpoint's MTP head."""

    name = "mtp"

    def __init__(self, config: SpeculativeConfig, target: Target) -> None:
        model = target.model
        names = mtp_tensor_names(target.model_path)
        if not hasattr(model, "recurrent_spec") or f"{PREFIX}fc.weight" not in names:
            raise StartupError(
                f"speculative method mtp needs the multi-token-prediction weights (mtp.*) that "
                f"Qwen3.5 and Qwen3-Next checkpoints ship; the model at {target.model_path} has none",
                param="speculative.method",
            )
        experts = has_experts(names)
        if experts and model.args.routing is None:
            raise StartupError("the model's MTP layer has experts but the model has none", param="speculative.method")
        args = head_args(model.args, experts)
        with torch.device("meta"):
            head = MtpHead(args, model)
        load_part(head, target.model_path, PREFIX, target.dtype, target.device)
        head.eval().requires_grad_(False)
        num_pages = config.draft_kv_pages or target.num_pages
        self.start(head, args, config.num_speculative_tokens, num_pages, target)
        log.info(
            "MTP head of %s: one %s layer, %d KV pages of %d tokens",
            target.model_path,
            "MoE" if experts else "dense",
            num_pages,
            target.page_size,
        )

    def features(self, result: StepResult) -> torch.Tensor | None:
        return result.hidden

    def describe(self) -> dict:
        return {}
