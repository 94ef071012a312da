"""Engine logprobs -> OpenAI's chat and completions formats, and vLLM's prompt_logprobs."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from engine.outputs import Logprob, PositionLogprobs

# JSON has no -inf; vLLM clamps to the same floor.
FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, FLOOR)


def _entry(lp: Logprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": _lp(lp.logprob), "bytes": list(lp.token_bytes)}


def chat_logprobs(positions: list[PositionLogprobs], top: int) -> dict[str, Any]:
    """A chat choice's `logprobs` object: one entry per generated token with `top` alternatives."""
    content = [{**_entry(p.chosen), "top_logprobs": [_entry(alt) for alt in p.top[:top]]} for p in positions]
    return {"content": content, "refusal": None}


class TextOffsets:
    """Where each token starts in the text its bytes decode to, in characters (completions' text_offset).

    A token that begins inside a multi-byte character is placed at that character, so the offsets are the
    same whether the text comes whole or streamed in pieces.
    """

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token_bytes: bytes) -> int:
        """The offset of the next token, given its bytes; moves past it."""
        at = self.chars
        self.chars += len(self._decoder.decode(token_bytes))
        return at


def completion_logprobs(
    positions: Sequence[PositionLogprobs | None],
    top: int,
    offsets: TextOffsets,
    pieces: list[tuple[str, bytes]] | None = None,
) -> dict[str, Any]:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs and text_offset.

    `pieces` gives each position's (text, bytes) where a position may be None (the first prompt token,
    echoed, which has no logprob, as in OpenAI's legacy API); else they come from the positions.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for i, position in enumerate(positions):
        if pieces is not None:
            text, raw = pieces[i]
        else:
            assert position is not None, "a position without logprobs comes with its pieces"
            text, raw = position.chosen.token, position.chosen.token_bytes
        tokens.append(text)
        text_offset.append(offsets.advance(raw))
        if position is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(position.chosen.logprob))
        # The chosen token is listed with its alternatives, as vLLM does.
        alternatives = {alt.token: _lp(alt.logprob) for alt in position.top[:top]}
        alternatives.setdefault(position.chosen.token, _lp(position.chosen.logprob))
        top_logprobs.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


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
        entry = {
            str(chosen.token_id): {
                "logprob": _lp(chosen.logprob),
                "rank": _rank_of(position),
                "decoded_token": chosen.token,
            }
        }
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
