"""DeepSeek-V2 / V2-Lite / Coder-V2 (DeepseekV2ForCausalLM) and DeepSeek-V3 / R1 / Kimi K2 (DeepseekV3ForCausalLM):
a decoder whose attention is multi-head latent attention over latent pages (engine/model/layers/mla.py) and whose
layers from `first_k_dense_replace` on (every `moe_layer_freq`-th) are DeepSeek mixtures of experts with ungated
shared experts (engine/model/layers/moe.py). V2 routes by softmax scores (greedy or group_limited_greedy); V3 by
sigmoid scores with a choice-only correction bias over groups (noaux_tc), as GLM-4.5. GLM-4.7-Flash
(Glm4MoeLiteForCausalLM) is V3's decoder with its MoE layers listed in mlp_layer_types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata, LatentAttentionBackend
from engine.errors import UnsupportedModel
from engine.model.kv_spec import KVGroupSpec, latent_group
from engine.model.layers.mla import MLAShape, MLAttention, mla_softmax_scale
from engine.model.layers.moe import SparseMoE
from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.layers.routing import Routing, read_grouped_routing
from engine.model.models.base import DecoderLM
from engine.model.models.llama import LlamaMLP
from engine.model.models.moe_base import MoeArgs, shared_mlp
from engine.model.sharding import ShardPlan, shard_experts, shard_gated_mlp, shard_mla, shard_vocab

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(kw_only=True)
class DeepseekArgs(MoeArgs):
    """A DeepSeek decoder: the MoE decoder's shape and routing, and its attention's MLA widths."""

    mla: MLAShape


def read_deepseek_args(
    config: dict,
    names: set[str],
    routing: Routing,
    *,
    rope_interleave: bool,
    sparse_layers: tuple[int, ...] | None = None,
) -> DeepseekArgs:
    """DeepseekArgs from a DeepSeek config and its routing; head_dim is the query head's width (nope + rope).
    sparse_layers None: DeepSeek's rule (from first_k_dense_replace on, every moe_layer_freq-th layer)."""
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config['hidden_act']!r} is not supported", param="model")
    mla = MLAShape.read(config, rope_interleave=rope_interleave)
    first, freq = config.get("first_k_dense_replace") or 0, config.get("moe_layer_freq") or 1
    num_layers = config["num_hidden_layers"]
    fields = MoeArgs.from_config(
        config,
        names,
        routing=routing,
        sparse_layers=tuple(i for i in range(num_layers) if i >= first and i % freq == 0)
        if sparse_layers is None
        else sparse_layers,
    ).__dict__
    return DeepseekArgs(**{**fields, "head_dim": mla.qk_head_dim, "num_kv_heads": mla.num_heads}, mla=mla)


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm decoder layer: MLA, then the dense MLP or the MoE."""

    def __init__(self, a: DeepseekArgs, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = MLAttention(a.mla)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.tp: TensorParallel | None = None  # tensor-parallel: attention and MLP give partial sums to all-reduce

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        caches: tuple[torch.Tensor, torch.Tensor],
        backend: LatentAttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(h, *rotary, *caches, backend)
        if self.tp is not None:
            h = self.tp.all_reduce(h)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        h = self.mlp(h)
        return (h if self.tp is None else self.tp.all_reduce(h)), residual


class DeepseekModel(nn.Module):
    def __init__(self, a: DeepseekArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(a, make_moe(a) if i in a.sparse_layers else LlamaMLP(a)) for i in range(a.num_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


def make_moe(a: DeepseekArgs) -> SparseMoE:
    """The routed experts and, beside them, n_shared_experts * moe_intermediate_size of ungated shared MLP."""
    routing = a.routing
    assert routing is not None
    return SparseMoE(routing=routing, hidden_size=a.hidden_size, shared_experts=shared_mlp(a))


class DeepseekV2ForCausalLM(DecoderLM):
    """The CausalLM of api.md over one MLA KV group; the caller plans the backend for `meta` before forward()."""

    model: DeepseekModel
    args: DeepseekArgs

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> DeepseekArgs:
        method = config.get("topk_method") or "greedy"
        if method not in V2_TOPK_METHODS:
            raise UnsupportedModel(f"MoE routing topk_method={method!r} is not supported", param="model")
        if config.get("norm_topk_prob"):  # transformers' V2 router ignores it; DeepSeek's own code drops the scaling
            raise UnsupportedModel("MoE routing norm_topk_prob=true is not supported for DeepSeek-V2", param="model")
        routing = read_grouped_routing(config, scoring="softmax", topk_method=method, norm_topk_prob=False)
        return read_deepseek_args(config, names, routing, rope_interleave=True)

    def __init__(self, args: DeepseekArgs) -> None:
        super().__init__(args, DeepseekModel(args))
        self.rotary: RotaryEmbedding | None = None

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        mla = self.args.mla
        return [latent_group(self.args.num_layers, mla.latent, mla_softmax_scale(mla.qk_head_dim, self.args.rope))]

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """Shrinks this model (on the meta device) to rank tp.rank's attention heads, MLP and expert columns and
        vocabulary rows (engine/model/sharding.py); returns what the loader reads for it."""
        plan = ShardPlan()
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, DeepseekDecoderLayer)
            prefix = f"model.layers.{i}"
            layer.self_attn = shard_mla(layer.self_attn, f"{prefix}.self_attn", tp, plan)
            if isinstance(layer.mlp, SparseMoE):
                shard_experts(layer.mlp, f"{prefix}.mlp", tp, plan)
            else:
                shard_gated_mlp(layer.mlp, f"{prefix}.mlp", tp, plan)
            layer.tp = tp
        shard_vocab(self, tp, plan)
        return plan

    def checkpoint_name(self, name: str) -> str | None:
        """The hub's next-n prediction (MTP) layers, stored as model.layers.{num_hidden_layers + i}, are not read
        here: speculative method mtp reads the first as its head (engine/model/models/next_n_mtp.py)."""
        layer = _LAYER.match(name)
        return None if layer is not None and int(layer.group(1)) >= self.args.num_layers else name

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """The rotary tables over the qk_rope dims, always torch's (the MLA layer rotates q_pe and k_pe itself,
        before either attention backend sees them)."""
        a = self.args
        self.rotary = RotaryEmbedding(
            head_dim=a.mla.qk_rope_head_dim,
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
        backend: AttentionBackend | list[AttentionBackend],
    ) -> torch.Tensor:
        """kv_caches: each layer's (ckv, kpe) latent pages; backend: one for every layer, or each layer's."""
        assert self.rotary is not None, "init_rotary() was not called"
        rotary = self.rotary.lookup(positions)
        h, residual = self.model.embed_tokens(input_ids), None
        backends = cast(list[LatentAttentionBackend], self.layer_backends(backend, len(kv_caches)))
        for layer, caches, b in zip(self.model.layers, kv_caches, backends, strict=True):
            h, residual = layer(h, residual, rotary, caches, b)
        assert residual is not None
        h, _ = self.model.norm.add_forward(h, residual)
        return h


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: sigmoid routing with e_score_correction_bias over groups (noaux_tc), q_lora_rank, and the rotary
    dims interleaved unless rope_interleave is false."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> DeepseekArgs:
        routing = read_grouped_routing(config, scoring="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
        return read_deepseek_args(config, names, routing, rope_interleave=config.get("rope_interleave", True))


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's decoder whose MoE layers are the ones mlp_layer_types names "sparse" (default:
    every layer after the first)."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> DeepseekArgs:
        num_layers = config["num_hidden_layers"]
        types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
        routing = read_grouped_routing(config, scoring="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
        sparse = tuple(i for i, kind in enumerate(types[:num_layers]) if kind == "sparse")
        interleave = config.get("rope_interleave", True)
        return read_deepseek_args(config, names, routing, rope_interleave=interleave, sparse_layers=sparse)
