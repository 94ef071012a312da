"""TII Falcon-H1 (FalconH1ForCausalLM): in every layer, attention (Llama's, with rotary) and a Mamba2 mixer
(engine/model/layers/mamba2.py) read the same input_layernorm output side by side and their outputs join the residual
together; then pre_ff_layernorm and a gated SiLU MLP.

Its μP multipliers, as transformers applies them: the embeddings times embedding_multiplier; the attention's input
times attention_in_multiplier, its keys times key_multiplier (here in the softmax scale, which equals it: the scores
are linear in k), its output times attention_out_multiplier; the mixer's input times ssm_in_multiplier, in_proj's z,
x, B, C and dt parts each times one of ssm_multipliers, its output times ssm_out_multiplier; the MLP's gate (before
SiLU) and its output times mlp_multipliers; the logits times lm_head_multiplier.

Every layer holds KV pages (its attention) and a state slot (its mixer): the engine numbers the caches, not the
layers, so layer i's attention is cache 2i (the one KV group) and its mixer cache 2i + 1 (the recurrent spec).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import UnsupportedModel
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.linear import FusedLinear
from engine.model.layers.mamba2 import Mamba2Mixer, Mamba2Shape, read_dt_limit
from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.recurrent_step import RecurrentPlan, RecurrentSpec
from engine.model.models.llama import LlamaArgs, LlamaAttention, LlamaForCausalLM, LlamaModel
from engine.model.sharding import ShardPlan, shard_attention, shard_gated_mlp, shard_mamba2, shard_vocab


@dataclass(kw_only=True)
class FalconH1Args(LlamaArgs):
    """The Llama decoder's shape, the Mamba2 shape (with its in_proj multipliers) and the other μP multipliers."""

    mamba: Mamba2Shape
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # the gate's (before SiLU) and the down projection's
    lm_head_multiplier: float = 1.0


def read_falcon_h1_mamba(config: dict, names: set[str]) -> Mamba2Shape:
    """The mixer's shape and options from a falcon_h1 config (mamba_d_head "auto": mamba_d_ssm over the heads)."""
    heads, groups = config["mamba_n_heads"], config.get("mamba_n_groups") or 1
    mz, mx, mb, mc, mdt = (float(m) for m in config.get("ssm_multipliers") or (1.0,) * 5)
    inner = config.get("mamba_d_ssm") or int((config.get("mamba_expand") or 2) * config["hidden_size"])
    head_dim = config.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if heads % groups or head_dim * heads != inner:
        raise UnsupportedModel(
            f"mamba_n_heads={heads}, mamba_n_groups={groups}, mamba_d_head={head_dim}: the heads do not split "
            f"mamba_d_ssm={inner} into whole groups",
            param="model",
        )
    return Mamba2Shape(
        hidden_size=config["hidden_size"],
        num_heads=heads,
        head_dim=head_dim,
        n_groups=groups,
        state_size=config.get("mamba_d_state") or 256,
        conv_kernel=config.get("mamba_d_conv") or 4,
        chunk_size=config.get("mamba_chunk_size") or 256,
        eps=config.get("rms_norm_eps", 1e-5),
        conv_bias=any(n.endswith("mamba.conv1d.bias") for n in names),
        proj_bias=any(n.endswith("mamba.in_proj.bias") for n in names),
        out_bias=any(n.endswith("mamba.out_proj.bias") for n in names),
        dt_limit=read_dt_limit(config),
        rms_norm=bool(config.get("mamba_rms_norm", False)),
        norm_before_gate=bool(config.get("mamba_norm_before_gate", True)),
        proj_multipliers=(mz, mx, mb, mc, mdt),
    )


def read_falcon_h1_args(config: dict, names: set[str]) -> FalconH1Args:
    """FalconH1Args from a falcon_h1 config; UnsupportedModel in one line for what the engine does not run."""
    if config.get("hidden_act", "silu") != "silu":
        act = config["hidden_act"]
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (Falcon-H1 runs 'silu')", param="model")
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant:
        raise UnsupportedModel(
            f"quantization_config quant_method={quant!r}: quantized Falcon-H1 checkpoints are not served yet",
            param="model",
        )
    args = LlamaArgs.from_config({**config, "rms_norm_eps": config.get("rms_norm_eps", 1e-5)}, names)
    fields = {name: getattr(args, name) for name in LlamaArgs.__dataclass_fields__}
    gate, down = config.get("mlp_multipliers") or (1.0, 1.0)
    fields.update(
        mlp_bias=any(n.endswith("feed_forward.gate_proj.bias") for n in names),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
    )
    return FalconH1Args(
        **fields,
        mamba=read_falcon_h1_mamba(config, names),
        attention_in_multiplier=float(config.get("attention_in_multiplier", 1.0)),
        attention_out_multiplier=float(config.get("attention_out_multiplier", 1.0)),
        key_multiplier=float(config.get("key_multiplier", 1.0)),
        ssm_in_multiplier=float(config.get("ssm_in_multiplier", 1.0)),
        ssm_out_multiplier=float(config.get("ssm_out_multiplier", 1.0)),
        mlp_multipliers=(float(gate), float(down)),
        lm_head_multiplier=float(config.get("lm_head_multiplier", 1.0)),
    )


class FalconH1MLP(nn.Module):
    """down_proj(SiLU(gate_proj(x) * gate multiplier) * up_proj(x)) * down multiplier."""

    def __init__(self, a: FalconH1Args) -> None:
        super().__init__()
        n = a.intermediate_size
        self.gate_up_proj = FusedLinear(a.hidden_size, {"gate_proj": n, "up_proj": n}, a.mlp_bias)
        self.down_proj = nn.Linear(n, a.hidden_size, bias=a.mlp_bias)
        self.gate_multiplier, self.down_multiplier = a.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate * self.gate_multiplier) * up) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    """input_layernorm -> attention and Mamba2 side by side, each scaled, + residual; pre_ff_layernorm -> MLP
    + residual."""

    def __init__(self, a: FalconH1Args) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = LlamaAttention(a)
        self.mamba = Mamba2Mixer(a.mamba)
        self.pre_ff_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.feed_forward = FalconH1MLP(a)
        self.attention_in, self.attention_out = a.attention_in_multiplier, a.attention_out_multiplier
        self.ssm_in, self.ssm_out = a.ssm_in_multiplier, a.ssm_out_multiplier
        self.tp: TensorParallel | None = None  # tensor-parallel: each block gives a partial sum to all-reduce

    def forward(
        self,
        h: torch.Tensor,
        *,
        positions: torch.Tensor,
        rotary: tuple[torch.Tensor | None, torch.Tensor | None],
        pages: tuple[torch.Tensor, torch.Tensor],
        attention: AttentionBackend,
        state: tuple[torch.Tensor, torch.Tensor],
        plan: RecurrentPlan,
    ) -> torch.Tensor:
        x = self.input_layernorm(h)
        mamba = self.mamba(x * self.ssm_in, plan.step, *state) * self.ssm_out
        attn = self.self_attn(x * self.attention_in, positions, *rotary, *pages, attention) * self.attention_out
        h = h + self._reduce(mamba + attn)
        return h + self._reduce(self.feed_forward(self.pre_ff_layernorm(h)))

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.all_reduce(x)


class FalconH1ForCausalLM(LlamaForCausalLM):
    """The Llama decoder's embedding, rotary and head around Falcon-H1's layers; two caches a layer."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> FalconH1Args:
        return read_falcon_h1_args(config, names)

    @classmethod
    def make_layer(cls, args: LlamaArgs, index: int) -> nn.Module:
        return FalconH1DecoderLayer(cast(FalconH1Args, args))

    @property
    def layers(self) -> list[FalconH1DecoderLayer]:
        return [cast(FalconH1DecoderLayer, layer) for layer in cast(LlamaModel, self.model).layers]

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        a = cast(FalconH1Args, self.args)
        scale = None if a.key_multiplier == 1.0 else a.key_multiplier * a.head_dim**-0.5
        layers = tuple(range(0, 2 * a.num_layers, 2))
        return [KVGroupSpec(layers=layers, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, scale=scale)]

    def recurrent_spec(self) -> RecurrentSpec:
        # A shard's mixers hold its groups' heads only: the slots are sized from a mixer, not from the config.
        conv, state = self.layers[0].mamba.shape.state_shapes()
        return RecurrentSpec(tuple(range(1, 2 * self.args.num_layers, 2)), conv, state, kind="mamba2")

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head_logits(hidden, exact_rows)
        multiplier = cast(FalconH1Args, self.args).lm_head_multiplier
        return logits if multiplier == 1.0 else logits * multiplier

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """This rank's attention heads, Mamba2 groups, MLP columns and vocabulary rows (engine/model/sharding.py)."""
        plan = ShardPlan()
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            shard_attention(layer.self_attn, f"{prefix}.self_attn", tp, plan)
            layer.mamba = cast(Mamba2Mixer, shard_mamba2(layer.mamba, f"{prefix}.mamba", tp, plan))
            shard_gated_mlp(layer.feed_forward, f"{prefix}.feed_forward", tp, plan)
            layer.tp = tp
        shard_vocab(self, tp, plan)
        return plan

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The hub's final_layernorm is this model's norm."""
        return name.replace("model.final_layernorm.", "model.norm.")

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend | RecurrentPlan],
    ) -> torch.Tensor:
        """kv_caches / backend: two per layer, in cache order (its attention's K/V pages and KV group backend, then
        its mixer's (conv windows, SSM states) slots and the step's RecurrentPlan)."""
        assert isinstance(backend, list), "every layer holds a state slot: the runner gives one backend per cache"
        a = cast(FalconH1Args, self.args)
        h = cast(LlamaModel, self.model).embed_tokens(input_ids) * a.embedding_multiplier
        rotaries = self.layer_rotaries(positions)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:  # an EAGLE-3 head reads the residual stream entering these layers
                captured[i] = h
            h = layer(
                h,
                positions=positions,
                rotary=rotaries[i],
                pages=kv_caches[2 * i],
                attention=cast(AttentionBackend, backend[2 * i]),
                state=kv_caches[2 * i + 1],
                plan=cast(RecurrentPlan, backend[2 * i + 1]),
            )
        if captured:  # side by side in the head's order
            self.aux_hidden = torch.cat([captured[i] for i in self.aux_layers], dim=-1)
        return cast(LlamaModel, self.model).norm(h)
