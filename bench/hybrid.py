"""Hybrid (Qwen3.5-shaped) benchmark (CPU): a random-weight Qwen3.5 served by our engine against transformers'
generate on the same weights and dtype, the memory a sequence holds against a dense model of the same shape, and
the prefix cache on a second chat turn, in one run.

    python bench/hybrid.py [--hidden 1024] [--layers 8] [--batches 1,64] [--tokens 32] [--turn 300]
                           [--repeat 2] [--dtype float32] [--threads N]

Figures:
- decode tokens/s at each batch size, prefill excluded, 16 random prompt tokens, --tokens answer tokens
  (ignore_eos), after an untimed warm-up of each side, engine and transformers alternating --repeat times, every
  run printed and the best kept;
- bytes one sequence holds at 1k, 8k and 32k tokens of context in bf16: the hybrid's pages (its full-attention
  layers) plus its two state slots (its own and one prefix snapshot), against a dense model of the same shape whose
  every layer attends over pages;
- the batch-1 roofline: the bytes of weights a decode step reads (every parameter once, the tied embedding as the
  lm_head) over the read bandwidth measured in the same run (the best of a few sums over a buffer of that size),
  so that the batch-1 figures read as a share of what the memory allows either side;
- a second chat turn: turn one is --turn random tokens and a 32-token answer; turn two repeats both and adds 40
  tokens. Its time to first token after turn one was served (the prefix cache holds the pages and a state
  snapshot at a page boundary) against the same prompt with no turn one before it, alternating, and the share of
  its prompt served from the cache.
Prints tables and writes bench/out/hybrid.json.
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
VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

from bench.moe import engine_decode, hf_decode  # noqa: E402


def shape(args) -> dict:
    """Qwen3.5-0.8B's layer shapes (head_dim 256, 16 + 16 DeltaNet heads of 128, every fourth layer attention), fewer
    layers and the default model's vocabulary."""
    return dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=2,
        head_dim=256,
        intermediate_size=int(3.5 * args.hidden),
        vocab_size=VOCAB,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        eos_token_id=2,
    )


def save_model(args, folder: Path):
    import transformers as tf

    base = Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"
    config = tf.AutoConfig.for_model("qwen3_5_text", **shape(args))
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype)).eval()
    config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    for f in TOKENIZER_FILES:
        if (base / f).exists():
            shutil.copy(base / f, folder / f)
    return model


def memory_per_sequence(engine, args) -> list[dict]:
    """Bytes of one sequence's cache in bf16 at several context lengths: the hybrid's (pages of its attention
    layers, two state slots) and a dense twin's (every layer's pages)."""
    spec, s = engine.spec, shape(args)
    kv_per_token = 2 * s["num_key_value_heads"] * s["head_dim"] * 2  # K and V, bf16, one layer
    attention_layers = sum(len(g.layers) for g in spec.kv_groups)
    state = 2 * spec.recurrent.slot_bytes(torch.bfloat16)
    rows = []
    for context in (1024, 8192, 32768):
        hybrid = attention_layers * kv_per_token * context + state
        dense = s["num_hidden_layers"] * kv_per_token * context
        rows.append(
            {
                "context": context,
                "hybrid_mib": round(hybrid / 2**20, 1),
                "dense_mib": round(dense / 2**20, 1),
                "state_mib": round(state / 2**20, 1),
                "dense_over_hybrid": round(dense / hybrid, 2),
            }
        )
    return rows


def read_bandwidth(nbytes: int) -> float:
    """Bytes/s of the best of five sums over a float32 buffer of nbytes (a bf16 sum converts as it reads, which
    costs more than the read): what a step bound by reading weights can reach."""
    buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def roofline(hf) -> dict:
    """Batch-1 decode tokens/s if a step cost only reading its weights once at the measured bandwidth. The weights
    are counted on the transformers model (a tied embedding once, read as the lm_head)."""
    nbytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    bandwidth = read_bandwidth(nbytes)
    return {
        "weight_mib": round(nbytes / 2**20, 1),
        "read_gb_s": round(bandwidth / 1e9, 2),
        "batch1_roofline_tok_s": round(bandwidth / nbytes, 1),
    }


def first_token_seconds(engine, prompt: list[int], request_id: str) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens served from the prefix cache) of one request run alone."""
    from engine.sample.params import SamplingParams

    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first, cached = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first, cached = time.perf_counter() - start, out.num_cached_tokens
    return first, cached


def second_turn(engine, args, rep: int) -> dict:
    from engine.sample.params import SamplingParams

    gen = torch.Generator().manual_seed(100 + rep)
    turn1 = torch.randint(3, VOCAB, (args.turn,), generator=gen).tolist()
    other = torch.randint(3, VOCAB, (args.turn,), generator=gen).tolist()
    engine.add_request(f"t1-{rep}", turn1, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    answer = []
    while engine.has_unfinished():
        for out in engine.step():
            answer += out.outputs[0].token_ids
    extra = torch.randint(3, VOCAB, (40,), generator=gen).tolist()
    order = ("warm", "cold") if rep % 2 == 0 else ("cold", "warm")  # alternating which goes first
    prompts = {"warm": turn1 + answer + extra, "cold": other + answer + extra}
    got = {side: first_token_seconds(engine, prompts[side], f"{side}-{rep}") for side in order}
    (warm, cached), (cold, cold_cached) = got["warm"], got["cold"]
    prompt = len(turn1) + len(answer) + len(extra)
    return {
        "rep": rep,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 3),
        "ttft_warm_ms": round(warm * 1e3, 1),
        "ttft_cold_ms": round(cold * 1e3, 1),
        "cold_cached_tokens": cold_cached,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--turn", type=int, default=300)
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
    runs, turns, roofs = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        hf = save_model(args, Path(tmp))
        pages = max(batches) * (PROMPT + args.tokens) // 16 + 2 * (args.turn + 128) // 16 + 64
        engine = LLMEngine(
            EngineConfig(model_path=tmp, dtype=args.dtype, max_num_seqs=max(batches), num_kv_pages=pages)
        )
        # Untimed: the first steps of each side pay one-time costs (oneDNN's kernel set-up, allocator growth).
        engine_decode(engine, 2, 4, -1)
        hf_decode(hf, 2, 4, -1)
        for rep in range(args.repeat):
            for batch in batches:
                for side in ("engine", "transformers"):
                    rate = (
                        engine_decode(engine, batch, args.tokens, rep)
                        if side == "engine"
                        else hf_decode(hf, batch, args.tokens, rep)
                    )
                    best[side, batch] = max(best.get((side, batch), 0.0), rate)
                    runs.append({"rep": rep, "batch": batch, "side": side, "tok_s": round(rate, 1)})
                    print(f"rep {rep} batch {batch:3d} {side:12s} {rate:9.1f} tok/s", flush=True)
            turns.append(second_turn(engine, args, rep))
            roofs.append(roofline(hf))
            print(f"rep {rep} roofline {roofs[-1]}", flush=True)
            print(f"rep {rep} second turn {turns[-1]}", flush=True)
        memory = memory_per_sequence(engine, args)
    rows = []
    print(f"\n{'batch':>5} {'engine':>9} {'transformers':>13} {'ratio':>6}")
    for batch in batches:
        ours, theirs = best["engine", batch], best["transformers", batch]
        rows.append(
            {
                "batch": batch,
                "engine_tok_s": round(ours, 1),
                "transformers_tok_s": round(theirs, 1),
                "engine_over_transformers": round(ours / theirs, 2),
            }
        )
        print(f"{batch:5d} {ours:9.1f} {theirs:13.1f} {ours / theirs:6.2f}")
    top = max(r["batch1_roofline_tok_s"] for r in roofs)
    print(f"batch-1 roofline (weights once at the best measured read bandwidth): {top:.1f} tok/s")
    print(f"\n{'context':>7} {'hybrid MiB':>11} {'dense MiB':>10} {'dense/hybrid':>13}")
    for m in memory:
        print(f"{m['context']:7d} {m['hybrid_mib']:11.1f} {m['dense_mib']:10.1f} {m['dense_over_hybrid']:13.2f}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "threads": torch.get_num_threads(),
                "runs": runs,
                "decode": rows,
                "memory": memory,
                "second_turn": turns,
                "roofline": roofs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
