"""A hybrid draft model (Gated DeltaNet layers, as a small Qwen3.5 drafting for a large one): its recurrent state is
saved before its greedy steps and restored after them, so each proposal continues from the target's tokens. The
target as its own draft: greedy output token for token as without speculation and nearly every proposal accepted
(a state left at a rejected guess would make its next proposals wrong); its proposals equal the model's greedy
continuation after the target keeps part of a proposal, and after a shadow gave its state slot up to another."""

from __future__ import annotations

import pytest

from engine.config import SpeculativeConfig
from engine.core.scheduling.sequence import Sequence
from tests.engine.core.engine_run import greedy
from tests.engine.core.hybrid_spec import hybrid_requests, hybrid_target, run_checked, tokens
from tests.engine.model.family_parity import tiny_engine


def _self_draft(path, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="draft_model", model=str(path), num_speculative_tokens=3, **{"disable_by_batch_size": 256, **kw}
    )


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def target(request, tmp_path_factory, baked_model_path):
    return hybrid_target(request.param, tmp_path_factory.mktemp(request.param), baked_model_path)


def test_the_hybrid_as_its_own_draft_is_exact_and_accepts_nearly_everything(target):
    requests = hybrid_requests()
    want = tokens(run_checked(tiny_engine(target), requests))
    spec = tiny_engine(target, speculative=_self_draft(target))
    assert tokens(run_checked(spec, requests, join_at={"p2": 3, "beam": 2})) == want
    stats = spec.stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_acceptance_rate"] > 0.9, stats
    draft = spec.speculator.proposer
    draft.kv.check()
    assert draft.kv.num_free == [a.num_pages for a in draft.kv.allocators]  # every shadow given back


def _continuation(engine, prefix: list[int], n: int) -> list[int]:
    engine.add_request("ref", prefix, greedy(n, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.outputs[0].token_ids
    return out


def test_proposals_continue_from_the_kept_tokens_and_after_giving_the_slot_up(target):
    reference = tiny_engine(target)
    spec = tiny_engine(
        target,
        speculative=_self_draft(target, disable_by_batch_size=1),  # one shadow's slots
        max_num_batched_tokens=64,
    )
    draft = spec.speculator.proposer
    a = Sequence(seq_id=101, token_ids=list(range(5, 22)), num_prompt_tokens=17)
    b = Sequence(seq_id=102, token_ids=list(range(40, 49)), num_prompt_tokens=9)
    for kept in (0, 2, 3, 1):  # the target keeps `kept` of a's guesses and adds a token of its own
        guesses = draft.propose([a], [3])[0]
        assert guesses == _continuation(reference, a.token_ids, 3), kept
        a.token_ids += guesses[:kept] + [(guesses[kept] + 1) % 128 if kept < 3 else 7]
    assert draft.propose([b], [3]) == [_continuation(reference, b.token_ids, 3)]  # a's slot goes to b
    assert draft.propose([a], [3]) == [_continuation(reference, a.token_ids, 3)]  # a runs again from the start
    draft.retain(set())
    draft.kv.check()
    assert draft.kv.num_free == [x.num_pages for x in draft.kv.allocators]
