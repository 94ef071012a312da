"""KV cache layer groups: which layers share a page pool, and what each group's attention sees (a model declares
them, engine/core sizes and fills the pages).

Layers whose KV has the same shape and the same reach form one group: full attention (today's), or a sliding
window of W tokens (a query at position i sees keys j with i - W < j <= i, as transformers masks it). Every
group keeps the same page-table format; a window group only holds the pages its window reaches. A multi-head
latent attention group (DeepSeek's MLA) holds per token the compressed latent and the rotary key part, not K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

# Families whose configs carry use_sliding_window, which transformers defaults to False for them.
WINDOW_OFF_BY_DEFAULT = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class LatentKV:
    """What an MLA group's pages hold per token and layer: the compressed latent (`kv_lora_rank` values, which is
    also the value) and the rotary key part (`rope_dim`), one row of `width` values shared by every query head."""

    kv_lora_rank: int
    rope_dim: int

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True, kw_only=True)
class KVGroupSpec:
    """The layers of one group (model layer indices, ascending), their KV shape and their window (None: full).

    scale and soft_cap are the attention extras the group's backend plans with (Gemma's query_pre_attn_scalar and
    attention logit soft-capping): None is 1/sqrt(head_dim) and no capping. readers: (layer, source) pairs of
    layers that hold no pages and attend over a source layer's of this group (Gemma 4's shared KV). latent: an MLA
    group's row (LatentKV), seen by the page table as one KV head of head_dim = latent.width.
    """

    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    window: int | None = None
    scale: float | None = None
    soft_cap: float | None = None
    readers: tuple[tuple[int, int], ...] = ()
    latent: LatentKV | None = None

    @property
    def values_per_token(self) -> int:
        """Values one layer of the group stores per token: K and V of every KV head, or an MLA row."""
        return self.latent.width if self.latent is not None else 2 * self.num_kv_heads * self.head_dim

    def window_pages(self, page_size: int) -> int | None:
        """The most pages a sequence holds in this group between steps (None: unbounded, full attention)."""
        return None if self.window is None else -(-self.window // page_size) + 1

    def first_needed_page(self, num_computed: int, page_size: int) -> int:
        """The first page the next query (at position num_computed) reads; the ones before it are out of reach."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // page_size

    def attention_extras(self) -> dict[str, object]:
        """What the group's attention backend is built with besides its shape: the window, scale and soft-cap."""
        return {"window": self.window, "scale": self.scale, "soft_cap": self.soft_cap}

    @property
    def label(self) -> str:
        kind = "full" if self.window is None else f"window({self.window})"
        kind = kind if self.latent is None else f"mla({self.latent.kv_lora_rank}+{self.latent.rope_dim})"
        shared = f"+{len(self.readers)}shared" if self.readers else ""
        return f"{kind}:{len(self.layers)}x{shared}"


def layer_windows(config: dict, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention) as transformers reads config.json.

    layer_types ("full_attention" / "sliding_attention") when the config has them; else Qwen2's
    use_sliding_window + max_window_layers (layers from max_window_layers on slide); else, when
    sliding_window is set (Mistral), every layer.
    """
    window = config.get("sliding_window")
    default_on = config.get("model_type") not in WINDOW_OFF_BY_DEFAULT
    if not window or not config.get("use_sliding_window", default_on):
        return [None] * num_layers
    window = int(window)
    layer_types = config.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]
    first = config.get("max_window_layers")
    first = 0 if first is None else int(first)
    return [window if i >= first else None for i in range(num_layers)]


def kv_groups(
    windows: list[int | None],
    num_kv_heads: int,
    head_dim: int,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    shapes: list[tuple[int, int]] | None = None,
    shared: dict[int, int] | None = None,
) -> list[KVGroupSpec]:
    """One group per distinct window and KV shape, in order of each group's first layer (a full-attention model:
    one group). shapes: each layer's (num_kv_heads, head_dim) where they differ by layer (Gemma 4); shared:
    layer -> the layer whose pages it reads (it holds none)."""
    shared = shared or {}
    by_key: dict[tuple[int | None, int, int], list[int]] = {}
    for layer, window in enumerate(windows):
        if layer not in shared:
            by_key.setdefault((window, *(shapes[layer] if shapes else (num_kv_heads, head_dim))), []).append(layer)
    groups = []
    for (window, heads, dim), layers in by_key.items():
        readers = tuple((r, s) for r, s in sorted(shared.items()) if s in layers)
        groups.append(
            KVGroupSpec(
                layers=tuple(layers),
                num_kv_heads=heads,
                head_dim=dim,
                window=window,
                scale=scale,
                soft_cap=soft_cap,
                readers=readers,
            )
        )
    return groups


def latent_group(num_layers: int, latent: LatentKV, scale: float) -> KVGroupSpec:
    """The one KV group of an MLA model whose every layer attends over latent pages with softmax scale `scale`."""
    return KVGroupSpec(
        layers=tuple(range(num_layers)), num_kv_heads=1, head_dim=latent.width, scale=scale, latent=latent
    )


def describe_groups(groups: list[KVGroupSpec]) -> str:
    """e.g. "full:22x,window(4096):6x"."""
    return ",".join(g.label for g in groups)


def graphs_blocker(groups: list[KVGroupSpec]) -> str | None:
    """Why decode cannot replay CUDA graphs (they hold one page table, planned without a window); None: it can."""
    if len(groups) > 1:
        return "several KV layer groups"
    if groups[0].latent is not None:
        return "a multi-head latent attention (MLA) group (no MLA backend captures decode graphs yet)"
    if groups[0].scale is not None or groups[0].soft_cap is not None:
        return "an attention scale or soft-cap of the model's own"
    return "a sliding-window KV group" if groups[0].window is not None else None
