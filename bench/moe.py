"""MoE benchmark (CPU): a random-weight Qwen3-MoE served by our engine against transformers' generate on the same
weights and dtype, and against a dense Qwen3 with the same active parameters, in one run.

    python bench/moe.py [--hidden 1024] [--layers 8] [--experts 32] [--top-k 2] [--expert-size 768]
                        [--batches 1,64] [--tokens 32] [--repeat 2] [--dtype float32] [--threads N]

Figures: decode tokens/s at each batch size for the engine (MoE), transformers (MoE) and the engine (dense with
intermediate_size = top_k * expert_size, so the same active parameters per token), and the engine's decode step
time MoE / dense. Sides alternate --repeat times and each keeps its best (a shared machine drifts). Prompts are
16 random tokens, answers --tokens tokens (ignore_eos). Prints a table and writes bench/out/moe.json.
"""

from __future__ import annotations

import argparse
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
PROMPT = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_models(args, folder: Path) -> tuple[Path, Path, object]:
    """The MoE and the dense twin, random weights, with the default model's tokenizer; returns the MoE in
    transformers too (for generate)."""
    import transformers as tf

    base = Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"
    common = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=2,
    )
    configs = {
        "moe": tf.Qwen3MoeConfig(
            **common,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.expert_size,
            intermediate_size=args.expert_size,
            norm_topk_prob=True,
        ),
        "dense": tf.Qwen3Config(**common, intermediate_size=args.top_k * args.expert_size),
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
        if name == "moe":
            hf = model
        del model
    return paths["moe"], paths["dense"], hf


def engine_decode(engine, batch: int, tokens: int, seed: int) -> float:
    """Decode tokens/s once every request has its first token (prefill excluded)."""
    from engine.sample.params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for r in range(batch):
        engine.add_request(f"{seed}-{r}", torch.randint(3, 40000, (PROMPT,), generator=gen).tolist(), params)
    started: set[str] = set()
    produced, start = 0, 0.0
    while engine.has_unfinished():
        for out in engine.step():
            if len(started) == batch:
                produced += len(out.outputs[0].token_ids)
            started.add(out.request_id)
        if len(started) == batch and not start:
            start = time.perf_counter()
    return produced / (time.perf_counter() - start)


def hf_decode(hf, batch: int, tokens: int, seed: int) -> float:
    """transformers generate: decode tokens/s as (N - 1) tokens per row over the time past the first token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40000, (batch, PROMPT), generator=gen)
    timings = []
    with torch.inference_mode():
        for n in (1, tokens):
            t0 = time.perf_counter()
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            timings.append(time.perf_counter() - t0)
    return batch * (tokens - 1) / (timings[1] - timings[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-size", type=int, default=768)
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
    best: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        moe_path, dense_path, hf = save_models(args, Path(tmp))
        engines = {
            name: LLMEngine(
                EngineConfig(
                    model_path=str(path),
                    dtype=args.dtype,
                    max_num_seqs=max(batches),
                    num_kv_pages=max(batches) * (PROMPT + args.tokens) // 16 + 64,
                )
            )
            for name, path in (("engine-moe", moe_path), ("engine-dense", dense_path))
        }
        for rep in range(args.repeat):
            for batch in batches:
                for side in ("engine-moe", "transformers-moe", "engine-dense"):
                    if side == "transformers-moe":
                        rate = hf_decode(hf, batch, args.tokens, rep)
                    else:
                        rate = engine_decode(engines[side], batch, args.tokens, rep)
                    best[side, batch] = max(best.get((side, batch), 0.0), rate)
                    print(f"rep {rep} batch {batch:3d} {side:17s} {rate:9.1f} tok/s", flush=True)
    rows = []
    print(f"\n{'batch':>5} {'engine MoE':>11} {'hf MoE':>9} {'engine dense':>13} {'MoE/hf':>7} {'step MoE/dense':>15}")
    for batch in batches:
        moe, hf_rate, dense = (best[s, batch] for s in ("engine-moe", "transformers-moe", "engine-dense"))
        rows.append(
            {
                "batch": batch,
                "engine_moe_tok_s": round(moe, 1),
                "transformers_moe_tok_s": round(hf_rate, 1),
                "engine_dense_tok_s": round(dense, 1),
                "moe_over_transformers": round(moe / hf_rate, 2),
                "moe_step_over_dense_step": round(dense / moe, 2),
            }
        )
        print(f"{batch:5d} {moe:11.1f} {hf_rate:9.1f} {dense:13.1f} {moe / hf_rate:7.2f} {dense / moe:15.2f}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe.json").write_text(
        json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
