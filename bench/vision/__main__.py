"""Image input benchmark (CPU): per family (Gemma 3's SigLIP, Qwen3-VL's vision transformer with its 2-D rotary,
merger and deepstack, Qwen2.5-VL's windowed one, Gemma 4's tower), a random-weight image-text model of a realistic
tower width (bench/vision/families.py), in one run:

    python -m bench.vision [--family gemma3,qwen3_vl,qwen2_5_vl,gemma4] [--dtype bfloat16] [--tower-layers 4]

1. images per second through the vision tower and its projector / merger / embedder, ours (engine/model/vision/,
   loaded as the engine serves it: in --dtype, its bf16 linears packed for oneDNN on a CPU that has bf16) against
   transformers' get_image_features on the same weights in the same dtype, at batch 1 and 8, the sides
   alternating, with the relative difference of the two outputs;
2. time to first token of one request with one image against the same text without it (prefix caching off, a new
   picture every run), through LLMEngine, alternating.
Every run is printed (with the load average before each family and at the end: the figures are only as quiet as
the machine) and written to bench/out/vision.json.
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
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.vision.families import FAMILIES, features  # noqa: E402


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


def relative_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    a, b = torch.cat([t.float().flatten() for t in ours]), torch.cat([t.float().flatten() for t in theirs])
    return ((a - b).norm() / b.norm()).item()


def tower_runs(family: str, engine, hf, args) -> list[dict]:
    ours, runs = engine.model, []
    with torch.inference_mode():
        for batch in (1, 8):
            (pixels, grids), theirs = FAMILIES[family].inputs(batch, args.torch_dtype)
            # the warm-up pair, also the check that both sides compute the same features
            diff = relative_difference(
                ours.encode_images(pixels, grids), features(family, hf.model.get_image_features(**theirs))
            )
            for rep in range(args.repeat):
                t_ours = timed(partial(ours.encode_images, pixels, grids))
                t_hf = timed(partial(hf.model.get_image_features, **theirs))
                runs.append(
                    {
                        "family": family,
                        "what": "tower",
                        "batch": batch,
                        "rep": rep,
                        "ours_img_s": batch / t_ours,
                        "transformers_img_s": batch / t_hf,
                        "speedup": t_hf / t_ours,
                        "relative_difference": diff,
                    }
                )
                print(runs[-1], flush=True)
    return runs


def ttft_runs(family: str, engine, args) -> list[dict]:
    from engine.inputs import ImageData

    text = list(range(1000, 1100))
    with_image = text[:50] + FAMILIES[family].placeholder + text[50:]
    first_token_s(engine, text, [])  # warm-up
    first_token_s(engine, with_image, [ImageData(picture(10_000), "image")])
    runs = []
    for rep in range(args.repeat):
        t_text = first_token_s(engine, text, [])
        t_image = first_token_s(engine, with_image, [ImageData(picture(rep), "image")])
        runs.append(
            {
                "family": family,
                "what": "ttft",
                "rep": rep,
                "text_ms": 1000 * t_text,
                "image_ms": 1000 * t_image,
                "text_tokens": len(text),
            }
        )
        print(runs[-1], flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default=",".join(FAMILIES), help=f"comma-separated: {', '.join(FAMILIES)}")
    parser.add_argument("--tower-layers", type=int, default=4)
    parser.add_argument("--text-layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    args.torch_dtype = getattr(torch, args.dtype)
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine

    runs: list[dict] = []
    loads: dict[str, list[float]] = {}
    for family in args.family.split(","):
        loads[family] = list(os.getloadavg())
        print(f"{family}: load average {loads[family]}", flush=True)
        folder = Path(tempfile.mkdtemp(prefix=f"vision-bench-{family}-"))
        try:
            hf = FAMILIES[family].build(args, folder)
            engine = LLMEngine(
                EngineConfig(
                    model_path=str(folder), dtype=args.dtype, enable_prefix_caching=False, max_num_batched_tokens=2048
                )
            )
            if getattr(engine.model, "cpu_packing", None) is not None:
                engine.model.cpu_packing.wait()
            runs += tower_runs(family, engine, hf, args)
            runs += ttft_runs(family, engine, args)
            del engine, hf
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    loads["end"] = list(os.getloadavg())
    print(f"end: load average {loads['end']}", flush=True)
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "torch_dtype"}
    (out / "vision.json").write_text(
        json.dumps(
            {"args": settings, "threads": torch.get_num_threads(), "load_average": loads, "runs": runs}, indent=2
        )
    )


if __name__ == "__main__":
    main()
