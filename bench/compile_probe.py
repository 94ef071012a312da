"""Does `torch.compile` (Inductor's CPU code generation) speed up the batch-1 bf16 decode step?

    TORCH_LOGS=recompiles,graph_breaks python bench/compile_probe.py {eager,static,dynamic} [--tokens 40]

Compiles the model's forward inside the offline engine (the packed oneDNN linears are left out: Inductor
cannot lower them, and with `freezing` it packs the weights itself) and times every engine step of one greedy
request. `static` compiles for exact shapes, `dynamic` with symbolic ones. Prints the first steps (which
include compiling) and the median of the last ten. Figures and the diagnosis: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["eager", "static", "dynamic"])
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    import torch

    import engine.model.loader
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.sample.params import SamplingParams

    if args.mode != "eager":
        import torch._inductor.config as inductor

        engine.model.loader.pack_linears_for_cpu = lambda model: 0
        inductor.freezing = True
    path = os.environ.get("MODEL_PATH", str(Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"))
    llm = LLMEngine(EngineConfig(model_path=path, dtype="bfloat16", num_kv_pages=64, max_num_seqs=4))
    if args.mode != "eager":
        model = llm.runner.model
        model.forward = torch.compile(model.forward, dynamic=args.mode == "dynamic")
    llm.add_request(
        "probe",
        llm.tokenizer.encode("The ocean is"),
        SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True),
    )
    steps = []
    while llm.has_unfinished():
        started = time.perf_counter()
        llm.step()
        steps.append(time.perf_counter() - started)
    tail = 1000 * statistics.median(steps[-10:])
    print(
        f"{args.mode}: {len(steps)} steps in {sum(steps):.1f} s; first steps (ms) "
        f"{[round(1000 * s) for s in steps[:6]]}; median of the last ten {tail:.1f} ms",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
