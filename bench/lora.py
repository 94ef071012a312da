"""CPU benchmark: the cost of LoRA adapters on decode, against the base model, in one run.

    python bench/lora.py [--dtypes float32,bfloat16] [--rank 16] [--repeat 2] [--tokens 32]

One engine per dtype holds 8 random adapters (rank --rank, on all seven projections: the most work an adapter
can add); a second engine of the same dtype has none. Decode tokens/s (prefill excluded) of batch 1 and batch 64
for: the engine without adapters ("no-lora"), the LoRA engine's base model (rows with no adapter), and 1, 4 and 8
distinct adapters spread over the batch. Configurations alternate, --repeat times, each keeping its best figure
(a shared VM drifts between fast and slow periods). Prints a table and writes bench/out/lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_engine import model_path, prompts  # noqa: E402

ADAPTERS = [f"a{i}" for i in range(8)]
PROMPT_TOKENS = 16
# (label, batch size, distinct adapters; 0: base rows on the LoRA engine, None: the engine without adapters)
CONFIGS = [
    ("no-lora", 1, None),
    ("base", 1, 0),
    ("1 adapter", 1, 1),
    ("no-lora", 64, None),
    ("base", 64, 0),
    ("1 adapter", 64, 1),
    ("4 adapters", 64, 4),
    ("8 adapters", 64, 8),
]


def write_adapters(folder: Path, rank: int) -> dict[str, str]:
    from transformers import AutoConfig

    from engine.model.adapters import projection_shapes
    from tests.lora_adapters import ALL_TARGETS, write_adapter

    config = AutoConfig.from_pretrained(model_path())
    for i, name in enumerate(ADAPTERS):
        write_adapter(
            folder / name,
            projection_shapes(config),
            config.num_hidden_layers,
            targets=ALL_TARGETS,
            rank=rank,
            alpha=2.0 * rank,
            seed=i,
            std=0.02,
        )
    return {name: str(folder / name) for name in ADAPTERS}


def decode_rate(engine, batch: int, distinct: int | None, tokens: int, seed: int) -> float:
    """Decode tokens/s of `batch` requests, request i on adapter i % distinct; prefill steps are not timed."""
    from engine.sample.params import SamplingParams

    # Short prompts: the prefill is not what is measured, and on a 2-core VM it would dominate the run.
    for i, ids in enumerate(p[:PROMPT_TOKENS] for p in prompts(engine.tokenizer, batch, seed)):
        adapter = ADAPTERS[i % distinct] if distinct else None
        engine.add_request(
            f"r{seed}-{i}", ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, adapter=adapter)
        )
    start, produced = None, 0
    while engine.has_unfinished():
        outputs = engine.step()
        decoding = all(g.seqs[0].output_token_ids for g in engine.scheduler.running) and not engine.scheduler.waiting
        if start is None and decoding:
            start = time.perf_counter()  # every request has its first token: decode steps from here
            continue
        if start is not None:
            produced += sum(len(d.token_ids) for out in outputs for d in out.outputs)
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    from engine.config import EngineConfig, LoraConfig
    from engine.core.engine import LLMEngine

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(Path(tmp), args.rank)
        for dtype in args.dtypes.split(","):
            common = dict(model_path=model_path(), dtype=dtype, device="cpu", max_num_seqs=64, max_model_len=1024)
            engines = {
                True: LLMEngine(EngineConfig(**common, lora=LoraConfig(adapters, 8, args.rank))),
                False: LLMEngine(EngineConfig(**common)),
            }
            best: dict[str, float] = {}
            for round_ in range(args.repeat):
                for label, batch, distinct in CONFIGS:
                    engine = engines[distinct is not None]
                    rate = decode_rate(engine, batch, distinct, args.tokens, seed=round_)
                    key = f"batch {batch}, {label}"
                    best[key] = max(best.get(key, 0.0), rate)
                    print(f"{dtype} round {round_ + 1}: {key}: {rate:.1f} tok/s", flush=True)
            results[dtype] = best
    print("\n| dtype | configuration | decode tok/s | vs no-lora |\n|---|---|---|---|")
    for dtype, best in results.items():
        for key, rate in best.items():
            base = best[key.split(",")[0] + ", no-lora"]
            print(f"| {dtype} | {key} | {rate:.1f} | {rate / base:.2f} |")
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "lora.json").write_text(
        json.dumps({"rank": args.rank, "tokens": args.tokens, "threads": os.cpu_count(), "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
