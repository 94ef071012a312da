"""NVIDIA Nemotron-H and Nemotron 3 Nano (NemotronHForCausalLM): a stack of single-mixer blocks, each a pre-norm
(RMSNorm) and a residual around one of Mamba2 (`M`, engine/model/layers/mamba2.py, its state in a slot of the
engine's state pool), attention (`*`: GQA over the paged KV cache with no positional encoding at all), a non-gated
relu^2 MLP (`-`) or a mixture of relu^2 experts (`E`: DeepSeek-V3's sigmoid routing with a correction bias over
expert groups, scaled, plus a relu^2 shared expert), as hybrid_override_pattern (or layers_block_type) lists them.

Tensor-parallel, each rank holds whole Mamba2 groups (their heads and states), attention heads, and columns of the
MLP and of every expert (engine/model/sharding.py). The engine numbers the layers that hold a cache (attention
pages or a state slot) on their own: MLP and MoE blocks hold none, so the KV group's and the recurrent spec's layer
indices count only the `M` and `*` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import UnsupportedModel
from engine.model.layers.activation import relu_squared
from engine.model.layers.mamba2 import Mamba2Mixer, Mamba2Shape, read_dt_limit
from engine.model.layers.moe import SparseMoE, StackedExperts
from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.recurrent_step import RecurrentPlan
from engine.model.layers.routing import read_grouped_routing
from engine.model.models.llama import LlamaAttention
from engine.model.models.mamba2_base import CACHED, Mamba2HybridArgs, Mamba2HybridLM
from engine.model.models.moe_base import MoeArgs
from engine.model.sharding import ShardPlan, shard_attention, shard_experts, shard_gated_mlp, shard_mamba2, shard_vocab

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@dataclass(kw_only=True)
class NemotronHArgs(Mamba2HybridArgs):
    """The decoder's shape, each block's mixer, the Mamba2 shape and the MoE routing (None: no `E` block)."""


def read_layer_types(config: dict) -> tuple[str, ...]:
    """Each block's mixer: layers_block_type as transformers 5 writes it, or the hub's hybrid_override_pattern."""
    types = config.get("layers_block_type") or config.get("layer_types")
    if not types:
        pattern = config.get("hybrid_override_pattern") or ""
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown or not pattern:
            raise UnsupportedModel(
                f"hybrid_override_pattern {pattern!r} has blocks other than M, *, - and E", param="model"
            )
        types = [PATTERN[c] for c in pattern]
    unknown = sorted(set(types) - set(PATTERN.values()))
    if unknown:
        raise UnsupportedModel(f"layer type {unknown[0]!r} is not supported (supported: M, *, - and E)", param="model")
    return tuple(types)


def read_nemotron_h_args(config: dict, names: set[str]) -> NemotronHArgs:
    """NemotronHArgs from a nemotron_h config; UnsupportedModel in one line for what the engine does not run."""
    for key, runs in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if config.get(key, runs) != runs:
            raise UnsupportedModel(f"{key} {config[key]!r} is not supported (this family runs {runs!r})", param="model")
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant:
        raise UnsupportedModel(
            f"quantization_config quant_method={quant!r}: quantized Nemotron-H checkpoints are not served yet (its "
            "Mamba2 projections and non-gated experts are untested quantized)",
            param="model",
        )
    if config.get("moe_latent_size"):
        raise UnsupportedModel("moe_latent_size (latent MoE projections) is not supported", param="model")
    layer_types = read_layer_types(config)
    heads = config["mamba_num_heads"]
    groups = config.get("n_groups") or config.get("mamba_n_groups") or 1
    if heads % groups:
        raise UnsupportedModel(f"mamba_num_heads={heads} is not a multiple of n_groups={groups}", param="model")
    mamba = Mamba2Shape(
        hidden_size=config["hidden_size"],
        num_heads=heads,
        head_dim=config["mamba_head_dim"],
        n_groups=groups,
        state_size=config["ssm_state_size"],
        conv_kernel=config.get("conv_kernel") or config.get("mamba_d_conv") or 4,
        chunk_size=config.get("chunk_size") or config.get("mamba_chunk_size") or 128,
        eps=config.get("layer_norm_epsilon", 1e-5),
        conv_bias=any(n.endswith("mixer.conv1d.bias") for n in names),
        proj_bias=any(n.endswith("mixer.in_proj.bias") for n in names),
        out_bias=any(n.endswith("mixer.out_proj.bias") for n in names),
        dt_limit=read_dt_limit(config),
    )
    routing = None
    if "moe" in layer_types:
        routing = read_grouped_routing(config, scoring="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
        # NOTE: transformers builds the shared expert whatever n_shared_experts says, this wide.
        routing = replace(routing, shared_expert_size=config["moe_shared_expert_intermediate_size"])
    config = {
        **config,
        "num_hidden_layers": len(layer_types),
        "rms_norm_eps": config.get("layer_norm_epsilon", 1e-5),
        "head_dim": config.get("head_dim") or config.get("attention_head_dim"),  # the hub's first releases' name
    }
    args = MoeArgs.from_config(config, names, routing=routing)
    fields = {name: getattr(args, name) for name in MoeArgs.__dataclass_fields__}
    fields.update(
        qkv_bias=any(n.endswith("mixer.q_proj.bias") for n in names),
        o_bias=any(n.endswith("mixer.o_proj.bias") for n in names),
        mlp_bias=any(n.endswith("mixer.up_proj.bias") for n in names),
        sparse_layers=tuple(i for i, t in enumerate(layer_types) if t == "moe"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    return NemotronHArgs(**fields, layer_types=layer_types, mamba=mamba)


class ReluSquaredMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2): the `-` block and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_squared(self.up_proj(x)))


def relu_squared_moe(a: NemotronHArgs) -> SparseMoE:
    r = a.routing
    assert r is not None
    experts = StackedExperts(
        num_experts=r.num_experts,
        hidden_size=a.hidden_size,
        intermediate_size=r.intermediate_size,
        activation=relu_squared,
        gated=False,
    )
    shared = ReluSquaredMLP(a.hidden_size, r.shared_expert_size, a.mlp_bias) if r.shared_expert_size else None
    return SparseMoE(routing=r, hidden_size=a.hidden_size, experts=experts, shared_experts=shared)


class NemotronHBlock(nn.Module):
    """norm -> one mixer -> + residual."""

    def __init__(self, a: NemotronHArgs, index: int) -> None:
        super().__init__()
        self.kind = a.layer_types[index]
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if self.kind == "linear_attention":
            assert a.mamba is not None
            self.mixer: nn.Module = Mamba2Mixer(a.mamba)
        elif self.kind == "full_attention":
            self.mixer = LlamaAttention(a, rotates=False)
        elif self.kind == "mlp":
            self.mixer = ReluSquaredMLP(a.hidden_size, a.intermediate_size, a.mlp_bias)
        else:
            self.mixer = relu_squared_moe(a)
        self.tp: TensorParallel | None = None  # tensor-parallel: the mixer gives a partial sum to all-reduce

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        backend: AttentionBackend | RecurrentPlan | None,
    ) -> torch.Tensor:
        x = self.norm(h)
        if self.kind == "linear_attention":
            assert isinstance(backend, RecurrentPlan) and cache is not None
            x = self.mixer(x, backend.step, *cache)
        elif self.kind == "full_attention":
            assert cache is not None
            x = self.mixer(x, positions, None, None, *cache, backend)
        else:
            x = self.mixer(x)
        return h + (x if self.tp is None else self.tp.all_reduce(x))


class NemotronHModel(nn.Module):
    def __init__(self, a: NemotronHArgs) -> None:
        super().__init__()
        vocab, hidden = a.vocab_size, a.hidden_size
        self.embed_tokens = nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
        self.layers = nn.ModuleList(NemotronHBlock(a, i) for i in range(a.num_layers))
        self.norm = RMSNorm(hidden, a.rms_norm_eps)


class NemotronHForCausalLM(Mamba2HybridLM):
    mtp_refusal = "Nemotron-H's multi-token-prediction layers (mtp.*) are not built"

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> NemotronHArgs:
        return read_nemotron_h_args(config, names)

    def __init__(self, args: NemotronHArgs) -> None:
        super().__init__(args, NemotronHModel(args))

    @property
    def blocks(self) -> list[NemotronHBlock]:
        return [cast(NemotronHBlock, block) for block in cast(NemotronHModel, self.model).layers]

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """This rank's Mamba2 groups, attention heads, MLP and expert columns and vocabulary rows
        (engine/model/sharding.py)."""
        plan = ShardPlan()
        for i, layer in enumerate(self.blocks):
            prefix = f"model.layers.{i}.mixer"
            if layer.kind == "linear_attention":
                layer.mixer = shard_mamba2(layer.mixer, prefix, tp, plan)
            elif layer.kind == "full_attention":
                shard_attention(layer.mixer, prefix, tp, plan)
            elif layer.kind == "mlp":
                shard_gated_mlp(layer.mixer, prefix, tp, plan)
            else:
                shard_experts(layer.mixer, prefix, tp, plan)
            layer.tp = tp
        shard_vocab(self, tp, plan)
        return plan

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """Nothing to build: no block has a positional encoding."""

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The hub's backbone.* (transformers 5: model.*) as this model's names; the MTP head (mtp.*) is not read."""
        if name.startswith("mtp."):
            return None
        for hub, own in (
            ("backbone.", "model."),
            ("model.embeddings.", "model.embed_tokens."),
            ("model.norm_f.", "model.norm."),
        ):
            if name.startswith(hub):
                name = own + name[len(hub) :]
        return name.replace(".mixer.experts.up_proj", ".mixer.experts.gate_up_proj")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend | RecurrentPlan],
    ) -> torch.Tensor:
        """kv_caches / backend: one per block that holds a cache, in order (an attention block's K/V pages and its
        group's backend, a Mamba2 block's (conv windows, SSM states) slots and the step's RecurrentPlan)."""
        model = cast(NemotronHModel, self.model)
        h = model.embed_tokens(input_ids)
        # One backend for all: a model whose cached blocks are all attention (no state slots), in one KV group.
        caches = iter(kv_caches)
        backends = iter(backend if isinstance(backend, list) else [backend] * len(kv_caches))
        for layer in self.blocks:
            cached = layer.kind in CACHED
            h = layer(h, positions, next(caches) if cached else None, next(backends) if cached else None)
        return model.norm(h)
