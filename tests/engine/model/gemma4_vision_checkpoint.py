"""A tiny random Gemma4ForConditionalGeneration in the hub layout: a vision tower of 4-pixel patches pooled 2x2 (so a
40x90 picture takes 60 soft tokens, a 300x120 one 65), with clipped linears, standardised soft tokens and GQA; a text
model with per-layer inputs, global layers of their own head size and a window of 8, so an image's span is much
wider than the window, and use_bidirectional_attention "vision"; a preprocessor_config.json with the smallest
budget (70 soft tokens); prompts with images; transformers' logits for them (mm_token_type_ids marking the soft
tokens, as Gemma4Processor does)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import torch

from tests.engine.conftest import TOKENIZER_FILES

BOI, EOI, IMAGE = 98, 99, 100
PROCESSOR = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    max_position_embeddings=512,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=128,
    final_logit_softcapping=10.0,
    use_bidirectional_attention="vision",
    pad_token_id=0,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    patch_size=4,
    pooling_kernel_size=2,
    position_embedding_size=160,
    use_clipped_linears=True,
    standardize=True,
)


def build_gemma4_vision(path: Path, baked: Path, text: dict | None = None):
    """Saves the model (and the baked tokenizer, a preprocessor_config.json) to path; returns transformers' model."""
    import transformers as tf
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    config = tf.Gemma4Config(
        text_config={**TEXT, **(text or {})},
        vision_config=VISION,
        audio_config=None,
        image_token_id=IMAGE,
        boi_token_id=BOI,
        eoi_token_id=EOI,
    )
    torch.manual_seed(0)
    model = tf.Gemma4ForConditionalGeneration(config).float().eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # bigger weights than the default init, so that parity means something
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name or "scalar" in name else 0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-2.0)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(2.5)
            elif name.endswith(("std_bias", "std_scale")):
                b.copy_(0.1 * torch.randn_like(b) + (1.0 if name.endswith("scale") else 0.0))
    model.config.architectures = ["Gemma4ForConditionalGeneration"]
    model.save_pretrained(path)
    Gemma4ImageProcessorPil(**PROCESSOR).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (baked / name).exists() and name != "generation_config.json":
            shutil.copy(baked / name, path / name)
    return model


def hf_inputs(files: list[bytes]) -> dict:
    """transformers' own preprocessing of the files (the engine's is held to it in tests/engine/image)."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    out = Gemma4ImageProcessorPil(**PROCESSOR)(
        [Image.open(io.BytesIO(f)).convert("RGB") for f in files], return_tensors="pt"
    )
    return {
        "pixel_values": out["pixel_values"],
        "image_position_ids": out["image_position_ids"],
        "tokens": [int(n) for n in out["num_soft_tokens_per_image"]],
    }


def prompt_with(files: list[bytes], seed: int = 0, lead: int = 5, widen: bool = True) -> list[int]:
    """Text, then per image boi, its soft tokens (one placeholder when not `widen`), eoi and a few text tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 97, (lead,), generator=gen).tolist()
    counts = hf_inputs(files)["tokens"] if files else []
    for i, n in enumerate(counts):
        tokens += [BOI] + [IMAGE] * (n if widen else 1) + [EOI] + torch.randint(3, 97, (3 + i,), generator=gen).tolist()
    return tokens


def hf_logits(hf, tokens: list[int], files: list[bytes]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    pixels = {k: v for k, v in hf_inputs(files).items() if k != "tokens"} if files else {}
    with torch.no_grad():
        return hf(input_ids=ids, mm_token_type_ids=(ids == IMAGE).long(), **pixels).logits[0].float()
