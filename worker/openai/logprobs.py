"""Engine logprobs -> OpenAI's chat and completions formats, and vLLM's prompt_logprobs."""

from __future__ import annotations

from typing import Any

from engine.outputs import Logprob, PositionLogprobs

# JSON has no -inf; vLLM clamps to the same floor.
FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, FLOOR)


def _entry(lp: Logprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": _lp(lp.logprob), "bytes": list(lp.token.encode("utf-8"))}


def chat_logprobs(positions: list[PositionLogprobs], top: int) -> dict[str, Any]:
    """A chat choice's `logprobs` object: one entry per generated token with `top` alternatives."""
    content = [{**_entry(p.chosen), "top_logprobs": [_entry(alt) for alt in p.top[:top]]} for p in positions]
    return {"content": content, "refusal": None}


def completion_logprobs(
    positions: list[PositionLogprobs | None], top: int, tokens_text: list[str] | None = None, offset: int = 0
) -> dict[str, Any]:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs and text_offset, from `offset` on.

    A None position (the first prompt token, echoed) has no logprob, as in OpenAI's legacy API.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for i, position in enumerate(positions):
        text = tokens_text[i] if tokens_text is not None else position.chosen.token
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if position is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(position.chosen.logprob))
        # The chosen token is listed with its alternatives, as vLLM does.
        alternatives = {alt.token: _lp(alt.logprob) for alt in position.top[:top]}
        alternatives.setdefault(position.chosen.token, _lp(position.chosen.logprob))
        top_logprobs.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} (first is None)."""
    if positions is None:
        return None
    out: list[dict[str, Any] | None] = []
    for position in positions:
        if position is None:
            out.append(None)
            continue
        chosen = position.chosen
        entry = {str(chosen.token_id): {"logprob": _lp(chosen.logprob), "rank": _rank_of(position),
                                        "decoded_token": chosen.token}}
        for rank, alt in enumerate(position.top, start=1):
            entry.setdefault(str(alt.token_id), {"logprob": _lp(alt.logprob), "rank": rank, "decoded_token": alt.token})
        out.append(entry)
    return out


def _rank_of(position: PositionLogprobs) -> int:
    """The chosen token's rank among the alternatives (1 = most likely); past the top-k, one beyond it."""
    for rank, alt in enumerate(position.top, start=1):
        if alt.token_id == position.chosen.token_id:
            return rank
    return len(position.top) + 1
