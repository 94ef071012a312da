"""What the Mamba2 / attention hybrids with one mixer a layer share (Granite 4.0-H, Nemotron-H): each layer's kind,
and from it the attention layers' KV group and the Mamba2 layers' recurrent-state spec, both in the engine's cache
numbering (only the layers that hold a cache, attention pages or a state slot, are counted)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from engine.model.layers.recurrent_step import RecurrentSpec
from engine.model.models.base import DecoderLM
from engine.model.models.moe_base import MoeArgs

CACHED = ("linear_attention", "full_attention")


@dataclass(kw_only=True)
class Mamba2HybridArgs(MoeArgs):
    """A MoE decoder's args (routing None: no experts), each layer's kind (transformers 5's names: linear_attention
    is Mamba2) and the Mamba2 shape (None: no Mamba2 layer)."""

    layer_types: tuple[str, ...] = ()
    mamba: Mamba2Shape | None = None

    @property
    def activation_width(self) -> int:
        return self.intermediate_size if self.routing is None else super().activation_width

    def cache_index(self, kind: str) -> tuple[int, ...]:
        """The engine's indices (among the layers that hold a cache) of the layers of `kind`."""
        cached = [t for t in self.layer_types if t in CACHED]
        return tuple(i for i, t in enumerate(cached) if t == kind)


class Mamba2HybridLM(DecoderLM):
    """A DecoderLM over Mamba2HybridArgs: its attention layers' one KV group and its Mamba2 layers' state slots."""

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        a = cast(Mamba2HybridArgs, self.args)
        full = a.cache_index("full_attention")
        spec = KVGroupSpec(layers=full, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, scale=a.attention_multiplier)
        return [spec] if full else []

    def recurrent_spec(self) -> RecurrentSpec | None:
        layers = cast(Mamba2HybridArgs, self.args).cache_index("linear_attention")
        if not layers:
            return None
        # A shard's mixers hold its groups' heads only: the slots are sized from a mixer, not from the config.
        mixer = next(m for m in self.model.modules() if isinstance(m, Mamba2Mixer))
        conv, state = mixer.shape.state_shapes()
        return RecurrentSpec(layers, conv, state, kind="mamba2")
