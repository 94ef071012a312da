"""Mistral 3's image input against transformers' Mistral3ForConditionalGeneration in float32 on a tiny random
checkpoint (mistral3_checkpoint.py): the Pixtral tower and projector on images of several sizes (non-square, sides
not multiples of the patch), prompt logits with one and with two images of different sizes laid out as
PixtralProcessor lays them (only the image tokens take features, the break and end tokens keep their embeddings),
text alone, decode after them; transformers 5's tensor names as well as 4's; and through the engine, from prompts
holding one image token per image as the chat template writes them: greedy batched (chunks cutting the images)
equal to each alone and to transformers, a prefix-cache hit of the same image, another image no hit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model.loader import check_checkpoint
from engine.sample.params import SamplingParams
from tests.engine.model.family_parity import Pages, load_family, tiny_engine
from tests.engine.model.mistral3_checkpoint import (
    BREAK,
    END,
    IMAGE,
    MINISTRAL3,
    build_mistral3,
    hf_inputs,
    hf_logits,
    layout,
    prompt_with,
)
from tests.engine.model.vision_bf16 import bf16_tower, check_bf16_tower
from tests.engine.model.vision_checkpoints import hf_greedy, image_file, images

ATOL = 1e-4
IMAGE_ATOL = 5e-4  # the features equal transformers' within 1e-5; a tiny random decoder amplifies such rounding
FILES = [image_file(90, 40, 1), image_file(20, 30, 2, "JPEG")]  # 32x64 and 32x24 pixels: 4x8 and 4x3 soft tokens


@pytest.fixture(scope="module", params=["mistral", "ministral3"])
def vision(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp(f"mistral3_{request.param}")
    hf = build_mistral3(path, baked_model_path, text=MINISTRAL3 if request.param == "ministral3" else None)
    model, spec = load_family(path, baked_model_path)
    engine = tiny_engine(path, max_num_batched_tokens=24, num_kv_pages=160)
    return SimpleNamespace(hf=hf, model=model, spec=spec, path=path, engine=engine, intake=engine.images)


def _spans(vision, prompt: list[int], files: list[bytes]):
    """The engine's intake of the prompt (one image token per image, or whole layouts): widened prompt, spans."""
    widened, decoded = vision.intake.expand(prompt, images(files))
    return widened, vision.intake.spans(widened, decoded)


def test_the_tower_and_projector_equal_transformers(vision):
    assert check_checkpoint(str(vision.path)) == "Mistral3ForConditionalGeneration"
    files = [*FILES, image_file(90, 40, 3), image_file(200, 7, 4), image_file(64, 64, 5)]
    inputs = hf_inputs(files)
    with torch.no_grad():
        want = vision.hf.model.get_image_features(**inputs).pooler_output
    _, spans = _spans(vision, [IMAGE] * len(files), files)
    assert [s.grid for s in spans] == [(4, 8), (4, 3), (4, 8), (1, 8), (8, 8)]
    got = vision.model.encode_images([s.pixels for s in spans], [s.grid for s in spans])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def _run(vision, pages: Pages, batch: list[tuple[str, list[int], list[bytes]]]) -> torch.Tensor:
    """One paged step of `batch` (request, new tokens holding whole image layouts, their images), the image tokens'
    embeddings placed as the model runner places them (ImageSpan.features)."""
    rows, values, offset = [], [], 0
    for _, tokens, files in batch:
        if files:
            _, spans = _spans(vision, tokens, files)
            encoded = vision.model.encode_images([s.pixels for s in spans], [s.grid for s in spans])
            for span, embeds in zip(spans, encoded, strict=True):
                at, features = span.features(0, span.end - span.start)
                rows.append(offset + span.start + at)
                values.append(embeds[features])
        offset += len(tokens)
    extra = {"image_embeds": (torch.cat(rows), torch.cat(values))} if rows else {}
    return pages.run(vision.model, [(r, t) for r, t, _ in batch], **extra)


def test_prompt_logits_with_one_and_two_images_and_text_then_decode(vision):
    files = {"one": FILES[:1], "two": FILES, "text": []}
    prompts = {r: prompt_with(f, seed=i + 1) for i, (r, f) in enumerate(files.items())}
    assert prompts["one"][5 : 5 + 36] == ([IMAGE] * 8 + [BREAK]) * 3 + [IMAGE] * 8 + [END]
    pages = Pages(vision.spec.kv_groups)
    logits = _run(vision, pages, [(r, prompts[r], files[r]) for r in files])
    offset = 0
    for r, tokens in prompts.items():
        want = hf_logits(vision.hf, tokens, files[r])
        torch.testing.assert_close(logits[offset : offset + len(tokens)], want, atol=IMAGE_ATOL, rtol=1e-4)
        torch.testing.assert_close(logits[offset : offset + 5], want[:5], atol=ATOL, rtol=1e-4)  # text before
        offset += len(tokens)
    seqs = {r: list(t) for r, t in prompts.items()}
    for step in range(3):
        logits = _run(vision, pages, [(r, [20 + step], []) for r in seqs])
        for i, r in enumerate(seqs):
            seqs[r].append(20 + step)
            want = hf_logits(vision.hf, seqs[r], files[r])[-1]
            torch.testing.assert_close(logits[i], want, atol=IMAGE_ATOL, rtol=1e-4)


def test_the_break_tokens_keep_their_embeddings(vision):
    """Features put on the break and end tokens too (the image's tokens all replaced) answer otherwise."""
    tokens = prompt_with(FILES[:1], seed=1)
    _, (span,) = _spans(vision, tokens, FILES[:1])
    (embeds,) = vision.model.encode_images([span.pixels], [span.grid])
    n = span.end - span.start
    stretched = torch.cat([embeds, embeds[: n - len(embeds)]])  # every position of the span takes a feature
    rows = torch.arange(span.start, span.end)
    logits = Pages(vision.spec.kv_groups).run(vision.model, [("r", tokens)], image_embeds=(rows, stretched))
    assert (logits - hf_logits(vision.hf, tokens, FILES[:1])).abs().max() > 1e-2


def test_transformers_5_tensor_names_load_alike(vision, tmp_path, baked_model_path):
    from safetensors.torch import load_file, save_file

    names = {
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
        "vision_tower.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    tensors = load_file(vision.path / "model.safetensors")
    assert set(tensors) & {"language_model.lm_head.weight"}, "transformers saves 4's layout"
    renamed = {}
    for name, t in tensors.items():
        prefix = next(p for p in names if name.startswith(p))
        renamed[names[prefix] + name[len(prefix) :]] = t
    for f in vision.path.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_family(tmp_path, baked_model_path)
    theirs = dict(model.state_dict())
    for name, t in vision.model.state_dict().items():
        torch.testing.assert_close(theirs[name], t, atol=0, rtol=0)


def _greedy(engine, requests: dict[str, tuple[list[int], list[bytes]]], max_tokens: int = 5):
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
    """One image token per image, widened by the engine; a 24-token budget cuts the images between chunks."""
    requests = {"one": FILES[:1], "two": FILES, "text": []}
    prompts = {r: prompt_with(f, seed=i + 1, widen=False) for i, (r, f) in enumerate(requests.items())}
    want = {
        r: hf_greedy(vision.hf, prompt_with(f, seed=i + 1), f, 5, logits=hf_logits)
        for i, (r, f) in enumerate(requests.items())
    }
    given = {r: (prompts[r], requests[r]) for r in requests}
    engine = vision.engine
    batched, _ = _greedy(engine, given)
    assert batched == want
    again, cached = _greedy(engine, {r + "2": v for r, v in given.items()})
    assert {r[:-1]: t for r, t in again.items()} == want
    assert cached["one2"] >= 36 and cached["two2"] >= 52  # the images' pages came from the cache
    other, cached = _greedy(engine, {"other": (prompts["one"], FILES[1:])})
    assert cached["other"] <= 8  # the text before the image at most
    assert other["other"] == hf_greedy(vision.hf, prompt_with(FILES[1:], seed=1), FILES[1:], 5, logits=hf_logits)
    for r in requests:
        solo, _ = _greedy(tiny_engine(vision.path, max_num_batched_tokens=24, num_kv_pages=160), {r: given[r]})
        assert solo == {r: want[r]}


def test_a_prompt_whose_layout_is_not_the_image_is_refused(vision):
    from engine.errors import InvalidRequest

    tokens = prompt_with(FILES[:1], seed=1)
    at = tokens.index(BREAK)
    wrong = tokens[:at] + [IMAGE] + tokens[at + 1 :]  # a break token missing: rows would be mis-assigned
    with pytest.raises(InvalidRequest):
        _spans(vision, wrong, FILES[:1])
    assert layout((32, 64)) == tokens[5:41]


def test_the_tower_in_bfloat16_stays_near_float32_transformers(vision):
    """The CPU product path: the tower's and projector's linears packed (vision_bf16.py); two images of one size
    (attended in one call) and one of another."""
    files = [*FILES, image_file(90, 40, 3)]
    _, spans = _spans(vision, [IMAGE] * len(files), files)
    model = bf16_tower(vision.path, "vision_tower")
    ours = model.encode_images([s.pixels for s in spans], [s.grid for s in spans])
    inputs = dict(hf_inputs(files))
    check_bf16_tower(ours, vision.hf, lambda hf, x: list(hf.model.get_image_features(**x).pooler_output), inputs)


def test_a_head_of_its_own_is_read_where_the_text_config_unties_it(vision, tmp_path, baked_model_path):
    """Mistral3Config's top level defaults to tie_word_embeddings; a checkpoint whose text_config says false keeps
    its own lm_head (the logits stay transformers')."""
    import json

    for f in vision.path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    config["text_config"]["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, spec = load_family(tmp_path, baked_model_path)
    tokens = prompt_with([], seed=3, lead=9)
    logits = Pages(spec.kv_groups).run(model, [("r", tokens)])
    torch.testing.assert_close(logits, hf_logits(vision.hf, tokens, []), atol=ATOL, rtol=1e-4)
