"""Tiny random Qwen image-text checkpoints in the hub layout (Qwen3-VL and its MoE, Qwen3.5 and its MoE, built with
transformers' AutoConfig.for_model and from_config): a vision tower of 8-pixel patches merged 2x2 (deepstack after
its first two blocks where the family has it), a 4x4 square of learned positions, and a processor whose pixel budget
gives images of different sizes 4 to 16 soft tokens; prompts with one image pad per image as the chat template
writes them, and transformers' logits and greedy answers (its Qwen3VLProcessor's expansion, mm_token_type_ids and
image_grid_thw)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.engine.conftest import TOKENIZER_FILES
from tests.engine.model import vision_checkpoints

START, END, IMAGE = 98, 99, 100
PROCESSOR = dict(
    patch_size=8,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 16 * 16 * 4, "longest_edge": 16 * 16 * 16},
)
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=8,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
)
TOKENS = dict(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=97)
TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
HYBRID = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
# Qwen2.5-VL's tower: no learned positions, windows of 2x2 merge units (32 pixels), block 1 over the whole image
WINDOWED = dict(
    {k: v for k, v in VISION.items() if k != "num_position_embeddings"}, window_size=32, fullatt_block_indexes=[1]
)
FAMILIES = {  # model_type -> (architecture, text config, rope with its mrope sections)
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        TEXT,
        {"rope_theta": 10000.0, "mrope_section": [2, 3, 3], "rope_type": "default"},
    ),
    "qwen3_vl": (
        "Qwen3VLForConditionalGeneration",
        TEXT,
        {"rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True, "rope_type": "default"},
    ),
    "qwen3_vl_moe": (
        "Qwen3VLMoeForConditionalGeneration",
        {**TEXT, **MOE},
        {"rope_theta": 10000.0, "mrope_section": [4, 2, 2], "rope_type": "default"},
    ),
    "qwen3_5": (
        "Qwen3_5ForConditionalGeneration",
        {**TEXT, **HYBRID},
        {
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
            "rope_type": "default",
        },
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeForConditionalGeneration",
        {**TEXT, **HYBRID, **MOE, "shared_expert_intermediate_size": 48},
        {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1], "rope_type": "default"},
    ),
}


def build_qwen_vl(model_type: str, path: Path, baked: Path):
    """Saves the model, a preprocessor_config.json and the baked tokenizer to path; returns transformers' model."""
    import transformers as tf

    arch, text, rope = FAMILIES[model_type]
    vision = {**VISION, **({"deepstack_visual_indexes": [0, 1]} if model_type.startswith("qwen3_vl") else {})}
    if model_type == "qwen2_5_vl":
        vision = WINDOWED
    config = tf.AutoConfig.for_model(
        model_type, text_config={**text, "rope_parameters": rope}, vision_config=vision, **TOKENS
    )
    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(config).float().eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # bigger weights than the default init, so that parity means something
        for name, p in model.named_parameters():
            p.copy_((0.2 if "norm" in name else 0.15) * torch.randn_like(p))
    model.config.architectures = [arch]
    model.save_pretrained(path)
    if model_type == "qwen3_vl_moe":
        hub_expert_layout(path / "model.safetensors")
    hf_processor().save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (baked / name).exists() and name != "generation_config.json":
            shutil.copy(baked / name, path / name)
    return model


def hub_expert_layout(file: Path) -> None:
    """The fused experts as the hub's Qwen3-VL-MoE checkpoints store them, [E, in, out] (transformers 5 saves its
    own [E, out, in], and reads either)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    save_file(
        {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in tensors.items()},
        file,
        metadata={"format": "pt"},
    )


def hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**PROCESSOR)


def hf_images(files: list[bytes]) -> dict[str, torch.Tensor]:
    """transformers' pixel_values and image_grid_thw for the files."""
    import io

    from PIL import Image

    return dict(hf_processor()([Image.open(io.BytesIO(f)).convert("RGB") for f in files], return_tensors="pt"))


def expanded(tokens: list[int], files: list[bytes]) -> list[int]:
    """The prompt with each image pad widened to its image's soft tokens, as Qwen3VLProcessor does."""
    if not files:
        return list(tokens)
    counts = iter((hf_images(files)["image_grid_thw"].prod(-1) // 4).tolist())
    return [t for token in tokens for t in ([IMAGE] * next(counts) if token == IMAGE else [token])]


def prompt_with(images: int, seed: int = 0, lead: int = 5) -> list[int]:
    """Text, then per image <vision_start><image_pad><vision_end> and a few more text tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 97, (lead,), generator=gen).tolist()
    for i in range(images):
        tokens += [START, IMAGE, END] + torch.randint(3, 97, (3 + i,), generator=gen).tolist()
    return tokens


def hf_logits(hf, tokens: list[int], files: list[bytes]) -> torch.Tensor:
    """Logits of the expanded prompt `tokens` (and whatever follows it) with the files' images."""
    ids = torch.tensor([tokens])
    extra = {}
    if files:
        extra = {**hf_images(files), "mm_token_type_ids": (ids == IMAGE).int()}
    with torch.no_grad():
        return hf(input_ids=ids, **extra).logits[0].float()


def hf_greedy(hf, tokens: list[int], files: list[bytes], max_tokens: int) -> list[int]:
    return vision_checkpoints.hf_greedy(hf, tokens, files, max_tokens, hf_logits)
