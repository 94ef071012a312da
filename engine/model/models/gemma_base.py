"""The one Gemma decoder that Gemma 2, 3 and 4 configure (gemma2.py, gemma3.py, gemma4.py read their configs into
GemmaArgs): GeGLU, RMSNorms in float32 before and after attention and the MLP, embeddings scaled by sqrt(hidden),
sliding-window layers by `layer_types`, a rope per layer type, a final logit soft-cap, and the attention extras
(scale, soft-cap) carried by the KV groups to their backends. The layers are in gemma_layers.py.

Runs in torch on every device (norms, rope and GeGLU); attention goes through the backend over the paged KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.core.kv_spec import KVGroupSpec, kv_groups
from engine.errors import UnsupportedModel
from engine.model.layers.moe import Routing
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.models.base import DecoderLM
from engine.model.models.gemma_layers import FULL, SLIDING, GemmaModel, scaled

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass
class GemmaArgs:
    """The shape of a Gemma decoder and the options each family sets. num_kv_heads / head_dim are the local
    layers'; layer_shapes has every layer's (num_kv_heads, head_dim) (empty: all the same)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
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
        heads = config["num_attention_heads"]
        common = dict(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_q_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 8192),
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


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaForCausalLM(DecoderLM):
    """The CausalLM of every Gemma; a family's subclass reads its config (read_args)."""

    args: GemmaArgs

    def __init__(self, args: GemmaArgs) -> None:
        super().__init__(args, GemmaModel(args))
        self.rotary: dict[str, RotaryEmbedding] = {}

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        a = self.args
        return kv_groups(a.windows(), a.num_kv_heads, a.head_dim, scale=a.attn_scale, soft_cap=a.attn_soft_cap,
                         shapes=a.layer_shapes, shared=a.kv_sources)

    def checkpoint_name(self, name: str) -> str | None:
        """A shared-KV layer's k/v projections and norms, which some checkpoints carry, are not read."""
        parts = name.split(".")
        if (self.args.kv_sources and len(parts) > 4 and parts[:2] == ["model", "layers"]
                and int(parts[2]) in self.args.kv_sources and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")):
            return None
        return name

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """One rotary table per layer type, at that type's head size."""
        a = self.args
        dims = {t: a.layer_shapes[i][1] for i, t in enumerate(a.layer_types)}
        self.rotary = {t: RotaryEmbedding(d, a.ropes[t], a.max_position_embeddings, max_positions, dtype, device)
                       for t, d in dims.items()}

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[T, layers, ple_dim]: each layer's token embedding mixed with a projection of the input embedding."""
        a, m = self.args, self.model
        shape = (input_ids.shape[0], a.num_layers, a.ple_dim)
        context = m.per_layer_projection_norm((m.per_layer_model_projection(h) * a.hidden_size**-0.5).view(shape))
        token = scaled(m.embed_tokens_per_layer(input_ids), math.sqrt(a.ple_dim)).view(shape)
        return (context + token) * 2**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend],
    ) -> torch.Tensor:
        """kv_caches / backend as LlamaForCausalLM.forward takes them (a shared-KV layer's are its source's)."""
        assert self.rotary, "init_rotary() was not called"
        tables = {t: r.lookup(positions) for t, r in self.rotary.items()}
        h = scaled(self.model.embed_tokens(input_ids), math.sqrt(self.args.hidden_size))
        ple = self.per_layer_inputs(input_ids, h) if self.args.ple_dim else None
        backends = self.layer_backends(backend, len(kv_caches))
        for i, (layer, (k_cache, v_cache), b) in enumerate(zip(self.model.layers, kv_caches, backends, strict=True)):
            h = layer(h, None if ple is None else ple[:, i], *tables[layer.self_attn.layer_type], k_cache, v_cache, b)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        return soft_cap(self.head_logits(hidden, exact_rows), self.args.final_soft_cap)


class GemmaTextOfMultimodal:
    """Mixed in before a family's CausalLM: its ForConditionalGeneration checkpoint served as the text model alone
    (text_config; the language model's tensors renamed to ours, the other towers' left unread)."""

    TEXT_PREFIXES: dict[str, str] = {"model.language_model.": "model."}  # checkpoint prefix -> ours
    NOT_TEXT: tuple[str, ...] = ()  # prefixes of the tensors a text-only engine does not read

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> GemmaArgs:
        return super().read_args(dict(config.get("text_config") or {}), names)

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(self.NOT_TEXT):
            return None
        for prefix, ours in self.TEXT_PREFIXES.items():
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
                break
        return super().checkpoint_name(name)
