"""MLA benchmark (CPU): a random-weight DeepSeek-V3-shaped decoder (multi-head latent attention, dense MLPs) served by
our engine, against transformers' generate on the same weights and dtype, and against the same decoder with full
heads (a Llama twin: one K and V head per query head, head_dim = v_head_dim) in our engine, in one run.

    python bench/mla.py [--hidden 1024] [--layers 8] [--heads 8] [--kv-lora-rank 256] [--rope-dim 32]
                        [--batches 1,64] [--tokens 32] [--repeat 2] [--dtype float32] [--threads N]

Figures: KV bytes per token (every layer, the engine's own page sizing) for both engines and for DeepSeek-V3's real
shape; decode tokens/s at each batch size for the engine (MLA), transformers (MLA) and the engine (full heads).
Sides alternate --repeat times and each keeps its best (a shared machine drifts). Prompts are 16 random tokens,
answers --tokens tokens (ignore_eos). Prints a table and writes bench/out/mla.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.moe import PROMPT, TOKENIZER_FILES, engine_decode, hf_decode  # noqa: E402

HEAD_DIM = 128  # qk_nope + qk_rope of the MLA model, and the head_dim of its full-heads twin


def save_models(args, folder: Path) -> tuple[Path, Path, object]:
    """The MLA model and its full-heads twin, random weights, with the default model's tokenizer; returns the MLA
    model in transformers too (for generate)."""
    import os

    import transformers as tf

    base = Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"
    common = dict(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        vocab_size=49152,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=2,
    )
    configs = {
        "mla": tf.DeepseekV3Config(
            **common,
            num_key_value_heads=args.heads,
            q_lora_rank=args.hidden * 3 // 8,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=HEAD_DIM - args.rope_dim,
            qk_rope_head_dim=args.rope_dim,
            v_head_dim=HEAD_DIM,
            first_k_dense_replace=args.layers,  # every layer dense: the two sides differ in attention only
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
        ),
        "full": tf.LlamaConfig(**common, num_key_value_heads=args.heads, head_dim=HEAD_DIM),
    }
    paths, hf = {}, None
    for name, config in configs.items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype)).eval()
        config.architectures = [type(model).__name__]
        paths[name] = folder / name
        model.save_pretrained(paths[name])
        for f in TOKENIZER_FILES:
            if (base / f).exists():
                shutil.copy(base / f, paths[name] / f)
        if name == "mla":
            hf = model
        del model
    return paths["mla"], paths["full"], hf


def kv_bytes_per_token(engine) -> int:
    """Bytes one token holds across every layer's pages, from the engine's own KV groups and dtype."""
    from engine.core.kv.sizing import page_bytes

    groups, page = engine.spec.kv_groups, engine.config.page_size
    return sum(page_bytes(groups, page, engine.kv_dtype)) // page


def deepseek_v3_values_per_token() -> tuple[int, int]:
    """DeepSeek-V3's values per token per layer: its latent (512 + 64) against full heads (128 heads of K and V at
    128 values each, the figure the issue quotes)."""
    return 512 + 64, 2 * 128 * 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-lora-rank", type=int, default=256)
    p.add_argument("--rope-dim", type=int, default=32)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    sides = ("engine-mla", "transformers-mla", "engine-full")
    best: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        mla_path, full_path, hf = save_models(args, Path(tmp))
        engines = {
            name: LLMEngine(
                EngineConfig(
                    model_path=str(path),
                    dtype=args.dtype,
                    max_num_seqs=max(batches),
                    num_kv_pages=max(batches) * (PROMPT + args.tokens) // 16 + 64,
                )
            )
            for name, path in (("engine-mla", mla_path), ("engine-full", full_path))
        }
        kv_bytes = {name: kv_bytes_per_token(engine) for name, engine in engines.items()}
        for rep in range(args.repeat):
            for batch in batches:
                for side in sides:
                    if side == "transformers-mla":
                        rate = hf_decode(hf, batch, args.tokens, rep)
                    else:
                        rate = engine_decode(engines[side], batch, args.tokens, rep)
                    best[side, batch] = max(best.get((side, batch), 0.0), rate)
                    print(f"rep {rep} batch {batch:3d} {side:17s} {rate:9.1f} tok/s", flush=True)
    latent, full = deepseek_v3_values_per_token()
    print(
        f"\nKV bytes per token: MLA {kv_bytes['engine-mla']:,}, full heads {kv_bytes['engine-full']:,} "
        f"({kv_bytes['engine-full'] / kv_bytes['engine-mla']:.2f}x); DeepSeek-V3 per layer: {latent} vs {full} values "
        f"({full / latent:.1f}x)"
    )
    rows = []
    print(f"{'batch':>5} {'engine MLA':>11} {'hf MLA':>9} {'engine full':>12} {'MLA/hf':>7} {'MLA/full':>9}")
    for batch in batches:
        mla, hf_rate, full_rate = (best[s, batch] for s in sides)
        rows.append(
            {
                "batch": batch,
                "engine_mla_tok_s": round(mla, 1),
                "transformers_mla_tok_s": round(hf_rate, 1),
                "engine_full_tok_s": round(full_rate, 1),
                "mla_over_transformers": round(mla / hf_rate, 2),
                "mla_over_full": round(mla / full_rate, 2),
            }
        )
        print(f"{batch:5d} {mla:11.1f} {hf_rate:9.1f} {full_rate:12.1f} {mla / hf_rate:7.2f} {mla / full_rate:9.2f}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "threads": torch.get_num_threads(), "kv_bytes_per_token": kv_bytes, "rows": rows}
    (out / "mla.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
