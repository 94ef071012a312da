"""Qwen3-VL's vision tower (2-D rotary, per-image attention, deepstack mergers) and Qwen2.5-VL's (window attention:
many short runs of patches per image through image_attention, the whole-image block, the window order undone) run by
torch on CUDA in bfloat16 against the same weights in float32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.engine.model.qwen_vl_checkpoints import build_qwen_vl, hf_images
from tests.engine.model.vision_checkpoints import image_file

# Qwen2.5-VL: merged grids of 6x2 and 2x5 units cut into windows of 2x2 short, and 4x4 units tiled whole
FILES = [image_file(40, 90, 1), image_file(120, 60, 2, "JPEG"), image_file(64, 64, 4)]


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen2_5_vl"])
def test_the_qwen_vl_tower_on_cuda_matches_the_cpu(tmp_path, baked_model_path, model_type):
    from engine.model.loader import load_model

    build_qwen_vl(model_type, tmp_path, baked_model_path)
    cpu, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    gpu, _ = load_model(str(tmp_path), torch.bfloat16, torch.device("cuda"))
    h = hf_images(FILES)
    grids = [tuple(g) for g in h["image_grid_thw"].tolist()]
    patches = list(h["pixel_values"].split([g[1] * g[2] for g in grids]))
    want = cpu.encode_images(patches, grids)
    got = gpu.encode_images([p.cuda() for p in patches], grids)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float().cpu(), b, atol=5e-2, rtol=5e-2)
