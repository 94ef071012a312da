"""Speculative rejection sampling keeps the target distribution: chi-square over many draws on a small vocabulary
(fixed seeds, so a run is reproducible; a bound at a 1e-6 tail, so a correct sampler never trips it while a biased
one, as the last test shows, trips it by orders of magnitude)."""

from __future__ import annotations

import torch

from engine.sample.rejection import accept_greedy, accept_sampled

DRAWS = 20000
# The chi-square quantile at 1 - 1e-6 for 4 degrees of freedom (5 tokens) is about 35.
BOUND = 35.0


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p / p.sum() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _first_tokens(p: torch.Tensor, proposal: list[int], q: torch.Tensor | None, seed: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    first, second = [], []
    for _ in range(DRAWS):
        out = accept_sampled(p, proposal, torch.rand(len(proposal) + 1, generator=g), q)
        first.append(out[0])
        if len(out) > 1:
            second.append(out[1])
    return first, second


def _counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float()


P = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.05, 0.15, 0.2, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])


def test_a_point_mass_proposal_keeps_the_target_distribution_of_each_position() -> None:
    first, second = _first_tokens(P, [3, 0], None, seed=0)
    assert _chi_square(_counts(first, 5), P[0]) < BOUND
    # The second token exists when the first proposal was kept: then it follows the second row.
    assert abs(len(second) / DRAWS - 0.25) < 0.02
    assert _chi_square(_counts(second, 5), P[1]) < BOUND


def test_a_proposal_drawn_from_a_draft_distribution_keeps_the_target_distribution() -> None:
    q = torch.tensor([[0.5, 0.1, 0.1, 0.2, 0.1], [0.1, 0.1, 0.6, 0.1, 0.1]])
    g = torch.Generator().manual_seed(1)
    first = []
    for _ in range(DRAWS):
        x = int(torch.multinomial(q[0], 1, generator=g))  # the draft's own draw
        out = accept_sampled(P[:2], [x], torch.rand(2, generator=g), q[:1])
        first.append(out[0])
    assert _chi_square(_counts(first, 5), P[0]) < BOUND


def test_unnormalised_rows_and_a_proposal_of_zero_probability() -> None:
    p = torch.tensor([[0.0, 2.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])  # min-p left rows unnormalised
    first, second = _first_tokens(p, [4], None, seed=2)
    assert 4 not in first and 0 not in first and not second  # never kept, never drawn
    assert _chi_square(_counts(first, 5)[1:4], p[0, 1:4]) < BOUND


def test_greedy_accepts_the_longest_matching_prefix_then_the_targets_token() -> None:
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert accept_greedy([1, 2], [3]) == [1]
    assert accept_greedy([4], []) == [4]


def test_a_biased_sampler_fails_the_bound() -> None:
    """The test can fail: always keeping the proposal (no rejection) is far outside the bound."""
    first = [3] * (DRAWS // 2) + _first_tokens(P, [3], None, seed=3)[0][: DRAWS // 2]
    assert _chi_square(_counts(first, 5), P[0]) > 100 * BOUND
