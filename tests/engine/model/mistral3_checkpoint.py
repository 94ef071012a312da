"""A tiny random Mistral3ForConditionalGeneration in the hub layout: a Pixtral tower of 4-pixel patches merged 2x2
(so an image's sides round up to multiples of 8 pixels, within a longest edge of 64), a Mistral (or Ministral 3)
text model; the image, break and end tokens at Mistral's ids (10, 12, 13); prompts with images laid out as
PixtralProcessor lays them (rows of image tokens, a break after each, the end token last) or with one image token
per image as the chat template writes them; transformers' logits for them."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import torch

from tests.engine.conftest import TOKENIZER_FILES

IMAGE, BREAK, END = 10, 12, 13
PATCH, MERGE, LONGEST = 4, 2, 64
TEXT = dict(
    model_type="mistral",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    sliding_window=None,
    tie_word_embeddings=False,
)
MINISTRAL3 = dict(
    model_type="ministral3",
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "llama_4_scaling_beta": 0.1,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
VISION = dict(
    model_type="pixtral",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=LONGEST,
    patch_size=PATCH,
    hidden_act="silu",
)


def build_mistral3(path: Path, baked: Path, text: dict | None = None, **top):
    """Saves the model (and the baked tokenizer, a preprocessor_config.json) to path; returns transformers' model."""
    import transformers as tf
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    config = tf.Mistral3Config(
        text_config={**TEXT, **(text or {})},
        vision_config=VISION,
        image_token_index=IMAGE,
        spatial_merge_size=MERGE,
        tie_word_embeddings=False,
        **top,
    )
    torch.manual_seed(0)
    model = tf.Mistral3ForConditionalGeneration(config).float().eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # bigger weights than the default init, so that parity means something
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.config.architectures = ["Mistral3ForConditionalGeneration"]
    model.save_pretrained(path)
    PixtralImageProcessorPil(size={"longest_edge": LONGEST}, patch_size=PATCH).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (baked / name).exists() and name != "generation_config.json":
            shutil.copy(baked / name, path / name)
    return model


def hf_inputs(files: list[bytes]) -> dict:
    """transformers' own preprocessing (with the merged patch Mistral 3's processor passes), padded to one batch."""
    from PIL import Image
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    processor = PixtralImageProcessorPil(size={"longest_edge": LONGEST}, patch_size=PATCH)
    pictures = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    return processor(pictures, patch_size={"height": PATCH * MERGE, "width": PATCH * MERGE}, return_tensors="pt")


def layout(size: tuple[int, int]) -> list[int]:
    """PixtralProcessor.replace_image_token's tokens for an image of `size` pixels (height, width)."""
    rows, cols = size[0] // (PATCH * MERGE), size[1] // (PATCH * MERGE)
    tokens = ([IMAGE] * cols + [BREAK]) * rows
    return tokens[:-1] + [END]


def prompt_with(files: list[bytes], seed: int = 0, lead: int = 5, widen: bool = True) -> list[int]:
    """Text, then per image its layout (one image token when not `widen`) and a few text tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(14, 97, (lead,), generator=gen).tolist()
    sizes = hf_inputs(files)["image_sizes"].tolist() if files else []
    for i, size in enumerate(sizes):
        tokens += (layout(size) if widen else [IMAGE]) + torch.randint(14, 97, (3 + i,), generator=gen).tolist()
    return tokens


def hf_logits(hf, tokens: list[int], files: list[bytes]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    pixels = dict(hf_inputs(files)) if files else {}
    with torch.no_grad():
        return hf(input_ids=ids, **pixels).logits[0].float()
