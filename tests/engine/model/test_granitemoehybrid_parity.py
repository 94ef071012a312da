"""Granite 4.0-H (Mamba2 and attention mixers, experts beside the shared MLP, Granite's four scalars) against
transformers on a tiny random config in float32: logits on prompts longer than a Mamba2 chunk (16) and its conv window
and on decode steps; greedy through the engine (chunked prefill, batched equal to solo, from the prefix cache);
preempted and recomputed; forked choices (n=2); the dense variant (no experts: Micro) and rotary attention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import run
from tests.engine.model.family_parity import (
    check_engine_greedy,
    check_preemption,
    check_prefill_and_decode,
    load_family,
    reference_logits,
    tiny_engine,
)
from tests.engine.model.mamba_checkpoints import build_granite_hybrid_checkpoint


@pytest.fixture(scope="module")
def granite(tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp("granitemoehybrid")
    hf = build_granite_hybrid_checkpoint(path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(hf=hf, model=model, spec=spec, path=path)


def test_layers_split_into_pages_and_state_slots(granite):
    assert [g.layers for g in granite.spec.kv_groups] == [(1,)]
    assert granite.spec.recurrent.layers == (0, 2, 3)
    assert granite.spec.recurrent.state_shape == (8, 8, 16)  # heads, head_dim, d_state
    assert granite.spec.recurrent.conv_shape == (64 + 2 * 2 * 16, 3)


def test_prefill_lengths_and_decode_match_transformers(granite):
    # 1 and 3 tokens sit inside the conv window; 17, 40 and 70 span two to five chunks of the scan
    check_prefill_and_decode(granite.model, granite.spec, granite.hf, lengths=(1, 3, 17, 40, 70), decode_steps=4)


def test_engine_greedy_equals_transformers_batched_solo_and_from_the_prefix_cache(granite):
    check_engine_greedy(granite.path, granite.hf)


def test_preempted_and_recomputed_equals_uninterrupted(granite):
    check_preemption(granite.path)


def test_forked_choices_each_continue_the_prompt_state(granite):
    """n=2 sampled choices fork from one prefilled prompt: every sampled token's logprob is transformers' for that
    choice's own context."""
    prompt = torch.randint(3, 128, (19,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, logprobs=0, ignore_eos=True)
    got = run(tiny_engine(granite.path), {"f": (prompt, params)})["f"]
    assert got.choices[0].token_ids != got.choices[1].token_ids
    for choice in got.choices.values():
        ref = torch.log_softmax(reference_logits(granite.hf, prompt + choice.token_ids), -1)
        for i, (t, lp) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
            assert abs(lp.chosen.logprob - float(ref[len(prompt) - 1 + i, t])) < 1e-4


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
