"""Nemotron-H (Mamba2, attention without positions, relu^2 MLP and experts) against transformers on a tiny random
config in float32: logits on prompts longer than a Mamba2 chunk (16) and its conv window, and on decode steps; greedy
through the engine (chunked prefill under a 16-token budget carries the state between chunks), batched equal to solo;
preempted and recomputed; forked choices (n=2) each from a copy of the prompt's state; a prefix-cache hit starting
from a page-boundary snapshot equal to a cold run; the state pool and the pages in one byte budget."""

from __future__ import annotations

import pytest
import torch

from tests.engine.model.family_parity import (
    check_engine_greedy,
    check_forked_choices,
    check_preemption,
    check_prefill_and_decode,
    check_prefix_hit_from_snapshot,
    load_family,
    tiny_engine,
)
from tests.engine.model.mamba_checkpoints import build_nemotron_h_checkpoint
from tests.engine.model.mamba_family import (
    check_state_slots,
    load_mamba_family,
)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory, baked_model_path):
    return load_mamba_family("nemotron_h", tmp_path_factory, baked_model_path)


def test_blocks_split_into_pages_state_and_neither(nemotron):
    """M E * M - M: the engine counts the blocks that hold a cache (M, *, M, M) on their own."""
    assert [g.layers for g in nemotron.spec.kv_groups] == [(1,)]
    check_state_slots(nemotron.spec, (0, 2, 3))


def test_prefill_lengths_and_decode_match_transformers(nemotron):
    # 1 and 3 tokens sit inside the conv window; 17, 40 and 70 span two to five chunks of the scan
    check_prefill_and_decode(nemotron.model, nemotron.spec, nemotron.hf, lengths=(1, 3, 17, 40, 70), decode_steps=4)


def test_engine_greedy_equals_transformers_batched_and_solo(nemotron):
    check_engine_greedy(nemotron.path, nemotron.hf)


def test_preempted_and_recomputed_equals_uninterrupted(nemotron):
    check_preemption(nemotron.path)


def test_a_prefix_hit_starts_from_the_snapshot_and_equals_a_cold_run(nemotron):
    check_prefix_hit_from_snapshot(nemotron)


def test_forked_choices_each_continue_the_prompt_state(nemotron):
    check_forked_choices(nemotron)


def test_the_state_pool_and_the_pages_share_one_budget(nemotron):
    """KV_CACHE_BYTES covers the Mamba2 states too: the state pool takes at most half (two slots a sequence), which
    lowers max_num_seqs, and the pages the rest."""
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine

    recurrent = nemotron.spec.recurrent
    per_layer = 4 * 8 * 8 * 16 + 4 * (64 + 64) * 3  # float32 SSM state and conv window
    assert recurrent.slot_bytes(torch.float32) == 3 * per_layer
    budget = 20 * 2 * recurrent.slot_bytes(torch.float32)
    engine = LLMEngine(
        EngineConfig(
            model_path=str(nemotron.path), dtype="float32", page_size=4, max_num_seqs=64, kv_cache_bytes=budget
        )
    )
    info = engine.describe()
    assert info["state_seqs"] == engine.max_num_seqs == engine.limits.max_num_seqs == 10
    assert info["state_bytes"] + info["kv_bytes"] <= budget
    assert info["kv_bytes"] > budget // 3


def test_speculative_mtp_is_refused_in_one_line(nemotron):
    from engine.config import SpeculativeConfig
    from engine.errors import StartupError

    with pytest.raises(StartupError, match="multi-token-prediction layers") as err:
        tiny_engine(nemotron.path, speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=1))
    assert "\n" not in str(err.value)


def test_a_stack_without_mamba2_blocks_serves_transformers_tokens(tmp_path, baked_model_path):
    """Attention, MLP and MoE blocks only: no state pool, one KV group whose backend serves every cached block."""
    hf = build_nemotron_h_checkpoint(tmp_path, hybrid_override_pattern="*-E*", layers_block_type=None)
    model, spec = load_family(tmp_path, baked_model_path)
    assert spec.recurrent is None and [g.layers for g in spec.kv_groups] == [(0, 1)]
    check_prefill_and_decode(model, spec, hf, lengths=(3, 17), decode_steps=2)
    check_engine_greedy(tmp_path, hf, max_tokens=4)
