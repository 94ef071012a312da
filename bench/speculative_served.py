"""Speculative decoding served, side by side with llama.cpp's llama-server: tokens/s and acceptance per workload.

    python bench/speculative_served.py [--clients 1,8,64] [--repeat 2] [--tokens 64]
                                       [--sides ours,ours-ngram,llama,llama-ngram,...]

Both servers serve the default model (ours its bake, `handler.py --serve`; llama-server the Q4_1 GGUF it was baked from,
as bench/serving.py starts it) and are driven by the same client: the official `openai` SDK streaming chat completions,
greedy. Workloads as bench/speculative.py's: "repeat" (repeat or lightly edit a paragraph given in the prompt; the model
ends by itself after it) and "free" (short open questions, `max_tokens` forced with `ignore_eos`). 1 client runs 8
requests one after another; N clients max(8, N) requests, N at a time. Sides: `ours` (no speculation), `ours-ngram`
(`SPECULATIVE_CONFIG={"method": "ngram"}`: the defaults), `ours-ngram-always` (the same, never turned off by the batch
size: where speculation stops paying), `llama` (no speculation), `llama-ngram` (llama-server's own n-gram speculation,
`--spec-type ngram-simple` with its defaults) and `llama-ngram-k4` (the same with a lookup and a draft shaped as ours).
Acceptance: ours from the engine's counters in /health before and after a level, llama-server's from the `timings` of
its last stream chunk. One server at a time, the sides alternating `--repeat` times; every run is printed and kept in
bench/out/speculative_served.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import server  # noqa: E402
from bench.speculative import messages, print_table  # noqa: E402

NGRAM = {"SPECULATIVE_CONFIG": json.dumps({"method": "ngram"})}
NGRAM_ALWAYS = {"SPECULATIVE_CONFIG": json.dumps({"method": "ngram", "disable_by_batch_size": 10**6})}
# llama-server's prompt-and-output n-gram lookup: as its user turns it on (its defaults: a 12-token lookup, up to 48
# drafted), and shaped as ours (a 3-token lookup, 4 drafted; ours looks up 4 down to 2 tokens and drafts 4).
LLAMA_NGRAM = ("--spec-type", "ngram-simple")
LLAMA_NGRAM_K4 = (*LLAMA_NGRAM, "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4")
SIDES = {
    "ours": ("ours", {}, ()),
    "ours-ngram": ("ours", NGRAM, ()),
    "ours-ngram-always": ("ours", NGRAM_ALWAYS, ()),
    "llama": ("llama", {}, ()),
    "llama-ngram": ("llama", {}, LLAMA_NGRAM),
    "llama-ngram-k4": ("llama", {}, LLAMA_NGRAM_K4),
}


async def one_request(client, model: str, workload: str, index: int, tokens: int) -> dict:
    usage, timings, text_chunks = None, None, 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": messages(workload, index)}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": workload == "free"},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        timings = (chunk.model_extra or {}).get("timings") or timings
        if chunk.choices and chunk.choices[0].delta.content:
            text_chunks += 1
    drafted = (timings or {}).get("draft_n", 0)
    return {
        "tokens": usage if usage is not None else text_chunks,
        "drafted": drafted,
        "accepted": (timings or {}).get("draft_n_accepted", 0),
        "end": time.perf_counter(),
    }


async def run_level(base: str, model: str, workload: str, clients: int, tokens: int) -> dict:
    import httpx2
    from openai import AsyncOpenAI, DefaultAsyncHttpx2Client

    # a connection per request, as bench/serving.py (llama-server sometimes drops a kept-alive one)
    http = DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_keepalive_connections=0))
    client = AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600, http_client=http)
    queue = list(range(max(8, clients)))[::-1]
    results = []

    async def worker():
        while queue:
            results.append(await one_request(client, model, workload, queue.pop(), tokens))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    await client.close()
    generated = sum(r["tokens"] for r in results)
    return {
        "workload": workload,
        "clients": clients,
        "tokens": generated,
        "tokens_per_s": round(generated / (max(r["end"] for r in results) - started), 1),
        "proposed": sum(r["drafted"] for r in results),
        "accepted": sum(r["accepted"] for r in results),
    }


def engine_counts(port_base: str) -> tuple[int, int]:
    """Ours: the speculator's proposed and accepted token counters from /health (zeros without speculation)."""
    root = port_base.split("/openai/")[0]
    engine = httpx.get(f"{root}/health", timeout=10).json().get("engine", {})
    return engine.get("spec_proposed_tokens", 0), engine.get("spec_accepted_tokens", 0)


def run_side(side: str, levels: list[int], tokens: int, out_dir: Path) -> list[dict]:
    kind, env, args = SIDES[side]
    runs = []
    with server(kind, out_dir, extra_env=env, extra_args=args) as (base, model, _):
        asyncio.run(run_level(base, model, "free", 1, 8))  # warm-up, not counted
        for workload in ("repeat", "free"):
            for clients in levels:
                before = engine_counts(base) if kind == "ours" else (0, 0)
                result = asyncio.run(run_level(base, model, workload, clients, tokens))
                if kind == "ours":
                    after = engine_counts(base)
                    result.update(proposed=after[0] - before[0], accepted=after[1] - before[1])
                result["acceptance"] = round(result["accepted"] / result["proposed"], 3) if result["proposed"] else None
                runs.append({"side": side, **result})
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,8,64")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sides", default=",".join(SIDES))
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    out_dir = ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_ in range(1, args.repeat + 1):
        for side in args.sides.split(","):
            for run in run_side(side, levels, args.tokens, out_dir):
                runs.append({"round": round_, **run, "load": os.getloadavg()[0]})
                print(json.dumps(runs[-1]), flush=True)
    (out_dir / "speculative_served.json").write_text(json.dumps(runs, indent=2))
    print_table(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
