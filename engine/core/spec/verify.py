"""Verifies the proposals of a step's speculating sequences on the target's logits, all of them in one batch.

A sequence with k proposed tokens owns k + 1 logits rows: row j is the target's prediction after its proposals
1..j. Each row is processed as the sampler would process it at that point of the output (its penalties, min_tokens
and bad-words masks see the accepted tokens in order; temperature, top-k / top-p and min-p after), so the accepted
tokens are distributed exactly as without speculation (engine/sample/rejection.py). Their logprobs come from the
raw logits of their rows, as the sampler reports them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.core.scheduling.step import Sample, ScheduledSeq, StepResult, sampling_row
from engine.sample.logits_processor import SamplingRow, process_logits
from engine.sample.rejection import accept_greedy, accept_sampled
from engine.sample.sampler import Sampler


def verify(logits: torch.Tensor, items: list[tuple[int, ScheduledSeq]], sampler: Sampler, result: StepResult) -> None:
    """logits: the k + 1 rows of each item in turn. Fills result.samples (or result.errors) per item. Every
    proposer here is deterministic (n-gram lookup, a greedy draft), so each proposal is a point mass."""
    spans, row = [], 0
    for _, s in items:
        spans.append(row)
        row += s.num_tokens
    try:
        _verify(logits, items, spans, sampler, result)
    except Exception:
        # One request's bad parameters must not fail the batch: each sequence alone.
        for (i, s), start in zip(items, spans, strict=True):
            try:
                _verify(logits[start : start + s.num_tokens], [(i, s)], [0], sampler, result)
            except Exception as exc:
                result.errors[i] = exc


def _rows(s: ScheduledSeq) -> list[SamplingRow]:
    """One sampling row per position: after 0, 1, ..., k of the proposed tokens."""
    base = sampling_row(s.group, s.seq)
    # NOTE: the running penalty counts are the sequence's, at its output as it is; the later rows count afresh.
    return [base] + [
        replace(base, output_token_ids=s.seq.output_token_ids + s.draft[:j], penalties=None)
        for j in range(1, len(s.draft) + 1)
    ]


def _verify(
    logits: torch.Tensor, items: list[tuple[int, ScheduledSeq]], spans: list[int], sampler: Sampler, result: StepResult
) -> None:
    rows = [r for _, s in items for r in _rows(s)]
    raw = logits.float()
    processed = process_logits(raw, rows)
    greedy = [j for j, (_, s) in enumerate(items) if s.group.sampling.greedy]
    argmax = processed.argmax(dim=-1).tolist() if greedy else []
    accepted: list[list[int]] = []
    for (_, s), start in zip(items, spans, strict=True):
        n = s.num_tokens
        if s.group.sampling.greedy:
            accepted.append(accept_greedy(argmax[start : start + n], s.draft))
            continue
        mine = rows[start : start + n]
        probs = sampler.probs(processed[start : start + n], mine)
        u = sampler.uniforms(mine[:1], logits.device, per_row=n)[0]
        accepted.append(accept_sampled(probs, s.draft, u))
    # The accepted tokens' logprobs, each from its own row, in one scoring pass.
    used = [start + j for (_, s), start, toks in zip(items, spans, accepted, strict=True) for j in range(len(toks))]
    index = torch.tensor(used, device=logits.device)
    tokens = torch.tensor([t for toks in accepted for t in toks], dtype=torch.long, device=logits.device)
    scored = sampler.score(raw.index_select(0, index), tokens, [rows[r] for r in used])
    at = 0
    for (i, s), toks in zip(items, accepted, strict=True):
        samples = []
        for _ in toks:
            top = (
                scored.top_logprobs[at]
                if scored.top_logprobs is not None and s.group.sampling.logprobs is not None
                else None
            )
            samples.append(Sample(scored.token_ids[at], scored.logprobs[at], top))
            at += 1
        result.samples[i] = samples
