"""Gemma 3 benchmark (CPU): a random-weight Gemma 3 text model of a small shape (Gemma 3 270M's layers, with the
default model's 49152-token vocabulary) served by our engine against transformers' generate on the same weights and
dtype, in one run.

    python bench/gemma.py [--layers 18] [--batches 1,64] [--tokens 32] [--repeat 2] [--dtype bfloat16]

Five sliding-window layers (window 512) to one global, as Gemma 3 ships. Figures: decode tokens/s at each batch
size, prefill excluded (bench/moe.py's engine_decode and hf_decode); the sides alternate --repeat times and each
keeps its best. Prints a table and writes bench/out/gemma.json.
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


def save_gemma3(args, folder: Path):
    """The random Gemma 3 in hub layout with the default model's tokenizer; returns it in transformers too."""
    import transformers as tf

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(args.layers)]
    config = tf.Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=types,
        max_position_embeddings=4096,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    base = Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, folder / name)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = p.parse_args()
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    best: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = save_gemma3(args, Path(tmp))
        engine = LLMEngine(
            EngineConfig(
                model_path=tmp,
                dtype=args.dtype,
                max_num_seqs=max(batches),
                num_kv_pages=max(batches) * (PROMPT + args.tokens) // 16 + 64,
            )
        )
        for rep in range(args.repeat):
            for batch in batches:
                for side in ("engine", "transformers"):
                    rate = (
                        hf_decode(hf, batch, args.tokens, rep)
                        if side == "transformers"
                        else engine_decode(engine, batch, args.tokens, rep)
                    )
                    best[side, batch] = max(best.get((side, batch), 0.0), rate)
                    print(f"rep {rep} batch {batch:3d} {side:12s} {rate:9.1f} tok/s", flush=True)
    rows = []
    print(f"\n{'batch':>5} {'engine':>9} {'transformers':>13} {'ratio':>6}")
    for batch in batches:
        ours, theirs = best["engine", batch], best["transformers", batch]
        rows.append(
            {
                "batch": batch,
                "engine_tok_s": round(ours, 1),
                "transformers_tok_s": round(theirs, 1),
                "ratio": round(ours / theirs, 2),
            }
        )
        print(f"{batch:5d} {ours:9.1f} {theirs:13.1f} {ours / theirs:6.2f}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemma.json").write_text(
        json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
