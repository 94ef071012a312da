"""Speculative decoding at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes): the proposers run on rank 0,
each verify is one sharded forward of the model. n-gram on a tiny Llama and on a Qwen3.5 hybrid (whose verified
rows every rank replays into its own DeltaNet states once rank 0 knows how many were kept), and a hybrid draft model
(the target as its own draft, unsharded on rank 0): greedy output token for token as one rank without speculation.
The hidden-state heads (EAGLE-3, MTP) are refused in one line; no rank is left behind."""

from __future__ import annotations

import pytest

from engine.config import SpeculativeConfig
from engine.errors import StartupError
from tests.engine.core.distributed.tp_models import child_pids, save_tp_model
from tests.engine.core.hybrid_spec import hybrid_requests, hybrid_target, run_checked, tokens
from tests.engine.model.family_parity import tiny_engine

NGRAM = SpeculativeConfig(
    method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=256
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, baked_model_path):
    return save_tp_model("llama_biased", tmp_path_factory.mktemp("llama"), baked_model_path)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, baked_model_path):
    return hybrid_target("qwen3_5_text", tmp_path_factory.mktemp("qwen3_5_text"), baked_model_path)


def _check_against_one_rank(path, speculative: SpeculativeConfig, min_acceptance: float = 0.0) -> None:
    requests = hybrid_requests()
    want = tokens(run_checked(tiny_engine(path), requests))
    before = child_pids()
    two = tiny_engine(path, tensor_parallel_size=2, speculative=speculative)
    try:
        assert tokens(run_checked(two, requests, join_at={"p2": 3, "beam": 2})) == want
        stats = two.stats()
        assert stats["spec_verify_steps"] > 0 and stats["spec_acceptance_rate"] >= min_acceptance, stats
    finally:
        two.close()
    assert child_pids() <= before, "a rank outlived its engine"


def test_ngram_at_two_ranks_equals_one_rank_without_speculation(llama, hybrid):
    for path in (llama, hybrid):
        _check_against_one_rank(path, NGRAM)


def test_a_hybrid_draft_at_two_ranks_is_exact_and_accepts_nearly_everything(hybrid):
    draft = SpeculativeConfig(
        method="draft_model", model=str(hybrid), num_speculative_tokens=3, disable_by_batch_size=256
    )
    _check_against_one_rank(hybrid, draft, min_acceptance=0.9)


def test_the_hidden_state_heads_are_refused_at_two_ranks_in_one_line(hybrid):
    with pytest.raises(StartupError, match="speculative method mtp does not run tensor-parallel") as info:
        tiny_engine(
            hybrid, tensor_parallel_size=2, speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2)
        )
    assert "\n" not in str(info.value)
