"""Gemma 3's image input against transformers' Gemma3ForConditionalGeneration in float32 on a tiny random checkpoint
(vision_checkpoints.py): the SigLIP tower and projector, prompt logits with one and with two images of different
sizes (an image's tokens seeing each other both ways, its span wider than the sliding window), decode after them,
and through the engine greedy answers batched (chunked prefill that keeps each span whole) equal to each alone and to
transformers, a prefix-cache hit of the same image equal to the cold run, another image with the same tokens no hit.
Bad image input is refused with the image named, and a text-only model refuses any."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.errors import InvalidRequest, NoImageInput
from engine.inputs import ImageData
from engine.sample.params import SamplingParams
from tests.engine.model.family_parity import Pages, load_family, tiny_engine
from tests.engine.model.vision_bf16 import bf16_tower, check_bf16_tower
from tests.engine.model.vision_checkpoints import (
    IMAGE,
    TOKENS,
    build_vision_model,
    hf_greedy,
    hf_logits,
    hf_pixels,
    image_file,
    images,
    prompt_with,
)

ATOL = 1e-4
FILES = [image_file(40, 90, 1), image_file(300, 120, 2, "JPEG")]  # tall PNG, wide JPEG: both resized to 112


@pytest.fixture(scope="module")
def vision(tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp("gemma3_vision")
    hf = build_vision_model(path, baked_model_path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(hf=hf, model=model, spec=spec, path=path)


def test_the_tower_and_projector_equal_transformers(vision):
    pixels = hf_pixels(FILES)
    with torch.no_grad():
        want = vision.hf.model.get_image_features(pixels).pooler_output
    got = torch.stack(vision.model.encode_images(list(pixels), [None, None]))
    assert got.shape == (2, TOKENS, 64)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_the_tower_in_bfloat16_stays_near_float32_transformers(vision):
    """The CPU product path: its linears packed, GELU and residual adds fused into them (vision_bf16.py)."""
    pixels = hf_pixels(FILES + [image_file(64, 64, 3)])
    ours = bf16_tower(vision.path, "vision_tower").encode_images(list(pixels), [None] * 3)
    check_bf16_tower(
        ours, vision.hf, lambda hf, x: list(hf.model.get_image_features(**x).pooler_output), {"pixel_values": pixels}
    )


def _run(vision, pages: Pages, batch: list[tuple[str, list[int], list[bytes]]], bidirectional: bool = True):
    """One paged step of `batch` (request, new tokens, the images whose spans the tokens hold whole)."""
    positions, meta = pages.table.step([(r, len(t)) for r, t, _ in batch])
    rows, values, spans, offset = [], [], [], 0
    for r, tokens, files in batch:
        start = pages.table.lengths[r] - len(tokens)
        mine = []
        runs = [i for i, t in enumerate(tokens) if t == IMAGE]
        for k, f in enumerate(files):
            first = runs[k * TOKENS]
            rows += range(offset + first, offset + first + TOKENS)
            values.append(vision.model.encode_images(list(hf_pixels([f])), [None])[0])
            mine.append((start + first, start + first + TOKENS))
        spans.append(mine)
        offset += len(tokens)
    meta.bidirectional = spans if bidirectional and rows else None
    for b in pages.unique:
        b.plan(meta)
    extra = {"image_embeds": (torch.tensor(rows), torch.cat(values))} if rows else {}
    return pages.forward(vision.model, [(r, t) for r, t, _ in batch], positions, meta, **extra)


def test_prompt_logits_with_one_and_two_images_then_decode(vision):
    one, two = prompt_with(1, seed=1), prompt_with(2, seed=2)
    files = {"one": FILES[:1], "two": FILES}
    pages = Pages(vision.spec.kv_groups)
    logits = _run(vision, pages, [("one", one, files["one"]), ("two", two, files["two"])])
    torch.testing.assert_close(logits[: len(one)], hf_logits(vision.hf, one, files["one"]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[len(one) :], hf_logits(vision.hf, two, files["two"]), atol=ATOL, rtol=1e-4)
    seqs = {"one": list(one), "two": list(two)}
    for step in range(3):
        logits = _run(vision, pages, [(r, [7 + step], []) for r in seqs])
        for i, r in enumerate(seqs):
            seqs[r].append(7 + step)
            torch.testing.assert_close(logits[i], hf_logits(vision.hf, seqs[r], files[r])[-1], atol=ATOL, rtol=1e-4)


def test_the_mask_and_the_embeddings_matter(vision):
    """Causal attention over the image, or another image, answers otherwise: the parity above proves both."""
    tokens = prompt_with(1, seed=1)
    want = hf_logits(vision.hf, tokens, FILES[:1])
    causal = _run(vision, Pages(vision.spec.kv_groups), [("r", tokens, FILES[:1])], bidirectional=False)
    other = hf_logits(vision.hf, tokens, FILES[1:])
    assert (causal - want).abs().max() > 1e-2 and (other - want).abs().max() > 1e-2


def _greedy(engine, requests: dict[str, tuple[list[int], list[bytes]]], max_tokens: int = 6):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for r, (prompt, files) in requests.items():
        engine.add_request(r, prompt, params, images(files))
    out = {r: [] for r in requests}
    cached = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.outputs[0].token_ids
            cached[o.request_id] = o.num_cached_tokens
        engine.kv.check([s for g in engine.scheduler.running for s in g.seqs])
    assert engine.kv.num_free == [a.num_pages for a in engine.kv.allocators], "pages leaked"
    return out, cached


def test_engine_greedy_batched_solo_and_from_the_prefix_cache(vision):
    requests = {
        "one": (prompt_with(1, seed=1), FILES[:1]),
        "two": (prompt_with(2, seed=2), FILES),
        "text": (prompt_with(0, seed=3, lead=9), []),
    }
    want = {r: hf_greedy(vision.hf, p, f, 6) for r, (p, f) in requests.items()}
    # A 24-token budget: the two-image prompt (48 tokens) prefills in chunks that stop before a span.
    engine = tiny_engine(vision.path, max_num_batched_tokens=24)
    batched, _ = _greedy(engine, requests)
    assert batched == want
    assert engine.runner.num_images_encoded == 3
    again, cached = _greedy(engine, {r + "2": v for r, v in requests.items()})
    assert {r[:-1]: t for r, t in again.items()} == want
    assert cached["two2"] >= 40 and cached["one2"] >= 20  # the images' pages came from the cache
    for r, request in requests.items():
        solo, _ = _greedy(tiny_engine(vision.path, max_num_batched_tokens=24), {r: request})
        assert solo == {r: want[r]}


def test_another_image_with_the_same_tokens_misses_the_cache(vision):
    prompt = prompt_with(1, seed=1)
    engine = tiny_engine(vision.path, max_num_batched_tokens=24)
    _greedy(engine, {"a": (prompt, FILES[:1])})
    out, cached = _greedy(engine, {"b": (prompt, FILES[1:])})
    assert cached["b"] <= 4  # the first page (text only) at most: every page of the span hashes its image
    assert out["b"] == hf_greedy(vision.hf, prompt, FILES[1:], 6)


def test_bad_images_are_refused_naming_the_image(vision):
    engine = tiny_engine(vision.path)
    params = SamplingParams(max_tokens=2)
    prompt = prompt_with(2, seed=2)
    cases = [
        ([ImageData(FILES[0], "image 0")], "2 image placeholders for 1 images", "messages"),
        ([ImageData(b"not an image at all", "image 0"), ImageData(FILES[1], "image 1")], "not an image", "image 0"),
        (
            [ImageData(FILES[0], "image 0"), ImageData(FILES[1][: len(FILES[1]) // 2], "image 1")],
            "not an image",
            "image 1",
        ),
    ]
    for given, message, param in cases:
        with pytest.raises(InvalidRequest) as info:
            engine.prepare(prompt, params, given)
        assert message in info.value.message and info.value.param == param, info.value.message
    cut = prompt[: prompt.index(IMAGE) + 5]  # a span cut short
    with pytest.raises(InvalidRequest, match="5 soft tokens"):
        engine.prepare(cut, params, [ImageData(FILES[0], "image 0")])


def test_a_text_only_model_takes_no_image(tiny_model_path):
    engine = tiny_engine(tiny_model_path)
    with pytest.raises(NoImageInput, match="this model takes no image input") as info:
        engine.prepare([5, 6, 7], SamplingParams(max_tokens=2), [ImageData(FILES[0], "messages.[0].content.[1]")])
    assert info.value.param == "messages.[0].content.[1]"
    assert engine.images.prompt is None


def test_the_bake_keeps_the_vision_weights_and_the_processor(vision, tmp_path):
    from builder.bake import bake
    from builder.sources import resolve
    from engine.core.images.intake import read_processor_config

    manifest = bake(resolve(str(vision.path), None), tmp_path / "model")
    assert manifest["architecture"] == "Gemma3ForConditionalGeneration"
    assert "preprocessor_config.json" in manifest["files"]
    assert read_processor_config(str(tmp_path / "model"))["size"] == {"height": 112, "width": 112}
    engine = tiny_engine(tmp_path / "model")
    assert engine.spec.vision is not None and engine.images.prompt is not None
    assert engine.images.prompt.tokens_per_image == TOKENS


def test_a_prefill_chunk_never_ends_inside_an_image(vision):
    """A 48-token prompt with two spans under a 20-token budget: it prefills in chunks, the first cut short before
    the first span (at 6, where 20 would split it), none ending inside a span (the step plan is watched as the
    scheduler hands it over)."""
    from engine.core.images.intake import image_runs

    prompt = prompt_with(2, seed=2)
    engine = tiny_engine(vision.path, max_num_batched_tokens=20)
    ends: list[int] = []
    schedule = engine.scheduler.schedule

    def watched(*args, **kwargs):
        out = schedule(*args, **kwargs)
        ends.extend(s.start + s.num_tokens for s in out.scheduled if s.start + s.num_tokens <= len(prompt))
        return out

    engine.scheduler.schedule = watched
    out, _ = _greedy(engine, {"two": (prompt, FILES)})
    assert out["two"] == hf_greedy(vision.hf, prompt, FILES, 6)
    spans = image_runs(prompt, IMAGE)  # soft tokens 6-21 and 27-42
    assert ends[0] == spans[0][0] and ends[-1] == len(prompt) and len(ends) >= 4
    assert not [e for e in ends for a, b in spans if a < e < b], (ends, spans)
