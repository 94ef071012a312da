"""Sustained load on a running worker: N concurrent streaming clients with mixed parameters for a while.

    python bench/load.py --base-url http://127.0.0.1:8000 --pid <worker pid> --duration 600 --clients 64

Each client loops over a fixed set of request kinds (greedy chat and completions, n > 1, stop strings,
logprobs, long and short prompts sharing one long prefix, seeded sampling) and aborts one request in ten
midway. Every greedy answer is compared with the same request run alone before the load starts. Reports
requests, aborts, mismatches, p50/p99 time to first token, generated tokens/s, the worker's RSS over time
and whether every KV page is free at the end, as one JSON object (the properties the slow test asserts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PREFIX = (
    "You are a careful assistant for a shipping company. Answer questions about parcels, routes and "
    "schedules clearly. " * 12
)
QUESTIONS = [
    "Where is my parcel?",
    "How long does delivery to Paris take?",
    "Can I change the address?",
    "What does 'in transit' mean?",
    "Do you ship on Sundays?",
    "How heavy can a parcel be?",
]


@dataclass
class Kind:
    """One request shape: the route, its body, and whether its output is deterministic (compared with solo)."""

    name: str
    route: str
    body: dict[str, Any]
    greedy: bool = True


def kinds(model: str) -> list[Kind]:
    out = []
    for i, question in enumerate(QUESTIONS):
        long = i % 2 == 0
        content = (PREFIX if long else "") + question
        messages = [{"role": "user", "content": content}]
        out.append(
            Kind(
                f"chat-{i}",
                "/openai/v1/chat/completions",
                {"model": model, "messages": messages, "max_tokens": 24 + 8 * i, "temperature": 0},
            )
        )
    out += [
        Kind(
            "n3",
            "/openai/v1/chat/completions",
            {
                "model": model,
                "n": 3,
                "max_tokens": 16,
                "temperature": 0,
                "messages": [{"role": "user", "content": QUESTIONS[0]}],
            },
        ),
        Kind(
            "stop",
            "/openai/v1/completions",
            {
                "model": model,
                "prompt": PREFIX + "Q: Do you ship on Sundays?\nA:",
                "max_tokens": 40,
                "temperature": 0,
                "stop": ["\n", "."],
            },
        ),
        Kind(
            "logprobs",
            "/openai/v1/chat/completions",
            {
                "model": model,
                "max_tokens": 16,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 3,
                "messages": [{"role": "user", "content": PREFIX + QUESTIONS[1]}],
            },
        ),
        Kind(
            "completion",
            "/openai/v1/completions",
            {"model": model, "prompt": "The parcel arrived", "max_tokens": 32, "temperature": 0, "ignore_eos": True},
        ),
        Kind(
            "sampled",
            "/openai/v1/chat/completions",
            {
                "model": model,
                "max_tokens": 24,
                "temperature": 0.9,
                "top_p": 0.9,
                "messages": [{"role": "user", "content": QUESTIONS[2]}],
            },
            greedy=False,
        ),
    ]
    return out


@dataclass
class Stats:
    requests: int = 0
    aborted: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0


async def stream_once(
    http: httpx.AsyncClient, kind: Kind, abort_after: int | None = None
) -> tuple[dict[int, str], float | None, int, bool]:
    """(text by choice, time to first token, completion tokens, aborted) of one streamed request."""
    body = {**kind.body, "stream": True, "stream_options": {"include_usage": True}}
    texts: dict[int, str] = {}
    first: float | None = None
    tokens, chunks = 0, 0
    started = time.monotonic()
    async with http.stream("POST", kind.route, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{kind.name}: HTTP {reply.status_code} {(await reply.aread())[:200]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{kind.name}: {chunk['error']}")
            if chunk.get("usage") and not chunk.get("choices"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                if piece:
                    first = first if first is not None else time.monotonic() - started
                    texts[choice["index"]] = texts.get(choice["index"], "") + piece
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                return texts, first, tokens, True
    return texts, first, tokens, False


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


async def run_load(
    base_url: str, model: str, duration_s: float, clients: int, pid: int | None = None, seed: int = 0
) -> dict[str, Any]:
    rng = random.Random(seed)
    all_kinds = kinds(model)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:
        solo = {k.name: (await stream_once(http, k))[0] for k in all_kinds if k.greedy}
        stats = Stats()
        rss: list[tuple[float, float | None]] = [(0.0, rss_mb(pid))]
        start = time.monotonic()
        deadline = start + duration_s

        async def client(i: int) -> None:
            local = random.Random(rng.random())
            while time.monotonic() < deadline:
                kind = local.choice(all_kinds)
                abort_after = local.randint(1, 6) if local.random() < 0.1 else None
                try:
                    texts, first, tokens, aborted = await stream_once(http, kind, abort_after)
                except Exception as exc:  # recorded: the test asserts there are none
                    stats.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                stats.requests += 1
                stats.aborted += aborted
                stats.tokens += tokens
                if first is not None:
                    stats.ttft.append(first)
                if kind.greedy and not aborted and texts != solo[kind.name]:
                    stats.mismatches.append(f"{kind.name}: {texts!r} != {solo[kind.name]!r}"[:300])

        async def sample_rss() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(min(10.0, max(duration_s / 20, 1.0)))
                rss.append((time.monotonic() - start, rss_mb(pid)))

        await asyncio.gather(sample_rss(), *(client(i) for i in range(clients)))
        elapsed = time.monotonic() - start
        await asyncio.sleep(1.0)  # aborted requests' pages are freed before the next engine step
        engine = (await http.get("/health")).json()["engine"]
    ttft = sorted(stats.ttft)
    settled = [mb for t, mb in rss if mb is not None and t >= duration_s * 0.5]  # the second half of the run
    return {
        "clients": clients,
        "duration_s": round(elapsed, 1),
        "requests": stats.requests,
        "aborted": stats.aborted,
        "errors": stats.errors[:10],
        "num_errors": len(stats.errors),
        "mismatches": stats.mismatches[:10],
        "num_mismatches": len(stats.mismatches),
        "tokens_per_s": round(stats.tokens / elapsed, 1),
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], 3) if ttft else None,
        "rss_mb": [(round(t), round(mb, 1)) for t, mb in rss if mb is not None],
        "rss_growth_second_half_mb": round(max(settled) - min(settled), 1) if settled else None,
        "kv_pages_free": engine["kv_pages_free"],
        "kv_pages": engine["kv_pages"],
        "preemptions": engine.get("preemptions"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first one /openai/v1/models lists")
    parser.add_argument("--pid", type=int, default=None, help="the worker's process id, for its RSS")
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--clients", type=int, default=64)
    args = parser.parse_args()
    model = args.model or httpx.get(f"{args.base_url}/openai/v1/models").json()["data"][0]["id"]
    print(json.dumps(asyncio.run(run_load(args.base_url, model, args.duration, args.clients, args.pid)), indent=1))


if __name__ == "__main__":
    main()
