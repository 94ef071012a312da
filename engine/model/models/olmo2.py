"""OLMo 2 / OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM) and EXAONE 4.0 (Exaone4ForCausalLM): Llama decoders whose
norms come after attention and after the MLP, on the block's output before it joins the residual stream, with no
norm before either. OLMo normalises the whole q and k projections (one RMSNorm over all heads; OLMoE's attention too);
OLMo 3 adds sliding-window layers (layer_types). EXAONE 4 normalises q and k per head (as Qwen3) and, where it has
sliding windows, rotates q and k on the sliding layers only: its global layers take no positions. OLMo 3's
rope_parameters may be keyed by layer type (its long-context releases scale the full-attention layers' rope by YaRN):
those layers then read a table of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.errors import UnsupportedModel
from engine.model.checkpoint import Source
from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import ParallelRMSNorm, TensorParallel
from engine.model.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model.models.llama import LlamaArgs, LlamaAttention, LlamaForCausalLM
from engine.model.sharding import ShardPlan


class OlmoAttention(LlamaAttention):
    """Llama attention with one RMSNorm over all of q's heads and one over all of k's, and q, k, v clipped to
    +-clip_qkv where it is set (OLMoE)."""

    def __init__(self, a: LlamaArgs, *, clip_qkv: float | None = None) -> None:
        super().__init__(a)
        self.clip_qkv = clip_qkv

    def qk_norms(self, a: LlamaArgs) -> tuple[RMSNorm, RMSNorm]:
        return RMSNorm(a.num_q_heads * a.head_dim, a.rms_norm_eps), RMSNorm(a.num_kv_heads * a.head_dim, a.rms_norm_eps)

    def normalize(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One norm over each token's whole q and one over its whole k, then q, k, v clipped where clip_qkv is set."""
        assert self.q_norm is not None and self.k_norm is not None
        t = q.shape[0]
        q, k = self.q_norm(q.reshape(t, -1)).view_as(q), self.k_norm(k.reshape(t, -1)).view_as(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp_(-c, c), k.clamp_(-c, c), v.clamp(-c, c)
        return q, k, v


def shard_whole_qk_norms(model: LlamaForCausalLM, tp: TensorParallel, plan: ShardPlan) -> None:
    """After the Llama shard: q / k norms over this rank's heads' columns that take their mean square over every
    rank's (the norm spans the whole projection, so a rank's own heads alone would give another scale)."""
    a = model.args
    (q0, nq), (k0, nk), d = tp.span(a.num_q_heads), tp.kv_heads(a.num_kv_heads), a.head_dim
    for i, layer in enumerate(cast(nn.ModuleList, model.model.layers)):
        attn = layer.self_attn
        for name, start, n in (("q_norm", q0, nq), ("k_norm", k0, nk)):
            setattr(attn, name, ParallelRMSNorm(n * d, a.rms_norm_eps, tp))
            plan.sources[f"model.layers.{i}.self_attn.{name}.weight"] = Source(0, ((start * d, n * d),))


class PostNormDecoderLayer(nn.Module):
    """x + norm(attention(x)), then x + norm(mlp(x)). The running pair (h, residual) sums to the stream, as the
    pre-norm layers hand it on, so the model's final norm reads it alike."""

    def __init__(self, a: LlamaArgs, self_attn: LlamaAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.tp: TensorParallel | None = None  # tensor-parallel: attention and MLP give partial sums to all-reduce

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = h if residual is None else h + residual
        out = self.self_attn(stream, positions, cos, sin, k_cache, v_cache, backend)
        stream = stream + self.post_attention_layernorm(out if self.tp is None else self.tp.all_reduce(out))
        out = self.mlp(stream)
        return self.post_feedforward_layernorm(out if self.tp is None else self.tp.all_reduce(out)), stream


@dataclass(kw_only=True)
class PostNormArgs(LlamaArgs):
    """A Llama decoder's args, and the rope of the full-attention layers where it is not `rope` (the sliding ones')."""

    full_rope: dict | None = None
    full_layers: tuple[int, ...] = ()


def read_layer_type_ropes(config: dict) -> tuple[dict, dict | None]:
    """(the sliding layers' rope, the full-attention layers' where it differs) from rope_parameters keyed by layer
    type, as transformers 5 writes OLMo 3's; one rope for every layer otherwise."""
    given = config.get("rope_parameters")
    if not (isinstance(given, dict) and given and all(isinstance(v, dict) for v in given.values())):
        return rope_parameters(config), None
    full = rope_parameters({**config, "rope_parameters": given["full_attention"]})
    sliding = rope_parameters({**config, "rope_parameters": given.get("sliding_attention") or given["full_attention"]})
    return sliding, (None if full == sliding else full)


class Olmo2ForCausalLM(LlamaForCausalLM):
    args: PostNormArgs

    def __init__(self, args: PostNormArgs) -> None:
        super().__init__(args)
        self.full_rotary: RotaryEmbedding | None = None  # the full-attention layers' own, where their rope differs

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> PostNormArgs:
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config['hidden_act']!r} is not supported", param="model")
        rope, full_rope = read_layer_type_ropes(config)
        layer_types = config.get("layer_types") or []
        args = LlamaArgs.from_config({**config, "rope_parameters": rope}, names, qk_norm=True)
        return PostNormArgs(
            **args.__dict__,
            full_rope=full_rope,
            full_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention"),
        )

    @classmethod
    def make_layer(cls, args: LlamaArgs, index: int) -> nn.Module:
        return PostNormDecoderLayer(args, cls.make_attention(args, index), cls.make_mlp(args, index))

    @classmethod
    def make_attention(cls, args: LlamaArgs, index: int) -> LlamaAttention:
        return OlmoAttention(args)

    def shard(self, tp: TensorParallel) -> ShardPlan:
        plan = super().shard(tp)
        shard_whole_qk_norms(self, tp, plan)
        return plan

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """The Llama tables, and the full-attention layers' own where their rope differs."""
        super().init_rotary(max_positions, dtype, device, fused)
        a = self.args
        if a.full_rope is not None:
            self.full_rotary = RotaryEmbedding(
                head_dim=a.head_dim,
                rope=a.full_rope,
                max_position_embeddings=a.max_position_embeddings,
                max_positions=max_positions,
                dtype=dtype,
                device=device,
                fused=self.fused_kernels,
            )
            layers = cast(nn.ModuleList, self.model.layers)
            for i in a.full_layers:
                cast(PostNormDecoderLayer, layers[i]).self_attn.cos_sin_cache = self.full_rotary.cos_sin_cache

    def layer_rotaries(self, positions: torch.Tensor) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        rotaries = super().layer_rotaries(positions)
        full = self.full_rotary
        if full is None or full.cos is None:
            return rotaries
        full_cos_sin = full.lookup(positions)
        return [full_cos_sin if i in self.args.full_layers else r for i, r in enumerate(rotaries)]


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> PostNormArgs:
        args = super().read_args(config, names)
        if config.get("sliding_window"):  # then only the sliding layers rotate (transformers' Exaone4Attention)
            layer_types = config.get("layer_types") or []
            args.no_rope_layers = tuple(i for i, kind in enumerate(layer_types) if kind != "sliding_attention")
        return args

    @classmethod
    def make_attention(cls, args: LlamaArgs, index: int) -> LlamaAttention:
        return LlamaAttention(args, rotates=index not in args.no_rope_layers)

    def shard(self, tp: TensorParallel) -> ShardPlan:
        return LlamaForCausalLM.shard(self, tp)  # its q / k norms are per head: they split with the heads
