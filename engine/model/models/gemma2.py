"""The Gemma 2 decoder, which Gemma 3's text model extends (gemma3.py): GeGLU, (1 + w) RMSNorms in float32 before
and after attention and the MLP, embeddings scaled by sqrt(hidden), sliding-window layers by `layer_types`, a
rope per layer type, and the attention extras (query_pre_attn_scalar, logit soft-capping) carried by the KV
groups to their backends.

Runs in torch on every device (norms, rope and GeGLU); attention goes through the backend over the paged KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import UnsupportedModel
from engine.model.kv_spec import KVGroupSpec, kv_groups
from engine.model.layers.activation import gelu_tanh_and_mul
from engine.model.layers.linear import FusedLinear
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.layers.rotary import RotaryEmbedding, apply_rotary_, rope_parameters
from engine.model.models.base import DecoderLM

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass
class GemmaArgs:
    """The shape of a Gemma 2 / 3 decoder (the CausalLM fields, then Gemma's own)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: list[str]
    ropes: dict[str, dict]  # layer type -> transformers' rope parameters
    query_pre_attn_scalar: float
    sliding_window: int | None
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    qk_norm: bool = False  # Gemma 3: (1 + w) RMSNorm over head_dim on q and k before rope
    tie_word_embeddings: bool = True

    @classmethod
    def from_config(cls, config: dict, layer_types: list[str], ropes: dict[str, dict], **kw) -> GemmaArgs:
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GELU_TANH:
            raise UnsupportedModel(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)", param="model")
        if config.get("use_bidirectional_attention"):
            raise UnsupportedModel("use_bidirectional_attention is not supported (an encoder)", param="model")
        if config.get("attention_bias"):
            raise UnsupportedModel("attention_bias is not supported for Gemma", param="model")
        unknown = set(layer_types) - {SLIDING, FULL}
        if unknown:
            raise UnsupportedModel(f"layer_types {sorted(unknown)} are not supported", param="model")
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_q_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            layer_types=layer_types,
            ropes=ropes,
            query_pre_attn_scalar=float(config["query_pre_attn_scalar"]),
            sliding_window=config.get("sliding_window"),
            tie_word_embeddings=config.get("tie_word_embeddings", True),
            **kw,
        )

    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        return [self.sliding_window if t == SLIDING and self.sliding_window else None for t in self.layer_types]


def default_layer_types(config: dict, pattern: int) -> list[str]:
    """config.json's layer_types, or transformers' default: every `pattern`-th layer global, the others sliding."""
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {n} layers", param="model")
    return list(types)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaAttention(nn.Module):
    def __init__(self, a: GemmaArgs, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.num_q, self.num_kv, self.head_dim = a.num_q_heads, a.num_kv_heads, a.head_dim
        q_size, kv_size = a.num_q_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = FusedLinear(a.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, False)
        self.o_proj = nn.Linear(q_size, a.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        t, hq, hk, d = x.shape[0], self.num_q, self.num_kv, self.head_dim
        qkv = self.qkv_proj(x)
        q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
        v = qkv[:, (hq + hk) * d :].view(t, hk, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin)
        backend.write_kv(k, v, k_cache, v_cache)
        # The scale (query_pre_attn_scalar) and the soft-cap are the backend's: its KV group's extras.
        return self.o_proj(backend.run(q, k_cache, v_cache).reshape(t, hq * d))


class GemmaMLP(nn.Module):
    def __init__(self, a: GemmaArgs) -> None:
        super().__init__()
        n = a.intermediate_size
        self.gate_up_proj = FusedLinear(a.hidden_size, {"gate_proj": n, "up_proj": n}, False)
        self.down_proj = nn.Linear(n, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, a: GemmaArgs, layer_type: str) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(a, layer_type)
        self.mlp = GemmaMLP(a)
        h, eps = a.hidden_size, a.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, backend)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, a: GemmaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(GemmaDecoderLayer(a, t) for t in a.layer_types)
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)


class Gemma2ForCausalLM(DecoderLM):
    """The CausalLM of Gemma 2; Gemma 3's text model differs in its config (read_args) and q/k norms."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> GemmaArgs:
        layer_types = default_layer_types(config, 2)
        rope = rope_parameters(config)
        config = {"query_pre_attn_scalar": 256, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                  **config}
        return GemmaArgs.from_config(config, layer_types, {SLIDING: rope, FULL: rope},
                                     attn_soft_cap=config["attn_logit_softcapping"],
                                     final_soft_cap=config["final_logit_softcapping"])

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        a = self.args
        return kv_groups(a.windows(), a.num_kv_heads, a.head_dim, scale=a.query_pre_attn_scalar**-0.5,
                         soft_cap=a.attn_soft_cap)

    def __init__(self, args: GemmaArgs) -> None:
        super().__init__(args, GemmaModel(args))
        self.rotary: dict[str, RotaryEmbedding] = {}

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """Builds one rotary table per layer type that the model has."""
        a = self.args
        self.rotary = {t: RotaryEmbedding(a.head_dim, a.ropes[t], a.max_position_embeddings, max_positions, dtype,
                                          device) for t in sorted(set(a.layer_types))}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend],
    ) -> torch.Tensor:
        """kv_caches and backend as LlamaForCausalLM.forward takes them."""
        assert self.rotary, "init_rotary() was not called"
        tables = {t: r.lookup(positions) for t, r in self.rotary.items()}
        h = self.model.embed_tokens(input_ids)
        # transformers scales by sqrt(hidden) rounded to the model dtype first.
        h = h * torch.tensor(math.sqrt(self.args.hidden_size), dtype=h.dtype)
        backends = self.layer_backends(backend, len(kv_caches))
        for layer, (k_cache, v_cache), b in zip(self.model.layers, kv_caches, backends, strict=True):
            h = layer(h, *tables[layer.self_attn.layer_type], k_cache, v_cache, b)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        return soft_cap(self.head_logits(hidden, exact_rows), self.args.final_soft_cap)
