"""Request fields -> the engine's SamplingParams, for OpenAI requests and native `sampling_params`."""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from engine.sample.params import SamplingParams
from worker.openai.errors import BadRequest
from worker.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, StructuredOutputs
from worker.openai.structured import structured_spec

# RunPod's vLLM worker documents 0.7 as the temperature default of its OpenAI routes.
DEFAULT_TEMPERATURE = 0.7
# Native jobs stop after this many tokens unless they say otherwise (RunPod's vLLM worker does the same).
NATIVE_DEFAULT_MAX_TOKENS = 100

# Fields copied under the same name when the request sets them.
_SHARED = (
    "n",
    "best_of",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "use_beam_search",
    "length_penalty",
    "early_stopping",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "prompt_logprobs",
    "priority",
)


def openai_sampling_params(
    request: ChatCompletionRequest | CompletionRequest, max_model_len: int, adapter: str | None = None
) -> SamplingParams:
    """The engine parameters of an OpenAI request (run with the LoRA `adapter` when one is named); raises BadRequest
    naming the parameter."""
    if isinstance(request, CompletionRequest) and request.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    fields: dict[str, Any] = {name: getattr(request, name) for name in _SHARED if getattr(request, name) is not None}
    fields["temperature"] = (
        _default_temperature(bool(request.use_beam_search), DEFAULT_TEMPERATURE)
        if request.temperature is None
        else request.temperature
    )
    fields["top_k"] = request.top_k if request.top_k is not None else 0
    fields["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    fields["logit_bias"] = _logit_bias(request)
    fields["max_tokens"] = request.output_limit
    fields["truncate_prompt_tokens"] = _truncation(request.truncate_prompt_tokens, max_model_len)
    if isinstance(request, ChatCompletionRequest):
        fields["logprobs"] = (request.top_logprobs or 0) if request.logprobs else None
    else:
        fields["logprobs"] = request.logprobs
        if request.echo and request.logprobs is not None:
            # Echoed prompt tokens carry logprobs too, as in vLLM and OpenAI's legacy API.
            fields["prompt_logprobs"] = max(request.logprobs, request.prompt_logprobs or 0)
    fields["structured"] = structured_spec(
        response_format=request.response_format, **{name: getattr(request, name) for name in _STRUCTURED}
    )
    return SamplingParams(**fields, adapter=adapter)


# The structured-output fields requests share with native sampling_params (vLLM's and SGLang's names).
_STRUCTURED = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "regex",
    "ebnf",
    "json_schema",
)


def _default_temperature(use_beam_search: bool, default: float) -> float:
    """The temperature of a request that sets none: beam search is deterministic and takes none, so it runs at
    0 rather than be refused over a default it did not choose."""
    return 0.0 if use_beam_search else default


def _logit_bias(request: SamplingFields) -> dict[int, float] | None:
    if not request.logit_bias:
        return None
    bias = {}
    for key, value in request.logit_bias.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    return bias


def _truncation(value: int | None, max_model_len: int) -> int | None:
    # vLLM reads -1 as "keep as many prompt tokens as the context holds".
    return max_model_len if value == -1 else value


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return Field(default_factory=f.default_factory)
    return ... if f.default is dataclasses.MISSING else f.default  # ... marks a required field


# Native jobs accept exactly SamplingParams' fields (vLLM's names) and nothing else; only these differ.
_NATIVE_OVERRIDES: dict[str, tuple[Any, Any]] = {
    "top_k": (int, -1),  # vLLM's spelling of "no top-k"; mapped to the engine's 0 below
    "max_tokens": (int | None, NATIVE_DEFAULT_MAX_TOKENS),
    # str before list[str]: a bad value then reports "should be a valid string" (errors show the first branch).
    "stop": (str | list[str] | None, None),
}

# vLLM's structured-output names in native sampling_params (`guided_decoding` is the older spelling of
# `structured_outputs`); the engine's own `structured` field is not a vLLM name and is not taken.
_NATIVE_STRUCTURED: dict[str, tuple[Any, Any]] = {
    "structured_outputs": (StructuredOutputs | None, None),
    "guided_decoding": (StructuredOutputs | None, None),
    "guided_json": (str | dict[str, Any] | bool | None, None),
    "guided_regex": (str | None, None),
    "guided_choice": (list[str] | None, None),
    "guided_grammar": (str | None, None),
    "guided_decoding_backend": (str | None, None),
    "guided_whitespace_pattern": (str | None, None),
}

# get_type_hints, not Field.type: sampling.py's annotations are strings (from __future__ import annotations).
_HINTS = get_type_hints(SamplingParams)
_NATIVE_FIELDS: dict[str, Any] = {
    f.name: _NATIVE_OVERRIDES.get(f.name, (_HINTS[f.name], _default(f)))
    for f in dataclasses.fields(SamplingParams)
    if f.name not in ("structured", "adapter")
} | _NATIVE_STRUCTURED
NativeSamplingParams: type[BaseModel] = create_model(
    "NativeSamplingParams",
    __config__=ConfigDict(extra="forbid"),
    __doc__="`sampling_params` of a native job: vLLM's SamplingParams names; unknown names are a 400.",
    **_NATIVE_FIELDS,
)


def native_sampling_params(raw: Any, max_model_len: int, adapter: str | None = None) -> SamplingParams:
    """The engine parameters of a native job's `sampling_params` (raises ValidationError / InvalidRequest)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object", param="sampling_params")
    validated = NativeSamplingParams.model_validate(raw)
    fields = validated.model_dump(exclude=set(_NATIVE_STRUCTURED))
    fields["structured"] = _native_structured(validated)
    if "temperature" not in raw:
        fields["temperature"] = _default_temperature(fields["use_beam_search"], fields["temperature"])
    fields["top_k"] = 0 if fields["top_k"] == -1 else fields["top_k"]
    fields["truncate_prompt_tokens"] = _truncation(fields["truncate_prompt_tokens"], max_model_len)
    return SamplingParams(**fields, adapter=adapter)


def _native_structured(validated: Any) -> Any:  # a NativeSamplingParams: its fields are made at import
    values = {name: getattr(validated, name) for name in _NATIVE_STRUCTURED if name != "guided_decoding"}
    if validated.guided_decoding is not None:
        if validated.structured_outputs is not None:
            raise BadRequest(
                "only one structured output constraint is allowed per request, got structured_outputs "
                "and guided_decoding",
                param="guided_decoding",
            )
        values["structured_outputs"] = validated.guided_decoding
    return structured_spec(**values)
