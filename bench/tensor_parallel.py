"""Decode step time at TENSOR_PARALLEL_SIZE=2 against one rank, on a random Llama big enough to be bound by memory
bandwidth (float32), each side in its own subprocess, alternating; with rank 0's share of the step spent in
collectives (all-reduce, broadcast, gather: time waiting for the other rank included).

On a 2-core VM: TP=2 runs one thread a rank, TP=1 two threads (the same cores either way).

    python bench/tensor_parallel.py [--repeat 2] [--layers 4] [--hidden 2048] [--batch 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(path: Path, layers: int, hidden: int) -> None:
    import torch
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(str(path))
    baked = ROOT / ".models" / "model"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((baked / name).read_bytes())


def side(path: str, tp: int, batch: int, steps: int) -> dict:
    """One engine: decode steps of `batch` requests, timed after the prefill; rank 0's time in collectives."""
    import torch.distributed as dist

    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.sample.params import SamplingParams

    spent = [0.0]
    for name in ("all_reduce", "broadcast", "gather"):
        original = getattr(dist, name)

        def timed(*a, _f=original, **kw):
            t = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(dist, name, timed)
    engine = LLMEngine(
        EngineConfig(model_path=path, dtype="float32", num_kv_pages=256, tensor_parallel_size=tp, cpu_threads=2 // tp)
    )
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9, 10, 11, 12], params)
    engine.step()  # the prefill
    engine.step()
    spent[0], start = 0.0, time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - start) / steps
    engine.close()
    return {"tp": tp, "batch": batch, "step_ms": 1000 * step_s, "collective_share": spent[0] / steps / step_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--side", nargs=3, help=argparse.SUPPRESS)  # path tp batch: run one side, print JSON
    args = ap.parse_args()
    if args.side:
        print(json.dumps(side(args.side[0], int(args.side[1]), int(args.side[2]), args.steps)))
        return
    with tempfile.TemporaryDirectory() as folder:
        build(Path(folder), args.layers, args.hidden)
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()}")
        for r in range(args.repeat):
            for batch in [int(b) for b in args.batch.split(",")]:
                for tp in (1, 2):
                    out = subprocess.run(
                        [sys.executable, __file__, "--steps", str(args.steps), "--side", folder, str(tp), str(batch)],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        env={**os.environ, "PYTHONPATH": str(ROOT)},
                    )
                    if out.returncode:
                        raise SystemExit(out.stderr[-2000:])
                    print(f"run {r} " + out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
