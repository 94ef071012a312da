"""Hybrid linear-attention families against transformers on tiny random configs in float32: Qwen3.5 dense and MoE,
Qwen3-Next (fused DeltaNet projections, a dense layer among sparse ones) and the text model of a Qwen3.5 image-text
checkpoint. Logits on prompts longer than one DeltaNet chunk (64) and on decode steps; greedy through the engine
(chunked prefill under a 16-token budget carries the state between chunks), batched equal to solo; preempted and
recomputed; forked choices (n=2, beams) each from a copy of the prompt's state; a prefix-cache hit starting from a
page-boundary snapshot equal to a cold run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import run
from tests.engine.model.family_parity import (
    check_engine_greedy,
    check_forked_choices,
    check_preemption,
    check_prefill_and_decode,
    check_prefix_hit_from_snapshot,
    load_family,
    tiny_engine,
)
from tests.engine.model.hybrid_checkpoints import build_hybrid_checkpoint

CASES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5"]


@pytest.fixture(scope="module", params=CASES)
def hybrid(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_hybrid_checkpoint(request.param, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(kind=request.param, hf=hf, model=model, spec=spec, path=path)


def test_layers_split_into_pages_and_state(hybrid):
    assert [g.layers for g in hybrid.spec.kv_groups] == [(3,)]
    assert hybrid.spec.recurrent.layers == (0, 1, 2)


def test_prefill_lengths_and_decode_match_transformers(hybrid):
    # 70 and 150 tokens span two and three chunks of the chunked delta rule
    check_prefill_and_decode(hybrid.model, hybrid.spec, hybrid.hf, lengths=(1, 13, 70, 150), decode_steps=4)


def test_engine_greedy_equals_transformers_batched_and_solo(hybrid):
    check_engine_greedy(hybrid.path, hybrid.hf)


def test_preempted_and_recomputed_equals_uninterrupted(hybrid):
    check_preemption(hybrid.path)


def test_a_prefix_hit_starts_from_the_snapshot_and_equals_a_cold_run(hybrid):
    check_prefix_hit_from_snapshot(hybrid)


def test_forked_choices_each_continue_the_prompt_state(hybrid):
    check_forked_choices(hybrid, prompt_length=11)


@pytest.mark.parametrize("kind", ["qwen3_5_text"])
def test_beam_search_returns_transformers_beams(kind, tmp_path, baked_model_path):
    """Beams fork and drop sequences every step, each with its own copy of the recurrent state."""
    hf = build_hybrid_checkpoint(kind, tmp_path)
    load_family(tmp_path, baked_model_path)
    prompt = torch.randint(3, 128, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=8, ignore_eos=True)
    got = run(tiny_engine(tmp_path), {"b": (prompt, params)})["b"]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            num_beams=3,
            num_return_sequences=2,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            early_stopping=False,
            length_penalty=1.0,
        )
    assert [got.choices[i].token_ids for i in range(2)] == ref[:, len(prompt) :].tolist()


def test_the_state_pool_and_the_pages_share_one_budget(hybrid):
    """KV_CACHE_BYTES covers both: the state pool takes at most half (two slots a sequence, one for its prefix
    snapshots), which lowers max_num_seqs, and the pages the rest."""
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine

    per_seq = 2 * hybrid.spec.recurrent.slot_bytes(torch.float32)
    budget = 20 * per_seq
    engine = LLMEngine(
        EngineConfig(model_path=str(hybrid.path), dtype="float32", page_size=4, max_num_seqs=64, kv_cache_bytes=budget)
    )
    info = engine.describe()
    assert info["state_seqs"] == engine.max_num_seqs == engine.limits.max_num_seqs == 10
    assert info["state_bytes"] + info["kv_bytes"] <= budget
    assert info["kv_bytes"] > budget // 3
