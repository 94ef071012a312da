"""The decoders that differ from Llama by a mechanism or two, against transformers on tiny random configs in float32:
Seed-OSS (attention biases), SmolLM3 (no rotary on some layers), OLMo 2 (norms after attention and MLP, q / k norm
over the whole projection), OLMo 3 (OLMo 2 with sliding windows and a YaRN rope on its full-attention layers),
EXAONE 4 (OLMo 2's norm placement, q / k norm per head, sliding windows with rotary only on the sliding layers),
Granite (embedding, residual, attention and logits multipliers), Phi-3 / Phi-4 (fused q|k|v and gate|up tensors;
Phi-4-mini's partial rotary), ERNIE 4.5 (interleaved rotary pairs, biases), Ministral 3 (YaRN, queries scaled past
the original context). Logits on several prompt lengths and over
decode steps (one prompt past every window), and greedy equal through the engine: batched, from the prefix cache,
alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

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
    "granite": (
        {"embedding_multiplier": 6.0, "residual_multiplier": 0.3, "attention_multiplier": 0.05, "logits_scaling": 4.0},
        "GraniteForCausalLM",
    ),
    "phi3": ({"sliding_window": WINDOW}, "Phi3ForCausalLM"),
    "phi3_partial": ({"partial_rotary_factor": 0.5}, "Phi3ForCausalLM"),
    "ernie4_5": ({"use_bias": True}, "Ernie4_5ForCausalLM"),
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
}


def build_variant(model_type: str, path: Path):
    """A tiny random checkpoint of model_type saved at path; returns transformers' float32 model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra, architecture = VARIANTS[model_type]
    config = AutoConfig.for_model(model_type.removesuffix("_partial"), **COMMON, **extra)
    config.architectures = [architecture]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # biases and norm weights away from their init, so that a dropped one shows
        for name, param in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    hf.save_pretrained(path)
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


def test_a_longrope_phi_fails_the_bake_in_one_line(tmp_path, baked_model_path):
    """Phi-4-mini's long-context rope is not run: the bake's folder check says so, as start-up would."""
    build_variant("phi3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    short, long = [1.0] * (COMMON["head_dim"] // 2), [4.0] * (COMMON["head_dim"] // 2)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long}
    config.update(rope_parameters=rope, original_max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="longrope"):
        load_family(tmp_path, baked_model_path)
    with pytest.raises(UnsupportedModel, match="longrope"):
        check_model_folder(tmp_path)
