"""Speculative verification of one sequence's proposed tokens against the target model's distributions.

Greedy: the longest prefix of the proposal that equals the target's argmax, then the target's own next token.
Sampled: standard speculative rejection sampling (Leviathan et al., Chen et al.): proposed token x_j, drawn from
q_j, is kept with probability min(1, p_j(x_j) / q_j(x_j)); the first one refused is replaced by a draw from
max(0, p_j - q_j) renormalised; when every one is kept, one more token comes from p_{k}. Each output token is then
distributed exactly as p. A deterministic proposer (n-gram lookup, a greedy draft) has q_j a point mass on x_j:
keep with probability p_j(x_j), else draw from p_j with x_j removed.
"""

from __future__ import annotations

import torch


def accept_greedy(target: list[int], proposal: list[int]) -> list[int]:
    """target: the argmax of each of the k + 1 rows; returns the accepted tokens (1 to k + 1 of them)."""
    n = 0
    while n < len(proposal) and proposal[n] == target[n]:
        n += 1
    return proposal[:n] + [target[n]]


def accept_sampled(
    probs: torch.Tensor, proposal: list[int], u: torch.Tensor, draft_probs: torch.Tensor | None = None
) -> list[int]:
    """probs: [k + 1, vocab] target distributions (rows need not sum to one); u: k + 1 uniforms in [0, 1);
    draft_probs: [k, vocab] the proposer's q, None for a point mass on each proposed token.
    Returns the accepted tokens (1 to k + 1 of them)."""
    k = len(proposal)
    p = probs.float()
    p = p / p.sum(dim=-1, keepdim=True)
    if k:
        index = torch.tensor(proposal, dtype=torch.long, device=p.device)[:, None]
        p_x = p[:k].gather(1, index).squeeze(1)
        if draft_probs is None:
            q = torch.zeros_like(p[:k]).scatter_(1, index, 1.0)
        else:
            q = draft_probs.float() / draft_probs.float().sum(dim=-1, keepdim=True)
        q_x = q.gather(1, index).squeeze(1)
        # u < p / q without dividing (q_x > 0 for a token the proposer drew): u * q < p.
        kept = (u[:k] * q_x < p_x).tolist()
    else:
        kept = []
    n = next((j for j, ok in enumerate(kept) if not ok), k)
    if n == k:
        row = p[k]
    else:
        row = (p[n] - q[n]).clamp_min(0.0)
        if float(row.sum()) <= 0.0:  # p == q: a refusal has probability 0; fall back to p itself
            row = p[n]
    return proposal[:n] + [_draw(row, float(u[k]))]


def _draw(row: torch.Tensor, u: float) -> int:
    """Inverse CDF, as the sampler draws: the first token whose cumulative mass exceeds u * total."""
    cdf = row.cumsum(dim=-1)
    total = cdf[-1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, target, right=True)[0])
