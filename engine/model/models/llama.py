"""One Llama-family decoder: Llama (incl. tied embeddings, SmolLM), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Runs on the flattened tokens of a step; attention goes through the backend over the paged KV cache.
On CUDA in half precision, RMSNorm, RoPE and SiLU-and-mul run FlashInfer's kernels (decided once, in
init_rotary()); elsewhere the torch path of engine.layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.cuda import kernels
from engine.errors import UnsupportedModel
from engine.model.kv_spec import KVGroupSpec, kv_groups, layer_windows
from engine.model.layers.activation import silu_and_mul
from engine.model.layers.linear import FusedLinear
from engine.model.layers.norm import RMSNorm
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.rotary import RotaryEmbedding, apply_rotary_, pairs_as_halves, rope_parameters
from engine.model.models.base import DecoderLM, DecoderShape
from engine.model.sharding import ShardPlan, shard_attention, shard_gated_mlp, shard_vocab


@dataclass(kw_only=True)
class LlamaArgs(DecoderShape):
    """The shape of a Llama-style decoder and its options, read from a transformers config by the loader."""

    rope: dict = field(default_factory=dict)  # transformers' rope_parameters (rope_theta, rope_type, ...)
    partial_rotary: bool = False  # GLM-4.5: rotary on the first partial_rotary_factor of each head (rotary.py)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    no_rope_layers: tuple[int, ...] = ()  # SmolLM3, EXAONE 4: the layers whose q and k take no rotary
    rope_interleaved: bool = False  # ERNIE 4.5: the rotary pairs are (x0, x1), (x2, x3), ... (GPT-J style)
    # Ministral 3 (llama_4_scaling_beta, original_max_position_embeddings): queries scaled by
    # 1 + beta * log(1 + floor(position / original_max)) past the original context
    query_scaling: tuple[float, int] | None = None
    # Granite's scalars: the token embeddings scaled by embedding_multiplier, each block's output by
    # residual_multiplier before it joins the residual stream, the scores by attention_multiplier (None:
    # 1/sqrt(head_dim)), the logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    sinks: bool = False  # gpt-oss: a learned sink logit per q head
    head_bias: bool = False  # Phi-3.5-MoE: the lm_head has a bias
    tie_word_embeddings: bool = False
    vision: Any = None  # an image-text checkpoint's QwenVision (engine/model/vision/qwen_vl_model.py)

    @classmethod
    def from_config(cls, config: dict, names: set[str], **extra) -> LlamaArgs:
        """The fields every Llama-style config has (KeyError on a missing one); `extra` sets the rest."""
        return cls(
            **DecoderShape.read(config, max_positions=2048),
            rope=rope_parameters(config),
            # Biases are read off the checkpoint: Qwen2 always has qkv bias, Llama only with attention_bias.
            qkv_bias=any(n.endswith("self_attn.q_proj.bias") for n in names),
            o_bias=any(n.endswith("self_attn.o_proj.bias") for n in names),
            mlp_bias=any(n.endswith("mlp.gate_proj.bias") for n in names),
            head_bias="lm_head.bias" in names,
            **extra,
        )


def read_no_rope_layers(config: dict) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: no_rope_layers[i] is 0 for them (transformers' default when the list is
    absent: every no_rope_layer_interval-th layer)."""
    if config.get("model_type") != "smollm3":
        return ()
    num_layers, interval = config["num_hidden_layers"], config.get("no_rope_layer_interval") or 4
    uses_rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    return tuple(i for i, rope in enumerate(uses_rope[:num_layers]) if not rope)


def read_query_scaling(config: dict) -> tuple[float, int] | None:
    """Ministral 3's (beta, original context) from its rope parameters' llama_4_scaling_beta; None without it."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    beta = rope.get("llama_4_scaling_beta")
    if not beta:
        return None
    return float(beta), int(rope.get("original_max_position_embeddings") or config["max_position_embeddings"])


class LlamaAttention(nn.Module):
    """q|k|v in one projection, optional norms on q and k, rotary, paged attention, o_proj. `input_size`: the width
    it reads, where that is not hidden_size (an EAGLE-3 head's layer reads two hidden states side by side)."""

    def __init__(self, a: LlamaArgs, input_size: int | None = None, *, rotates: bool = True) -> None:
        super().__init__()
        self.num_q, self.num_kv, self.head_dim = a.num_q_heads, a.num_kv_heads, a.head_dim
        self.rotates = rotates  # false: a no-position layer (SmolLM3's every fourth, EXAONE 4's global ones)
        self.interleaved = a.rope_interleaved
        self.query_scaling = a.query_scaling
        q_size, kv_size = a.num_q_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = FusedLinear(
            input_size or a.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, a.qkv_bias
        )
        self.o_proj = nn.Linear(q_size, a.hidden_size, bias=a.o_bias)
        self.q_norm, self.k_norm = self.qk_norms(a)
        # Set by init_rotary() on the fused path: RoPE by FlashInfer from this float32 cos|sin table.
        self.cos_sin_cache: torch.Tensor | None = None
        # An FP8 KV cache holds K / k_scale and V / v_scale (the checkpoint's, set by the loader, or 1.0).
        self.k_scale, self.v_scale = 1.0, 1.0
        self.sinks = nn.Parameter(torch.empty(a.num_q_heads)) if a.sinks else None

    def qk_norms(self, a: LlamaArgs) -> tuple[nn.Module | None, nn.Module | None]:
        """The norms on q and k: Qwen3's RMSNorm over each head where the config has them, else none."""
        if not a.qk_norm:
            return None, None
        return RMSNorm(a.head_dim, a.rms_norm_eps), RMSNorm(a.head_dim, a.rms_norm_eps)

    def normalize(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k [T, heads, head_dim] through their norms before rotary (Qwen3's: each head on its own)."""
        assert self.q_norm is not None and self.k_norm is not None
        return self.q_norm(q), self.k_norm(k), v

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
        qkv = self.qkv_proj(x)
        q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
        v = qkv[:, (hq + hk) * d :].view(t, hk, d)
        if self.q_norm is not None:
            q, k, v = self.normalize(q, k, v)
        if self.rotates and self.interleaved:
            q, k = pairs_as_halves(q), pairs_as_halves(k)
        if not self.rotates:
            pass
        elif self.cos_sin_cache is not None:
            kernels.apply_rope_with_cos_sin_cache_inplace(positions, q, k, d, self.cos_sin_cache)
        elif self.q_norm is None and not self.interleaved:  # q and k side by side in each row: one rotation for both
            qk = apply_rotary_(qkv[:, : (hq + hk) * d].view(t, hq + hk, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
        else:
            q, k = apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin)
        if self.query_scaling is not None:
            beta, original = self.query_scaling
            scale = 1 + beta * torch.log1p(torch.div(positions, original, rounding_mode="floor").float())
            q = q * scale.to(q.dtype)[:, None, None]
        return self.attend(q, k, v, k_cache, v_cache, backend)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Writes k, v to the pages (under the FP8 KV scales), attends (with the sinks, if any) and projects out."""
        backend.write_kv(k, v, k_cache, v_cache, k_scale=self.k_scale, v_scale=self.v_scale)
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        out = backend.run(q, k_cache, v_cache, k_scale=self.k_scale, v_scale=self.v_scale, **extra)
        return self.o_proj(out.reshape(q.shape[0], self.num_q * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        n = a.intermediate_size
        self.gate_up_proj = FusedLinear(a.hidden_size, {"gate_proj": n, "up_proj": n}, a.mlp_bias)
        self.down_proj = nn.Linear(n, a.hidden_size, bias=a.mlp_bias)
        self.fused = False  # set by init_rotary(): FlashInfer's silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(kernels.silu_and_mul(gate_up) if self.fused else silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP with a running residual; the attention and the MLP are the family's."""

    def __init__(self, a: LlamaArgs, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.tp: TensorParallel | None = None  # tensor-parallel: attention and MLP give partial sums to all-reduce
        self.residual_multiplier = a.residual_multiplier

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
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.block_output(self.self_attn(h, positions, cos, sin, k_cache, v_cache, backend))
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.block_output(self.mlp(h)), residual

    def block_output(self, h: torch.Tensor) -> torch.Tensor:
        """An attention or MLP block's output as it joins the stream: all-reduced (tensor-parallel), scaled."""
        if self.tp is not None:
            h = self.tp.all_reduce(h)
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArgs, layers: list[nn.Module]) -> None:
        super().__init__()
        # Given an empty weight, nn.Embedding skips its random init: that init, even on the meta device,
        # imports torch._dynamo (half a second of every cold start) and the loader overwrites it anyway.
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaForCausalLM(DecoderLM):
    """The CausalLM of api.md. The caller plans the backend for `meta` before forward()."""

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> LlamaArgs:
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config['hidden_act']!r} is not supported", param="model")
        qk_norm = (config.get("architectures") or [""])[0] in ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification")
        return LlamaArgs.from_config(
            config,
            names,
            qk_norm=qk_norm,
            no_rope_layers=read_no_rope_layers(config),
            rope_interleaved=config.get("model_type") in ("ernie4_5", "ernie4_5_moe"),
            query_scaling=read_query_scaling(config),
        )

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        a = self.args
        return kv_groups(layer_windows(config, a.num_layers), a.num_kv_heads, a.head_dim, scale=a.attention_multiplier)

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head_logits(hidden, exact_rows)
        return logits if self.args.logits_scaling == 1.0 else logits / self.args.logits_scaling

    def __init__(self, args: LlamaArgs, head_vocab: int | None = None) -> None:
        layers = [self.make_layer(args, i) for i in range(args.num_layers)]
        super().__init__(args, LlamaModel(args, layers), head_vocab, head_bias=args.head_bias)
        self.rotary: RotaryEmbedding | None = None
        # Set by an EAGLE-3 proposer: the layers whose input each forward keeps, side by side, in aux_hidden.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    # The layer builders a family overrides where its layers differ; they run before the module is set up, so they
    # build from `args` alone.
    @classmethod
    def make_layer(cls, args: LlamaArgs, index: int) -> nn.Module:
        return LlamaDecoderLayer(args, cls.make_attention(args, index), cls.make_mlp(args, index))

    @classmethod
    def make_attention(cls, args: LlamaArgs, index: int) -> nn.Module:
        return LlamaAttention(args, rotates=index not in args.no_rope_layers)

    @classmethod
    def make_mlp(cls, args: LlamaArgs, index: int) -> nn.Module:
        return LlamaMLP(args)

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """Shrinks this model (on the meta device) to rank tp.rank's heads, columns and vocabulary rows
        (engine/model/sharding.py); returns what the loader reads for it."""
        plan = ShardPlan()
        for i, layer in enumerate(self.model.layers):
            shard_attention(layer.self_attn, f"model.layers.{i}.self_attn", tp, plan)
            self.shard_mlp(layer, f"model.layers.{i}.mlp", tp, plan)
            layer.tp = tp
        shard_vocab(self, tp, plan)
        return plan

    def shard_mlp(self, layer: nn.Module, prefix: str, tp: TensorParallel, plan: ShardPlan) -> None:
        shard_gated_mlp(layer.mlp, prefix, tp, plan)

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """Builds the rotary tables once the weights live on their device, and chooses the kernels for good:
        fused (FlashInfer) when `fused`, or when None, on CUDA in fp16/bf16 with flashinfer importable."""
        if fused is None:
            fused = kernels.use_fused_kernels(torch.device(device), dtype)
        self.rotary = self.make_rotary(max_positions, dtype, device, fused)
        self.fused_kernels = fused
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.fused = fused
            elif isinstance(module, LlamaAttention):
                module.cos_sin_cache = self.rotary.cos_sin_cache

    def make_rotary(self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool) -> RotaryEmbedding:
        """The rotary tables; fused: FlashInfer's cos|sin table in place of torch's cos and sin."""
        a = self.args
        return RotaryEmbedding(
            head_dim=a.head_dim,
            rope=a.rope,
            max_position_embeddings=a.max_position_embeddings,
            max_positions=max_positions,
            dtype=dtype,
            device=device,
            fused=fused,
            partial=a.partial_rotary,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend],
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """kv_caches: each layer's K/V pages; backend: one for every layer, or each layer's (its KV group's,
        planned for the step with that group's page table and window). image_embeds: (rows, values) of an image's
        tokens (Qwen3-VL): the first hidden_size columns replace the rows' embeddings, each further hidden_size
        (the deepstack features) is added to the rows after one of the first layers."""
        rotaries = self.layer_rotaries(positions)
        h = self.model.embed_tokens(input_ids)
        if self.args.embedding_multiplier != 1.0:
            h = h * self.args.embedding_multiplier
        rows, deepstack = None, ()
        if image_embeds is not None:
            rows, values = image_embeds
            h = h.index_copy(0, rows, values[:, : h.shape[1]].to(h.dtype))
            if values.shape[1] > h.shape[1]:
                deepstack = values[:, h.shape[1] :].to(h.dtype).split(h.shape[1], dim=1)
        residual = None
        backends = self.layer_backends(backend, len(kv_caches))
        captured: dict[int, torch.Tensor] = {}
        for i, (layer, (k_cache, v_cache), b) in enumerate(zip(self.model.layers, kv_caches, backends, strict=True)):
            if i in self.aux_layers:  # an EAGLE-3 head reads the residual stream entering these layers
                captured[i] = h if residual is None else h + residual
            h, residual = layer(h, residual, positions, *rotaries[i], k_cache, v_cache, b)
            if i < len(deepstack):  # the layer's output is h + residual: adding to h adds to it
                h = h.index_add(0, rows, deepstack[i])
        if captured:  # side by side in the head's order, which need not be the layers' order
            self.aux_hidden = torch.cat([captured[i] for i in self.aux_layers], dim=-1)
        h, _ = self.model.norm.add_forward(h, residual)
        return h

    def layer_rotaries(self, positions: torch.Tensor) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Each layer's (cos, sin) at `positions`; (None, None) where FlashInfer's RoPE reads the attention's own
        cos|sin table. One table serves every layer here (a family with a rope per layer type overrides this)."""
        assert self.rotary is not None, "init_rotary() was not called"
        # A multimodal rotary keeps torch tables even where the other kernels are fused (FlashInfer's RoPE takes
        # 1-D positions only).
        cos_sin = (None, None) if self.rotary.cos is None else self.rotary.lookup(positions)
        return [cos_sin] * len(self.model.layers)
