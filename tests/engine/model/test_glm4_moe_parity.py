"""GLM-4.5 (Glm4MoeForCausalLM) against transformers on tiny random configs in float32: a dense first layer
(first_k_dense_replace), sigmoid routing with a correction bias, a routed scaling factor and shared experts,
partial rotary 0.5, qkv bias and q/k norm; one case with grouped top-k (4 groups, 2 kept). From the hub's per-expert
layout (with the next-n prediction layer the hub's checkpoints carry, not read) and transformers 5's fused one;
chunked prefill, a prefix-cache hit and preemption through the engine.
Also the bake's check of the folder (what it refuses: tests/engine/model/test_moe_bake.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model.folder_check import check_model_folder
from engine.model.layers import moe as moe_layer
from engine.model.layers.moe import SparseMoE
from engine.model.layers.routing import grouped_top_k
from engine.model.models.llama import LlamaMLP
from tests.engine.model.family_parity import (
    Pages,
    check_engine_greedy,
    check_preemption,
    check_prefill_and_decode,
    load_family,
)
from tests.engine.model.moe_checkpoints import build_moe_checkpoint

CASES = ["glm4_moe/hub", "glm4_moe/fused", "glm4_moe_grouped/hub"]


@pytest.fixture(scope="module", params=CASES)
def glm(request, tmp_path_factory, baked_model_path):
    kind, layout = request.param.split("/")
    path = tmp_path_factory.mktemp(kind + "-" + layout)
    hf = build_moe_checkpoint(kind, layout, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(kind=kind, layout=layout, hf=hf, model=model, spec=spec, path=path)


def test_layers_before_first_k_dense_replace_are_dense_and_half_of_each_head_rotates(glm):
    layers = glm.model.model.layers
    assert isinstance(layers[0].mlp, LlamaMLP)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in layers[1:])
    shared = glm.hf.config.n_shared_experts * glm.hf.config.moe_intermediate_size
    assert layers[1].mlp.shared_experts.down_proj.in_features == shared
    assert glm.model.rotary.rotary_dim == glm.spec.head_dim // 2


def test_prefill_lengths_and_decode_match_transformers(glm):
    check_prefill_and_decode(glm.model, glm.spec, glm.hf, lengths=(1, 7, 30), decode_steps=6)


def test_the_per_expert_path_matches_transformers(glm, monkeypatch):
    """The loop over active experts (quantized or packed experts, devices without a grouped matmul) routes alike."""
    monkeypatch.setattr(moe_layer, "grouped_mm_runs", lambda device, dtype: False)
    check_prefill_and_decode(glm.model, glm.spec, glm.hf, lengths=(3, 17), decode_steps=2)


def test_engine_greedy_equals_transformers_batched_and_solo(glm):
    """Through the engine: a batch of mixed prompts (chunked prefill, a shared prefix served from the cache the
    second time) gives each prompt the tokens it gets alone and from transformers."""
    check_engine_greedy(glm.path, glm.hf)


def test_preempted_requests_recompute_the_same_answers(glm):
    check_preemption(glm.path)


def test_the_correction_bias_and_the_groups_decide_some_choices(glm):
    """The parity above means something: over a prompt's tokens, routing without the correction bias (or, in the
    grouped case, without the groups) picks other experts for some tokens."""
    from dataclasses import replace

    layer = glm.model.model.layers[1].mlp
    x = torch.randn(64, glm.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ids = layer.route(x)[0].sort(dim=-1).values
        unbiased = grouped_top_k(layer.gate(x), layer.routing)[0].sort(dim=-1).values
        assert not torch.equal(ids, unbiased)
        if layer.routing.num_groups > 1:
            ungrouped = replace(layer.routing, group_score=None)
            flat = grouped_top_k(layer.gate(x), ungrouped, layer.gate.e_score_correction_bias)[0]
            assert not torch.equal(ids, flat.sort(dim=-1).values)


def test_the_bake_check_passes_and_tensor_parallel_sizes_split_it(glm):
    from engine.model.loader import tensor_parallel_sizes

    assert check_model_folder(glm.path) == "Glm4MoeForCausalLM"
    assert tensor_parallel_sizes(str(glm.path)) == [1, 2, 4]  # 8 would cut the 4 attention heads


def test_the_bake_keeps_it_with_its_next_n_layer(glm, tmp_path):
    """The bake (python -m builder on a local folder) stages the checkpoint whole, next-n layer included, for a
    later MTP head to read."""
    from builder.bake import bake
    from builder.sources import resolve

    if glm.layout != "hub":
        pytest.skip("the hub layout carries the next-n layer")
    from engine.model.checkpoint import safetensors_files, tensor_shapes

    manifest = bake(resolve(str(glm.path), None), tmp_path / "out")
    assert manifest["architecture"] == "Glm4MoeForCausalLM"
    assert manifest["tensor_parallel_sizes"] == [1, 2, 4]
    staged = tensor_shapes(safetensors_files(str(tmp_path / "out")))
    assert f"model.layers.{glm.spec.num_layers}.eh_proj.weight" in staged


def test_the_next_n_layer_is_in_the_checkpoint_but_not_read(glm):
    """The hub layout holds model.layers.{num_hidden_layers}.*, which the engine neither refuses nor reads."""
    from engine.model.checkpoint import safetensors_files, tensor_shapes

    names = tensor_shapes(safetensors_files(str(glm.path)))
    extra = [n for n in names if n.startswith(f"model.layers.{glm.spec.num_layers}.")]
    assert bool(extra) == (glm.layout == "hub")
    assert all(glm.model.checkpoint_name(n) is None for n in extra)
    logits = Pages(glm.spec.kv_groups).run(glm.model, [("x", list(range(5, 15)))])
    assert bool(logits.isfinite().all())
