"""CPU benchmark of structured outputs: the per-step cost of grammar constraints, and grammar compile times.

    python bench/structured.py [--dtype bfloat16] [--batches 1,64] [--steps 48] [--threads 2]

Decode steps: two engines on the baked default model live in one process, each with B requests decoding
(B from --batches): one unconstrained, one with every request under its own JSON schema (64 distinct
schemas whose grammars cannot end within the measured steps). Once both are past their prefills, the
script alternates one step of each, `--steps` times: a shared VM drifts between fast and slow periods,
and each pair of steps meets the same period. It reports the median step of each side, the median of the
per-pair ratios, and the grammar's own work per step (mask fill, mask apply, token accept; timed apart,
as the VM's noise hits the whole step far more). Mask apply: ours against xgrammar's CPU kernel, on one
64-row batch. Compiles: each of the 64 schemas compiled once (a cache miss) and asked for again (a cache
hit) through the engine's GrammarCache, after one warm-up compile that also builds the tokenizer's token
table (timed apart). Every step is written to bench/out/structured.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine import LLMEngine  # noqa: E402
from engine.sample.params import SamplingParams  # noqa: E402
from engine.sample.structured.compiler import GrammarCache  # noqa: E402
from engine.sample.structured.spec import StructuredSpec  # noqa: E402

QUICK = os.environ.get("BENCH_QUICK") == "1"
WORDS = ["invoice", "sensor", "ticket", "order", "flight", "patient", "parcel", "album"]
# Seconds spent in the grammar's own work, summed by `timed` below.
GRAMMAR_TIME = [0.0]


def schema(i: int) -> dict:
    """Distinct per i; `minItems` keeps the grammar open for hundreds of tokens (the steps must all decode)."""
    word = WORDS[i % len(WORDS)]
    item = {
        "type": "object",
        "properties": {
            f"{word}_id": {"type": "integer", "minimum": 0, "maximum": 10 ** (3 + i % 4)},
            f"{word}_label_{i}": {"type": "string", "maxLength": 8 + i % 16},
            "status": {"enum": ["new", "open", "closed", f"state{i}"]},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": [f"{word}_id", f"{word}_label_{i}", "status", "score"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "source": {"type": "string", "maxLength": 20},
            f"{word}s": {"type": "array", "items": item, "minItems": 40 + i, "maxItems": 200},
        },
        "required": ["source", f"{word}s"],
        "additionalProperties": False,
    }


def prompt_ids(tokenizer, i: int) -> list[int]:
    messages = [
        {
            "role": "user",
            "content": f"List {WORDS[i % len(WORDS)]} records as JSON with this schema: {json.dumps(schema(i))}",
        }
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def timed(fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            GRAMMAR_TIME[0] += time.perf_counter() - t

    return wrapper


def instrument() -> None:
    import engine.sample.logits_processor as processor
    from engine.sample.structured.matcher import GrammarState

    processor.grammar_bitmask = timed(processor.grammar_bitmask)
    processor.apply_bitmask = timed(processor.apply_bitmask)
    GrammarState.accept = timed(GrammarState.accept)


def start(engine: LLMEngine, batch: int, constrained: bool, steps: int) -> list[str]:
    """Adds `batch` requests and steps until each has its first token (prefill and compiles done)."""
    ids = []
    for i in range(batch):
        spec = StructuredSpec.json_schema(schema(i), "bench") if constrained else None
        params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 64, ignore_eos=True, structured=spec)
        ids.append(f"{batch}-{i}")
        engine.add_request(ids[-1], prompt_ids(engine.tokenizer, i), params)
    started: set[str] = set()
    while len(started) < batch:
        started |= {out.request_id for out in engine.step()}
        assert not engine.pop_failures()
    return ids


def step(engine: LLMEngine, batch: int) -> float:
    t = time.perf_counter()
    outputs = engine.step()
    elapsed = time.perf_counter() - t
    assert len(outputs) == batch and not any(o.finished for o in outputs), "a request left the batch"
    return elapsed


def paired_steps(plain: LLMEngine, grammar: LLMEngine, batch: int, steps: int) -> dict:
    runs = {"batch": batch, "plain_ms": [], "grammar_ms": [], "grammar_work_ms": []}
    ids = [start(plain, batch, False, steps), start(grammar, batch, True, steps)]
    for k in range(steps + 4):
        a = step(plain, batch)
        GRAMMAR_TIME[0] = 0.0
        b = step(grammar, batch)
        if k >= 4:  # the first steps of a new batch shape are warm-up
            runs["plain_ms"].append(a * 1e3)
            runs["grammar_ms"].append(b * 1e3)
            runs["grammar_work_ms"].append(GRAMMAR_TIME[0] * 1e3)
    for engine, request_ids in zip((plain, grammar), ids, strict=True):
        for request_id in request_ids:
            engine.abort(request_id)
    return runs


def compile_times(engine: LLMEngine, count: int) -> dict:
    cache = GrammarCache(
        tokenizer=engine.tokenizer, vocab_size=engine.spec.vocab_size, stop_token_ids=sorted(engine.spec.eos_token_ids)
    )
    t = time.perf_counter()
    cache.get(StructuredSpec(kind="regex", value="warm-up", param="bench"))
    first_ever = time.perf_counter() - t
    miss, hit = [], []
    for i in range(count):
        t = time.perf_counter()
        cache.get(StructuredSpec.json_schema(schema(i), "bench"))
        miss.append(time.perf_counter() - t)
        t = time.perf_counter()
        cache.get(StructuredSpec.json_schema(schema(i), "bench"))
        hit.append(time.perf_counter() - t)
    cache.shutdown()
    return {
        "token_table_and_first_compile_s": first_ever,
        "miss_ms": [m * 1e3 for m in miss],
        "hit_ms": [h * 1e3 for h in hit],
    }


def apply_times(vocab: int, rows: int = 64, reps: int = 20) -> dict:
    """One batch's mask applied to [rows, vocab] float32 logits: ours (torch ops) against xgrammar's CPU kernel,
    for rows that allow almost nothing (a grammar between tokens) and almost everything (inside a string)."""
    import torch
    import xgrammar as xgr

    from engine.sample.structured.bitmask import apply_bitmask

    words = (vocab + 31) // 32
    sparse = torch.zeros((rows, words), dtype=torch.int32)
    sparse[:, :4] = -1
    dense = torch.full((rows, words), -1, dtype=torch.int32)
    dense[:, :4] = 0
    logits = torch.randn(rows, vocab)
    every = list(range(rows))
    times: dict = {}
    for _ in range(reps):
        for kind, bitmask in (("sparse", sparse), ("dense", dense)):
            for name, apply in (
                ("torch_ops", lambda x, b=bitmask: apply_bitmask(x, b, every)),
                (
                    "xgrammar_cpu_kernel",
                    lambda x, b=bitmask: xgr.apply_token_bitmask_inplace(x, b, vocab_size=vocab, backend="cpu"),
                ),
            ):
                x = logits.clone()
                t = time.perf_counter()
                apply(x)
                times.setdefault(f"{name}_{kind}_ms", []).append((time.perf_counter() - t) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=6 if QUICK else 48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    instrument()
    base = os.environ.get("BASE_PATH", str(ROOT / ".models"))
    batches = [int(b) for b in args.batches.split(",")]
    config = EngineConfig(
        model_path=os.environ.get("MODEL_PATH", os.path.join(base, "model")),
        dtype=args.dtype,
        max_num_seqs=max(batches),
        max_num_batched_tokens=4096,
        num_kv_pages=2048,
    )
    plain, grammar = LLMEngine(config), LLMEngine(config)
    result: dict = {"dtype": args.dtype, "threads": args.threads, "steps": args.steps, "batches": []}
    for batch in batches:
        runs = paired_steps(plain, grammar, batch, args.steps)
        result["batches"].append(runs)
        ratios = [b / a for a, b in zip(runs["plain_ms"], runs["grammar_ms"], strict=True)]
        p, g = statistics.median(runs["plain_ms"]), statistics.median(runs["grammar_ms"])
        work = statistics.median(runs["grammar_work_ms"])
        print(
            f"batch {batch:3d}: unconstrained median {p:7.2f} ms/step (min {min(runs['plain_ms']):.2f}), "
            f"constrained median {g:7.2f} ms/step (min {min(runs['grammar_ms']):.2f}); median of per-pair "
            f"ratios {statistics.median(ratios):.3f}, min/min {min(runs['grammar_ms']) / min(runs['plain_ms']):.3f}; "
            f"grammar work median {work:.2f} ms/step = {work / p:.1%} of the unconstrained median step",
            flush=True,
        )
    result["apply"] = a = apply_times(plain.spec.vocab_size)
    print(
        f"mask apply, 64 x {plain.spec.vocab_size} float32, min (median) ms: "
        + ", ".join(f"{name.removesuffix('_ms')} {min(v):.2f} ({statistics.median(v):.2f})" for name, v in a.items())
    )
    result["compile"] = c = compile_times(plain, 8 if QUICK else 64)
    print(
        f"token table + first compile: {c['token_table_and_first_compile_s']:.2f} s; per schema: miss median "
        f"{statistics.median(c['miss_ms']):.1f} ms (min {min(c['miss_ms']):.1f}, max {max(c['miss_ms']):.1f}); "
        f"hit median {statistics.median(c['hit_ms']) * 1e3:.0f} us (max {max(c['hit_ms']) * 1e3:.0f})"
    )
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "structured.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
