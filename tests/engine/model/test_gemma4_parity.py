"""Gemma 4 dense text against transformers in float32 on a tiny random checkpoint that has every Gemma 4 extra:
global layers with their own head size (32) and KV heads (1) in their own KV group, keys reused as values there
(attention_k_eq_v), proportional rope with partial_rotary_factor 0.25 on them, the last two layers sharing KV
(they hold no pages; one has a double-wide MLP), per-layer input embeddings, a final soft-cap, a window of 8.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model.kv_spec import KVGroupSpec
from engine.model.loader import check_checkpoint, load_model
from tests.engine.model.family_parity import (
    ATOL,
    Pages,
    check_engine_greedy,
    check_preemption,
    check_prefill_and_decode,
    load_family,
    reference_logits,
    tiny_engine,
)

WINDOW = 8
TYPES = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "sliding_attention",
    "full_attention",
]
CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    layer_types=TYPES,
    sliding_window=WINDOW,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=128,
    final_logit_softcapping=10.0,
    max_position_embeddings=256,
)
# Layers 4 and 5 share KV: each reads the last earlier layer of its type (3 and 2).
GROUPS = [
    KVGroupSpec(
        layers=(0, 1, 3), num_kv_heads=2, head_dim=16, window=WINDOW, scale=1.0, soft_cap=None, readers=((4, 3),)
    ),
    KVGroupSpec(layers=(2,), num_kv_heads=1, head_dim=32, window=None, scale=1.0, soft_cap=None, readers=((5, 2),)),
]


def save_tiny_gemma4(path):
    """Saves the tiny random Gemma 4 of CONFIG to `path`; returns the transformers model (float32, eager)."""
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tf.Gemma4TextConfig(**CONFIG), attn_implementation="eager")
    hf = hf.float().eval()
    with torch.no_grad():  # default init gives near-zero logits; bigger weights make parity meaningful
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name or "scalar" in name else 0.15 * torch.randn_like(p))
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp("gemma4")
    hf = save_tiny_gemma4(path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(hf=hf, model=model, spec=spec, path=path)


def test_groups_shapes_and_shared_layers(gemma4):
    assert gemma4.spec.kv_groups == GROUPS
    assert check_checkpoint(str(gemma4.path)) == "Gemma4ForCausalLM"
    layers = gemma4.hf.model.layers  # the reference has the extras the test is about
    assert not hasattr(layers[4].self_attn, "k_proj") and layers[2].self_attn.v_proj is None
    assert layers[5].mlp.intermediate_size == 2 * layers[3].mlp.intermediate_size
    assert gemma4.hf.config.rope_parameters["full_attention"]["rope_type"] == "proportional"


def test_prefill_lengths_and_decode_past_the_window(gemma4):
    check_prefill_and_decode(gemma4.model, gemma4.spec, gemma4.hf)  # 5 + 10 crosses the window


def test_engine_greedy_equals_transformers_batched_and_solo(gemma4):
    assert tiny_engine(gemma4.path).describe()["kv_groups"] == "window(8):3x+1shared,full:1x+1shared"
    check_engine_greedy(gemma4.path, gemma4.hf)


def test_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """A Gemma4ForConditionalGeneration folder (vision tower and all): the bake's check passes, and the text logits
    equal transformers' on text alone (its images: test_gemma4_vision_parity.py)."""
    import transformers as tf

    text = {**CONFIG, "num_hidden_layers": 2, "layer_types": TYPES[1:3], "num_kv_shared_layers": 0}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    hf = tf.AutoModelForImageTextToText.from_config(
        tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None), attn_implementation="eager"
    )
    hf = hf.float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name or "scalar" in name else 0.15 * torch.randn_like(p))
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(tmp_path)
    assert check_checkpoint(str(tmp_path)) == "Gemma4ForConditionalGeneration"
    model, spec = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    prompts = {"a": list(range(3, 8)), "b": list(range(10, 30))}
    logits = Pages(spec.kv_groups).run(model, list(prompts.items()))
    torch.testing.assert_close(logits[:5], reference_logits(hf, prompts["a"]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[5:], reference_logits(hf, prompts["b"]), atol=ATOL, rtol=1e-4)


def test_preemption_recomputes_the_same_tokens(gemma4):
    check_preemption(gemma4.path)
