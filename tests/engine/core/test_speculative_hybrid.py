"""Speculative decoding on hybrid targets (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers; Nemotron-H, Falcon-H1 and
Granite 4.0-H: Mamba2 layers; each with a recurrent state per sequence): greedy output token for token as without it.
An oracle proposer that errs at every position of its proposals in turn makes every acceptance length happen, so the
state after each verify must be exactly the one after the last accepted token; batched with beam search, n=2,
max_tokens inside a proposal, under preemption, and a second turn that starts from a page-boundary snapshot taken
during a verify. Then the real n-gram and draft-model proposers on a hybrid target."""

from __future__ import annotations

import pytest

from engine.config import SpeculativeConfig
from tests.engine.core.engine_run import greedy
from tests.engine.core.hybrid_spec import (
    check_snapshots,
    hybrid_requests,
    hybrid_target,
    oracle_engine,
    reference_snapshots,
    run_checked,
    tokens,
)
from tests.engine.model.family_parity import tiny_engine


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next", "nemotron_h", "falcon_h1", "granitemoehybrid"])
def target(request, tmp_path_factory, baked_model_path):
    return hybrid_target(request.param, tmp_path_factory.mktemp(request.param), baked_model_path)


@pytest.fixture(scope="module")
def plain(target):
    requests = hybrid_requests()
    return requests, tokens(run_checked(tiny_engine(target), requests))


def _answers(requests, plain_tokens) -> dict[tuple[int, ...], list[int]]:
    answers: dict[tuple[int, ...], list[int]] = {}
    for r, (prompt, _) in requests.items():
        longest = plain_tokens[r][0]
        if len(longest) > len(answers.get(tuple(prompt), [])):
            answers[tuple(prompt)] = longest
    return answers


def test_every_acceptance_length_leaves_the_state_of_the_last_accepted_token(target, plain):
    requests, want = plain
    answers = _answers(requests, want)
    engine = oracle_engine(target, answers)
    texts = [prompt + choice for r, (prompt, _) in requests.items() for choice in want[r]]
    reference, compared = reference_snapshots(target, texts), []
    original = engine.step

    def step():
        out = original()
        compared.append(check_snapshots(engine, reference))
        return out

    engine.step = step
    assert tokens(run_checked(engine, requests, join_at={"p2": 3, "beam": 2})) == want
    assert sum(compared) > 50
    stats = engine.stats()
    assert 0 < stats["spec_acceptance_rate"] < 1 and stats["spec_mean_accepted_length"] > 2


def test_preempted_speculating_sequences_recompute_the_same_tokens(target, plain):
    requests, want = plain
    picked = {r: requests[r] for r in ("p0", "p1", "p2", "loop")}
    tight = oracle_engine(
        target, _answers(requests, want), max_num_seqs=4, num_kv_pages=20, enable_prefix_caching=False
    )
    assert tokens(run_checked(tight, picked)) == {r: want[r] for r in picked}
    assert tight.scheduler.num_preemptions > 0 and tight.stats()["spec_accepted_tokens"] > 0


def test_a_second_turn_hits_snapshots_taken_during_verifies_and_equals_a_cold_run(target, plain):
    """Snapshots at page boundaries that verifies crossed: one among rejected tokens must never be registered, one
    among accepted tokens holds their state. A second turn over the first one's answer starts from such a snapshot
    and decodes as a cold engine does."""
    requests, want = plain
    prompt = requests["p1"][0]
    engine = oracle_engine(target, _answers(requests, want))
    first = run_checked(engine, {"t1": (prompt, greedy(24, ignore_eos=True))})["t1"].choices[0].token_ids
    assert first == want["p1"][0]
    second = prompt + first + [5, 6, 7]
    cold = run_checked(tiny_engine(target), {"t2": (second, greedy(10, ignore_eos=True))})["t2"]
    engine.speculator.proposer.answers[tuple(second)] = cold.choices[0].token_ids
    warm = run_checked(engine, {"t2": (second, greedy(10, ignore_eos=True))})["t2"]
    assert warm.choices[0].token_ids == cold.choices[0].token_ids
    assert warm.last.num_cached_tokens > len(prompt) + 4  # a snapshot a verify took, past the first prompt
    assert engine.stats()["spec_accepted_tokens"] > 0


def test_ngram_on_a_hybrid_target_equals_plain_decoding(target, plain):
    requests, want = plain
    ngram = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=256
    )
    spec = tiny_engine(target, speculative=ngram)
    assert spec.speculator is not None
    assert tokens(run_checked(spec, requests)) == want
    assert spec.stats()["spec_verify_steps"] > 0


def test_a_draft_model_on_a_hybrid_target_equals_plain_decoding(target, plain, tmp_path, baked_model_path):
    """A tiny random Llama on the same tokenizer and vocabulary drafts for the hybrid: mostly refused, so the
    target's state is replayed by short accepted runs and the draft's shadows are cut back every step."""
    import transformers as tf

    from tests.engine.conftest import ENGINE_TINY, _save_tiny_engine_model

    requests, want = plain
    config = tf.LlamaConfig(**{**ENGINE_TINY, "vocab_size": 128}, num_hidden_layers=1)
    draft = _save_tiny_engine_model(config, tmp_path / "draft", baked_model_path)
    spec = tiny_engine(
        target,
        speculative=SpeculativeConfig(
            method="draft_model", model=str(draft), num_speculative_tokens=3, disable_by_batch_size=256
        ),
    )
    assert tokens(run_checked(spec, requests)) == want
    assert spec.stats()["spec_verify_steps"] > 0
    spec.speculator.proposer.kv.check()
