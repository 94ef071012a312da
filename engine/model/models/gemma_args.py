"""The arguments of the one Gemma decoder (gemma_base.py): its shape and the options Gemma 2, 3 and 4 set, read
from config.json by each family's file, and the config checks every Gemma shares."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import UnsupportedModel
from engine.model.layers.routing import Routing
from engine.model.models.base import DecoderShape

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(kw_only=True)
class GemmaArgs(DecoderShape):
    """The shape of a Gemma decoder and the options each family sets. num_kv_heads / head_dim are the local
    layers'; layer_shapes has every layer's (num_kv_heads, head_dim) (empty: all the same)."""

    layer_types: list[str]
    ropes: dict[str, dict]  # layer type -> transformers' rope parameters
    sliding_window: int | None
    attn_scale: float  # Gemma 2 / 3: query_pre_attn_scalar**-0.5; Gemma 4: 1
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    unit_offset: bool = True  # norms scale by 1 + w (Gemma 2 / 3) or by w (Gemma 4)
    qk_norm: bool = False  # Gemma 3 / 4: RMSNorm over head_dim on q and k before rope
    v_norm: bool = False  # Gemma 4: a weightless RMSNorm on v
    layer_scalar: bool = False  # Gemma 4: a learned scalar multiplies each layer's output
    layer_shapes: list[tuple[int, int]] = field(default_factory=list)
    k_eq_v: bool = False  # global layers: values are the keys' projection (normed without a weight)
    kv_sources: dict[int, int] = field(default_factory=dict)  # shared-KV layer -> the layer whose pages it reads
    ple_dim: int = 0  # hidden_size_per_layer_input; 0: no per-layer input embeddings
    ple_vocab: int = 0
    double_wide_mlp: bool = False  # shared-KV layers have an MLP twice as wide
    tie_word_embeddings: bool = True
    routing: Routing | None = None  # Gemma 4's MoE block beside the MLP (every layer has it when set)

    def __post_init__(self) -> None:
        self.layer_shapes = self.layer_shapes or [(self.num_kv_heads, self.head_dim)] * self.num_layers

    @classmethod
    def from_config(cls, config: dict, layer_types: list[str], ropes: dict[str, dict], **fields) -> GemmaArgs:
        """The fields every Gemma config has (KeyError on a missing one; the family fills its own defaults into
        `config` first); `fields` sets the rest and overrides."""
        common = dict(
            **DecoderShape.read(config, max_positions=8192),
            layer_types=layer_types,
            ropes=ropes,
            sliding_window=config.get("sliding_window"),
            final_soft_cap=config.get("final_logit_softcapping"),
            tie_word_embeddings=config.get("tie_word_embeddings", True),
        )
        return cls(**{**common, **fields})

    @property
    def activation_width(self) -> int:
        """Per token, the widest MLP activations a layer holds (CUDA start-up budgets for them)."""
        moe = self.routing.top_k * (self.routing.intermediate_size + self.hidden_size) if self.routing else 0
        return self.intermediate_size * (2 if self.double_wide_mlp else 1) + moe

    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        return [self.sliding_window if t == SLIDING and self.sliding_window else None for t in self.layer_types]


def check_config(config: dict, activation: str | None, encoder: str | None) -> None:
    """UnsupportedModel for what no Gemma here runs: an activation other than tanh GeLU, bidirectional attention
    over text (`encoder`: the setting that asks for it, as the family reads it; None: causal), attention biases."""
    act = activation or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise UnsupportedModel(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)", param="model")
    if encoder:
        raise UnsupportedModel(f"{encoder} is not supported (an encoder)", param="model")
    if config.get("attention_bias"):
        raise UnsupportedModel("attention_bias is not supported for Gemma", param="model")


def default_layer_types(config: dict, pattern: int) -> list[str]:
    """config.json's layer_types, or transformers' default: every `pattern`-th layer global, the others sliding."""
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {n} layers", param="model")
    return list(types)
