"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM): Granite 3 MoE's decoder (its four scalars, experts routed by a
softmax over the chosen k, the ungated-named shared MLP beside them) whose mixer is, per layer_types, Mamba2
(engine/model/layers/mamba2.py, its state in a slot of the engine's state pool) or GQA attention over the paged KV
cache, with rotary only where position_embedding_type is "rope" (Granite 4.0-H's releases say "nope"). Each layer:
norm -> mixer -> residual_multiplier x + residual; norm -> experts + shared MLP (the shared MLP alone where
num_local_experts is 0: Micro) -> residual_multiplier x + residual.

Hub checkpoints name the mixers `mamba.*` and `self_attn.*`, the MoE as Granite 3's (`block_sparse_moe`,
`shared_mlp`; engine/model/models/granite.py). Tensor-parallel, a rank holds whole Mamba2 groups (or, with more ranks
than groups, as the releases' one group, a part of its heads), attention heads and columns of every expert and of the
shared MLP (engine/model/sharding.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import UnsupportedModel
from engine.model.layers.mamba2 import Mamba2Mixer, Mamba2Shape, read_dt_limit
from engine.model.layers.moe import SparseMoE
from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.recurrent_step import RecurrentPlan
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.models.granite import granite_moe_name, granite_scalars
from engine.model.models.llama import LlamaArgs, LlamaAttention, LlamaMLP
from engine.model.models.mamba2_base import Mamba2HybridArgs, Mamba2HybridLM
from engine.model.models.moe_base import MoeArgs, read_moe_args, shared_mlp
from engine.model.sharding import ShardPlan, shard_attention, shard_experts, shard_gated_mlp, shard_mamba2, shard_vocab

# The hub's layer type names and transformers 5's
LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
# Without experts the shared MLP is the layer's whole MLP
_DENSE_NAMES = (
    (re.compile(r"\.shared_mlp\.input_linear\."), ".mlp.gate_up_proj."),
    (re.compile(r"\.shared_mlp\.output_linear\."), ".mlp.down_proj."),
)


@dataclass(kw_only=True)
class GraniteHybridArgs(Mamba2HybridArgs):
    """Granite 3 MoE's args (routing None: no experts, intermediate_size the shared MLP's), each layer's mixer
    and the Mamba2 shape."""


def read_layer_types(config: dict) -> tuple[str, ...]:
    """Each layer's mixer as transformers 5 names it; transformers' default (no list): every layer Mamba2."""
    types = config.get("layer_types") or config.get("layers_block_type")
    types = [LAYER_TYPES.get(t, t) for t in types or ["mamba"] * config["num_hidden_layers"]]
    unknown = sorted(set(types) - set(LAYER_TYPES.values()))
    if unknown:
        raise UnsupportedModel(
            f"layer type {unknown[0]!r} is not supported (supported: mamba, attention)", param="model"
        )
    return tuple(types)


def read_mamba_shape(config: dict, names: set[str]) -> Mamba2Shape:
    hidden, heads = config["hidden_size"], config.get("mamba_n_heads") or 128
    groups = config.get("mamba_n_groups") or 1
    if heads % groups:
        raise UnsupportedModel(f"mamba_n_heads={heads} is not a multiple of mamba_n_groups={groups}", param="model")
    d_head = config.get("mamba_d_head")
    head_dim = (config.get("mamba_expand") or 2) * hidden // heads if d_head in (None, "auto") else int(d_head)
    return Mamba2Shape(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        n_groups=groups,
        state_size=config.get("mamba_d_state") or 256,
        conv_kernel=config.get("mamba_d_conv") or 4,
        chunk_size=config.get("mamba_chunk_size") or 256,
        eps=config.get("rms_norm_eps", 1e-6),
        conv_bias=any(n.endswith("mamba.conv1d.bias") for n in names),
        proj_bias=any(n.endswith("mamba.in_proj.bias") for n in names),
        dt_limit=read_dt_limit(config),
    )


def read_granite_hybrid_args(config: dict, names: set[str]) -> GraniteHybridArgs:
    """GraniteHybridArgs from a granitemoehybrid config; UnsupportedModel in one line for what the engine does not
    run."""
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config['hidden_act']!r} is not supported", param="model")
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant:
        raise UnsupportedModel(
            f"quantization_config quant_method={quant!r}: quantized Granite 4.0-H checkpoints are not served yet (its "
            "Mamba2 projections are untested quantized)",
            param="model",
        )
    layer_types = read_layer_types(config)
    shared = config.get("shared_intermediate_size", 1024)
    args: LlamaArgs
    if config.get("num_local_experts", 8):
        args = read_moe_args(
            config, names, expert_size_key="intermediate_size", norm_topk_prob=True, shared_expert_size=shared
        )
    else:
        args = MoeArgs.from_config({**config, "intermediate_size": shared}, names)
    rotates = config.get("position_embedding_type") == "rope"
    fields = {name: getattr(args, name) for name in MoeArgs.__dataclass_fields__}
    fields.update(
        granite_scalars({"attention_multiplier": 1.0, **config}),  # this family's default scale is 1.0
        no_rope_layers=() if rotates else tuple(range(len(layer_types))),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    mamba = read_mamba_shape(config, names) if "linear_attention" in layer_types else None
    return GraniteHybridArgs(**fields, layer_types=layer_types, mamba=mamba)


class GraniteHybridLayer(nn.Module):
    """norm -> Mamba2 (`mamba`) or attention (`self_attn`) -> scaled + residual; norm -> MLP -> scaled + residual."""

    def __init__(self, a: GraniteHybridArgs, index: int) -> None:
        super().__init__()
        self.recurrent = a.layer_types[index] == "linear_attention"
        if self.recurrent:
            assert a.mamba is not None
            self.mamba = Mamba2Mixer(a.mamba)
        else:
            self.self_attn = LlamaAttention(a, rotates=index not in a.no_rope_layers)
        self.mlp = (
            LlamaMLP(a)
            if a.routing is None
            else SparseMoE(routing=a.routing, hidden_size=a.hidden_size, shared_experts=shared_mlp(a))
        )
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.residual_multiplier = a.residual_multiplier
        self.tp: TensorParallel | None = None  # tensor-parallel: the mixer and the MLP give partial sums

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor | None, torch.Tensor | None],
        cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend | RecurrentPlan,
    ) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.recurrent:
            assert isinstance(backend, RecurrentPlan)
            x = self.mamba(x, backend.step, *cache)
        else:
            x = self.self_attn(x, positions, *cos_sin, *cache, backend)
        h = h + self.scaled(x)
        return h + self.scaled(self.mlp(self.post_attention_layernorm(h)))

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """A mixer's or MLP's output as it joins the stream: all-reduced (tensor-parallel), scaled."""
        if self.tp is not None:
            x = self.tp.all_reduce(x)
        return x * self.residual_multiplier


class GraniteHybridModel(nn.Module):
    def __init__(self, a: GraniteHybridArgs) -> None:
        super().__init__()
        vocab, hidden = a.vocab_size, a.hidden_size
        self.embed_tokens = nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
        self.layers = nn.ModuleList(GraniteHybridLayer(a, i) for i in range(a.num_layers))
        self.norm = RMSNorm(hidden, a.rms_norm_eps)


class GraniteMoeHybridForCausalLM(Mamba2HybridLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> GraniteHybridArgs:
        return read_granite_hybrid_args(config, names)

    def __init__(self, args: GraniteHybridArgs) -> None:
        super().__init__(args, GraniteHybridModel(args))
        self.rotary: RotaryEmbedding | None = None

    @property
    def layers(self) -> list[GraniteHybridLayer]:
        return [cast(GraniteHybridLayer, layer) for layer in cast(GraniteHybridModel, self.model).layers]

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """This rank's Mamba2 groups, attention heads, expert and shared-MLP columns and vocabulary rows
        (engine/model/sharding.py)."""
        plan = ShardPlan()
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            if layer.recurrent:
                layer.mamba = cast(Mamba2Mixer, shard_mamba2(layer.mamba, f"{prefix}.mamba", tp, plan))
            else:
                shard_attention(layer.self_attn, f"{prefix}.self_attn", tp, plan)
            if isinstance(layer.mlp, SparseMoE):
                shard_experts(layer.mlp, f"{prefix}.mlp", tp, plan)
            else:
                shard_gated_mlp(layer.mlp, f"{prefix}.mlp", tp, plan)
            layer.tp = tp
        shard_vocab(self, tp, plan)
        return plan

    def checkpoint_name(self, name: str) -> str:
        if self.args.routing is None:
            for pattern, ours in _DENSE_NAMES:
                name = pattern.sub(ours, name)
        return granite_moe_name(name)

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """Torch's rotary tables where an attention layer rotates (position_embedding_type "rope"), on every device."""
        a = self.args
        if len(a.no_rope_layers) == a.num_layers:
            return
        self.rotary = RotaryEmbedding(
            head_dim=a.head_dim,
            rope=a.rope,
            max_position_embeddings=a.max_position_embeddings,
            max_positions=max_positions,
            dtype=dtype,
            device=device,
        )

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.head_logits(hidden, exact_rows) / self.args.logits_scaling

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend | RecurrentPlan],
    ) -> torch.Tensor:
        """kv_caches / backend per layer: an attention layer's K/V pages and its group's backend, a Mamba2 layer's
        (conv windows, SSM states) slots and the step's RecurrentPlan (one backend: every layer attention)."""
        model = cast(GraniteHybridModel, self.model)
        cos_sin = (None, None) if self.rotary is None else self.rotary.lookup(positions)
        h = model.embed_tokens(input_ids) * self.args.embedding_multiplier
        backends = backend if isinstance(backend, list) else [backend] * len(kv_caches)
        for layer, cache, b in zip(self.layers, kv_caches, backends, strict=True):
            h = layer(h, positions, cos_sin, cache, b)
        return model.norm(h)
