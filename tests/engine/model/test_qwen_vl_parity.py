"""Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's image input against transformers in float32 on tiny random checkpoints
(qwen_vl_checkpoints.py): the vision tower (deepstack features where the family has them), prompt logits with one
and with two images of different sizes (3-D rotary positions, the text after an image shifted), decode after them,
and through the engine greedy answers batched (chunked prefill that cuts an image's span) equal to each alone and to
transformers, a prefix-cache hit of the same image equal to the cold run and another image no hit. The engine widens
one image pad to the image's tokens (usage counts them) and refuses placeholders that do not match."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.core.images.intake import ImageSpan, image_runs
from engine.core.images.positions import StepPositions
from engine.errors import InvalidRequest
from engine.inputs import ImageData
from engine.sample.params import SamplingParams
from tests.engine.model.family_parity import Pages, load_family, tiny_engine
from tests.engine.model.qwen_vl_checkpoints import (
    IMAGE,
    build_qwen_vl,
    expanded,
    hf_greedy,
    hf_images,
    hf_logits,
    prompt_with,
)
from tests.engine.model.vision_bf16 import bf16_tower, check_bf16_tower
from tests.engine.model.vision_checkpoints import image_file, images

ATOL = 1e-4
FILES = [image_file(40, 90, 1), image_file(120, 60, 2, "JPEG")]  # 12 and 10 soft tokens
# the tower's batch: two images of one size (attended in one call) and one of another; Qwen2.5-VL's windows of 2x2
# merge units cut the first two short (grids of 6x2 and 2x5 units) and tile the last (4x4 units) whole
TOWER_FILES = FILES + [image_file(40, 90, 3), image_file(64, 64, 4)]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def family(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_qwen_vl(request.param, path, baked_model_path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(name=request.param, hf=hf, model=model, spec=spec, path=path)


def _encoded(family, files: list[bytes], model=None) -> list[torch.Tensor]:
    h = hf_images(files)
    grids = [tuple(g) for g in h["image_grid_thw"].tolist()]
    return (model or family.model).encode_images(list(h["pixel_values"].split([g[1] * g[2] for g in grids])), grids)


def _hf_features(hf, h: dict) -> list[torch.Tensor]:
    """transformers' tower: per image its merged tokens, then the deepstack features, side by side."""
    out = hf.model.get_image_features(h["pixel_values"], h["image_grid_thw"])
    deepstack = getattr(out, "deepstack_features", None) or []
    return [torch.cat([p, *(d[i] for d in deepstack)], dim=-1) for i, p in enumerate(out.pooler_output)]


def test_the_vision_tower_equals_transformers(family):
    with torch.no_grad():
        wants = _hf_features(family.hf, hf_images(TOWER_FILES))
    deepstack = 2 if family.name.startswith("qwen3_vl") else 0
    assert wants[0].shape[-1] == 64 * (1 + deepstack)
    for got, want in zip(_encoded(family, TOWER_FILES), wants, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_the_vision_tower_in_bfloat16_stays_near_float32_transformers(family):
    """The CPU product path: its linears packed, GELU and residual adds fused into them (vision_bf16.py)."""
    ours = _encoded(family, TOWER_FILES, bf16_tower(family.path, "visual"))
    h = {k: v for k, v in hf_images(TOWER_FILES).items() if k in ("pixel_values", "image_grid_thw")}
    check_bf16_tower(ours, family.hf, _hf_features, h)


def _spans(tokens: list[int], files: list[bytes]) -> list[ImageSpan]:
    grids = hf_images(files)["image_grid_thw"].tolist() if files else []
    return [
        ImageSpan(
            start=a,
            end=b,
            pixels=torch.empty(0),
            digest=b"",
            grid=tuple(g),
            rope_grid=(g[1] // 2, g[2] // 2),
            whole=False,
        )
        for (a, b), g in zip(image_runs(tokens, IMAGE), grids, strict=True)
    ]


def _run(family, pages: Pages, batch: list[tuple[str, list[int], list[bytes], list[int]]]):
    """One paged step: (request, new tokens, the request's images, its whole expanded prompt)."""
    positions = StepPositions()
    rows, values, offset = [], [], 0
    for r, tokens, files, prompt in batch:
        start = pages.table.lengths.get(r, 0)
        spans = _spans(prompt, files)
        positions.add(spans, start, start + len(tokens))
        if start == 0 and files:
            for span, embeds in zip(spans, _encoded(family, files), strict=True):
                rows += range(offset + span.start, offset + span.end)
                values.append(embeds)
        offset += len(tokens)
    extra = {"image_embeds": (torch.tensor(rows), torch.cat(values))} if rows else {}
    return pages.run(family.model, [(r, t) for r, t, _, _ in batch], positions.tensor(torch.device("cpu")), **extra)


def test_prompt_logits_with_one_and_two_images_then_decode(family):
    files = {"one": FILES[:1], "two": FILES}
    seqs = {"one": expanded(prompt_with(1, seed=1), files["one"]), "two": expanded(prompt_with(2, seed=2), FILES)}
    assert len(seqs["two"]) == 5 + (1 + 12 + 1) + 3 + (1 + 10 + 1) + 4
    pages = Pages(family.spec.kv_groups, recurrent=family.spec.recurrent)
    logits = _run(family, pages, [(r, seqs[r], files[r], seqs[r]) for r in seqs])
    n = len(seqs["one"])
    torch.testing.assert_close(logits[:n], hf_logits(family.hf, seqs["one"], files["one"]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[n:], hf_logits(family.hf, seqs["two"], FILES), atol=ATOL, rtol=1e-4)
    prompts = {r: list(t) for r, t in seqs.items()}
    for step in range(3):
        logits = _run(family, pages, [(r, [7 + step], files[r], prompts[r]) for r in seqs])
        for i, r in enumerate(seqs):
            seqs[r].append(7 + step)
            torch.testing.assert_close(logits[i], hf_logits(family.hf, seqs[r], files[r])[-1], atol=ATOL, rtol=1e-4)


def test_the_positions_and_the_embeddings_matter(family):
    """1-D positions over the image, or another image, answer otherwise: the parity above proves both."""
    tokens = expanded(prompt_with(1, seed=1), FILES[:1])
    want = hf_logits(family.hf, tokens, FILES[:1])
    pages = Pages(family.spec.kv_groups, recurrent=family.spec.recurrent)
    (embeds,) = _encoded(family, FILES[:1])
    rows = torch.tensor([i for i, t in enumerate(tokens) if t == IMAGE])
    flat = pages.run(family.model, [("r", tokens)], image_embeds=(rows, embeds))
    other = hf_logits(family.hf, expanded(prompt_with(1, seed=1), FILES[1:]), FILES[1:])
    assert (flat - want).abs().max() > 1e-3 and (other[-1] - want[-1]).abs().max() > 1e-3  # 10x ATOL


def _greedy(engine, requests: dict[str, tuple[list[int], list[bytes]]], max_tokens: int = 6):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for r, (prompt, files) in requests.items():
        engine.add_request(r, prompt, params, images(files))
    out, cached, prompts = {r: [] for r in requests}, {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.outputs[0].token_ids
            cached[o.request_id] = o.num_cached_tokens
            prompts[o.request_id] = list(o.prompt_token_ids)
        engine.kv.check([s for g in engine.scheduler.running for s in g.seqs])
    assert engine.kv.num_free == [a.num_pages for a in engine.kv.allocators], "pages leaked"
    return out, cached, prompts


def test_engine_greedy_batched_solo_and_from_the_prefix_cache(family):
    requests = {
        "one": (prompt_with(1, seed=1), FILES[:1]),
        "two": (prompt_with(2, seed=2), FILES),
        "text": (prompt_with(0, seed=3, lead=9), []),
    }
    want = {r: hf_greedy(family.hf, expanded(p, f), f, 6) for r, (p, f) in requests.items()}
    # An 8-token budget: chunks end inside the 12- and 10-token images (a causal model's span may be cut). A hybrid
    # model keeps as many state snapshots as sequences: room for every page boundary of the run.
    engine = tiny_engine(family.path, max_num_batched_tokens=8, max_num_seqs=32)
    batched, _, prompts = _greedy(engine, requests)
    assert batched == want
    assert prompts["two"] == expanded(requests["two"][0], FILES)  # usage counts the image's tokens
    assert engine.runner.num_images_encoded == 3
    again, cached, _ = _greedy(engine, {r + "2": v for r, v in requests.items()})
    assert {r[:-1]: t for r, t in again.items()} == want
    assert cached["two2"] >= 36 and cached["one2"] >= 20  # the images' pages came from the cache
    for r, request in requests.items():
        solo, _, _ = _greedy(tiny_engine(family.path, max_num_batched_tokens=8), {r: request})
        assert solo == {r: want[r]}


def test_another_image_misses_the_cache_and_an_expanded_prompt_runs_as_is(family):
    prompt = prompt_with(1, seed=1)
    engine = tiny_engine(family.path, max_num_batched_tokens=32)
    _greedy(engine, {"a": (prompt, FILES[:1])})
    other = [image_file(90, 40, 5)]  # the first image's size, turned: as many tokens, another grid
    out, cached, _ = _greedy(engine, {"b": (expanded(prompt, other), other)})
    assert cached["b"] <= 4  # the text page before the image at most
    assert out["b"] == hf_greedy(family.hf, expanded(prompt, other), other, 6)


def test_placeholders_that_do_not_match_are_refused(family):
    engine = tiny_engine(family.path)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequest, match="2 image placeholders for 1 images"):
        engine.prepare(prompt_with(2, seed=2), params, [ImageData(FILES[0], "image 0")])
    prompt = prompt_with(1, seed=1)
    cut = prompt[:6] + [IMAGE] * 5 + prompt[7:]  # five pads where the image takes 12
    with pytest.raises(InvalidRequest, match="5 soft tokens, not the 12") as info:
        engine.prepare(cut, params, [ImageData(FILES[0], "image 0")])
    assert info.value.param == "image 0"


def test_the_bake_keeps_the_vision_weights_and_the_processor(family, tmp_path):
    from builder.bake import bake
    from builder.sources import resolve
    from engine.core.images.intake import read_processor_config

    manifest = bake(resolve(str(family.path), None), tmp_path / "model")
    assert manifest["architecture"] == family.hf.config.architectures[0]
    assert read_processor_config(str(tmp_path / "model"))["patch_size"] == 8
    engine = tiny_engine(tmp_path / "model")
    assert engine.images.prompt is not None and engine.images.prompt.tokens_per_image is None
    assert any(name.startswith("visual.blocks.") for name, _ in engine.model.named_parameters())
    out, _, _ = _greedy(engine, {"r": (prompt_with(1, seed=1), FILES[:1])})
    assert out["r"] == hf_greedy(family.hf, expanded(prompt_with(1, seed=1), FILES[:1]), FILES[:1], 6)
