"""Tiny random-weight hybrid (Gated DeltaNet + gated attention) checkpoints in the hub's layout: Qwen3.5 dense
(qwen3_5_text), Qwen3.5 MoE (qwen3_5_moe_text), Qwen3-Next (a dense layer among sparse ones) and a Qwen3.5
image-text checkpoint (qwen3_5: the text model under model.language_model, a one-block vision tower)."""

from __future__ import annotations

import torch

# Four layers, every fourth full attention (three Gated DeltaNet, one attention), Hk < Hv as in the real models.
TINY_HYBRID = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
KINDS = {"qwen3_5_text": {}, "qwen3_5_moe_text": EXPERTS, "qwen3_next": {**EXPERTS, "mlp_only_layers": [1]}}


def randomise(model) -> None:
    """Weights larger than the default init (so that parity means something): zero-centred norms near 0 (scale near
    1), the gated norm's plain scale near 1, decay parameters of either sign."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name or "A_log" in name or "dt_bias" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)


def build_hybrid_checkpoint(kind: str, path, **change):
    """Saves a random-weight `kind` to path and returns the transformers model (float32, eager)."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "qwen3_5":
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=change.get("hidden_size", TINY_HYBRID["hidden_size"]),
        )
        config = tf.AutoConfig.for_model(
            "qwen3_5", text_config={**TINY_HYBRID, **change}, vision_config=vision, tie_word_embeddings=False
        )
        model = tf.AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
    else:
        config = tf.AutoConfig.for_model(kind, **{**TINY_HYBRID, **KINDS[kind], **change})
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    randomise(model)
    config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return model
