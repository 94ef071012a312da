"""A request on its way in: checked once, at the edge, against the engine's limits (`check_request`), then made
into a SequenceGroup with one Sequence per choice, or one for the first beam (`build_group`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from engine.core.images.intake import ImageSpan
from engine.core.kv.cache import adapter_salt
from engine.core.output.pooling import PoolingParams
from engine.core.output.state import OutputState
from engine.core.scheduling.sequence import Sequence, SequenceGroup
from engine.errors import ContextTooLong, InvalidRequest
from engine.sample.beam_search import BeamSearch
from engine.sample.logits_processor import tokenize_bad_words
from engine.sample.params import SamplingParams
from engine.sample.penalties import PenaltyCounts, has_penalty
from engine.text.detokenizer import Detokenizer


@dataclass(kw_only=True)
class Limits:
    """What a request is checked against."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    adapters: dict[str, int]  # LoRA adapter name -> slot
    hidden_size: int = 0  # an embedding's full size
    adapter_keys: dict[str, str] = field(default_factory=dict)  # name -> the seed of its prefix-cache hashes


@dataclass
class PreparedRequest:
    """A checked request: the prompt as it will run, its parameters and its grammar's compile (submitted once)."""

    prompt: list[int]
    params: SamplingParams | PoolingParams
    grammar: Future | None = None
    images: list[ImageSpan] = field(default_factory=list)


def check_request(prompt_token_ids: list[int], params: SamplingParams | PoolingParams, limits: Limits) -> list[int]:
    """The prompt as it will run (after truncate_prompt_tokens); raises InvalidRequest / ContextTooLong."""
    if isinstance(params, PoolingParams):
        return check_pooling(prompt_token_ids, params, limits)
    if not isinstance(params, SamplingParams):
        raise InvalidRequest("params must be SamplingParams", param="sampling_params")
    if params.adapter is not None and params.adapter not in limits.adapters:
        raise InvalidRequest(f"unknown LoRA adapter {params.adapter!r}", param="model")
    prompt = _checked_tokens(prompt_token_ids, params.truncate_prompt_tokens, limits)
    params.check_vocab(limits.vocab_size)
    limit = limits.max_model_len
    if len(prompt) >= limit:
        raise ContextTooLong(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {len(prompt)} tokens, leaving no room for the completion.",
            param="prompt",
        )
    if params.max_tokens is not None and len(prompt) + params.max_tokens > limit:
        raise ContextTooLong(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the prompt, {params.max_tokens} in "
            "the completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens",
        )
    width = params.num_sequences
    if width > min(limits.max_num_seqs, limits.max_num_batched_tokens):
        raise InvalidRequest(
            f"{width} sequences per request exceed this engine's max_num_seqs ({limits.max_num_seqs})",
            param="best_of" if params.best_of else "n",
        )
    return prompt


def check_pooling(prompt_token_ids: list[int], params: PoolingParams, limits: Limits) -> list[int]:
    """An embedding request's prompt as it will run: it may fill the whole context (nothing follows it)."""
    config, dims = params.config, params.dimensions
    if dims is not None:
        if not config.matryoshka:
            raise InvalidRequest(
                "this model does not support shortening its embeddings: leave dimensions unset "
                "(its config.json names no matryoshka_dimensions)",
                param="dimensions",
            )
        if dims > limits.hidden_size or (config.matryoshka_dimensions and dims not in config.matryoshka_dimensions):
            sizes = config.matryoshka_dimensions or f"1 to {limits.hidden_size}"
            raise InvalidRequest(f"dimensions {dims} is not one this model supports ({sizes})", param="dimensions")
    if config.whole_prompt and params.truncate_prompt_tokens is not None:
        raise InvalidRequest(
            "truncate_prompt_tokens keeps a prompt's last tokens, which would drop an encoder's leading [CLS] "
            "token: send a shorter input",
            param="truncate_prompt_tokens",
        )
    if params.truncate_prompt_tokens and params.truncate_prompt_tokens > limits.max_model_len:
        raise InvalidRequest(
            f"truncate_prompt_tokens {params.truncate_prompt_tokens} is above the model's maximum "
            f"context length of {limits.max_model_len} tokens",
            param="truncate_prompt_tokens",
        )
    # NOTE: only an encoder reads them, and its prompt is never truncated (whole_prompt, above)
    types = params.token_type_ids
    if types is not None and (len(types) != len(prompt_token_ids) or any(t not in (0, 1) for t in types)):
        raise InvalidRequest("token_type_ids must give 0 or 1 for each token of the prompt", param="token_type_ids")
    prompt = _checked_tokens(prompt_token_ids, params.truncate_prompt_tokens, limits)
    if len(prompt) > limits.max_model_len:
        remedy = "Shorten it." if config.whole_prompt else "Shorten it, or set truncate_prompt_tokens."
        raise ContextTooLong(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, the "
            f"input has {len(prompt)} tokens. {remedy}",
            param="prompt",
        )
    return prompt


def _checked_tokens(prompt_token_ids: list[int], truncate: int | None, limits: Limits) -> list[int]:
    prompt = list(prompt_token_ids)
    if truncate:
        prompt = prompt[-truncate:]
    if not prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")
    vocab = limits.vocab_size
    if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt):
        raise InvalidRequest(f"the prompt has token ids outside the vocabulary (size {vocab})", param="prompt")
    return prompt


def build_group(
    request_id: str,
    request: PreparedRequest,
    *,
    arrival: int,
    next_seq_id: Callable[[], int],
    tokenizer: Any,
    device: torch.device,
    eos_token_ids: set[int],
    limits: Limits,
) -> SequenceGroup:
    """The request's SequenceGroup: n (or best_of) choices, each with its own RNG stream and detokenizer, or
    the first beam of a beam search."""
    prompt, params = request.prompt, request.params
    if isinstance(params, PoolingParams):
        return SequenceGroup(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            seqs=[Sequence(seq_id=next_seq_id(), token_ids=list(prompt), num_prompt_tokens=len(prompt))],
            arrival=arrival,
        )
    if params.adapter is not None and params.adapter not in limits.adapters:  # unloaded since it was checked
        raise InvalidRequest(f"LoRA adapter {params.adapter!r} was unloaded", param="model")
    adapter = params.adapter
    salt = adapter_salt(None if adapter is None else limits.adapter_keys.get(adapter, adapter))
    keys = tuple(span.key for span in request.images)
    beam = None
    if params.use_beam_search:
        stops = (set() if params.ignore_eos else eos_token_ids) | set(params.stop_token_ids or ())
        max_tokens = min(params.max_tokens or limits.max_model_len, limits.max_model_len - len(prompt))
        beam = BeamSearch(
            width=params.num_sequences,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            stop_token_ids=stops,
            max_tokens=max_tokens,
        )
        seqs = [
            Sequence(
                seq_id=next_seq_id(),
                token_ids=list(prompt),
                num_prompt_tokens=len(prompt),
                cache_salt=salt,
                image_keys=keys,
                output_state=OutputState(penalties=_penalties(params)),
            )
        ]
    else:
        seqs = [
            Sequence(
                seq_id=next_seq_id(),
                token_ids=list(prompt),
                num_prompt_tokens=len(prompt),
                index=i,
                cache_salt=salt,
                image_keys=keys,
                output_state=OutputState(
                    detokenizer=_detokenizer(tokenizer, params, prompt),
                    generator=_generator(params.seed, i, device),
                    stop_reader=params.stop_reader() if params.stop_reader else None,
                    penalties=_penalties(params),
                ),
            )
            for i in range(params.num_sequences)
        ]
    bad_words = tokenize_bad_words(tokenizer, params.bad_words) if params.bad_words else []
    return SequenceGroup(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        seqs=seqs,
        arrival=arrival,
        eos_token_ids=set(eos_token_ids),
        bad_words_ids=bad_words,
        beam=beam,
        adapter=None if params.adapter is None else limits.adapters.get(params.adapter),
        images=list(request.images),
    )


def _penalties(params: SamplingParams) -> PenaltyCounts | None:
    # Each choice counts its own tokens (a beam's children clone their parent's counts when they fork).
    return PenaltyCounts() if has_penalty(params) else None


def _generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    # Choice i of a seeded request draws from its own stream, fixed by (seed, i) alone.
    return torch.Generator(device=device).manual_seed((seed + index * 0x9E3779B97F4A7C15) % 2**64)


def _detokenizer(tokenizer: Any, params: SamplingParams, prompt: list[int]) -> Detokenizer:
    return Detokenizer(
        tokenizer=tokenizer,
        skip_special_tokens=params.skip_special_tokens,
        stop=cast(list[str] | None, params.stop),  # SamplingParams turns a string into a list
        include_stop_str_in_output=params.include_stop_str_in_output,
        prompt_token_ids=prompt,
    )
