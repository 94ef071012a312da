"""Multi-head latent attention (DeepSeek-V2 / V3, Kimi K2, GLM-4.7-Flash): the layer that writes each token's
compressed latent and rotary key part to the pages and attends over them with the absorbed projections.

kv_b_proj [H * (qk_nope + v), kv_lora_rank] holds, per head h, W_UK_h (its first qk_nope rows) and W_UV_h (the
v rows after them). The query's no-position part is folded into latent space (q_latent = q_nope @ W_UK_h), so the
scores against the cached latent c equal q_nope . (W_UK_h c), transformers' k_nope; the attention output is a
latent per head, taken to the head's value by W_UV_h. The backend (engine/attention/mla.py) sees multi-query
attention with one KV row of kv_lora_rank + qk_rope values per token. A tensor-parallel rank's layer holds its heads
(engine/model/sharding.py's shard_mla) and writes the same whole rows as every other rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import LatentAttentionBackend
from engine.model.kv_spec import LatentKV
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import apply_rotary_


@dataclass(frozen=True, kw_only=True)
class MLAShape:
    """One MLA layer's widths (transformers' DeepseekV2Config names); q_lora_rank None: q_proj reads the hidden
    state directly (DeepSeek-V2-Lite). rope_interleave: the rotary dims pair up as (x0, x1), (x2, x3), ... (V2 and
    V3's default) rather than as halves."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    attention_bias: bool = False
    rope_interleave: bool = True

    @classmethod
    def read(cls, config: dict, *, rope_interleave: bool) -> MLAShape:
        return cls(
            hidden_size=config["hidden_size"],
            num_heads=config["num_attention_heads"],
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            attention_bias=bool(config.get("attention_bias", False)),
            rope_interleave=rope_interleave,
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent(self) -> LatentKV:
        return LatentKV(self.kv_lora_rank, self.qk_rope_head_dim)


def mla_softmax_scale(qk_head_dim: int, rope: dict) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim) squared where a scaled rope (YaRN) gives
    mscale_all_dim, as transformers' DeepSeek-V2 / V3 attention computes it."""
    scale = qk_head_dim**-0.5
    all_dim = rope.get("mscale_all_dim") or 0
    factor = float(rope.get("factor") or 1.0)
    if rope.get("rope_type", "default") != "default" and all_dim and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class HeadWeights(nn.Module):
    """kv_b_proj's weight [H * (qk_nope + v), kv_lora_rank], read per head as W_UK_h and W_UV_h, never run as a
    linear. Not an nn.Linear on purpose: int4, CPU packing and LoRA, which replace linears, leave it whole. A
    quantized checkpoint's kv_b_proj is dequantised once at load into `weight` (quant/base.py's to_serving)."""

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if weight is None:
            weight = torch.empty(out_features, in_features)
        self.weight = nn.Parameter(weight, requires_grad=False)


class MLAttention(nn.Module):
    """DeepSeek's attention block with the hub's parameter names (q_proj or q_a_proj / q_a_layernorm / q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj); forward takes the layer's (ckv, kpe) pages."""

    def __init__(self, s: MLAShape) -> None:
        super().__init__()
        self.shape = s
        h, qk = s.num_heads, s.qk_head_dim
        if s.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(s.hidden_size, h * qk, bias=False)
            self.q_a_proj: nn.Linear | None = None
            self.q_a_layernorm: RMSNorm | None = None
            self.q_b_proj: nn.Linear | None = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(s.hidden_size, s.q_lora_rank, bias=s.attention_bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, s.rms_norm_eps)
            self.q_b_proj = nn.Linear(s.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(s.hidden_size, s.kv_lora_rank + s.qk_rope_head_dim, bias=s.attention_bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, s.rms_norm_eps)
        self.kv_b_proj = HeadWeights(s.kv_lora_rank, h * (s.qk_nope_head_dim + s.v_head_dim))
        self.o_proj = nn.Linear(h * s.v_head_dim, s.hidden_size, bias=s.attention_bias)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, qk_rope] rotated out of place. Interleaved pairs are first laid out as halves (the same
        permutation for q and k, so the scores are transformers'), then rotated as rotate_half does."""
        if self.shape.rope_interleave:
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        else:
            x = x.clone()
        return apply_rotary_(x, cos, sin)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        backend: LatentAttentionBackend,
    ) -> torch.Tensor:
        s, t = self.shape, x.shape[0]
        h, nope, rank = s.num_heads, s.qk_nope_head_dim, s.kv_lora_rank
        q = self.queries(x).view(t, h, s.qk_head_dim)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([rank, s.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotate(q[..., nope:], cos, sin), self.rotate(k_pe.view(t, 1, -1), cos, sin)
        w = self.kv_b_proj.weight.view(h, nope + s.v_head_dim, rank)  # per head W_UK_h rows, then W_UV_h rows
        backend.write_kv(latent, k_pe.view(t, -1), ckv_cache, kpe_cache)
        values = backend.run_mla(q[..., :nope], q_pe, ckv_cache, kpe_cache, w[:, :nope], w[:, nope:])
        return self.o_proj(values.reshape(t, h * s.v_head_dim))
