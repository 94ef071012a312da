"""Mistral 3's Pixtral tower and projector (2-D rotary, block-diagonal image attention, RMSNorms switched to
FlashInfer's kernel with the text model's, the patch merger) run on CUDA in bfloat16 against the same weights in
float32 on the CPU, on images of different sizes, two of them alike. Held by the relative error of each image's soft
tokens (a random tiny tower amplifies bfloat16 rounding; element bounds would test rounding, not the code)."""

from __future__ import annotations

import torch

from tests.engine.model.family_parity import tiny_engine
from tests.engine.model.mistral3_checkpoint import IMAGE, build_mistral3
from tests.engine.model.vision_checkpoints import image_file, images


def test_the_pixtral_tower_on_cuda_matches_the_cpu(tmp_path, baked_model_path):
    from engine.model.loader import load_model

    build_mistral3(tmp_path, baked_model_path)
    cpu, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    gpu, _ = load_model(str(tmp_path), torch.bfloat16, torch.device("cuda"))
    files = [image_file(90, 40, 1), image_file(20, 30, 2, "JPEG"), image_file(90, 40, 3)]
    _, decoded = tiny_engine(tmp_path).images.expand([IMAGE] * 3, images(files))
    grids = [d.grid for d in decoded]
    want = cpu.encode_images([d.pixels for d in decoded], grids)
    got = gpu.encode_images([d.pixels.cuda() for d in decoded], grids)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.bfloat16
        assert ((a.float().cpu() - b).norm() / b.norm()).item() < 0.08
