"""Gemma 2 and Gemma 3 text against transformers in float32 on tiny random checkpoints: logits on several prompt
lengths, decode past the sliding window, and the engine's greedy answers batched (chunked prefill, prefix hits)
equal to each alone and to transformers, and the same after preemption with prefix caching off. A
Gemma3ForConditionalGeneration folder serves its text model alone.

The tiny configs make every Gemma extra bite: query_pre_attn_scalar != head_dim, attention and final soft-caps
small enough to cap (checked against the same weights without them), a window of 8 tokens, a linear rope scaling
on Gemma 3's global layers only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model.kv_spec import KVGroupSpec
from engine.model.loader import check_checkpoint
from tests.engine.model.family_parity import (
    check_engine_greedy,
    check_preemption,
    check_prefill_and_decode,
    load_family,
    reference_logits,
    tiny_engine,
)

WINDOW = 8
SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=WINDOW,
    query_pre_attn_scalar=24,
    max_position_embeddings=256,
)
SCALE = 24**-0.5
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
}
GROUPS = {
    "gemma2": [
        KVGroupSpec(layers=(0, 2), num_kv_heads=2, head_dim=16, window=WINDOW, scale=SCALE, soft_cap=3.0),
        KVGroupSpec(layers=(1, 3), num_kv_heads=2, head_dim=16, window=None, scale=SCALE, soft_cap=3.0),
    ],
    "gemma3": [
        KVGroupSpec(layers=(0, 1, 2, 3, 4, 6), num_kv_heads=2, head_dim=16, window=WINDOW, scale=SCALE),
        KVGroupSpec(layers=(5,), num_kv_heads=2, head_dim=16, window=None, scale=SCALE),
    ],
    "gemma3_mm": [
        KVGroupSpec(layers=(0, 1, 2, 3, 4, 6), num_kv_heads=2, head_dim=16, window=WINDOW, scale=SCALE),
        KVGroupSpec(layers=(5,), num_kv_heads=2, head_dim=16, window=None, scale=SCALE),
    ],
}


def gemma_config(kind: str, **changes):
    import transformers as tf

    if kind == "gemma2":
        return tf.Gemma2Config(
            **{
                **SIZES,
                "num_hidden_layers": 4,
                "attn_logit_softcapping": 3.0,
                "final_logit_softcapping": 10.0,
                **changes,
            }
        )
    text = tf.Gemma3TextConfig(**{**SIZES, "num_hidden_layers": 7, "rope_parameters": GEMMA3_ROPE, **changes})
    if kind == "gemma3":
        return text
    return tf.Gemma3Config(text_config=text.to_dict(), vision_config=VISION, mm_tokens_per_image=4)


def build(kind: str, path, **changes):
    """Saves a random-weight model of `kind` to path and returns the transformers model (fp32, eager)."""
    import transformers as tf

    config = gemma_config(kind, **changes)
    torch.manual_seed(0)
    cls = tf.AutoModelForImageTextToText if kind == "gemma3_mm" else tf.AutoModelForCausalLM
    model = cls.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # default init gives near-zero logits; bigger weights make parity meaningful
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(GROUPS))
def gemma(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(kind=request.param, hf=hf, model=model, spec=spec, path=path)


def test_groups_carry_the_attention_extras(gemma):
    assert gemma.spec.kv_groups == GROUPS[gemma.kind]
    assert check_checkpoint(str(gemma.path)) == type(gemma.hf).__name__


def test_the_reference_caps_and_slides(gemma, tmp_path):
    """Without the window or the soft-caps the same weights answer otherwise past the window: parity below
    proves the engine applies them."""
    tokens = list(range(3, 23))
    ours = reference_logits(gemma.hf, tokens)
    for change in ({"sliding_window": 64}, {"attn_logit_softcapping": None, "final_logit_softcapping": None}):
        if gemma.kind != "gemma2" and "attn_logit_softcapping" in change:
            continue
        other = build(gemma.kind, tmp_path / str(len(change)), **change)
        assert (reference_logits(other, tokens) - ours)[WINDOW:].abs().max() > 1e-2, change


def test_prefill_lengths_and_decode_past_the_window(gemma):
    check_prefill_and_decode(gemma.model, gemma.spec, gemma.hf)  # 5 + 10 crosses the window


def test_engine_greedy_equals_transformers_batched_and_solo(gemma):
    assert tiny_engine(gemma.path).describe()["kv_groups"] == ",".join(g.label for g in GROUPS[gemma.kind])
    check_engine_greedy(gemma.path, gemma.hf)


def test_preemption_recomputes_the_same_tokens(gemma):
    check_preemption(gemma.path)
