"""KV bytes per token of real Gemma shapes, as the engine's KV groups hold them, against a cache that keeps every
layer whole: one sequence of 32k tokens in bfloat16, pages of 16. The figures are in bench/RESULTS.md.

Gemma 3 27B (62 layers, 16 KV heads of 128, window 1024, five local layers to one global) and transformers'
Gemma4TextConfig default shape (30 layers, 4 KV heads of 256 locally and of 512 on the 5 global layers,
window 512), the latter also with its last 10 layers sharing KV.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.kv.sizing import page_bytes
from engine.model.models import model_class

CONTEXT, PAGE, BF16 = 32768, 16, 2
GEMMA3_27B = {
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "query_pre_attn_scalar": 168,
    "sliding_window": 1024,
    "vocab_size": 262208,
}
GEMMA4_DEFAULT = {
    "architectures": ["Gemma4ForCausalLM"],
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 512,
    "vocab_size": 262144,
}


def bytes_per_token(config: dict) -> tuple[float, int]:
    """(held by the engine's groups, held by a cache keeping every layer whole), bytes per token of context."""
    cls = model_class(config["architectures"][0])
    with torch.device("meta"):
        model = cls(cls.read_args(config, set()))
    groups = model.kv_groups(config)
    held = 0.0
    for g, size in zip(groups, page_bytes(groups, PAGE, torch.bfloat16), strict=True):
        pages = -(-CONTEXT // PAGE) if g.window is None else min(g.window_pages(PAGE), -(-CONTEXT // PAGE))
        held += pages * size / CONTEXT
    by_layer = {layer: g for g in groups for layer in g.layers}
    by_layer.update({r: g for g in groups for r, _ in g.readers})  # whole: a shared layer keeps its own KV
    whole = sum(2 * g.num_kv_heads * g.head_dim * BF16 for g in by_layer.values())
    assert len(by_layer) == model.args.num_layers
    return held, whole


@pytest.mark.parametrize(
    ("name", "config", "expected_held", "expected_whole"),
    [
        ("gemma3-27b", GEMMA3_27B, 81920 + 52 * 8192 * 1040 / CONTEXT, 62 * 8192),
        ("gemma4-default", GEMMA4_DEFAULT, 5 * 8192 + 25 * 4096 * 528 / CONTEXT, 25 * 4096 + 5 * 8192),
        (
            "gemma4-default-10-shared",
            {**GEMMA4_DEFAULT, "num_kv_shared_layers": 10},
            3 * 8192 + 17 * 4096 * 528 / CONTEXT,
            25 * 4096 + 5 * 8192,
        ),  # layers 20-29 (two global) hold none
    ],
)
def test_kv_bytes_per_token_against_every_layer_whole(name, config, expected_held, expected_whole):
    held, whole = bytes_per_token(config)
    print(
        f"{name}: {held:,.0f} B/token held by the KV groups vs {whole:,} whole ({held / whole:.1%}) at {CONTEXT} tokens"
    )
    assert held == pytest.approx(expected_held) and whole == expected_whole
