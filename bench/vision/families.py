"""The image-text families the benchmark runs, each a random-weight transformers model of a realistic tower
width with a small text model, saved in the hub layout with its processor settings: how to build it, how to feed
the same images to our tower and to transformers', and the prompt an image takes."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
START, IMAGE, END = 49000, 49001, 49002  # ordinary vocabulary ids standing in for the image tokens
GEMMA3_TOKENS = 64


@dataclass(frozen=True)
class Family:
    """build(args, folder) saves the checkpoint and returns transformers' model; inputs(batch, dtype) gives our
    encode_images' (pixels, grids) and transformers' get_image_features kwargs for the same images; placeholder is
    what the prompt holds for one image (the engine widens a one-token one)."""

    name: str
    build: Callable
    inputs: Callable
    placeholder: list[int]


def _finish(model, folder: Path, architecture: str, processor) -> None:
    model.config.architectures = [architecture]
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    base = Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            shutil.copy(base / name, folder / name)


def _random(cls, config, dtype: torch.dtype):
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # weights transformers starts at zero (Gemma 3's projector, biases): random too
        for name, p in model.named_parameters():
            if "norm" not in name and not p.any():
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def build_gemma3(args, folder: Path):
    """SigLIP-base's encoder blocks at 224 pixels (256 patches of 14, pooled to 64 soft tokens); Gemma 3 270M's
    text width."""
    import transformers as tf

    text = dict(
        vocab_size=49152,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=args.text_layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=4096,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=args.tower_layers,
        num_attention_heads=12,
        image_size=224,
        patch_size=14,
        vision_use_head=False,
    )
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_TOKENS,
        image_token_index=IMAGE,
        boi_token_index=START,
        eoi_token_index=END,
    )
    model = _random(tf.Gemma3ForConditionalGeneration, config, args.torch_dtype)
    _finish(
        model, folder, "Gemma3ForConditionalGeneration", tf.Gemma3ImageProcessor(size={"height": 224, "width": 224})
    )
    return model


def gemma3_inputs(batch: int, dtype: torch.dtype):
    pixels = torch.randn(batch, 3, 224, 224, dtype=dtype)
    return (list(pixels), [None] * batch), {"pixel_values": pixels}


def build_qwen3_vl(args, folder: Path):
    """Qwen3-VL 2B's vision tower width (1024, 16 heads, 16-pixel patches merged 2x2, a 48x48 square of learned
    positions), deepstack after a quarter, half and three quarters of its blocks; a Qwen3 0.6B-wide text model."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    depth = args.tower_layers
    deepstack = sorted({depth // 4, depth // 2, 3 * depth // 4} - {0}) or [0]
    vision = dict(
        depth=depth,
        hidden_size=1024,
        intermediate_size=4096,
        num_heads=16,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=1024,
        num_position_embeddings=2304,
        deepstack_visual_indexes=deepstack,
    )
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    text = dict(
        vocab_size=49152,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=args.text_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        rope_parameters=rope,
        tie_word_embeddings=True,
    )
    config = tf.AutoConfig.for_model(
        "qwen3_vl",
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=START - 1,
    )
    model = _random(tf.Qwen3VLForConditionalGeneration, config, args.torch_dtype)
    # 256 x 256 pixels at most: a 300 x 400 picture becomes 12 x 18 patches (54 soft tokens)
    processor = Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 64 * 64, "longest_edge": 256 * 256}
    )
    _finish(model, folder, "Qwen3VLForConditionalGeneration", processor)
    return model


def qwen3_vl_inputs(batch: int, dtype: torch.dtype):
    """Images of 256 x 256 pixels: 16 x 16 patches (64 soft tokens) each."""
    patches = [torch.randn(256, 3 * 2 * 16 * 16, dtype=dtype) for _ in range(batch)]
    grids = [(1, 16, 16)] * batch
    return (patches, grids), {"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor(grids)}


def build_qwen2_5_vl(args, folder: Path):
    """Qwen2.5-VL 3B's vision tower width (1280, 16 heads, 14-pixel patches merged 2x2, windows of 112 pixels, every
    eighth block over the whole image, the last one at least); a Qwen2 text model of 1024 wide."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    depth = args.tower_layers
    vision = dict(
        depth=depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=1024,
        window_size=112,
        fullatt_block_indexes=sorted({i for i in range(depth) if i % 8 == 7} | {depth - 1}),
    )
    text = dict(
        vocab_size=49152,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=args.text_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        tie_word_embeddings=True,
    )
    config = tf.AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=START - 1,
    )
    model = _random(tf.Qwen2_5_VLForConditionalGeneration, config, args.torch_dtype)
    # 252 x 252 pixels at most: a 300 x 400 picture becomes 14 x 20 patches (70 soft tokens)
    processor = Qwen2VLImageProcessorPil(
        patch_size=14, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 56 * 56, "longest_edge": 252 * 252}
    )
    _finish(model, folder, "Qwen2_5_VLForConditionalGeneration", processor)
    return model


def qwen2_5_vl_inputs(batch: int, dtype: torch.dtype):
    """Images of 252 x 252 pixels: 18 x 18 patches (81 soft tokens) each, in windows of 4 x 4 merged patches (the
    last row and column of windows cut short)."""
    patches = [torch.randn(324, 3 * 2 * 14 * 14, dtype=dtype) for _ in range(batch)]
    grids = [(1, 18, 18)] * batch
    return (patches, grids), {"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor(grids)}


def build_gemma4(args, folder: Path):
    """Gemma 4's own vision tower width (768, 12 heads of 64, 16-pixel patches pooled 3x3); a small Gemma 4 text
    model (per-layer inputs, a window of 512, a global layer of its own head size)."""
    import transformers as tf
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    layers = args.text_layers
    text = dict(
        vocab_size=49152,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        hidden_size_per_layer_input=64,
        vocab_size_per_layer_input=49152,
        max_position_embeddings=4096,
        final_logit_softcapping=30.0,
        use_bidirectional_attention="vision",
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    vision = dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=args.tower_layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        head_dim=64,
        patch_size=16,
        pooling_kernel_size=3,
    )
    config = tf.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=IMAGE,
        boi_token_id=START,
        eoi_token_id=END,
    )
    model = _random(tf.Gemma4ForConditionalGeneration, config, args.torch_dtype)
    # 70 soft tokens at most: a 300 x 400 picture becomes 21 x 27 patches (63 soft tokens)
    _finish(
        model,
        folder,
        "Gemma4ForConditionalGeneration",
        Gemma4ImageProcessorPil(patch_size=16, pooling_kernel_size=3, max_soft_tokens=70),
    )
    return model


def gemma4_inputs(batch: int, dtype: torch.dtype):
    """Images of 240 x 288 pixels: 15 x 18 patches (30 soft tokens) each, listed row by row."""
    rows, cols = 15, 18
    patches = [torch.rand(rows * cols, 16 * 16 * 3, dtype=dtype) for _ in range(batch)]
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    xy = torch.stack([c.flatten(), r.flatten()], dim=-1)  # transformers' (x, y) per patch
    theirs = {"pixel_values": torch.stack(patches), "image_position_ids": xy.expand(batch, -1, -1).contiguous()}
    return (patches, [(rows, cols)] * batch), theirs


FAMILIES = {
    "gemma3": Family("gemma3", build_gemma3, gemma3_inputs, [START] + [IMAGE] * GEMMA3_TOKENS + [END]),
    "qwen3_vl": Family("qwen3_vl", build_qwen3_vl, qwen3_vl_inputs, [START, IMAGE, END]),
    "qwen2_5_vl": Family("qwen2_5_vl", build_qwen2_5_vl, qwen2_5_vl_inputs, [START, IMAGE, END]),
    "gemma4": Family("gemma4", build_gemma4, gemma4_inputs, [START, IMAGE, END]),
}


def features(family: str, out) -> list[torch.Tensor]:
    """transformers' get_image_features output as our encode_images' per image tensors."""
    if family == "gemma3":
        return list(out.pooler_output)
    deepstack = getattr(out, "deepstack_features", None) or []
    return [torch.cat([p, *(d[i] for d in deepstack)], dim=-1) for i, p in enumerate(out.pooler_output)]
