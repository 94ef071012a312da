"""Falcon-H1 (attention and Mamba2 side by side in every layer, μP multipliers everywhere) against transformers on a
tiny random config in float32: logits on prompts longer than a Mamba2 chunk (16) and its conv window, and on decode
steps; greedy through the engine (chunked prefill, batched, solo, from the prefix cache) equal to transformers';
preempted and recomputed; forked choices (n=2) each from a copy of the prompt's state; each layer's attention and
mixer numbered as two caches; a multiplier left out shows."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.sample.params import SamplingParams
from tests.engine.core.eagle3_heads import head_reference, write_head
from tests.engine.model.family_parity import (
    check_engine_greedy,
    check_forked_choices,
    check_preemption,
    check_prefill_and_decode,
    check_prefix_hit_from_snapshot,
    greedy,
    load_family,
    tiny_engine,
)
from tests.engine.model.mamba_checkpoints import build_falcon_h1_checkpoint
from tests.engine.model.mamba_family import (
    check_state_slots,
    load_mamba_family,
)

# An EAGLE-3 head as wide as the tiny model (it shares its embedding)
HEAD = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96)


@pytest.fixture(scope="module")
def falcon(tmp_path_factory, baked_model_path):
    return load_mamba_family("falcon_h1", tmp_path_factory, baked_model_path)


def test_each_layer_holds_pages_and_a_state_slot(falcon):
    """Layer i's attention is cache 2i (its pages), its mixer cache 2i + 1 (its state slot)."""
    assert [g.layers for g in falcon.spec.kv_groups] == [(0, 2, 4)]
    assert falcon.spec.kv_groups[0].scale == pytest.approx(1.4 / 4)  # key_multiplier / sqrt(head_dim)
    check_state_slots(falcon.spec, (1, 3, 5))


def test_prefill_lengths_and_decode_match_transformers(falcon):
    # 1 and 3 tokens sit inside the conv window; 17, 40 and 70 span two to five chunks of the scan
    check_prefill_and_decode(falcon.model, falcon.spec, falcon.hf, lengths=(1, 3, 17, 40, 70), decode_steps=4)


@pytest.mark.parametrize(
    "change", [{"mamba_rms_norm": False}, {"mamba_norm_before_gate": False}], ids=["no_norm", "gate_then_norm"]
)
def test_the_mixer_gate_options_match_transformers(change, tmp_path, baked_model_path):
    hf = build_falcon_h1_checkpoint(tmp_path, **change)
    model, spec = load_family(tmp_path, baked_model_path)
    check_prefill_and_decode(model, spec, hf, lengths=(3, 40), decode_steps=2)


def test_engine_greedy_equals_transformers_batched_and_solo(falcon):
    check_engine_greedy(falcon.path, falcon.hf)


def test_preempted_and_recomputed_equals_uninterrupted(falcon):
    check_preemption(falcon.path)


def test_a_prefix_hit_starts_from_the_snapshot_and_equals_a_cold_run(falcon):
    check_prefix_hit_from_snapshot(falcon)


def test_forked_choices_each_continue_the_prompt_state(falcon):
    check_forked_choices(falcon)


def test_an_eagle3_head_reads_the_layers_transformers_gives(falcon, tmp_path):
    """An EAGLE-3 head's guesses after a prompt equal the reference fed transformers' hidden states entering its
    layers (the residual stream, embeddings times embedding_multiplier at layer 0), and greedy output is unchanged."""
    from safetensors.torch import load_file

    config = json.loads((falcon.path / "config.json").read_text())
    write_head(tmp_path, config, draft_vocab=128, head=HEAD)
    speculative = SpeculativeConfig(method="eagle3", model=str(tmp_path), num_speculative_tokens=3)
    engine = tiny_engine(falcon.path, speculative=speculative)
    prompt = torch.randint(3, 128, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    seq = engine._groups["r"].seqs[0]
    while len(seq.token_ids) == len(prompt):  # the prefill, in chunks: the head catches up and guesses once
        engine.step()
    guesses = engine.speculator.proposer.propose([seq], [3])[0]
    engine.abort("r")
    with torch.no_grad():
        out = falcon.hf(torch.tensor([prompt]), output_hidden_states=True)
    features = torch.cat([out.hidden_states[i][0] for i in (2, 1, 0)], -1)  # EAGLE-3's (2, L // 2, L - 3)
    next_token = int(out.logits[0, -1].argmax())
    assert seq.token_ids[len(prompt)] == next_token
    tensors = load_file(str(tmp_path / "model.safetensors"))
    embed = falcon.hf.model.embed_tokens.weight
    assert guesses == head_reference(tensors, embed, prompt + [next_token], features, 128, steps=3, head=HEAD)
    assert greedy(engine, {"p": prompt}, 8) == greedy(tiny_engine(falcon.path), {"p": prompt}, 8)
