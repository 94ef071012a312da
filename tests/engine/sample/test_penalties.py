"""The penalties from running per-sequence counts are bit-identical to listing every token anew each step
(penalty_oracle.py), over random batches, and stay so as outputs grow, fork, shrink (rollback) or change."""

from __future__ import annotations

import random

import torch

from engine.sample.logits_processor import SamplingRow, process_logits
from engine.sample.params import SamplingParams
from engine.sample.penalties import PenaltyCounts, apply_penalties
from tests.engine.sample.penalty_oracle import reference_penalties

# Edge values (1.0 / 0.0: that penalty off) and ordinary ones, of every sign the parameters allow.
REPETITION = [1.0, 1.0, 0.5, 0.9, 1.3, 2.0, 7.5]
FREQUENCY = [0.0, 0.0, -2.0, -0.4, 0.7, 2.0]
PRESENCE = [0.0, 0.0, -1.5, 0.3, 2.0]


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        repetition_penalty=rng.choice(REPETITION),
        frequency_penalty=rng.choice(FREQUENCY),
        presence_penalty=rng.choice(PRESENCE),
    )


def random_logits(rng: random.Random, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(rows, vocab, generator=gen) * rng.choice([0.1, 3.0, 30.0])
    # Exact zeros of both signs and -inf (a masked token) take every branch of the arithmetic.
    spots = torch.rand(rows, vocab, generator=gen)
    logits[spots < 0.05] = 0.0
    logits[(spots >= 0.05) & (spots < 0.1)] = -0.0
    logits[(spots >= 0.1) & (spots < 0.13)] = float("-inf")
    return logits


def tokens(rng: random.Random, vocab: int, length: int) -> list[int]:
    # Often a narrow range, so that tokens repeat and the prompt and output overlap.
    hi = rng.choice([vocab, min(vocab, 8)])
    return [rng.randrange(hi) for _ in range(length)]


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def both(logits: torch.Tensor, rows: list[tuple[int, SamplingRow]]) -> tuple[torch.Tensor, torch.Tensor]:
    got, want = logits.clone(), logits.clone()
    apply_penalties(got, rows)
    reference_penalties(want, rows)
    return got, want


def test_random_batches_match_the_reference() -> None:
    rng = random.Random(0)
    for _ in range(200):
        vocab = rng.choice([1, 2, 5, 17, 64, 300, 1000, 49152])
        batch = rng.randint(1, 6)
        rows = [
            SamplingRow(
                params=random_params(rng),
                prompt_token_ids=tokens(rng, vocab, rng.choice([0, 1, 3, 40])),
                output_token_ids=tokens(rng, vocab, rng.choice([0, 1, 2, 9, 60])),
                penalties=rng.choice([None, PenaltyCounts()]),
            )
            for _ in range(batch)
        ]
        # Some rows of the batch are not penalised: the others' indices then skip them.
        picked = sorted(rng.sample(range(batch), rng.randint(1, batch)))
        got, want = both(random_logits(rng, batch, vocab), [(i, rows[i]) for i in picked])
        assert_bitwise_equal(got, want)


def test_counts_kept_across_steps_match_the_reference() -> None:
    """Rows grow a token a step (sometimes several, sometimes shrink or change under the counts) and fork."""
    rng = random.Random(1)
    for _ in range(40):
        vocab = rng.choice([3, 50, 1000])
        rows = [
            SamplingRow(
                params=random_params(rng),
                prompt_token_ids=tokens(rng, vocab, rng.choice([0, 5, 30])),
                output_token_ids=[],
                penalties=PenaltyCounts(),
            )
            for _ in range(rng.randint(1, 5))
        ]
        for _ in range(30):
            got, want = both(random_logits(rng, len(rows), vocab), list(enumerate(rows)))
            assert_bitwise_equal(got, want)
            for r in rows:
                move = rng.random()
                if move < 0.7:
                    r.output_token_ids.append(rng.randrange(vocab))
                elif move < 0.8:
                    r.output_token_ids += tokens(rng, vocab, rng.randint(2, 5))
                elif move < 0.9 and r.output_token_ids:
                    del r.output_token_ids[rng.randrange(len(r.output_token_ids)) :]  # a rollback
                elif r.output_token_ids:
                    r.output_token_ids[-1] = (r.output_token_ids[-1] + 1) % vocab  # replaced in place
            if rng.random() < 0.2:
                # A beam forks: the child copies its parent's tokens and clones its counts.
                parent = rng.choice(rows)
                rows.append(
                    SamplingRow(
                        params=parent.params,
                        prompt_token_ids=parent.prompt_token_ids,
                        output_token_ids=list(parent.output_token_ids),
                        penalties=parent.penalties.fork(),
                    )
                )


def test_process_logits_with_masks_and_counts_matches_the_reference(monkeypatch) -> None:
    rng = random.Random(2)
    vocab = 200
    rows = [
        SamplingRow(
            params=SamplingParams(
                repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.2, logit_bias={3: 4.0}, min_tokens=4
            ),
            prompt_token_ids=tokens(rng, vocab, 20),
            output_token_ids=tokens(rng, vocab, 3),
            eos_token_ids={2},
            penalties=PenaltyCounts(),
        ),
        SamplingRow(params=SamplingParams(), prompt_token_ids=[1], output_token_ids=[5, 5]),
    ]
    logits = random_logits(rng, 2, vocab)
    got = process_logits(logits, rows)
    from engine.sample import logits_processor

    monkeypatch.setattr(logits_processor, "apply_penalties", reference_penalties)
    assert_bitwise_equal(got, process_logits(logits, rows))


def test_a_decode_step_adds_one_token_to_the_counts() -> None:
    state = PenaltyCounts()
    row = SamplingRow(
        params=SamplingParams(frequency_penalty=0.5), prompt_token_ids=[3], output_token_ids=[4, 4, 1], penalties=state
    )
    cpu = torch.device("cpu")
    state.sync(row, 8, cpu)
    assert state.counts.tolist() == [0, 1, 0, 0, 2, 0, 0, 0]
    before = state.counts
    row.output_token_ids.append(7)
    state.sync(row, 8, cpu)
    assert state.counts is before  # updated in place, not rebuilt
    assert before.tolist() == [0, 1, 0, 0, 2, 0, 0, 1]
    child = state.fork()
    row.output_token_ids.append(1)
    state.sync(row, 8, cpu)
    assert child.counts.tolist() == [0, 1, 0, 0, 2, 0, 0, 1]  # the fork has its own counts
    assert state.counts.tolist() == [0, 2, 0, 0, 2, 0, 0, 1]
