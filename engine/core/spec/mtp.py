"""MTP proposes: the multi-token-prediction head a checkpoint ships reads the target's final hidden states and guesses
k tokens, run by engine/core/spec/head.py as an EAGLE-3 head is; each of its own steps is fed its previous row's
output. Two layouts: Qwen3.5 / Qwen3-Next's mtp.* (engine/model/models/qwen3_5_mtp.py), and the next-n layer that
DeepSeek-V3 / R1 and GLM-4.5 / 4.6 / 4.7 / 4.7-Flash store as model.layers.{num_hidden_layers}
(engine/model/models/next_n_mtp.py). The head is read from the target's own folder: there is nothing else to fetch
or bake."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.config import SpeculativeConfig
from engine.core.scheduling.step import StepResult
from engine.core.spec.head import HeadProposer
from engine.core.spec.proposer import Target
from engine.errors import StartupError
from engine.model.checkpoint import safetensors_files, tensor_shapes
from engine.model.loader import load_part, read_config
from engine.model.models.next_n_mtp import NextNHead, next_n_head, next_n_prefix
from engine.model.models.qwen3_5_mtp import PREFIX, MtpHead, has_experts, head_args

log = logging.getLogger(__name__)


def checkpoint_names(model_path: str) -> set[str]:
    """The checkpoint's tensor names, from its files' headers."""
    return set(tensor_shapes(safetensors_files(model_path)))


class MtpProposer(HeadProposer):
    """vLLM's "mtp" method: num_speculative_tokens steps of the checkpoint's MTP head."""

    name = "mtp"

    def __init__(self, config: SpeculativeConfig, target: Target) -> None:
        model, names = target.model, checkpoint_names(target.model_path)
        head: MtpHead | NextNHead
        refusal = getattr(model, "mtp_refusal", None)  # a family whose MTP layers the engine does not build
        if refusal is not None:
            raise StartupError(f"speculative method mtp: {refusal}", param="speculative.method")
        if not hasattr(model, "recurrent_spec"):  # DeepSeek and GLM: the next-n layer
            head, prefix = self._next_n_head(model, names, target.model_path), next_n_prefix(model.args.num_layers)
        elif f"{PREFIX}fc.weight" in names:
            head, prefix = self._qwen_head(model, names), PREFIX
        else:
            raise StartupError(
                f"speculative method mtp needs the multi-token-prediction weights (mtp.*) that "
                f"Qwen3.5 and Qwen3-Next checkpoints ship; the model at {target.model_path} has none",
                param="speculative.method",
            )
        load_part(head, target.model_path, prefix, target.dtype, target.device)
        head.eval().requires_grad_(False)
        if isinstance(head, NextNHead):
            head.share_kernels()
        num_pages = config.draft_kv_pages or target.num_pages
        self.start(head, head.args, config.num_speculative_tokens, num_pages, target)
        log.info(
            "MTP head of %s (%s): %d KV pages of %d tokens", target.model_path, prefix, num_pages, target.page_size
        )

    @staticmethod
    def _qwen_head(model: Any, names: set[str]) -> MtpHead:
        experts = has_experts(names)
        if experts and model.args.routing is None:
            raise StartupError("the model's MTP layer has experts but the model has none", param="speculative.method")
        with torch.device("meta"):
            return MtpHead(head_args(model.args, experts), model)

    @staticmethod
    def _next_n_head(model: Any, names: set[str], model_path: str) -> NextNHead:
        layers = read_config(model_path).get("num_nextn_predict_layers") or 1
        if layers > 1:
            log.warning("num_nextn_predict_layers=%d: the first next-n layer makes every guess", layers)
        with torch.device("meta"):
            return next_n_head(model, names)

    def features(self, result: StepResult) -> torch.Tensor | None:
        return result.hidden

    def describe(self) -> dict:
        return {}
