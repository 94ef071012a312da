"""Random EAGLE-3 heads in the published layout (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, no embedding),
and a reference of the head's forward in plain torch that the engine's proposals are held to."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

HEAD = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=512)


def write_head(
    folder: Path,
    target_config: dict,
    *,
    draft_vocab: int = 4096,
    seed: int = 0,
    std: float = 0.05,
    head: dict = HEAD,
    **config,
) -> dict[str, torch.Tensor]:
    """A random head of shape `head` (its hidden size the target's: it shares the target's embedding) for the target
    whose config.json is `target_config`; returns its tensors."""
    gen = torch.Generator().manual_seed(seed)
    h, heads, kv, d, inter = (
        head[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    )
    target_h, vocab = target_config["hidden_size"], target_config["vocab_size"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # the draft vocabulary's target ids
    tensors = {
        "fc.weight": rand(h, 3 * target_h),
        "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.hidden_norm.weight": 1 + rand(h),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "norm.weight": 1 + rand(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "lm_head.weight": rand(draft_vocab, h) * 20,
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    settings = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        **head,
        **config,
    }
    (folder / "config.json").write_text(json.dumps(settings))
    return tensors


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * freqs[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def head_reference(
    t: dict[str, torch.Tensor],
    embed: torch.Tensor,
    tokens: list[int],
    features: torch.Tensor,
    vocab: int,
    steps: int,
    head: dict = HEAD,
) -> list[int]:
    """The head's greedy guesses after a prompt: position p reads token p + 1 and feature p (fc of the target's
    captured states), then each guess's pre-norm row feeds the next position. Full causal attention, float32."""
    heads, kv, d = head["num_attention_heads"], head["num_key_value_heads"], head["head_dim"]
    feats = features @ t["fc.weight"].T
    ids = list(tokens[1:])
    guesses = []
    for _ in range(steps):
        n = len(ids)
        x = torch.cat(
            [_rms(embed[ids], t["midlayer.input_layernorm.weight"]), _rms(feats[:n], t["midlayer.hidden_norm.weight"])],
            -1,
        )
        pos = torch.arange(n)
        q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), pos)
        k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d), pos)
        v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
        h = attn @ t["midlayer.self_attn.o_proj.weight"].T + feats[:n]
        m = _rms(h, t["midlayer.post_attention_layernorm.weight"])
        mlp = (
            torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T)
            * (m @ t["midlayer.mlp.up_proj.weight"].T)
        ) @ t["midlayer.mlp.down_proj.weight"].T
        prenorm = mlp + h
        logits = _rms(prenorm[-1], t["norm.weight"]) @ t["lm_head.weight"].T
        draft = int(logits.argmax())
        guess = draft + int(t["d2t"][draft])
        assert guess < vocab
        guesses.append(guess)
        ids.append(guess)
        feats = torch.cat([feats[:n], prenorm[-1:]])
    return guesses
