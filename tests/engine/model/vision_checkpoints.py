"""A tiny random Gemma3ForConditionalGeneration in the hub layout (its SigLIP tower of 8x8 patches pooled to 16 soft
tokens, a text window of 8 tokens, so an image's span is wider than the window), images as files of several sizes,
prompts with image spans, and transformers' logits and greedy answers for them (token_type_ids marking the soft
tokens, as Gemma3Processor does)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import torch

from engine.inputs import ImageData
from tests.engine.conftest import TOKENIZER_FILES

BOI, EOI, IMAGE = 98, 99, 100
TOKENS = 16  # soft tokens per image
SIZE = 112  # the tower's square: 8 x 8 patches of 14
TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=24,
    max_position_embeddings=256,
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=SIZE,
    patch_size=14,
    vision_use_head=False,
)


def build_vision_model(path: Path, baked: Path, vocab_size: int = 128, **processor):
    """Saves the model (and the baked tokenizer, a preprocessor_config.json with `processor`'s settings added) to
    path; returns transformers' model. vocab_size: the baked tokenizer's whole vocabulary for prompts of real text."""
    import transformers as tf

    config = tf.Gemma3Config(
        text_config={**TEXT, "vocab_size": vocab_size},
        vision_config=VISION,
        mm_tokens_per_image=TOKENS,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config).float().eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # bigger weights than the default init, so that parity means something
        for name, p in model.named_parameters():
            p.copy_((0.2 if "norm" in name else 0.15) * torch.randn_like(p))
    model.config.architectures = ["Gemma3ForConditionalGeneration"]
    model.save_pretrained(path)
    tf.Gemma3ImageProcessor(size={"height": SIZE, "width": SIZE}, **processor).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (baked / name).exists() and name != "generation_config.json":
            shutil.copy(baked / name, path / name)
    return model


def image_file(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """A noisy picture of the given size, as a file."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def hf_pixels(files: list[bytes]) -> torch.Tensor:
    """transformers' own preprocessing of the files (the engine's is held to it in tests/engine/image)."""
    import transformers as tf
    from PIL import Image

    processor = tf.Gemma3ImageProcessor(size={"height": SIZE, "width": SIZE})
    return processor([Image.open(io.BytesIO(f)).convert("RGB") for f in files], return_tensors="pt")["pixel_values"]


def prompt_with(images: int, seed: int = 0, lead: int = 5) -> list[int]:
    """Text, then per image its span (boi, 16 soft tokens, eoi) and a few more text tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 97, (lead,), generator=gen).tolist()
    for i in range(images):
        tokens += [BOI] + [IMAGE] * TOKENS + [EOI] + torch.randint(3, 97, (3 + i,), generator=gen).tolist()
    return tokens


def hf_logits(hf, tokens: list[int], files: list[bytes]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return (
            hf(input_ids=ids, pixel_values=hf_pixels(files) if files else None, token_type_ids=(ids == IMAGE).long())
            .logits[0]
            .float()
        )


def hf_greedy(hf, tokens: list[int], files: list[bytes], max_tokens: int, logits=None) -> list[int]:
    """transformers' greedy answer, the whole sequence run again for each token; logits: the family's hf_logits."""
    out = list(tokens)
    for _ in range(max_tokens):
        out.append(int((logits or hf_logits)(hf, out, files)[-1].argmax()))
    return out[len(tokens) :]


def images(files: list[bytes]) -> list[ImageData]:
    return [ImageData(f, f"image {i}") for i, f in enumerate(files)]


def gpu_files() -> list[bytes]:
    """Three pictures of different sizes (tests/gpu's tower check)."""
    return [image_file(40, 90, 1), image_file(300, 120, 2, "JPEG"), image_file(112, 112, 3)]
