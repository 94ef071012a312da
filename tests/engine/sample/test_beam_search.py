"""Beam search bookkeeping on a hand-made tree whose winner depends on the length penalty."""

from __future__ import annotations

import pytest

from engine.sample.beam_search import BeamSearch, beam_score

EOS = 0

# Each step: for each live beam (best first), its top 2*width next (token, logprob).
STEP1 = [[(EOS, -1.0), (1, -1.2), (2, -2.0), (3, -3.0)]]
STEP2 = [
    [(EOS, -0.1), (4, -0.3), (8, -4.0), (9, -5.0)],  # after [1], cum -1.2
    [(5, -0.2), (EOS, -0.5), (8, -4.0), (9, -5.0)],  # after [2], cum -2.0
]
STEP3 = [
    [(EOS, -0.05), (6, -1.0), (8, -4.0), (9, -5.0)],  # after [1, 4], cum -1.5
    [(EOS, -0.1), (7, -0.5), (8, -4.0), (9, -5.0)],  # after [2, 5], cum -2.2
]


def run(length_penalty: float, early_stopping: bool = False) -> BeamSearch:
    search = BeamSearch(
        width=2, length_penalty=length_penalty, early_stopping=early_stopping, stop_token_ids={EOS}, max_tokens=3
    )
    for cands in (STEP1, STEP2, STEP3):
        if search.done:
            break
        search.step(cands)
    return search


def test_beam_score_formula() -> None:
    assert beam_score(-3.0, 4, 0.5) == pytest.approx(-1.5)
    assert beam_score(-3.0, 4, 1.0) == pytest.approx(-0.75)
    assert beam_score(-3.0, 4, 0.0) == pytest.approx(-3.0)


def test_live_beams_and_parents_after_each_step() -> None:
    search = BeamSearch(width=2, stop_token_ids={EOS})
    live = search.step(STEP1)
    assert [b.token_ids for b in live] == [[1], [2]]
    assert [b.finished for b in search.finished] == [True] and search.finished[0].token_ids == [EOS]
    live = search.step(STEP2)
    # [2, EOS] ranks 4th of the pool, outside the width, so it is not kept as a finished hypothesis.
    assert [(b.token_ids, b.parent) for b in live] == [([1, 4], 0), ([2, 5], 1)]
    assert [b.cum_logprob for b in live] == pytest.approx([-1.5, -2.2])
    assert live[0].logprobs == pytest.approx([-1.2, -0.3])
    assert sorted(b.token_ids for b in search.finished) == [[EOS], [1, EOS]]


def test_length_penalty_1_prefers_the_longer_hypothesis() -> None:
    search = run(length_penalty=1.0)
    assert search.done and search.live == []
    best = search.best(2)
    # [1, 4, EOS]: -1.55 over 2 tokens = -0.775 beats [1, 4, 6] (-2.5 / 3) and [EOS] (-1.0 / 1).
    assert [b.token_ids for b in best] == [[1, 4, EOS], [1, 4, 6]]
    assert best[0].cum_logprob == pytest.approx(-1.55)


def test_length_penalty_0_ranks_by_the_raw_sum() -> None:
    search = run(length_penalty=0.0)
    # Done after step 2: no live beam (best -1.5) can beat the worst finished one (-1.3) any more.
    assert search.done and len(search.live) == 2
    assert [b.token_ids for b in search.best(2)] == [[EOS], [1, EOS]]


def test_done_conditions() -> None:
    search = BeamSearch(width=2, stop_token_ids={EOS})
    search.step(STEP1)
    assert not search.done  # one finished of two
    search.step(STEP2)
    # Two finished (worst -1.3); the best live beam scores -1.5 / 2 = -0.75, which could still win.
    assert not search.done
    early = BeamSearch(width=2, early_stopping=True, stop_token_ids={EOS})
    early.step(STEP1)
    early.step(STEP2)
    assert early.done


def test_max_tokens_finishes_the_live_beams() -> None:
    search = BeamSearch(width=2, stop_token_ids={EOS}, max_tokens=2)
    search.step(STEP1)
    search.step(STEP2)
    assert search.done and search.live == []
    # [1, 4]: -1.5 / 2 beats [EOS] (-1.0), [2, 5] (-2.2 / 2) and [1, EOS] (-1.3 / 1).
    assert [b.token_ids for b in search.best(2)] == [[1, 4], [EOS]]


def test_with_width_finished_beams_only_finished_ones_come_back() -> None:
    # early_stopping: two beams end in the stop token by the second step; the live [5, 5] must not be returned
    # (transformers and vLLM return the finished hypotheses once there are width of them).
    bs = BeamSearch(width=2, early_stopping=True, stop_token_ids={9}, max_tokens=10)
    bs.step([[(5, -0.1), (9, -0.5), (6, -0.6), (7, -3.0)]])
    bs.step([[(5, -0.05), (9, -0.2), (7, -4.0), (8, -4.1)], [(9, -5.0), (5, -6.0), (7, -7.0), (8, -8.0)]])
    assert bs.done and bs.live
    assert [(b.token_ids, b.finished) for b in bs.best(2)] == [([5, 9], True), ([9], True)]
