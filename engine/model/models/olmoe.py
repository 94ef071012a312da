"""OLMoE: a Llama-style decoder whose attention normalises the whole q and k projections (one RMSNorm over all
heads, before RoPE) and may clip q, k and v to +-clip_qkv; every MLP is a mixture of experts.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.cuda import kernels
from engine.model.checkpoint import Source
from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import ParallelRMSNorm, TensorParallel
from engine.model.layers.rotary import apply_rotary_
from engine.model.models.llama import LlamaAttention
from engine.model.models.moe_base import MoeArgs, MoeForCausalLM, read_moe_args
from engine.model.sharding import ShardPlan


class OlmoeAttention(LlamaAttention):
    """Llama attention with one RMSNorm over all of q's heads and one over all of k's, and q, k, v clipped."""

    def __init__(self, a: MoeArgs, clip_qkv: float | None) -> None:
        super().__init__(a)
        self.clip_qkv = clip_qkv

    def qk_norms(self, a: MoeArgs) -> tuple[RMSNorm, RMSNorm]:
        return RMSNorm(a.num_q_heads * a.head_dim, a.rms_norm_eps), RMSNorm(a.num_kv_heads * a.head_dim, a.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t, hq, hk, d = x.shape[0], self.num_q, self.num_kv, self.head_dim
        q, k, v = self.qkv_proj(x).split([hq * d, hk * d, hk * d], dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp_(-c, c), k.clamp_(-c, c), v.clamp(-c, c)
        q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.reshape(t, hk, d)
        if self.cos_sin_cache is not None:
            kernels.apply_rope_with_cos_sin_cache_inplace(positions, q, k, d, self.cos_sin_cache)
        else:
            q, k = apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin)
        return self.attend(q, k, v, k_cache, v_cache, backend)


class OlmoeForCausalLM(MoeForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> MoeArgs:
        args = read_moe_args(config, names, expert_size_key="intermediate_size", norm_topk_prob=None)
        args.clip_qkv = config.get("clip_qkv")
        return args

    @classmethod
    def make_attention(cls, args: MoeArgs) -> OlmoeAttention:
        return OlmoeAttention(args, args.clip_qkv)

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """The Llama shard, and q / k norms over this rank's heads' columns that take their mean square over every
        rank's (the norm spans the whole projection, so a rank's own heads alone would give another scale)."""
        plan = super().shard(tp)
        a = self.args
        (q0, nq), (k0, nk), d = tp.span(a.num_q_heads), tp.kv_heads(a.num_kv_heads), a.head_dim
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            for name, start, n in (("q_norm", q0, nq), ("k_norm", k0, nk)):
                setattr(attn, name, ParallelRMSNorm(n * d, a.rms_norm_eps, tp))
                plan.sources[f"model.layers.{i}.self_attn.{name}.weight"] = Source(0, ((start * d, n * d),))
        return plan
