"""EAGLE-3 proposes: a draft head (engine/model/models/eagle3.py) reads the target's hidden states entering three of
its layers and guesses k tokens (engine/core/spec/head.py runs it); each of its own steps is fed its previous row's
pre-norm output."""

from __future__ import annotations

import logging

import torch

from engine.config import SpeculativeConfig
from engine.core.scheduling.step import StepResult
from engine.core.spec.head import HeadProposer
from engine.core.spec.proposer import Target
from engine.errors import StartupError
from engine.model.models.eagle3 import load_eagle3_head

log = logging.getLogger(__name__)


class Eagle3Proposer(HeadProposer):
    """vLLM's "eagle3" method: SpeculativeConfig.model is the head's folder."""

    name = "eagle3"

    def __init__(self, config: SpeculativeConfig, target: Target) -> None:
        if not hasattr(target.model, "aux_layers"):
            raise StartupError(
                f"EAGLE-3 heads run on the Llama-family decoders (Llama, Qwen2/3 and their MoEs), "
                f"not on {type(target.model).__name__}",
                param="speculative.method",
            )
        assert config.model is not None, "check_config: eagle3 names its head"
        self.path = config.model
        head, layers = load_eagle3_head(config.model, target.model, target.dtype, target.device)
        target.model.aux_layers = layers
        num_pages = config.draft_kv_pages or target.num_pages
        self.start(head, head.args, config.num_speculative_tokens, num_pages, target)
        log.info(
            "EAGLE-3 head %s: reads layers %s, %d KV pages of %d tokens",
            config.model,
            list(layers),
            num_pages,
            target.page_size,
        )

    def features(self, result: StepResult) -> torch.Tensor | None:
        return result.aux_hidden

    def describe(self) -> dict:
        return {"model": self.path}
