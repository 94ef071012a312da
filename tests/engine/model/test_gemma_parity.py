"""Gemma 2 and Gemma 3 text against transformers in float32 on tiny random checkpoints: logits on several prompt
lengths, decode past the sliding window, and the engine's greedy answers batched (chunked prefill, prefix hits)
equal to each alone and to transformers. A Gemma3ForConditionalGeneration folder serves its text model alone.

The tiny configs make every Gemma extra bite: query_pre_attn_scalar != head_dim, attention and final soft-caps
small enough to cap (checked against the same weights without them), a window of 8 tokens, a linear rope scaling
on Gemma 3's global layers only.
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
from engine.model.loader import check_checkpoint, load_model
from engine.sample.params import SamplingParams
from tests.engine.conftest import TOKENIZER_FILES

ATOL = 1e-4
WINDOW = 8
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, max_position_embeddings=256)
SCALE = 24**-0.5
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}}
GROUPS = {
    "gemma2": [KVGroupSpec((0, 2), 2, 16, WINDOW, SCALE, 3.0), KVGroupSpec((1, 3), 2, 16, None, SCALE, 3.0)],
    "gemma3": [KVGroupSpec((0, 1, 2, 3, 4, 6), 2, 16, WINDOW, SCALE), KVGroupSpec((5,), 2, 16, None, SCALE)],
    "gemma3_mm": [KVGroupSpec((0, 1, 2, 3, 4, 6), 2, 16, WINDOW, SCALE), KVGroupSpec((5,), 2, 16, None, SCALE)],
}


def gemma_config(kind: str, **changes):
    import transformers as tf

    if kind == "gemma2":
        return tf.Gemma2Config(**{**SIZES, "num_hidden_layers": 4, "attn_logit_softcapping": 3.0,
                                  "final_logit_softcapping": 10.0, **changes})
    text = tf.Gemma3TextConfig(**{**SIZES, "num_hidden_layers": 7, "rope_parameters": GEMMA3_ROPE, **changes})
    if kind == "gemma3":
        return text
    return tf.Gemma3Config(text_config=text.to_dict(), vision_config=VISION, mm_tokens_per_image=4)


def build(kind: str, path, **changes):
    """Saves a random-weight model of `kind` to path and returns the transformers model (fp32, eager)."""
    import transformers as tf

    config = gemma_config(kind, **changes)
    torch.manual_seed(0)
    cls = tf.AutoModelForImageTextToText if kind == "gemma3_mm" else tf.AutoModelForCausalLM
    model = cls.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # default init gives near-zero logits; bigger weights make parity meaningful
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(GROUPS))
def gemma(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, path)
    for name in TOKENIZER_FILES:  # the engine needs a tokenizer; the ids stay below the tiny vocabulary
        if (baked_model_path / name).exists() and name != "generation_config.json":
            shutil.copy(baked_model_path / name, path / name)
    model, spec = load_model(str(path), torch.float32, torch.device("cpu"))
    return SimpleNamespace(kind=request.param, hf=hf, model=model, spec=spec, path=path)


def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def run_step(model, spec, harness, batch) -> torch.Tensor:
    input_ids, positions, meta = harness.step(batch)
    by_layer = {layer: g for g in spec.kv_groups for layer in g.layers}
    backends = [TorchRefBackend("cpu", window=g.window, scale=g.scale, soft_cap=g.soft_cap)
                for g in (by_layer[n] for n in range(spec.num_layers))]
    for b in backends:
        b.plan(meta)
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, meta, harness.kv_caches, backends))


def test_groups_carry_the_attention_extras(gemma):
    assert gemma.spec.kv_groups == GROUPS[gemma.kind]
    assert check_checkpoint(str(gemma.path)) == type(gemma.hf).__name__


def test_the_reference_caps_and_slides(gemma, tmp_path):
    """Without the window or the soft-caps the same weights answer otherwise past the window: parity below
    proves the engine applies them."""
    tokens = list(range(3, 23))
    ours = reference_logits(gemma.hf, tokens)
    for change in ({"sliding_window": 64}, {"attn_logit_softcapping": None, "final_logit_softcapping": None}):
        if gemma.kind != "gemma2" and "attn_logit_softcapping" in change:
            continue
        other = build(gemma.kind, tmp_path / str(len(change)), **change)
        assert (reference_logits(other, tokens) - ours)[WINDOW:].abs().max() > 1e-2, change


def test_prefill_lengths_and_decode_past_the_window(gemma, paged_harness):
    gen = torch.Generator().manual_seed(1)
    prompts = {r: torch.randint(0, 128, (n,), generator=gen).tolist() for r, n in (("a", 5), ("b", 13), ("c", 30))}
    s = gemma.spec
    harness = paged_harness(num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, num_pages=128)
    logits = run_step(gemma.model, s, harness, list(prompts.items()))
    row = 0
    for tokens in prompts.values():
        torch.testing.assert_close(logits[row : row + len(tokens)], reference_logits(gemma.hf, tokens),
                                   atol=ATOL, rtol=1e-4)
        row += len(tokens)
    seqs = {r: list(t) for r, t in prompts.items()}
    for _ in range(10):  # "a" crosses the window, every request crosses pages
        nxt = {r: int(torch.randint(0, 128, (1,), generator=gen)) for r in seqs}
        logits = run_step(gemma.model, s, harness, [(r, [t]) for r, t in nxt.items()])
        for i, (r, t) in enumerate(nxt.items()):
            seqs[r].append(t)
            torch.testing.assert_close(logits[i], reference_logits(gemma.hf, seqs[r])[-1], atol=ATOL, rtol=1e-4)


def _generate(path, prompts: dict[str, list[int]], max_tokens: int, engine: LLMEngine | None = None):
    engine = engine or LLMEngine(EngineConfig(model_path=str(path), dtype="float32", page_size=4, max_num_seqs=8,
                                              max_num_batched_tokens=16, num_kv_pages=64))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for r, prompt in prompts.items():
        engine.add_request(r, prompt, params)
    out: dict[str, list[int]] = {r: [] for r in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.outputs[0].token_ids
        engine.kv.check()
    assert engine.kv.num_free == [a.num_pages for a in engine.kv.allocators], "pages leaked"
    return out, engine


def _hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(reference_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_engine_greedy_equals_transformers_batched_and_solo(gemma):
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 128, (10,), generator=gen).tolist()
    prompts = {f"p{n}": shared + torch.randint(3, 128, (n,), generator=gen).tolist() for n in (1, 9, 23)}
    prompts["short"] = [5, 6, 7]
    batched, engine = _generate(gemma.path, prompts, 10)
    assert engine.describe()["kv_groups"] == ",".join(g.label for g in GROUPS[gemma.kind])
    again, _ = _generate(gemma.path, prompts, 10, engine)  # now from the prefix cache
    assert again == batched
    for r, prompt in prompts.items():
        assert batched[r] == _hf_greedy(gemma.hf, prompt, 10), r
        assert _generate(gemma.path, {r: prompt}, 10)[0] == {r: batched[r]}
