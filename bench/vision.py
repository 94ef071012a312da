"""Gemma 3 image input benchmark (CPU): a random-weight Gemma3ForConditionalGeneration (SigLIP-base's encoder
blocks at 224 pixels, 256 patches pooled to 64 soft tokens; a small Gemma 3 text model) in one run:

    python bench/vision.py [--tower-layers 4] [--repeat 3] [--dtype float32]

1. images per second through the vision tower and projector, ours (engine/model/vision/) against transformers'
   get_image_features on the same weights, at batch 1 and 8, the sides alternating;
2. time to first token of one request with one image against the same text without it (prefix caching off, a new
   image every run), through LLMEngine, alternating.
Every run is printed and written to bench/out/vision.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOI, IMAGE, EOI = 49000, 49001, 49002  # ordinary vocabulary ids standing in for Gemma's image tokens
TOKENS = 64


def save_model(args, folder: Path):
    import transformers as tf

    text = dict(vocab_size=49152, hidden_size=640, intermediate_size=2048, num_hidden_layers=args.text_layers,
                num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                sliding_window=512, max_position_embeddings=4096, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=args.tower_layers, num_attention_heads=12,
                  image_size=224, patch_size=14, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS,
                             image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config).to(getattr(torch, args.dtype)).eval()
    model.config.architectures = ["Gemma3ForConditionalGeneration"]
    model.save_pretrained(folder)
    tf.Gemma3ImageProcessor(size={"height": 224, "width": 224}).save_pretrained(folder)
    base = Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            shutil.copy(base / name, folder / name)
    return model


def picture(seed: int) -> bytes:
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (300, 400, 3), generator=gen, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def first_token_s(engine, prompt: list[int], images: list) -> float:
    from engine.sample.params import SamplingParams

    start = time.perf_counter()
    engine.add_request(f"r{time.perf_counter_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=1), images)
    while engine.has_unfinished():
        if any(o.outputs and o.outputs[0].token_ids for o in engine.step()):
            elapsed = time.perf_counter() - start
            while engine.has_unfinished():
                engine.step()
            return elapsed
    raise RuntimeError("no token came")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tower-layers", type=int, default=4)
    parser.add_argument("--text-layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.inputs import ImageData

    folder = Path(tempfile.mkdtemp(prefix="vision-bench-"))
    runs: list[dict] = []
    try:
        hf = save_model(args, folder)
        engine = LLMEngine(EngineConfig(model_path=str(folder), dtype=args.dtype, enable_prefix_caching=False,
                                        max_num_batched_tokens=2048))
        ours = engine.model
        with torch.inference_mode():
            for batch in (1, 8):
                pixels = torch.randn(batch, 3, 224, 224, dtype=getattr(torch, args.dtype))
                images, grids = list(pixels), [None] * batch
                ours.encode_images(images, grids), hf.model.get_image_features(pixels)  # warm-up
                for rep in range(args.repeat):
                    t_ours = timed(lambda: ours.encode_images(images, grids))
                    t_hf = timed(lambda: hf.model.get_image_features(pixels))
                    runs.append({"what": "tower", "batch": batch, "rep": rep, "ours_img_s": batch / t_ours,
                                 "transformers_img_s": batch / t_hf})
                    print(runs[-1], flush=True)
        text = list(range(1000, 1100))
        with_image = text[:50] + [BOI] + [IMAGE] * TOKENS + [EOI] + text[50:]
        first_token_s(engine, text, [])  # warm-up
        for rep in range(args.repeat):
            t_text = first_token_s(engine, text, [])
            t_image = first_token_s(engine, with_image, [ImageData(picture(rep), "image")])
            runs.append({"what": "ttft", "rep": rep, "text_ms": 1000 * t_text, "image_ms": 1000 * t_image,
                         "text_tokens": len(text), "image_prompt_tokens": len(with_image)})
            print(runs[-1], flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "vision.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
