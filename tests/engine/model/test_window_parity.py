"""Sliding-window models against transformers: a tiny Qwen2 with use_sliding_window (layer 0 full attention,
layers 1-2 a window of 8 tokens: two KV layer groups) and a tiny Mistral with sliding_window=12 (one window
group), float32, prompts longer than the window. transformers masks keys j <= i - W for these configs (checked
below against the same weights without a window), so the reference really uses the window.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from engine.attention.torch_ref import TorchRefBackend
from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.kv_spec import KVGroupSpec
from engine.model.loader import load_model
from engine.sample.params import SamplingParams
from tests.engine.conftest import TOKENIZER_FILES, WINDOW

ATOL = 1e-4
GROUPS = {
    "qwen2_window": [KVGroupSpec((0,), 2, 16, None), KVGroupSpec((1, 2), 2, 16, WINDOW)],
    "mistral_window": [KVGroupSpec((0, 1), 2, 16, 12)],
}


@pytest.fixture(scope="module", params=list(GROUPS))
def windowed(request, tmp_path_factory, tiny_checkpoint, baked_model_path):
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_checkpoint(request.param, path)
    for name in TOKENIZER_FILES:  # the engine needs a tokenizer; the ids stay below the tiny vocabulary
        if (baked_model_path / name).exists() and name != "generation_config.json":
            shutil.copy(baked_model_path / name, path / name)
    model, spec = load_model(str(path), torch.float32, torch.device("cpu"))
    return SimpleNamespace(kind=request.param, hf=hf, model=model, spec=spec, path=path)


def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def backends(spec) -> list[TorchRefBackend]:
    """Each layer's backend: its group's window."""
    by_layer = {layer: g.window for g in spec.kv_groups for layer in g.layers}
    return [TorchRefBackend("cpu", window=by_layer[n]) for n in range(spec.num_layers)]


def run_step(model, spec, harness, batch) -> torch.Tensor:
    input_ids, positions, meta = harness.step(batch)
    layer_backends = backends(spec)
    for b in layer_backends:
        b.plan(meta)
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, meta, harness.kv_caches, layer_backends))


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


def test_prefill_lengths_and_decode_past_the_window(windowed, paged_harness):
    gen = torch.Generator().manual_seed(1)
    prompts = {r: torch.randint(0, 128, (n,), generator=gen).tolist() for r, n in (("a", 5), ("b", 13), ("c", 30))}
    s = windowed.spec
    harness = paged_harness(num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, num_pages=128)
    logits = run_step(windowed.model, s, harness, list(prompts.items()))
    row = 0
    for tokens in prompts.values():
        torch.testing.assert_close(logits[row : row + len(tokens)], reference_logits(windowed.hf, tokens),
                                   atol=ATOL, rtol=1e-4)
        row += len(tokens)
    seqs = {r: list(t) for r, t in prompts.items()}
    for _ in range(14):  # "a" crosses the window, every request crosses pages
        nxt = {r: int(torch.randint(0, 128, (1,), generator=gen)) for r in seqs}
        logits = run_step(windowed.model, s, harness, [(r, [t]) for r, t in nxt.items()])
        for i, (r, t) in enumerate(nxt.items()):
            seqs[r].append(t)
            torch.testing.assert_close(logits[i], reference_logits(windowed.hf, seqs[r])[-1], atol=ATOL, rtol=1e-4)


def _engine(path, **kw) -> LLMEngine:
    kw = {"dtype": "float32", "page_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 16, **kw}
    return LLMEngine(EngineConfig(model_path=str(path), **kw))


def _generate(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for r, prompt in prompts.items():
        engine.add_request(r, prompt, params)
    out: dict[str, list[int]] = {r: [] for r in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.outputs[0].token_ids
        engine.kv.check()
    assert engine.kv.num_free == [a.num_pages for a in engine.kv.allocators], "pages leaked"
    return out


def _hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(reference_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_engine_greedy_equals_transformers_batched_and_solo(windowed):
    """Through the engine: paged window groups with NULL pages, chunked prefill (16-token budget), prefix hits."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 128, (10,), generator=gen).tolist()
    prompts = {f"p{n}": shared + torch.randint(3, 128, (n,), generator=gen).tolist() for n in (1, 9, 23)}
    prompts["short"] = [5, 6, 7]
    engine = _engine(windowed.path, num_kv_pages=64)
    assert engine.describe()["kv_groups"] == ",".join(g.label for g in GROUPS[windowed.kind])
    batched = _generate(engine, prompts, 12)
    fed = engine.runner.num_tokens_run
    again = _generate(engine, prompts, 12)  # the prompts' pages are now in the prefix cache
    assert again == batched
    # Every prompt's whole pages came back from the cache (all but the last token), in the window group too:
    # there only the pages inside the window of the hit's end, NULL before them.
    hits = sum((len(p) - 1) // 4 * 4 for p in prompts.values())
    assert engine.runner.num_tokens_run - fed == sum(len(p) for p in prompts.values()) - hits + 11 * len(prompts)
    for r, prompt in prompts.items():
        assert batched[r] == _hf_greedy(windowed.hf, prompt, 12), r
        assert _generate(_engine(windowed.path, num_kv_pages=64), {r: prompt}, 12) == {r: batched[r]}
