"""Sampler behaviour: greedy, masks, penalties, truncation, seeded draws and reported logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.logits_processor import SamplingRow, process_logits, tokenize_bad_words
from engine.sample.params import SamplingParams
from engine.sample.sampler import Sampler, compute_logprobs

EOS = 2


def row(
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    seed: int | None = None,
    bad_words_ids: list[list[int]] | None = None,
    **kw,
) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(
        params=SamplingParams(**kw),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=gen,
        eos_token_ids={EOS},
        bad_words_ids=bad_words_ids or [],
    )


def draws(logits: torch.Tensor, count: int, seed: int = 0, **kw) -> list[int]:
    """`count` independent draws from one row of logits, in one batch (global RNG, seeded)."""
    torch.manual_seed(seed)
    rows = [row(**kw) for _ in range(count)]
    return Sampler()(logits.expand(count, -1).clone(), rows).token_ids


def test_greedy_is_argmax_and_logprobs_are_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 64) * 3
    out = Sampler()(logits, [row(temperature=0, logprobs=3) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        values, ids = ref[i].topk(3)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-5)


def test_logprobs_are_of_the_raw_distribution_not_the_processed_one() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    out = Sampler()(logits, [row(temperature=0, logit_bias={0: 50}, repetition_penalty=1.5, output=[3], logprobs=0)])
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item(), abs=1e-6)
    assert out.top_logprobs == [[]]


def test_top_logprobs_only_for_rows_that_ask() -> None:
    logits = torch.randn(3, 32)
    out = Sampler()(logits, [row(temperature=0), row(temperature=0, logprobs=2), row(temperature=0, logprobs=5)])
    assert [len(t) for t in out.top_logprobs] == [0, 2, 5]
    assert Sampler()(logits, [row(temperature=0)] * 3).top_logprobs is None


def test_penalties_match_a_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    r = row(prompt=[0], output=[1, 3, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(logits, [r])[0].tolist()
    # 0: prompt only -> 2/2. 1: once in output, negative -> -1*2 - 0.5 - 0.25. 3: twice -> 3/2 - 2*0.5 - 0.25.
    assert got == pytest.approx([1.0, -2.75, 0.5, 0.25, 0.0])


def test_penalties_apply_per_row_and_leave_other_rows_alone() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    rows = [row(output=[0], temperature=0, presence_penalty=1.0), row(output=[0], temperature=0)]
    processed = process_logits(logits, rows)
    assert processed[0].tolist() == pytest.approx([2.0, 2.9, 0.0])
    assert processed[1].tolist() == pytest.approx([3.0, 2.9, 0.0])
    assert Sampler()(logits, rows).token_ids == [1, 0]


def test_logit_bias_minus_100_bans_and_plus_100_forces() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 10.0]])
    assert Sampler()(logits, [row(temperature=0, logit_bias={3: -100})]).token_ids == [2]
    assert set(draws(logits, 500, logit_bias={3: -100})) <= {0, 1, 2}
    assert set(draws(logits, 200, logit_bias={0: 100})) == {0}


def test_allowed_token_ids() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 50)
    allowed = [4, 9, 31]
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert Sampler()(logits, [row(temperature=0, allowed_token_ids=allowed)]).token_ids == [best]
    assert set(draws(logits, 500, allowed_token_ids=allowed, temperature=3.0)) == set(allowed)
    # Only the restricted row is restricted.
    both = Sampler()(logits.repeat(2, 1), [row(temperature=0), row(temperature=0, allowed_token_ids=allowed)])
    assert both.token_ids == [logits.argmax().item(), best]


def test_bad_words_single_and_multi_token() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0, 1.0, 0.0, 9.0]])
    bad = [[3], [5, 7]]
    # A single-token word is always banned; [5, 7] bans 7 only right after 5.
    assert Sampler()(logits, [row(temperature=0, output=[1], bad_words_ids=bad)]).token_ids == [7]
    assert Sampler()(logits, [row(temperature=0, output=[1, 5], bad_words_ids=bad)]).token_ids == [5]
    assert Sampler()(logits, [row(temperature=0, output=[5, 1], bad_words_ids=bad)]).token_ids == [7]


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 2.0]])  # eos (2) best, then 3
    sampler = Sampler()
    kw = dict(temperature=0, min_tokens=3, stop_token_ids=[3])
    assert sampler(logits, [row(output=[1, 1], **kw)]).token_ids == [4]
    assert sampler(logits, [row(output=[1, 1, 1], **kw)]).token_ids == [2]
    # ignore_eos never stops on eos, so min_tokens leaves eos alone; stop tokens stay masked.
    assert sampler(logits, [row(output=[1], ignore_eos=True, **kw)]).token_ids == [2]
    assert set(draws(logits, 300, output=[1], min_tokens=3, stop_token_ids=[3])) <= {0, 1, 4}


def test_top_k_1_equals_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(16, 300)
    rows = [row(top_k=1, temperature=1.5, seed=i) for i in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_sampling_follows_the_tempered_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    n = 4000
    counts = torch.bincount(torch.tensor(draws(logits, n, temperature=0.7)), minlength=4).float() / n
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(counts, expected, atol=0.03)


def test_top_k_top_p_min_p_never_sample_excluded_tokens() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    # top_p 0.75 keeps 1 (0.5) and 3 (mass before it 0.5 < 0.75), drops 2 (0.8 before it) and 0.
    assert set(draws(logits, 1000, seed=1, top_p=0.75)) == {1, 3}
    # min_p 0.25: keep p >= 0.125 -> {1, 3, 2}.
    assert set(draws(logits, 1000, seed=2, min_p=0.25)) == {1, 2, 3}
    assert set(draws(logits, 1000, seed=3, top_k=2)) == {1, 3}
    # Combined: top_k 3 keeps {1, 3, 2}; then top_p 0.9 on the renormalised {0.526, 0.316, 0.158} keeps all three.
    assert set(draws(logits, 1000, seed=4, top_k=3, top_p=0.9)) == {1, 2, 3}


def test_seeded_rows_reproduce_whatever_else_is_in_the_batch() -> None:
    torch.manual_seed(3)
    steps = [torch.randn(8, 1000) for _ in range(10)]
    target = dict(seed=1234, temperature=0.9, top_p=0.95)

    # Same generator object across steps, as the engine keeps one per sequence.
    gen_row = row(**target)
    alone_again = [Sampler()(logits[:1], [gen_row]).token_ids[0] for logits in steps]
    assert len(set(alone_again)) > 1  # a real draw, not a constant

    others = [
        dict(temperature=0),
        dict(seed=7),
        dict(),
        dict(top_k=5, seed=9),
        dict(min_p=0.1),
        dict(presence_penalty=1.0, output=[1, 2, 3]),
        dict(temperature=0.3, logit_bias={5: 10}),
    ]
    mixed_target = row(**target)
    mixed_rows = [row(**o) for o in others[:3]] + [mixed_target] + [row(**o) for o in others[3:]]
    mixed = []
    for logits in steps:
        batch = torch.cat([logits[1:4], logits[:1], logits[4:]])
        mixed.append(Sampler()(batch, mixed_rows).token_ids[3])

    fresh = row(**target)
    fresh_run = [Sampler()(logits[:1], [fresh]).token_ids[0] for logits in steps]
    assert fresh_run == mixed == alone_again


def test_compute_logprobs_for_prompt_positions() -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 20)
    ids = [3, 0, 19, 7]
    result = compute_logprobs(logits, ids, k=2)
    ref = torch.log_softmax(logits, -1)
    for pos, (chosen, top) in enumerate(result):
        assert chosen == pytest.approx(ref[pos, ids[pos]].item(), abs=1e-6)
        assert [t for t, _ in top] == ref[pos].topk(2).indices.tolist()
    assert all(top == [] for _, top in compute_logprobs(logits, ids, k=0))


def test_tokenize_bad_words_with_the_real_tokenizer(baked_model_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(baked_model_path)
    ids = tokenize_bad_words(tok, ["hello"])
    assert tok.encode("hello", add_special_tokens=False) in ids
    assert tok.encode(" hello", add_special_tokens=False) in ids


def nucleus(logits: torch.Tensor, top_p: float, top_k: int = 0) -> set[int]:
    """Reference keep-set: full sort, top_k, renormalise, keep while the mass before a token is < top_p."""
    values, order = logits[0].sort(descending=True)
    if top_k:
        values, order = values[:top_k], order[:top_k]
    probs = torch.softmax(values.double(), -1)
    before = probs.cumsum(-1) - probs
    return set(order[before < top_p].tolist())


# Nuclei of 9 to 1574 tokens: inside the sampler's ranked head and past it (its full-sort fallback).
@pytest.mark.parametrize("scale", [0.5, 2.0, 3.0])
def test_top_p_matches_a_full_sort_reference(scale: float) -> None:
    torch.manual_seed(5)
    logits = torch.randn(1, 2000) * scale
    for top_p, top_k in ((0.5, 0), (0.9, 0), (0.8, 300)):
        keep = nucleus(logits, top_p, top_k)
        got = set(draws(logits, 1000, seed=6, top_p=top_p, top_k=top_k))
        assert got <= keep
        assert len(got) >= min(len(keep), 50)  # the draw spreads over the nucleus


def test_logprobs_only_computed_for_rows_that_report_or_rank_them() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 32) * 3
    rows = [row(temperature=0), row(temperature=0, logprobs=2), row(temperature=0), row(temperature=0, best_of=3)]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert math.isnan(out.logprobs[0]) and math.isnan(out.logprobs[2])
    for i in (1, 3):
        assert out.logprobs[i] == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
    assert out.top_logprobs[0] == [] and out.top_logprobs[3] == []
    assert [t for t, _ in out.top_logprobs[1]] == ref[1].topk(2).indices.tolist()
    assert Sampler()(logits, [row(temperature=0)] * 4).top_logprobs is None
