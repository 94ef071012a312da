"""Tiny random-weight DeepSeek checkpoints with multi-head latent attention (MLA), saved by transformers in the hub
layout: DeepSeek-V2-Lite's shape (q_proj, greedy softmax routing), a V2 with q_lora_rank, group_limited_greedy
routing and YaRN with DeepSeek's mscale, and V3s (sigmoid noaux_tc routing with a correction bias; rotary dims
interleaved, or as halves with attention biases)."""

from __future__ import annotations

import torch

from tests.engine.conftest import TINY

MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    first_k_dense_replace=1,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
CONFIGS = {
    "deepseek_v2_lite": dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy"),
    "deepseek_v2_grouped": dict(
        q_lora_rank=24,
        n_shared_experts=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.0,
        rope_parameters=YARN,
    ),
    "deepseek_v3": dict(q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    # the rotary dims as halves (rotate_half) rather than interleaved pairs; attention biases
    "deepseek_v3_halves": dict(
        q_lora_rank=24, n_shared_experts=1, n_group=2, topk_group=1, rope_interleave=False, attention_bias=True
    ),
    # GLM-4.7-Flash: V3's decoder, its MoE layers named by mlp_layer_types
    "glm4_moe_lite": dict(q_lora_rank=24, n_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"]),
}
MODEL_TYPES = {
    "deepseek_v2_lite": "deepseek_v2",
    "deepseek_v2_grouped": "deepseek_v2",
    "deepseek_v3_halves": "deepseek_v3",
}


def build_mla_checkpoint(kind: str, path, **change):
    """Saves a random-weight `kind` (its config `change`d) to path (save_pretrained's layout) and returns the
    transformers model (float32, eager)."""
    import transformers as tf

    # NOTE: no head_dim: DeepSeek's configs set it to qk_rope_head_dim, which a V3 config's kwargs would override.
    tiny = {k: v for k, v in TINY.items() if k != "head_dim"}
    config = tf.AutoConfig.for_model(MODEL_TYPES.get(kind, kind), **{**tiny, **MLA, **CONFIGS[kind], **change})
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # bigger than the default init, so that parity (and routing) means something
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return model
