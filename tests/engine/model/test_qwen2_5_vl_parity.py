"""What Qwen2.5-VL has that the other Qwen image-text families do not, against transformers in float32 on a tiny
random checkpoint (qwen_vl_checkpoints.py; its images, greedy answers and bake run in test_qwen_vl_parity.py): the
window order equal to get_vision_window_index, the windows and the whole-image blocks both shaping the tower's
output, text-only logits at several prompt lengths batched in one step, and the hub releases' layout (visual.*,
model.layers.*, the text fields at the top of config.json, rope_scaling of type "mrope") loading the same model."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from engine.core.images.positions import StepPositions
from engine.model.vision.windows import window_order
from tests.engine.model.family_parity import Pages, load_family
from tests.engine.model.qwen_vl_checkpoints import IMAGE, build_qwen_vl, expanded, hf_images, hf_logits, prompt_with
from tests.engine.model.test_qwen_vl_parity import _spans
from tests.engine.model.vision_checkpoints import image_file

ATOL = 1e-4
# merged grids of 6x2, 2x5 and 4x4 units: windows of 2x2 units cut short, and whole
FILES = [image_file(40, 90, 1), image_file(120, 60, 2, "JPEG"), image_file(64, 64, 4)]


@pytest.fixture(scope="module")
def family(tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = build_qwen_vl("qwen2_5_vl", path, baked_model_path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(hf=hf, model=model, spec=spec, path=path)


@pytest.mark.parametrize(
    "grids", [[(1, 8, 8)], [(1, 12, 4)], [(1, 4, 10), (1, 8, 8), (1, 2, 2)], [(1, 14, 18)], [(1, 16, 6), (1, 6, 16)]]
)
@pytest.mark.parametrize("side", [1, 2, 4])
def test_the_window_order_equals_transformers(grids, side):
    from transformers.vision_utils import get_vision_window_index

    want_index, want_cu = get_vision_window_index(torch.tensor(grids), 2, side * 2 * 14, 14)
    got = window_order(grids, merge=2, side=side)
    assert got.units.tolist() == want_index.tolist()
    assert torch.tensor([0, *got.lengths]).cumsum(0).tolist() == want_cu.tolist()


def _features(model, files: list[bytes]) -> list[torch.Tensor]:
    h = hf_images(files)
    grids = [tuple(g) for g in h["image_grid_thw"].tolist()]
    return model.encode_images(list(h["pixel_values"].split([g[1] * g[2] for g in grids])), grids)


def test_the_windows_and_the_whole_image_blocks_both_count(family):
    """Every block over the whole image, or every block in windows, answers otherwise: the tower's parity (in
    test_qwen_vl_parity.py, on these images) proves the windows' order and the whole-image blocks both."""
    with torch.no_grad():
        want = _features(family.model, FILES)
        args = family.model.visual.args
        for changed in (dict(fullatt_block_indexes=()), dict(fullatt_block_indexes=(0, 1, 2))):
            family.model.visual.args = dataclasses.replace(args, **changed)
            try:
                other = _features(family.model, FILES)
            finally:
                family.model.visual.args = args
            assert all((a - b).abs().max() > 1e-3 for a, b in zip(want[:2], other[:2], strict=True)), changed


def test_text_only_logits_at_several_prompt_lengths(family):
    prompts = {f"n{n}": prompt_with(0, seed=n, lead=n) for n in (1, 6, 17, 45)}
    pages = Pages(family.spec.kv_groups)
    logits = pages.run(family.model, list(prompts.items()))
    offset = 0
    for tokens in prompts.values():
        want = hf_logits(family.hf, tokens, [])
        torch.testing.assert_close(logits[offset : offset + len(tokens)], want, atol=ATOL, rtol=1e-4)
        offset += len(tokens)


def release_layout(path) -> None:
    """Rewrites a transformers 5 save as the hub's Qwen2.5-VL releases are: visual.*, model.layers.*, lm_head, and
    config.json with the text model's fields at the top and rope_scaling {"type": "mrope", "mrope_section"}."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    renamed = {
        k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
        for k, v in load_file(file).items()
    }
    save_file(renamed, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    text["rope_theta"] = rope["rope_theta"]
    (path / "config.json").write_text(json.dumps({**text, **config}))


def test_the_hub_release_layout_loads_the_same_model(family, tmp_path, baked_model_path):
    build_qwen_vl("qwen2_5_vl", tmp_path, baked_model_path)
    release_layout(tmp_path)
    model, spec = load_family(tmp_path, baked_model_path)
    assert any(name.startswith("visual.blocks.") for name, _ in model.named_parameters())
    tokens = expanded(prompt_with(1, seed=1), FILES[:1])
    (embeds,) = _features(model, FILES[:1])
    rows = torch.tensor([i for i, t in enumerate(tokens) if t == IMAGE])
    positions = StepPositions()
    positions.add(_spans(tokens, FILES[:1]), 0, len(tokens))
    logits = Pages(spec.kv_groups).run(
        model, [("r", tokens)], positions.tensor(torch.device("cpu")), image_embeds=(rows, embeds)
    )
    torch.testing.assert_close(logits, hf_logits(family.hf, tokens, FILES[:1]), atol=ATOL, rtol=1e-4)
