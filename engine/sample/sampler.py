"""The sampler: one step's logits -> next tokens, batched over rows, each row drawing from its own RNG.

Order as vLLM: the masks and penalties of engine.sample.logits_processor; then temperature; then top_k, top_p,
min_p; then the draw. Reported logprobs come from log_softmax of the raw logits, before any of that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.logits_processor import NEG_INF, SamplingRow, process_logits
from engine.sample.params import SamplingParams

NAN = float("nan")
TOP_P_HEAD = 256  # tokens ranked by topk before falling back to a full sort


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token under the raw model distribution; NaN where not needed
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row, [] for rows that did not ask


def _needs_logprob(p: SamplingParams) -> bool:
    """The chosen token's logprob is reported (logprobs) or ranks the samples (best_of > n)."""
    return p.logprobs is not None or p.num_sequences > p.n


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per position: the logprob of token_ids[i] and the top-k (id, logprob), highest first (prompt_logprobs)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in token_ids]
    return list(zip(chosen, tops, strict=True))


class Sampler:
    """Stateless; __call__ samples one token per row of `logits` [B, V] float32."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows)
        raw = logits.float()
        return self.score(raw, self.choose(process_logits(raw, rows), rows), rows)

    def choose(self, processed: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row of the processed logits: the argmax for greedy rows, a draw for the others."""
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled:
            return processed.argmax(dim=-1)
        if len(sampled) == len(rows):
            return self._sample(processed, rows)
        device = processed.device
        greedy = torch.tensor([i for i, row in enumerate(rows) if row.params.greedy], device=device)
        index = torch.tensor(sampled, device=device)
        tokens = torch.empty(len(rows), dtype=torch.long, device=device)
        tokens[greedy] = processed[greedy].argmax(dim=-1)
        tokens[index] = self._sample(processed[index], [rows[i] for i in sampled])
        return tokens

    def score(self, raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The chosen tokens with their logprobs (and top logprobs) under the raw float32 logits."""
        token_ids = tokens.tolist()
        # NOTE: the log-normaliser costs a pass over [B, vocab]; only rows that report logprobs or rank
        # their samples (best_of > n) pay for it, the others get NaN.
        need = [i for i, row in enumerate(rows) if _needs_logprob(row.params)]
        if not need:
            return SamplerOutput(token_ids=token_ids, logprobs=[NAN] * len(rows))
        if len(need) < len(rows):
            index = torch.tensor(need, device=raw.device)
            raw, tokens, rows = raw.index_select(0, index), tokens.index_select(0, index), [rows[i] for i in need]
        lse = torch.logsumexp(raw, dim=-1)
        chosen = (raw.gather(1, tokens[:, None]).squeeze(1) - lse).tolist()
        top = self._top_logprobs(raw, lse, rows)
        logprobs = [NAN] * len(token_ids)
        tops: list[list[tuple[int, float]]] | None = None if top is None else [[] for _ in token_ids]
        for j, i in enumerate(need):
            logprobs[i] = chosen[j]
            if tops is not None and top is not None:
                tops[i] = top[j]
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=tops)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top_k / top_p / min_p, then one draw per row from its own generator."""
        return self.draw(self.probs(logits, rows), self.uniforms(rows, logits.device))

    def probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each sampled row draws from (unnormalised where min_p cut it): temperature, then
        top_k / top_p, then min_p. Speculative verification (engine/sample/rejection.py) reads it too."""
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], device=device)[:, None]
        logits = logits / temps
        # Only rows that truncate pay for the sort over the vocabulary.
        truncated = [i for i, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1.0]
        if truncated:
            index = torch.tensor(truncated, device=device)
            top_k = [rows[i].params.top_k for i in truncated]
            top_p = [rows[i].params.top_p for i in truncated]
            logits[index] = self._top_k_top_p(logits[index], top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(m > 0.0 for m in min_p):
            floor = torch.tensor(min_p, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    @staticmethod
    def uniforms(rows: list[SamplingRow], device: torch.device, per_row: int = 1) -> torch.Tensor:
        """[rows, per_row] uniforms in [0, 1), a seeded row's from its own generator."""
        # NOTE: a few numbers per row, not one per token as an exponential race would need: the RNG dominates a
        # CPU step otherwise. A seeded row gets the same numbers whatever else shares the batch.
        u = torch.empty(len(rows), per_row, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            u.uniform_()
        else:
            for i, row in enumerate(rows):
                if row.generator is not None:
                    u[i] = torch.rand(per_row, generator=row.generator, device=device)
            if unseeded:
                u[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), per_row, device=device)
        return u

    @staticmethod
    def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Inverse CDF: row i's token for its uniform u[i] (any shape of [rows] or [rows, 1])."""
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        # Strictly below the total, so the first cdf entry above it is a token of nonzero probability
        # (a zero-probability token repeats the entry before it and is never the first to exceed).
        target = torch.minimum(u.reshape(-1, 1) * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Mask all but each row's top_k, then all but the smallest head holding top_p of the mass."""
        vocab = logits.shape[1]
        ks = [k if 0 < k < vocab else vocab for k in top_k]
        # A full sort of the vocabulary is slow on CPU; the nucleus almost always lies in a short head,
        # so rank only that head (and any larger top_k) and sort the rows whose nucleus runs past it.
        width = min(vocab, max([TOP_P_HEAD, *(k for k in ks if k < vocab)]))
        head_logits, head_ids = logits.topk(width, dim=-1)
        drop, covered = Sampler._head_drop(logits, head_logits, ks, top_p)
        out = torch.full_like(logits, NEG_INF).scatter_(1, head_ids, head_logits.masked_fill(drop, NEG_INF))
        if not bool(covered.all()):
            rest = (~covered).nonzero().squeeze(1)
            sorted_logits, order = logits[rest].sort(dim=-1, descending=True)
            picked = rest.tolist()
            drop, _ = Sampler._head_drop(
                logits[rest], sorted_logits, [ks[i] for i in picked], [top_p[i] for i in picked]
            )
            out[rest] = torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits.masked_fill(drop, NEG_INF))
        return out

    @staticmethod
    def _head_drop(
        logits: torch.Tensor, head: torch.Tensor, ks: list[int], top_p: list[float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of the sorted `head` logits top_k / top_p drop, and per row whether the head sufficed."""
        device = logits.device
        width = head.shape[1]
        k = torch.tensor(ks, device=device)[:, None]
        drop = torch.arange(width, device=device)[None, :] >= k
        p = torch.tensor(top_p, device=device)[:, None]
        covered = torch.ones(len(ks), dtype=torch.bool, device=device)
        if bool((p < 1.0).any()):
            # top_p renormalises over the top_k survivors (all inside the head) or the whole vocabulary.
            full = k[:, 0] >= logits.shape[1]
            lse = torch.where(
                full, torch.logsumexp(logits, dim=-1), torch.logsumexp(head.masked_fill(drop, NEG_INF), -1)
            )
            probs = (head - lse[:, None]).exp().masked_fill(drop, 0.0)
            cum = probs.cumsum(dim=-1)
            # Keep a token while the mass strictly before it is below top_p: the top token always stays.
            drop |= (cum - probs) >= p
            covered = ~full | (p[:, 0] >= 1.0) | (cum[:, -1] >= p[:, 0]) | (width == logits.shape[1])
        return drop, covered

    @staticmethod
    def _top_logprobs(
        raw: torch.Tensor, lse: torch.Tensor, rows: list[SamplingRow]
    ) -> list[list[tuple[int, float]]] | None:
        if all(r.params.logprobs is None for r in rows):
            return None
        ks = [r.params.logprobs or 0 for r in rows]
        k = max(ks)
        if k == 0:
            return [[] for _ in rows]
        values, ids = raw.topk(k, dim=-1)
        values = values - lse[:, None]
        return [list(zip(i[:n], v[:n], strict=True)) for i, v, n in zip(ids.tolist(), values.tolist(), ks, strict=True)]
