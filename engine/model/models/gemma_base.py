"""The one Gemma decoder that Gemma 2, 3 and 4 configure (gemma2.py, gemma3.py, gemma4.py read their configs into
GemmaArgs): GeGLU, RMSNorms in float32 before and after attention and the MLP, embeddings scaled by sqrt(hidden),
sliding-window layers by `layer_types`, a rope per layer type, a final logit soft-cap, and the attention extras
(scale, soft-cap) carried by the KV groups to their backends. Its arguments are in gemma_args.py, its layers
in gemma_layers.py.

Runs in torch on every device (norms, rope and GeGLU); attention goes through the backend over the paged KV cache.
"""

from __future__ import annotations

import math

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.model.checkpoint import Source
from engine.model.kv_spec import KVGroupSpec, kv_groups
from engine.model.layers.parallel import TensorParallel, VocabParallelEmbedding
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.models.base import DecoderLM
from engine.model.models.gemma_args import GemmaArgs
from engine.model.models.gemma_layers import GemmaModel, scaled
from engine.model.sharding import ShardPlan, shard_attention, shard_expert_stack, shard_gated_mlp, shard_vocab


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
        return kv_groups(
            a.windows(),
            a.num_kv_heads,
            a.head_dim,
            scale=a.attn_scale,
            soft_cap=a.attn_soft_cap,
            shapes=a.layer_shapes,
            shared=a.kv_sources,
        )

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """This rank's heads, MLP columns and vocabulary rows (engine/model/sharding.py), as a Llama's: the extras
        (soft-caps, windows, q / k / v norms, the final cap on the gathered logits) act per head or per logit.
        Gemma 4: each layer type's own heads, its MoE block's expert columns, and the per-layer input embeddings'
        vocabulary rows; their projections and the router, small, are every rank's."""
        plan = ShardPlan()
        for i, layer in enumerate(self.model.layers):
            shard_attention(layer.self_attn, f"model.layers.{i}.self_attn", tp, plan)
            shard_gated_mlp(layer.mlp, f"model.layers.{i}.mlp", tp, plan)
            if layer.experts is not None:
                layer.experts = shard_expert_stack(layer.experts, f"model.layers.{i}.experts", tp, plan)
            layer.tp = tp
        if self.args.ple_dim:
            table = self.model.embed_tokens_per_layer
            start, n = tp.span(table.num_embeddings)
            self.model.embed_tokens_per_layer = VocabParallelEmbedding(n, table.embedding_dim, start, tp)
            plan.sources["model.embed_tokens_per_layer.weight"] = Source(0, ((start, n),))
        shard_vocab(self, tp, plan)
        return plan

    def checkpoint_name(self, name: str) -> str | None:
        """A shared-KV layer's k/v projections and norms, which some checkpoints carry, are not read."""
        parts = name.split(".")
        if (
            self.args.kv_sources
            and len(parts) > 4
            and parts[:2] == ["model", "layers"]
            and int(parts[2]) in self.args.kv_sources
            and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")
        ):
            return None
        return name

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """One rotary table per layer type, at that type's head size."""
        a = self.args
        dims = {t: a.layer_shapes[i][1] for i, t in enumerate(a.layer_types)}
        self.rotary = {
            t: RotaryEmbedding(
                head_dim=d,
                rope=a.ropes[t],
                max_position_embeddings=a.max_position_embeddings,
                max_positions=max_positions,
                dtype=dtype,
                device=device,
            )
            for t, d in dims.items()
        }

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
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """kv_caches / backend as LlamaForCausalLM.forward takes them (a shared-KV layer's are its source's).
        image_embeds: (rows, embeddings) that replace those rows' scaled token embeddings (an image's soft tokens)."""
        assert self.rotary, "init_rotary() was not called"
        tables = {t: r.lookup(positions) for t, r in self.rotary.items()}
        h = scaled(self.model.embed_tokens(input_ids), math.sqrt(self.args.hidden_size))
        if image_embeds is not None:
            rows, values = image_embeds
            h = h.index_copy(0, rows, values.to(h.dtype))
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
