"""Incremental detokenization: token ids in, safe text deltas out, with stop strings and UTF-8 holdback.

Each push decodes only a short window (vLLM's prefix/read offsets): the text of ids[prefix:] minus the
text of ids[prefix:read] is what the new ids add. A window ending in U+FFFD is an incomplete UTF-8
character and is held until the next token completes it. Text that could still grow into a stop
string is held too, so no part of a stop string is ever emitted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
# vLLM starts the first window this many prompt tokens back, so the first output token decodes in context.
PROMPT_CONTEXT = 5
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass
class DetokenizerDelta:
    text: str
    stop_string: str | None = None


class Detokenizer:
    """One sequence's incremental detokenizer (see the module docstring)."""

    def __init__(
        self,
        *,
        tokenizer,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop or [] if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids or [])[-PROMPT_CONTEXT:]
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._prefix_text: str | None = None
        self._pending = ""  # decoded text held back because it may begin a stop string
        self.output_text = ""
        self.stopped: str | None = None

    def push(self, token_ids: list[int], check_stop: bool = True) -> DetokenizerDelta:
        """check_stop False (before min_tokens, as vLLM): stop strings neither match nor hold text back."""
        if self.stopped is not None:
            raise RuntimeError("Detokenizer.push after a stop string matched")
        self._ids.extend(token_ids)
        return self._release(self._pending + self._decode_new(), final=False, check_stop=check_stop)

    def flush(self) -> str:
        """All held text (a trailing invalid UTF-8 sequence included), for a finish that is not a stop string."""
        if self.stopped is not None:
            return ""
        text = self._pending
        full = self._decode(self._ids[self._prefix :])
        prefix_text = self._window_prefix_text()
        if len(full) > len(prefix_text):
            text += full[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        return self._release(text, final=True).text

    def _decode_new(self) -> str:
        prefix_text = self._window_prefix_text()
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(prefix_text) or full.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        return full[len(prefix_text) :]

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return self._prefix_text

    def _release(self, text: str, final: bool, check_stop: bool = True) -> DetokenizerDelta:
        """Emit `text` except a stop string (and what follows) or a tail that may start one."""
        match = self._find_stop(text) if check_stop else None
        if match is not None:
            at, stop = match
            emitted = text[: at + len(stop)] if self.include_stop_str_in_output else text[:at]
            self.stopped, self._pending = stop, ""
            self.output_text += emitted
            return DetokenizerDelta(emitted, stop)
        hold = 0 if final or not check_stop else self._partial_stop_length(text)
        emitted, self._pending = text[: len(text) - hold], text[len(text) - hold :]
        self.output_text += emitted
        return DetokenizerDelta(emitted)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = text.find(stop)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _decode(self, ids: list[int]) -> str:
        # NOTE: one call for the whole window, added tokens included: the fast tokenizer puts them next to the
        # text around them as they are (`<think>\nOkay`), and joining pieces with spaces (the slow tokenizers'
        # spaces_between_special_tokens) would add text the model never produced.
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The exact bytes one token stands for (byte-level BPE and <0xHH> byte-fallback pieces included)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if _is_byte_level(tokenizer):
            if all(ch in _UNICODE_TO_BYTE for ch in piece):
                return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def token_text(tokenizer, token_id: int) -> str:
    """One token's text for logprobs; a partial UTF-8 piece is shown as escaped bytes, as OpenAI does."""
    text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if REPLACEMENT not in text:
        return text
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="backslashreplace")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    from tokenizers import decoders

    if isinstance(decoder, decoders.ByteLevel):
        return True
    return isinstance(decoder, decoders.Sequence) and "ByteLevel" in repr(decoder)


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


_UNICODE_TO_BYTE = _unicode_to_byte()
