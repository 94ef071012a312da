"""The layers of the Gemma decoder (gemma_base.py), each with the options Gemma 2, 3 and 4 set in GemmaArgs: q/k
(and v) norms, keys as values, shared-KV layers that write no pages, a double-wide MLP, per-layer input embeddings
(PLE), a learned layer scalar, and Gemma 4's MoE block beside the MLP (gemma4_moe.py). Parameter names are the
hub's."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.model.layers.activation import gelu_tanh_and_mul
from engine.model.layers.linear import FusedLinear
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.rotary import apply_rotary_
from engine.model.models.gemma4_moe import MOE_NORMS, moe_modules
from engine.model.models.gemma_args import FULL, GemmaArgs


def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x times `scale` rounded to x's dtype first, as transformers' scaled embeddings do."""
    return x * torch.tensor(scale, dtype=x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, a: GemmaArgs, layer: int) -> None:
        super().__init__()
        self.layer_type = a.layer_types[layer]
        self.num_kv, self.head_dim = a.layer_shapes[layer]
        self.num_q, d, eps = a.num_q_heads, self.head_dim, a.rms_norm_eps
        self.shared = layer in a.kv_sources
        self.k_eq_v = a.k_eq_v and self.layer_type == FULL
        shards = {"q_proj": self.num_q * d}
        if not self.shared:
            shards["k_proj"] = self.num_kv * d
            if not self.k_eq_v:
                shards["v_proj"] = self.num_kv * d
        self.qkv_proj = FusedLinear(a.hidden_size, shards, False)
        self.o_proj = nn.Linear(self.num_q * d, a.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(d, eps, unit_offset=a.unit_offset) if a.qk_norm else None
        self.k_norm = GemmaRMSNorm(d, eps, unit_offset=a.unit_offset) if a.qk_norm and not self.shared else None
        self.v_norm = GemmaRMSNorm(d, eps, scaled=False) if a.v_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t, hq, hk, d = x.shape[0], self.num_q, self.num_kv, self.head_dim
        qkv = self.qkv_proj(x)
        q = qkv[:, : hq * d].view(t, hq, d)
        q = apply_rotary_(q if self.q_norm is None else self.q_norm(q), cos, sin)
        if not self.shared:  # a shared layer reads the pages its source layer wrote this step
            k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
            v = k if self.k_eq_v else qkv[:, (hq + hk) * d :].view(t, hk, d)
            k = k if self.k_norm is None else self.k_norm(k)
            v = v if self.v_norm is None else self.v_norm(v)  # before k's rope, which rotates in place
            backend.write_kv(apply_rotary_(k, cos, sin), v, k_cache, v_cache)
        # The scale and the soft-cap are the backend's: its KV group's extras.
        return self.o_proj(backend.run(q, k_cache, v_cache).reshape(t, hq * d))


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, n: int) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, {"gate_proj": n, "up_proj": n}, False)
        self.down_proj = nn.Linear(n, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, a: GemmaArgs, layer: int) -> None:
        super().__init__()
        h, eps = a.hidden_size, a.rms_norm_eps
        self.self_attn = GemmaAttention(a, layer)
        wide = 2 if a.double_wide_mlp and layer in a.kv_sources else 1
        self.mlp = GemmaMLP(h, a.intermediate_size * wide)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            *(MOE_NORMS if a.routing else ()),
        ):
            setattr(self, name, GemmaRMSNorm(h, eps, unit_offset=a.unit_offset))
        self.layer_scalar = nn.Parameter(torch.ones(1)) if a.layer_scalar else None
        if a.ple_dim:
            self.per_layer_input_gate = nn.Linear(h, a.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(a.ple_dim, h, bias=False)
            self.post_per_layer_input_norm = GemmaRMSNorm(h, eps, unit_offset=a.unit_offset)
        self.router, self.experts = moe_modules(h, a.routing, eps)
        self.tp: TensorParallel | None = None  # tensor-parallel: attention and MLP give partial sums to all-reduce

    def forward(
        self,
        h: torch.Tensor,
        ple: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, backend)
        h = h + self.post_attention_layernorm(attn if self.tp is None else self.tp.all_reduce(attn))
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.tp is not None:  # summed before the post-norm, which is not linear
            out = self.tp.all_reduce(out)
        if self.experts is not None:  # the router and the experts read h itself, not the dense MLP's input
            moe = self.experts(self.pre_feedforward_layernorm_2(h), *self.router(h))
            moe = moe if self.tp is None else self.tp.all_reduce(moe)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(out)
        if ple is not None:
            gate = torch.nn.functional.gelu(self.per_layer_input_gate(h), approximate="tanh") * ple
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h if self.layer_scalar is None else h * self.layer_scalar


class GemmaModel(nn.Module):
    def __init__(self, a: GemmaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(GemmaDecoderLayer(a, i) for i in range(a.num_layers))
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, unit_offset=a.unit_offset)
        if a.ple_dim:
            width = a.num_layers * a.ple_dim
            self.embed_tokens_per_layer = nn.Embedding(a.ple_vocab, width, _weight=torch.empty(a.ple_vocab, width))
            self.per_layer_model_projection = nn.Linear(a.hidden_size, width, bias=False)
            self.per_layer_projection_norm = GemmaRMSNorm(a.ple_dim, a.rms_norm_eps, unit_offset=a.unit_offset)
