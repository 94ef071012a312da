"""Penalties through the engine: the running per-sequence counts give the tokens that listing every token anew
each step (tests/engine/sample/penalty_oracle.py) gives, across batching, choices (n), beams and preemption."""

from __future__ import annotations

import pytest

from engine.core.engine import LLMEngine
from engine.sample import logits_processor
from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import greedy, make_engine, random_prompts, run
from tests.engine.sample.penalty_oracle import reference_penalties

PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=0.8),
    dict(presence_penalty=1.5),
    dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.4),
    dict(repetition_penalty=2.0, presence_penalty=-1.0),
    {},  # an unpenalised row in the same batch
]


def requests() -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = random_prompts(len(PENALTIES), 1, 30, seed=21)
    reqs = {
        f"g{i}": (p, greedy(24 + 3 * i, ignore_eos=True, **kw))
        for i, (p, kw) in enumerate(zip(prompts, PENALTIES, strict=True))
    }
    prompt = random_prompts(1, 12, 12, seed=22)[0]
    reqs["n"] = (
        prompt,
        SamplingParams(
            n=3, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.6
        ),
    )
    reqs["beam"] = (
        prompt,
        SamplingParams(
            n=2,
            best_of=3,
            use_beam_search=True,
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            presence_penalty=1.2,
            repetition_penalty=1.2,
        ),
    )
    return reqs


def tokens(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[list[int]]]:
    got = run(engine, reqs)
    return {r: [got[r].choices[i].token_ids for i in sorted(got[r].choices)] for r in reqs}


def test_penalised_outputs_equal_the_reference(tiny_model_path, monkeypatch):
    reqs = requests()
    got = tokens(make_engine(tiny_model_path, page_size=4), reqs)
    with monkeypatch.context() as m:
        m.setattr(logits_processor, "apply_penalties", reference_penalties)
        want = tokens(make_engine(tiny_model_path, page_size=4), reqs)
    assert got == want
    # The penalties must change something, or the comparison proves nothing.
    plain = tokens(
        make_engine(tiny_model_path, page_size=4),
        {
            r: (
                p,
                SamplingParams(
                    **{**params.__dict__, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
                ),
            )
            for r, (p, params) in reqs.items()
        },
    )
    changed = [r for r in reqs if plain[r] != got[r]]
    assert len(changed) >= len(reqs) - 2, changed


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_penalised_outputs_survive_preemption(tiny_model_path, monkeypatch, prefix_caching):
    # A pool too small for all six at once: some are preempted by recompute and come back with their counts.
    prompts = random_prompts(6, 8, 14, seed=4)
    reqs = {str(i): (p, greedy(18, ignore_eos=True, **PENALTIES[i % 5])) for i, p in enumerate(prompts)}
    kw = dict(page_size=4, num_kv_pages=14, max_model_len=40, enable_prefix_caching=prefix_caching)
    engine = make_engine(tiny_model_path, **kw)
    got = tokens(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    with monkeypatch.context() as m:
        m.setattr(logits_processor, "apply_penalties", reference_penalties)
        want = tokens(make_engine(tiny_model_path, page_size=4), reqs)
    assert got == want
