"""The memory plan (engine.model.memory_plan) against hand arithmetic on the shapes users ask about: Llama-3.1-8B,
Qwen3-30B-A3B, gpt-oss-120b (its experts in bf16, and as MXFP4 as the GPU path serves them), and a
Gemma 4 shape with sliding and global layers of their own head sizes (its weights against transformers' own
parameter count), Nemotron 3 Nano's Mamba2 states beside its pages; `python -m builder --plan` prints it for the
baked model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.model.memory_plan import CONTEXT_BYTES, GB, plan_from_config

BF16 = 2
LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
GPT_OSS_120B = dict(
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=36,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=201088,
    num_local_experts=128,
    num_experts_per_tok=4,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 18,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    rope_theta=150000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)
GPT_OSS_NAMES = {f"model.layers.0.self_attn.{n}" for n in ("sinks", "q_proj.bias", "o_proj.bias")}
# Five sliding layers (window 1024, 16 KV heads of 256) to one global layer (4 KV heads of 512, keys as values).
GEMMA4_LIKE = dict(
    architectures=["Gemma4ForCausalLM"],
    model_type="gemma4_text",
    hidden_size=5376,
    intermediate_size=21504,
    num_hidden_layers=60,
    num_attention_heads=32,
    num_key_value_heads=16,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=4,
    attention_k_eq_v=True,
    sliding_window=1024,
    vocab_size=262144,
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
    max_position_embeddings=262144,
    tie_word_embeddings=True,
    final_logit_softcapping=30.0,
)


def llama_8b_params() -> int:
    v, h, n, i, q, kv = 128256, 4096, 32, 14336, 32 * 128, 8 * 128
    return 2 * v * h + n * (h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h) + h


def qwen3_30b_params() -> int:
    v, h, n, e, i, q, kv = 151936, 2048, 48, 128, 768, 32 * 128, 4 * 128
    layer = h * q + 2 * h * kv + q * h + 2 * 128 + h * e + e * 3 * h * i + 2 * h
    return 2 * v * h + n * layer + h


def gpt_oss_120b_params() -> int:
    v, h, n, e, i, q, kv = 201088, 2880, 36, 128, 2880, 64 * 64, 8 * 64
    attention = h * q + q + 2 * (h * kv + kv) + q * h + h + 64
    experts = e * (h * 2 * i + 2 * i) + e * (i * h + h)
    return 2 * v * h + n * (attention + h * e + e + experts + 2 * h) + h


def fits(plan, gb: int, utilization: float = 0.9) -> int:
    budget = (
        int(gb * GB * utilization)
        - plan.weight_bytes
        - plan.reserve_bytes
        - CONTEXT_BYTES
        - plan.window_bytes
        - plan.scratch_bytes
    )
    return max(0, budget // plan.full_bytes_per_token) if budget > 0 else 0


def test_llama_8b():
    plan = plan_from_config(LLAMA_8B, set(), torch.bfloat16)
    assert plan.weight_bytes == llama_8b_params() * BF16 == 16_060_522_496
    assert [(g.layers, g.bytes_per_token, g.window) for g in plan.groups] == [(32, 2 * 32 * 8 * 128 * BF16, None)]
    assert plan.tokens_that_fit(24 * GB, 0.9) == fits(plan, 24) > 0
    assert plan.tokens_that_fit(80 * GB, 0.9) == fits(plan, 80)
    fp8 = plan_from_config(LLAMA_8B, set(), torch.bfloat16, torch.float8_e4m3fn)
    assert fp8.full_bytes_per_token * 2 == plan.full_bytes_per_token


def test_qwen3_30b_a3b():
    plan = plan_from_config(QWEN3_30B_A3B, set(), torch.bfloat16)
    assert plan.weight_bytes == qwen3_30b_params() * BF16
    assert plan.full_bytes_per_token == 2 * 48 * 4 * 128 * BF16
    assert plan.tokens_that_fit(48 * GB, 0.9) == 0  # 61 GB of weights
    assert plan.tokens_that_fit(80 * GB, 0.9) == fits(plan, 80) > 0


def gpt_oss_120b_expert_weights() -> int:
    return 36 * 128 * (2880 * 2 * 2880 + 2880 * 2880)


def test_gpt_oss_120b_in_bfloat16_fits_no_single_gpu():
    plan = plan_from_config(GPT_OSS_120B, GPT_OSS_NAMES, torch.bfloat16)
    assert plan.weight_bytes == gpt_oss_120b_params() * BF16  # about 234 GB
    assert plan.scratch_bytes == 0
    per_token = 2 * 18 * 8 * 64 * BF16
    assert [(g.layers, g.bytes_per_token, g.window) for g in plan.groups] == [
        (18, per_token, 128),
        (18, per_token, None),
    ]
    assert plan.window_bytes == per_token * 128 * 256
    assert all(plan.tokens_that_fit(gb * GB, 0.9) == 0 for gb in (24, 48, 80, 141))


def test_gpt_oss_120b_with_mxfp4_experts_fits_an_80_gb_gpu():
    plan = plan_from_config(
        {**GPT_OSS_120B, "quantization_config": {"quant_method": "mxfp4"}}, GPT_OSS_NAMES, torch.bfloat16
    )
    experts = gpt_oss_120b_expert_weights()
    # 32 FP4 codes in 16 bytes and one e8m0 scale a group of 32; everything else (expert biases too) in bf16
    assert plan.weight_bytes == (gpt_oss_120b_params() - experts) * BF16 + experts // 32 * 17  # about 65 GB
    per_expert = (2880 * 2 * 2880 + 2880 * 2880) * BF16  # 49.8 MB: 21 of them fit the 1 GiB scratch
    assert plan.scratch_bytes == 21 * per_expert
    assert [plan.tokens_that_fit(gb * GB, 0.9) for gb in (24, 48)] == [0, 0]
    assert plan.tokens_that_fit(80 * GB, 0.9) == fits(plan, 80) > 0


def test_gemma4_shape_with_global_layers_of_their_own():
    import transformers as tf

    plan = plan_from_config(GEMMA4_LIKE, set(), torch.bfloat16)
    with torch.device("meta"):
        reference = tf.AutoModelForCausalLM.from_config(tf.Gemma4TextConfig(**GEMMA4_LIKE))
    # transformers holds each layer's one-value layer_scalar as a buffer; the engine loads it as a parameter.
    scalars = sum(b.numel() for n, b in reference.named_buffers() if n.endswith("layer_scalar"))
    assert plan.weight_bytes == (sum(p.numel() for p in reference.parameters()) + scalars) * BF16
    sliding, full = 2 * 50 * 16 * 256 * BF16, 2 * 10 * 4 * 512 * BF16  # k-as-v: V pages still hold the keys
    assert sorted((g.bytes_per_token, g.window) for g in plan.groups) == sorted([(sliding, 1024), (full, None)])
    assert plan.tokens_that_fit(80 * GB, 0.9) == fits(plan, 80)


# Nemotron 3 Nano's shape (52 blocks: 23 Mamba2, 23 MoE, 6 attention), from transformers' config defaults otherwise.
NEMOTRON_NANO = dict(
    architectures=["NemotronHForCausalLM"],
    model_type="nemotron_h",
    hidden_size=2688,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    mamba_num_heads=64,
    mamba_head_dim=64,
    n_groups=8,
    ssm_state_size=128,
    conv_kernel=4,
    chunk_size=128,
    n_routed_experts=128,
    num_experts_per_tok=6,
    moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712,
    n_group=1,
    topk_group=1,
    intermediate_size=1856,
    vocab_size=131072,
    max_position_embeddings=262144,
    hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
)


def test_nemotron_nano_counts_its_mamba2_states_in_the_same_budget_as_its_pages():
    plan = plan_from_config(NEMOTRON_NANO, {"backbone.layers.0.mixer.conv1d.bias"}, torch.bfloat16)
    conv_dim = 64 * 64 + 2 * 8 * 128
    slot = 23 * (conv_dim * 3 * BF16 + 64 * 64 * 128 * 4)  # conv windows in bf16, SSM states in float32
    assert plan.state_slot_bytes == slot and plan.state_layers == 23
    assert plan.full_bytes_per_token == 2 * 6 * 2 * 128 * BF16
    budget = int(80 * GB * 0.9) - plan.weight_bytes - plan.reserve_bytes - CONTEXT_BYTES
    seqs = min(256, budget // 2 // (2 * slot))  # two slots a sequence, at most half the budget
    assert plan.tokens_that_fit(80 * GB, 0.9) == (budget - (2 * seqs + 2) * slot) // plan.full_bytes_per_token > 0


@pytest.mark.parametrize("env", [{}, {"KV_CACHE_DTYPE": "fp8"}])
def test_the_builder_prints_the_plan_of_the_bake(env, baked_model_path):
    out = subprocess.run(
        [sys.executable, "-m", "builder", "--plan", "--out", str(baked_model_path)],
        capture_output=True,
        text=True,
        env={"PATH": "", **env},
        check=True,
    ).stdout
    # SmolLM2-135M: 134.5M parameters (tied) in bf16; 30 layers of 3 KV heads of 64, K and V.
    kv = 2 * 30 * 3 * 64 * (1 if env else 2) / 1024
    assert "weights 0.27 GB" in out and f"KV {kv:.1f} KiB per token over 30 layers" in out
    assert out.count(" GB GPU at GPU_MEMORY_UTILIZATION=0.9: ") == 4
