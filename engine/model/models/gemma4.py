"""Gemma 4's dense text model (gemma4_text; and a Gemma4ForConditionalGeneration checkpoint's language model alone).

On top of the Gemma 2 / 3 decoder: a head size and KV head count of their own on global layers (own KV groups);
keys reused as values on global layers (attention_k_eq_v); q, k and v norms, attention scale 1; proportional rope
with a partial rotary factor on global layers; the last num_kv_shared_layers layers attend over the pages of the
last earlier layer of their type and hold none (KVGroupSpec.readers); per-layer input embeddings (PLE) added after
each layer's MLP; a learned per-layer scalar; the MoE block beside the MLP (enable_moe_block, gemma4_moe.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import UnsupportedModel
from engine.model.kv_spec import KVGroupSpec, kv_groups
from engine.model.layers.activation import gelu_tanh_and_mul
from engine.model.layers.linear import FusedLinear
from engine.model.layers.moe import Routing
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.layers.rotary import RotaryEmbedding, apply_rotary_
from engine.model.models.base import DecoderLM
from engine.model.models.gemma2 import FULL, GELU_TANH, SLIDING, default_layer_types, soft_cap
from engine.model.models.gemma4_moe import MOE_NORMS, moe_modules, read_routing

DEFAULT_ROPES = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
# Parts of a multimodal checkpoint that a text-only engine does not read.
NOT_TEXT = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


@dataclass
class Gemma4Args:
    """The shape of a Gemma 4 text decoder. num_kv_heads / head_dim are the local layers'; layer_shapes has every
    layer's (num_kv_heads, head_dim)."""

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
    layer_shapes: list[tuple[int, int]]
    ropes: dict[str, dict]
    sliding_window: int | None
    final_soft_cap: float | None
    k_eq_v: bool  # global layers: values are the keys' projection (normed without a weight)
    kv_sources: dict[int, int] = field(default_factory=dict)  # shared-KV layer -> the layer whose pages it reads
    ple_dim: int = 0  # hidden_size_per_layer_input; 0: no per-layer input embeddings
    ple_vocab: int = 0
    double_wide_mlp: bool = False  # shared-KV layers have an MLP twice as wide
    tie_word_embeddings: bool = True
    routing: Routing | None = None  # the MoE block's experts (every layer has it when set)

    @property
    def activation_width(self) -> int:
        """Per token, the widest MLP activations a layer holds (CUDA start-up budgets for them)."""
        moe = self.routing.top_k * (self.routing.intermediate_size + self.hidden_size) if self.routing else 0
        return self.intermediate_size * (2 if self.double_wide_mlp else 1) + moe

    @classmethod
    def from_config(cls, config: dict) -> Gemma4Args:
        act = config.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in GELU_TANH:
            raise UnsupportedModel(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)", param="model")
        if config.get("use_bidirectional_attention") == "all":
            raise UnsupportedModel("use_bidirectional_attention 'all' is not supported (an encoder)", param="model")
        if config.get("attention_bias"):
            raise UnsupportedModel("attention_bias is not supported for Gemma", param="model")
        types = default_layer_types(config, 6)
        types[-1] = FULL  # as transformers forces it
        n, heads = len(types), config["num_attention_heads"]
        kv_heads, head_dim = config.get("num_key_value_heads") or heads, config.get("head_dim") or 256
        return cls(
            hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"], num_layers=n,
            num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 131_072),
            layer_types=types, layer_shapes=_layer_shapes(config, types, kv_heads, head_dim),
            ropes={t: dict(p) for t, p in (config.get("rope_parameters") or DEFAULT_ROPES).items()},
            sliding_window=config.get("sliding_window", 512), final_soft_cap=config.get("final_logit_softcapping"),
            k_eq_v=bool(config.get("attention_k_eq_v")), kv_sources=_kv_sources(types, config),
            ple_dim=config.get("hidden_size_per_layer_input", 256) or 0,
            ple_vocab=config.get("vocab_size_per_layer_input", 262_144),
            double_wide_mlp=bool(config.get("use_double_wide_mlp")),
            tie_word_embeddings=config.get("tie_word_embeddings", True), routing=read_routing(config),
        )

    def windows(self) -> list[int | None]:
        return [self.sliding_window if t == SLIDING else None for t in self.layer_types]


def _layer_shapes(config: dict, types: list[str], kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """Each layer's (num_kv_heads, head_dim): config.json's per_layer_config when saved, else transformers' rule
    (global layers: global_head_dim, and num_global_key_value_heads with attention_k_eq_v)."""
    per_layer = config.get("per_layer_config")
    if per_layer is None:
        full = {"head_dim": config.get("global_head_dim", 512)}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = config["num_global_key_value_heads"]
        per_layer = {i: full for i, t in enumerate(types) if t == FULL}
    per_layer = {int(i): v for i, v in per_layer.items()}
    return [(per_layer.get(i, {}).get("num_key_value_heads", kv_heads), per_layer.get(i, {}).get("head_dim", head_dim))
            for i in range(len(types))]


def _kv_sources(types: list[str], config: dict) -> dict[int, int]:
    """Shared-KV layer -> the last layer of its type before the shared ones (transformers' kv_sharing_modes)."""
    first_shared = len(types) - int(config.get("num_kv_shared_layers") or 0)
    if first_shared == len(types):
        return {}
    last = {t: i for i, t in enumerate(types[:first_shared])}
    if first_shared <= 0 or set(last) != set(types):
        raise UnsupportedModel("num_kv_shared_layers leaves a layer type with no layer to share KV from", param="model")
    return {i: last[types[i]] for i in range(first_shared, len(types))}


class Gemma4Attention(nn.Module):
    def __init__(self, a: Gemma4Args, layer: int) -> None:
        super().__init__()
        self.layer_type = a.layer_types[layer]
        self.num_kv, self.head_dim = a.layer_shapes[layer]
        self.num_q, d, eps = a.num_q_heads, self.head_dim, a.rms_norm_eps
        self.shared = layer in a.kv_sources
        self.k_eq_v = a.k_eq_v and self.layer_type == FULL
        shards = {"q_proj": self.num_q * d}
        if not self.shared:
            shards["k_proj"] = self.num_kv * d
            if not self.k_eq_v:
                shards["v_proj"] = self.num_kv * d
        self.qkv_proj = FusedLinear(a.hidden_size, shards, False)
        self.o_proj = nn.Linear(self.num_q * d, a.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(d, eps, unit_offset=False)
        self.k_norm = None if self.shared else GemmaRMSNorm(d, eps, unit_offset=False)
        self.v_norm = GemmaRMSNorm(d, eps, scaled=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        t, hq, hk, d = x.shape[0], self.num_q, self.num_kv, self.head_dim
        qkv = self.qkv_proj(x)
        q = apply_rotary_(self.q_norm(qkv[:, : hq * d].view(t, hq, d)), cos, sin)
        if not self.shared:  # a shared layer reads the pages its source layer wrote this step
            k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
            v = k if self.k_eq_v else qkv[:, (hq + hk) * d :].view(t, hk, d)
            backend.write_kv(apply_rotary_(self.k_norm(k), cos, sin), self.v_norm(v), k_cache, v_cache)
        return self.o_proj(backend.run(q, k_cache, v_cache).reshape(t, hq * d))


class Gemma4MLP(nn.Module):
    def __init__(self, hidden: int, n: int) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, {"gate_proj": n, "up_proj": n}, False)
        self.down_proj = nn.Linear(n, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, a: Gemma4Args, layer: int) -> None:
        super().__init__()
        h, eps = a.hidden_size, a.rms_norm_eps
        self.self_attn = Gemma4Attention(a, layer)
        wide = 2 if a.double_wide_mlp and layer in a.kv_sources else 1
        self.mlp = Gemma4MLP(h, a.intermediate_size * wide)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", *(MOE_NORMS if a.routing else ())):
            setattr(self, name, GemmaRMSNorm(h, eps, unit_offset=False))
        self.layer_scalar = nn.Parameter(torch.ones(1))
        if a.ple_dim:
            self.per_layer_input_gate = nn.Linear(h, a.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(a.ple_dim, h, bias=False)
            self.post_per_layer_input_norm = GemmaRMSNorm(h, eps, unit_offset=False)
        self.router, self.experts = moe_modules(h, a.routing, eps)

    def forward(self, h: torch.Tensor, ple: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache,
                                                             backend))
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.experts is not None:  # the router and the experts read h itself, not the dense MLP's input
            moe = self.experts(self.pre_feedforward_layernorm_2(h), *self.router(h))
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(out)
        if ple is not None:
            gate = torch.nn.functional.gelu(self.per_layer_input_gate(h), approximate="tanh") * ple
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, a: Gemma4Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(Gemma4DecoderLayer(a, i) for i in range(a.num_layers))
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, unit_offset=False)
        if a.ple_dim:
            width = a.num_layers * a.ple_dim
            self.embed_tokens_per_layer = nn.Embedding(a.ple_vocab, width, _weight=torch.empty(a.ple_vocab, width))
            self.per_layer_model_projection = nn.Linear(a.hidden_size, width, bias=False)
            self.per_layer_projection_norm = GemmaRMSNorm(a.ple_dim, a.rms_norm_eps, unit_offset=False)


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x times `scale` rounded to x's dtype first, as transformers' scaled embeddings do."""
    return x * torch.tensor(scale, dtype=x.dtype)


class Gemma4ForCausalLM(DecoderLM):
    """The CausalLM of Gemma 4 text (dense, or with the MoE block)."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> Gemma4Args:
        return Gemma4Args.from_config(config)

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        a = self.args
        return kv_groups(a.windows(), a.num_kv_heads, a.head_dim, scale=1.0, shapes=a.layer_shapes,
                         shared=a.kv_sources)

    def checkpoint_name(self, name: str) -> str | None:
        """A shared-KV layer's k/v projections and norms, which some checkpoints carry, are not read."""
        parts = name.split(".")
        if (len(parts) > 4 and parts[:2] == ["model", "layers"] and int(parts[2]) in self.args.kv_sources
                and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")):
            return None
        return name

    def __init__(self, args: Gemma4Args) -> None:
        super().__init__(args, Gemma4Model(args))
        self.rotary: dict[str, RotaryEmbedding] = {}

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
        token = _scaled(m.embed_tokens_per_layer(input_ids), math.sqrt(a.ple_dim)).view(shape)
        return (context + token) * 2**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend],
    ) -> torch.Tensor:
        """kv_caches / backend: each layer's (a shared-KV layer's are its source layer's)."""
        assert self.rotary, "init_rotary() was not called"
        tables = {t: r.lookup(positions) for t, r in self.rotary.items()}
        h = _scaled(self.model.embed_tokens(input_ids), math.sqrt(self.args.hidden_size))
        ple = self.per_layer_inputs(input_ids, h) if self.args.ple_dim else None
        backends = self.layer_backends(backend, len(kv_caches))
        for i, (layer, (k_cache, v_cache), b) in enumerate(zip(self.model.layers, kv_caches, backends, strict=True)):
            h = layer(h, None if ple is None else ple[:, i], *tables[layer.self_attn.layer_type], k_cache, v_cache, b)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        return soft_cap(self.head_logits(hidden, exact_rows), self.args.final_soft_cap)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """A Gemma 4 multimodal checkpoint served as its text model: vision and audio towers are not read."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> Gemma4Args:
        return Gemma4Args.from_config(dict(config.get("text_config") or {}))

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(NOT_TEXT):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        return super().checkpoint_name(name)
