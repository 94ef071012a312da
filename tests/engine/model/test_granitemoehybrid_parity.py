"""Granite 4.0-H (Mamba2 and attention mixers, experts beside the shared MLP, Granite's four scalars) against
transformers on a tiny random config in float32: logits on prompts longer than a Mamba2 chunk (16) and its conv window
and on decode steps; greedy through the engine (chunked prefill, batched equal to solo, from the prefix cache);
preempted and recomputed; forked choices (n=2); the dense variant (no experts: Micro) and rotary attention."""

from __future__ import annotations

import pytest

from tests.engine.model.family_parity import (
    check_engine_greedy,
    check_forked_choices,
    check_preemption,
    check_prefill_and_decode,
    load_family,
)
from tests.engine.model.mamba_checkpoints import build_granite_hybrid_checkpoint
from tests.engine.model.mamba_family import check_state_slots, load_mamba_family


@pytest.fixture(scope="module")
def granite(tmp_path_factory, baked_model_path):
    return load_mamba_family("granitemoehybrid", tmp_path_factory, baked_model_path)


def test_layers_split_into_pages_and_state_slots(granite):
    assert [g.layers for g in granite.spec.kv_groups] == [(1,)]
    check_state_slots(granite.spec, (0, 2, 3))


def test_prefill_lengths_and_decode_match_transformers(granite):
    # 1 and 3 tokens sit inside the conv window; 17, 40 and 70 span two to five chunks of the scan
    check_prefill_and_decode(granite.model, granite.spec, granite.hf, lengths=(1, 3, 17, 40, 70), decode_steps=4)


def test_engine_greedy_equals_transformers_batched_solo_and_from_the_prefix_cache(granite):
    check_engine_greedy(granite.path, granite.hf)


def test_preempted_and_recomputed_equals_uninterrupted(granite):
    check_preemption(granite.path)


def test_forked_choices_each_continue_the_prompt_state(granite):
    check_forked_choices(granite)


@pytest.mark.parametrize(
    "change",
    [
        {"num_local_experts": 0},  # Granite-4.0-H-Micro: the shared MLP alone
        {"position_embedding_type": "rope", "layer_types": ["attention", "mamba", "attention"], "num_hidden_layers": 3},
    ],
    ids=["dense", "rope"],
)
def test_variants_match_transformers(change, tmp_path, baked_model_path):
    hf = build_granite_hybrid_checkpoint(tmp_path, **change)
    model, spec = load_family(tmp_path, baked_model_path)
    check_prefill_and_decode(model, spec, hf, lengths=(3, 17, 40), decode_steps=3)
    check_engine_greedy(tmp_path, hf, max_tokens=6)
