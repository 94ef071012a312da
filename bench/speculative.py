"""Speculative decoding on CPU: tokens/s with and without n-gram lookup, on a repetitive and a free-form workload.

    python bench/speculative.py [--clients 1,8,64] [--repeat 2] [--tokens 128] [--sides plain,ngram,ngram-always]

Each side runs the engine (the default model, DTYPE auto) in its own subprocess and prints one JSON line per
workload and number of clients: generated tokens/s over the level's wall time, and the acceptance rate and mean
accepted length of its proposals. 1 client runs 4 requests one after another; N clients N requests at once.
Workloads: "repeat" asks the model to repeat or lightly edit a paragraph given in the prompt (where prompt lookup
finds the answer in the prompt); "free" asks short open questions. Greedy, so every side generates the same
tokens. Sides: `plain` (no speculation), `ngram` (k=4, n 2..4, off above 8 decoding sequences: the default when the
figures in bench/RESULTS.md were taken; it is 4 now) and
`ngram-always` (never turned off: where speculation stops paying). The sides alternate `--repeat` times; every
run is printed and kept in bench/out/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARAGRAPHS = [
    "The town council met on Tuesday evening to discuss the new library. After a long debate, the members agreed "
    "to fund the building, to open it six days a week, and to hire two more librarians for the children's room.",
    "Our weekly report: the team shipped the new search page, fixed eleven bugs in the checkout flow, and started "
    "work on the mobile app. Next week we will test the app with ten customers and write the release notes.",
    "To make the bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes, "
    "let it rise for two hours, shape it into a loaf, and bake it at two hundred degrees for forty minutes.",
    "The museum is open from nine in the morning until five in the afternoon. Tickets cost twelve euros for "
    "adults and six euros for students. Guided tours start every hour at the main entrance near the shop.",
]
ASKS = [
    "Repeat this text exactly:\n{}",
    "Rewrite this text, changing nothing but replacing 'ten' with 'twelve':\n{}",
    "Copy this text word for word:\n{}",
    "Repeat the following paragraph:\n{}",
]
QUESTIONS = [
    "Tell me about the ocean.",
    "Write a short story about a cat.",
    "Explain how trains work.",
    "Describe a walk in the forest.",
    "What makes a good breakfast?",
    "Tell me about the moon.",
]
SIDES = {
    "plain": None,
    "ngram": {"method": "ngram", "disable_by_batch_size": 8},
    "ngram-always": {"method": "ngram", "disable_by_batch_size": 10**6},
}


def model_path() -> str:
    base = os.environ.get("BASE_PATH", str(ROOT / ".models"))
    return os.environ.get("MODEL_PATH", os.path.join(base, "model"))


def messages(workload: str, i: int) -> str:
    if workload == "repeat":
        return ASKS[i % len(ASKS)].format(PARAGRAPHS[(i // len(ASKS) + i) % len(PARAGRAPHS)])
    return QUESTIONS[i % len(QUESTIONS)]


def side_main(side: str, levels: list[int], tokens: int) -> None:
    """One side, in its own process: every workload and level, one JSON line each."""
    from engine.config import EngineConfig, SpeculativeConfig
    from engine.core.engine import LLMEngine
    from engine.sample.params import SamplingParams

    spec = SIDES[side]
    engine = LLMEngine(
        EngineConfig(model_path=model_path(), max_num_seqs=64, speculative=SpeculativeConfig(**spec) if spec else None)
    )
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=tokens)

    def prompt(workload: str, i: int) -> list[int]:
        text = f"<|im_start|>user\n{messages(workload, i)}<|im_end|>\n<|im_start|>assistant\n"
        return tok.encode(text)

    def drain() -> int:
        generated = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    generated += out.num_generated_tokens
        return generated

    engine.add_request("warm", prompt("free", 0), SamplingParams(temperature=0.0, max_tokens=8))
    drain()
    for workload in ("repeat", "free"):
        for clients in levels:
            before = engine.stats()
            start, generated = time.perf_counter(), 0
            batches = [[i] for i in range(4)] if clients == 1 else [list(range(clients))]
            for batch in batches:
                for i in batch:
                    engine.add_request(f"{workload}-{clients}-{i}", prompt(workload, i), params)
                generated += drain()
            wall = time.perf_counter() - start
            after = engine.stats()
            proposed = after.get("spec_proposed_tokens", 0) - before.get("spec_proposed_tokens", 0)
            accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
            verifies = after.get("spec_verify_steps", 0) - before.get("spec_verify_steps", 0)
            print(
                json.dumps(
                    {
                        "side": side,
                        "workload": workload,
                        "clients": clients,
                        "tokens": generated,
                        "wall_s": round(wall, 2),
                        "tokens_per_s": round(generated / wall, 1),
                        "acceptance": round(accepted / proposed, 3) if proposed else None,
                        "proposed": proposed,
                        "accepted": accepted,
                        "verify_steps": verifies,
                    }
                ),
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,8,64")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--sides", default="plain,ngram,ngram-always")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    if args.side:
        side_main(args.side, levels, args.tokens)
        return 0
    runs = []
    for round_ in range(1, args.repeat + 1):
        for side in args.sides.split(","):
            cmd = [sys.executable, __file__, "--side", side, "--clients", args.clients, "--tokens", str(args.tokens)]
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
            for line in out.stdout.strip().splitlines():
                runs.append({"round": round_, **json.loads(line)})
                print(json.dumps(runs[-1]), flush=True)
    out_dir = ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "speculative.json").write_text(json.dumps(runs, indent=2))
    print_table(runs)
    return 0


def print_table(runs: list[dict]) -> None:
    """Every run as a markdown row (with the load average where the runs have it)."""
    load = all("load" in r for r in runs)
    print("| round | side | workload | clients | tokens/s | acceptance | tokens |" + (" load |" if load else ""))
    print("|---" * (8 if load else 7) + "|")
    for r in runs:
        acc = "" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        print(
            f"| {r['round']} | {r['side']} | {r['workload']} | {r['clients']} | {r['tokens_per_s']} | {acc} | "
            f"{r['tokens']} |" + (f" {r['load']:.2f} |" if load else "")
        )


if __name__ == "__main__":
    sys.exit(main())
