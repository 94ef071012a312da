"""Sliding-window models against transformers: a tiny Qwen2 with use_sliding_window (layer 0 full attention,
layers 1-2 a window of 8 tokens: two KV layer groups) and a tiny Mistral with sliding_window=12 (one window
group), float32, prompts longer than the window. transformers masks keys j <= i - W for these configs (checked
below against the same weights without a window), so the reference really uses the window.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.model.kv_spec import KVGroupSpec
from tests.engine.conftest import WINDOW
from tests.engine.model.family_parity import (
    check_prefill_and_decode,
    greedy,
    hf_greedy,
    load_family,
    mixed_prompts,
    reference_logits,
    tiny_engine,
)

GROUPS = {
    "qwen2_window": [
        KVGroupSpec(layers=(0,), num_kv_heads=2, head_dim=16, window=None),
        KVGroupSpec(layers=(1, 2), num_kv_heads=2, head_dim=16, window=WINDOW),
    ],
    "mistral_window": [KVGroupSpec(layers=(0, 1), num_kv_heads=2, head_dim=16, window=12)],
}


@pytest.fixture(scope="module", params=list(GROUPS))
def windowed(request, tmp_path_factory, tiny_checkpoint, baked_model_path):
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_checkpoint(request.param, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(kind=request.param, hf=hf, model=model, spec=spec, path=path)


def test_groups_are_read_from_the_config(windowed):
    assert windowed.spec.kv_groups == GROUPS[windowed.kind]
    assert windowed.spec.max_position_embeddings == windowed.hf.config.max_position_embeddings  # not capped


def test_the_reference_uses_its_window(windowed):
    import transformers as tf

    config = windowed.hf.config.to_dict()
    config.update(sliding_window=None, layer_types=None, use_sliding_window=False)
    config.pop("architectures", None)
    plain = tf.AutoModelForCausalLM.from_config(type(windowed.hf.config)(**config), attn_implementation="eager")
    plain.load_state_dict(windowed.hf.state_dict())
    tokens = list(range(3, 33))
    diff = (reference_logits(plain.float().eval(), tokens) - reference_logits(windowed.hf, tokens)).abs()
    window = max(g.window for g in windowed.spec.kv_groups if g.window)
    assert diff[:window].max() < 1e-5 and diff[window:].max(-1).values.min() > 1e-3


def test_prefill_lengths_and_decode_past_the_window(windowed):
    check_prefill_and_decode(windowed.model, windowed.spec, windowed.hf, decode_steps=14)  # 5 crosses the window


def test_engine_greedy_equals_transformers_batched_and_solo(windowed):
    """Through the engine: paged window groups with NULL pages, chunked prefill (16-token budget), prefix hits."""
    prompts = mixed_prompts()
    engine = tiny_engine(windowed.path)
    assert engine.describe()["kv_groups"] == ",".join(g.label for g in GROUPS[windowed.kind])
    batched = greedy(engine, prompts, 12)
    fed = engine.runner.num_tokens_run
    again = greedy(engine, prompts, 12)  # the prompts' pages are now in the prefix cache
    assert again == batched
    # Every prompt's whole pages came back from the cache (all but the last token), in the window group too:
    # there only the pages inside the window of the hit's end, NULL before them.
    hits = sum((len(p) - 1) // 4 * 4 for p in prompts.values())
    assert engine.runner.num_tokens_run - fed == sum(len(p) for p in prompts.values()) - hits + 11 * len(prompts)
    for r, prompt in prompts.items():
        assert batched[r] == hf_greedy(windowed.hf, prompt, 12), r
        assert greedy(tiny_engine(windowed.path), {r: prompt}, 12) == {r: batched[r]}
