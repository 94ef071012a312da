"""The engine's speculator from its SpeculativeConfig, or None (with the reason said once at start-up)."""

from __future__ import annotations

import logging

from engine.config import SpeculativeConfig
from engine.core.scheduling.step import SchedulerOutput, StepResult
from engine.core.spec.ngram import NgramProposer
from engine.core.spec.proposer import Proposer, Target
from engine.core.spec.speculator import Speculator
from engine.errors import StartupError

log = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
# The methods whose proposer is a model of its own, in SpeculativeConfig.model.
MODEL_METHODS = {"draft_model": "the draft's folder", "eagle3": "the EAGLE-3 head's folder"}


def check_config(config: SpeculativeConfig) -> None:
    """StartupError (one line, naming the field) for a configuration no proposer can run."""
    if config.method not in METHODS:
        raise StartupError(
            f"speculative method {config.method!r} is not one of {', '.join(METHODS)}", param="speculative.method"
        )
    if config.num_speculative_tokens < 1:
        raise StartupError("num_speculative_tokens must be at least 1", param="speculative.num_speculative_tokens")
    if config.method == "ngram" and not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
        raise StartupError(
            "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max",
            param="speculative.prompt_lookup_min",
        )
    if config.method in MODEL_METHODS and not config.model:
        raise StartupError(
            f"the {config.method} method needs {MODEL_METHODS[config.method]} as `model`", param="speculative.model"
        )


def reads_final_hidden(config: SpeculativeConfig | None) -> bool:
    """Whether the method's proposer reads the target's final hidden states, which the model runner then hands on
    (StepResult.hidden): MTP's head does; EAGLE-3's reads the aux states the model keeps itself."""
    return config is not None and config.method == "mtp"


def build_speculator(config: SpeculativeConfig | None, target: Target) -> Speculator | None:
    if config is None:
        return None
    check_config(config)
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "eagle3":
        from engine.core.spec.eagle3 import Eagle3Proposer

        proposer = Eagle3Proposer(config, target)
    elif config.method == "mtp":
        from engine.core.spec.mtp import MtpProposer

        proposer = MtpProposer(config, target)
    else:
        from engine.core.spec.draft import DraftModelProposer

        proposer = DraftModelProposer(config, target)
    log.info(
        "speculative decoding: %s, up to %d tokens per step, off above %d decoding sequences",
        proposer.name,
        config.num_speculative_tokens,
        config.disable_by_batch_size,
    )
    return Speculator(config, proposer, target.max_model_len)


def accepted_counts(out: SchedulerOutput, result: StepResult) -> tuple[list[int], list[int]]:
    """(proposal length, proposals accepted) of each speculating sequence that the step verified."""
    proposed, accepted = [], []
    for i, s in enumerate(out.scheduled):
        if s.draft and i in result.samples:
            proposed.append(len(s.draft))
            accepted.append(len(result.samples[i]) - 1)
    return proposed, accepted
