"""engine.sample.sampler on CUDA (the sampler the GPU path runs: torch, no FlashInfer sampling kernel, because
a seeded request must draw the same tokens whatever shares its batch): a seeded row repeats itself alone and
among other rows, top-k / top-p / min-p keep their support, and greedy rows take the argmax."""

from __future__ import annotations

import torch

from engine.sample.logits_processor import SamplingRow
from engine.sample.params import SamplingParams
from engine.sample.sampler import Sampler


def row(seed: int | None = None, **params) -> SamplingRow:
    gen = None if seed is None else torch.Generator("cuda").manual_seed(seed)
    return SamplingRow(
        params=SamplingParams(max_tokens=1, **params), prompt_token_ids=[1, 2], output_token_ids=[], generator=gen
    )


def test_a_seeded_row_draws_the_same_token_alone_and_in_a_batch():
    logits = torch.randn(6, 32000, device="cuda") * 2
    alone = [Sampler()(logits[i : i + 1], [row(seed=7, temperature=1.0)]).token_ids[0] for i in range(6)]
    batched = Sampler()(logits, [row(seed=7, temperature=1.0) for _ in range(6)]).token_ids
    assert batched == alone


def test_truncation_keeps_its_support_and_greedy_takes_the_argmax():
    logits = torch.randn(4, 32000, device="cuda") * 3
    top5 = logits.topk(5).indices.tolist()
    for _ in range(10):
        out = Sampler()(
            logits,
            [
                row(temperature=1.0, top_k=5),
                row(temperature=1.0, top_p=0.3),
                row(temperature=1.0, min_p=0.5),
                row(temperature=0.0),
            ],
        ).token_ids
        assert out[0] in top5[0]
        probs = logits[1].softmax(-1)
        assert (
            probs[out[1]]
            >= probs.sort(descending=True).values[(probs.sort(descending=True).values.cumsum(0) < 0.3).sum()]
        )
        p2 = logits[2].softmax(-1)
        assert p2[out[2]] >= 0.5 * p2.max()
        assert out[3] == int(logits[3].argmax())
