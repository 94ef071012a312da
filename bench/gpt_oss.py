"""gpt-oss benchmark (CPU): a gpt-oss-20b-shaped slice (full width, a few layers, random MXFP4 experts) served by
our engine against transformers' generate on the same weights and dtype, in one run.

    python bench/gpt_oss.py [--layers 2] [--batches 1,64] [--tokens 16] [--repeat 2] [--dtype bfloat16]

gpt-oss-20b's width: hidden 2880, 64 query and 8 KV heads of 64, 32 experts of 2880 with top-4, a 128-token window
on every other layer. The vocabulary is the default model's (49152, so the engine has a tokenizer), not o200k.
Figures: the checkpoint's bytes on disk (experts in MXFP4), the engine's loaded weight bytes (experts dequantised
to --dtype: no MXFP4 kernel yet), and decode tokens/s (prefill excluded) at each batch size, sides alternating
--repeat times, every run printed. Writes bench/out/gpt_oss.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.moe import PROMPT, TOKENIZER_FILES, engine_decode, hf_decode  # noqa: E402

WIDTH = dict(
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    vocab_size=49152,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = p.parse_args()
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from tests.engine.model.gpt_oss_checkpoints import build_gpt_oss

    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    base = Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"
    runs, best = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt-oss"
        hf = build_gpt_oss(path, "mxfp4", **WIDTH, num_hidden_layers=args.layers).to(dtype)
        for f in TOKENIZER_FILES:
            if (base / f).exists():
                shutil.copy(base / f, path / f)
        disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        engine = LLMEngine(
            EngineConfig(
                model_path=str(path),
                dtype=args.dtype,
                max_num_seqs=max(batches),
                num_kv_pages=max(batches) * (PROMPT + args.tokens) // 16 + 64,
            )
        )
        loaded = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
        print(
            f"checkpoint on disk {disk / 2**30:.2f} GiB (MXFP4 experts); engine weights {loaded / 2**30:.2f} GiB "
            f"({args.dtype}, experts dequantised)",
            flush=True,
        )
        for rep in range(args.repeat):
            for batch in batches:
                sides = ("engine", "transformers") if rep % 2 == 0 else ("transformers", "engine")
                for side in sides:
                    rate = (
                        engine_decode(engine, batch, args.tokens, rep)
                        if side == "engine"
                        else hf_decode(hf, batch, args.tokens, rep)
                    )
                    best[side, batch] = max(best.get((side, batch), 0.0), rate)
                    runs.append({"rep": rep, "batch": batch, "side": side, "tok_s": round(rate, 2)})
                    print(f"rep {rep} batch {batch:3d} {side:13s} {rate:8.2f} tok/s", flush=True)
    print(f"\n{'batch':>5} {'engine':>8} {'transformers':>13} {'ratio':>6}")
    for batch in batches:
        ours, theirs = best["engine", batch], best["transformers", batch]
        print(f"{batch:5d} {ours:8.2f} {theirs:13.2f} {ours / theirs:6.2f}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpt_oss.json").write_text(
        json.dumps({"args": vars(args), "disk_bytes": disk, "loaded_bytes": loaded, "runs": runs}, indent=2)
    )


if __name__ == "__main__":
    main()
