"""SamplingParams: one request's decoding settings, validated once at the edge of the engine."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol

from engine.errors import InvalidRequest
from engine.sample.structured.spec import StructuredSpec

# Below this a temperature means greedy, as in vLLM (dividing by it would overflow the logits).
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


def _fail(param: str, message: str) -> NoReturn:
    raise InvalidRequest(message, param=param)


def _check_range(param: str, value: float, lo: float | None, hi: float | None, lo_open: bool = False) -> None:
    """Raise naming `param` unless lo <= value <= hi (lo < value when lo_open); NaN always fails."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(param, f"{param} must be a number, got {value!r}")
    if math.isnan(value) or (lo is None and hi is None and math.isinf(value)):
        _fail(param, f"{param} must be a finite number, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        _fail(param, f"{param} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        _fail(param, f"{param} must be <= {hi}, got {value}")


def _check_int(param: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(param, f"{param} must be an integer, got {value!r}")
    if value < lo:
        _fail(param, f"{param} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        _fail(param, f"{param} must be <= {hi}, got {value}")


def _token_ids(param: str, ids: object) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        _fail(param, f"{param} must be a list of token ids, got {ids!r}")
    for tid in ids:
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            _fail(param, f"{param} must contain non-negative integer token ids, got {tid!r}")
    return list(ids)


class StopReader(Protocol):
    """Reads one choice's output text as the detokenizer releases it; True ends the choice there ("stop")."""

    def push(self, text: str) -> bool: ...


@dataclass(kw_only=True)
class SamplingParams:
    """Decoding settings of one request (vLLM's names and semantics); invalid values raise InvalidRequest."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    # Accepted as vLLM accepts it; with a fast tokenizer (every one the engine runs) vLLM's text is the tokenizer's
    # own decode whichever value is asked, and so is ours (engine/detokenizer.py).
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    structured: StructuredSpec | None = None  # a grammar the output must match
    # Makes each choice's StopReader: a stop condition on the text that stop strings cannot express (where a
    # tool-call answer takes no further call). Not applied to beam search.
    stop_reader: Callable[[], StopReader] | None = None
    # Not sampling settings, but they travel with the request's: the LoRA adapter to run (None: the base), and its
    # priority under the "priority" scheduling policy (lower runs first; vLLM's request field).
    adapter: str | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        self._normalize()
        self._check_fields()
        self._check_combinations()

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def num_sequences(self) -> int:
        """How many sequences run for this request (beam width for beam search)."""
        return self.best_of if self.best_of is not None else self.n

    def check_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce; the engine calls this once it knows the vocab."""
        for param, ids in (
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids or []),
        ):
            bad = [tid for tid in ids if tid >= vocab_size]
            if bad:
                _fail(param, f"{param} has token id {bad[0]} out of the vocabulary (size {vocab_size})")

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
                _fail("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
            # An empty stop string would end every request at once; clients send "" to mean "none".
            self.stop = [s for s in self.stop if s] or None
        if self.stop_token_ids is not None:
            self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids) or None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                # JSON object keys arrive as strings.
                try:
                    tid = int(key)
                except (TypeError, ValueError):
                    _fail("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
                if tid < 0:
                    _fail("logit_bias", f"logit_bias keys must be non-negative token ids, got {key!r}")
                _check_range("logit_bias", value, -100.0, 100.0)
                bias[tid] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                _fail("allowed_token_ids", "allowed_token_ids must not be empty")
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                _fail("bad_words", f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words) or None

    def _check_fields(self) -> None:
        _check_int("n", self.n, 1)
        _check_int("priority", self.priority, -(2**63), 2**63 - 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1)
        _check_range("temperature", self.temperature, 0.0, None)
        if math.isinf(self.temperature):
            _fail("temperature", f"temperature must be finite, got {self.temperature}")
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, None, lo_open=True)
        if math.isinf(self.repetition_penalty):
            _fail("repetition_penalty", f"repetition_penalty must be finite, got {self.repetition_penalty}")
        _check_range("length_penalty", self.length_penalty, None, None)
        if self.seed is not None:
            # torch.Generator.manual_seed takes anything in [-2**63, 2**64).
            _check_int("seed", self.seed, -(2**63), 2**64 - 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        if self.adapter is not None and not isinstance(self.adapter, str):
            _fail("model", f"adapter must be an adapter's name, got {self.adapter!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            _fail("structured", f"structured must be a StructuredSpec, got {type(self.structured).__name__}")
        if self.stop_reader is not None and not callable(self.stop_reader):
            _fail("stop_reader", "stop_reader must make a StopReader")

    def _check_combinations(self) -> None:
        if self.best_of is not None and self.best_of < self.n:
            _fail("best_of", f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(
                "min_tokens",
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} and max_tokens={self.max_tokens}",
            )
        if self.use_beam_search:
            if self.num_sequences < 2:
                _fail(
                    "best_of" if self.best_of is not None else "n",  # the width the request gave
                    f"beam search needs a beam width (best_of, or n) greater than 1, got {self.num_sequences}",
                )
            if self.temperature > SAMPLING_EPS:
                _fail("temperature", f"temperature must be 0 when using beam search, got {self.temperature}")
            if self.top_p < 1.0 - SAMPLING_EPS:
                _fail("top_p", f"top_p must be 1 when using beam search, got {self.top_p}")
            if self.top_k not in (0, -1):
                _fail("top_k", f"top_k must be disabled (0 or -1) when using beam search, got {self.top_k}")
            if self.min_p > SAMPLING_EPS:
                _fail("min_p", f"min_p must be 0 when using beam search, got {self.min_p}")
        else:
            if self.early_stopping:
                _fail("early_stopping", "early_stopping only applies to beam search and must be false without it")
            if abs(self.length_penalty - 1.0) > SAMPLING_EPS:
                _fail(
                    "length_penalty",
                    f"length_penalty only applies to beam search and must be 1 without it, got {self.length_penalty}",
                )
