"""Hybrid decoders of linear and full attention: Qwen3.5 / Qwen3.6 (dense and MoE, and their image-text
checkpoints) and Qwen3-Next.

Most layers are Gated DeltaNet (engine.model.layers.gated_deltanet), whose per-sequence state lives in a slot of
the engine's state pool; every `full_attention_interval`-th layer is gated attention over the paged KV cache: a
q_proj that also emits a per-head output gate, zero-centred RMSNorms on q and k, rotary on the first
partial_rotary_factor of each head (multimodal positions for an image-text checkpoint's images, which reduce to
plain 1-D ones for text), and attn * sigmoid(gate) before o_proj. Every decoder norm is zero-centred (scale 1 + w,
computed in float32). The MLP is SwiGLU, or a mixture of experts with a sigmoid-gated shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import UnsupportedModel
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.gated_deltanet import DeltaNetCore, DeltaNetShape, GatedDeltaNet
from engine.model.layers.linear import FusedLinear
from engine.model.layers.moe import SparseMoE
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.recurrent_step import RecurrentPlan, RecurrentSpec
from engine.model.layers.rotary import RotaryEmbedding, apply_rotary_
from engine.model.models.base import DecoderLM
from engine.model.models.llama import LlamaArgs, LlamaMLP
from engine.model.models.moe_base import MoeArgs, read_moe_args
from engine.model.models.qwen3_moe import qwen_sparse_layers, shared_expert_moe
from engine.model.sharding import (
    ShardPlan,
    shard_attention,
    shard_deltanet,
    shard_experts,
    shard_gated_mlp,
    shard_vocab,
)
from engine.model.vision.qwen_vl_model import QwenVisionLM

LAYER_TYPES = ("linear_attention", "full_attention")
# Per-layer-type rope keys that only the multimodal positions use; text positions make them moot.
MROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


@dataclass(kw_only=True)
class HybridArgs(MoeArgs):
    """MoeArgs (routing None: a dense MLP on every layer) plus each layer's mixer, the rotary width and the DeltaNet's
    shape."""

    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0  # the leading dims of each q / k head that rotate
    deltanet: DeltaNetShape | None = None
    fused_projections: bool = False  # Qwen3-Next: in_proj_qkvz and in_proj_ba, interleaved per key head

    @property
    def activation_width(self) -> int:
        return self.intermediate_size if self.routing is None else super().activation_width

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")


def read_hybrid_args(
    config: dict,
    names: set[str],
    *,
    moe: bool,
    fused_projections: bool = False,
    sparse_layers: tuple[int, ...] | None = None,
    norm_topk_prob: bool | None = None,
) -> HybridArgs:
    """HybridArgs from a Qwen3.5 / Qwen3-Next text config; UnsupportedModel naming what the engine does not run."""
    n = config["num_hidden_layers"]
    layer_types = tuple(
        config.get("layer_types")
        or (
            "full_attention" if (i + 1) % config.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(n)
        )
    )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModel(
            f"layer type {unknown[0]!r} is not supported (supported: {', '.join(LAYER_TYPES)})", param="model"
        )
    rope = dict(config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)})
    factor = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    config = {**config, "rope_parameters": {k: v for k, v in rope.items() if k not in MROPE_KEYS}}
    if moe:
        base = read_moe_args(
            config,
            names,
            expert_size_key="moe_intermediate_size",
            norm_topk_prob=norm_topk_prob,
            shared_expert_size=config.get("shared_expert_intermediate_size") or 0,
            sparse_layers=sparse_layers,
        )
        fields = {name: getattr(base, name) for name in MoeArgs.__dataclass_fields__}
    else:
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config['hidden_act']!r} is not supported", param="model")
        fields = vars(LlamaArgs.from_config(config, names))
    shape = DeltaNetShape(
        hidden_size=config["hidden_size"],
        num_k_heads=config["linear_num_key_heads"],
        num_v_heads=config["linear_num_value_heads"],
        head_k_dim=config["linear_key_head_dim"],
        head_v_dim=config["linear_value_head_dim"],
        conv_kernel=config["linear_conv_kernel_dim"],
        eps=config.get("rms_norm_eps", 1e-6),
    )
    if shape.num_v_heads % shape.num_k_heads:
        raise UnsupportedModel("linear_num_value_heads must be a multiple of linear_num_key_heads", param="model")
    head_dim = fields["head_dim"]
    return HybridArgs(
        **fields,
        layer_types=layer_types,
        rotary_dim=int(head_dim * factor),
        deltanet=shape,
        fused_projections=fused_projections,
    )


class GatedAttention(nn.Module):
    """Full attention over the paged KV cache whose q_proj rows are, per head, [query (head_dim) | output gate
    (head_dim)]: zero-centred q / k norms, rotary on each head's first rotary_dim, attn * sigmoid(gate) into o_proj."""

    def __init__(self, args: HybridArgs) -> None:
        super().__init__()
        self.num_q, self.num_kv, self.head_dim = args.num_q_heads, args.num_kv_heads, args.head_dim
        self.rotary_dim = args.rotary_dim
        q_size, kv_size = args.num_q_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = FusedLinear(
            args.hidden_size, {"q_proj": 2 * q_size, "k_proj": kv_size, "v_proj": kv_size}, args.qkv_bias
        )
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=args.o_bias)
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        # An FP8 KV cache holds K / k_scale and V / v_scale (the checkpoint's, set by the loader, or 1.0).
        self.k_scale, self.v_scale = 1.0, 1.0

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t, hq, hk, d, r = x.shape[0], self.num_q, self.num_kv, self.head_dim, self.rotary_dim
        qkv = self.qkv_proj(x)
        query_gate = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)
        q, gate = self.q_norm(query_gate[..., :d]), query_gate[..., d:].reshape(t, hq * d)
        k = self.k_norm(qkv[:, 2 * hq * d : (2 * hq + hk) * d].view(t, hk, d))
        v = qkv[:, (2 * hq + hk) * d :].view(t, hk, d)
        apply_rotary_(q[..., :r], cos, sin)
        apply_rotary_(k[..., :r], cos, sin)
        backend.write_kv(k, v, k_cache, v_cache, k_scale=self.k_scale, v_scale=self.v_scale)
        out = backend.run(q, k_cache, v_cache, k_scale=self.k_scale, v_scale=self.v_scale)
        return self.o_proj(out.reshape(t, hq * d) * torch.sigmoid(gate))


class FusedProjectionDeltaNet(DeltaNetCore):
    """Qwen3-Next's Gated DeltaNet: q|k|v|z in one in_proj_qkvz and b|a in one in_proj_ba, both laid out per key
    head ([q_h, k_h, v of its value heads, z of its value heads]); split back into Qwen3.5's order at run time."""

    def __init__(self, shape: DeltaNetShape) -> None:
        super().__init__(shape)
        s = shape
        self.in_proj_qkvz = nn.Linear(s.hidden_size, 2 * s.conv_dim - 2 * s.num_k_heads * s.head_k_dim, bias=False)
        self.in_proj_ba = nn.Linear(s.hidden_size, 2 * s.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        s, t = self.shape, x.shape[0]
        per = s.num_v_heads // s.num_k_heads * s.head_v_dim
        q, k, v, z = self.in_proj_qkvz(x).view(t, s.num_k_heads, -1).split([s.head_k_dim, s.head_k_dim, per, per], -1)
        b, a = self.in_proj_ba(x).view(t, s.num_k_heads, -1).chunk(2, dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, -1), b.reshape(t, -1), a.reshape(t, -1)


class HybridDecoderLayer(nn.Module):
    """A Gated DeltaNet (`linear_attn`) or gated attention (`self_attn`), then the SwiGLU MLP or, on a sparse layer,
    the experts; zero-centred norms before each."""

    def __init__(self, args: HybridArgs, index: int) -> None:
        super().__init__()
        self.recurrent = args.layer_types[index] == "linear_attention"
        if self.recurrent:
            deltanet = FusedProjectionDeltaNet if args.fused_projections else GatedDeltaNet
            self.linear_attn = deltanet(args.deltanet)
        else:
            self.self_attn = GatedAttention(args)
        self.mlp = shared_expert_moe(args) if index in args.sparse_layers else LlamaMLP(args)
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.tp: TensorParallel | None = None  # tensor-parallel: the mixer and the MLP give partial sums

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend | RecurrentPlan,
    ) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.recurrent:
            x = self.linear_attn(x, backend.step, *cache)
        else:
            x = self.self_attn(x, cos, sin, *cache, backend)
        h = h + (x if self.tp is None else self.tp.all_reduce(x))
        x = self.mlp(self.post_attention_layernorm(h))
        return h + (x if self.tp is None else self.tp.all_reduce(x))


class HybridModel(nn.Module):
    def __init__(self, args: HybridArgs) -> None:
        super().__init__()
        vocab, hidden = args.vocab_size, args.hidden_size
        self.embed_tokens = nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
        self.layers = nn.ModuleList(HybridDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = GemmaRMSNorm(hidden, args.rms_norm_eps)


class Qwen3_5ForCausalLM(DecoderLM):
    """Qwen3.5's dense text model (qwen3_5_text)."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> HybridArgs:
        return read_hybrid_args(config, names, moe=False)

    def __init__(self, args: HybridArgs) -> None:
        super().__init__(args, HybridModel(args))
        self.rotary: RotaryEmbedding | None = None

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        a = self.args
        full = tuple(i for i, t in enumerate(a.layer_types) if t == "full_attention")
        return [KVGroupSpec(layers=full, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim)] if full else []

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """This rank's Gated DeltaNet heads, gated-attention heads, MLP or expert columns and vocabulary rows
        (engine/model/sharding.py)."""
        plan = ShardPlan()
        for i, layer in enumerate(self.model.layers):
            prefix = f"model.layers.{i}"
            if layer.recurrent:
                layer.linear_attn = shard_deltanet(layer.linear_attn, f"{prefix}.linear_attn", tp, plan)
            else:
                shard_attention(layer.self_attn, f"{prefix}.self_attn", tp, plan, gated=True)
            if isinstance(layer.mlp, SparseMoE):
                shard_experts(layer.mlp, f"{prefix}.mlp", tp, plan)
            else:
                shard_gated_mlp(layer.mlp, f"{prefix}.mlp", tp, plan)
            layer.tp = tp
        shard_vocab(self, tp, plan)
        return plan

    def recurrent_spec(self) -> RecurrentSpec:
        # A shard's layers hold its heads only: the slots are sized from a layer, not from the config.
        layers = self.args.linear_layers
        shape = self.model.layers[layers[0]].linear_attn.shape if layers else self.args.deltanet
        conv, state = shape.state_shapes()
        return RecurrentSpec(self.args.linear_layers, conv, state)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The multi-token-prediction head (mtp.*) is not read (it stays in the bake for speculative decoding)."""
        return None if name.startswith("mtp.") else name

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """The torch path on every device (FlashInfer's kernels are not wired for this family)."""
        self.rotary = self.make_rotary(max_positions, dtype, device, fused=False)

    def make_rotary(self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool) -> RotaryEmbedding:
        a = self.args
        return RotaryEmbedding(
            head_dim=a.rotary_dim,
            rope=a.rope,
            max_position_embeddings=a.max_position_embeddings,
            max_positions=max_positions,
            dtype=dtype,
            device=device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: list[AttentionBackend | RecurrentPlan],
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """kv_caches / backend per layer: a full-attention layer's K/V pages and its group's backend, a linear one's
        (conv windows, delta states) slots and the step's RecurrentPlan. image_embeds: (rows, embeddings) that
        replace those rows' token embeddings (an image's tokens); positions [3, T] where the step has some."""
        assert self.rotary is not None, "init_rotary() was not called"
        cos, sin = self.rotary.lookup(positions)
        h = self.model.embed_tokens(input_ids)
        if image_embeds is not None:
            rows, values = image_embeds
            h = h.index_copy(0, rows, values.to(h.dtype))
        for layer, cache, b in zip(self.model.layers, kv_caches, backend, strict=True):
            h = layer(h, cos, sin, cache, b)
        return self.model.norm(h)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's MoE text model (qwen3_5_moe_text): every layer's MLP is experts plus a shared expert."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> HybridArgs:
        return read_hybrid_args(config, names, moe=True, norm_topk_prob=True)  # its router always renormalises


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: fused DeltaNet projections, experts on the layers transformers' Qwen MoE rule picks."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> HybridArgs:
        moe = bool(config.get("num_experts"))
        return read_hybrid_args(
            config,
            names,
            moe=moe,
            fused_projections=True,
            norm_topk_prob=config.get("norm_topk_prob", True),
            sparse_layers=qwen_sparse_layers(config) if moe else None,
        )


class _ImageText(QwenVisionLM):
    """A Qwen3.5 image-text checkpoint: Qwen3-VL's tower without deepstack (engine/model/vision/qwen_vl_model.py)."""

    MROPE_SECTION = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding default


class Qwen3_5ForConditionalGeneration(_ImageText, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(_ImageText, Qwen3_5MoeForCausalLM):
    pass
