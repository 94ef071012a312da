"""Per-step cost of the repetition, frequency and presence penalties on a long context (CPU).

    python bench/penalties.py [--batch 8] [--prompt 512] [--output 4096] [--vocab 49152] [--steps 50]

Grows `batch` rows to `output` generated tokens one token a step (as decode does; not timed), then times process_logits
on the last `steps` steps and prints the median (and best) milliseconds a step, with every penalty on, with
frequency/presence only, and with none (the masks-free floor: a float32 copy of the logits). Rows carry the sequence's
running counts when SamplingRow has them (engine/sample/penalties.py), so the same script measures the code before and
after that change.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.sample.logits_processor import SamplingRow, process_logits  # noqa: E402
from engine.sample.params import SamplingParams  # noqa: E402


def measure(batch: int, prompt: int, output: int, vocab: int, steps: int, **penalties: float) -> tuple[float, float]:
    """(median, best) milliseconds a step."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, **penalties)
    prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(batch)]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    stateful = "penalties" in {f.name for f in dataclasses.fields(SamplingRow)}
    states = []
    if stateful:
        from engine.sample.penalties import PenaltyCounts

        states = [PenaltyCounts() for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    times: list[float] = []
    for step in range(output):
        rows = [
            SamplingRow(
                params=params,
                prompt_token_ids=prompts[i],
                output_token_ids=outputs[i],
                **({"penalties": states[i]} if stateful else {}),
            )
            for i in range(batch)
        ]
        timed = step >= output - steps
        start = time.perf_counter()
        if timed or stateful:  # the counts must see every step; the old code has nothing to keep up
            process_logits(logits, rows)
        if timed:
            times.append(time.perf_counter() - start)
        for out in outputs:
            out.append(rng.randrange(vocab))
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="one is steadier on a shared VM")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = (args.batch, args.prompt, args.output, args.vocab, args.steps)
    cases = {
        "all three": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
        "frequency+presence": dict(frequency_penalty=0.5, presence_penalty=0.3),
        "none": {},
    }
    for name, kw in cases.items():
        median, best = measure(*shape, **kw)
        print(
            f"{name:>20}: {median:8.3f} ms/step median, {best:8.3f} best  (batch {args.batch}, prompt {args.prompt}, "
            f"output {args.output}, vocab {args.vocab})"
        )


if __name__ == "__main__":
    main()
