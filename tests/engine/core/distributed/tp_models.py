"""Tiny random-weight checkpoints for the tensor-parallel tests (SmolLM2's tokenizer, its first 1024 ids), saved in
the hub layout, and the child processes of this one (no test may leave a rank behind)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.sample.params import SamplingParams
from tests.engine.conftest import ENGINE_TINY, TOKENIZER_FILES, _save_tiny_engine_model
from tests.engine.core.engine_run import run
from tests.engine.model.family_parity import mixed_prompts

# kind -> what it covers at TP=2: biases on every projection (row-parallel ones added once), KV heads fewer than
# ranks (replicated) with Qwen3's q/k norm, two KV layer groups (a full layer, then a sliding window of 8 tokens),
# a Qwen3-MoE with experts split inside, a Qwen2-MoE with a shared expert and qkv bias, Mixtral's experts, OLMoE's
# q / k norms over the whole projection (one KV head, replicated: its norm must not count it twice) with clipping,
# Gemma 2 (attention and final soft-caps, every other layer sliding), Gemma 3 text (q / k norms, a rope per layer
# type), gpt-oss (biased attention and experts, interleaved gate|up, sinks, a window, yarn), and Gemma 4 text with
# every extra at once: global layers with their own head size and one KV head (replicated) whose keys are the values,
# the last two layers reading earlier layers' pages with a double-wide MLP, per-layer input embeddings (split by
# vocabulary rows), and the MoE block beside each MLP; GLM-4.5 (a dense first layer, grouped sigmoid routing with a
# replicated router, shared experts split like the routed ones, partial rotary on the split heads, qkv bias, q/k norm).
KINDS = (
    "llama_biased",
    "qwen3_one_kv_head",
    "qwen2_window",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "gemma4_text",
    "glm4_moe",
)
# The KV layer groups each kind has (1 unless listed).
KV_GROUPS = {"qwen2_window": 2, "gemma2": 2, "gemma3_text": 2, "gpt_oss": 2, "gemma4_text": 2}
GEMMA = dict(sliding_window=8, query_pre_attn_scalar=24)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 32,
}
GEMMA4 = dict(
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    final_logit_softcapping=10.0,
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=8,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
)
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
}


def tp_config(kind: str):
    import transformers as tf

    base = {**ENGINE_TINY, "num_hidden_layers": 2}
    if kind == "llama_biased":
        return tf.LlamaConfig(**{**base, "tie_word_embeddings": False}, attention_bias=True, mlp_bias=True)
    if kind == "qwen3_one_kv_head":
        return tf.Qwen3Config(**{**base, "num_key_value_heads": 1})
    if kind == "qwen2_window":
        return tf.Qwen2Config(
            **{**base, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=8, max_window_layers=1
        )
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **base, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
        )
    if kind == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **base,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
        )
    if kind == "mixtral":
        return tf.MixtralConfig(**{**base, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2)
    if kind == "olmoe":
        return tf.OlmoeConfig(
            **{**base, "num_key_value_heads": 1, "intermediate_size": 32},
            num_experts=4,
            num_experts_per_tok=2,
            clip_qkv=1.5,
        )
    if kind == "gemma2":
        return tf.Gemma2Config(**base, **GEMMA, attn_logit_softcapping=3.0, final_logit_softcapping=10.0)
    if kind == "gemma3_text":
        return tf.Gemma3TextConfig(
            **{**base, "num_hidden_layers": 3},
            **GEMMA,
            rope_parameters=GEMMA3_ROPE,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    if kind == "gpt_oss":
        return tf.GptOssConfig(
            **{**base, "intermediate_size": 32},
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters=YARN,
        )
    if kind == "glm4_moe":
        return tf.Glm4MoeConfig(
            **{**base, "num_hidden_layers": 3},
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
        )
    if kind == "gemma4_text":
        return tf.Gemma4TextConfig(
            **{**base, "num_hidden_layers": 4}, **GEMMA4, vocab_size_per_layer_input=base["vocab_size"]
        )
    raise ValueError(kind)


def save_tp_model(kind: str, path: Path, baked_model_path: Path) -> Path:
    return _save_tiny_engine_model(tp_config(kind), path, baked_model_path)


def copy_tokenizer(path: Path, baked_model_path: Path) -> None:
    """The baked model's tokenizer into a tiny checkpoint's folder (its ids stay below the tokenizer's vocabulary)."""
    for name in TOKENIZER_FILES:
        if (baked_model_path / name).exists() and name != "generation_config.json":
            shutil.copy(baked_model_path / name, path / name)


def check_split_answers(
    reference: Callable[[list[int]], torch.Tensor],
    one,
    two,
    prompt: list[int],
    max_tokens: int,
    vocab: int = 128,
    atol: float = 2e-4,
) -> None:
    """Engine `two` (several ranks) against `one` (one rank) and transformers' logits (`reference(tokens)`: [tokens,
    vocab] in float32): the prompt's log-probabilities within `atol`, and the greedy answers of mixed prompts (ids
    below `vocab`), batched, equal to one rank's and to transformers' argmax token after token."""
    requests = {"p": (prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))}
    ref = torch.log_softmax(reference(prompt), dim=-1)
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    got = [p.chosen.logprob for p in run(two, requests)["p"].first.prompt_logprobs[1:]]
    assert got == pytest.approx(expected, abs=atol)
    assert got == pytest.approx([p.chosen.logprob for p in run(one, requests)["p"].first.prompt_logprobs[1:]], abs=atol)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = {r: (p, params) for r, p in mixed_prompts(vocab=vocab).items()}
    batched, single = run(two, requests), run(one, requests)
    for r, (tokens, _) in requests.items():
        tokens = list(tokens)
        for _ in range(max_tokens):
            tokens.append(int(reference(tokens)[-1].argmax()))
        assert batched[r].choices[0].token_ids == single[r].choices[0].token_ids == tokens[-max_tokens:], r


def child_pids() -> set[int]:
    """The live (not zombie) processes whose parent is this one, read from /proc; not multiprocessing's resource
    tracker, which spawn starts once per interpreter and which ends with it."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == me and state != "Z" and b"resource_tracker" not in command:
            out.add(int(entry))
    return out
