"""The decoders that differ from Llama by a mechanism or two, against transformers on tiny random configs in float32:
Seed-OSS (attention biases), SmolLM3 (no rotary on some layers), OLMo 2 (norms after attention and MLP, q / k norm
over the whole projection), OLMo 3 (OLMo 2 with sliding windows and a YaRN rope on its full-attention layers),
EXAONE 4 (OLMo 2's norm placement, q / k norm per head, sliding windows with rotary only on the sliding layers),
Granite dense and MoE (embedding, residual, attention and logits multipliers; a shared MLP; the hub's names),
Phi-3 / Phi-4 (fused q|k|v and gate|up tensors; Phi-4-mini's partial rotary), ERNIE 4.5 dense and MoE (interleaved
rotary pairs, biases; a choice-only correction bias), Ministral 3 (YaRN, queries scaled past the original context),
Phi-3.5-MoE (LayerNorm, biases on the attention and the lm_head, sparsemixer routing), and LongRoPE (Phi-4-mini's with
partial rotary, Phi-3.5-MoE's with its own scales) served within and past the original context.
Logits on several prompt lengths and over decode steps (one prompt past every window), and greedy equal through the
engine: batched, from the prefix cache, alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import UnsupportedModel
from engine.model.folder_check import check_model_folder
from tests.engine.model.family_parity import check_engine_greedy, check_prefill_and_decode, load_family

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
WINDOW = 8
# Phi-3.5-MoE's biases everywhere; a jitter wide enough that sparsemixer's masks leave several experts competing.
PHIMOE = {
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "attention_bias": True,
    "lm_head_bias": True,
    "router_jitter_noise": 0.3,
}
GRANITE = {"embedding_multiplier": 6.0, "residual_multiplier": 0.3, "attention_multiplier": 0.05, "logits_scaling": 4.0}
# The hub's names of a Granite MoE checkpoint, where transformers 5 writes its own.
GRANITE_HUB_NAMES = {
    ".block_sparse_moe.router.weight": ".block_sparse_moe.router.layer.weight",
    ".block_sparse_moe.experts.gate_up_proj": ".block_sparse_moe.input_linear.weight",
    ".block_sparse_moe.experts.down_proj": ".block_sparse_moe.output_linear.weight",
}
# model_type -> (the config's own keys, the architecture)
VARIANTS = {
    "seed_oss": ({"attention_bias": True, "attention_out_bias": False}, "SeedOssForCausalLM"),
    "smollm3": ({"no_rope_layer_interval": 2}, "SmolLM3ForCausalLM"),
    "olmo2": ({}, "Olmo2ForCausalLM"),
    "olmo3": (
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_parameters": {  # the full-attention layers' rope scaled by YaRN, as OLMo 3's long-context releases
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        },
        "Olmo3ForCausalLM",
    ),
    "granite": (GRANITE, "GraniteForCausalLM"),
    "phi3": ({"sliding_window": WINDOW}, "Phi3ForCausalLM"),
    "phi3_partial": ({"partial_rotary_factor": 0.5}, "Phi3ForCausalLM"),
    "ernie4_5": ({"use_bias": True}, "Ernie4_5ForCausalLM"),
    "ernie4_5_moe": (
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1,
            "moe_layer_interval": 1,
        },
        "Ernie4_5_MoeForCausalLM",
    ),
    "granitemoe": ({**GRANITE, "num_local_experts": 4, "num_experts_per_tok": 2}, "GraniteMoeForCausalLM"),
    "granitemoeshared": (
        {**GRANITE, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 48},
        "GraniteMoeSharedForCausalLM",
    ),
    "ministral3": (
        {
            "sliding_window": 4 * WINDOW,
            "rope_parameters": {  # queries scaled past 16 positions (Ministral 3's 16k, shrunk)
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
        },
        "Ministral3ForCausalLM",
    ),
    "exaone4": ({"sliding_window": WINDOW, "sliding_window_pattern": 2}, "Exaone4ForCausalLM"),
    "phimoe": (PHIMOE, "PhimoeForCausalLM"),
}
# LongRoPE as Phi-4-mini (partial rotary) and Phi-3.5-MoE (its own scales) write it, shrunk: an original context of
# ORIGINAL positions in COMMON's 256.
ORIGINAL = 64
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": ORIGINAL,
}
LONGROPE_VARIANTS = {
    "phi3_longrope": (
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": ORIGINAL,  # Phi3Config's own field, which its rope reads
            "rope_parameters": {
                **LONGROPE,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.3 * i for i in range(6)],
                "long_factor": [2.0 + 1.5 * i for i in range(6)],
            },
        },
        "Phi3ForCausalLM",
    ),
    "phimoe_longrope": (
        {
            **PHIMOE,
            "rope_parameters": {
                **LONGROPE,
                "short_factor": [1.0 + 0.2 * i for i in range(8)],
                "long_factor": [3.0 + i for i in range(8)],
                "short_mscale": 1.1,
                "long_mscale": 1.3,
            },
        },
        "PhimoeForCausalLM",
    ),
}


def build_variant(model_type: str, path: Path):
    """A tiny random checkpoint of model_type saved at path; returns transformers' float32 model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra, architecture = {**VARIANTS, **LONGROPE_VARIANTS}[model_type]
    config = AutoConfig.for_model(model_type.split("_partial")[0].split("_longrope")[0], **COMMON, **extra)
    config.architectures = [architecture]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # biases and norm weights away from their init, so that a dropped one shows
        for name, param in hf.named_parameters():
            if name.endswith("bias") or "norm" in name or "correction" in name:
                param.add_(torch.randn_like(param) * 0.2)
    hf.save_pretrained(path)
    if model_type == "granitemoeshared":  # the hub's names, which the engine reads as it reads transformers 5's
        tensors = load_file(path / "model.safetensors")
        for theirs, hub in GRANITE_HUB_NAMES.items():
            tensors = {(k.replace(theirs, hub) if k.endswith(theirs) else k): v for k, v in tensors.items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return hf


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_variant(request.param, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(kind=request.param, hf=hf, model=model, spec=spec, path=path)


def test_prefill_lengths_and_decode_match_transformers(variant):
    check_prefill_and_decode(variant.model, variant.spec, variant.hf, lengths=(1, 7, 3 * WINDOW), decode_steps=6)


def test_engine_greedy_equals_transformers_batched_from_the_cache_and_solo(variant):
    check_engine_greedy(variant.path, variant.hf)


def test_the_bake_check_passes(variant):
    assert check_model_folder(variant.path) == variant.hf.config.architectures[0]


def test_smollm3_reads_its_no_rope_layers():
    from engine.model.models.llama import read_no_rope_layers

    config = {"model_type": "smollm3", "num_hidden_layers": 8}
    assert read_no_rope_layers(config) == (3, 7)
    assert read_no_rope_layers({**config, "no_rope_layers": [1, 0, 1, 1, 1, 1, 1, 0]}) == (1, 7)
    assert read_no_rope_layers({**config, "model_type": "llama"}) == ()


@pytest.mark.parametrize("kind", sorted(LONGROPE_VARIANTS))
def test_longrope_within_the_original_context_matches_transformers(kind, tmp_path, baked_model_path):
    """Served within the original context, the short factors and scale: transformers' values at every length it
    reaches, batched, from the prefix cache and alone."""
    hf = build_variant(kind, tmp_path)
    model, spec = load_family(tmp_path, baked_model_path, max_model_len=ORIGINAL)
    check_prefill_and_decode(model, spec, hf, lengths=(1, 7, 40), decode_steps=6)
    check_engine_greedy(tmp_path, hf, max_model_len=ORIGINAL)
    assert check_model_folder(tmp_path) == hf.config.architectures[0]


def test_longrope_past_the_original_context_matches_transformers(tmp_path, baked_model_path):
    """Served past the original context, the long factors and scale: transformers' values for prompts past it."""
    hf = build_variant("phi3_longrope", tmp_path)
    model, spec = load_family(tmp_path, baked_model_path)
    check_prefill_and_decode(model, spec, hf, lengths=(ORIGINAL + 1, ORIGINAL + 20), decode_steps=4)


def test_longrope_factors_of_the_wrong_width_fail_the_bake_in_one_line(tmp_path, baked_model_path):
    build_variant("phi3_longrope", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["long_factor"] = [1.0] * 8  # 6 frequencies rotate (12 of the 16 dims)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for load in (lambda: load_family(tmp_path, baked_model_path), lambda: check_model_folder(tmp_path)):
        with pytest.raises(UnsupportedModel, match="longrope factors give 8 frequencies for a rotary width of 12"):
            load()


def test_the_first_phi3_releases_rope_names_read_as_longrope():
    from engine.model.models.phi3 import phi_rope

    config = {"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}, "rope_theta": 1e4}
    rope = phi_rope({**config, "original_max_position_embeddings": 4096})
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 4096
