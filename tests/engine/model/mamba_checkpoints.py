"""Tiny random-weight Mamba2 hybrids, with a Mamba2 chunk of 16 tokens so that prompts span several chunks and the
conv window: Nemotron-H (nemotron_h, in the hub's layout: backbone.*, per-expert tensors) with every block kind
(Mamba2, attention, relu^2 MLP, MoE) in one stack; Falcon-H1 (falcon_h1: attention and Mamba2 in every layer, every
μP multiplier away from 1); Granite 4.0-H (granitemoehybrid: Mamba2 and attention mixers, experts and the shared
MLP)."""

from __future__ import annotations

import torch

# M E * M - M: three Mamba2 blocks, one MoE, one attention, one MLP; 2 groups of 4 Mamba2 heads each.
TINY_NEMOTRON_H = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    hybrid_override_pattern="ME*M-M",
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def randomise(model) -> None:
    """Weights larger than the default init (so that parity means something): norm scales near 1, slow decays
    (A = -exp(A_log) near -0.05, dt near 0.3: a state remembers tens of tokens, so a lost one shows), a correction
    bias that moves the expert choice."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "A_log" in name:
                p.copy_(-3.0 + 0.5 * torch.randn_like(p))
            elif "dt_bias" in name:
                p.copy_(-1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".D"):
                p.copy_(torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))


# Attention and Mamba2 in each of 3 layers; 2 groups of 4 Mamba2 heads; every μP multiplier away from 1.
TINY_FALCON_H1 = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    mamba_d_ssm=64,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    mamba_rms_norm=True,
    mamba_norm_before_gate=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    embedding_multiplier=1.7,
    lm_head_multiplier=0.6,
    mlp_multipliers=[1.3, 0.7],
    key_multiplier=1.4,
    attention_in_multiplier=0.8,
    attention_out_multiplier=1.2,
    ssm_multipliers=[0.9, 1.25, 0.8, 1.5, 0.6],
    ssm_in_multiplier=1.1,
    ssm_out_multiplier=0.75,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


# Granite 4.0-H: mamba attention mamba mamba, each with 4 experts and the shared MLP; Granite's four scalars away
# from 1 (so that a lost one shows); 2 groups of 4 Mamba2 heads of 8.
TINY_GRANITE_HYBRID = dict(
    hidden_size=64,
    intermediate_size=32,
    shared_intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    num_hidden_layers=4,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_expand=1,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    embedding_multiplier=2.0,
    residual_multiplier=0.6,
    attention_multiplier=0.2,
    logits_scaling=1.5,
    position_embedding_type="nope",
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


TINY = {"nemotron_h": TINY_NEMOTRON_H, "falcon_h1": TINY_FALCON_H1, "granitemoehybrid": TINY_GRANITE_HYBRID}


def build_mamba_checkpoint(model_type: str, path, **change):
    """Saves a random-weight model of `model_type` (TINY's config, `change` over it) to path and returns the
    transformers model (float32, eager)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.AutoConfig.for_model(model_type, **{**TINY[model_type], **change})
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomise(model)
    config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return model


def build_nemotron_h_checkpoint(path, **change):
    return build_mamba_checkpoint("nemotron_h", path, **change)


def build_falcon_h1_checkpoint(path, **change):
    return build_mamba_checkpoint("falcon_h1", path, **change)


def build_granite_hybrid_checkpoint(path, **change):
    return build_mamba_checkpoint("granitemoehybrid", path, **change)
