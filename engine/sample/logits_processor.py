"""Logits processing before the draw, in vLLM's order: logit_bias, allowed_token_ids, bad_words and min_tokens
masks, the grammar's token bitmask (structured outputs), then repetition, frequency and presence penalties
(engine/sample/penalties.py).
Beam search ranks its candidates on the result too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sample.params import SamplingParams
from engine.sample.penalties import PenaltyCounts, apply_penalties, has_penalty
from engine.sample.structured.bitmask import apply_bitmask, grammar_bitmask

if TYPE_CHECKING:
    from engine.sample.structured.matcher import GrammarState

NEG_INF = float("-inf")


@dataclass(kw_only=True)
class SamplingRow:
    """One sequence's share of a sampling step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # None: the global RNG (no per-request seed)
    eos_token_ids: set[int] = field(default_factory=set)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    grammar: GrammarState | None = None  # the sequence's place in its grammar (structured outputs)
    penalties: PenaltyCounts | None = None  # the sequence's running token counts (None: counted afresh)


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Masks and penalties, before temperature (beam search ranks candidates on these logits).

    Returns `logits` itself when no row needs either; never modifies it.
    """
    raw = logits.float()
    masked = [i for i, r in enumerate(rows) if _has_mask(r)]
    penalised = [i for i, r in enumerate(rows) if has_penalty(r.params)]
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not masked and not penalised and not constrained:
        return raw
    out = raw.clone()
    if masked:
        _apply_masks(out, [(i, rows[i]) for i in masked])
    bitmask = None
    if constrained:
        bitmask = grammar_bitmask([g for i in constrained if (g := rows[i].grammar) is not None], out.shape[1])
        apply_bitmask(out, bitmask, constrained)
    if penalised:
        apply_penalties(out, [(i, rows[i]) for i in penalised])
    # A row whose every token got masked would sample NaN; let it fall back to the raw logits, under its
    # grammar alone where it has one (the grammar wins over min_tokens or allowed_token_ids that contradict it).
    dead = out.amax(dim=-1) == NEG_INF
    if bool(dead.any()):
        fallback = raw
        if bitmask is not None:
            fallback = raw.clone()
            apply_bitmask(fallback, bitmask, constrained)
        out[dead] = fallback[dead]
    return out


def _apply_masks(out: torch.Tensor, rows: list[tuple[int, SamplingRow]]) -> None:
    """In place: logit_bias, then allowed_token_ids, bad_words and min_tokens as -inf."""
    device = out.device
    bias_index: tuple[list[int], list[int]] = ([], [])
    bias_values: list[float] = []
    banned: tuple[list[int], list[int]] = ([], [])
    allowed_rows: list[int] = []
    allowed_index: tuple[list[int], list[int]] = ([], [])
    for i, row in rows:
        p = row.params
        if p.logit_bias:
            bias_index[0].extend([i] * len(p.logit_bias))
            bias_index[1].extend(p.logit_bias.keys())
            bias_values.extend(p.logit_bias.values())
        if p.allowed_token_ids:
            allowed_rows.append(i)
            allowed_index[0].extend([i] * len(p.allowed_token_ids))
            allowed_index[1].extend(p.allowed_token_ids)
        ids = _banned_tokens(row)
        banned[0].extend([i] * len(ids))
        banned[1].extend(ids)
    if allowed_rows:
        # Keep the allowed logits, blank only the restricted rows, put the kept ones back.
        index = (torch.tensor(allowed_index[0], device=device), torch.tensor(allowed_index[1], device=device))
        kept = out[index]
        out.index_fill_(0, torch.tensor(allowed_rows, device=device), NEG_INF)
        out[index] = kept
    if bias_values:
        index = (torch.tensor(bias_index[0], device=device), torch.tensor(bias_index[1], device=device))
        out.index_put_(index, torch.tensor(bias_values, device=device), accumulate=True)
    if banned[0]:
        out[torch.tensor(banned[0], device=device), torch.tensor(banned[1], device=device)] = NEG_INF


def _has_mask(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.logit_bias or p.allowed_token_ids or row.bad_words_ids or len(row.output_token_ids) < p.min_tokens)


def _banned_tokens(row: SamplingRow) -> list[int]:
    p = row.params
    out = row.output_token_ids
    banned: list[int] = []
    for word in row.bad_words_ids:
        # A multi-token word bans its last token only right after the rest of it.
        prefix = len(word) - 1
        if prefix <= len(out) and (prefix == 0 or out[-prefix:] == word[:-1]):
            banned.append(word[-1])
    if len(out) < p.min_tokens:
        banned += p.stop_token_ids or []
        if not p.ignore_eos:
            banned += row.eos_token_ids
    return banned


def tokenize_bad_words(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Token ids of each bad word, alone and after a space, as vLLM bans them."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        # A leading space that merges into the first token gives a distinct word to ban.
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
