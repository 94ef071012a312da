"""Gemma 4's image input against transformers' Gemma4ForConditionalGeneration in float32 on a tiny random checkpoint
(gemma4_vision_checkpoint.py): the vision tower and embedder on images of different sizes and aspect ratios, prompt
logits with one and with two images (an image's tokens seeing each other both ways on the windowed layers only,
its span wider than the window), decode after them, and through the engine, from prompts holding one image token per
image as the chat template writes them: greedy answers batched (chunked prefill that keeps each span whole) equal to
each alone and to transformers, a prefix-cache hit of the same image equal to the cold run, another image no hit; the
bake keeps the vision weights and the processor's settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model.loader import check_checkpoint
from engine.sample.params import SamplingParams
from tests.engine.model.family_parity import Pages, load_family, tiny_engine
from tests.engine.model.gemma4_vision_checkpoint import (
    BOI,
    EOI,
    IMAGE,
    build_gemma4_vision,
    hf_inputs,
    hf_logits,
    prompt_with,
)
from tests.engine.model.vision_bf16 import bf16_tower, check_bf16_tower
from tests.engine.model.vision_checkpoints import hf_greedy, image_file, images

ATOL = 1e-4
# The soft tokens equal transformers' within 1e-5, but this tiny random model amplifies such float32 rounding: its
# own logits move by 2e-4 when the image embeddings are ours instead of its own. Logits after an image are held to:
IMAGE_ATOL = 5e-4
FILES = [image_file(40, 90, 1), image_file(300, 120, 2, "JPEG")]  # 60 and 65 soft tokens


@pytest.fixture(scope="module")
def vision(tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp("gemma4_vision")
    hf = build_gemma4_vision(path, baked_model_path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(hf=hf, model=model, spec=spec, path=path, intake=tiny_engine(path).images)


def _engine_pixels(vision, files: list[bytes]):
    """The engine's preprocessing of the files: each image's patches and grid."""
    _, decoded = vision.intake.expand([BOI, IMAGE, EOI] * len(files), images(files))
    return [d.pixels for d in decoded], [d.grid for d in decoded]


def test_the_tower_and_embedder_equal_transformers(vision):
    assert check_checkpoint(str(vision.path)) == "Gemma4ForConditionalGeneration"
    files = FILES + [image_file(40, 90, 3)]  # two images of one size (attended in one call) and one of another
    inputs = hf_inputs(files)
    with torch.no_grad():
        want = vision.hf.model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output
    pixels, grids = _engine_pixels(vision, files)
    assert grids == [(24, 10), (10, 26), (24, 10)] and inputs["tokens"] == [60, 65, 60]
    got = vision.model.encode_images(pixels, grids)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-4)


def _run(
    vision,
    pages: Pages,
    batch: list[tuple[str, list[int], list[bytes]]],
    bidirectional: bool = True,
    everywhere: bool = False,
):
    """One paged step of `batch` (request, new tokens, the images whose spans the tokens hold whole); the image
    spans attend both ways on the windowed group only, as the model runner plans them (`everywhere`: on every
    group, as Gemma 3 has it)."""
    positions, meta = pages.table.step([(r, len(t)) for r, t, _ in batch])
    rows, values, spans, offset = [], [], [], 0
    for r, tokens, files in batch:
        start = pages.table.lengths[r] - len(tokens)
        runs = [i for i, t in enumerate(tokens) if t == IMAGE and (i == 0 or tokens[i - 1] != IMAGE)]
        mine = []
        if files:
            pixels, grids = _engine_pixels(vision, files)
            for first, embeds in zip(runs, vision.model.encode_images(pixels, grids), strict=True):
                rows += range(offset + first, offset + first + len(embeds))
                values.append(embeds)
                mine.append((start + first, start + first + len(embeds)))
        spans.append(mine)
        offset += len(tokens)
    windowed = {id(pages.backends[layer]) for g in vision.spec.kv_groups if g.window for layer in g.layers}
    for b in pages.unique:
        meta.bidirectional = spans if bidirectional and rows and (everywhere or id(b) in windowed) else None
        b.plan(meta)
    extra = {"image_embeds": (torch.tensor(rows), torch.cat(values))} if rows else {}
    return pages.forward(vision.model, [(r, t) for r, t, _ in batch], positions, meta, **extra)


def test_prompt_logits_with_one_and_two_images_then_decode(vision):
    files = {"one": FILES[:1], "two": FILES}
    one, two = prompt_with(files["one"], seed=1), prompt_with(files["two"], seed=2)
    pages = Pages(vision.spec.kv_groups)
    logits = _run(vision, pages, [("one", one, files["one"]), ("two", two, files["two"])])
    want = {"one": hf_logits(vision.hf, one, files["one"]), "two": hf_logits(vision.hf, two, files["two"])}
    torch.testing.assert_close(logits[: len(one)], want["one"], atol=IMAGE_ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[len(one) :], want["two"], atol=IMAGE_ATOL, rtol=1e-4)
    first = one.index(IMAGE)  # before the image, the text alone: as tight as any family
    torch.testing.assert_close(logits[:first], want["one"][:first], atol=ATOL, rtol=1e-4)
    seqs = {"one": list(one), "two": list(two)}
    for step in range(3):
        logits = _run(vision, pages, [(r, [7 + step], []) for r in seqs])
        for i, r in enumerate(seqs):
            seqs[r].append(7 + step)
            torch.testing.assert_close(
                logits[i], hf_logits(vision.hf, seqs[r], files[r])[-1], atol=IMAGE_ATOL, rtol=1e-4
            )


def test_the_mask_and_the_embeddings_matter(vision):
    """Causal attention over the image, or both ways on the global layers too, answers otherwise: the parity above
    proves the mask."""
    tokens = prompt_with(FILES[:1], seed=1)
    want = hf_logits(vision.hf, tokens, FILES[:1])
    causal = _run(vision, Pages(vision.spec.kv_groups), [("r", tokens, FILES[:1])], bidirectional=False)
    everywhere = _run(vision, Pages(vision.spec.kv_groups), [("r", tokens, FILES[:1])], everywhere=True)
    assert (causal - want).abs().max() > 1e-2 and (everywhere - want).abs().max() > 1e-2


def _greedy(engine, requests: dict[str, tuple[list[int], list[bytes]]], max_tokens: int = 6):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for r, (prompt, files) in requests.items():
        engine.add_request(r, prompt, params, images(files))
    out, cached = {r: [] for r in requests}, {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.outputs[0].token_ids
            cached[o.request_id] = o.num_cached_tokens
    assert engine.kv.num_free == [a.num_pages for a in engine.kv.allocators], "pages leaked"
    return out, cached


def test_engine_greedy_batched_solo_and_from_the_prefix_cache(vision):
    """The engine takes one image token per image and widens it to the image's soft tokens."""
    requests = {"one": FILES[:1], "two": FILES, "text": []}
    prompts = {r: prompt_with(f, seed=i + 1, widen=False) for i, (r, f) in enumerate(requests.items())}
    want = {
        r: hf_greedy(vision.hf, prompt_with(f, seed=i + 1), f, 5, logits=hf_logits)
        for i, (r, f) in enumerate(requests.items())
    }
    # An 80-token budget: the two-image prompt prefills in chunks that stop before a span.
    engine = tiny_engine(vision.path, max_num_batched_tokens=80, num_kv_pages=160)
    given = {r: (prompts[r], requests[r]) for r in requests}
    batched, _ = _greedy(engine, given, 5)
    assert batched == want
    assert engine.runner.num_images_encoded == 3
    again, cached = _greedy(engine, {r + "2": v for r, v in given.items()}, 5)
    assert {r[:-1]: t for r, t in again.items()} == want
    assert cached["two2"] >= 120 and cached["one2"] >= 60  # the images' pages came from the cache
    other, cached = _greedy(engine, {"other": (prompts["one"], FILES[1:])}, 5)
    assert cached["other"] <= 8  # the text before the image at most
    assert other["other"] == hf_greedy(vision.hf, prompt_with(FILES[1:], seed=1), FILES[1:], 5, logits=hf_logits)
    for r in requests:
        solo, _ = _greedy(tiny_engine(vision.path, max_num_batched_tokens=80, num_kv_pages=160), {r: given[r]}, 5)
        assert solo == {r: want[r]}


def test_the_bake_keeps_the_vision_weights_and_the_processor(vision, tmp_path):
    from builder.bake import bake
    from builder.sources import resolve
    from engine.core.images.intake import read_processor_config

    manifest = bake(resolve(str(vision.path), None), tmp_path / "model")
    assert manifest["architecture"] == "Gemma4ForConditionalGeneration"
    assert read_processor_config(str(tmp_path / "model"))["max_soft_tokens"] == 70
    engine = tiny_engine(tmp_path / "model", max_num_batched_tokens=80)
    assert engine.spec.vision is not None and engine.images.prompt.tokens_per_image is None
    assert engine.runner.bidirectional == [g.window is not None for g in engine.spec.kv_groups]
    out, _ = _greedy(engine, {"a": (prompt_with(FILES[:1], seed=1, widen=False), FILES[:1])}, 3)
    assert out["a"] == hf_greedy(vision.hf, prompt_with(FILES[:1], seed=1), FILES[:1], 3, logits=hf_logits)


def test_the_tower_in_bfloat16_stays_near_float32_transformers(vision):
    """The CPU product path: its linears packed, the MLP's GELU and gate fused into them (vision_bf16.py); two
    images of one size (attended in one call) and one of another."""
    files = FILES + [image_file(40, 90, 3)]
    pixels, grids = _engine_pixels(vision, files)
    ours = bf16_tower(vision.path, "vision_tower").encode_images(pixels, grids)
    inputs = {k: v for k, v in hf_inputs(files).items() if k != "tokens"}
    check_bf16_tower(ours, vision.hf, lambda hf, x: list(hf.model.get_image_features(**x).pooler_output), inputs)


def test_a_causal_checkpoint_may_cut_an_image_between_chunks(tmp_path, baked_model_path):
    """Without use_bidirectional_attention an image's tokens attend causally, as transformers masks them: a 24-token
    budget cuts the spans between chunks, the tower's output waits for the rest, and greedy equals transformers."""
    hf = build_gemma4_vision(tmp_path, baked_model_path, text={"use_bidirectional_attention": None})
    engine = tiny_engine(tmp_path, max_num_batched_tokens=24, num_kv_pages=160)
    assert engine.runner.bidirectional == [False, False]
    out, _ = _greedy(engine, {"two": (prompt_with(FILES, seed=2, widen=False), FILES)}, 4)
    assert out["two"] == hf_greedy(hf, prompt_with(FILES, seed=2), FILES, 4, logits=hf_logits)
    assert engine.runner.num_images_encoded == 2
