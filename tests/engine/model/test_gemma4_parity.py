"""Gemma 4 dense text against transformers in float32 on a tiny random checkpoint that has every Gemma 4 extra:
global layers with their own head size (32) and KV heads (1) in their own KV group, keys reused as values there
(attention_k_eq_v), proportional rope with partial_rotary_factor 0.25 on them, the last two layers sharing KV
(they hold no pages; one has a double-wide MLP), per-layer input embeddings, a final soft-cap, a window of 8.
"""

from __future__ import annotations

import random
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
from tests.paging import PageTable

ATOL = 1e-4
WINDOW = 8
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
         "full_attention"]
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True, layer_types=TYPES,
              sliding_window=WINDOW, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
              final_logit_softcapping=10.0, max_position_embeddings=256)
# Layers 4 and 5 share KV: each reads the last earlier layer of its type (3 and 2).
GROUPS = [KVGroupSpec((0, 1, 3), 2, 16, WINDOW, 1.0, None, ((4, 3),)),
          KVGroupSpec((2,), 1, 32, None, 1.0, None, ((5, 2),))]


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory, baked_model_path):
    import transformers as tf

    path = tmp_path_factory.mktemp("gemma4")
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tf.Gemma4TextConfig(**CONFIG), attn_implementation="eager")
    hf = hf.float().eval()
    with torch.no_grad():  # default init gives near-zero logits; bigger weights make parity meaningful
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name or "scalar" in name else 0.15 * torch.randn_like(p))
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(path)
    for name in TOKENIZER_FILES:  # the engine needs a tokenizer; the ids stay below the tiny vocabulary
        if (baked_model_path / name).exists() and name != "generation_config.json":
            shutil.copy(baked_model_path / name, path / name)
    model, spec = load_model(str(path), torch.float32, torch.device("cpu"))
    return SimpleNamespace(hf=hf, model=model, spec=spec, path=path)


def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


class Pages:
    """Each KV group's NaN-filled pools and backend over one page table; a shared-KV layer gets its source's."""

    def __init__(self, groups: list[KVGroupSpec], num_pages: int = 128, page_size: int = 4) -> None:
        free = list(range(num_pages))
        random.Random(0).shuffle(free)
        self.table = PageTable(page_size, free)
        self.caches, self.backends = {}, {}
        for g in groups:
            backend = TorchRefBackend("cpu", **g.attention_extras())
            shape = (num_pages, page_size, g.num_kv_heads, g.head_dim)
            for layer in g.layers:
                self.caches[layer] = (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                self.backends[layer] = backend
            for reader, source in g.readers:
                self.caches[reader], self.backends[reader] = self.caches[source], backend
        self.unique = list({id(b): b for b in self.backends.values()}.values())

    def run(self, model, batch: list[tuple[str, list[int]]]) -> torch.Tensor:
        positions, meta = self.table.step([(r, len(t)) for r, t in batch])
        for b in self.unique:
            b.plan(meta)
        layers = sorted(self.caches)
        with torch.inference_mode():
            hidden = model(torch.tensor([t for _, ts in batch for t in ts]), positions, meta,
                           [self.caches[n] for n in layers], [self.backends[n] for n in layers])
            return model.compute_logits(hidden)


def test_groups_shapes_and_shared_layers(gemma4):
    assert gemma4.spec.kv_groups == GROUPS
    assert check_checkpoint(str(gemma4.path)) == "Gemma4ForCausalLM"
    layers = gemma4.hf.model.layers  # the reference has the extras the test is about
    assert not hasattr(layers[4].self_attn, "k_proj") and layers[2].self_attn.v_proj is None
    assert layers[5].mlp.intermediate_size == 2 * layers[3].mlp.intermediate_size
    assert gemma4.hf.config.rope_parameters["full_attention"]["rope_type"] == "proportional"


def test_prefill_lengths_and_decode_past_the_window(gemma4):
    gen = torch.Generator().manual_seed(1)
    prompts = {r: torch.randint(0, 128, (n,), generator=gen).tolist() for r, n in (("a", 5), ("b", 13), ("c", 30))}
    pages = Pages(gemma4.spec.kv_groups)
    logits = pages.run(gemma4.model, list(prompts.items()))
    row = 0
    for tokens in prompts.values():
        torch.testing.assert_close(logits[row : row + len(tokens)], reference_logits(gemma4.hf, tokens),
                                   atol=ATOL, rtol=1e-4)
        row += len(tokens)
    seqs = {r: list(t) for r, t in prompts.items()}
    for _ in range(10):  # "a" crosses the window, every request crosses pages
        nxt = {r: int(torch.randint(0, 128, (1,), generator=gen)) for r in seqs}
        logits = pages.run(gemma4.model, [(r, [t]) for r, t in nxt.items()])
        for i, (r, t) in enumerate(nxt.items()):
            seqs[r].append(t)
            torch.testing.assert_close(logits[i], reference_logits(gemma4.hf, seqs[r])[-1], atol=ATOL, rtol=1e-4)


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


def test_engine_greedy_equals_transformers_batched_and_solo(gemma4):
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 128, (10,), generator=gen).tolist()
    prompts = {f"p{n}": shared + torch.randint(3, 128, (n,), generator=gen).tolist() for n in (1, 9, 23)}
    prompts["short"] = [5, 6, 7]
    batched, engine = _generate(gemma4.path, prompts, 10)
    assert engine.describe()["kv_groups"] == "window(8):3x+1shared,full:1x+1shared"
    again, _ = _generate(gemma4.path, prompts, 10, engine)  # now from the prefix cache
    assert again == batched
    for r, prompt in prompts.items():
        tokens = list(prompt)
        for _ in range(10):
            tokens.append(int(reference_logits(gemma4.hf, tokens)[-1].argmax()))
        assert batched[r] == tokens[len(prompt) :], r
        assert _generate(gemma4.path, {r: prompt}, 10)[0] == {r: batched[r]}


def test_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """A Gemma4ForConditionalGeneration folder (vision tower and all): the bake's check passes, the vision weights
    are left unread, and the text logits equal transformers' on text alone."""
    import transformers as tf

    text = {**CONFIG, "num_hidden_layers": 2, "layer_types": TYPES[1:3], "num_kv_shared_layers": 0}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    torch.manual_seed(0)
    hf = tf.AutoModelForImageTextToText.from_config(
        tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None), attn_implementation="eager")
    hf = hf.float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name or "scalar" in name else 0.15 * torch.randn_like(p))
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(tmp_path)
    assert check_checkpoint(str(tmp_path)) == "Gemma4ForConditionalGeneration"
    model, spec = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    prompts = {"a": list(range(3, 8)), "b": list(range(10, 30))}
    logits = Pages(spec.kv_groups).run(model, list(prompts.items()))
    torch.testing.assert_close(logits[:5], reference_logits(hf, prompts["a"]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[5:], reference_logits(hf, prompts["b"]), atol=ATOL, rtol=1e-4)


def test_preemption_recomputes_the_same_tokens(gemma4):
    """A pool too small for every request at once: requests are preempted and recomputed (their shared-KV layers
    read the recomputed pages), and every answer equals the roomy run's."""
    gen = torch.Generator().manual_seed(3)
    prompts = {f"q{i}": torch.randint(3, 128, (n,), generator=gen).tolist() for i, n in enumerate((14, 19, 22, 9))}
    roomy, _ = _generate(gemma4.path, prompts, 12)
    tight = LLMEngine(EngineConfig(model_path=str(gemma4.path), dtype="float32", page_size=4, max_num_seqs=4,
                                   max_num_batched_tokens=16, num_kv_pages=20, enable_prefix_caching=False))
    squeezed, engine = _generate(gemma4.path, prompts, 12, tight)
    assert engine.scheduler.num_preemptions > 0
    assert squeezed == roomy

