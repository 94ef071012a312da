"""Tiny random image-text models baked by the real builder for serving tests: the default model's tokenizer with
the family's image tokens added (special) and its chat template; a Gemma3ForConditionalGeneration (a 56-pixel
SigLIP tower whose 16 patches pool to 4 soft tokens), a Qwen3VLForConditionalGeneration or a
Qwen2_5_VLForConditionalGeneration (8-pixel patches merged 2x2, a pixel budget of 1024 to 4096; Qwen2.5-VL's tower
in windows of 2x2 merged patches, its second block over the whole image), a Gemma4ForConditionalGeneration (8-pixel
patches pooled 2x2, a budget of 70 soft tokens) and a Mistral3ForConditionalGeneration (a Pixtral tower of 4-pixel
patches merged 2x2, a longest edge of 64); each with a preprocessor_config.json; and image files to send them."""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from family_templates import GEMMA3, GEMMA4, MISTRAL3, QWEN2_5_VL, QWEN3_VL
from local_worker import ROOT

IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
SIZE, TOKENS = 56, 4
QWEN_IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
GEMMA4_IMAGE_TOKENS = ("<|image>", "<|image|>", "<image|>")
MISTRAL3_IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


def _tokenizer(baked: Path, source: Path, image_tokens: tuple[str, ...], template: str):
    """The default model's tokenizer with the image tokens added and the family's template, saved to source."""
    import transformers as tf
    from tokenizers import AddedToken

    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(baked / name, source / name)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(source))
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in image_tokens], special_tokens=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(source))
    return tokenizer


def _bake(source: Path, root: Path) -> Path:
    out = root / "model"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    baked_run = subprocess.run(
        [sys.executable, "-m", "builder", "--model", str(source), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert baked_run.returncode == 0, baked_run.stderr
    return out


def bake_vision_model(baked: Path, root: Path) -> Path:
    import torch
    import transformers as tf

    source = root / "tiny-gemma3-vision"
    tokenizer = _tokenizer(baked, source, IMAGE_TOKENS, GEMMA3)
    boi, image, eoi = tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS))
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=16,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=SIZE,
        patch_size=14,
        vision_use_head=False,
    )
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS,
        image_token_index=image,
        boi_token_index=boi,
        eoi_token_index=eoi,
    )
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # an image must move the answer's logprobs visibly
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0, 1.0)
    model.config.architectures = ["Gemma3ForConditionalGeneration"]
    model.save_pretrained(str(source))
    tf.Gemma3ImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(str(source))
    return _bake(source, root)


QWEN_VL_TOWERS = {  # model_type -> (served name, template, vision_config beyond the common one, architecture)
    "qwen3_vl": (
        "tiny-qwen3-vl",
        QWEN3_VL,
        dict(depth=1, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        "Qwen3VLForConditionalGeneration",
    ),
    "qwen2_5_vl": (
        "tiny-qwen2.5-vl",
        QWEN2_5_VL,
        dict(depth=2, window_size=32, fullatt_block_indexes=[1]),
        "Qwen2_5_VLForConditionalGeneration",
    ),
}


def bake_qwen_vl_model(baked: Path, root: Path, model_type: str = "qwen3_vl") -> Path:
    import torch
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    name, template, tower, architecture = QWEN_VL_TOWERS[model_type]
    source = root / name
    tokenizer = _tokenizer(baked, source, QWEN_IMAGE_TOKENS, template)
    start, image, end = tokenizer.convert_tokens_to_ids(list(QWEN_IMAGE_TOKENS))
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, "mrope_section": [2, 1, 1], "rope_type": "default"},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=32,
        **tower,
    )
    config = tf.AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = getattr(tf, architecture)(config)
    with torch.no_grad():  # an image must move the answer's logprobs visibly
        for p in model.model.visual.merger.parameters():
            p.normal_(0, 1.0)
    model.config.architectures = [architecture]
    model.save_pretrained(str(source))
    Qwen2VLImageProcessorPil(
        patch_size=8, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 1024, "longest_edge": 4096}
    ).save_pretrained(str(source))
    return _bake(source, root)


def bake_gemma4_vision_model(baked: Path, root: Path) -> Path:
    import torch
    import transformers as tf
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    source = root / "tiny-gemma4-vision"
    tokenizer = _tokenizer(baked, source, GEMMA4_IMAGE_TOKENS, GEMMA4)
    boi, image, eoi = tokenizer.convert_tokens_to_ids(list(GEMMA4_IMAGE_TOKENS))
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tokenizer),
        max_position_embeddings=512,
        num_kv_shared_layers=0,
        use_bidirectional_attention="vision",
        pad_token_id=tokenizer.pad_token_id or 0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=8,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    config = tf.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=image,
        boi_token_id=boi,
        eoi_token_id=eoi,
    )
    torch.manual_seed(0)
    model = tf.Gemma4ForConditionalGeneration(config)
    with torch.no_grad():  # an image must move the answer's logprobs visibly
        model.model.embed_vision.embedding_projection.weight.normal_(0, 1.0)
    model.config.architectures = ["Gemma4ForConditionalGeneration"]
    model.save_pretrained(str(source))
    Gemma4ImageProcessorPil(patch_size=8, pooling_kernel_size=2, max_soft_tokens=70).save_pretrained(str(source))
    return _bake(source, root)


def bake_mistral3_model(baked: Path, root: Path) -> Path:
    import torch
    import transformers as tf
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    source = root / "tiny-mistral3"
    tokenizer = _tokenizer(baked, source, MISTRAL3_IMAGE_TOKENS, MISTRAL3)
    text = dict(
        model_type="mistral",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = dict(
        model_type="pixtral",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=64,
        patch_size=4,
        hidden_act="silu",
    )
    config = tf.Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),  # the break and end tokens: the tokenizer's
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.Mistral3ForConditionalGeneration(config)
    with torch.no_grad():  # an image must move the answer's logprobs visibly
        model.model.multi_modal_projector.linear_2.weight.normal_(0, 1.0)
    model.config.architectures = ["Mistral3ForConditionalGeneration"]
    model.save_pretrained(str(source))
    PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=4).save_pretrained(str(source))
    return _bake(source, root)


def png(width: int, height: int, colour: tuple[int, int, int], fmt: str = "PNG") -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), colour)
    ImageDraw.Draw(image).ellipse((width // 4, height // 4, width // 2, height // 2), fill=(255 - colour[0], 0, 90))
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def check_image_moves_the_answer(sdk, model: str, messages, red: str, blue: str, image_tokens: int) -> None:
    """The first token's top logprobs differ between two images, repeat for the same one, and its second request
    takes the image's pages from the prefix cache. messages(url) -> the chat messages asking about the image."""

    def first_logprobs(url: str) -> tuple[list[float], object]:
        r = sdk.chat.completions.create(
            model=model, messages=messages(url), max_tokens=1, temperature=0, logprobs=True, top_logprobs=5
        )
        return [t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs], r.usage

    first, _ = first_logprobs(red)
    other, _ = first_logprobs(blue)
    assert max(abs(a - b) for a, b in zip(first, other, strict=True)) > 1e-3
    again, usage = first_logprobs(red)
    assert again == pytest.approx(first, abs=1e-5)
    assert usage.prompt_tokens_details.cached_tokens >= image_tokens  # the image's pages came from the cache


def ask(url: str, text: str = "What is in the picture?") -> list[dict]:
    """A user turn of one image_url part, then text."""
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


def check_whole_and_streamed(sdk, model: str, url: str, image_tokens: int, around: int = 2) -> None:
    """A chat turn with the image at `url` answers, streamed equal to whole, its prompt counting image_tokens more
    than the same text alone (the image's own tokens and the `around` tokens that open and close it)."""
    plain = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is in the picture?"}], max_tokens=8, temperature=0
    )
    whole = sdk.chat.completions.create(model=model, messages=ask(url), max_tokens=8, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.content
    assert whole.usage.prompt_tokens == plain.usage.prompt_tokens + image_tokens + around
    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=ask(url),
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
