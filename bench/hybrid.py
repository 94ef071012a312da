"""Hybrid benchmark (CPU): a random-weight hybrid (Qwen3.5's Gated DeltaNet, or a Mamba2 hybrid: Nemotron-H,
Granite 4.0-H, Falcon-H1) served by our engine against transformers' generate on the same weights and dtype, the
memory a sequence holds against a dense model of the same shape, and the prefix cache on a second chat turn, in one
run.

    python bench/hybrid.py [--family qwen3_5] [--hidden 1024] [--layers N] [--batches 1,64] [--tokens 32]
                           [--turn 300] [--repeat 2] [--dtype float32] [--threads N]

--family picks the shape (FAMILIES: the release each mirrors and what was shrunk); --layers defaults to the
family's. Before timing, the engine's greedy tokens on 4 random prompts are compared with transformers' (printed).

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
Prints tables and writes bench/out/hybrid.json (qwen3_5) or bench/out/hybrid-<family>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = 16
VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

from bench.moe import engine_decode, hf_decode  # noqa: E402

# NVIDIA-Nemotron-Nano-9B-v2's hybrid_override_pattern (M Mamba2, * attention, - relu^2 MLP): 56 blocks, 4 attention.
NEMOTRON_NANO_9B_V2 = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"


def granite_layer_types(layers: int) -> list[str]:
    """Granite-4.0-H-Tiny's layer types (40 layers, attention at 5, 15, 25 and 35, Mamba2 elsewhere), the first
    `layers`."""
    return ["attention" if i % 10 == 5 else "mamba" for i in range(layers)]


@dataclass(frozen=True, kw_only=True)
class Family:
    """A hybrid the bench builds: its transformers model type, the release it mirrors and what was shrunk (for the
    record), its config at --hidden / --layers, and its dense twin's attention layers (every mixer attention)."""

    model_type: str
    mirrors: str
    layers: int  # the default --layers
    config: Callable[[int, int], dict]  # (hidden, layers) -> config keywords
    dense_layers: Callable[[dict], int]  # config keywords -> the dense twin's attention layers


def qwen3_5_shape(hidden: int, layers: int) -> dict:
    return dict(
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=2,
        head_dim=256,
        intermediate_size=int(3.5 * hidden),
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=40960,
    )


def nemotron_h_shape(hidden: int, layers: int) -> dict:
    return dict(
        hybrid_override_pattern=NEMOTRON_NANO_9B_V2[:layers],
        num_attention_heads=hidden // 128,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=int(3.5 * hidden),
        mamba_num_heads=hidden // 32,
        mamba_head_dim=64,
        n_groups=8,
        ssm_state_size=128,
        conv_kernel=4,
        chunk_size=128,
        max_position_embeddings=40960,
        # Untied, as the release: transformers' NemotronH keeps its own lm_head even when the config ties it,
        # where the engine (and every other family in transformers) would use the embedding.
        tie_word_embeddings=False,
    )


def granitemoehybrid_shape(hidden: int, layers: int) -> dict:
    return dict(
        num_hidden_layers=layers,
        layer_types=granite_layer_types(layers),
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 256,
        intermediate_size=hidden // 4,
        shared_intermediate_size=hidden,
        num_local_experts=32,
        num_experts_per_tok=6,
        mamba_n_heads=hidden // 32,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=128,
        mamba_d_conv=4,
        mamba_chunk_size=256,
        position_embedding_type="nope",
        max_position_embeddings=40960,
    )


def falcon_h1_shape(hidden: int, layers: int) -> dict:
    return dict(
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=2 * hidden,
        mamba_d_ssm=3 * hidden // 2,
        mamba_n_heads=3 * hidden // 128,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=128,
        mamba_d_conv=4,
        mamba_chunk_size=128,
        max_position_embeddings=40960,
    )


FAMILIES = {
    "qwen3_5": Family(
        model_type="qwen3_5_text",
        mirrors="Qwen3.5-0.8B's layer shapes (head_dim 256, 16 + 16 DeltaNet heads of 128, every fourth layer "
        "attention), fewer layers",
        layers=8,
        config=qwen3_5_shape,
        dense_layers=lambda c: c["num_hidden_layers"],
    ),
    "nemotron_h": Family(
        model_type="nemotron_h",
        mirrors="NVIDIA-Nemotron-Nano-9B-v2: the first --layers blocks of its pattern (16: M-M-M-MM-M-M-M*-, "
        "8 Mamba2, 1 attention, 7 MLP); hidden 4480 -> --hidden, 40/8 heads -> hidden/128 and 2 (head_dim 128 "
        "kept), Mamba2 128 heads of 80 -> hidden/32 of 64 (8 groups, state 128 kept), MLP 3.5x hidden kept, "
        "untied as the release",
        layers=16,
        config=nemotron_h_shape,
        dense_layers=lambda c: sum(b in "M*" for b in c["hybrid_override_pattern"]),
    ),
    "granitemoehybrid": Family(
        model_type="granitemoehybrid",
        mirrors="Granite-4.0-H-Tiny: the first --layers of its layer types (8: attention at 5, Mamba2 elsewhere); "
        "hidden 1536 -> --hidden, 12/4 heads -> hidden/128 and hidden/256 (head_dim 128 kept), 64 experts top-6 "
        "of 512 -> 32 top-6 of hidden/4, shared MLP 1024 -> hidden, Mamba2 48 heads of 64 -> hidden/32 of 64 "
        "(1 group, state 128 kept), no positions as the release",
        layers=8,
        config=granitemoehybrid_shape,
        dense_layers=lambda c: c["num_hidden_layers"],
    ),
    "falcon_h1": Family(
        model_type="falcon_h1",
        mirrors="Falcon-H1-0.5B: its proportions at --hidden (the release's 1024: 8/2 heads of 64, Mamba2 d_ssm "
        "1536 = 24 heads of 64, state 128, MLP 2048), 36 layers -> --layers, the muP multipliers left at 1; "
        "attention and Mamba2 side by side in every layer, so the dense twin is the same attention without the "
        "Mamba2 half",
        layers=8,
        config=falcon_h1_shape,
        dense_layers=lambda c: c["num_hidden_layers"],
    ),
}


def shape(args) -> dict:
    """The family's config keywords at --hidden / --layers, with the default model's vocabulary, tied unless the
    family says otherwise."""
    family = FAMILIES[args.family]
    common = dict(hidden_size=args.hidden, vocab_size=VOCAB, tie_word_embeddings=True, eos_token_id=2)
    return {**common, **family.config(args.hidden, args.layers)}


def save_model(args, folder: Path):
    import transformers as tf

    base = Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"
    config = tf.AutoConfig.for_model(FAMILIES[args.family].model_type, **shape(args))
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
    layers, two state slots) and a dense twin's (every mixer an attention layer of the same KV shape)."""
    spec = engine.spec
    kv_per_token = spec.kv_groups[0].values_per_token * 2  # K and V, bf16, one layer
    attention_layers = sum(len(g.layers) for g in spec.kv_groups)
    dense_layers = FAMILIES[args.family].dense_layers(shape(args))
    state = 2 * spec.recurrent.slot_bytes(torch.bfloat16)
    rows = []
    for context in (1024, 8192, 32768):
        hybrid = attention_layers * kv_per_token * context + state
        dense = dense_layers * kv_per_token * context
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


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
        None if len(a) == len(b) else min(len(a), len(b)),
    )


def greedy_check(engine, hf, tokens: int) -> dict:
    """The engine's greedy tokens against transformers' generate on the same 4 random 16-token prompts."""
    from engine.sample.params import SamplingParams

    ids = torch.randint(3, 40000, (4, PROMPT), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        want = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )[:, PROMPT:].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for r in range(len(ids)):
        engine.add_request(f"greedy-{r}", ids[r].tolist(), params)
    got: dict[str, list[int]] = {f"greedy-{r}": [] for r in range(len(ids))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.outputs[0].token_ids
    same = [got[f"greedy-{r}"] == want[r] for r in range(len(ids))]
    first = [first_difference(got[f"greedy-{r}"], want[r]) for r in range(len(ids))]
    return {"prompts": len(ids), "tokens": tokens, "equal": sum(same), "first_difference": first}


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
    assert first is not None, f"{request_id} ended without a token"
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
    p.add_argument("--family", default="qwen3_5", choices=sorted(FAMILIES))
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the family's, see FAMILIES)")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--turn", type=int, default=300)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    args.layers = args.layers or FAMILIES[args.family].layers
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
        greedy = greedy_check(engine, hf, args.tokens)
        print(f"greedy tokens equal transformers': {greedy}", flush=True)
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
    name = "hybrid.json" if args.family == "qwen3_5" else f"hybrid-{args.family}.json"
    (out / name).write_text(
        json.dumps(
            {
                "args": vars(args),
                "mirrors": FAMILIES[args.family].mirrors,
                "greedy": greedy,
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
