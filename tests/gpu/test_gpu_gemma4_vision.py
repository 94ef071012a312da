"""Gemma 4's vision tower and embedder (clipped linears, GQA, 2-D rotary, pooling, standardisation) run by torch on
CUDA in bfloat16 against the same weights in float32 on the CPU, on two images of different sizes. Held by the
relative error of each image's soft tokens: transformers' own bfloat16 run of this random tower is 5-7% off its float32
one (the engine's on a bf16 CPU 3-4%), so element bounds would test rounding, not the code."""

from __future__ import annotations

import torch

from tests.engine.model.family_parity import tiny_engine
from tests.engine.model.gemma4_vision_checkpoint import BOI, EOI, IMAGE, build_gemma4_vision
from tests.engine.model.vision_checkpoints import image_file, images


def test_the_gemma4_tower_on_cuda_matches_the_cpu(tmp_path, baked_model_path):
    from engine.model.loader import load_model

    build_gemma4_vision(tmp_path, baked_model_path)
    cpu, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    gpu, _ = load_model(str(tmp_path), torch.bfloat16, torch.device("cuda"))
    files = [image_file(40, 90, 1), image_file(300, 120, 2, "JPEG")]
    _, decoded = tiny_engine(tmp_path).images.expand([BOI, IMAGE, EOI] * 2, images(files))
    grids = [d.grid for d in decoded]
    want = cpu.encode_images([d.pixels for d in decoded], grids)
    got = gpu.encode_images([d.pixels.cuda() for d in decoded], grids)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.bfloat16
        assert ((a.float().cpu() - b).norm() / b.norm()).item() < 0.08
