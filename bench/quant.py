"""INT4 checkpoints on CPU, side by side: AWQ and GPTQ checkpoints of the default model's shape served by this worker
against its bf16 bake and against llama.cpp's llama-server on the Q4_1 GGUF the default model comes from.

    python bench/quant.py [--clients 1,64] [--repeat 2] [--tokens 128] [--sides bf16,awq,gptq,llama]

The AWQ and GPTQ folders are written from the default model's own weights (round-to-nearest, 4 bits, zero points
for AWQ, symmetric for GPTQ, in each format's packed layout, lm_head and embeddings left in float as both tools
leave them), then baked by `python -m builder` like any hub folder. Groups are 64 inputs: the model's hidden size
576 is no multiple of the formats' usual 128. Each side's server runs alone and the sides alternate `--repeat`
times; every run is printed, kept in bench/out/quant.json, and each side's best goes in the table with the bytes of
weights its engine holds (parameters and buffers; llama-server: the GGUF file).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import OURS, run_sides  # noqa: E402
from builder.sources import default_gguf_path  # noqa: E402

GROUP = 64
FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def bf16_bake() -> Path:
    return Path(os.environ.get("BASE_PATH", ROOT / ".models")) / "model"


def quantized_bake(kind: str, out: Path) -> Path:
    """The default model's weights in `kind` ("awq" or "gptq"), baked; reused when already there."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.engine.model.quant_writers import PROJECTIONS, awq_tensors, gptq_tensors

    baked = out / kind / "model"
    if (baked / "manifest.json").exists():
        return baked
    source = out / kind / "source"
    shutil.rmtree(out / kind, ignore_errors=True)
    source.mkdir(parents=True)
    base = bf16_bake()
    tensors = load_file(base / "model.safetensors")
    for name in list(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS:
            weight = tensors.pop(name).float()
            packed, _ = awq_tensors(weight, GROUP) if kind == "awq" else gptq_tensors(weight, GROUP, symmetric=True)
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
        elif tensors[name].is_floating_point():
            tensors[name] = tensors[name].to(torch.float16)  # as AutoAWQ / AutoGPTQ save the rest
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config["dtype"] = "float16"
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}
        if kind == "awq"
        else {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    )
    (source / "config.json").write_text(json.dumps(config, indent=2))
    for name in FOLDER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "builder",
            "--model",
            str(source),
            "--out",
            str(baked),
            "--served-name",
            f"smollm2-{kind}",
        ],
        cwd=ROOT,
        check=True,
    )
    return baked


def weight_bytes(model_path: Path) -> int:
    """Bytes of the parameters and buffers the engine holds for this bake (serving dtype, DTYPE=auto)."""
    code = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from engine.core.llm import LLM
from worker.settings import load_settings
llm = LLM({str(model_path)!r}, dtype=load_settings().dtype, max_model_len=256)
model = llm.engine.runner.model
tensors = list(model.parameters()) + list(model.buffers())
print(json.dumps(sum(t.numel() * t.element_size() for t in {{id(t): t for t in tensors}}.values())))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,64")
    parser.add_argument("--sides", default="bf16,awq,gptq,llama")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    levels, sides = [int(c) for c in args.clients.split(",")], args.sides.split(",")
    out = ROOT / "bench" / "out"
    paths = {"bf16": bf16_bake(), **{k: quantized_bake(k, out / "quant") for k in ("awq", "gptq") if k in sides}}
    sizes = {side: weight_bytes(path) for side, path in paths.items()}
    sizes["llama"] = default_gguf_path().stat().st_size
    print(json.dumps({"weight_bytes": sizes}), flush=True)
    for side, path in paths.items():
        OURS[side] = {"MODEL_PATH": str(path)}
    runs = run_sides(sides, levels, args.repeat, args.tokens, out)
    (out / "quant.json").write_text(json.dumps({"weight_bytes": sizes, "runs": runs}, indent=2))
    best = {}
    for run in runs:
        key = (run["side"], run["clients"])
        best[key] = max(best.get(key, 0.0), run["tok_s"])
    print("\n| side | weights, MiB | " + " | ".join(f"{c} clients, tok/s (x llama-server)" for c in levels) + " |")
    print("|---" * (len(levels) + 2) + "|")
    for side in sides:
        cells = [
            f"{best[(side, c)]:.1f} ({best[(side, c)] / best[('llama', c)]:.2f}x)"
            if ("llama", c) in best
            else f"{best[(side, c)]:.1f}"
            for c in levels
        ]
        print(f"| {side} | {sizes[side] / 2**20:.1f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
